"""Starting a process of SIMULATED engine replicas: options, ports, start-up lines, exit code.

Owns `SimEngineOptions` (everything `fleet sim-engine` and ``python -m fleet.enginesim`` accept),
`resolve_profile` (``--profile`` or a ``sim://NAME`` model source), `run` (bind every port,
print one line per replica, write the ports file, serve until a signal), and the process around
the replicas: `bind_socket`, `serve_replicas` (start every `SimReplica`, run until SIGINT/SIGTERM
or until every replica has died of a fault) and `write_ports_file`. Called by `fleet.cli` and
`fleet.enginesim.__main__`; tests bind sockets with `bind_socket`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fleet.enginesim.faults import FaultPlan
from fleet.enginesim.kvpublish import KvEventsConfig
from fleet.enginesim.profiles import DEFAULT_PROFILE, Profile, get_profile
from fleet.enginesim.realtokens import RealTokens
from fleet.enginesim.sleep import wake_time_s
from fleet.enginesim.server import ReplicaSettings, SimReplica

SIM_SCHEME = "sim://"


class OptionsError(ValueError):
    """Options that cannot run; the message says which and why."""


def profile_from_source(source: str) -> str | None:
    """``NAME`` of a ``sim://NAME`` model source, else None."""
    if source.startswith(SIM_SCHEME):
        return source[len(SIM_SCHEME):].strip("/") or None
    return None


def resolve_profile(profile: str | None, model_source: str) -> Profile:
    """The profile named by ``profile``, else by a ``sim://NAME`` source, else the default.

    Raises:
        OptionsError: an unknown profile name (listing the known ones).
    """
    name = profile or profile_from_source(model_source) or DEFAULT_PROFILE
    try:
        return get_profile(name)
    except KeyError as err:
        raise OptionsError(err.args[0]) from None


@dataclass(frozen=True)
class SimEngineOptions:
    replicas: int = 1
    host: str = "127.0.0.1"
    base_port: int = 0                 # 0: free ports chosen by the kernel; else base_port + i
    profile: str | None = None
    model_source: str = ""
    served_model_name: str | None = None
    seed: int = 0
    startup_delay_s: float = 0.0
    faults: FaultPlan = field(default_factory=FaultPlan)
    mean_output_tokens: float | None = None
    config_overrides: dict[str, object] = field(default_factory=dict)
    ports_file: str | None = None
    sleep_mode: bool = False
    wake_s: float | None = None        # None: from the profile's weight bytes per GPU
    kv_events: KvEventsConfig | None = None   # vLLM's --kv-events-config; replica i offsets its ports by i
    tokenizer: str | None = None       # a model directory: its real tokenizer (fleet.enginesim.realtokens)
    prompt_tokens_details: bool = False   # vLLM's --enable-prompt-tokens-details

    def replica_settings(self) -> list[ReplicaSettings]:
        """Settings of each replica. Raises OptionsError."""
        if self.replicas < 1:
            raise OptionsError(f"--replicas must be >= 1, got {self.replicas}")
        if self.wake_s is not None and self.wake_s < 0:
            raise OptionsError(f"--wake-s must be >= 0, got {self.wake_s}")
        profile = resolve_profile(self.profile, self.model_source)
        try:
            profile = profile.with_overrides(**self.config_overrides)
        except ValueError as err:
            raise OptionsError(str(err)) from None
        real = _real_tokens(self.tokenizer) if self.tokenizer else None
        name = self.served_model_name or (
            self.model_source if self.model_source and not self.model_source.startswith(SIM_SCHEME) else profile.model
        )
        one = ReplicaSettings(profile=profile, served_model_name=name, model_source=self.model_source,
                              seed=self.seed, startup_delay_s=self.startup_delay_s, faults=self.faults,
                              mean_output_tokens=self.mean_output_tokens, sleep_mode=self.sleep_mode,
                              wake_s=self.wake_s if self.wake_s is not None
                              else wake_time_s(profile.weight_bytes_per_gpu), kv_events=self.kv_events,
                              tokens=real, prompt_tokens_details=self.prompt_tokens_details)  # fmt: skip
        return [one] * self.replicas


def _real_tokens(directory: str) -> RealTokens:
    """The real tokenizer in ``directory``, loaded once for every replica. Raises OptionsError."""
    from router.kv.tokenizer_files import TokenizerError, load_tokenizer

    try:
        return RealTokens(load_tokenizer(directory))
    except (TokenizerError, ValueError) as err:
        raise OptionsError(f"--tokenizer: {err}") from None


