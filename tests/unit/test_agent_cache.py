"""The weight cache against the local hub server (fleet/testing/hub_server.py, in a thread): hub and
http manifest sources, verification, resume, one download for concurrent callers (threads), space
checks, LRU and pins. Downloads in other processes: tests/integration/test_agent_cache.py."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from fleet.agent.cache_files import CacheError, InsufficientSpace
from fleet.sources import SourceError
from fleet.agent.transfer import RetryPolicy
from tests.support.fakes import FakeClock
from tests.support.waits import wait_until
from fleet.testing.hub_server import HubRepo, HubServer
from tests.support.weights import file_gets as _file_gets, make_cache as _cache
from tests.support.weights import manifest_source as _manifest_source, model_files as _files


def test_hub_model_cached_once_and_served_from_the_cache(hub, tmp_path):
    cache = _cache(tmp_path)
    seen = []
    path = cache.ensure("hf://org/tiny", progress=lambda d, t: seen.append((d, t)))
    for rel, data in _files(0).items():
        assert (path / rel).read_bytes() == data
    assert seen[-1] == (sum(map(len, _files(0).values())),) * 2
    assert len(_file_gets(hub)) == 3
    # A second deployment of the same weights: no file is fetched again (one metadata call).
    assert cache.ensure("hf://org/tiny@main") == path
    assert len(_file_gets(hub)) == 3
    assert cache.lookup("hf://org/tiny") == path
    [entry] = cache.entries()
    assert entry.key == path.name and entry.revision == hub.repos["org/tiny"].commit and entry.files == 3


def test_hub_revision_pinned_to_commit_and_unknown_ones_named(hub, tmp_path):
    cache = _cache(tmp_path)
    commit = hub.repos["org/tiny"].commit
    assert cache.ensure(f"hf://org/tiny@{commit}") == cache.ensure("hf://org/tiny", revision="main")
    with pytest.raises(SourceError, match="revision 'nope' not found"):
        cache.ensure("hf://org/tiny@nope")
    with pytest.raises(SourceError, match="repository 'org/absent' not found.*HF_TOKEN"):
        cache.ensure("hf://org/absent")


def test_private_hub_repo_needs_the_token_from_the_environment(hub, tmp_path, monkeypatch):
    hub.repos["org/private"] = HubRepo(_files(1), private=True)
    cache = _cache(tmp_path)
    with pytest.raises(SourceError, match="HF_TOKEN"):
        cache.ensure("hf://org/private")
    monkeypatch.setenv("HF_TOKEN", "s3cret")
    path = cache.ensure("hf://org/private")
    assert (path / "config.json").read_bytes() == _files(1)["config.json"]


def test_offline_ensure_uses_the_revision_last_resolved(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    with HubServer({"org/tiny": HubRepo(_files(0))}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        cache = _cache(tmp_path)
        path = cache.ensure("hf://org/tiny")
    assert cache.ensure("hf://org/tiny") == path          # hub gone: the cached commit
    with pytest.raises(SourceError):
        cache.ensure("hf://org/other")


def test_http_manifest_source(hub, tmp_path):
    files = _files(2)
    source = _manifest_source(hub, "m2", files)
    cache = _cache(tmp_path)
    path = cache.ensure(source)
    assert {rel: (path / rel).read_bytes() for rel in files} == files
    assert cache.lookup(source) == path
    assert cache.lookup(source.rstrip("/") + "/fleet-manifest.json") == path


def test_interrupted_download_resumes_with_a_range_request(hub, tmp_path):
    files = _files(6)
    source = _manifest_source(hub, "m6", files)
    hub.cut_after["m6/model.safetensors"] = 700_000
    path = _cache(tmp_path).ensure(source)
    assert (path / "model.safetensors").read_bytes() == files["model.safetensors"]
    ranges = hub.log.file_gets("m6/model.safetensors")
    assert ranges == [None, "bytes=700000-"]
    assert hub.log.body_bytes < sum(map(len, files.values())) + 10_000   # nothing fetched twice


def test_redirects_are_followed_and_a_server_ignoring_range_is_handled(hub, tmp_path):
    files = _files(8)
    source = _manifest_source(hub, "m8", files)
    (hub.static_root / "moved").mkdir()
    (hub.static_root / "moved" / "weights.bin").write_bytes(files["model.safetensors"])
    hub.redirect["m8/model.safetensors"] = "/static/moved/weights.bin"
    hub.cut_after["moved/weights.bin"] = 500_000
    hub.ignore_range.add("moved/weights.bin")
    path = _cache(tmp_path).ensure(source)
    assert (path / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert hub.log.file_gets("moved/weights.bin") == [None, "bytes=500000-"]   # answered 200: refetched whole


def test_a_kept_alive_connection_the_server_closed_is_redialled(hub, tmp_path):
    files = _files(9)
    source = _manifest_source(hub, "m9", files)
    hub.drop_kept_alive = True
    cache = _cache(tmp_path, parallel_files=1, retry=RetryPolicy(attempts=1, initial_s=0, max_s=0))
    path = cache.ensure(source)                       # no retry allowed: only the redial saves it
    assert {rel: (path / rel).read_bytes() for rel in files} == files


def test_eight_concurrent_callers_cause_one_download(hub, tmp_path):
    cache = _cache(tmp_path)
    hub.hold_after["model.safetensors"] = 100_000      # keep the first download going while the rest arrive
    results, errors = [], []

    def ask():
        try:
            results.append(_cache(tmp_path).ensure("hf://org/tiny"))
        except Exception as err:   # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    wait_until(lambda: hub.log.file_gets("model.safetensors"), 30, what="the first download to begin")
    hub.release.set()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == 8 and len(set(results)) == 1
    assert len(hub.log.file_gets("model.safetensors")) == 1
    assert len(_file_gets(hub)) == 3
    assert len(cache.entries()) == 1


def test_a_process_waiting_on_another_s_download_sees_its_progress(hub, tmp_path):
    source = _manifest_source(hub, "m4", _files(4))
    hub.hold_after["m4/model.safetensors"] = 1_500_000   # past the transport's first 1 MiB read
    seen: list[tuple[int, int]] = []
    first = threading.Thread(target=lambda: _cache(tmp_path, parallel_files=1).ensure(source))
    first.start()
    wait_until(lambda: list((tmp_path / "cache" / "partial").rglob("progress.json")), 30,
               what="the first download's progress file")
    second = threading.Thread(target=lambda: _cache(tmp_path).ensure(source, progress=lambda d, t: seen.append((d, t))))
    second.start()
    wait_until(lambda: any(0 < d < t for d, t in seen), 30, what="the second process to see progress short of done",
               explain=lambda: f"progress seen: {seen}")
    hub.release.set()
    first.join(60)
    second.join(60)
    assert len(hub.log.file_gets("m4/model.safetensors")) == 1


def test_corrupted_cache_file_is_caught_and_fetched_again(hub, tmp_path):
    cache = _cache(tmp_path)
    path = cache.ensure("hf://org/tiny")
    blob = (path / "model.safetensors").resolve()
    os.chmod(blob, 0o644)
    with blob.open("r+b") as f:     # same size, one byte flipped
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 1]))
    assert cache.lookup("hf://org/tiny") is None
    before = len(hub.log.file_gets("model.safetensors"))
    assert cache.ensure("hf://org/tiny") == path
    assert (path / "model.safetensors").read_bytes() == _files(0)["model.safetensors"]
    assert len(hub.log.file_gets("model.safetensors")) == before + 1
    assert len(hub.log.file_gets("config.json")) == 1      # only the bad file was fetched again


def test_deep_verify_finds_corruption_that_kept_size_and_mtime(hub, tmp_path):
    cache = _cache(tmp_path)
    path = cache.ensure("hf://org/tiny")
    blob = (path / "model.safetensors").resolve()
    st = blob.stat()
    os.chmod(blob, 0o644)
    with blob.open("r+b") as f:
        f.write(b"\0\0\0\0")
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert cache.lookup("hf://org/tiny") == path            # a stat cannot see it ...
    assert cache.verify(path.name) == ["model.safetensors"]  # ... a re-hash does
    assert cache.lookup("hf://org/tiny") is None
    cache.ensure("hf://org/tiny")
    assert cache.verify(path.name) == []


def test_corrupt_transfer_is_detected_and_retried(hub, tmp_path):
    hub.corrupt.update({"model.safetensors", "config.json"})   # LFS sha256 and git blob id checks
    path = _cache(tmp_path).ensure("hf://org/tiny")
    assert (path / "model.safetensors").read_bytes() == _files(0)["model.safetensors"]
    assert (path / "config.json").read_bytes() == _files(0)["config.json"]
    assert len(hub.log.file_gets("model.safetensors")) == 2 and len(hub.log.file_gets("config.json")) == 2


def test_a_file_that_never_matches_its_digest_fails_naming_it(hub, tmp_path):
    source = _manifest_source(hub, "m5", _files(5))
    (hub.static_root / "m5" / "config.json").write_bytes(b"changed after the manifest was written")
    cache = _cache(tmp_path)
    with pytest.raises(CacheError, match="config.json.*(size|sha256)"):
        cache.ensure(source)
    assert cache.entries() == [] and not list((tmp_path / "cache" / "partial").rglob("*.part"))
    assert cache.blob_bytes() >= len(_files(5)["model.safetensors"])   # the good files are kept for next time


def test_free_disk_is_checked_before_fetching(hub, tmp_path):
    cache = _cache(tmp_path, disk_usage=lambda p: SimpleNamespace(free=1_000_000))
    with pytest.raises(InsufficientSpace) as err:
        cache.ensure("hf://org/tiny")
    msg = str(err.value)
    assert "hf://org/tiny@main" in msg and "1.9 MiB to fetch" in msg and str(tmp_path / "cache") in msg
    assert _file_gets(hub) == []


def test_lru_eviction_to_the_budget_never_evicts_pinned_models(hub, tmp_path):
    clock = FakeClock()
    sources = [_manifest_source(hub, f"lru{i}", _files(10 + i, big=400_000)) for i in range(4)]
    cache = _cache(tmp_path, budget_bytes=1_000_000, clock=clock)   # room for two models
    a = cache.ensure(sources[0], pin_as="replica-a")
    clock.advance(10)
    b = cache.ensure(sources[1])
    clock.advance(10)
    c = cache.ensure(sources[2])                 # evicts b (a is pinned)
    keys = {e.key for e in cache.entries()}
    assert keys == {a.name, c.name} and b.name not in keys and cache.blob_bytes() <= 1_000_000
    assert cache.entries()[0].pinned_by == ("replica-a",)
    cache.pin(c.name, "replica-c")
    with pytest.raises(InsufficientSpace, match="budget"):
        cache.ensure(sources[3])
    cache.unpin(a.name, "replica-a")
    clock.advance(10)
    d = cache.ensure(sources[3])                 # now a (least recently used, unpinned) goes
    assert {e.key for e in cache.entries()} == {c.name, d.name}


def test_shared_files_are_stored_once_and_outlive_one_model(hub, tmp_path):
    shared = _files(20)
    other = dict(shared, **{"config.json": b'{"other": true}'})
    s1, s2 = _manifest_source(hub, "s1", shared), _manifest_source(hub, "s2", other)
    cache = _cache(tmp_path)
    p1, p2 = cache.ensure(s1), cache.ensure(s2)
    assert (p1 / "model.safetensors").resolve() == (p2 / "model.safetensors").resolve()
    assert len(hub.log.file_gets("s2/model.safetensors")) == 0     # deduplicated by sha256
    cache.pin(p2.name, "r1")
    with pytest.raises(CacheError, match="in use by r1"):
        cache.remove(p2.name)
    freed = cache.remove(p1.name)
    assert freed == len(shared["config.json"])                        # the shared blobs stay
    assert (p2 / "model.safetensors").read_bytes() == shared["model.safetensors"]
    cache.remove(p2.name, force=True)
    assert cache.entries() == [] and cache.blob_bytes() == 0


def test_crash_after_blobs_before_the_entry_refetches_nothing(hub, tmp_path):
    cache = _cache(tmp_path)
    path = cache.ensure("hf://org/tiny")
    (tmp_path / "cache" / "models" / f"{path.name}.json").unlink()    # the crash: record never written
    gets = len(_file_gets(hub))
    assert cache.lookup("hf://org/tiny") is None
    assert cache.ensure("hf://org/tiny") == path
    assert len(_file_gets(hub)) == gets + 1   # only config.json (not in LFS: no sha256 to find its blob by)


def test_a_crash_mid_commit_leaves_nothing_usable_and_the_next_ensure_repairs_it(hub, tmp_path):
    cache = _cache(tmp_path)
    path = cache.ensure("hf://org/tiny")
    models = tmp_path / "cache" / "models"
    # The crash: the old directory gone, the new one still under its temporary name.
    (models / f"{path.name}.json").unlink()
    path.rename(models / f".{path.name}.4242.1.tmp")
    assert cache.lookup("hf://org/tiny") is None
    assert cache.ensure("hf://org/tiny") == path and (path / "config.json").read_bytes() == _files(0)["config.json"]
    assert not list(models.glob(".*.tmp"))


def test_local_sources_are_served_in_place(tmp_path):
    d = tmp_path / "weights"
    d.mkdir()
    cache = _cache(tmp_path)
    assert cache.ensure(str(d)) == d and cache.ensure(f"file://{d}") == d and cache.lookup(str(d)) == d
    with pytest.raises(SourceError, match="not a directory"):
        cache.ensure(str(tmp_path / "absent"))


def test_the_test_hub_speaks_enough_for_hf_hub_download_too(hub, tmp_path):
    """The server is faithful beyond Fleet's own calls: huggingface_hub's hf_hub_download (HEAD
    with X-Repo-Commit / ETag / X-Linked-*, then GET) works against it."""
    from huggingface_hub import hf_hub_download

    got = hf_hub_download("org/tiny", "model.safetensors", cache_dir=tmp_path / "hf", endpoint=hub.url)
    assert Path(got).read_bytes() == _files(0)["model.safetensors"]
    got = hf_hub_download("org/tiny", "config.json", cache_dir=tmp_path / "hf", endpoint=hub.url)
    assert Path(got).read_bytes() == _files(0)["config.json"]
