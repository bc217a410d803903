"""The memory one replica of a deployment spec needs: the one place it is read, for the
controller's placement requests, `fleet up`'s preflight and the `fleet` CLI.

Owns `read_memory_need` (`fleet.models.read.memory_need` of a deployment; an ``hf://`` source is
read from this machine's weight cache when `fleet cache pull` or the local backend put it there,
else from the hub through `huggingface_hub`: ``config.json`` and the safetensors index alone),
`memory_need_or_reason` (the same, errors reported: `fleet.local.preflight`, `fleet.cli.models`,
`fleet.cli.placement`), and `ModelMemory`: per serving spec
(`fleet.spec.LoadedDeployment.serving_hash`) the `fleet.models.memory.MemoryNeed` of one
replica, read once and kept, through `read_memory_need` unless given another reader. The
controller (`fleet.controller.launch.Launcher.placement_request`) asks `ModelMemory.need`
for every scale-up; placement then skips the products and MIG profiles that cannot hold the model
and explains why (`fleet.placement.explain.memory_reason`), and places no replica of a spec whose
``--max-model-len`` vLLM refuses for the model (`fleet.models.memory.MemoryNeed.max_len_problem`,
the rule ``fleet validate`` and ``fleet up``'s preflight apply), so a deployment whose model fits
no device, or whose engine would refuse its length, waits with that reason (``fleet status``, the
CRD's ``Degraded`` condition, reason ``Unplaceable``) instead of starting replicas that vLLM
refuses at start-up.

Where the need comes from, and when:

- no read at all for the engine simulator and CPU replicas (None: placement checks no memory);
- a source on this machine (a path, ``file://``) and sources Fleet does not read (``sim://``,
  http(s) manifests): read inline the first time, from local files (``config.json``, the
  safetensors index or headers);
- ``hf://``: read in a worker thread (`asyncio.to_thread`), never on the reconcile step: until the
  read is done, or when it fails or takes longer than ``timeout_s``, replicas are placed without a
  memory need (logged once per spec) and a failed read is tried again ``retry_after_s`` later. A
  finished read calls ``on_known`` (the controller wakes for its next tick).

Errors of a read (`fleet.models.read.ModelSourceError`, `fleet.models.memory.EngineArgError`, or
anything else the reader raises) are logged and kept as the reason the need is unknown
(`ModelMemory.unknown_reason`); they never reach the caller.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from fleet.models.memory import EngineArgError, MemoryNeed
from fleet.models.read import ModelSourceError, memory_need
from fleet.spec import LoadedDeployment

log = logging.getLogger("fleet.controller")

READ_TIMEOUT_S = 60.0
"""Longest wait for one ``hf://`` read (config.json and the index: each fetch has its own
`fleet.models.read.HUB_TIMEOUT_S`, and huggingface_hub may retry) before placing without it."""
RETRY_AFTER_S = 300.0
"""Seconds (controller clock) before a failed or timed-out read is tried again."""
MAX_SPECS = 1024
"""Specs whose need is kept; the oldest settled ones are forgotten beyond it."""

Reader = Callable[[LoadedDeployment], "MemoryNeed | None"]
"""A deployment spec -> the memory one replica needs, or None (nothing to check). May raise."""


def read_memory_need(ld: LoadedDeployment, *, hub: bool = True) -> MemoryNeed | None:
    """The memory one replica of ``ld`` needs per GPU, the one reading of it that the controller
    (the default `Reader`), `fleet up`'s preflight (`fleet.local.preflight`) and the `fleet` CLI
    (`fleet validate`, `fleet plan`) share: `fleet.models.read.memory_need` of the deployment,
    an ``hf://`` source read from this machine's weight cache when it holds it
    (`fleet.agent.cache.cached_hub_dir`), else from the hub, or not at all with ``hub=False``
    (None: weights not on this machine yet). None also for the engine simulator and sources Fleet
    does not read. Blocking (files, network): `ModelMemory` runs it in a thread
    for ``hf://`` sources. Raises ModelSourceError or EngineArgError."""
    from fleet.agent.cache import cached_hub_dir

    source = ld.deployment.spec.model.source
    cached = cached_hub_dir(source)
    if cached is None and not hub and ld.deployment.spec.model.parsed_source.remote:
        return None
    return memory_need(ld.deployment, ld.base_dir, cached)


def memory_need_or_reason(ld: LoadedDeployment, *, hub: bool = True) -> tuple[MemoryNeed | None, str | None]:
    """`read_memory_need` that reports instead of raising: (the need or None, why it is not known
    when the model or its engine flags could not be read, else None)."""
    try:
        return read_memory_need(ld, hub=hub), None
    except (ModelSourceError, EngineArgError) as err:
        return None, str(err)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


