"""KV cache events of a SIMULATED replica on vLLM's wire: ``--kv-events-config``, the PUB socket
and the replay socket.

Owns `KvEventsConfig` (vLLM's ``--kv-events-config`` JSON, the same keys and defaults:
vllm/config/kv_events.py) and `KvEventPublisher`, which numbers each batch, keeps the last
``buffer_steps`` for replay, hands every batch to in-process sinks and, with ``publisher: zmq``,
sends it as vLLM's `ZmqEventPublisher` does (vllm/distributed/kv_events.py):

- PUB multipart ``(topic, seq as 8 bytes big-endian, msgpack payload)``, seq from 0 per replica;
  the payload is `router.kv.events.encode_batch` of one engine step's events;
- a ROUTER replay socket: a request ``(b"", start_seq 8 bytes)`` is answered with
  ``(b"", topic, seq, payload)`` for every buffered batch with seq >= start_seq, then
  ``(b"", b"", END_SEQ, b"")`` with END_SEQ = -1 as 8 signed bytes (``_service_replay``).

vLLM binds the PUB socket only when the endpoint is a wildcard (``*`` or ``::``) or an ``ipc://``
/ ``inproc://`` address and connects to it otherwise; the replay socket always binds
(``_is_bind_endpoint``, ``_bind``); this follows the same rules. With several replicas in one
process, replica ``i`` offsets both ports by ``i`` as vLLM offsets them by data-parallel rank
(``offset_endpoint_port``).

Everything runs on the replica's event loop: a send on PUB never blocks (ZMQ drops past ``hwm``)
and the replay task yields between batches, so serving never waits on a subscriber. Used by
`fleet.enginesim.server`; the trace simulator takes batches from the model directly
(`fleet.enginesim.model.StepResult.kv_event_batch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields

from router.kv.events import END_SEQ, EventBatch, encode_batch

log = logging.getLogger("fleet.enginesim")

REPLAY_YIELD_EVERY = 64
"""Replayed batches sent between two yields to the event loop."""


class KvEventsConfigError(ValueError):
    """A ``--kv-events-config`` that cannot be used; the message names the key."""


@dataclass(frozen=True)
class KvEventsConfig:
    """vLLM's `KVEventsConfig` (vllm/config/kv_events.py), same keys and defaults.

    Attributes:
        enable_kv_cache_events: make events at all.
        publisher: ``zmq`` or ``null`` (default: zmq when enabled).
        endpoint: PUB address (``tcp://*:5557`` binds; ``tcp://host:port`` connects).
        replay_endpoint: ROUTER address for replay requests (always bound); None: no replay.
        buffer_steps: batches kept for replay.
        hwm: the PUB socket's high-water mark (messages queued per subscriber before drops).
        max_queue_size: vLLM's queue to its publisher thread; accepted (sends here are immediate).
        topic: first frame of every message (subscribers filter on it).
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise KvEventsConfigError(f"--kv-events-config publisher: {self.publisher!r} is not zmq or null")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KvEventsConfigError(f"--kv-events-config {name}: {value!r} is not an integer >= 1")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.startswith(("tcp://", "ipc://",
                                                                                          "inproc://"))):
                raise KvEventsConfigError(f"--kv-events-config {name}: {value!r} is not a tcp://, ipc:// or "
                                          "inproc:// address")  # fmt: skip

    @property
    def enabled(self) -> bool:
        """Events are made (and published, with ``zmq``)."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_json(cls, text: str) -> KvEventsConfig:
        """Parse the flag's JSON. Raises KvEventsConfigError naming the key."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as err:
            raise KvEventsConfigError(f"--kv-events-config is not JSON: {err}") from None
        if not isinstance(doc, dict):
            raise KvEventsConfigError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise KvEventsConfigError(f"--kv-events-config: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**doc)

    def for_replica(self, index: int) -> KvEventsConfig:
        """The config of replica ``index`` of a process: ports offset by ``index`` (vLLM's
        ``offset_endpoint_port``: port 0 stays 0, ``inproc://x`` becomes ``inproc://x_dp<i>``)."""
        if index == 0:
            return self
        return KvEventsConfig(**{**self.__dict__, "endpoint": offset_endpoint_port(self.endpoint, index),
                                 "replay_endpoint": offset_endpoint_port(self.replay_endpoint, index)})


def offset_endpoint_port(endpoint: str | None, index: int) -> str | None:
    """vLLM's ``ZmqEventPublisher.offset_endpoint_port``; ``ipc://`` paths get ``_dp<i>`` too."""
    if not endpoint or index == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{index}"
    base, _, port = endpoint.rpartition(":")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + index}"


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard, ipc and inproc addresses; connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    """Numbers, buffers and publishes one replica's event batches (see the module docstring).

    Args:
        config: the replica's config (`KvEventsConfig.for_replica`); must be enabled.
        sinks: in-process consumers, each called with ``(seq, batch)`` for every batch, in order.
    """

    def __init__(self, config: KvEventsConfig, sinks: tuple[Callable[[int, EventBatch], None], ...] = ()) -> None:
        self.config = config
        self.sinks = list(sinks)
        self.topic = config.topic.encode()
        self.next_seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.endpoint: str | None = None          # where it bound or connected (port 0 resolved)
        self.replay_endpoint: str | None = None
        self.replays_served = 0
        self._ctx = None
        self._pub = None
        self._replay = None
        self._replay_task: asyncio.Task | None = None

    def open(self) -> None:
        """Bind (or connect) the sockets; with ``publisher: null`` only the sinks get batches.
        Raises zmq.ZMQError (address in use, bad address)."""
        if self.config.publisher != "zmq":
            return
        import zmq
        import zmq.asyncio

        self._ctx = zmq.Context()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.set_hwm(self.config.hwm)
            if is_bind_endpoint(self.config.endpoint):
                self._pub.bind(self.config.endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(self.config.endpoint)
                self.endpoint = self.config.endpoint
            if self.config.replay_endpoint is not None:
                self._replay = zmq.asyncio.Context.shadow(self._ctx).socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
                self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay(),
                                                                           name="sim-kv-replay")  # fmt: skip
        except Exception:
            self.close()
            raise

    def publish(self, batch: EventBatch) -> int:
        """Send ``batch`` as the next seq (returned); never blocks."""
        seq = self.next_seq
        self.next_seq += 1
        payload = encode_batch(batch)
        self.buffer.append((seq, payload))
        for sink in self.sinks:
            sink(seq, batch)
        if self._pub is not None:
            import zmq

            try:
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            except zmq.ZMQError as err:   # PUB drops at its high-water mark; anything else is logged
                log.warning("kv events: cannot publish seq %d: %s", seq, err)
        return seq

    def replay_frames(self, start_seq: int) -> list[tuple[bytes, bytes, bytes]]:
        """The ``(topic, seq, payload)`` frames a replay from ``start_seq`` answers, END_SEQ last."""
        frames = [(self.topic, seq.to_bytes(8, "big"), buf) for seq, buf in list(self.buffer) if seq >= start_seq]
        frames.append((b"", END_SEQ, b""))
        return frames

    async def _serve_replay(self) -> None:
        while True:
            try:
                frame = await self._replay.recv_multipart()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - a socket error ends replay, never the replica
                log.warning("kv events: replay socket failed: %s", err)
                return
            if len(frame) != 3:
                log.warning("kv events: invalid replay request of %d frame(s)", len(frame))
                continue
            client_id, _, start = frame
            for i, (topic, seq, payload) in enumerate(self.replay_frames(int.from_bytes(start, "big"))):
                await self._replay.send_multipart((client_id, b"", topic, seq, payload))
                if i % REPLAY_YIELD_EVERY == REPLAY_YIELD_EVERY - 1:
                    await asyncio.sleep(0)
            self.replays_served += 1

    def close(self) -> None:
        """Close the sockets (no linger) and stop answering replays."""
        if self._replay_task is not None:
            self._replay_task.cancel()
            self._replay_task = None
        for sock in (self._pub, self._replay):
            if sock is not None:
                with contextlib.suppress(Exception):
                    sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
