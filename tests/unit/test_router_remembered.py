"""The models a router serves, kept on disk (router.http.remembered), and what a restarted router does
with them (router.pools.pool.PoolTable.awaiting): 503 instead of 404 for each until the control plane
speaks for it, on fake time. The end-to-end restart over HTTP is in test_router_hostile.py."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
from pathlib import Path

import pytest

from router.stats.metrics import RouterMetrics
from router.pools.pool import AWAIT_AFTER_HEARD_S, PoolTable
from router.http.remembered import FILE_VERSION, ModelsFile, write_atomically
from router.pools.spec import PoolSpec
from tests.support.waits import async_wait_until

WAIT_S = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def table(remembered: list[str], clock: FakeClock) -> PoolTable:
    return PoolTable(RouterMetrics(), lambda: 1_700_000_000.0, clock, remembered)


POOL = PoolSpec.model_validate({"endpoints": [{"id": "e", "url": "http://127.0.0.1:9"}]})


def test_a_remembered_model_is_awaited_until_its_pool_is_put_or_deleted() -> None:
    clock = FakeClock()
    pools = table(["a", "b", "c"], clock)
    assert [m for m in ("a", "b", "c", "x") if pools.awaiting(m)] == ["a", "b", "c"]
    pools.put("a", POOL)
    pools.delete("b")            # no pool to delete: the controller spoke for it all the same
    assert (pools.awaiting("a"), pools.awaiting("b"), pools.awaiting("c")) == (False, False, True)
    assert pools.awaited() == ["c"]
    clock.now_s += AWAIT_AFTER_HEARD_S - 0.1
    assert pools.awaiting("c")
    clock.now_s += 0.2           # the controller spoke 30 s ago and never named c: it is unknown now
    assert not pools.awaiting("c") and pools.awaited() == []


def test_without_word_from_the_control_plane_a_remembered_model_is_awaited_for_ever() -> None:
    clock = FakeClock()
    pools = table(["a"], clock)
    clock.now_s += 10 * AWAIT_AFTER_HEARD_S
    assert pools.awaiting("a")
    pools.mark_synced()          # every pool published, a among none: unknown at once
    assert pools.synced and not pools.awaiting("a")


def test_the_file_round_trips_and_is_written_only_when_the_set_changes(tmp_path: Path) -> None:
    path = tmp_path / "router-models.json"
    models = ["b", "a"]
    writes: list[bytes] = []

    def write(p: Path, data: bytes) -> None:
        writes.append(data)
        write_atomically(p, data)

    async def scenario() -> None:
        file = ModelsFile(path, lambda: list(models), write=write)
        assert file.read() == []
        file.changed()
        await file.flushed()
        file.changed()           # same set: nothing written
        await file.flushed()
        models.append("c")
        file.changed()
        await file.flushed()

    asyncio.run(scenario())
    assert len(writes) == 2
    assert json.loads(path.read_text()) == {"version": FILE_VERSION, "models": ["a", "b", "c"]}
    assert ModelsFile(path, list).read() == ["a", "b", "c"]
    assert [p.name for p in tmp_path.iterdir()] == ["router-models.json"]  # no temporary file left


@pytest.mark.parametrize("content", [b"", b"{trunc", b'{"version": 1}', b'{"version": 2, "models": ["a"]}',
                                     b'{"version": 1, "models": [1]}', b'[1, 2]', b"[" * 50_000])  # fmt: skip
def test_an_unreadable_file_is_logged_and_ignored(tmp_path: Path, content: bytes,
                                                  caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    path = tmp_path / "router-models.json"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="router.http.remembered"):
        assert ModelsFile(path, list).read() == []
    assert "router-models.json" in caplog.text and "no remembered model" in caplog.text


def test_a_file_that_cannot_be_read_at_all_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "router-models.json").mkdir()   # reading it raises IsADirectoryError
    with caplog.at_level(logging.WARNING, logger="router.http.remembered"):
        assert ModelsFile(tmp_path / "router-models.json", list).read() == []
    assert "cannot read" in caplog.text


def test_a_failed_write_is_counted_logged_once_and_retried_until_it_succeeds(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    path = tmp_path / "router-models.json"
    failures = [OSError(errno.ENOSPC, "No space left on device")] * 3
    counted: list[int] = []

    def write(p: Path, data: bytes) -> None:
        if failures:
            raise failures.pop()
        write_atomically(p, data)

    async def scenario() -> ModelsFile:
        file = ModelsFile(path, lambda: ["m"], write=write, on_write_error=lambda: counted.append(1),
                          retry_first_s=0.01, retry_max_s=0.02)  # fmt: skip
        file.changed()
        await asyncio.wait_for(file.flushed(), WAIT_S)
        return file

    with caplog.at_level(logging.WARNING, logger="router.http.remembered"):
        file = asyncio.run(scenario())
    assert len(counted) == 3 and file.failures == 0
    assert json.loads(path.read_text())["models"] == ["m"]
    assert caplog.text.count("No space left on device") == 1 and "written again after 3 failed" in caplog.text


def test_a_crash_mid_write_leaves_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "router-models.json"
    write_atomically(path, b'{"version": 1, "models": ["old"]}')

    def crash(*args: object) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr("router.http.remembered.os.replace", crash)
    with pytest.raises(OSError):
        write_atomically(path, b'{"version": 1, "models": ["new"]}')
    assert ModelsFile(path, list).read() == ["old"]
    assert [p.name for p in tmp_path.iterdir()] == ["router-models.json"]


async def test_changes_during_a_slow_write_are_written_after_it() -> None:
    written: list[list[str]] = []
    models = ["a"]
    gate = asyncio.Event()
    loop = asyncio.get_running_loop()

    started: list[list[str]] = []

    def write(p: Path, data: bytes) -> None:
        started.append(json.loads(data)["models"])
        asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(WAIT_S)
        written.append(json.loads(data)["models"])

    file = ModelsFile(Path("/nonexistent/router-models.json"), lambda: list(models), write=write)
    file.changed()
    await async_wait_until(lambda: started == [["a"]], WAIT_S)   # the first write is under way
    models.append("b")
    file.changed()               # a write is under way: it is followed by another
    gate.set()
    await asyncio.wait_for(file.flushed(), WAIT_S)
    assert written == [["a"], ["a", "b"]]
