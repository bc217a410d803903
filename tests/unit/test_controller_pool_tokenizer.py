"""The controller names the model's tokenizer directory in its pool (`router.spec.PoolSpec.tokenizer`):
the model's own directory for a path or file:// source when it holds tokenizer.json, nothing for
sim:// or a directory without one; a miss is looked for again only after TOKENIZER_RECHECK_S."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.controller import pools
from fleet.controller.pools import PoolPublisher, tokenizer_dir
from fleet.spec import LoadedDeployment, parse_document


def _loaded(source: str, base: Path) -> LoadedDeployment:
    spec = {"model": {"name": "chat-model", "source": source}, "engine": {"kind": "sim"},
            "resources": {"accelerator": "cpu", "cpuCores": 1}, "replicas": {"min": 1, "max": 1},
            "warmup": {"requests": [{"kind": "completion", "prompt": "hi", "maxTokens": 2}]}}  # fmt: skip
    doc = {"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
           "metadata": {"name": "chat"}, "spec": spec}  # fmt: skip
    return LoadedDeployment(parse_document(doc), base / "chat.yaml", 0)


def test_tokenizer_dir_of_local_sources(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    assert tokenizer_dir(_loaded(f"file://{model}", tmp_path)) is None        # no tokenizer.json there
    (model / "tokenizer.json").write_text("{}")
    assert tokenizer_dir(_loaded(f"file://{model}", tmp_path)) == str(model)
    assert tokenizer_dir(_loaded("model", tmp_path)) == str(model)             # relative to the YAML file
    assert tokenizer_dir(_loaded("sim://cpu-tiny-llama", tmp_path)) is None


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
