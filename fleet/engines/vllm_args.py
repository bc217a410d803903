"""``spec.engine.args`` checked by the installed vLLM's own argument parser, before any replica
starts.

Owns `check_engine_args` (the args -> `EngineArgsCheck`: the problems vLLM would refuse them
for, each naming the flag, or a note that no vLLM is installed here to ask) and `vllm_installed`.
Called by `fleet validate` (`fleet.cli.models.model_check`) for deployments of engine kind
``vllm``. vLLM is imported lazily, only when a deployment has engine args to check, and once per
process (its import takes seconds: docs/placement.md gives the figure).

What is asked of vLLM (vLLM 0.32, paths in the vllm package):

- the parser of ``vllm serve``: ``entrypoints/launchers/cli_args.py`` ``make_arg_parser`` over
  ``utils/argparse_utils.py`` ``FlexibleArgumentParser`` (the frontend's flags and
  ``engine/arg_utils.py`` ``EngineArgs.add_cli_args``; ``EngineArgs.add_cli_args`` alone where
  the serve parser is missing): unknown flags, values of the wrong type, choices;
- each value the args change, checked against the field of vLLM's config classes
  (``vllm.config``: ``CacheConfig``, ``SchedulerConfig``, ``ParallelConfig``, ...) it lands in,
  with that field's own pydantic constraints: the range checks ``EngineArgs.create_engine_config``
  runs when it builds those configs (``--gpu-memory-utilization`` in (0, 1], ``--max-num-seqs``
  >= 1), none of which needs a GPU;
- ``validate_parsed_serve_args`` (the serve command's own checks before loading, e.g.
  ``--enable-auto-tool-choice`` without ``--tool-call-parser``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import logging
import os
import typing
import warnings
from dataclasses import dataclass, field


def vllm_installed() -> bool:
    """Whether a vLLM package can be imported here (no import: ``importlib.util.find_spec``)."""
    return importlib.util.find_spec("vllm") is not None


@dataclass
class EngineArgsCheck:
    """``problems``: why vLLM refuses the args, one line each naming the flag; ``notes``: what
    could not be checked (no vLLM here)."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class _ParseError(Exception):
    """argparse's error, raised instead of printing usage and exiting."""


@dataclass(frozen=True)
class _Parser:
    """The installed vLLM's serve parser, its defaults, flag names by dest, and vLLM's config
    classes (pydantic dataclasses) by field name."""

    parser: argparse.ArgumentParser
    defaults: dict
    flags: dict[str, str]
    fields: dict[str, list]
    serve_checks: typing.Callable[[argparse.Namespace], None] | None
    version: str


@contextlib.contextmanager
def _quiet_vllm_import() -> typing.Iterator[None]:
    """vLLM's import logs its platform checks (e.g. Triton's missing CPU backend) through its own
    handler; `fleet validate` prints only its verdict: ``VLLM_CONFIGURE_LOGGING=0`` (vllm/envs.py)
    and the ``vllm`` logger at ERROR for the import, both restored after."""
    vllm_logger = logging.getLogger("vllm")
    level, before = vllm_logger.level, os.environ.get("VLLM_CONFIGURE_LOGGING")
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    vllm_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        vllm_logger.setLevel(level)
        if before is None:
            os.environ.pop("VLLM_CONFIGURE_LOGGING", None)
        else:
            os.environ["VLLM_CONFIGURE_LOGGING"] = before


@functools.lru_cache(maxsize=1)
def _vllm_parser() -> _Parser:
    with _quiet_vllm_import():
        import vllm
        import vllm.config as vllm_config
        from vllm.utils.argparse_utils import FlexibleArgumentParser

    class RaisingParser(FlexibleArgumentParser):
        def error(self, message: str) -> typing.NoReturn:   # argparse's hook: print usage, exit 2
            raise _ParseError(message)

    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        parser = make_arg_parser(RaisingParser())
        serve_checks = validate_parsed_serve_args
    except ImportError:   # a vLLM without the serve parser there: the engine's flags alone
        from vllm.engine.arg_utils import EngineArgs
        parser = EngineArgs.add_cli_args(RaisingParser())
        serve_checks = None
    flags = {}
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs or action.option_strings:
            flags.setdefault(action.dest, (longs or action.option_strings)[0])
    fields: dict[str, list] = {}
    for cls in vars(vllm_config).values():
        if isinstance(cls, type) and hasattr(cls, "__pydantic_fields__"):
            for name, info in cls.__pydantic_fields__.items():
                fields.setdefault(name, []).append((cls.__name__, info))
    return _Parser(parser, vars(parser.parse_args([])), flags, fields, serve_checks,
                   getattr(vllm, "__version__", "?"))


def _field_problems(p: _Parser, dest: str, value: object) -> list[str]:
    from pydantic import TypeAdapter, ValidationError

    out = []
    for cls_name, info in p.fields.get(dest, ()):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")   # pydantic warns about dataclass-only Field() attributes
                TypeAdapter(typing.Annotated[info.annotation, info]).validate_python(value)
        except ValidationError as err:
            why = "; ".join(e["msg"] for e in err.errors())
            out.append(f"{p.flags.get(dest, dest)} {value!r}: {why} (vLLM {p.version} {cls_name}.{dest})")
        except Exception:   # noqa: BLE001 - a field type pydantic cannot build alone: vLLM checks it at start
            continue
    return out[:1]


def check_engine_args(args: list[str] | tuple[str, ...], ask_vllm: bool = True) -> EngineArgsCheck:
    """What the installed vLLM says of ``args`` (``spec.engine.args``; module docstring). No args:
    nothing is imported. No vLLM installed, or ``ask_vllm`` False (`fleet validate
    --no-vllm-check`): one note saying the flags were not checked."""
    out = EngineArgsCheck()
    if not args:
        return out
    if not ask_vllm:
        out.notes.append("engine args not checked against vLLM (--no-vllm-check)")
        return out
    if not vllm_installed():
        out.notes.append("engine args not checked against vLLM: vLLM is not installed here (fleet validate "
                         "asks the installed vLLM's own parser where there is one)")
        return out
    p = _vllm_parser()
    try:
        ns = p.parser.parse_args(list(args))
    except _ParseError as err:
        out.problems.append(f"{err} (vLLM {p.version}'s vllm serve parser)")
        return out
    for dest, value in vars(ns).items():
        if dest in p.defaults and p.defaults[dest] == value:
            continue
        out.problems.extend(_field_problems(p, dest, value))
    if p.serve_checks is not None and not out.problems:
        try:
            p.serve_checks(ns)
        except (TypeError, ValueError) as err:
            out.problems.append(f"{str(err).removeprefix('Error: ')} (vLLM {p.version} vllm serve)")
    return out
