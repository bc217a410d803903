"""What the engine will read, read before it runs: weights at the dtype vLLM loads them
(``--quantization``, a checkpoint's ``quantization_config``), the KV cache at
``--kv-cache-dtype``, ``--max-model-len`` against the model's maximum as vLLM derives it
(fleet/models/quant.py, fleet/models/maxlen.py), and what `fleet validate` says of each. The
installed vLLM's own parser is checked in tests/integration/test_vllm_engine_args.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fleet.cli import app
from fleet.models import EngineMemorySettings, MemoryNeed, facts_from_config
from fleet.models.maxlen import allows_long_max_len, derive_max_len, max_model_len_problem
from tests.support.inventories import H100

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "model_configs"
H100_MIB = 81559   # NVML's memory.total of an H100 80GB HBM3 (fleet/models/advise.py)


def config(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


def need(name: str, tp: int, *args: str, cfg: dict | None = None) -> MemoryNeed:
    return MemoryNeed(facts_from_config(cfg or config(name)), EngineMemorySettings.from_engine_args(list(args)), tp)


# ----- weights at the dtype vLLM loads them -----------------------------------------------------

def test_online_fp8_holds_70b_at_tp2_on_h100_where_bf16_cannot():
    # The model's whole 131,072-token context: 20 GiB of KV cache per GPU beside the weights.
    bf16 = need("llama-3.1-70b-instruct", 2)
    fp8 = need("llama-3.1-70b-instruct", 2, "--quantization", "fp8")
    assert bf16.fits(H100_MIB) is not None and "weights 65.71 GiB" in bf16.fits(H100_MIB)
    assert fp8.fits(H100_MIB) is None
    # Linear layers at 1 byte; embeddings and the untied LM head (2 x 128,256 x 8,192) stay bf16.
    embed_bytes = 2 * 128256 * 8192 * 2
    f = fp8.facts
    assert fp8.loaded_weight_bytes == pytest.approx((f.parameters - f.embedding_parameters) + embed_bytes, rel=1e-6)
    assert 0.5 < fp8.loaded_weight_bytes / f.weight_bytes < 0.52


def test_online_methods_that_quantize_only_experts_leave_a_dense_model_unchanged():
    dense = need("llama-3.1-8b-instruct", 1, "--quantization", "int8_per_channel_weight_only")
    assert dense.loaded_weight_bytes == dense.facts.weight_bytes
    moe = need("mixtral-8x7b-instruct-v0.1", 2, "--quantization", "int8_per_channel_weight_only")
    assert moe.facts.expert_parameters > 0.9 * moe.facts.parameters
    assert moe.loaded_weight_bytes < 0.55 * moe.facts.weight_bytes


def test_a_quantized_checkpoint_is_counted_at_its_own_width_and_ignores_online_quantization():
    base = config("llama-3.1-70b-instruct")
    bf16 = facts_from_config(base)
    awq = facts_from_config({**base, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}})
    fp8 = facts_from_config({**base, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}})
    ct = facts_from_config({**base, "quantization_config": {
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float"}, "targets": ["Linear"]}}}})
    assert awq.quantization == "awq" and awq.weight_bytes == bf16.weight_bytes // 4
    assert fp8.weight_bytes == ct.weight_bytes == bf16.weight_bytes // 2
    # vLLM's get_quant_config reads the checkpoint's config first: --quantization changes nothing.
    on_fp8 = MemoryNeed(fp8, EngineMemorySettings.from_engine_args(["--quantization", "fp8"]), 2)
    assert on_fp8.loaded_weight_bytes == fp8.weight_bytes


def test_kv_cache_dtype_fp8_counts_one_byte_per_element():
    auto = need("qwen2.5-7b-instruct", 1, "--max-model-len", "32768")
    fp8 = need("qwen2.5-7b-instruct", 1, "--max-model-len", "32768", "--kv-cache-dtype", "fp8")
    assert fp8.kv_bytes_per_token * 2 == auto.kv_bytes_per_token
    assert fp8.concurrency(H100_MIB) > 1.9 * auto.concurrency(H100_MIB)


def test_sizes_read_as_vllm_reads_them():
    assert EngineMemorySettings.from_engine_args(["--max-model-len", "32K"]).max_model_len == 32768
    assert EngineMemorySettings.from_engine_args(["--max-model-len=32k"]).max_model_len == 32000
    assert EngineMemorySettings.from_engine_args(["--max-model-len", "auto"]).max_model_len is None


# ----- --max-model-len against the model's maximum -----------------------------------------------

def test_max_model_len_above_the_models_maximum_is_refused_as_vllm_refuses_it():
    qwen = facts_from_config(config("qwen2.5-7b-instruct")).model_max_len
    assert (qwen.limit, qwen.default) == (32768, 32768)
    assert max_model_len_problem(qwen, 32768) is None
    problem = max_model_len_problem(qwen, 65536)
    assert problem.startswith("--max-model-len 65,536 is above the model's maximum 32,768 "
                              "(max_position_embeddings=32768 in config.json)")
    assert max_model_len_problem(qwen, 65536, allow_long=True) is None
    assert allows_long_max_len({"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "True"})
    assert not allows_long_max_len({"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "0"}) and not allows_long_max_len(None)


def test_max_len_follows_vllms_keys_and_rope_scaling():
    # llama3 RoPE leaves max_position_embeddings already scaled: 131,072, no factor applied.
    assert facts_from_config(config("llama-3.1-70b-instruct")).model_max_len.limit == 131072
    base = {"max_position_embeddings": 4096}
    assert derive_max_len({**base, "rope_scaling": {"type": "linear", "factor": 4.0}}).limit == 16384
    assert derive_max_len({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}).limit == 4096
    assert derive_max_len({**base, "rope_scaling": {"type": "linear", "factor": 4.0}}, "gemma3_text").limit == 4096
    assert derive_max_len({**base, "n_positions": 2048}).limit == 2048          # the smallest key wins
    assert derive_max_len({**base, "model_max_length": 8192}).limit == 8192     # Command-R's key overrides
    assert derive_max_len(base, tokenizer_max_length=1024).limit == 1024
    none = derive_max_len({})
    assert none.limit is None and none.default == 2048 and max_model_len_problem(none, 10 ** 6) is None
    longrope = derive_max_len({"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                               "rope_scaling": {"type": "longrope", "long_factor": [1.0]}})
    assert (longrope.limit, longrope.default) == (131072, 4096)


# ----- fleet validate ----------------------------------------------------------------------------

def _deployment(tmp_path: Path, model: str, resources: str, args: list[str], env: str = "{}") -> Path:
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text((CONFIGS / f"{model}.json").read_text())
    f = tmp_path / "dep.yaml"
    f.write_text(f"""apiVersion: fleet.inference.dev/v1alpha1
