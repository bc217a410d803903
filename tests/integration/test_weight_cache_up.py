"""`fleet up` with weights from a model hub: the replica is CACHING (bytes shown) while the node's
weight cache fetches `hf://org/tiny` from a local server that speaks the Hugging Face Hub's HTTP
API (fleet/testing/hub_server.py), then starts from the cache; a second deployment of the same weights
starts without a download. Engines are the engine SIMULATOR (`engine.kind: sim`), which is given
the cached directory as its model like vLLM would be."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import yaml

from tests.support.fleet_up import all_ready, stop_cleanly
from fleet.testing.hub_server import HubRepo, HubServer


def deployment(tmp_path: Path, name: str, model: str) -> Path:
    doc = {"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": name},
           "spec": {"model": {"name": model, "source": "hf://org/tiny"},
                    "engine": {"kind": "sim", "args": ["--profile", "cpu-tiny-llama", "--startup-delay-s", "0.2"]},
                    "resources": {"accelerator": "cpu"}, "replicas": {"min": 1, "max": 1}}}  # fmt: skip
    f = tmp_path / f"{name}.yaml"
    f.write_text(yaml.safe_dump(doc))
    return f


def test_hf_weights_are_cached_once_and_served_from_the_cache(sim_fleet_up, tmp_path, monkeypatch):
    blob = hashlib.sha256(b"w").digest() * (24 * 2**20 // 32)        # 24 MiB of weights
    files = {"config.json": b'{"architectures": ["LlamaForCausalLM"]}', "model.safetensors": blob}
    static = tmp_path / "static"
    static.mkdir()
    monkeypatch.setenv("FLEET_CACHE_DIR", str(tmp_path / "weights"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with HubServer({"org/tiny": HubRepo(files)}, static_root=static) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        first = sim_fleet_up([deployment(tmp_path, "chat-a", "tiny-a")])
        first.wait_for("chat-a READY", lambda: all_ready(first, 1), timeout_s=180)
        out = first.output()
        assert "CACHING" in out and "MiB cached" in out, out
        r = httpx.post(f"{first.router_url}/v1/completions", json={"model": "tiny-a", "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200, r.text
        weights = next(iter(first.replicas().values()))["detail"]["weights"]
        assert weights.startswith(str(tmp_path / "weights"))
        assert len(hub.log.file_gets("/model.safetensors")) == 1
        stop_cleanly(first, first.state_dir)

        second = sim_fleet_up([deployment(tmp_path, "chat-b", "tiny-b")], port=first.port)
        second.wait_for("chat-b READY", lambda: all_ready(second, 1), timeout_s=180)
        assert next(iter(second.replicas().values()))["detail"]["weights"] == weights
        assert len(hub.log.file_gets("/model.safetensors")) == 1           # no second download
        stop_cleanly(second, second.state_dir)
