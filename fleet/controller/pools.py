"""The router's view of each deployment: the pools the controller publishes.

Owns `PoolSink` (the router admin API as the controller sees it: `fleet.controller.router_admin`
on one machine, `fleet.k8s.routers` fanning out to router pods on Kubernetes) and `PoolPublisher`,
a collaborator of `fleet.controller.reconcile.Controller` that works on its
`fleet.controller.targets.FleetRecords`: once per tick (`publish`, the last step of
`Controller.reconcile_once`) it writes each deployment's pool (`router.pools.spec.PoolSpec`: the
replicas that passed warm-up, their revision's label and weight, DRAINING ones marked draining;
where the router gets the model's tokenizer, `tokenizer_source`)
where it changed since the last write, and drains the pool of each retired deployment through
the router before deleting it. A failed write is logged and tried again next tick; no target is
changed here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Protocol

from fleet.agent.cache import cached_hub_dir
from fleet.controller.lifecycle import Replica, ReplicaStatus
from fleet.controller.targets import DeploymentRecord, FleetRecords
from fleet.rollout.revisions import endpoint_weights, revision_label
from fleet.sources import parse_source
from fleet.spec import LoadedDeployment
from router.pools.spec import EndpointSpec, KvEventsSource, PoolSpec, StreamLimitsSpec

log = logging.getLogger("fleet.controller")

PUBLISH_CONCURRENCY = 16
"""Pool updates sent to the router at once (each its own admin API request)."""
TOKENIZER_RECHECK_S = 60.0
"""Seconds before a model without a tokenizer directory on this machine is looked for again."""


def tokenizer_source(ld: LoadedDeployment) -> str | None:
    """Where the router gets the deployment's tokenizer (`router.pools.spec.PoolSpec.tokenizer`): the
    directory holding its tokenizer.json on this machine (the model's own directory for a path or
    ``file://`` source, this machine's weight-cache entry for an ``hf://`` one); else, for an
    ``hf://`` source, the source itself (``hf://org/name@revision``: the router fetches the
    tokenizer files from the hub, as a router pod on Kubernetes must: it holds no weights); None
    otherwise (``sim://``, a directory without tokenizer.json, an http(s) manifest). Reads the file
    system."""
    source = ld.deployment.spec.model.source
    local = ld.deployment.spec.model.local_path(ld.base_dir)
    directory = local if local is not None else cached_hub_dir(source)
    if directory is not None and (Path(directory) / "tokenizer.json").is_file():
        return str(directory)
    if source.startswith("hf://"):
        return parse_source(source).canonical
    return None


class PoolSink(Protocol):
    """Where the controller publishes each model's pool: the router's admin API. The pool document
    is `router.pools.spec.PoolSpec`, the one definition the router parses."""

    async def put_pool(self, model: str, pool: PoolSpec) -> None:
        """Replace the pool of ``model``. Raises on failure (retried next tick)."""
        ...

    async def delete_pool(self, model: str) -> None:
        """Remove the pool of ``model`` (absent is fine). Raises on failure."""
        ...

    async def in_flight(self) -> dict[str, int]:
        """Endpoint id -> requests in flight at the router, over all pools."""
        ...


class PoolPublisher:
    """Publishes the pools of the deployments in ``records`` to ``pool_sink`` (see the module
    docstring). What was last written is kept per deployment (`DeploymentRecord.last_pool`) and,
    for retired deployments, here."""

    def __init__(self, records: FleetRecords, pool_sink: PoolSink) -> None:
        self.records = records
        self.pool_sink = pool_sink
        self._retired_pools: dict[str, PoolSpec] = {}   # pools of retired deployments as last published
        self._tokenizers: dict[tuple[str, Path], tuple[str | None, float]] = {}   # (source, base) -> (dir, when)

    def forget(self) -> None:
        """The router lost its pools (it was restarted): publish every pool again next tick."""
        for ds in self.records.deployments.values():
            ds.last_pool = None

    def all_published(self) -> bool:
        """Whether every deployment's pool has been written since the last `forget`."""
        return all(ds.last_pool is not None for ds in self.records.deployments.values())

    async def publish(self, deadline: float) -> None:
        """Write the pools that changed; stops sending new chunks once ``time.monotonic()``
        passes ``deadline`` (the tick's budget; the rest goes next tick)."""
        for name, model in list(self.records.retired.items()):  # drained through the router, then deleted
            endpoints = self.endpoints(name)
            if not endpoints:
                await self.pool_sink.delete_pool(model)
                del self.records.retired[name]
                self._retired_pools.pop(model, None)
            elif self._retired_pools.get(model) != (pool := PoolSpec(endpoints=endpoints)):
                await self.pool_sink.put_pool(model, pool)
                self._retired_pools[model] = pool
        changed: list[tuple[DeploymentRecord, PoolSpec]] = []
        for name, ds in self.records.deployments.items():
            routing = ds.loaded.deployment.spec.routing
            endpoints = self.endpoints(name)
            stickiness = ds.loaded.deployment.spec.rollout.stickiness
            sticky_key = None if stickiness is None else (
                f"header:{stickiness.header}" if stickiness.header else "body:user")
            pool = PoolSpec(
                policy=routing.policy, endpoints=endpoints,
                max_concurrency_per_endpoint=routing.max_concurrency_per_endpoint,
                max_queue_length=routing.max_queue_length, queue_timeout_s=routing.queue_timeout_seconds,
                sticky_key=sticky_key, tokenizer=self._tokenizer(ds.loaded),
                first_token_timeout_s=routing.first_token_timeout_seconds,
                max_retries=routing.max_retries, migration_limit=routing.migration_limit,
                stream_limits=StreamLimitsSpec(max_stream_duration_s=routing.max_stream_duration_seconds,
                                               min_bytes_per_s=routing.min_bytes_per_second,
                                               rate_window_s=routing.byte_rate_window_seconds),
            )  # fmt: skip
            if pool != ds.last_pool:
                changed.append((ds, pool))
        if not changed:
            return
        slots = asyncio.Semaphore(PUBLISH_CONCURRENCY)

        async def put(ds: DeploymentRecord, pool: PoolSpec) -> None:
            async with slots:
                await self.pool_sink.put_pool(ds.model, pool)
            ds.last_pool = pool

        # 1,000 new deployments are 1,000 pools: sent side by side, each one retried next tick if it
        # failed; in chunks, until the tick's budget is spent (the rest next tick).
        failed = []
        for at in range(0, len(changed), PUBLISH_CONCURRENCY * 4):
            chunk = changed[at: at + PUBLISH_CONCURRENCY * 4]
            results = await asyncio.gather(*(put(ds, pool) for ds, pool in chunk), return_exceptions=True)
            failed += [(ds.model, r) for (ds, _), r in zip(chunk, results) if isinstance(r, BaseException)]
            if time.monotonic() > deadline:
                break
        if failed:
            log.warning("cannot publish %d pool(s) (retried next tick); first: %s: %r", len(failed), *failed[0])

    def _tokenizer(self, ld: LoadedDeployment) -> str | None:
        """`tokenizer_source` of ``ld``, remembered, so a tick does not read the file system for
        every deployment: a directory is kept; a miss, or a hub source (this machine's weight
        cache may get the files: then the router reads them there), is looked for again after
        `TOKENIZER_RECHECK_S`."""
        key = (ld.deployment.spec.model.source, ld.base_dir)
        now_s = time.monotonic()
        known = self._tokenizers.get(key)
        if known is None or ((known[0] is None or known[0].startswith("hf://"))
                             and now_s - known[1] >= TOKENIZER_RECHECK_S):  # fmt: skip
            known = self._tokenizers[key] = (tokenizer_source(ld), now_s)
        return known[0]

    def endpoints(self, deployment: str) -> list[EndpointSpec]:
        """The router's view of a deployment: replicas that passed warm-up and still run; DRAINING
        ones, and STANDBY ones not yet asleep, marked draining (no new requests, in-flight ones finish). Each endpoint's version is
        its revision's label and its weight its revision's share (`fleet.rollout.revisions.endpoint_weights`)."""
        members = sorted((
            r for r in self.records.of_deployment(deployment)
            if r.warmup_passed_at_s is not None and r.endpoint is not None
            and (r.status in (ReplicaStatus.READY, ReplicaStatus.DRAINING)
                 or (r.status is ReplicaStatus.STANDBY and r.sleep_sent_at_s is None))
            and r.engine_alive and r.stop_requested_at_s is None
        ), key=lambda r: r.id)
        deployments = self.records.deployments
        revs = deployments[deployment].revs if deployment in deployments else None
        ready = Counter(r.spec_hash for r in members if r.status is ReplicaStatus.READY)
        weights = endpoint_weights(revs, ready) if revs is not None else {}
        return [
            EndpointSpec(id=r.id, url=r.endpoint, version=self._version(r), weight=weights.get(r.spec_hash, 1.0),
                         draining=r.status is not ReplicaStatus.READY, kv_events=_kv_source(r))  # fmt: skip
            for r in members
        ]

    def _version(self, r: Replica) -> str:
        ds = self.records.deployments.get(r.deployment)
        ld = ds.revs.specs.get(r.spec_hash) if ds is not None else None
        return revision_label(ld) if ld is not None else f"{r.revision}@{r.spec_hash[:8]}"


def _kv_source(r: Replica) -> KvEventsSource | None:
    """Where routers subscribe to the replica's KV cache events (`ReplicaFacts.kv_events`); None
    when its engine publishes none or the record is unreadable (the router matches prompts
    against its approximate index then)."""
    if not r.kv_events:
        return None
    try:
        return KvEventsSource(**r.kv_events)
    except ValueError as err:   # pydantic's ValidationError
        log.warning("replica %s: ignoring its KV event addresses %r: %s", r.id, r.kv_events, err)
        return None
