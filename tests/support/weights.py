"""The weight-cache tests' shared harness: the local hub server (fleet/testing/hub_server.py, in a
thread) as the ``hub`` fixture, model files made from a seed, and a cache with quick retries.
Used by tests/unit/test_agent_cache.py and tests/integration/test_agent_cache.py; tests/conftest.py
loads this module as a plugin, so ``hub`` is a fixture everywhere (a file may define its own)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from fleet.agent.cache import WeightCache
from fleet.agent.transfer import RetryPolicy
from fleet.sources import write_manifest
from fleet.testing.hub_server import HubRepo, HubServer

FAST = RetryPolicy(attempts=3, initial_s=0.0, max_s=0.0)


def model_files(seed: int = 0, big: int = 2_000_000) -> dict[str, bytes]:
    rnd = hashlib.sha256(str(seed).encode()).digest()
    return {
        "config.json": b'{"architectures": ["LlamaForCausalLM"], "seed": %d}' % seed,
        "model.safetensors": (rnd * (big // 32 + 1))[:big],
        "tokenizer/tokenizer.json": b"t" * 3000 + bytes([seed]),
    }


@pytest.fixture()
def hub(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))   # no token file from the machine
    monkeypatch.delenv("HF_TOKEN", raising=False)
    static = tmp_path / "static"
    static.mkdir()
    with HubServer({"org/tiny": HubRepo(model_files(0))}, static_root=static, token="s3cret") as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


def make_cache(tmp_path: Path, **kw) -> WeightCache:
    kw.setdefault("retry", FAST)
    kw.setdefault("reserve_bytes", 0)
    return WeightCache(tmp_path / "cache", **kw)


def file_gets(hub: HubServer) -> list[str]:
    return [p for m, p, _ in hub.log.requests if m == "GET" and "/resolve/" in p]


def manifest_source(hub: HubServer, name: str, files: dict[str, bytes], sha: bool = True) -> str:
    d = hub.static_root / name
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    write_manifest(d, with_sha256=sha)
    return f"{hub.url}/static/{name}/"
