"""The Kubernetes backend: the second implementation of the replica protocol
(`fleet.controller.backend.Backend`); a replica is a Pod.

Owns the calls that make replicas run as pods and what it observes of them: `inventory` (Node
objects and their GPU Feature Discovery labels through `fleet.inventory.gfd`, minus nodes that
are not Ready, cordoned, or that engine pods could not go to: node selector, untolerated
NoSchedule taints), `ensure` (create the pod `fleet.k8s.pods.pod_manifest` builds, in the
background, a bounded number at once; a pod that exists, running or not, is left alone), `observe` (every pod of this fleet by its labels ->
`ReplicaFacts`; a pod that vanished — deleted, evicted and collected, or lost with its node — is
reported exited once, until `forget`; a pod whose Node object is gone counts as
exited, its node lost), `stop` (delete with the pod's grace period: the kubelet
sends SIGTERM), `kill` (delete with grace 0), `forget` (delete a finished pod's object) and
`log_tail` (the pod log). Draining is the controller's, through the router, before `stop`.

Image pre-pull (`fleet.k8s.prepull`): ``ensure`` creates the pod at once only when every node of
the placement holds the engine image (``Node.status.images``, or a finished pre-pull);
otherwise the replica waits, PULLING (its facts say ``image_present`` False, and ``detail.cache``
what the pull is doing), while ``observe`` advances the pre-pull pods each tick; the pod is
created once the image is there. A failed pull is an Event on the InferenceDeployment naming
the node, the image and the reason, and backs off; when the policy gives up, the waiting
replica exits with that reason (the controller replaces it). ``set_pre_pull`` adds the
selector-wide pulls of ``spec.prePull``. With ``spec.engine.imagePullPolicy: Never`` nothing is
pre-pulled (the node must hold the image; the kubelet says ErrImageNeverPull). A replica's pod
on a node that lists its image reports ``image_present`` from that fact.

GPU health (`fleet.inventory.gpu_health`, the node agent's annotation
``fleet.inference.dev/gpu-health``): ``inventory`` marks quarantined GPUs and MIG instances
(`fleet.inventory.gfd.quarantine_marks`, told which synthetic devices each of this fleet's pods
was placed on, so the mark lands on the replica that really holds the device); ``observe``
reports a replica whose pod the device plugin gave a quarantined device (the annotation's
``pods``, or ``allocations``) as ``sick`` (the controller drains and replaces it), and a
tensor-parallel pod whose GPUs span more than one NVLink domain (``allocations`` against the
node's ``fleet.inference.dev/nvlink-domains`` label) gets a Warning Event ``NVLinkSpan`` and a
``detail.nvlink`` line: the device plugin's choice, which Fleet cannot steer through
``nvidia.com/gpu`` counts (docs/kubernetes.md, "GPU health and NVLink on a cluster").

Objects come from informers when the operator gives them (`fleet.k8s.informer`: list + watch),
else from a list per call. Every call goes through `fleet.k8s.client.Kube`.
Created by the operator (`fleet.k8s.operator`) per namespace.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Protocol

import tenacity

from fleet.controller.backend import ReplicaFacts, ReplicaWant
from fleet.inventory import Inventory
from fleet.inventory.gfd import LabelKeys, image_aliases, node_from_k8s, node_images, parse_nvlink_domains
from fleet.inventory.gpu_health import ANNOTATION as GPU_HEALTH, GpuHealthFacts, QuarantinedGpu, parse_gpu_health
from fleet.k8s.client import EVENTS, NODES, PODS, ApiError, Conflict, Kube
from fleet.k8s.prepull import Pull, PrePuller, PrePullPolicy, is_pull_pod
from fleet.k8s.pod_facts import group_facts, pod_node
from fleet.k8s.pod_settings import EnginePodSettings
from fleet.k8s.pods import ANNOTATION_PLACEMENT, LABEL_DEPLOYMENT, LABEL_FLEET, LABEL_MANAGED_BY, LABEL_REPLICA, \
    MANAGED_BY, label_value, pod_group  # fmt: skip

log = logging.getLogger("fleet.k8s.backend")

CREATE_CONCURRENCY = 16
"""Pod creates in flight at once (`ensure` returns before its pod exists)."""


class ObjectSource(Protocol):
    """Where the backend reads objects from: an informer's cache (`fleet.k8s.informer.Informer`
    has this shape) or a list per call (`ListSource`)."""

    async def items(self) -> list[dict]:
        """The objects now (dicts as the API serves them)."""
        ...


class ListSource:
    """Objects by one list call each time (no informer)."""

    def __init__(self, kube: Kube, res, namespace: str | None, selector: str | None) -> None:
        self.kube, self.res, self.namespace, self.selector = kube, res, namespace, selector

    async def items(self) -> list[dict]:
        objs, _ = await self.kube.list(self.res, self.namespace, self.selector)
        return objs


def node_usable(node: dict, settings: EnginePodSettings) -> str | None:
    """Why engine pods cannot be placed on ``node``, or None: not Ready, cordoned, the engine
    node selector does not match, a NoSchedule/NoExecute taint is not tolerated, or, with the node
    weight cache on (``weightCache.hostPath``), no node agent runs there: it publishes
    ``fleet.inference.dev/gpu-health`` on every node it runs on, even without GPUs, and without it
    the cache directory is not the engine pods' to write (`fleet.k8s.pod_weights`), no GPU is
    health-checked and no NVLink domain is known."""
    spec = node.get("spec") or {}
    labels = node["metadata"].get("labels") or {}
    annotations = node["metadata"].get("annotations") or {}
    if settings.weight_cache_path and GPU_HEALTH not in annotations:
        return "no Fleet node agent on it (no weight cache: the chart's agent.nodeSelector leaves it out)"
    ready = [c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"]
    if ready and ready[0].get("status") != "True":
        return "not Ready"
    if spec.get("unschedulable"):
        return "cordoned"
    for key, value in settings.node_selector.items():
        if labels.get(key) != value:
            return f"label {key}={value} missing (engine node selector)"
    for taint in spec.get("taints") or []:
        if taint.get("effect") not in ("NoSchedule", "NoExecute"):
            continue
        if not any(_tolerates(t, taint) for t in settings.tolerations):
            return f"taint {taint.get('key')}={taint.get('value', '')}:{taint.get('effect')} not tolerated"
    return None


def _tolerates(toleration: dict, taint: dict) -> bool:
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("operator") == "Exists":
        return not toleration.get("key") or toleration["key"] == taint.get("key")
    return toleration.get("key") == taint.get("key") and toleration.get("value", "") == taint.get("value", "")


def _annotation(obj: dict, key: str) -> str:
    return (obj["metadata"].get("annotations") or {}).get(key) or ""


def _nvlink_span(node: dict, pod: dict, gpus: tuple[int, ...] | None, keys: LabelKeys) -> str | None:
    """Why ``pod``'s GPUs (NVML indexes the device plugin gave it, from the agent's
    ``allocations``) are not one NVLink domain of ``node`` (its NVLink domains label), or None:
    fewer than two GPUs, unknown allocation or topology, or one domain."""
    label = (node["metadata"].get("labels") or {}).get(keys.nvlink_domains)
    if not gpus or len(gpus) < 2 or label is None:
        return None
    try:
        domains = parse_nvlink_domains(label)
    except ValueError:
        return None
    domain_of = {i: n for n, dom in enumerate(domains) for i in dom}
    spanned = {domain_of.get(i, f"alone-{i}") for i in gpus}
    if len(spanned) < 2:
        return None
    return (f"the device plugin gave GPUs {','.join(map(str, sorted(gpus)))}, which span {len(spanned)} NVLink "
            f"domains ({keys.nvlink_domains}={label}): tensor-parallel traffic crosses PCIe")


class KubernetesBackend:
    """Replicas as pods in ``namespace`` (`fleet.controller.backend.Backend`)."""

    def __init__(self, kube: Kube, namespace: str, fleet_id: str, *, settings: EnginePodSettings | None = None,
                 owner_of: Callable[[str], dict | None] = lambda deployment: None,
                 pods: ObjectSource | None = None, nodes: ObjectSource | None = None,
                 label_keys: LabelKeys = LabelKeys(), clock: Callable[[], float] = time.time) -> None:  # fmt: skip
        """``fleet_id``: the value of the fleet label on this fleet's pods; ``owner_of``: the
        InferenceDeployment object of a deployment name (its pods' owner), None if unknown;
        ``clock``: seconds, for the pre-pull's timeouts and backoff (wall time: Events carry it)."""
        self.kube = kube
        self.namespace = namespace
        self.fleet_id = fleet_id
        self.settings = settings or EnginePodSettings()
        self.owner_of = owner_of
        self.selector = f"{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_FLEET}={label_value(fleet_id)}"
        self.pods = pods or ListSource(kube, PODS, namespace, self.selector)
        self.nodes = nodes or ListSource(kube, NODES, None, None)
        self.label_keys = label_keys
        self.unusable_nodes: dict[str, str] = {}     # node -> why it is left out of the inventory
        self._node_cache: dict[tuple[str, str | None], object] = {}   # (name, resourceVersion) -> NodeInventory
        self._seen: dict[str, ReplicaFacts] = {}     # replica id -> last facts while its pod existed
        self._gone: dict[str, ReplicaFacts] = {}     # pods that vanished, reported exited until forget
        self._forgotten: set[str] = set()            # finished pods being deleted: no longer reported
        self._created: dict[str, ReplicaFacts] = {}  # created by this backend, not yet observed
        self._members: dict[str, list[str]] = {}     # replica id -> its pod names (a gang has several)
        self._facts_cache: dict[str, tuple[tuple, ReplicaFacts]] = {}   # replica id -> (its pods' versions, facts)
        self._creating: set[asyncio.Task] = set()
        self._create_slots = asyncio.Semaphore(CREATE_CONCURRENCY)
        self.clock = clock
        self.prepuller: PrePuller | None = None
        if self.settings.pre_pull:
            policy = PrePullPolicy(clock, timeout_s=self.settings.pre_pull_timeout_s,
                                   wait=tenacity.wait_exponential(multiplier=self.settings.pre_pull_backoff_s,
                                                                  max=self.settings.pre_pull_max_backoff_s),
                                   stop=tenacity.stop_after_attempt(self.settings.pre_pull_attempts))  # fmt: skip
            self.prepuller = PrePuller(kube, namespace, fleet_id, self.settings, policy)
        self._images: dict[str, frozenset[str]] = {}   # node -> image names its status lists (last seen)
        self._images_at: dict[str, tuple[str | None, frozenset[str]]] = {}   # node -> (resourceVersion, images)
        self._awaiting: dict[str, tuple[str, str, list[dict]]] = {}   # replica id -> (deployment, image, pods)
        self._pre_pull: dict[str, tuple[str, dict[str, str], int]] = {}   # deployment -> (image, selector, limit)
        # node -> (resourceVersion, its agent's GPU health, pod uid -> the quarantined device it holds)
        self._health: dict[str, tuple[str | None, GpuHealthFacts, dict[str, QuarantinedGpu]]] = {}
        self._nvlink_warned: set[str] = set()   # pod uids whose NVLink span was reported

    # ----- Backend ----------------------------------------------------------------------------

    async def inventory(self) -> Inventory:
        nodes = []
        self.unusable_nodes = {}
        objs = await self.nodes.items()
        self._refresh_images(objs)
        quarantining = {o["metadata"]["name"] for o in objs if '"index"' in _annotation(o, GPU_HEALTH)}
        held = await self._held_devices(quarantining) if quarantining else {}
        for obj in sorted(objs, key=lambda n: n["metadata"]["name"]):
            why = node_usable(obj, self.settings)
            if why:
                self.unusable_nodes[obj["metadata"]["name"]] = why
                continue
            key = (obj["metadata"]["name"], obj["metadata"].get("resourceVersion"))
            try:
                if key[0] in quarantining:   # where the marks go depends on the pods too: built each time
                    nodes.append(node_from_k8s(obj, self.label_keys, held.get(key[0], {})))
                    continue
                if key not in self._node_cache:   # a node changes rarely; its inventory is built once per version
                    self._node_cache[key] = node_from_k8s(obj, self.label_keys)
                nodes.append(self._node_cache[key])
            except ValueError as err:
                self.unusable_nodes[obj["metadata"]["name"]] = str(err)
        current = {(n.name, None) for n in nodes}
        if len(self._node_cache) > 2 * len(nodes) + 16:
            self._node_cache = {k: v for k, v in self._node_cache.items() if (k[0], None) in current}
        return Inventory(tuple(nodes))

    async def _held_devices(self, nodes: set[str]) -> dict[str, dict[str, tuple[str, ...]]]:
        """Node -> pod uid -> the synthetic device ids (its placement annotation) of this fleet's
        pods on ``nodes``: where `fleet.inventory.gfd.quarantine_marks` puts a quarantine."""
        out: dict[str, dict[str, tuple[str, ...]]] = {}
        for pod in await self.pods.items():
            meta = pod["metadata"]
            node = pod_node(pod)
            if node not in nodes or is_pull_pod(pod) or not meta.get("uid"):
                continue
            try:
                members = json.loads((meta.get("annotations") or {}).get(ANNOTATION_PLACEMENT, "{}")).get("members", [])
            except (ValueError, AttributeError):
                continue
            devices = tuple(d for m in members if m.get("node") == node for d in m.get("devices", ()))
            out.setdefault(node, {})[meta["uid"]] = devices
        return out

    def _node_health(self, obj: dict) -> tuple[GpuHealthFacts, dict[str, QuarantinedGpu]]:
        """The node agent's GPU health on ``obj`` and its sick pods, parsed once per node version;
        a malformed annotation counts as none (`inventory` reports the node unusable for it)."""
        meta = obj["metadata"]
        version = meta.get("resourceVersion")
        seen = self._health.get(meta["name"])
        if seen is None or version is None or seen[0] != version:
            try:
                facts = parse_gpu_health(_annotation(obj, GPU_HEALTH))
            except ValueError:
                facts = GpuHealthFacts()
            seen = self._health[meta["name"]] = (version, facts, facts.sick_pods())
        return seen[1], seen[2]

    async def _gpu_facts(self, rid: str, f: ReplicaFacts, pods: list[dict], nodes: dict[str, dict]) -> ReplicaFacts:
        """``f`` with ``sick`` when a pod of the replica holds a quarantined device, and the
        NVLink span of a tensor-parallel pod checked (a Warning Event once per pod)."""
        for pod in pods:
            meta = pod["metadata"]
            obj = nodes.get(pod_node(pod))
            uid = meta.get("uid")
            if obj is None or not uid:
                continue
            health, sick = self._node_health(obj)
            if uid in sick and not f.sick:
                f = replace(f, sick=f"pod {meta['name']} on node {obj['metadata']['name']} holds a device the node "
                                    f"agent quarantines: {sick[uid].describe()}")  # fmt: skip
            span = _nvlink_span(obj, pod, health.allocations.get(uid), self.label_keys)
            if span:
                f = replace(f, detail={**f.detail, "nvlink": span})
                if uid not in self._nvlink_warned:
                    self._nvlink_warned.add(uid)
                    deployment = (meta.get("labels") or {}).get(LABEL_DEPLOYMENT, f.deployment)
                    await self._event(deployment, "NVLinkSpan", f"replica {rid}: pod {meta['name']} on node "
                                      f"{obj['metadata']['name']}: {span}")  # fmt: skip
        return f

    def _refresh_images(self, objs: list[dict]) -> None:
        """``self._images``: node -> the image names its status lists, parsed once per node
        version (`inventory` and `observe` both read the nodes every tick; 50 images on each of
        10,000 nodes take ~0.3 s to parse)."""
        images = {}
        for obj in objs:
            meta = obj["metadata"]
            version = meta.get("resourceVersion")
            seen = self._images_at.get(meta["name"])
            if seen is not None and version is not None and seen[0] == version:
                images[meta["name"]] = seen[1]
            else:
                images[meta["name"]] = node_images(obj)
                self._images_at[meta["name"]] = (version, images[meta["name"]])
        if len(self._images_at) > len(images):
            self._images_at = {k: v for k, v in self._images_at.items() if k in images}
        self._images = images

    async def ensure(self, want: ReplicaWant) -> None:
        rid = want.replica_id
        if rid in self._seen or rid in self._gone or rid in self._created or rid in self._forgotten:
            return
        pods = pod_group(want, fleet_id=self.fleet_id, owner=self.owner_of(want.deployment.name),
                         settings=self.settings)  # fmt: skip
        self._members[rid] = [p["metadata"]["name"] for p in pods]
        self._created[rid] = ReplicaFacts(rid, want.deployment.name, want.spec_hash, want.placement.nodes[0],
                                          detail={"pod": rid, "phase": "Pending"})  # fmt: skip
        image = pods[0]["spec"]["containers"][0]["image"]
        pulls = want.deployment.spec.engine.image_pull_policy != "Never"   # Never: the node must hold it
        if self.prepuller is not None and pulls and not self._image_on(image, [pod_node(p) for p in pods]):
            self._awaiting[rid] = (want.deployment.name, image, pods)   # observe() pre-pulls, then creates
            return
        self._launch(rid, pods)

    def _image_on(self, image: str, nodes: Iterable[str]) -> bool:
        """Every one of ``nodes`` holds ``image`` (its status lists it, or its pre-pull finished)."""
        if self.prepuller is None:
            return True
        return all(self.prepuller.policy.present(n, image, self._images.get(n, ())) for n in nodes)

    def _launch(self, rid: str, pods: list[dict]) -> None:
        pending = self._created.get(rid)
        if pending is not None and self.prepuller is not None:   # checked by the caller: the image is there
            self._created[rid] = replace(pending, image_present=True,
                                         detail={k: v for k, v in pending.detail.items() if k != "cache"})
        # Non-blocking (the protocol's rule): the creates run beside the controller's tick, a
        # bounded number at once; a refusal shows up in the next `observe` as an exit.
        task = asyncio.get_running_loop().create_task(self._create(rid, pods), name=f"create-pods-{rid}")
        self._creating.add(task)
        task.add_done_callback(self._creating.discard)

    async def _create(self, rid: str, pods: list[dict]) -> None:
        """Create the replica's pods, all or nothing: when one is refused, those created are deleted."""
        created: list[str] = []
        async with self._create_slots:
            for pod in pods:
                try:
                    await self.kube.create(PODS, self.namespace, pod)
                    created.append(pod["metadata"]["name"])
                except Conflict:
                    created.append(pod["metadata"]["name"])   # exists (an operator before a restart created it)
                except Exception as err:  # noqa: BLE001 - ApiError, connection errors: the replica fails to start
                    for name in created:
                        await self.kube.delete(PODS, self.namespace, name, grace_period_s=0)
                    pending = self._created.pop(rid, None)
                    if pending is not None:
                        why = f"the API server refused pod {pod['metadata']['name']}: {err}"
                        if len(pods) > 1:
                            why += f" (gang of {len(pods)}: none kept)"
                        self._gone[rid] = replace(pending, exited=True, exit_reason=why)
                    return

    async def drain_creates(self) -> None:
        """Wait for the pod creates in flight (tests, benchmarks, orderly stop)."""
        while self._creating:
            await asyncio.gather(*list(self._creating), return_exceptions=True)

    async def observe(self) -> dict[str, ReplicaFacts]:
        facts: dict[str, ReplicaFacts] = {}
        node_objs = await self.nodes.items()
        by_name = {n["metadata"]["name"]: n for n in node_objs}
        nodes = set(by_name)
        self._health = {k: v for k, v in self._health.items() if k in nodes}
        self._refresh_images(node_objs)
        groups: dict[str, list[dict]] = {}
        pull_pods = []
        for pod in await self.pods.items():
            if is_pull_pod(pod):
                pull_pods.append(pod)
                continue
            rid = (pod["metadata"].get("labels") or {}).get(LABEL_REPLICA, pod["metadata"]["name"])
            groups.setdefault(rid, []).append(pod)
        cache: dict[str, tuple[tuple, ReplicaFacts]] = {}
        for rid, pods in groups.items():
            # Facts change only when one of the replica's pods or its node changes: computed
            # again then, reused otherwise (a tick at 10,000 pods must not re-derive them all).
            nodes_of = sorted({pod_node(p) for p in pods})
            key = (tuple(sorted((p["metadata"].get("uid"), p["metadata"].get("resourceVersion")) for p in pods)),
                   tuple((n, (by_name.get(n) or {}).get("metadata", {}).get("resourceVersion")) for n in nodes_of),
                   rid in self._created)  # fmt: skip
            cached = self._facts_cache.get(rid)
            if cached is not None and cached[0] == key and all(uid and rv for uid, rv in key[0]):
                f = cached[1]
            else:
                self._members[rid] = sorted({*self._members.get(rid, ()), *(p["metadata"]["name"] for p in pods)})
                f = group_facts(pods)
                image = ((pods[0].get("spec") or {}).get("containers") or [{}])[0].get("image", "")
                if not f.image_present and image and image_aliases(image) & self._images.get(f.node, frozenset()):
                    f = replace(f, image_present=True)   # the node lists it: the kubelet will not pull
                if not f.exited:
                    f = await self._gpu_facts(rid, f, pods, by_name)
            cache[rid] = (key, f)
            if f.exited and rid in self._created and "missing" in (f.exit_reason or ""):
                continue   # a gang whose members are still being created (or not yet seen): pending
            lost = sorted({pod_node(p) for p in pods} - nodes - {""})
            if lost and not f.exited:   # a node object is gone: the node is lost
                f = replace(f, running=False, exited=True, endpoint=None,
                            exit_reason=f"node {lost[0]} was lost (its Node object is gone)")
            facts[rid] = f
        self._facts_cache = cache
        self._forgotten &= set(facts)          # deleted for good: no longer hidden
        visible = {rid: f for rid, f in facts.items() if rid not in self._forgotten}
        for rid, last in list(self._seen.items()):
            if rid not in visible:             # the pod vanished under us
                del self._seen[rid]
                why = last.exit_reason if last.exited else (
                    "pod was deleted (stopped, evicted, deleted by someone, or its node was lost)")
                self._gone[rid] = replace(last, running=False, exited=True, endpoint=None, exit_reason=why)
        for rid, f in visible.items():
            self._seen[rid] = f
            self._gone.pop(rid, None)
            self._created.pop(rid, None)
        if self.prepuller is not None:
            await self._pre_pull_step(node_objs, pull_pods)
        # Created, not yet seen (the informer lags the create): starting, not missing.
        pending = {rid: f for rid, f in self._created.items() if rid not in visible}
        return {**pending, **self._gone, **visible}

    def _drop_awaiting(self, replica_id: str) -> None:
        """A replica stopped while it waited for its image: it never gets a pod."""
        if self._awaiting.pop(replica_id, None) is not None:
            pending = self._created.pop(replica_id, None)
            if pending is not None:
                self._gone[replica_id] = replace(pending, exited=True, exit_reason="stopped while its image was "
                                                 "being pre-pulled (no pod was created)")  # fmt: skip

    async def stop(self, replica_id: str) -> None:
        self._drop_awaiting(replica_id)
        for name in self._members.get(replica_id, [replica_id]):
            await self.kube.delete(PODS, self.namespace, name, grace_period_s=None)

    async def kill(self, replica_id: str) -> None:
        self._drop_awaiting(replica_id)
        for name in self._members.get(replica_id, [replica_id]):
            await self.kube.delete(PODS, self.namespace, name, grace_period_s=0)

    async def forget(self, replica_id: str) -> None:
        self._created.pop(replica_id, None)
        if self._gone.pop(replica_id, None) is not None:
            for name in self._members.pop(replica_id, [])[1:]:   # gang members left behind
                await self.kube.delete(PODS, self.namespace, name, grace_period_s=0)
            return
        f = self._seen.get(replica_id)
        if f is None or not f.exited:
            return
        del self._seen[replica_id]             # a finished replica's pod objects are still there: delete them
        self._forgotten.add(replica_id)
        for name in self._members.get(replica_id, [replica_id]):
            await self.kube.delete(PODS, self.namespace, name, grace_period_s=0)

    async def log_tail(self, replica_id: str, lines: int = 20) -> list[str]:
        try:
            text = await self.kube.read_log(self.namespace, replica_id, lines)
        except ApiError:
            return []
        return text.splitlines()[-lines:]

    # ----- image pre-pull ---------------------------------------------------------------------

    def set_pre_pull(self, deployments: Iterable) -> None:
        """The selector-wide pre-pulls: each deployment (`fleet.spec.InferenceDeployment`) with
        ``spec.prePull`` has its engine image pulled onto every usable node matching its node
        selector, at most ``maxParallel`` pulls of that image at once. Called by the operator
        with the declared deployments."""
        targets = {}
        for dep in deployments:
            pull = getattr(dep.spec, "pre_pull", None)
            image = dep.spec.engine.image or self.settings.default_image
            if pull is not None and image and dep.spec.engine.image_pull_policy != "Never":
                targets[dep.name] = (image, dict(pull.node_selector), pull.max_parallel)
        self._pre_pull = targets

    async def _pre_pull_step(self, node_objs: list[dict], pull_pods: list[dict]) -> None:
        """Advance the pre-pulls: the pods of replicas whose images are now present are created,
        failures become Events, replicas whose pull was given up exit."""
        wanted: dict[tuple[str, str], int | None] = {}
        selected: dict[str, set[str]] = {}   # deployment -> nodes its spec.prePull selects
        usable = [o for o in node_objs if node_usable(o, self.settings) is None]
        for name, (image, selector, limit) in self._pre_pull.items():
            for obj in usable:
                labels = obj["metadata"].get("labels") or {}
                if all(labels.get(k) == v for k, v in selector.items()):
                    key = (obj["metadata"]["name"], image)
                    selected.setdefault(name, set()).add(key[0])
                    wanted[key] = limit if wanted.get(key, limit) is not None else None
        for _dep, image, pods in self._awaiting.values():
            for pod in pods:
                wanted[(pod_node(pod), image)] = None
        plan = await self.prepuller.reconcile(wanted, node_objs, pull_pods)
        now = self.clock()
        policy = self.prepuller.policy
        for rec in plan.failed:
            deployments = {d for d, image, pods in self._awaiting.values()
                           if image == rec.image and any(pod_node(p) == rec.node for p in pods)}
            deployments |= {d for d, (image, _s, _l) in self._pre_pull.items()
                            if image == rec.image and rec.node in selected.get(d, ())}
            for name in sorted(deployments):
                await self._event(name, "ImagePullFailed", rec.describe(now))
        names = {n["metadata"]["name"] for n in node_objs}
        for rid, (_dep, image, pods) in list(self._awaiting.items()):
            nodes = [pod_node(p) for p in pods]
            lost = [n for n in nodes if n not in names]
            pending = self._created.get(rid)
            if lost and pending is not None:
                del self._awaiting[rid]
                del self._created[rid]
                self._gone[rid] = replace(pending, exited=True, exit_reason=(
                    f"node {lost[0]} was lost (its Node object is gone) while image {image} was being pre-pulled"))
                continue
            if self._image_on(image, nodes):
                del self._awaiting[rid]
                self._launch(rid, pods)
                continue
            recs = [r for n in nodes if (r := policy.record(n, image)) is not None]
            # Only a replica that waited through the attempts fails; one that arrives later waits
            # for the next attempt (after the backoff) rather than fail at once.
            gave_up = [r for r in plan.failed if r.phase is Pull.GAVE_UP and r.image == image and r.node in nodes]
            if gave_up and pending is not None:
                del self._awaiting[rid]
                del self._created[rid]
                r = gave_up[0]
                self._gone[rid] = replace(pending, exited=True, exit_reason=(
                    f"image {image} could not be pulled onto node {r.node} ({r.failures} attempt(s)): {r.reason}"))
            elif pending is not None:
                what = "; ".join(r.describe(now) for r in recs) or f"waiting to pre-pull image {image}"
                self._created[rid] = replace(pending, detail={**pending.detail, "cache": what})

    async def _event(self, deployment: str, reason: str, message: str) -> None:
        from fleet.k8s.status import decision_event

        owner = self.owner_of(deployment)
        if owner is None:
            return
        try:
            await self.kube.create(EVENTS, self.namespace, decision_event(owner, reason, message[:1000],
                                                                          "fleet-operator", self.clock(), True))
        except Exception as err:  # noqa: BLE001 - an event is best effort
            log.debug("event not recorded: %s", err)
