"""vLLM's answer on a deployment's engine args is kept (fleet/engines/vllm_args.py): asked once
per installed vLLM, args, check and ``VLLM_*`` environment, read back on the next `fleet
validate` or `fleet apply` without importing vLLM; anything the answer depends on asks again.
vLLM itself is stood in for by a counting fake here (the unit tier imports no vLLM; the real
parser is checked in tests/integration/test_vllm_engine_args.py)."""

from __future__ import annotations

import os
import sys

import pytest

from fleet.engines import vllm_args

REFUSED = "--gpu-memory-utilization 1.5: Input should be less than or equal to 1 (vLLM 0.32.0 CacheConfig)"


@pytest.fixture
def asked(monkeypatch, tmp_path) -> list[list[str]]:
    """vLLM counts as installed; each question that reaches it is recorded; the cache under tmp_path."""
    monkeypatch.setattr(vllm_args, "vllm_installed", lambda: True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for key in [k for k in os.environ if k.startswith("VLLM_")]:
        monkeypatch.delenv(key)
    calls: list[list[str]] = []

    def ask(args: list[str]) -> list[str]:
        calls.append(list(args))
        return [REFUSED] if "1.5" in args else []
    monkeypatch.setattr(vllm_args, "_ask_vllm", ask)
    return calls


def test_the_same_args_are_answered_from_the_cache_the_second_time(asked, tmp_path):
    args = ["--gpu-memory-utilization", "1.5"]
    first = vllm_args.check_engine_args(args)
    second = vllm_args.check_engine_args(args)
    assert first.problems == second.problems == [REFUSED] and second.notes == []
    assert asked == [args]
    assert vllm_args.cache_dir() == tmp_path / "cache" / "fleet" / "vllm-args"
    assert vllm_args.check_engine_args(["--max-num-seqs", "64"]).problems == []   # passing args are kept too
    assert vllm_args.check_engine_args(["--max-num-seqs", "64"]).problems == []
    assert asked == [args, ["--max-num-seqs", "64"]]


def test_what_the_answer_depends_on_asks_vllm_again(asked, monkeypatch):
    args = ["--max-num-seqs", "64"]
    vllm_args.check_engine_args(args)
    vllm_args.check_engine_args([*args, "--enforce-eager"])          # other args
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    vllm_args.check_engine_args(args)                                # another VLLM_* environment
    monkeypatch.setattr(vllm_args, "_vllm_identity", lambda: "/elsewhere/vllm\n__version__ = '0.33.0'")
    vllm_args.check_engine_args(args)                                # another installed vLLM
    assert len(asked) == 4
    monkeypatch.setenv("UNRELATED", "x")                             # an environment vLLM does not read
    vllm_args.check_engine_args(args)
    assert len(asked) == 4


def test_the_installed_vllm_is_told_by_its_files_without_importing_it(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "vllm"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (pkg / "_version.py").write_text("__version__ = '0.32.0'\n")
    (pkg / "engine" / "arg_utils.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    before = vllm_args._vllm_identity()
    assert str(pkg) in before and "0.32.0" in before
    (pkg / "engine" / "arg_utils.py").write_text("x = 22\n")   # an edited vLLM (a dev install)
    assert vllm_args._vllm_identity() != before


def test_an_unreadable_cache_file_is_asked_again_and_written_over(asked):
    args = ["--gpu-memory-utilization", "1.5"]
    vllm_args.check_engine_args(args)
    [kept] = list(vllm_args.cache_dir().glob("*.json"))
    kept.write_text("{not json")
    assert vllm_args.check_engine_args(args).problems == [REFUSED]
    assert vllm_args.check_engine_args(args).problems == [REFUSED]
    assert len(asked) == 2


def test_a_cache_that_cannot_be_written_still_answers(asked, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    args = ["--gpu-memory-utilization", "1.5"]
    assert vllm_args.check_engine_args(args).problems == [REFUSED]
    assert vllm_args.check_engine_args(args).problems == [REFUSED]
    assert len(asked) == 2


def test_no_vllm_check_and_no_args_neither_ask_nor_write(asked):
    assert vllm_args.check_engine_args(["--max-num-seqs", "64"], ask_vllm=False).notes
    assert vllm_args.check_engine_args([]).problems == []
    assert asked == [] and not vllm_args.cache_dir().exists()
