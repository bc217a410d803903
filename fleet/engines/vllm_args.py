"""``spec.engine.args`` checked by the installed vLLM's own argument parser, before any replica
starts.

Owns `check_engine_args` (the args -> `EngineArgsCheck`: the problems vLLM would refuse them
for, each naming the flag, or a note that no vLLM is installed here to ask), `vllm_installed`
and the answers' cache (`cache_dir`). Called by `fleet validate` and `fleet apply`
(`fleet.cli.models.model_check`) for deployments of engine kind ``vllm``.

vLLM is imported lazily, only when a deployment has engine args whose answer is not cached, and
once per process: ``import vllm`` imports torch (vllm/__init__.py imports ``vllm.env_override``,
which imports torch; ``vllm.config`` and ``vllm.engine.arg_utils`` import it again through
their own modules), so no part of vLLM's parser comes without it, and the import takes seconds
(docs/placement.md gives the figure). vLLM's answer for a list of args is the same on every run
of one installed vLLM, so it is kept, one small JSON file per key, under `cache_dir`: the key is
the args, the installed vLLM (its package directory, ``_version.py`` and the size and mtime of
the modules the check reads: `_VLLM_FILES`), this module's own source, and the ``VLLM_*``
variables of the environment (vllm/envs.py reads some defaults from them). A new or edited vLLM,
another check or another environment asks vLLM again; an unreadable cache file is asked again
and written over; a cache that cannot be written is skipped.

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
import hashlib
import importlib.util
import json
import logging
import os
import tempfile
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("fleet.engines")

CACHE_FORMAT = 1
"""Version of the cache files' layout (part of the key)."""
_VLLM_FILES = ("_version.py", "__init__.py", "engine/arg_utils.py", "entrypoints/launchers/cli_args.py",
               "utils/argparse_utils.py", "config/__init__.py", "config/cache.py", "config/model.py",
               "config/parallel.py", "config/scheduler.py")
"""The installed vLLM's modules (relative to its package directory) whose size and mtime key the
cache: the version, the parser and the config classes the check asks."""


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


def cache_dir() -> Path:
    """Where vLLM's answers are kept: ``$XDG_CACHE_HOME/fleet/vllm-args``, else
    ``~/.cache/fleet/vllm-args``."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "fleet" / "vllm-args"


def _vllm_identity() -> str:
    """The installed vLLM as the cache key reads it (module docstring): its package directory,
    its ``_version.py`` and the size and mtime (ns) of each of `_VLLM_FILES`; no import."""
    spec = importlib.util.find_spec("vllm")
    root = Path(spec.origin).parent if spec is not None and spec.origin else Path("?")
    parts = [str(root)]
    try:
        parts.append((root / "_version.py").read_text())
    except OSError:
        parts.append("no _version.py")
    for rel in _VLLM_FILES:
        try:
            st = (root / rel).stat()
            parts.append(f"{rel} {st.st_size} {st.st_mtime_ns}")
        except OSError:
            parts.append(f"{rel} -")
    return "\n".join(parts)


def _cache_key(args: list[str]) -> str:
    """sha256 of what vLLM's answer depends on (module docstring), as 64 hex digits."""
    what = {"format": CACHE_FORMAT, "args": args, "vllm": _vllm_identity(),
            "check": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_")}}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def _cached(key: str) -> list[str] | None:
    """The problems kept under ``key``, or None (not kept, or unreadable)."""
    try:
        doc = json.loads((cache_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    problems = doc.get("problems") if isinstance(doc, dict) else None
    if not isinstance(problems, list) or not all(isinstance(p, str) for p in problems):
        return None
    return problems


def _keep(key: str, args: list[str], problems: list[str]) -> None:
    """Write the answer under ``key`` (atomically: a concurrent reader sees the old file or the
    new one); a cache that cannot be written is skipped."""
    root = cache_dir()
    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{key}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"args": args, "problems": problems}, f)
        os.replace(tmp, root / f"{key}.json")
    except OSError as err:
        log.debug("vLLM's answer not cached in %s: %s", root, err)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def check_engine_args(args: list[str] | tuple[str, ...], ask_vllm: bool = True) -> EngineArgsCheck:
    """What the installed vLLM says of ``args`` (``spec.engine.args``; module docstring). No args:
    nothing is imported. No vLLM installed, or ``ask_vllm`` False (`fleet validate
    --no-vllm-check`): one note saying the flags were not checked. The answer comes from the
    cache (`cache_dir`) when this vLLM was asked about these args before, else from vLLM (and is
    kept)."""
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
    key = _cache_key(list(args))
    cached = _cached(key)
    if cached is not None:
        out.problems.extend(cached)
        return out
    out.problems.extend(_ask_vllm(list(args)))   # a copy: vLLM's parser may rewrite the list it parses
    _keep(key, list(args), out.problems)
    return out


def _ask_vllm(args: list[str]) -> list[str]:
    """The installed vLLM's problems with ``args``: its serve parser, the config fields the
    args change, the serve command's own checks (module docstring). Imports vLLM."""
    problems: list[str] = []
    p = _vllm_parser()
    try:
        ns = p.parser.parse_args(args)
    except _ParseError as err:
        return [f"{err} (vLLM {p.version}'s vllm serve parser)"]
    for dest, value in vars(ns).items():
        if dest in p.defaults and p.defaults[dest] == value:
            continue
        problems.extend(_field_problems(p, dest, value))
    if p.serve_checks is not None and not problems:
        try:
            p.serve_checks(ns)
        except (TypeError, ValueError) as err:
            problems.append(f"{str(err).removeprefix('Error: ')} (vLLM {p.version} vllm serve)")
    return problems
