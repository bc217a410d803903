"""The weight cache with downloads in other processes, against the local hub server: a download
killed mid-file resumes in the next process (direct and through huggingface_hub), two processes
asking at once cause one download, and an abandoned download is the first space given back
(tests/unit/test_agent_cache.py: the rest)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fleet.testing.hub_server import HubRepo
from tests.support.weights import file_gets as _file_gets, make_cache as _cache
from tests.support.waits import wait_until
from tests.support.weights import manifest_source as _manifest_source, model_files as _files

REPO = Path(__file__).resolve().parents[2]


def _kill_mid_download(root: Path, source: str, part_bytes: int) -> int:
    """Run ``ensure(source)`` in another process and SIGKILL it once a part file holds
    ``part_bytes`` (the server holds the file a little further); returns the part's length."""
    code = ("import sys; from pathlib import Path; from fleet.agent.cache import WeightCache; "
            "WeightCache(Path(sys.argv[1]), reserve_bytes=0, parallel_files=1).ensure(sys.argv[2])")
    proc = subprocess.Popen([sys.executable, "-c", code, str(root), source], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:

        def parts_at_the_hold_point() -> list[Path]:
            assert proc.poll() is None, "the downloading process exited early"
            return [p for p in (root / "partial").rglob("*.part") if p.stat().st_size >= part_bytes]

        parts = wait_until(parts_at_the_hold_point, 60, what="the download to reach the hold point")
    finally:
        proc.kill()
        proc.wait(30)
    return parts[0].stat().st_size


def test_download_killed_mid_file_resumes_in_the_next_process(hub, tmp_path):
    files = _files(3)
    source = _manifest_source(hub, "m3", files)
    hub.hold_after["m3/model.safetensors"] = 1_500_000
    kept = _kill_mid_download(tmp_path / "cache", source, 1 << 20)   # the transport writes 1 MiB reads
    hub.release.set()
    path = _cache(tmp_path).ensure(source)
    assert (path / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert hub.log.file_gets("m3/model.safetensors")[-1] == f"bytes={kept}-"


def test_hub_download_killed_mid_file_resumes_through_huggingface_hub(hub, tmp_path):
    from huggingface_hub import constants

    piece = constants.DOWNLOAD_CHUNK_SIZE           # http_get writes in pieces of this size
    files = _files(7, big=piece + 300_000)
    hub.repos["org/big"] = HubRepo(files)
    hub.hold_after["model.safetensors"] = piece + 100_000
    kept = _kill_mid_download(tmp_path / "cache", "hf://org/big", piece)
    hub.release.set()
    path = _cache(tmp_path).ensure("hf://org/big")
    assert (path / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert kept == piece and hub.log.file_gets("model.safetensors")[-1] == f"bytes={piece}-"


def test_two_processes_asking_at_once_cause_one_download(hub, tmp_path):
    hub.hold_after["model.safetensors"] = 100_000
    code = ("import sys; from pathlib import Path; from fleet.agent.cache import WeightCache; "
            "print(WeightCache(Path(sys.argv[1]), reserve_bytes=0).ensure(sys.argv[2]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "cache"), "hf://org/tiny"], cwd=REPO,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
             for _ in range(2)]
    try:
        wait_until(lambda: hub.log.file_gets("model.safetensors"), 60, what="the first download to begin")
        hub.release.set()
        outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0] and outs[0] == outs[1]
    assert len(hub.log.file_gets("model.safetensors")) == 1 and len(_file_gets(hub)) == 3


def test_an_abandoned_download_is_the_first_space_given_back(hub, tmp_path):
    files = _files(30, big=1_500_000)
    source = _manifest_source(hub, "ab", files)
    hub.hold_after["ab/model.safetensors"] = 1_200_000
    kept = _kill_mid_download(tmp_path / "cache", source, 1 << 20)   # leaves 1 MiB of part file
    hub.release.set()
    other = _manifest_source(hub, "ot", _files(31, big=1_500_000))
    cache = _cache(tmp_path, budget_bytes=2_000_000)          # room for one model, not one and a part
    assert kept >= 1 << 20
    path = cache.ensure(other)
    assert (path / "model.safetensors").is_file()
    assert not list((tmp_path / "cache" / "partial").rglob("*.part"))
