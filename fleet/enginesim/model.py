"""The scheduler model of the engine SIMULATOR: vLLM v1's continuous batching, in virtual time.

Owns `EngineModel` (requests, the running and waiting queues, the KV-cache block pool) and the
records it returns (`StepResult`, `FinishedRequest`, `EngineStats`). Pure: no I/O, no clock,
no asyncio. Whoever drives it says what time it is:

- the HTTP shell (`fleet.enginesim.server`) calls ``step(now_s)`` on real time, sleeps
  ``duration_s``, then streams the tokens the step emitted;
- a discrete-event trace simulator calls the very same ``add_request`` / ``step`` in virtual
  time (`run_virtual` below is the smallest such driver).

A new request is held back for ``cost.admission_s`` (the API server's parsing, tokenization and
hand-off to the engine core) before the scheduler sees it. One ``step`` is one engine
iteration, following vLLM v1's `Scheduler.schedule` (FCFS policy,
vllm/v1/core/sched/scheduler.py in vLLM 0.32):

1. Running requests first, in order: each gets the tokens it still needs (a prefill chunk, or
   one token in decode), capped by the step's token budget (``max_num_batched_tokens``:
   chunked prefill). If the KV cache has no room for them, the last running request is
   preempted (its blocks freed, its progress lost, put back at the head of the waiting queue)
   until there is room or the request itself was the one preempted.
2. Then, if nothing was preempted in this step, waiting requests in order while the batch has
   fewer than ``max_num_seqs`` requests and budget is left: a fresh (or preempted) request first
   takes its longest cached prefix (full blocks, at most ``num_tokens - 1`` tokens), then needs
   blocks for the chunk it computes; when the cache cannot hold them it stays waiting, and so
   does everyone behind it.
3. The step's duration comes from `fleet.enginesim.cost.StepCost` applied to what it computes
   (tokens, sequences, decode context, prefill attention pairs), times ``slowdown``.
4. At the end of the step each request whose known tokens are all computed emits one output
   token; full blocks enter the prefix cache; requests with all their output tokens finish
   and free their blocks.

With ``kv_events`` on, each step also carries the KV cache events it caused
(`StepResult.kv_events`: `router.kv.events` objects, in vLLM's order within a step, see
`fleet.enginesim.kvcache`), which vLLM publishes as one `KVEventBatch` per step at the step's end
(vllm/v1/core/sched/scheduler.py ``update_from_output``): the HTTP shell publishes them on vLLM's
wire and a trace simulator hands them to its routers' indexes directly (`kv_event_batch`).

Times are seconds on the driver's clock. Token ids are ints; the model only hashes them.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from fleet.enginesim.cost import StepCost, StepFeatures
from fleet.enginesim.kvcache import BlockPool, block_hashes
from router.kv.events import EventBatch, KvCacheEvent


@dataclass(frozen=True)
class EngineConfig:
    """Scheduler limits and KV capacity of one replica (vLLM's names; defaults: vLLM 0.32 on CPU).

    Attributes:
        max_num_seqs: most requests in one batch (vLLM ``--max-num-seqs``).
        max_num_batched_tokens: token budget of one step (``--max-num-batched-tokens``).
        block_size: tokens per KV block (``--block-size``; 16 on CUDA, 128 on the CPU backend).
        num_gpu_blocks: KV blocks in the cache (vLLM's ``num_gpu_blocks``, also on CPU).
        max_model_len: most tokens (prompt + output) of one request (``--max-model-len``).
        enable_prefix_caching: reuse cached blocks across requests (on by default in vLLM v1).
        long_prefill_token_threshold: most tokens of one prefill chunk per step; 0 = no cap.
    """

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 128
    num_gpu_blocks: int = 4096
    max_model_len: int = 1024
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_gpu_blocks", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_gpu_blocks * self.block_size < self.max_model_len:
            # vLLM refuses to start in this case too (one request of max_model_len must fit).
            raise ValueError(
                f"KV cache of {self.num_gpu_blocks} blocks x {self.block_size} tokens cannot hold one request "
                f"of max_model_len={self.max_model_len} tokens"
            )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size


@dataclass(frozen=True)
class FinishedRequest:
    """A request that left the engine, with its timeline in the driver's seconds."""

    request_id: str
    finish_reason: str                 # "length" | "stop" | "abort"
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_prompt_tokens: int      # prefix-cache hit at first admission
    num_preemptions: int
    arrival_s: float
    first_scheduled_s: float | None
    first_token_s: float | None
    finished_s: float

    @property
    def queue_s(self) -> float:
        """Arrival to first scheduling (vLLM's `vllm:request_queue_time_seconds`)."""
        return (self.first_scheduled_s if self.first_scheduled_s is not None else self.finished_s) - self.arrival_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finished_s - self.arrival_s

    @property
    def prefill_s(self) -> float:
        if self.first_token_s is None or self.first_scheduled_s is None:
            return 0.0
        return self.first_token_s - self.first_scheduled_s

    @property
    def decode_s(self) -> float:
        return 0.0 if self.first_token_s is None else self.finished_s - self.first_token_s

    @property
    def inference_s(self) -> float:
        return 0.0 if self.first_scheduled_s is None else self.finished_s - self.first_scheduled_s

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (0 with fewer than two tokens)."""
        return self.decode_s / (self.num_output_tokens - 1) if self.num_output_tokens > 1 else 0.0


@dataclass(frozen=True)
class StepResult:
    """What one ``step(now_s)`` did.

    Attributes:
        start_s, duration_s: when the step started and how long it takes; its output exists
            at ``end_s``.
        scheduled: request id -> tokens computed in this step (prefill chunk or 1 in decode).
        emitted: request id -> index (0-based) of the output token it emitted at ``end_s``.
        finished: requests that finished at ``end_s``.
        preempted: ids of requests preempted at the start of this step.
        features: what the step computed (input of the cost model).
        kv_events: KV cache events of the step (and any made since the last step), in order;
            empty unless the model was made with ``kv_events``.
    """

    start_s: float
    duration_s: float
    scheduled: dict[str, int]
    emitted: dict[str, int]
    finished: list[FinishedRequest]
    preempted: list[str]
    features: StepFeatures
    kv_events: tuple[KvCacheEvent, ...] = ()

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s

    @property
    def num_batched_tokens(self) -> int:
        return self.features.num_tokens

    def kv_event_batch(self) -> EventBatch | None:
        """The step's events as the batch vLLM publishes at its end (``ts`` = ``end_s`` on the
        driver's clock), None when it made none."""
        return EventBatch(ts=self.end_s, events=list(self.kv_events)) if self.kv_events else None


@dataclass(frozen=True)
class EngineStats:
    """Gauges now and counters since the model was made (vLLM metric in brackets)."""

    num_running: int                   # [vllm:num_requests_running]
    num_waiting: int                   # [vllm:num_requests_waiting]
    kv_cache_usage: float              # [vllm:kv_cache_usage_perc], 0..1
    prefix_cache_queries: int          # [vllm:prefix_cache_queries] tokens looked up
    prefix_cache_hits: int             # [vllm:prefix_cache_hits] tokens found
    num_preemptions: int               # [vllm:num_preemptions]
    prompt_tokens: int                 # [vllm:prompt_tokens]
    generation_tokens: int             # [vllm:generation_tokens]
    steps: int


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    max_output_tokens: int
    finish_reason: str
    arrival_s: float
    hashes: list[int]
    num_output: int = 0
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_s: float | None = None
    first_token_s: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.num_output


class EngineModel:
    """One simulated engine replica: ``add_request`` / ``abort`` / ``step(now_s)``.

    Args:
        config: scheduler limits and KV capacity.
        cost: per-step time model.
        slowdown: factor on every step's duration (a fault switch; 1 = as profiled).
        kv_events: make KV cache events (`StepResult.kv_events`; vLLM's
            ``enable_kv_cache_events``). Off, the model makes none and costs nothing for them.
    """

    def __init__(self, config: EngineConfig, cost: StepCost, slowdown: float = 1.0, kv_events: bool = False) -> None:
        if slowdown <= 0:
            raise ValueError(f"slowdown must be > 0, got {slowdown}")
        self.config = config
        self.cost = cost
        self.slowdown = slowdown
        self._kv_events: list[KvCacheEvent] | None = [] if kv_events else None
        self.pool = BlockPool(config.num_gpu_blocks, config.enable_prefix_caching,
                              on_event=self._kv_events.append if self._kv_events is not None else None)
        self._requests: dict[str, _Request] = {}
        self._running: list[_Request] = []
        self._waiting: deque[_Request] = deque()
        self._pending: list[tuple[float, int, _Request]] = []   # (ready_s, seq, request): in admission
        self._seq = 0
        self._last_end_s = -math.inf
        self._queries = self._hits = self._preemptions = 0
        self._prompt_tokens = self._generation_tokens = self._steps = 0

    # ----- requests ---------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_output_tokens: int,
        arrival_s: float,
        *,
        output_token_ids: Sequence[int] | None = None,
        finish_reason: str = "length",
    ) -> None:
        """Queue a request that arrived at ``arrival_s``.

        Args:
            request_id: unique among the requests in the engine.
            prompt_token_ids: the prompt (at least one token).
            max_output_tokens: output tokens it will emit before finishing (>= 1).
            output_token_ids: the ids of those tokens (they enter the prefix cache as blocks
                fill up); defaults to ids derived from the prompt.
            finish_reason: reported when it finishes ("length", or "stop" for an EOS).

        Raises:
            ValueError: duplicate id, empty prompt, ``max_output_tokens < 1``, or prompt plus
                output longer than ``max_model_len`` (vLLM answers 400 for that).
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in the engine")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("the prompt must have at least one token")
        if max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be >= 1, got {max_output_tokens}")
        total = len(prompt) + max_output_tokens
        if total > self.config.max_model_len:
            raise ValueError(
                f"{len(prompt)} prompt tokens + {max_output_tokens} output tokens = {total} "
                f"> max_model_len {self.config.max_model_len}"
            )
        bs = self.config.block_size
        prompt_hashes = block_hashes(prompt, bs)
        if output_token_ids is None:
            seed = prompt_hashes[-1] if prompt_hashes else hash(tuple(prompt))
            outputs = [hash((seed, i)) & 0x7FFFFFFF for i in range(max_output_tokens)]
        else:
            outputs = list(output_token_ids)[:max_output_tokens]
            if len(outputs) < max_output_tokens:
                raise ValueError(f"{len(outputs)} output_token_ids for max_output_tokens={max_output_tokens}")
        # Hashes of every full block the request can ever have: prompt and output tokens.
        all_hashes = block_hashes(prompt + outputs, bs)
        r = _Request(request_id, prompt, outputs, max_output_tokens, finish_reason, arrival_s, all_hashes)
        self._requests[request_id] = r
        if self.cost.admission_s > 0:
            self._seq += 1
            heapq.heappush(self._pending, (arrival_s + self.cost.admission_s, self._seq, r))
        else:
            self._waiting.append(r)

    def abort(self, request_id: str, now_s: float) -> FinishedRequest | None:
        """Remove a request (client gone); frees its blocks. None if it is not in the engine."""
        r = self._requests.pop(request_id, None)
        if r is None:
            return None
        if r in self._running:
            self._running.remove(r)
        elif r in self._waiting:
            self._waiting.remove(r)
        else:
            self._pending = [p for p in self._pending if p[2] is not r]
            heapq.heapify(self._pending)
        self.pool.free(r.blocks)
        r.blocks = []
        return self._record(r, "abort", now_s)

    # ----- state ------------------------------------------------------------------------

    def has_work(self) -> bool:
        """Requests in the engine (running, waiting, or still in admission)."""
        return bool(self._running or self._waiting or self._pending)

    def retry_at_s(self, now_s: float) -> float:
        """After a step that scheduled nothing at ``now_s``: when to step again (the next
        request in admission reaches the scheduler). Raises RuntimeError when nothing ever
        would (work queued, nothing schedulable: a bug in the model or its profile)."""
        ready_s = self.next_ready_s()
        if ready_s is None or ready_s <= now_s:
            raise RuntimeError(f"engine model is stuck at t={now_s:.3f} s: work queued but nothing schedulable")
        return ready_s

    def next_ready_s(self) -> float | None:
        """When the next request in admission reaches the scheduler; None if none is.

        A driver with nothing schedulable (``step`` scheduled nothing) waits until then.
        """
        return self._pending[0][0] if self._pending else None

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def prefill_queue(self) -> tuple[int, int]:
        """(prompt tokens still to prefill, requests they belong to): requests in admission or
        waiting (whole prompts, cache hits not yet looked up) and running ones whose prefill is
        not done. What a router would like each engine to report (vLLM does not export it)."""
        tokens = requests = 0
        for r in self._waiting:
            tokens += r.num_prompt_tokens - r.num_computed
            requests += 1
        for _, _, r in self._pending:
            tokens += r.num_prompt_tokens
            requests += 1
        for r in self._running:
            left = r.num_prompt_tokens - r.num_computed
            if left > 0:
                tokens += left
                requests += 1
        return tokens, requests

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self._running), num_waiting=len(self._waiting), kv_cache_usage=self.pool.usage(),
            prefix_cache_queries=self._queries, prefix_cache_hits=self._hits, num_preemptions=self._preemptions,
            prompt_tokens=self._prompt_tokens, generation_tokens=self._generation_tokens, steps=self._steps,
        )  # fmt: skip

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (vLLM's ``reset_prefix_cache``, which sleeping does): False when
        a request still holds blocks. Makes `AllBlocksCleared` (`take_kv_events`)."""
        return self.pool.reset()

    def take_kv_events(self) -> list[KvCacheEvent]:
        """KV cache events made since the last step or take (a step takes its own)."""
        if not self._kv_events:
            return []
        out = list(self._kv_events)
        self._kv_events.clear()
        return out

    # ----- the iteration ----------------------------------------------------------------

    def step(self, now_s: float) -> StepResult:
        """Schedule and run one iteration starting at ``now_s``.

        Raises:
            ValueError: ``now_s`` is before the end of the previous step (the engine runs one
                step at a time).
        """
        if now_s < self._last_end_s - 1e-9:
            raise ValueError(f"step at {now_s} starts before the previous one ended ({self._last_end_s})")
        while self._pending and self._pending[0][0] <= now_s + 1e-12:
            self._waiting.append(heapq.heappop(self._pending)[2])
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        order: list[tuple[_Request, int]] = []
        preempted: list[str] = []

        i = 0
        while i < len(self._running) and budget > 0:
            r = self._running[i]
            n = self._chunk(r.num_tokens - r.num_computed, budget)
            if n <= 0:
                i += 1
                continue
            while self._blocks_needed(r, n) > self.pool.num_free:
                victim = self._running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is r:
                    break
            if preempted and preempted[-1] == r.request_id:
                break
            self._grow(r, n)
            order.append((r, n))
            budget -= n
            i += 1

        if not preempted:
            while self._waiting and budget > 0 and len(self._running) < cfg.max_num_seqs:
                r = self._waiting[0]
                hit = self.pool.lookup(r.hashes, (r.num_tokens - 1) // cfg.block_size)
                computed = len(hit) * cfg.block_size
                n = self._chunk(r.num_tokens - computed, budget)
                needed = math.ceil((computed + n) / cfg.block_size) - len(hit)
                if needed + self.pool.num_evictable(hit) > self.pool.num_free:
                    break
                self.pool.touch(hit)
                r.blocks = hit + self.pool.allocate(needed)
                r.num_computed = computed
                r.num_cached_blocks = len(hit)
                if r.num_preemptions == 0:
                    self._queries += r.num_tokens
                    self._hits += computed
                    r.num_cached_prompt_tokens = computed
                if r.first_scheduled_s is None:
                    r.first_scheduled_s = now_s
                self._waiting.popleft()
                self._running.append(r)
                order.append((r, n))
                budget -= n

        features = self._features(order)
        duration_s = self.cost.duration_s(features) * self.slowdown
        end_s = now_s + duration_s
        self._last_end_s = end_s
        self._steps += 1 if order else 0
        return self._finish_step(now_s, duration_s, end_s, order, preempted, features)

    # ----- helpers ----------------------------------------------------------------------

    def _chunk(self, remaining: int, budget: int) -> int:
        n = min(remaining, budget)
        threshold = self.config.long_prefill_token_threshold
        return min(n, threshold) if threshold > 0 else n

    def _blocks_needed(self, r: _Request, n: int) -> int:
        return math.ceil((r.num_computed + n) / self.config.block_size) - len(r.blocks)

    def _grow(self, r: _Request, n: int) -> None:
        need = self._blocks_needed(r, n)
        if need > 0:
            r.blocks.extend(self.pool.allocate(need))

    def _preempt(self, r: _Request) -> None:
        self.pool.free(r.blocks)
        r.blocks = []
        r.num_computed = 0
        r.num_cached_blocks = 0
        r.num_preemptions += 1
        self._preemptions += 1
        self._waiting.appendleft(r)

    @staticmethod
    def _features(order: list[tuple[_Request, int]]) -> StepFeatures:
        tokens = ctx = 0
        pairs = 0.0
        for r, n in order:
            tokens += n
            if n == 1 and r.num_output > 0 and r.num_computed == r.num_tokens - 1:
                ctx += r.num_computed + 1
            else:
                pairs += n * (r.num_computed + (n + 1) / 2)
        return StepFeatures(num_tokens=tokens, num_seqs=len(order), decode_context_tokens=ctx,
                            prefill_attention_pairs=pairs)  # fmt: skip

    def _finish_step(self, start_s: float, duration_s: float, end_s: float, order: list[tuple[_Request, int]],
                     preempted: list[str], features: StepFeatures) -> StepResult:  # fmt: skip
        bs = self.config.block_size
        emitted: dict[str, int] = {}
        finished: list[FinishedRequest] = []
        done: list[_Request] = []
        for r, n in order:
            r.num_computed += n
            lo, hi = r.num_cached_blocks, min(r.num_computed // bs, len(r.blocks))
            if hi > lo and self._kv_events is None:
                for k in range(lo, hi):
                    self.pool.cache(r.blocks[k], r.hashes[k])
            elif hi > lo:
                self.pool.cache_blocks(r.blocks[lo:hi], r.hashes[lo:hi], _tokens(r, lo * bs, hi * bs), bs,
                                       r.hashes[lo - 1] if lo else None)  # fmt: skip
            r.num_cached_blocks = max(r.num_cached_blocks, hi)
            if r.num_computed < r.num_tokens:
                continue  # a prefill chunk that is not the last one
            if r.num_output == 0:
                self._prompt_tokens += r.num_prompt_tokens
                r.first_token_s = end_s
            emitted[r.request_id] = r.num_output
            r.num_output += 1
            self._generation_tokens += 1
            if r.num_output >= r.max_output_tokens:
                done.append(r)
        for r in done:
            self._running.remove(r)
            self.pool.free(r.blocks)
            r.blocks = []
            del self._requests[r.request_id]
            finished.append(self._record(r, r.finish_reason, end_s))
        scheduled = {r.request_id: n for r, n in order}
        return StepResult(start_s, duration_s, scheduled, emitted, finished, preempted, features,
                          tuple(self.take_kv_events()))  # fmt: skip

    @staticmethod
    def _record(r: _Request, reason: str, now_s: float) -> FinishedRequest:
        return FinishedRequest(
            request_id=r.request_id, finish_reason=reason, num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=r.num_output, num_cached_prompt_tokens=r.num_cached_prompt_tokens,
            num_preemptions=r.num_preemptions, arrival_s=r.arrival_s, first_scheduled_s=r.first_scheduled_s,
            first_token_s=r.first_token_s, finished_s=now_s,
        )  # fmt: skip


def _tokens(r: _Request, start: int, end: int) -> list[int]:
    """Tokens ``start:end`` of the request's prompt followed by its output."""
    p = len(r.prompt_token_ids)
    if end <= p:
        return r.prompt_token_ids[start:end]
    return r.prompt_token_ids[start:] + r.output_token_ids[max(0, start - p):end - p]


@dataclass(frozen=True)
class Arrival:
    """A request for `run_virtual`: ``EngineModel.add_request`` arguments plus its arrival time."""

    at_s: float
    request_id: str
    prompt_token_ids: Sequence[int]
    max_output_tokens: int
    output_token_ids: Sequence[int] | None = None


def run_virtual(model: EngineModel, arrivals: Iterable[Arrival], start_s: float = 0.0,
                on_step=None) -> list[FinishedRequest]:  # fmt: skip
    """Drive ``model`` in virtual time until every arrival has finished; no sleeping.

    Requests join at their ``at_s`` (a step in progress is never interrupted: a request that
    arrives during a step waits for the next one, as in vLLM). ``on_step(result)`` sees every
    step. Returns the finished requests in the order they finished.
    """
    pending = deque(sorted(arrivals, key=lambda a: a.at_s))
    now_s = start_s
    done: list[FinishedRequest] = []
    while pending or model.has_work():
        while pending and pending[0].at_s <= now_s:
            a = pending.popleft()
            model.add_request(a.request_id, a.prompt_token_ids, a.max_output_tokens, a.at_s,
                              output_token_ids=a.output_token_ids)  # fmt: skip
        if not model.has_work():
            now_s = pending[0].at_s
            continue
        result = model.step(now_s)
        if not result.scheduled and not result.preempted:
            ready_s = model.retry_at_s(now_s)
            now_s = min(ready_s, pending[0].at_s) if pending else ready_s
            continue
        if on_step is not None:
            on_step(result)
        done.extend(result.finished)
        now_s = result.end_s
    return done