kind: InferenceDeployment
metadata: {{name: m}}
spec:
  model: {{name: m, source: ./model}}
  engine: {{args: {json.dumps(args)}, env: {env}}}
  resources: {resources}
""")
    return f


def run(*args: str):
    return CliRunner().invoke(app, list(args), catch_exceptions=False, terminal_width=250)


def test_validate_accepts_70b_at_tp2_with_online_fp8_and_refuses_it_without(tmp_path):
    shape = f'{{gpuProduct: "{H100}", tensorParallelSize: 2}}'
    result = run("validate", str(_deployment(tmp_path, "llama-3.1-70b-instruct", shape, [])))
    assert result.exit_code == 2 and "does not fit NVIDIA H100 80GB HBM3" in result.output
    f = _deployment(tmp_path, "llama-3.1-70b-instruct", shape, ["--quantization", "fp8"])
    result = run("validate", str(f))
    assert result.exit_code == 0, result.output
    assert "loaded as fp8 (" in result.output and "fits NVIDIA H100 80GB HBM3" in result.output


def test_validate_refuses_a_max_model_len_above_the_models_maximum(tmp_path):
    shape = f'{{gpuProduct: "{H100}", tensorParallelSize: 1}}'
    result = run("validate", str(_deployment(tmp_path, "qwen2.5-7b-instruct", shape, ["--max-model-len", "65536"])))
    assert result.exit_code == 2, result.output
    assert "spec.engine.args: --max-model-len 65,536 is above the model's maximum 32,768" in result.output
    f = _deployment(tmp_path, "qwen2.5-7b-instruct", shape, ["--max-model-len", "65536"],
                    env='{VLLM_ALLOW_LONG_MAX_MODEL_LEN: "1"}')
    assert run("validate", str(f)).exit_code == 0


def test_validate_refuses_a_cpu_replicas_max_model_len_above_the_models_maximum(tmp_path):
    # No device memory to check on CPU, but vLLM's length rule holds there as on a GPU.
    cpu = "{accelerator: cpu}"
    result = run("validate", "--no-vllm-check",
                 str(_deployment(tmp_path, "qwen2.5-7b-instruct", cpu, ["--max-model-len", "65536"])))
    assert result.exit_code == 2, result.output
    assert "spec.engine.args: --max-model-len 65,536 is above the model's maximum 32,768" in result.output
    result = run("validate", "--no-vllm-check",
                 str(_deployment(tmp_path, "qwen2.5-7b-instruct", cpu, ["--max-model-len", "8192"])))
    assert result.exit_code == 0, result.output
    assert "CPU replica: up to 8,192 tokens per sequence, host memory not checked" in result.output


def test_validate_says_when_no_vllm_is_here_to_check_the_flags(tmp_path):
    shape = f'{{gpuProduct: "{H100}", tensorParallelSize: 1}}'
    f = _deployment(tmp_path, "qwen2.5-7b-instruct", shape, ["--max-model-len", "8192"])
    result = run("validate", str(f))
    assert result.exit_code == 0, result.output
    assert "engine args not checked against vLLM: vLLM is not installed here" in result.output



def test_a_mig_slice_without_gpu_product_is_sized_as_nvml_reports_it_on_an_h100(tmp_path):
    # Llama 3.1 70B AWQ 4-bit at 2,048 tokens: needs ~35 GiB, more than 38,146 MiB (40 GB, the
    # profile's name) x 0.92 holds, less than NVML's 40,448 MiB x 0.92.
    cfg = {**config("llama-3.1-70b-instruct"), "quantization_config": {"quant_method": "awq", "bits": 4}}
    awq = MemoryNeed(facts_from_config(cfg), EngineMemorySettings(max_model_len=2048), 1)
    assert awq.fits(38146) is not None and awq.fits(40448) is None
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(cfg))
    f = tmp_path / "dep.yaml"
    f.write_text("apiVersion: fleet.inference.dev/v1alpha1\nkind: InferenceDeployment\nmetadata: {name: m}\n"
                 "spec:\n  model: {name: m, source: ./model}\n  engine: {args: [--max-model-len, '2048']}\n"
                 "  resources: {migProfile: 3g.40gb}\n")
    result = run("validate", str(f))
    assert result.exit_code == 0, result.output
    assert "fits MIG 3g.40gb (sized as on an H100 80GB): " in result.output


def test_no_vllm_check_says_the_flags_were_not_checked(tmp_path):
    f = _deployment(tmp_path, "qwen2.5-7b-instruct", f'{{gpuProduct: "{H100}", tensorParallelSize: 1}}',
                    ["--max-model-len", "8192"])
    result = run("validate", "--no-vllm-check", str(f))
    assert result.exit_code == 0 and "engine args not checked against vLLM (--no-vllm-check)" in result.output


def test_fleet_up_preflight_refuses_a_max_model_len_vllm_refuses(tmp_path):
    from fleet.local.preflight import PreflightError, preflight
    from fleet.spec import load_deployments
    from tests.support.inventories import cluster, node

    f = _deployment(tmp_path, "qwen2.5-7b-instruct", "{tensorParallelSize: 1}", ["--max-model-len", "65536"])
    with pytest.raises(PreflightError) as err:
        preflight(load_deployments([f]), cluster(node("gpu-box", n=1)), {})
    assert [p for p in err.value.problems if "spec.engine.args: --max-model-len 65,536 is above" in p]
