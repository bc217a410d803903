"""The node agent's report of weight warmth on Kubernetes: the model sources its weight cache
holds, written as the annotation ``fleet.inference.dev/cached`` on its own Node.

Owns `annotation_value` and `NodeAnnotator` (patches the Node through `fleet.k8s.client.Kube`
when the value changes, nothing otherwise). The sources are the cache's canonical ones
(`fleet.agent.cache.WeightCache.cached_sources`: ``hf://org/name@revision``, a manifest URL),
the form `PlacementRequest.is_warm` compares ``spec.model.source`` in
(`fleet.placement.shapes.canonical_source`), as the local backend reports them in `fleet up`. The other half
of warmth, the container images, is the kubelet's own ``Node.status.images``;
`fleet.inventory.gfd.node_from_k8s` merges both into `NodeInventory.cached`, which
`fleet.placement.shapes.PlacementRequest.is_warm` reads.

Used by `fleet node-agent --annotate-node` (fleet/cli/agent.py), which runs in the chart's
DaemonSet with its node's name from the downward API (``spec.nodeName`` as ``NODE_NAME``) and a
service account allowed to get and patch nodes (charts/fleet/templates/agent-daemonset.yaml).
Optional: without the flag the agent makes no API call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from fleet.agent.cache import WeightCache
from fleet.inventory.gfd import LabelKeys
from fleet.k8s.client import NODES, Kube

log = logging.getLogger("fleet.node_agent")

ANNOTATION = LabelKeys().cached
MAX_VALUE_CHARS = 64 * 1024
"""The annotation's longest value (the API server caps all annotations of an object at 256 KiB)."""


def annotation_value(sources: Iterable[str]) -> str:
    """``a,b,c`` (sorted), cut to whole entries within `MAX_VALUE_CHARS`; a source with a comma
    cannot be listed (the annotation is comma-separated) and is left out."""
    value = ""
    for s in sorted({s for s in sources if "," not in s}):
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

    def publish_cache(self, cache: WeightCache) -> None:
        """`publish` the sources ``cache`` holds, from the agent's own thread (no event loop
        runs there: `fleet.agent.runner.NodeAgent` ``on_step``). Never raises."""
        try:
            asyncio.run(self.publish(cache.cached_sources()))
        except Exception as err:  # noqa: BLE001 - the agent's loop survives; the next step retries
            log.warning("cannot annotate node %s with %s: %s", self.node, self.key, err)
