"""The node agent's report of weight warmth on Kubernetes: the model sources its weight cache
holds, written as the annotation ``fleet.inference.dev/cached`` on its own Node.

Owns `cached_sources` (cache entries -> the source strings a deployment's
``spec.model.source`` is compared with), `annotation_value` and `NodeAnnotator` (patches the
Node through `fleet.k8s.client.Kube` when the value changes, nothing otherwise). The other half
of warmth, the container images, is the kubelet's own ``Node.status.images``;
`fleet.inventory.gfd.node_from_k8s` merges both into `NodeInventory.cached`, which
`fleet.placement.shapes.PlacementRequest.is_warm` reads.

Used by `fleet node-agent --annotate-node` (fleet/cli_agent.py), which runs in the chart's
DaemonSet with its node's name from the downward API (``spec.nodeName`` as ``NODE_NAME``) and a
service account allowed to get and patch nodes (charts/fleet/templates/agent-daemonset.yaml).
Optional: without the flag the agent makes no API call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from fleet.inventory.gfd import LabelKeys
from fleet.k8s.client import NODES, Kube

log = logging.getLogger("fleet.node_agent")

ANNOTATION = LabelKeys().cached
MAX_VALUE_CHARS = 64 * 1024
"""The annotation's longest value (the API server caps all annotations of an object at 256 KiB)."""


def cached_sources(entries: Iterable[Mapping[str, Any]]) -> list[str]:
    """The source strings of cached models, sorted: each entry's source as the cache records it
    (`fleet.agent.cache.CacheEntry.source`: an http(s) manifest URL, or ``hf://org/name``), and
    for the hub also ``hf://org/name@<commit>`` (a deployment may pin the commit). ``entries``:
    `CacheEntry` objects or the dicts of `fleet.agent.runner.NodeAgent.status` ``cache``."""
    out: set[str] = set()
    for e in entries:
        source = e["source"] if isinstance(e, Mapping) else e.source
        revision = e["revision"] if isinstance(e, Mapping) else e.revision
        out.add(source)
        if source.startswith("hf://") and "@" not in source and revision:
            out.add(f"{source}@{revision}")
    return sorted(s for s in out if "," not in s)   # the annotation is comma-separated


def annotation_value(sources: Iterable[str]) -> str:
    """``a,b,c`` (sorted), cut to whole entries within `MAX_VALUE_CHARS`."""
    value = ""
    for s in sorted(set(sources)):
        candidate = f"{value},{s}" if value else s
        if len(candidate) > MAX_VALUE_CHARS:
            log.warning("annotation %s: %d characters at most; %s and later sources left out", ANNOTATION,
                        MAX_VALUE_CHARS, s)  # fmt: skip
            break
        value = candidate
    return value


class NodeAnnotator:
    """Writes ``key`` on Node ``node`` when the cached sources change (one merge patch; an empty
    set removes the annotation). A failed patch is logged and retried at the next publish."""

    def __init__(self, kube: Kube, node: str, key: str = ANNOTATION) -> None:
        self.kube = kube
        self.node = node
        self.key = key
        self.last: str | None = None
        self.patches = 0

    async def publish(self, sources: Iterable[str]) -> bool:
        """Patch the Node if the value differs from the last one written; True when patched.
        Raises `fleet.k8s.client.ApiError` when the API server refuses."""
        value = annotation_value(sources)
        if value == self.last:
            return False
        await self.kube.patch(NODES, None, self.node, {"metadata": {"annotations": {self.key: value or None}}})
        self.last = value
        self.patches += 1
        return True

    def publish_status(self, status: Mapping[str, Any]) -> None:
        """`publish` from a node agent's status (its ``cache`` list), from the agent's own thread
        (`fleet.agent.runner.NodeAgent` ``on_step``). Never raises."""
        try:
            asyncio.run(self.publish(cached_sources(status.get("cache") or [])))
        except Exception as err:  # noqa: BLE001 - the agent's loop survives; the next step retries
            log.warning("cannot annotate node %s with %s: %s", self.node, self.key, err)
