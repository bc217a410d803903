"""An in-memory object store with the API server's semantics that Fleet relies on. A TEST
STAND-IN: no real API server runs on the test machines (docs/kubernetes.md).

Owns `ObjectStore`: objects by (resource, namespace, name) with a global resourceVersion;
create (409 AlreadyExists; 500 when it carries a resourceVersion), replace (of a custom resource:
422 without a resourceVersion) and merge patch (409 on a stale metadata.resourceVersion),
the status subresource (a main write never changes status, a status write never changes spec;
metadata.generation counts spec changes), delete (graceful for pods: deletionTimestamp first,
`finish_delete` later; an object with finalizers stays, marked, until a write removes the last
one, and no finalizer may be added to it; owner references cascade in the background, as the
garbage collector does), label selectors (=, ==, !=, in, notin, exists, !exists), and watches
that replay history after a resourceVersion (410 Gone when it is older than the kept window;
from ``""``: an ADDED event for each object there now) and send bookmarks.

Used by the fake client (tests/support/fake_kube.py) and by the HTTP stand-in (fleet/testing/k8s/apiserver.py).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import re
import uuid
from collections import deque
from dataclasses import dataclass, field

from fleet.k8s.client import INFERENCE_DEPLOYMENTS, PODS, ApiError, Conflict, Gone, NotFound, Resource

STATUS_SUBRESOURCE = {INFERENCE_DEPLOYMENTS.plural}
# Custom resources: an update must name the resourceVersion it replaces (the real API server's
# custom-resource strategy allows no unconditional update; core kinds do).
CUSTOM = {INFERENCE_DEPLOYMENTS.plural}


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: object, patch: object) -> object:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


_REQ = re.compile(r"^\s*(!?)([\w./-]+)\s*(?:(==|=|!=)\s*([\w.-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$")


def parse_selector(selector: str | None) -> list[tuple[str, str, set[str]]]:
    """``a=b,c!=d,e in (x,y),f,!g`` -> requirements (key, op, values). Raises ApiError 400."""
    if not selector:
        return []
    parts, depth, cur = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    reqs = []
    for part in parts:
        m = _REQ.match(part)
        if not m:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {part!r}")
        neg, key, op, value, setop, values = m.groups()
        if op:
            reqs.append((key, "!=" if op == "!=" else "=", {value}))
        elif setop:
            reqs.append((key, setop, {v.strip() for v in values.split(",") if v.strip()}))
        else:
            reqs.append((key, "!exists" if neg else "exists", set()))
    return reqs


def selector_matches(reqs: list[tuple[str, str, set[str]]], labels: dict[str, str]) -> bool:
    for key, op, values in reqs:
        have = labels.get(key)
        if op == "=" and have not in values:
            return False
        if op == "!=" and have in values:
            return False
        if op == "in" and have not in values:
            return False
        if op == "notin" and have in values:
            return False
        if op == "exists" and key not in labels:
            return False
        if op == "!exists" and key in labels:
            return False
    return True


@dataclass
class _Watcher:
    plural: str
    namespace: str | None
    selector: list
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class ObjectStore:
    """The state of one stand-in API server. ``history`` events are kept for watch resumption."""

    def __init__(self, history: int = 50_000) -> None:
        self.objects: dict[tuple[str, str | None, str], dict] = {}
        self.rv = itertools.count(1)
        self.current_rv = 0
        self.events: deque[tuple[int, str, str, dict]] = deque(maxlen=history)   # (rv, plural, type, obj)
        self.watchers: list[_Watcher] = []
        self.logs: dict[tuple[str, str], str] = {}
        self.writes = 0
        self.graceful_pod_delete = True

    # ----- helpers ----------------------------------------------------------------------------

    def _key(self, res: Resource, namespace: str | None, name: str) -> tuple[str, str | None, str]:
        return (res.plural, namespace if res.namespaced else None, name)

    def _bump(self, obj: dict) -> int:
        self.current_rv = next(self.rv)
        obj["metadata"]["resourceVersion"] = str(self.current_rv)
        return self.current_rv

    def _emit(self, res: Resource, type_: str, obj: dict) -> None:
        rv = int(obj["metadata"]["resourceVersion"])
        snapshot = copy.deepcopy(obj)
        self.events.append((rv, res.plural, type_, snapshot))
        for w in list(self.watchers):
            if w.plural == res.plural and self._visible(w.namespace, w.selector, snapshot):
                w.queue.put_nowait((type_, snapshot))
        self.writes += 1

    @staticmethod
    def _visible(namespace: str | None, selector: list, obj: dict) -> bool:
        meta = obj["metadata"]
        if namespace is not None and meta.get("namespace") not in (None, namespace):
            return False
        return selector_matches(selector, meta.get("labels") or {})

    def _get(self, res: Resource, namespace: str | None, name: str) -> dict:
        obj = self.objects.get(self._key(res, namespace, name))
        if obj is None:
            raise NotFound(404, "NotFound", f'{res.plural} "{name}" not found')
        return obj

    @staticmethod
    def _check_rv(current: dict, body: dict) -> None:
        want = (body.get("metadata") or {}).get("resourceVersion")
        have = current["metadata"]["resourceVersion"]
        if want and want != have:
            name = current["metadata"]["name"]
            raise Conflict(409, "Conflict", f'Operation cannot be fulfilled on "{name}": the object has been '
                                            "modified; please apply your changes to the latest version and try again")

    # ----- API --------------------------------------------------------------------------------

    def list(self, res: Resource, namespace: str | None, label_selector: str | None) -> tuple[list[dict], str]:
        reqs = parse_selector(label_selector)
        items = [copy.deepcopy(o) for (plural, _ns, _n), o in self.objects.items()
                 if plural == res.plural and self._visible(namespace, reqs, o)]  # fmt: skip
        return items, str(self.current_rv)

    def get(self, res: Resource, namespace: str | None, name: str) -> dict:
        return copy.deepcopy(self._get(res, namespace, name))

    def create(self, res: Resource, namespace: str | None, body: dict) -> dict:
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        name = meta.get("name")
        if not name:
            raise ApiError(422, "Invalid", "metadata.name: Required value")
        if meta.get("resourceVersion"):   # as the real API server answers (its storage layer refuses)
            raise ApiError(500, "InternalError", "resourceVersion should not be set on objects to be created")
        key = self._key(res, namespace, name)
        if key in self.objects:
            raise Conflict(409, "AlreadyExists", f'{res.plural} "{name}" already exists')
        obj.setdefault("apiVersion", res.api_version)
        obj.setdefault("kind", res.kind)
        if res.namespaced:
            meta["namespace"] = namespace
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_iso()
        meta["generation"] = 1
        if res.plural in STATUS_SUBRESOURCE:
            obj.pop("status", None)
        self._bump(obj)
        self.objects[key] = obj
        self._emit(res, "ADDED", obj)
        return copy.deepcopy(obj)

    def _write(self, res: Resource, current: dict, new: dict) -> dict:
        meta, was = new["metadata"], current["metadata"]
        if was.get("deletionTimestamp") and set(meta.get("finalizers") or []) - set(was.get("finalizers") or []):
            raise ApiError(422, "Invalid", f'{res.plural} "{was["name"]}" is invalid: metadata.finalizers: '
                                           "Forbidden: no new finalizers can be added if the object is being deleted")
        if res.plural in STATUS_SUBRESOURCE:
            new["status"] = copy.deepcopy(current.get("status"))
            if new.get("status") is None:
                new.pop("status", None)
        for keep in ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp"):
            if keep in current["metadata"]:
                new["metadata"][keep] = current["metadata"][keep]
        generation = current["metadata"].get("generation", 1)
        new["metadata"]["generation"] = generation + (new.get("spec") != current.get("spec"))
        if new == current:
            return copy.deepcopy(current)   # no-op writes do not bump the resourceVersion
        self._bump(new)
        self.objects[self._key(res, current["metadata"].get("namespace"), current["metadata"]["name"])] = new
        self._emit(res, "MODIFIED", new)
        meta = new["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers") and res.plural != PODS.plural:
            self.finish_delete(res, meta.get("namespace"), meta["name"])   # the last finalizer went
        return copy.deepcopy(new)

    def replace(self, res: Resource, namespace: str | None, name: str, body: dict) -> dict:
        current = self._get(res, namespace, name)
        if res.plural in CUSTOM and not (body.get("metadata") or {}).get("resourceVersion"):
            raise ApiError(422, "Invalid", f'{res.plural} "{name}" is invalid: metadata.resourceVersion: '
                                           "Invalid value: 0x0: must be specified for an update")
        self._check_rv(current, body)
        new = copy.deepcopy(body)
        new.setdefault("metadata", {})["resourceVersion"] = current["metadata"]["resourceVersion"]
        return self._write(res, current, new)

    def patch(self, res: Resource, namespace: str | None, name: str, patch: dict) -> dict:
        current = self._get(res, namespace, name)
        self._check_rv(current, patch)
        new = merge_patch(current, patch)
        new["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        return self._write(res, current, new)

    def patch_status(self, res: Resource, namespace: str | None, name: str, patch: dict) -> dict:
        current = self._get(res, namespace, name)
        self._check_rv(current, patch)
        new = copy.deepcopy(current)
        if "status" in patch:
            new["status"] = merge_patch(current.get("status") or {}, patch["status"])
        if new == current:
            return copy.deepcopy(current)
        self._bump(new)
        self.objects[self._key(res, namespace, name)] = new
        self._emit(res, "MODIFIED", new)
        return copy.deepcopy(new)

    def delete(self, res: Resource, namespace: str | None, name: str, grace_period_s: int | None = None) -> None:
        key = self._key(res, namespace, name)
        obj = self.objects.get(key)
        if obj is None:
            raise NotFound(404, "NotFound", f'{res.plural} "{name}" not found')
        graceful = res.plural == PODS.plural and self.graceful_pod_delete and grace_period_s != 0 \
            and (obj.get("spec") or {}).get("nodeName")
        if graceful or obj["metadata"].get("finalizers"):
            if "deletionTimestamp" not in obj["metadata"]:
                new = copy.deepcopy(obj)
                new["metadata"]["deletionTimestamp"] = now_iso()
                grace_s = 30 if grace_period_s is None else grace_period_s
                new["metadata"]["deletionGracePeriodSeconds"] = grace_s if graceful else 0   # finalizers only: 0
                self._bump(new)
                self.objects[key] = new
                self._emit(res, "MODIFIED", new)
            return
        self.finish_delete(res, namespace, name)

    def finish_delete(self, res: Resource, namespace: str | None, name: str) -> None:
        """Remove the object now (the kubelet confirmed a pod's containers are gone), and every
        object it owns (background cascade)."""
        obj = self.objects.pop(self._key(res, namespace, name), None)
        if obj is None:
            return
        self._bump(obj)
        self._emit(res, "DELETED", obj)
        uid = obj["metadata"].get("uid")
        for (plural, ns, n), other in list(self.objects.items()):
            owners = other["metadata"].get("ownerReferences") or []
            if any(o.get("uid") == uid for o in owners):
                owned = next(r for r in _RESOURCES if r.plural == plural)
                try:
                    self.delete(owned, ns, n)
                except NotFound:
                    pass

    # ----- watch ------------------------------------------------------------------------------

    def subscribe(self, res: Resource, namespace: str | None, resource_version: str,
                  label_selector: str | None) -> _Watcher:  # fmt: skip
        """A watcher that first gets every kept event after ``resource_version``; with ``""``, an
        ADDED event for each object there now (the real API server's "start at most recent";
        ``"0"`` replays from this store's beginning, which its lists report as ``"0"`` while empty). Raises `Gone` when that version is older than the kept history."""
        reqs = parse_selector(label_selector)
        w = _Watcher(res.plural, namespace, reqs)
        if resource_version == "":
            for (plural, _ns, _n), obj in self.objects.items():
                if plural == res.plural and self._visible(namespace, reqs, obj):
                    w.queue.put_nowait(("ADDED", copy.deepcopy(obj)))
            self.watchers.append(w)
            return w
        since = int(resource_version)
        if resource_version and self.events and since < self.events[0][0] - 1 and len(self.events) == self.events.maxlen:
            raise Gone(410, "Expired", f"too old resource version: {since} ({self.events[0][0]})")
        for rv, plural, type_, obj in self.events:
            if rv > since and plural == res.plural and self._visible(namespace, reqs, obj):
                w.queue.put_nowait((type_, copy.deepcopy(obj)))
        self.watchers.append(w)
        return w

    def unsubscribe(self, w: _Watcher) -> None:
        if w in self.watchers:
            self.watchers.remove(w)


def _all_resources() -> tuple[Resource, ...]:
    from fleet.testing.k8s.resources import BOX_RESOURCES

    return BOX_RESOURCES


_RESOURCES = _all_resources()
