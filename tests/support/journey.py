"""The user's journey on a cluster, from `helm install` of the chart AS RENDERED to uninstall with
nothing left: run on the cluster in a box (tests/integration/test_cluster_box.py: every Kubernetes
part a stand-in) and on the real control plane with hollow nodes running the pods
(tests/integration/test_real_cluster_journey.py: Kubernetes 1.20.2's API server, scheduler and
controllers, the real helm).

Owns `users_journey` (the steps and their checks) and `Load` (OpenAI traffic through the router
pods, failures before streaming kept). The cluster is either `fleet.testing.k8s.box.ClusterInABox`
or `fleet.testing.k8s.realbox.RealClusterInABox`: both give ``kube``, ``nodes``, ``kubelet``,
``work``, ``list``, ``get``, ``helm_install``, ``helm_upgrade``, ``helm_uninstall``,
``preload_image``, ``inject_xid``, ``leftovers`` and ``denied``.

Journey: install -> agents up on every GPU node, node facts accepted, the two router pods each
connected to the endpoint picker found in the Endpoints of the picker Service -> a TP=2 ``hf://...@rev``
deployment on the NVL node, a MIG one, a TP=1 one on the SXM node and a CPU one, served through
two router pods -> TP=2 replicas each on one NVLink pair (never across PCIe), MIG on a 3g.40gb slice ->
weights fetched once per node, engines started from the node cache -> KV event streams followed by
the picker, both routers' picks answered by it ->
an Xid 79 on a GPU of the SXM node: quarantined, its replica drained and replaced on another GPU,
no request failed before streaming -> a canary rollout promotes -> ``helm upgrade`` rolls the
operator, which adopts every engine -> kill -9 of the operator, an agent and a router pod (which
connects to the picker again) ->
delete, uninstall, nothing left. Any request outside a Role's rights fails it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from fleet.k8s.client import INFERENCE_DEPLOYMENTS, NODES, PODS, NotFound
from fleet.k8s.pods import node_affinity
from tests.support.waits import async_wait_until

NS = "fleet"
DEPLOYMENTS = ("chat-nvl", "small-mig", "chat-sxm")   # on GPUs; "tiny-cpu" beside them on the CPU node
IMAGE = "ghcr.io/inference-fleet/fleet:0.1.0"


def _cr(name: str, model: str, source: str, resources: dict, replicas: int, revision: str = "v1",
        rollout: dict | None = None) -> dict:  # fmt: skip
    spec = {"model": {"name": model, "source": source, "revision": revision},
            "engine": {"kind": "sim", "args": ["--seed", "1"], "startupTimeoutSeconds": 120},
            "resources": resources, "replicas": {"min": replicas, "max": replicas},
            "warmup": {"requests": [{"kind": "completion", "prompt": "Hello", "maxTokens": 2}]}}  # fmt: skip
    if rollout:
        spec["rollout"] = rollout
    return {"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": name},
            "spec": spec}


class Load:
    """Completions sent to every ready router pod in turn, all the time; failures before the first
    byte of the answer are kept (``failed_before_streaming``). A refused connection (a router
    process just killed: nothing reached Fleet) is retried on the next router, as a client behind
    a Service would, and counted in ``refused``."""

    def __init__(self, routers, model: str) -> None:
        self.routers = routers
        self.model = model
        self.ok = 0
        self.refused = 0
        self.killed_router: str | None = None   # requests in flight there when it was killed are lost
        self.lost_in_killed_router: list[str] = []
        self.failed_before_streaming: list[str] = []
        self._stop = asyncio.Event()
        self.task: asyncio.Task | None = None

    async def _run(self) -> None:
        async with aiohttp.ClientSession() as http:
            i = 0
            while not self._stop.is_set():
                urls = self.routers()
                if not urls:
                    await asyncio.sleep(0.2)   # the load's pace while no router is ready, not a wait
                    continue
                url = urls[i % len(urls)]
                i += 1
                try:
                    async with http.post(f"{url}/v1/completions", json={"model": self.model, "prompt": "hi there",
                                                                        "max_tokens": 4},
                                         timeout=aiohttp.ClientTimeout(total=30)) as r:  # fmt: skip
                        body = await r.read()
                        if r.status == 200:
                            self.ok += 1
                        else:
                            self.failed_before_streaming.append(f"{url}: {r.status} {body[:200]!r}")
                except aiohttp.ClientConnectorError:
                    self.refused += 1
                    continue
                except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                    broken = isinstance(err, (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError))
                    lost = broken and url == self.killed_router   # its process died with the request
                    (self.lost_in_killed_router if lost else self.failed_before_streaming).append(
                        f"{url}: {type(err).__name__}: {err}")
                await asyncio.sleep(0.05)   # the load's pace: about 20 requests a second

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._stop.set()
        if self.task:
            await self.task


async def users_journey(box, work: Path) -> list[tuple[str, float]]:
    """The journey (the module docstring) on ``box``, started; its files under ``work``. Returns
    each step's name and seconds since the start. Raises AssertionError (with the pods' states and
    logs) at the first step that fails."""
    from fleet.engines.tinymodel import make_tiny_tokenizer
    from fleet.testing.hub_server import HubRepo, HubServer

    weights = {"config.json": b'{"model_type": "llama"}', "model.safetensors": os.urandom(4096)}
    tok_dir = make_tiny_tokenizer(work / "tokenizer")
    tokenizer = {f: (tok_dir / f).read_bytes() for f in ("tokenizer.json", "tokenizer_config.json")}
    repos = {"org/chat": HubRepo({**weights, **tokenizer}), "org/small": HubRepo({**weights, "extra.txt": b"small"}),
             "org/sxm": HubRepo({**weights, "sxm.txt": b"v1"})}
    hub = HubServer(repos)
    hub.__enter__()
    rev = repos["org/chat"].commit
    kube = box.kube
    assert kube is not None
    steps: list[tuple[str, float]] = []
    started = time.monotonic()
    load: Load | None = None

    def mark(what: str) -> None:
        steps.append((what, time.monotonic() - started))
        print(f"[{time.monotonic() - started:6.1f} s] {what}", flush=True)

    def pods(selector: str | None = None) -> list[dict]:
        return box.list(PODS, NS, selector)[0]

    def phase(p: dict) -> str:
        return (p.get("status") or {}).get("phase", "Pending")

    def ready(p: dict) -> bool:
        return any(c.get("type") == "Ready" and c.get("status") == "True"
                   for c in (p.get("status") or {}).get("conditions") or [])  # fmt: skip

    def why() -> str:
        lines = [f"denied: {box.denied}"]
        for p in pods():
            cs = [(c["name"], list(c["state"])[0], c.get("restartCount")) for c in
                  (p.get("status") or {}).get("containerStatuses") or []]  # fmt: skip
            lines.append(f"{p['metadata']['name']} on {p['spec'].get('nodeName')}: {phase(p)} {cs}")
        for d in box.list(INFERENCE_DEPLOYMENTS, NS)[0]:
            status = d.get("status") or {}
            lines.append(f"{d['metadata']['name']}: {status.get('replicas')} {status.get('conditions')}")
        for d in sorted((box.work / "pods").glob("*")):
            for f in d.glob("*.log"):
                lines.append(f"--- {d.name}/{f.name}\n{f.read_text(errors='replace')[-2500:]}")
        return "\n".join(lines)

    box_wait = functools.partial(async_wait_until, interval_s=0.25, explain=why)   # the box is slow to change

    def router_urls() -> list[str]:
        return [f"http://{p['status']['podIP']}:8080" for p in pods("app.kubernetes.io/component=router")
                if ready(p) and not p["metadata"].get("deletionTimestamp")]  # fmt: skip

    async def served(model: str, n_routers: int = 2) -> bool:
        urls = router_urls()
        if len(urls) < n_routers:
            return False
        async with aiohttp.ClientSession() as http:
            for url in urls:
                try:
                    async with http.post(f"{url}/v1/completions", json={"model": model, "prompt": "hello",
                                                                        "max_tokens": 2}) as r:  # fmt: skip
                        if r.status != 200:
                            return False
                except aiohttp.ClientError:
                    return False
        return True

    def engine_pods(deployment: str) -> list[dict]:
        return [p for p in pods(f"fleet.inference.dev/deployment={deployment}")
                if not p["metadata"].get("deletionTimestamp")]  # fmt: skip

    def devices_of(p: dict) -> list[str]:
        plugin = box.nodes[p["spec"]["nodeName"]].plugin
        assert plugin is not None
        return [i for (uid, _c), (_res, ids) in plugin.allocations.items() if uid == p["metadata"]["uid"] for i in ids]

    try:
        # ---- helm install (rendered), agents up, node facts published --------------------------
        box.preload_image(IMAGE)
        values = {   # the node agent on every node, as docs/kubernetes.md says a CPU replica needs
            "agent": {"nodeSelector": None, "tolerations": [{"operator": "Exists"}]},
            "operator": {"tickSeconds": 0.5},
            "router": {"extraEnv": [{"name": "HF_ENDPOINT", "value": hub.url}]},
            "engine": {"defaultImage": IMAGE, "extraEnv": [{"name": "HF_ENDPOINT", "value": hub.url}],
                       "prePull": {"enabled": False}, "shmSize": ""},
        }  # fmt: skip
        box.helm_install(values)
        mark("helm install")

        def facts_published() -> bool:
            nodes = {n["metadata"]["name"]: n for n in box.list(NODES, None)[0]}
            labels = {n: (o["metadata"].get("labels") or {}).get("fleet.inference.dev/nvlink-domains")
                      for n, o in nodes.items()}  # fmt: skip
            return labels == {"cpu-1": None, "sxm-8": "0-7", "nvl-4": "0-1_2-3", "mig-1": "none"}

        await box_wait(lambda: len([p for p in pods("app.kubernetes.io/component=agent") if ready(p)]) == 4, 120,
                       what="a ready node agent on each of the 4 nodes (the CPU node: weight cache, no NVML)")
        await box_wait(facts_published, 60, what="NVLink domains published on every GPU node by its agent")
        await box_wait(lambda: len(router_urls()) == 2, 120, what="2 ready router pods")
        mark("agents up, node facts published, routers ready")

        async def scrape(url: str) -> dict[tuple[str, frozenset], float]:
            """{(sample name, labels): value} of the Prometheus text at ``url``."""
            async with aiohttp.ClientSession() as http:
                async with http.get(url) as r:
                    text = await r.text()
            return {(x.name, frozenset(x.labels.items())): x.value
                    for family in text_string_to_metric_families(text) for x in family.samples}  # fmt: skip

        async def picker_metrics() -> dict[tuple[str, frozenset], float]:
            """The metrics of the one ready picker pod (its metrics port, 9091)."""
            (picker,) = [p for p in pods("app.kubernetes.io/component=picker") if ready(p)]
            return await scrape(f"http://{picker['status']['podIP']}:9091/metrics")

        async def routers_connected() -> bool:
            """Each router pod connects to the picker at the ready address of the picker Service's
            Endpoints (fleet/k8s/service_endpoints.py; no cluster DNS, no kube-proxy here)."""
            picker_rows.clear()
            rows = await picker_metrics()
            picker_rows.update((n, v) for (n, _), v in rows.items() if n.startswith("fleet_picker_r"))
            return picker_rows.get("fleet_picker_routers_connected") == 2

        picker_rows: dict[str, float] = {}
        await box_wait(lambda: len([p for p in pods("app.kubernetes.io/component=picker") if ready(p)]) == 1, 120,
                       what="a ready endpoint picker pod")
        await async_wait_until(routers_connected, 60, interval_s=0.5, ignoring=(aiohttp.ClientError, ValueError),
                               what="both router pods connected to the endpoint picker",
                               explain=lambda: f"{picker_rows}\n{why()}")  # fmt: skip
        mark("router pods connected to the picker found through its Service's Endpoints")

        # ---- deployments: TP=2 on NVLink pairs, MIG, TP=1 on SXM ---------------------------------
        canary = {"strategy": "canary", "steps": [{"weight": 50}, {"analysis": {"passes": 1}}],
                  "analysis": {"intervalSeconds": 3, "minSamplesPerSide": 3, "excludeAfterReadySeconds": 0,
                               "metrics": [{"metric": "errorRate", "maxIncreaseOverStable": 0.5}]}}  # fmt: skip
        await kube.create(INFERENCE_DEPLOYMENTS, NS, _cr("chat-nvl", "chat-nvl", f"hf://org/chat@{rev}", {
            "tensorParallelSize": 2, "gpuProduct": "NVIDIA H100 NVL"}, 2))
        await kube.create(INFERENCE_DEPLOYMENTS, NS, _cr("small-mig", "small-mig", "hf://org/small",
                                                         {"migProfile": "3g.40gb"}, 1))  # fmt: skip
        await kube.create(INFERENCE_DEPLOYMENTS, NS, _cr("chat-sxm", "chat-sxm", "hf://org/sxm", {
            "gpuProduct": "NVIDIA H100 80GB HBM3"}, 2, rollout=canary))
        await kube.create(INFERENCE_DEPLOYMENTS, NS, _cr("tiny-cpu", "tiny-cpu", "hf://org/small",
                                                         {"accelerator": "cpu", "cpuCores": 2}, 1))  # fmt: skip
        for model in (*DEPLOYMENTS, "tiny-cpu"):
            await box_wait(lambda m=model: served(m), 300, what=f"{model} served through both router pods")
        (cpu,) = engine_pods("tiny-cpu")   # on the CPU node, no GPU asked for
        asked = cpu["spec"]["containers"][0]["resources"]
        assert cpu["spec"]["nodeName"] == "cpu-1", (cpu["spec"]["nodeName"], asked)
        assert not any(k.startswith("nvidia.com/") for k in asked.get("requests", {})), asked
        mark("4 deployments (TP=2 NVLink, MIG, TP=1, CPU) served through 2 router pods")

        async def kv_streams_live() -> bool:
            """The picker follows every engine pod's KV event stream (the engine's PUB socket and
            replay socket at its pod IP, ports kv-events / kv-replay) with an exact view, and has
            applied events of every deployment (each got a prompt longer than a KV block); every
            router pod's picks were answered by it, and each fetched chat-nvl's tokenizer from the
            hub (it tokenizes the prompts it asks about; it holds no weights)."""
            names = {p["metadata"]["name"]: d for d in ("chat-nvl", "small-mig", "chat-sxm") for p in engine_pods(d)}
            rows = await picker_metrics()
            kv_rows["picker"] = sorted(f"{n}{dict(labels)} {v}" for (n, labels), v in rows.items()
                                       if n.startswith("fleet_picker_kv_"))  # fmt: skip
            def of(n: str) -> frozenset:
                return frozenset({"endpoint": n, "model": names[n]}.items())

            live = {n for n in names if rows.get(("fleet_picker_kv_stream_live", of(n))) == 1}
            applied = {names[n] for n in names if rows.get(("fleet_picker_kv_events_total", of(n)), 0) > 0}
            if live != set(names) or applied != set(names.values()):
                return False
            for url in router_urls():
                router_rows = await scrape(f"{url}/metrics")
                kv_rows[url] = sorted(f"{n}{dict(labels)} {v}" for (n, labels), v in router_rows.items()
                                      if n.startswith(("fleet_router_picker_", "fleet_router_tokenizer")))  # fmt: skip
                answered = ("fleet_router_picker_picks_total", frozenset({"outcome": "answered"}.items()))
                if router_rows.get(answered, 0) < 1:
                    return False
                if router_rows.get(("fleet_router_tokenizer_loads_total", frozenset({"outcome": "ok"}.items()))) != 1:
                    return False
            return bool(names)

        kv_rows: dict[str, list[str]] = {}
        long_prompt = " ".join(f"word{i}" for i in range(400))   # many KV blocks of any block size
        async with aiohttp.ClientSession() as http:
            for url in router_urls():
                for model in ("chat-nvl", "small-mig", "chat-sxm"):
                    body = {"model": model, "prompt": long_prompt, "max_tokens": 2}
                    async with http.post(f"{url}/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()
        await async_wait_until(kv_streams_live, 60, interval_s=0.25, ignoring=(aiohttp.ClientError, ValueError),
                               what="the picker following every engine pod's KV event stream, answering both routers",
                               explain=lambda: f"{json.dumps(kv_rows, indent=1)}\n{why()}")  # fmt: skip
        for f in tokenizer:   # the node's weight cache once (the whole repository), each router pod once
            assert len(hub.log.file_gets(f"org/chat/resolve/{rev}/{f}")) == 3, f
        mark("KV event streams live from every engine pod to the picker; both routers' picks answered; "
             "tokenizer fetched by each router")

        nvl = engine_pods("chat-nvl")
        assert {p["spec"]["nodeName"] for p in nvl} == {"nvl-4"}
        pairs = sorted(sorted(devices_of(p)) for p in nvl)
        plugin = box.nodes["nvl-4"].plugin
        assert pairs == sorted(sorted(d) for d in plugin.domains), f"TP=2 replicas not one per NVLink pair: {pairs}"
        for p in nvl:   # the operator's placement agrees with the pair the device plugin gave
            placed = json.loads(p["metadata"]["annotations"]["fleet.inference.dev/placement"])
            assert len(placed["members"][0]["devices"]) == 2
        (mig,) = engine_pods("small-mig")
        assert mig["spec"]["nodeName"] == "mig-1"
        assert devices_of(mig)[0] in box.nodes["mig-1"].plugin.mig["3g.40gb"]
        assert {p["spec"]["nodeName"] for p in engine_pods("chat-sxm")} == {"sxm-8"}
        for p in [*nvl, mig]:   # pinned by node affinity, bound by the scheduler (the real one, or the box's)
            assert "nodeName" in p["spec"] and p["spec"]["affinity"] == node_affinity(p["spec"]["nodeName"])

        # weights: once per node, and the engines run from the node cache
        for f in weights:
            gets = hub.log.file_gets(f"org/chat/resolve/{rev}/{f}")
            assert len(gets) == 1, f"{f} of org/chat fetched {len(gets)} times for 2 pods on one node"
        for p in nvl:
            spec = p["spec"]
            assert [c["name"] for c in spec.get("initContainers") or []] == ["weights"]
            cmd = spec["containers"][0]["command"]
            assert cmd[cmd.index("--model") + 1] == "/fleet/model/current"
            admitted = box.nodes[spec["nodeName"]].requested[p["metadata"]["name"]]   # what the kubelet admitted
            assert "cpu" in admitted and "memory" in admitted, "engine pods must not be BestEffort"
        mark("placement, weights once per node, resources checked")

        # ---- Xid 79 on a GPU of a serving replica: quarantined, drained, replaced --------------
        load = Load(router_urls, "chat-sxm")
        load.start()
        await box_wait(lambda: load.ok >= 10, 60, what="traffic flowing to chat-sxm")
        victim = sorted(engine_pods("chat-sxm"), key=lambda p: p["metadata"]["name"])[0]
        (bad_uuid,) = devices_of(victim)
        bad_index = next(d["index"] for d in json.loads(box.nodes["sxm-8"].nvml_state.read_text())["devices"]
                         if d["uuid"] == bad_uuid)  # fmt: skip
        box.inject_xid("sxm-8", bad_index, 79)

        def quarantined() -> list[str] | None:
            """The pods the gpu-health annotation names on the bad GPU, once it is quarantined."""
            node = box.get(NODES, None, "sxm-8")
            value = (node["metadata"].get("annotations") or {}).get("fleet.inference.dev/gpu-health")
            hits = [q for q in json.loads(value)["quarantined"] if q["index"] == bad_index] if value else []
            return hits[0]["pods"] if hits else None

        named = await box_wait(quarantined, 60,
                               what=f"GPU {bad_index} of sxm-8 quarantined in the node's gpu-health annotation")
        # The agent named the victim: from the kubelet's PodResources socket (its only source of
        # which pod holds which GPU), the uid got from the API server.
        assert named == [victim["metadata"]["uid"]] and box.pod_resources["sxm-8"].calls > 0
        await box_wait(lambda: victim["metadata"]["name"] not in {p["metadata"]["name"] for p in pods()}, 180,
                       what=f"replica {victim['metadata']['name']} on the quarantined GPU drained")

        def replaced() -> bool:
            live = [p for p in engine_pods("chat-sxm") if ready(p)]
            return len(live) == 2 and all(bad_uuid not in devices_of(p) for p in live)

        await box_wait(replaced, 180, what="chat-sxm back to 2 ready replicas, none on the quarantined GPU")
        mark(f"Xid 79 on sxm-8 GPU {bad_index}: quarantined, drained, replaced")

        # ---- a canary rollout promotes ------------------------------------------------------------
        sxm_rev = repos["org/sxm"].commit
        await kube.patch(INFERENCE_DEPLOYMENTS, NS, "chat-sxm", {"spec": {"model": {
            "source": f"hf://org/sxm@{sxm_rev}", "revision": "v2"}}})

        def promoted() -> bool:
            live = engine_pods("chat-sxm")
            return len(live) == 2 and all(p["metadata"]["labels"].get("fleet.inference.dev/revision") == "v2"
                                          and ready(p) for p in live)  # fmt: skip

        await box_wait(promoted, 300, what="the canary of chat-sxm v2 promoted (2 ready v2 replicas, no v1)")
        mark("canary v2 promoted")

        # ---- helm upgrade: the operator's Deployment rolls; the new operator adopts every engine ---
        await box_wait(lambda: not any(p["metadata"].get("deletionTimestamp")
                                       for p in pods("app.kubernetes.io/managed-by=fleet-operator")), 60,
                       what="the rollout's last v1 pod gone before the upgrade")  # fmt: skip
        live_engines = {p["metadata"]["uid"] for p in pods("app.kubernetes.io/managed-by=fleet-operator")}
        old_operator = {p["metadata"]["uid"] for p in pods("app.kubernetes.io/component=operator")}
        box.helm_upgrade({**values, "operator": {**values["operator"], "logLevel": "debug"}})
        await box_wait(lambda: [p["metadata"]["uid"] not in old_operator and ready(p)
                                for p in pods("app.kubernetes.io/component=operator")] == [True], 180,
                       what="helm upgrade: one ready operator pod of the new template, the old one gone")  # fmt: skip
        await box_wait(lambda: served("chat-sxm"), 60, what="chat-sxm served after the upgrade")
        assert {p["metadata"]["uid"] for p in pods("app.kubernetes.io/managed-by=fleet-operator")} == live_engines, \
            f"the upgraded operator replaced engine pods instead of adopting them\n{why()}"
        mark("helm upgrade: operator rolled, engines adopted")

        # ---- kill -9: the operator, an agent, a router pod ---------------------------------------
        def kill9(selector: str, container: str, node: str | None = None) -> dict:
            """kill -9 of one container's process (the first pod matching); returns the pod."""
            p = [p for p in pods(selector) if node is None or p["spec"]["nodeName"] == node][0]
            os.killpg(box.kubelet.processes(NS, p["metadata"]["name"])[container], signal.SIGKILL)
            return p

        def restarted(p: dict, container: str) -> bool:
            now = next((q for q in pods() if q["metadata"]["uid"] == p["metadata"]["uid"]), None)
            return now is not None and ready(now) and any(
                c["name"] == container and c.get("restartCount", 0) >= 1 for c in now["status"]["containerStatuses"])

        def engines() -> set[str]:
            return {p["metadata"]["uid"] for p in pods("app.kubernetes.io/managed-by=fleet-operator")}

        # the rollout's last v1 pod may still be going: the operator's adoption is judged on what stays
        await box_wait(lambda: not any(p["metadata"].get("deletionTimestamp")
                                       for p in pods("app.kubernetes.io/managed-by=fleet-operator")), 60,
                       what="no engine pod being deleted before the kills")  # fmt: skip
        before = engines()
        op = kill9("app.kubernetes.io/component=operator", "operator")
        await box_wait(lambda: restarted(op, "operator"), 120, what="the operator restarted after kill -9")
        agent = kill9("app.kubernetes.io/component=agent", "agent", node="sxm-8")
        await box_wait(lambda: restarted(agent, "agent"), 120, what="the sxm-8 agent restarted after kill -9")
        assert quarantined() is not None, "the quarantine did not survive the agent's restart"
        load.killed_router = f"http://{pods('app.kubernetes.io/component=router')[0]['status']['podIP']}:8080"
        router = kill9("app.kubernetes.io/component=router", "router")
        await box_wait(lambda: restarted(router, "router"), 120, what="a router pod restarted after kill -9")
        await box_wait(lambda: served("chat-sxm"), 120, what="chat-sxm served through both routers after the kills")
        await box_wait(lambda: served("chat-nvl"), 60, what="chat-nvl served through both routers after the kills")
        await async_wait_until(routers_connected, 60, interval_s=0.5, ignoring=(aiohttp.ClientError, ValueError),
                               what="both router pods connected to the picker again after the kills",
                               explain=lambda: f"{picker_rows}\n{why()}")  # fmt: skip
        after = engines()
        assert after == before, f"the restarted operator replaced engine pods instead of adopting them\n{why()}"
        mark("kill -9 of operator, agent and router: adopted, served")
        await load.stop()
        assert not load.failed_before_streaming, load.failed_before_streaming[:10]
        assert load.ok > 50
        # kill -9 cannot drain: what was in flight inside the killed router process is lost (a
        # reset connection; nothing else failed). Requests refused by it were retried elsewhere.
        print(f"load: {load.ok} ok, {len(load.lost_in_killed_router)} lost in the killed router, "
              f"{load.refused} refused connections retried", flush=True)

        # ---- delete: nothing left ----------------------------------------------------------------
        for name in (*DEPLOYMENTS, "tiny-cpu"):
            await kube.delete(INFERENCE_DEPLOYMENTS, NS, name)

        async def deployments_gone() -> bool:
            for name in (*DEPLOYMENTS, "tiny-cpu"):
                try:
                    await kube.get(INFERENCE_DEPLOYMENTS, NS, name)
                    return False
                except NotFound:
                    pass
            return not pods("app.kubernetes.io/managed-by=fleet-operator")

        await box_wait(deployments_gone, 180, what="the deployments and their engine pods gone")
        assert not box.denied, f"requests outside a Role's rights: {box.denied}"
        box.helm_uninstall()
        await box_wait(lambda: not pods(), 120, what="every pod gone after uninstall")
        left = box.leftovers(NS)
        assert not left, f"left after uninstall: {left}"
        mark("deleted and uninstalled: nothing left")
        # helm uninstall deletes the Roles while the pods are still stopping (as on a real cluster):
        # the operator's last act, giving the Lease up, and a router's last read of the picker's
        # Endpoints may be refused; the Lease then just expires.
        stopping = (("leases", '"fleet-operator" is forbidden'), ("endpoints", '"fleet-picker" is forbidden'))
        late = [d for d in box.denied if not any(kind in d and what in d for kind, what in stopping)]
        assert not late, f"requests outside a Role's rights: {late}"
    finally:
        if load is not None and load.task is not None and not load.task.done():
            await load.stop()
        hub.__exit__(None, None, None)
        print("\n".join(f"{what}: {at:.1f} s" for what, at in steps))
    return steps



