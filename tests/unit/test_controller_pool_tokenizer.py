"""The controller names where the router gets the model's tokenizer in its pool
(`router.pools.spec.PoolSpec.tokenizer`): the model's own directory for a path or file:// source when it
holds tokenizer.json, the hub source itself for an hf:// model this machine has not cached (a
router pod fetches the tokenizer files), nothing for sim:// or a directory without one; a miss
or a hub source is looked for again only after TOKENIZER_RECHECK_S."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.controller import pools
from fleet.controller.pools import PoolPublisher, tokenizer_source
from fleet.spec import LoadedDeployment, parse_document


def _loaded(source: str, base: Path) -> LoadedDeployment:
    spec = {"model": {"name": "chat-model", "source": source}, "engine": {"kind": "sim"},
            "resources": {"accelerator": "cpu", "cpuCores": 1}, "replicas": {"min": 1, "max": 1},
            "warmup": {"requests": [{"kind": "completion", "prompt": "hi", "maxTokens": 2}]}}  # fmt: skip
    doc = {"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
           "metadata": {"name": "chat"}, "spec": spec}  # fmt: skip
    return LoadedDeployment(parse_document(doc), base / "chat.yaml", 0)


def test_tokenizer_source_of_local_sources(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    assert tokenizer_source(_loaded(f"file://{model}", tmp_path)) is None        # no tokenizer.json there
    (model / "tokenizer.json").write_text("{}")
    assert tokenizer_source(_loaded(f"file://{model}", tmp_path)) == str(model)
    assert tokenizer_source(_loaded("model", tmp_path)) == str(model)             # relative to the YAML file
    assert tokenizer_source(_loaded("sim://cpu-tiny-llama", tmp_path)) is None


def test_publisher_remembers_and_looks_again_after_a_while(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "model"
    model.mkdir()
    ld = _loaded(str(model), tmp_path)
    now = [1000.0]
    monkeypatch.setattr(pools.time, "monotonic", lambda: now[0])
    publisher = PoolPublisher(records=None, pool_sink=None)  # type: ignore[arg-type]  # not used here
    assert publisher._tokenizer(ld) is None
    (model / "tokenizer.json").write_text("{}")
    assert publisher._tokenizer(ld) is None                 # a miss is remembered for a while
    now[0] += pools.TOKENIZER_RECHECK_S
    assert publisher._tokenizer(ld) == str(model)
    (model / "tokenizer.json").unlink()
    assert publisher._tokenizer(ld) == str(model)           # a hit is kept (the router reports a load failure)


def test_a_hub_model_not_cached_here_names_its_hub_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_CACHE_DIR", str(tmp_path / "empty-cache"))   # an operator pod: no weight cache
    assert tokenizer_source(_loaded("hf://org/chat@0123abcd", tmp_path)) == "hf://org/chat@0123abcd"
    assert tokenizer_source(_loaded("hf://org/chat", tmp_path)) == "hf://org/chat@main"
    assert tokenizer_source(_loaded("https://example.com/m/manifest.json", tmp_path)) is None
