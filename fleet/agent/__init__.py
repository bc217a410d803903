"""The node agent: what one node knows and keeps for the controller.

One agent runs per node (inside `fleet up` on one machine; standalone as `fleet node-agent`, the
shape a Kubernetes DaemonSet runs). It owns:

- the weight cache (`fleet.agent.cache.WeightCache`): a content-addressed store of model files
  fetched from the sources in `fleet.sources` (local path / ``file://``, ``http(s)://``
  manifests, ``hf://org/name@revision``) into the store by `fleet.agent.cache_fill`, one file
  at a time by `fleet.agent.transfer` (resumable, verified, retried with tenacity) over the
  transports of `fleet.agent.transports`;
- GPU health (`fleet.agent.health.GpuHealthChecker` over `fleet.agent.nvml_health`, Xid
  classification in `fleet.agent.xid`) and the pure quarantine decision
  (`fleet.agent.quarantine.QuarantinePolicy`);
- the periodic runner with Prometheus metrics and the quarantine state file
  (`fleet.agent.runner.NodeAgent`);
- which pod holds which GPU, from the kubelet's PodResources API (`fleet.agent.pod_devices`,
  its proto in `fleet.agent.podresources_api`), for the node facts `fleet.k8s.node_facts`
  publishes and the weight-cache pins of departed pods (`fleet.agent.pins`).

Callers: `fleet.cli.agent` (``fleet cache``, ``fleet node-agent``); the controller integrates
through the interfaces described in docs/node-agent.md. Nothing here imports the controller.
"""
