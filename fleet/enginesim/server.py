"""The HTTP shell of the engine SIMULATOR: many simulated vLLM replicas in one asyncio process.

Owns `ReplicaSettings` and `SimReplica` (one replica: an aiohttp application on its own port, a
task that advances its `EngineModel` on real time, the request handlers, sleep and wake, fault
switches). The request checks and error documents are `fleet.enginesim.api`, the response
documents and SSE streams `fleet.enginesim.responses`. `fleet.enginesim.runner` serves many
replicas in one process (the `fleet sim-engine` command and ``python -m fleet.enginesim``,
`engine.kind: sim`); tests run `SimReplica` in-process.

The surface is vLLM's OpenAI server (0.32): ``POST /v1/completions`` and
``/v1/chat/completions`` (JSON, or SSE with ``stream``; ``stream_options.include_usage``;
``max_tokens``, ``min_tokens``, ``ignore_eos``, ``seed``; errors as vLLM's JSON, aiohttp's own
too (a body over 1 MiB: 413), ``http_errors_as_json``), ``GET
/v1/models``, ``/health``, ``/version`` and ``/metrics``; with ``sleep_mode`` (vLLM's
``--enable-sleep-mode``) also ``POST /sleep?level=1``, ``POST /wake_up`` and ``GET /is_sleeping``
(`fleet.enginesim.sleep` gives the sources and the wake time). Simulator-only: ``GET /sim/state`` and
``POST /sim/faults`` (``{"slowdown": 3.0}``, ``{"crash": true}`` or ``{"stall": true}``; `fleet.enginesim.faults`).

With ``kv_events`` (vLLM's ``--kv-events-config``) each replica publishes its KV cache events as
vLLM does, one batch per engine step at the step's end, on a PUB socket with a replay socket
(`fleet.enginesim.kvpublish`); in-process consumers get the same batches through ``kv_sinks``.
Sleeping clears the prefix cache (vLLM's ``sleep`` resets it at level >= 1): `AllBlocksCleared`.

The shell does no timing arithmetic of its own: each step is ``model.step(now)``, a sleep until
the step's end, then the delivery of the tokens the step emitted, so what clients see is what
the model computed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from typing import Any

from aiohttp import web

from fleet.enginesim import tokens
from fleet.enginesim.api import ApiError, http_errors_as_json, output_limits, read_body
from fleet.enginesim.faults import FaultPlan
from fleet.enginesim.kvpublish import KvEventPublisher, KvEventsConfig
from fleet.enginesim.metrics import ReplicaMetrics
from fleet.enginesim.model import EngineModel, StepResult
from fleet.enginesim.profiles import Profile
from fleet.enginesim.realtokens import RealTokens
from fleet.enginesim.responses import LiveRequest, ResponseWriter
from fleet.enginesim.sleep import SleepState, parse_level
from router.kv.events import EventBatch

log = logging.getLogger("fleet.enginesim")

SIMULATOR_NOTE = "Fleet engine SIMULATOR: no model runs here; latencies come from a model of vLLM's scheduler"


@dataclass(frozen=True)
class ReplicaSettings:
    """How one simulated replica behaves.

    Attributes:
        profile: hardware/model profile (config and step cost).
        served_model_name: the name clients send as ``model``.
        model_source: what ``/v1/models`` reports as ``root`` (the ``--model`` argument).
        seed: output text and EOS positions are functions of (seed, prompt).
        startup_delay_s: seconds before the replica listens (weight loading stand-in).
        faults: fault switches.
        mean_output_tokens: when set, requests without ``ignore_eos`` stop early at an EOS
            drawn with this mean (finish_reason "stop"); unset, they run to ``max_tokens``
            (as the random-weight tiny model does on real vLLM).
        sleep_mode: serve vLLM's sleep endpoints (``--enable-sleep-mode``); off, they are 404.
        wake_s: seconds ``POST /wake_up`` takes from level-1 sleep (`fleet.enginesim.sleep.wake_time_s`).
        kv_events: vLLM's ``--kv-events-config`` of the process (replica ``i`` offsets its ports
            by ``i``); None or disabled: no events.
        tokens: a model's real tokenizer (``--tokenizer DIR``, `fleet.enginesim.realtokens`); None:
            the simulator's word tokenizer (`fleet.enginesim.tokens`).
        prompt_tokens_details: the usage object carries ``prompt_tokens_details.cached_tokens``
            (the prompt tokens found in the prefix cache), as vLLM's ``--enable-prompt-tokens-details``.
    """

    profile: Profile
    served_model_name: str
    model_source: str = ""
    seed: int = 0
    startup_delay_s: float = 0.0
    faults: FaultPlan = field(default_factory=FaultPlan)
    mean_output_tokens: float | None = None
    sleep_mode: bool = False
    wake_s: float = 0.0
    kv_events: KvEventsConfig | None = None
    tokens: RealTokens | None = field(default=None, compare=False)
    prompt_tokens_details: bool = False


class SimReplica:
    """One simulated replica. ``await start(sock)`` serves on a bound socket; ``await close()``.

    Args:
        settings: behaviour.
        index: the replica's number in its process (used in request ids).
        clock: monotonic seconds (the model's time); ``loop.time`` by default.
        on_dead: called once if the replica dies of a fault (fail at start, crash).
        kv_sinks: in-process consumers of its KV event batches, each called with ``(seq, batch)``
            (only with ``settings.kv_events`` enabled).
    """

    def __init__(self, settings: ReplicaSettings, index: int = 0, clock: Callable[[], float] | None = None,
                 on_dead: Callable[[SimReplica, str], None] | None = None,
                 kv_sinks: tuple[Callable[[int, EventBatch], None], ...] = ()) -> None:  # fmt: skip
        self.settings = settings
        self.index = index
        self.profile = settings.profile
        kv = settings.kv_events
        self.kv_publisher = KvEventPublisher(kv.for_replica(index), kv_sinks) if kv is not None and kv.enabled else None
        self.model = EngineModel(settings.profile.config, settings.profile.cost, settings.faults.slowdown,
                                 kv_events=self.kv_publisher is not None)  # fmt: skip
        self.metrics = ReplicaMetrics(settings.served_model_name, settings.profile.config.max_model_len,
                                      settings.profile.name)  # fmt: skip
        token_text = settings.tokens.token_text if settings.tokens is not None else tokens.token_text
        self.responses = ResponseWriter(settings.served_model_name, f"fleet-sim-{settings.profile.name}",
                                        token_text, settings.prompt_tokens_details)  # fmt: skip
        self._clock = clock
        self._on_dead = on_dead
        self._live: dict[str, LiveRequest] = {}
        self._wake = asyncio.Event()
        self._cache_resets = 0   # prefix cache resets so far (`_sleep`): a step's events from before one are void
        self._running = asyncio.Event()   # cleared while the stall fault holds the engine
        if not settings.faults.stall:
            self._running.set()
        self._driver: asyncio.Task | None = None
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task] = set()
        self._counter = 0
        self.answered = 0
        self.port = 0
        self.state = "starting"    # starting | ready | failed | crashed | closed
        self.dead_reason = ""
        self.sleep = SleepState()
        self._woken: asyncio.Future | None = None

    # ----- lifecycle --------------------------------------------------------------------

    def now_s(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    async def start(self, sock: socket.socket) -> None:
        """Wait the start-up delay, then listen on ``sock`` (bound, not yet listening).

        Until then a client's connect is refused, as with a vLLM still loading weights.
        """
        self.port = sock.getsockname()[1]
        if self.settings.startup_delay_s > 0:
            await asyncio.sleep(self.settings.startup_delay_s)
        if self.settings.faults.fail_at_start:
            sock.close()
            self._die("failed", "fault switch: fail at start (engine core initialization failed)")
            return
        if self.kv_publisher is not None:
            try:
                self.kv_publisher.open()
            except Exception as err:  # noqa: BLE001 - zmq.ZMQError and address errors: vLLM fails its start too
                sock.close()
                self._die("failed", f"kv events publisher: cannot open {self.kv_publisher.config.endpoint}: {err}")
                return
        app = web.Application(middlewares=[http_errors_as_json])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/sim/state", self._state)
        app.router.add_post("/sim/faults", self._faults)
        if self.settings.sleep_mode:
            app.router.add_post("/sleep", self._sleep)
            app.router.add_post("/wake_up", self._wake_up)
            app.router.add_get("/is_sleeping", self._is_sleeping)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
                                     shutdown_timeout=1.0)  # fmt: skip
        await self._runner.setup()
        # Our own asyncio server over the runner's protocol factory, so a crash can stop
        # listening and cut connections at once.
        self._server = await asyncio.get_running_loop().create_server(self._runner.server, sock=sock)
        self._driver = asyncio.create_task(self._drive(), name=f"sim-replica-{self.index}")
        self.state = "ready"

    async def close(self) -> None:
        """Stop serving (in-flight streams are cut)."""
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
            self._driver = None
        for task in list(self._handlers):
            task.cancel()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.kv_publisher is not None:
            self.kv_publisher.close()
        if self.state in ("starting", "ready"):
            self.state = "closed"

    def crash(self, reason: str) -> None:
        """Die now: stop listening, cut every connection (a fault, not a shutdown)."""
        if self.state != "ready":
            return
        if self._server is not None:
            self._server.close()                  # stop listening now: connects are refused
            self._server = None
        if self._runner is not None and self._runner.server is not None:
            for conn in list(self._runner.server.connections):
                if conn.transport is not None:
                    conn.transport.abort()        # cut every open connection, no goodbye
        self._die("crashed", reason)
        asyncio.get_running_loop().create_task(self.close())

    def _die(self, state: str, reason: str) -> None:
        self.state, self.dead_reason = state, reason
        log.error("replica %d (port %d) %s: %s", self.index, self.port, state, reason)
        if self._on_dead is not None:
            self._on_dead(self, reason)

    # ----- the engine loop ------------------------------------------------------------

    async def _drive(self) -> None:
        last_end_s = self.now_s()
        while True:
            if not self._running.is_set():   # the stall fault: no step until it is lifted
                await self._running.wait()
                last_end_s = self.now_s()
            if not self.model.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            start_s = max(self.now_s(), last_end_s)
            resets = self._cache_resets
            try:
                result = self.model.step(start_s)
            except Exception as err:  # noqa: BLE001 - a model bug fails its requests, not the replica
                log.exception("replica %d: engine step failed", self.index)
                self._fail_all(f"simulated engine step failed: {type(err).__name__}: {err}")
                continue
            last_end_s = result.end_s
            if not result.scheduled and not result.preempted:
                # Only requests still in admission: sleep until the first reaches the scheduler
                # (or a new request wakes us).
                ready_s = self.model.next_ready_s()
                self._wake.clear()
                timeout_s = max(0.0, ready_s - self.now_s()) if ready_s is not None else None
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout_s)
                continue
            delay_s = result.end_s - self.now_s()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            else:
                await asyncio.sleep(0)  # let handlers run between back-to-back steps
            self._deliver(result)
            # A reset while the step ran (POST /sleep) already published AllBlocksCleared: the
            # step's blocks are gone with it, and publishing them after it would tell subscribers
            # of blocks the engine no longer holds.
            if result.kv_events and resets == self._cache_resets:
                self._publish_kv(list(result.kv_events))

    def _publish_kv(self, events: list) -> None:
        """One batch, stamped with wall-clock seconds as vLLM's scheduler stamps ``KVEventBatch.ts``."""
        if self.kv_publisher is not None and events:
            self.kv_publisher.publish(EventBatch(ts=time.time(), events=events))

    def _fail_all(self, message: str) -> None:
        """Abort every request in the engine; their handlers answer 500 (or end the stream)."""
        now_s = self.now_s()
        for rid, live in list(self._live.items()):
            self._live.pop(rid, None)
            fr = self.model.abort(rid, now_s)
            if fr is not None:
                self.metrics.finished(replace(fr, finish_reason="error"), live.max_tokens)
            live.events.put_nowait(("error", message))
        self.metrics.gauges(self.model.stats())

    def _deliver(self, result: StepResult) -> None:
        end_s = result.end_s
        itls = []
        for rid, idx in result.emitted.items():
            live = self._live.get(rid)
            if live is None:
                continue
            if idx == 0:
                self.metrics.first_token(end_s - live.arrival_s)
            else:
                itls.append(end_s - live.last_token_s)
            live.last_token_s = end_s
            live.events.put_nowait(("token", idx))
        for fr in result.finished:
            live = self._live.pop(fr.request_id, None)
            self.metrics.finished(fr, live.max_tokens if live else fr.num_output_tokens)
            if live is not None:
                live.events.put_nowait(("done", fr))
        self.metrics.step(result, self.model.stats(), itls)

    # ----- requests -------------------------------------------------------------------

    def _admit(self, prompt_ids: list[int], body: dict[str, Any], default_max_tokens: int | None) -> LiveRequest:
        cfg = self.profile.config
        max_tokens, min_tokens = output_limits(prompt_ids, body, cfg.max_model_len, default_max_tokens)
        seed = body.get("seed")
        seed = self.settings.seed if not isinstance(seed, int) else seed
        out_len, reason = max_tokens, "length"
        mean = self.settings.mean_output_tokens
        if mean is not None and not body.get("ignore_eos", False):
            eos = max(min_tokens, tokens.eos_length(seed, prompt_ids, mean), 1)
            if eos < max_tokens:
                out_len, reason = eos, "stop"
        real = self.settings.tokens
        output_ids = (real or tokens).filler_token_ids(seed, prompt_ids, out_len)
        self._counter += 1
        rid = f"{self.index}-{self._counter:08x}"
        now_s = self.now_s()
        try:
            self.model.add_request(rid, prompt_ids, out_len, now_s, output_token_ids=output_ids,
                                   finish_reason=reason)  # fmt: skip
        except ValueError as err:
            raise ApiError(400, str(err)) from None
        live = LiveRequest(rid, uuid.uuid4().hex[:16], output_ids, max_tokens, now_s)
        self._live[rid] = live
        self.metrics.request_received(max_tokens, 1)
        self.metrics.gauges(self.model.stats())
        self._wake.set()
        return live

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        live: LiveRequest | None = None
        try:
            if self.sleep.asleep:
                return ApiError(503, "The model is sleeping (vLLM sleep mode); POST /wake_up wakes it.").response(
                    HTTPStatus.SERVICE_UNAVAILABLE.phrase)
            try:
                body = await read_body(request, self.settings.served_model_name)
                real = self.settings.tokens
                if chat:
                    prompt_ids = real.encode_chat(body) if real else tokens.encode_chat(
                        body.get("messages"), continue_final=body.get("continue_final_message") is True)
                else:
                    if "prompt" not in body:
                        raise ApiError(400, "prompt: required field is missing", "prompt")
                    prompt_ids = real.encode_prompt(body) if real else tokens.encode_prompt(body["prompt"])
                live = self._admit(prompt_ids, body, None if chat else 16)
            except tokens.PromptError as err:
                return ApiError(400, str(err)).response()
            except UnicodeEncodeError as err:  # a lone surrogate ("\udc80"): vLLM's tokenizer refuses it with 400 too
                return ApiError(400, f"the prompt is not valid Unicode text: {err.reason} at position {err.start}",
                                "messages" if chat else "prompt").response()
            except ApiError as err:
                return err.response()
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                response = await self.responses.stream(request, live, len(prompt_ids), chat, include_usage)
            else:
                response = await self.responses.whole(live, len(prompt_ids), chat)
                await response.prepare(request)
                await response.write_eof()
            if not live.client_gone:
                self._answered()
            return response
        finally:
            if live is not None and live.request_id in self._live:
                self._live.pop(live.request_id, None)
                fr = self.model.abort(live.request_id, self.now_s())
                if fr is not None:
                    self.metrics.finished(fr, live.max_tokens)
                    self.metrics.gauges(self.model.stats())
            if task is not None:
                self._handlers.discard(task)

    def _answered(self) -> None:
        self.answered += 1
        limit = self.settings.faults.crash_after_requests
        if limit is not None and self.answered >= limit:
            # A moment after the answer is written, so the N-th response reaches its client.
            asyncio.get_running_loop().call_later(0.01, self.crash, f"fault switch: crash after {limit} request(s)")


    # ----- other routes -----------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        s = self.settings
        return web.json_response({"object": "list", "data": [{
            "id": s.served_model_name, "object": "model", "created": int(time.time()), "owned_by": "fleet-sim",
            "root": s.model_source or f"sim://{self.profile.name}", "parent": None,
            "max_model_len": self.profile.config.max_model_len, "permission": [],
            "simulator": {"note": SIMULATOR_NOTE, "profile": self.profile.name, "stands_for": self.profile.model,
                          "hardware": self.profile.hardware},
        }]})  # fmt: skip

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "fleet-sim", "simulator": SIMULATOR_NOTE})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})  # fmt: skip

    async def _state(self, request: web.Request) -> web.Response:
        st = self.model.stats()
        return web.json_response({
            "simulator": SIMULATOR_NOTE, "profile": self.profile.name, "state": self.state,
            "answered": self.answered, "slowdown": self.model.slowdown, "running": st.num_running,
            "waiting": st.num_waiting, "kv_cache_usage": st.kv_cache_usage, "steps": st.steps,
            "prefix_cache_hits": st.prefix_cache_hits, "prefix_cache_queries": st.prefix_cache_queries,
            "preemptions": st.num_preemptions, "sleep": self.sleep.to_dict(), "stalled": not self._running.is_set(),
        })  # fmt: skip

    async def _faults(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return ApiError(400, "request body is not valid JSON").response()
        slowdown = body.get("slowdown")
        if slowdown is not None:
            if not isinstance(slowdown, (int, float)) or slowdown <= 0:
                return ApiError(400, "slowdown must be a number > 0", "slowdown").response()
            self.model.slowdown = float(slowdown)
        stall = body.get("stall")
        if stall is not None:
            if not isinstance(stall, bool):
                return ApiError(400, "stall must be true or false", "stall").response()
            if stall:
                self._running.clear()
            else:
                self._running.set()
            log.warning("replica %d (port %d): stall fault %s", self.index, self.port, "on" if stall else "off")
        if body.get("crash"):
            asyncio.get_running_loop().call_soon(self.crash, "fault switch: crash requested via POST /sim/faults")
        return web.json_response({"slowdown": self.model.slowdown, "crash": bool(body.get("crash")),
                                  "stall": not self._running.is_set()})  # fmt: skip


    async def _sleep(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /sleep``: requests in flight are aborted (vLLM's default ``mode=abort``),
        the KV cache is dropped with them; an empty 200."""
        try:
            level = parse_level(request.query.get("level"))
        except ValueError as err:
            return ApiError(400, str(err), "level").response()
        if not self.sleep.asleep:
            self._fail_all("request aborted: the engine was put to sleep")
            self.model.reset_prefix_cache()
            self._cache_resets += 1
            self._publish_kv(self.model.take_kv_events())
            self.sleep.sleep(level, self.now_s())
            log.info("replica %d (port %d) asleep at level %d", self.index, self.port, level)
        return web.Response(status=200)

    async def _wake_up(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /wake_up``: answers (an empty 200) once the weights are back, after
        ``wake_s``; concurrent calls wait for the same wake."""
        if self.sleep.asleep:
            if not self.sleep.waking:
                self.sleep.waking = True
                self._woken = asyncio.get_running_loop().create_future()
                try:
                    await asyncio.sleep(self.settings.wake_s)
                finally:
                    self.sleep.woke()
                    self._woken.set_result(None)
                log.info("replica %d (port %d) awake after %.3f s", self.index, self.port, self.settings.wake_s)
            else:
                await asyncio.shield(self._woken)
        return web.Response(status=200)

    async def _is_sleeping(self, request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": self.sleep.asleep})