def run(options: SimEngineOptions, out: Callable[[str], None] = print) -> int:
    """Bind, announce and serve ``options.replicas`` simulated replicas; return the exit code.

    Exit codes: 0 after SIGINT/SIGTERM, 1 when every replica died of a fault switch, 2 for bad
    options or a port that cannot be bound.
    """
    try:
        settings = options.replica_settings()
    except OptionsError as err:
        out(f"fleet sim-engine: {err}")
        return 2
    sockets = []
    try:
        for i in range(options.replicas):
            port = options.base_port + i if options.base_port else 0
            sockets.append(bind_socket(options.host, port))
    except OSError as err:
        for s in sockets:
            s.close()
        out(f"fleet sim-engine: cannot bind {options.host}:{port}: {err.strerror or err}")
        return 2
    s0 = settings[0]
    p = s0.profile
    out(f"Fleet engine SIMULATOR (not vLLM): {options.replicas} replica(s) of {s0.served_model_name!r}, "
        f"profile {p.name} ({p.model} on {p.hardware}), seed {s0.seed}")  # fmt: skip
    fault = s0.faults.describe()
    if fault or s0.startup_delay_s:
        out(f"  start-up delay {s0.startup_delay_s:g} s" + (f"; faults: {fault}" if fault else ""))
    if s0.tokens is not None:
        out(f"  tokenizer {s0.tokens.tokenizer.directory} (vocabulary {s0.tokens.vocab_size}; chat template "
            f"{'yes' if s0.tokens.tokenizer.chat_template is not None else 'none'})")
    if s0.sleep_mode:
        out(f"  sleep mode on: POST /sleep?level=1, POST /wake_up ({s0.wake_s:.3f} s), GET /is_sleeping")
    kv = options.kv_events if options.kv_events is not None and options.kv_events.enabled else None
    for i, sock in enumerate(sockets):
        out(f"replica {i} http://{options.host}:{sock.getsockname()[1]}  (simulator)")
        if kv is not None:
            k = kv.for_replica(i)
            out(f"  kv events {k.publisher} {k.endpoint}" + (f", replay {k.replay_endpoint}" if k.replay_endpoint else ""))
    if options.ports_file:
        write_ports_file(options.ports_file, options.host, [sock.getsockname()[1] for sock in sockets],
                         [kv.for_replica(i) for i in range(len(sockets))] if kv is not None else None)
    sys.stdout.flush()

    def on_ready(replicas: list[SimReplica]) -> None:
        live = sum(1 for r in replicas if r.state == "ready")
        out(f"{live}/{len(replicas)} simulated replica(s) listening")
        sys.stdout.flush()

    return asyncio.run(serve_replicas(settings, sockets, host=options.host, on_ready=on_ready))


# ----- many replicas in one process ------------------------------------------------------

def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0 = a free port), not listening yet. Raises OSError."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


async def serve_replicas(
    settings: list[ReplicaSettings],
    sockets: list[socket.socket],
    *,
    host: str,
    on_ready: Callable[[list[SimReplica]], None] | None = None,
    stop: asyncio.Event | None = None,
) -> int:
    """Serve one replica per (settings, bound socket) until SIGINT/SIGTERM (or ``stop``).

    Returns the process exit code: 0 after a signal, 1 when every replica died of a fault.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    dead: set[int] = set()

    def on_dead(replica: SimReplica, reason: str) -> None:
        dead.add(replica.index)
        print(f"replica {replica.index} http://{host}:{replica.port} {replica.state}: {reason}", flush=True)
        if len(dead) == len(replicas):
            stop.set()

    replicas = [SimReplica(s, index=i, on_dead=on_dead) for i, s in enumerate(settings)]
    starts = [asyncio.create_task(r.start(sock)) for r, sock in zip(replicas, sockets)]
    try:
        await asyncio.gather(*starts)
        if on_ready is not None:
            on_ready(replicas)
        await stop.wait()
    finally:
        for t in starts:
            t.cancel()
        await asyncio.gather(*(r.close() for r in replicas), return_exceptions=True)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()
    return 1 if replicas and len(dead) == len(replicas) else 0


def write_ports_file(path: str, host: str, ports: list[int], kv_events: list[KvEventsConfig] | None = None) -> None:
    """Write ``{"ports": [...], "urls": [...], "pid": ...}`` atomically (for scripts and tests);
    with ``kv_events`` (one config per replica) also ``"kv_events": [{"endpoint", "replay_endpoint",
    "topic"}, ...]`` as configured."""
    doc: dict[str, Any] = {"pid": os.getpid(), "simulator": True, "ports": ports,
                           "urls": [f"http://{host}:{port}" for port in ports]}  # fmt: skip
    if kv_events is not None:
        doc["kv_events"] = [{"endpoint": k.endpoint, "replay_endpoint": k.replay_endpoint, "topic": k.topic}
                            for k in kv_events]  # fmt: skip
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)
