"""A Helm release applied the way Helm applies it, for tests on a real API server: install,
upgrade (a three-way merge per object) and uninstall of rendered manifests (``helm template``),
for any kind the server serves. A TEST STAND-IN for ``helm install/upgrade/uninstall``'s
client-side apply (Helm's pkg/kube/client.go ``Create``, ``Update``, ``Delete``): no release
Secret, no hooks, no waiting.

Owns `three_way` (Helm's merge of the release's manifest, the new manifest and the live object),
`Release` (install, upgrade, uninstall over a `KubeClient`) and `Applied` (what each step did).
Called by tests/integration/test_helm_upgrade_real.py.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

from fleet.k8s.client import Conflict, KubeClient, NotFound, Resource

# Helm's install order (pkg/release/util/kind_sorter.go InstallOrder); uninstall runs it backwards.
INSTALL_ORDER = ("Namespace", "NetworkPolicy", "ResourceQuota", "LimitRange", "PodSecurityPolicy",
                 "PodDisruptionBudget", "ServiceAccount", "Secret", "ConfigMap", "CustomResourceDefinition",
                 "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Service", "DaemonSet", "Pod",
                 "ReplicaSet", "Deployment", "HorizontalPodAutoscaler", "StatefulSet", "Job", "CronJob",
                 "IngressClass", "Ingress", "APIService")  # fmt: skip
KEEP = ("helm.sh/resource-policy", "keep")
RELEASE_NAME, RELEASE_NAMESPACE = "meta.helm.sh/release-name", "meta.helm.sh/release-namespace"


def key(doc: dict, namespace: str | None) -> tuple[str, str, str | None, str]:
    """Helm's identity of an object (pkg/kube/resource.go ``isMatchingInfo``): group, kind,
    namespace, name. The version is not part of it: ``policy/v1beta1`` and ``policy/v1``
    PodDisruptionBudgets of one name are one object."""
    group = doc["apiVersion"].rpartition("/")[0]
    return group, doc["kind"], namespace, doc["metadata"]["name"]


def three_way(original: object, target: object, live: object) -> object:
    """The object Helm's upgrade leaves: ``live`` with what changed from ``original`` (the
    release's manifest) to ``target`` (the new one) applied. A key ``original`` set and ``target``
    drops is removed; a key ``target`` sets is set to its value (and so is one that drifted live);
    a key neither manifest sets (server defaults, ``clusterIP``, ``resourceVersion``, another
    writer's fields) stays. Mappings merge key by key; lists of mappings that all carry a
    ``name`` merge item by item, as a strategic merge patch does with containers, env and
    volumes (items another writer added stay); other lists are replaced whole."""
    if isinstance(target, dict) and isinstance(live, dict):
        original = original if isinstance(original, dict) else {}
        out = {k: v for k, v in live.items() if not (k in original and k not in target)}
        for k, v in target.items():
            out[k] = three_way(original.get(k), v, live[k]) if k in live else copy.deepcopy(v)
        return out
    if _named(target) and _named(live):
        before = {item["name"]: item for item in original} if _named(original) else {}
        now = {item["name"]: item for item in live}
        merged = [three_way(before.get(t["name"]), t, now[t["name"]]) if t["name"] in now else copy.deepcopy(t)
                  for t in target]  # fmt: skip
        wanted = {t["name"] for t in target}
        return merged + [item for name, item in now.items() if name not in wanted and name not in before]
    return copy.deepcopy(target)


def _named(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) and "name" in v for v in value)


@dataclass
class Applied:
    """What one step did, by `key`: created, updated (a write that changed the object),
    unchanged (the merge changed nothing: no write), deleted, kept (``helm.sh/resource-policy:
    keep``), skipped (a kind the server does not serve: the reason)."""

    created: list[tuple] = field(default_factory=list)
    updated: list[tuple] = field(default_factory=list)
    unchanged: list[tuple] = field(default_factory=list)
    deleted: list[tuple] = field(default_factory=list)
    kept: list[tuple] = field(default_factory=list)
    skipped: dict[tuple, str] = field(default_factory=dict)


class Release:
    """Release ``name`` in ``namespace`` on ``kube``; ``resource(apiVersion, kind)`` gives a kind's
    `Resource` from the server's discovery (raising KeyError when it is not served)."""

    def __init__(self, kube: KubeClient, resource: Callable[[str, str], Resource], name: str, namespace: str,
                 attempts: int = 5) -> None:  # fmt: skip
        self.kube, self.resource, self.name, self.namespace = kube, resource, name, namespace
        self.attempts = attempts

    def _where(self, doc: dict) -> tuple[Resource, str | None]:
        res = self.resource(doc["apiVersion"], doc["kind"])
        return res, (self.namespace if res.namespaced else None)

    def _owned(self, doc: dict) -> dict:
        """``doc`` with the ownership annotations Helm puts on every object it creates."""
        doc = copy.deepcopy(doc)
        notes = doc["metadata"].setdefault("annotations", None) or {}
        doc["metadata"]["annotations"] = {**notes, RELEASE_NAME: self.name, RELEASE_NAMESPACE: self.namespace}
        return doc

    def _ordered(self, docs: list[dict], reverse: bool = False) -> list[dict]:
        rank = {kind: i for i, kind in enumerate(INSTALL_ORDER)}
        return sorted(docs, key=lambda d: rank.get(d["kind"], len(rank)), reverse=reverse)

    async def install(self, docs: list[dict]) -> Applied:
        """Create each of ``docs`` in install order (a kind the server does not serve is skipped
        and said). Raises `ApiError` as the server refuses an object."""
        out = Applied()
        for doc in self._ordered(docs):
            try:
                res, ns = self._where(doc)
            except KeyError as err:
                out.skipped[key(doc, self.namespace)] = str(err)
                continue
            await self.kube.create(res, ns, self._owned(doc))
            out.created.append(key(doc, ns))
        return out

    async def upgrade(self, original: list[dict], target: list[dict]) -> Applied:
        """``helm upgrade`` from the release's manifest ``original`` to ``target``: each target
        object created when it is not live, else written back as `three_way` merges it (a PUT
        carrying the live resourceVersion, merged again from a fresh read on a 409); then each
        object only ``original`` has is deleted, unless it says ``helm.sh/resource-policy:
        keep``. A live object the release does not own (no ``meta.helm.sh/release-name`` of this
        release) raises RuntimeError, as Helm refuses to import it. Raises `ApiError` as the
        server refuses a write."""
        out = Applied()
        before = {key(d, self.namespace if self._namespaced(d) else None): d for d in original}
        wanted = set()
        for doc in self._ordered(target):
            res, ns = self._where(doc)
            k = key(doc, ns)
            wanted.add(k)
            await self._update(res, ns, before.get(k), doc, k, out)
        for k, doc in before.items():
            if k not in wanted:
                await self._delete(doc, out)
        return out

    def _namespaced(self, doc: dict) -> bool:
        try:
            return self.resource(doc["apiVersion"], doc["kind"]).namespaced
        except KeyError:   # not served here: the old manifest's policy/v1 on 1.20; as served under another version
            return doc["kind"] not in ("CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "Namespace")

    async def _update(self, res: Resource, ns: str | None, original: dict | None, doc: dict, k: tuple,
                      out: Applied) -> None:  # fmt: skip
        name = doc["metadata"]["name"]
        for _ in range(self.attempts):
            try:
                live = await self.kube.get(res, ns, name)
            except NotFound:
                await self.kube.create(res, ns, self._owned(doc))
                out.created.append(k)
                return
            if (live["metadata"].get("annotations") or {}).get(RELEASE_NAME) != self.name:
                raise RuntimeError(f"{doc['kind']} {name} exists and is not owned by release {self.name}")
            merged = three_way(self._owned(original) if original else None, self._owned(doc), live)
            if merged == live:
                out.unchanged.append(k)
                return
            try:
                await self.kube.replace(res, ns, name, merged)
            except Conflict:
                continue   # written meanwhile (a controller's status, say): merge onto the new one
            out.updated.append(k)
            return
        raise RuntimeError(f"{doc['kind']} {name}: {self.attempts} writes refused as stale (409)")

    async def _delete(self, doc: dict, out: Applied) -> None:
        try:
            res, ns = self._where(doc)
            live = await self.kube.get(res, ns, doc["metadata"]["name"])
        except (KeyError, NotFound):
            return   # never created, or gone
        k = key(doc, ns)
        if (live["metadata"].get("annotations") or {}).get(KEEP[0]) == KEEP[1]:
            out.kept.append(k)
            return
        await self.kube.delete(res, ns, doc["metadata"]["name"])
        out.deleted.append(k)

    async def uninstall(self, docs: list[dict]) -> Applied:
        """``helm uninstall``: delete each of ``docs`` (the release's manifest) in reverse install
        order, background propagation, except those that say ``helm.sh/resource-policy: keep``."""
        out = Applied()
        for doc in self._ordered(docs, reverse=True):
            await self._delete(doc, out)
        return out
