"""The cluster in a box on a REAL control plane: Kubernetes 1.20.2's own API server, scheduler
and controller-manager over etcd (fleet/testing/k8s/kube.py), with hollow nodes that run their
pods (the box's process kubelet, fleet/testing/k8s/podrunner.py, speaking to the real API server
as each node: fleet/testing/k8s/kubelet_api.py). A TEST STAND-IN for the nodes only.

Real: admission (ServiceAccount, NodeRestriction, RuntimeClass, ...), RBAC and Node
authorization for every component of the chart, the Deployment -> ReplicaSet -> Pod and DaemonSet
controllers, the scheduler's placement (taints, node selectors, resource fit), the endpoints and
garbage-collector controllers, service-account tokens; the chart installed, upgraded and
uninstalled by the real ``helm`` (v4). Stand-ins: the kubelet (containers are local processes in
their own mount namespace, as in the box), each GPU node's device plugin and fake NVML
(fleet/testing/k8s/box.py `NODE_SHAPES`, the same four nodes) with its kubelet's PodResources
socket (fleet/testing/k8s/podresources.py), no kube-proxy (Service ClusterIPs do
not answer) and no cluster DNS. Pod addresses are 10.244.x.y (`POD_NETWORKS`), a range bound on
``lo`` while the cluster runs (a real API server refuses loopback addresses in Endpoints).

Owns `RealClusterInABox` (the same surface the journey uses on `ClusterInABox`: ``kube``,
``nodes``, ``kubelet``, `list`, `get`, `helm_install`, `helm_uninstall`, `preload_image`,
`inject_xid`, `leftovers`, `denied`). Called by tests/integration/test_real_cluster_journey.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import yaml

from fleet.inventory.gfd import image_aliases
from fleet.k8s.client import NODES, ApiError, KubeClient, Resource
from fleet.testing.fake_nvml import inject_xid
from fleet.testing.k8s.box import NODE_SHAPES, node_object, prepare_node
from fleet.testing.k8s.hollow import heartbeat
from fleet.testing.k8s.kube import RealControlPlane
from fleet.testing.k8s.kubelet import ImagePuller
from fleet.testing.k8s.kubelet_api import ServerKubeletApi
from fleet.testing.k8s.podconfig import REPO, BoxNode
from fleet.testing.k8s.podresources import PodResourcesServer, serve_pod_resources
from fleet.testing.k8s.podrunner import BoxKubelet

POD_NETWORKS = ("10.244", *(f"10.{b}" for b in range(246, 255)))
"""The first two octets of the pod networks a cluster may take (10.245 is the real node's bridge,
fleet/testing/k8s/realnode.py): the first that no other cluster of this machine holds is bound on
``lo`` as a /16 while the cluster runs, so every address in it is local and a pod can bind it."""

KEPT_IN_NAMESPACE = {("ServiceAccount", "default"), ("ConfigMap", "kube-root-ca.crt")}
"""What Kubernetes itself keeps in every namespace (plus the default ServiceAccount's token Secret)."""


class RealClusterInABox:
    """See the module docstring. ``plane``: a started `RealControlPlane` made with a token for
    each node of `NODE_SHAPES` (``nodes=NODE_NAMES``); ``work``: a directory of its own (node
    roots, pod logs); ``helm``: the helm binary."""

    NODE_NAMES = tuple(shape.name for shape in NODE_SHAPES)

    def __init__(self, plane: RealControlPlane, work: Path, helm: str,
                 image: str = "ghcr.io/inference-fleet/fleet:0.1.0") -> None:  # fmt: skip
        self.plane = plane
        self.work = work
        self.helm = helm
        self.image = image
        self.kube: KubeClient = plane.client()
        self.nodes: dict[str, BoxNode] = {}
        self.kubelet: BoxKubelet | None = None
        self.pod_resources: dict[str, PodResourcesServer] = {}   # GPU node -> its kubelet's PodResources
        self._clients: dict[str, KubeClient] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._network_added = False
        self.pod_network = ""   # bound on lo by `start` (`POD_NETWORKS`)

    # ----- life ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the pod network, register the nodes as themselves, start their heartbeats, device
        health and the kubelet. Raises ApiError when the API server refuses a node, RuntimeError
        when no pod network can be bound."""
        self._bind_pod_network()
        for shape in NODE_SHAPES:
            node = prepare_node(shape, self.work / "nodes" / shape.name)
            self.nodes[shape.name] = node
            if node.plugin is not None:
                self.pod_resources[shape.name] = serve_pod_resources(node)
            client = self._clients[shape.name] = self.plane.client(self.plane.tokens[f"system:node:{shape.name}"])
            await client.create(NODES, None, node_object(shape, node.plugin))
            self._tasks.append(asyncio.create_task(heartbeat(client, shape.name, self._stop, interval_s=5.0)))
        api = ServerKubeletApi(self._clients)
        port = urlparse(self.plane.url).port or 443
        self.kubelet = BoxKubelet(api, self.nodes, self.work, token_for=self._token, ca_pem=self.plane.ca_file.read_bytes(),
                                  api_port=port, puller=ImagePuller(),
                                  pod_subnet=self.pod_network.rsplit(".", 2)[0])  # fmt: skip
        self.kubelet.start()
        self._tasks.append(asyncio.create_task(self._device_health()))

    async def stop(self) -> None:
        """Stop the kubelet (every container killed), the heartbeats, and unbind the pod network."""
        self._stop.set()
        if self.kubelet is not None:
            await self.kubelet.stop()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for server in self.pod_resources.values():
            server.stop()
        for c in [*self._clients.values(), self.kube]:
            c.close()
        if self._network_added:
            subprocess.run(["ip", "addr", "del", self.pod_network, "dev", "lo"], capture_output=True)

    def _bind_pod_network(self) -> None:
        """Take the first of `POD_NETWORKS` that ``lo`` does not hold (another cluster of this
        machine may run at the same time). Raises RuntimeError with ``ip``'s words when none can be
        bound."""
        held = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", "lo"], capture_output=True, text=True).stdout
        errors = []
        for prefix in POD_NETWORKS:
            if f" {prefix}." in held:
                continue
            network = f"{prefix}.0.1/16"
            done = subprocess.run(["ip", "addr", "add", network, "dev", "lo"], capture_output=True, text=True)
            if done.returncode == 0:
                self.pod_network, self._network_added = network, True
                return
            errors.append(f"{network}: {done.stderr.strip()}")
        raise RuntimeError(f"no pod network could be bound on lo: {'; '.join(errors) or 'all are taken'}")

    def _token(self, namespace: str, service_account: str) -> str:
        """A ServiceAccount's token from its Secret (only asked for a pod whose spec mounts none)."""
        sa = self.get(Resource("", "v1", "serviceaccounts", "ServiceAccount"), namespace, service_account)
        for ref in sa.get("secrets") or []:
            secret = self.get(Resource("", "v1", "secrets", "Secret"), namespace, ref["name"])
            if "token" in (secret.get("data") or {}):
                return base64.b64decode(secret["data"]["token"]).decode()
        raise ApiError(404, "NotFound", f"no token Secret for serviceaccount {namespace}/{service_account} yet")

    async def _device_health(self) -> None:
        """Each GPU node's device plugin health loop: an unhealthy GPU leaves the Node's allocatable
        (patched as the node itself, as a kubelet does)."""
        while not self._stop.is_set():
            for name, node in self.nodes.items():
                if node.plugin is not None and node.plugin.refresh_health():
                    with contextlib.suppress(ApiError, OSError):
                        await self._clients[name].patch_status(NODES, None, name, {"status": {
                            "allocatable": node.plugin.allocatable()}})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 0.2)

    # ----- reading it ---------------------------------------------------------------------------

    def list(self, res: Resource, namespace: str | None, selector: str | None = None) -> tuple[list[dict], str]:
        """Objects and the list's resourceVersion, as the admin (blocking)."""
        query = [("labelSelector", selector)] if selector else []
        data = self.kube.request("GET", res.path(namespace), query=query)
        return data.get("items", []), data.get("metadata", {}).get("resourceVersion", "")

    def get(self, res: Resource, namespace: str | None, name: str) -> dict:
        """One object, as the admin (blocking). Raises NotFound."""
        return self.kube.request("GET", res.path(namespace, name))

    def leftovers(self, namespace: str) -> list[str]:
        """``Kind/name`` of every object left in ``namespace`` but what Kubernetes keeps there
        (`KEPT_IN_NAMESPACE`, the default ServiceAccount's token Secret), Events and Leases."""
        left = []
        for api_version, kinds in (("v1", None), ("apps/v1", None), ("rbac.authorization.k8s.io/v1", None),
                                   ("policy/v1beta1", None), ("networking.k8s.io/v1", None)):  # fmt: skip
            path = f"/api/{api_version}" if api_version == "v1" else f"/apis/{api_version}"
            for r in self.plane.get_json(path).get("resources", []):
                if "/" in r["name"] or not r["namespaced"] or "list" not in r.get("verbs", []):
                    continue
                if r["kind"] in ("Event", "Lease", "Endpoints", "Binding"):
                    continue
                group, _, version = api_version.rpartition("/")
                for obj in self.list(Resource(group, version, r["name"], r["kind"]), namespace)[0]:
                    name = obj["metadata"]["name"]
                    if (r["kind"], name) in KEPT_IN_NAMESPACE or (r["kind"] == "Secret" and name.startswith(
                            "default-token-")):  # fmt: skip
                        continue
                    left.append(f"{r['kind']}/{name}")
        return sorted(left)

    @property
    def denied(self) -> list[str]:
        """Lines of the pods' logs where the real API server refused a request (403 Forbidden):
        a Role of the chart that lacks a right (the real server keeps no list of refusals; the
        components log each one)."""
        found = []
        for log in sorted((self.work / "pods").glob("*/*.log")):
            for line in log.read_text(errors="replace").splitlines():
                if "forbidden" in line.lower() and ("403" in line or "is forbidden" in line):
                    found.append(f"{log.parent.name}/{log.name}: {line[:300]}")
        return found

    # ----- the chart, the nodes' images, faults ---------------------------------------------------

    def _helm(self, *args: str) -> subprocess.CompletedProcess:
        kubeconfig = self.plane.kubeconfig()
        done = subprocess.run([self.helm, *args, "--kubeconfig", str(kubeconfig)], capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args[:2])} failed: {done.stderr.strip()}")
        return done

    def helm_install(self, values: dict, namespace: str = "fleet", release: str = "fleet") -> None:
        """``helm install`` of charts/fleet with ``values`` into ``namespace`` (created). Raises
        RuntimeError with helm's stderr."""
        path = self.work / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        self._helm("install", release, str(REPO / "charts" / "fleet"), "-n", namespace, "--create-namespace",
                   "-f", str(path))  # fmt: skip

    def helm_upgrade(self, values: dict, namespace: str = "fleet", release: str = "fleet") -> None:
        """``helm upgrade`` of the release with ``values`` (all of them: nothing is reused)."""
        path = self.work / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        self._helm("upgrade", release, str(REPO / "charts" / "fleet"), "-n", namespace, "-f", str(path))

    def helm_uninstall(self, namespace: str = "fleet", release: str = "fleet") -> None:
        self._helm("uninstall", release, "-n", namespace)

    def preload_image(self, image: str) -> None:
        """Every node already holds ``image`` (its ``status.images``, written as the node)."""
        for name, client in self._clients.items():
            node = client.request("GET", NODES.path(None, name))
            images = list((node.get("status") or {}).get("images") or [])
            images.append({"names": [max(image_aliases(image), key=lambda n: (n.count("/"), len(n)))],
                           "sizeBytes": 2_000_000_000})
            client.request("PATCH", NODES.path(None, name, "status"), body={"status": {"images": images}},
                           content_type="application/merge-patch+json")  # fmt: skip

    def inject_xid(self, node: str, gpu_index: int, xid: int) -> str:
        """An Xid on GPU ``gpu_index`` of ``node``'s fake NVML; returns the GPU's UUID."""
        state = self.nodes[node].nvml_state
        assert state is not None, f"{node} has no GPUs"
        uuid = next(d["uuid"] for d in json.loads(state.read_text())["devices"] if d["index"] == gpu_index)
        inject_xid(state, uuid, xid)
        return uuid