@dataclass
class _Entry:
    """What is known of one spec's need: ``known`` (``need`` is the answer, None included), or a
    read in flight (``task``), or the last read failed (``why``, tried again at ``retry_at_s``)."""

    known: bool = False
    need: MemoryNeed | None = None
    task: asyncio.Task | None = None
    why: str | None = None
    retry_at_s: float = 0.0


class ModelMemory:
    """The memory need of each deployment spec, read once (module docstring).

    ``clock`` is the controller's (seconds; retries), ``reader`` the `Reader` (default
    `read_memory_need`), ``timeout_s`` the longest wait for a threaded read, ``on_known`` is
    called (on the event loop) when a threaded read has finished."""

    def __init__(self, clock: Callable[[], float], reader: Reader | None = None, *,
                 timeout_s: float = READ_TIMEOUT_S, retry_after_s: float = RETRY_AFTER_S,
                 on_known: Callable[[], None] | None = None) -> None:
        self.clock = clock
        self.reader = reader or read_memory_need
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.on_known = on_known or (lambda: None)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def need(self, ld: LoadedDeployment) -> MemoryNeed | None:
        """The need of one replica of ``ld`` if known now, else None (place without it). Never
        blocks on the network: an ``hf://`` source is read in a thread, started here (when called
        on a running event loop; the controller's steps are)."""
        spec = ld.deployment.spec
        if spec.engine.kind == "sim":
            return None
        key = ld.serving_hash
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
            self._trim()
        if entry.known:
            return entry.need
        if entry.task is not None:
            return None
        if entry.why is not None and self.clock() < entry.retry_at_s:
            return None
        if not spec.model.source.startswith("hf://"):
            self._settle(entry, ld, *self._read(ld))
            return entry.need
        loop = _running_loop()
        if loop is None:   # asked outside the controller's loop: the next tick starts the read
            return None
        entry.task = loop.create_task(self._read_in_thread(ld, entry), name=f"model-memory-{ld.deployment.name}")
        log.info("%s: placing without the model's memory need until %s is read", ld.deployment.name,
                 spec.model.source)
        return None

    def unknown_reason(self, ld: LoadedDeployment) -> str | None:
        """Why the need of ``ld`` is not known (the last read's error), or None."""
        entry = self._entries.get(ld.serving_hash)
        return entry.why if entry is not None and not entry.known else None

    async def settled(self) -> None:
        """Return once no read is in flight (tests; a shutdown that wants no thread left)."""
        while tasks := [e.task for e in self._entries.values() if e.task is not None]:
            await asyncio.wait(tasks)

    def close(self) -> None:
        """Stop waiting for reads in flight (their threads finish on their own; results dropped)."""
        for entry in self._entries.values():
            if entry.task is not None:
                entry.task.cancel()
                entry.task = None

    # ----- internals ----------------------------------------------------------------------------

    def _read(self, ld: LoadedDeployment) -> tuple[MemoryNeed | None, str | None]:
        try:
            return self.reader(ld), None
        except Exception as err:  # noqa: BLE001 - an unreadable model is placed without a need, never a failed step
            return None, str(err) or repr(err)

    async def _read_in_thread(self, ld: LoadedDeployment, entry: _Entry) -> None:
        try:
            need, why = await asyncio.wait_for(asyncio.to_thread(self._read, ld), self.timeout_s)
        except asyncio.TimeoutError:
            need, why = None, f"{ld.deployment.spec.model.source}: no answer within {self.timeout_s:g} s"
        entry.task = None
        self._settle(entry, ld, need, why)
        self.on_known()

    def _settle(self, entry: _Entry, ld: LoadedDeployment, need: MemoryNeed | None, why: str | None) -> None:
        name = ld.deployment.name
        if why is None:
            entry.known, entry.need, entry.why = True, need, None
            if need is not None:
                log.info("%s: memory need known (%s): weights %.2f GiB and one %d-token sequence %.2f GiB per GPU",
                         name, ld.deployment.spec.model.source, need.weight_bytes / 2**30, need.context_tokens,
                         need.sequence_kv_bytes / 2**30)
            return
        entry.why, entry.retry_at_s = why, self.clock() + self.retry_after_s
        log.warning("%s: placing without the model's memory need (tried again in %.0f s): %s", name,
                    self.retry_after_s, why)

    def _trim(self) -> None:
        while len(self._entries) > MAX_SPECS:
            oldest = next((k for k, e in self._entries.items() if e.task is None), None)
            if oldest is None:
                return
            del self._entries[oldest]
