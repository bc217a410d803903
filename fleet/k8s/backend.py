"""The Kubernetes backend: the second implementation of the replica protocol
(`fleet.backends.base.Backend`); a replica is a Pod.

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

Objects come from informers when the operator gives them (`fleet.k8s.informer`: list + watch),
else from a list per call. Every call goes through `fleet.k8s.client.Kube`.
Created by the operator (`fleet.k8s.operator`) per namespace.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from fleet.backends.base import ReplicaFacts, ReplicaWant
from fleet.inventory import Inventory
from fleet.inventory.gfd import LabelKeys, node_from_k8s
from fleet.k8s.client import NODES, PODS, ApiError, Conflict, Kube
from fleet.k8s.pods import LABEL_FLEET, LABEL_MANAGED_BY, LABEL_REPLICA, MANAGED_BY, EnginePodSettings, \
    group_facts, label_value, pod_group  # fmt: skip

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
    node selector does not match, or a NoSchedule/NoExecute taint is not tolerated."""
    spec = node.get("spec") or {}
    labels = node["metadata"].get("labels") or {}
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


class KubernetesBackend:
    """Replicas as pods in ``namespace`` (`fleet.backends.base.Backend`)."""

    def __init__(self, kube: Kube, namespace: str, fleet_id: str, *, settings: EnginePodSettings | None = None,
                 owner_of: Callable[[str], dict | None] = lambda deployment: None,
                 pods: ObjectSource | None = None, nodes: ObjectSource | None = None,
                 label_keys: LabelKeys = LabelKeys()) -> None:  # fmt: skip
        """``fleet_id``: the value of the fleet label on this fleet's pods; ``owner_of``: the
        InferenceDeployment object of a deployment name (its pods' owner), None if unknown."""
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
        self._creating: set[asyncio.Task] = set()
        self._create_slots = asyncio.Semaphore(CREATE_CONCURRENCY)

    # ----- Backend ----------------------------------------------------------------------------

    async def inventory(self) -> Inventory:
        nodes = []
        self.unusable_nodes = {}
        for obj in sorted(await self.nodes.items(), key=lambda n: n["metadata"]["name"]):
            why = node_usable(obj, self.settings)
            if why:
                self.unusable_nodes[obj["metadata"]["name"]] = why
                continue
            key = (obj["metadata"]["name"], obj["metadata"].get("resourceVersion"))
            try:
                if key not in self._node_cache:   # a node changes rarely; its inventory is built once per version
                    self._node_cache[key] = node_from_k8s(obj, self.label_keys)
                nodes.append(self._node_cache[key])
            except ValueError as err:
                self.unusable_nodes[obj["metadata"]["name"]] = str(err)
        current = {(n.name, None) for n in nodes}
        if len(self._node_cache) > 2 * len(nodes) + 16:
            self._node_cache = {k: v for k, v in self._node_cache.items() if (k[0], None) in current}
        return Inventory(tuple(nodes))

    async def ensure(self, want: ReplicaWant) -> None:
        rid = want.replica_id
        if rid in self._seen or rid in self._gone or rid in self._created or rid in self._forgotten:
            return
        pods = pod_group(want, fleet_id=self.fleet_id, owner=self.owner_of(want.deployment.name),
                         settings=self.settings)  # fmt: skip
        self._members[rid] = [p["metadata"]["name"] for p in pods]
        self._created[rid] = ReplicaFacts(rid, want.deployment.name, want.spec_hash, want.placement.nodes[0],
                                          detail={"pod": rid, "phase": "Pending"})  # fmt: skip
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
        nodes = {n["metadata"]["name"] for n in await self.nodes.items()}
        groups: dict[str, list[dict]] = {}
        for pod in await self.pods.items():
            rid = (pod["metadata"].get("labels") or {}).get(LABEL_REPLICA, pod["metadata"]["name"])
            groups.setdefault(rid, []).append(pod)
        for rid, pods in groups.items():
            self._members[rid] = sorted({*self._members.get(rid, ()), *(p["metadata"]["name"] for p in pods)})
            f = group_facts(pods)
            if f.exited and rid in self._created and "missing" in (f.exit_reason or ""):
                continue   # a gang whose members are still being created (or not yet seen): pending
            lost = sorted({(p.get("spec") or {}).get("nodeName") for p in pods} - nodes - {None, ""})
            if lost and not f.exited:   # a node object is gone: the node is lost
                f = replace(f, running=False, exited=True, endpoint=None,
                            exit_reason=f"node {lost[0]} was lost (its Node object is gone)")
            facts[rid] = f
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
        # Created, not yet seen (the informer lags the create): starting, not missing.
        pending = {rid: f for rid, f in self._created.items() if rid not in visible}
        return {**pending, **self._gone, **visible}

    async def stop(self, replica_id: str) -> None:
        for name in self._members.get(replica_id, [replica_id]):
            await self.kube.delete(PODS, self.namespace, name, grace_period_s=None)

    async def kill(self, replica_id: str) -> None:
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
