"""The local backend and its processes: identity by pid AND start time, records that let a new
controller find running engines, marked processes a crash left unrecorded. Real processes
(`sleep`, and one engine simulator) on this machine; every one is killed at the end."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path

import psutil
import pytest
import yaml

from fleet.local.backend import FLEET_ID_ENV, REPLICA_ID_ENV, LocalBackend
from fleet.local.procs import LocalProcesses, ProcessRecord, find_marked, start_ticks
from fleet.controller.backend import ReplicaWant
from fleet.inventory import NodeInventory
from fleet.placement import get_strategy
from fleet.placement.shapes import PlacementRequest
from fleet.inventory import Inventory
from fleet.spec import load_deployments
from tests.support.waits import async_wait_until, wait_until, zmq_connected

NODE = NodeInventory(name="local", cpu_cores=(0, 1))


@pytest.fixture
def spawned():
    records: list[ProcessRecord] = []
    yield records
    for r in records:
        try:
            os.killpg(r.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_process_is_ours_only_while_pid_and_start_time_match(spawned):
    procs = LocalProcesses()
    rec = procs.spawn(["sleep", "60"], {}, None)
    spawned.append(rec)
    assert rec.start_ticks == start_ticks(rec.pid) and rec.start_ticks > 0
    stranger = LocalProcesses()                         # a new controller: not its child
    assert stranger.is_ours(rec)
    assert not stranger.is_ours(dataclasses.replace(rec, start_ticks=rec.start_ticks + 1))  # a reused pid
    stranger.stop(dataclasses.replace(rec, start_ticks=rec.start_ticks + 1))               # never signalled
    assert stranger.poll(rec) == (True, None)
    stranger.stop(rec)
    wait_until(lambda: procs.poll(rec)[0] is False)
    assert procs.poll(rec) == (False, -signal.SIGTERM)  # the parent knows the exit code


def test_a_process_logging_through_the_relay_survives_a_sigterm_and_its_relay_ends_with_it(tmp_path, spawned):
    """The output of a process started on a full disk goes through the log relay
    (fleet/local/logrelay.py): every line reaches the log, a SIGTERM to the process's group
    leaves the relay reading its last lines, and the relay exits once the process has."""
    log = tmp_path / "logs" / "router.log"
    script = ("import signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *a: (print('draining', flush=True), sys.exit(0)))\n"
              "print('fleet router listening', flush=True)\n"
              "time.sleep(60)\n")  # fmt: skip
    procs = LocalProcesses()
    rec = procs.spawn([sys.executable, "-c", script], {}, log, relay=True)
    spawned.append(rec)
    wait_until(lambda: log.exists() and "listening" in log.read_text(), 30, what="the first line in the log")
    relays = [p for p in psutil.process_iter(["cmdline"]) if "fleet.local.logrelay" in " ".join(p.info["cmdline"] or [])
              and str(log) in p.info["cmdline"]]  # fmt: skip
    assert len(relays) == 1 and relays[0].ppid() == os.getpid()
    procs.stop(rec)
    wait_until(lambda: procs.poll(rec)[0] is False, 30, what="the process to exit on SIGTERM")
    wait_until(lambda: not relays[0].is_running() or relays[0].status() == psutil.STATUS_ZOMBIE, 30,
               what="the relay to exit once its input ended")  # fmt: skip
    assert log.read_text() == "fleet router listening\ndraining\n"


def test_marked_processes_are_found_by_their_environment(spawned):
    procs = LocalProcesses()
    ours = procs.spawn(["sleep", "60"], {FLEET_ID_ENV: "f1", REPLICA_ID_ENV: "chat-7"}, None)
    other = procs.spawn(["sleep", "60"], {FLEET_ID_ENV: "f2", REPLICA_ID_ENV: "chat-7"}, None)
    spawned += [ours, other]
    wait_until(lambda: len(find_marked(FLEET_ID_ENV, "f2")) == 1)   # exec'd with its environment
    found = find_marked(FLEET_ID_ENV, "f1")
    assert list(found) == [ours.pid] and found[ours.pid][REPLICA_ID_ENV] == "chat-7"


def _sim_want(tmp_path: Path, rid: str = "sim-0", source: str = "sim://cpu-tiny-llama") -> ReplicaWant:
    doc = {"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "sim"},
           "spec": {"model": {"name": "m", "source": source},
                    "engine": {"kind": "sim", "args": ["--profile", "cpu-tiny-llama"]},
                    "resources": {"accelerator": "cpu"}, "replicas": {"min": 1, "max": 1}}}
    f = tmp_path / "sim.yaml"
    f.write_text(yaml.safe_dump(doc))
    (ld,) = load_deployments([f])
    plan = get_strategy().place_replicas(PlacementRequest.for_deployment(ld.deployment, 1), Inventory((NODE,)), {})
    return ReplicaWant(rid, ld.deployment, plan.placements[0], ld.serving_hash, ld.base_dir)


async def test_a_new_backend_on_the_same_directory_finds_the_running_engine(tmp_path, spawned):
    first = LocalBackend(tmp_path, "fleet-a", NODE)
    want = _sim_want(tmp_path)
    await first.ensure(want)
    facts = (await first.observe())["sim-0"]
    pid = int(facts.detail["pid"])
    spawned.append(ProcessRecord(pid, 0, (), None, 0))
    assert facts.running and facts.endpoint.startswith("http://127.0.0.1:") and facts.spec_hash == want.spec_hash
    await first.ensure(want)                            # idempotent: no second process
    assert len(find_marked(FLEET_ID_ENV, "fleet-a")) == 1
    records = json.loads((tmp_path / "replicas.json").read_text())["replicas"]
    assert records[0]["process"]["pid"] == pid

    second = LocalBackend(tmp_path, "fleet-a", NODE)    # the controller died; a new one opens the directory
    again = (await second.observe())["sim-0"]
    assert again.running and again.endpoint == facts.endpoint and again.detail["pid"] == str(pid)
    await second.stop("sim-0")
    await asyncio.get_running_loop().run_in_executor(None, wait_until, lambda: start_ticks(pid) is None)
    gone = (await second.observe())["sim-0"]
    assert gone.exited and gone.exit_code is None and gone.exit_reason == "engine process is gone"
    await second.forget("sim-0")
    assert await second.observe() == {}


async def test_a_crash_between_record_and_start_is_resolved_by_the_marker(tmp_path, spawned):
    procs = LocalProcesses()
    started = procs.spawn(["sleep", "60"], {FLEET_ID_ENV: "fleet-b", REPLICA_ID_ENV: "chat-3"}, None)
    lost = procs.spawn(["sleep", "60"], {FLEET_ID_ENV: "fleet-b", REPLICA_ID_ENV: "chat-9"}, None)
    spawned += [started, lost]
    (tmp_path / "replicas.json").write_text(json.dumps({"replicas": [
        {"replica_id": "chat-3", "deployment": "chat", "spec_hash": "h", "node": "local", "host": "127.0.0.1",
         "port": 40001, "log_path": None, "process": None},       # written before the start, never updated
        {"replica_id": "chat-4", "deployment": "chat", "spec_hash": "h", "node": "local", "host": "127.0.0.1",
         "port": 40002, "log_path": None, "process": None},       # the crash came before the start
    ]}))
    wait_until(lambda: len(find_marked(FLEET_ID_ENV, "fleet-b")) == 2)   # both have exec'd with their marker
    backend = LocalBackend(tmp_path, "fleet-b", NODE)
    facts = await backend.observe()
    assert facts["chat-3"].running and facts["chat-3"].detail["pid"] == str(started.pid)
    assert "chat-4" not in facts   # never started: forgotten, so the controller asks for it again
    assert facts["chat-9"].running and facts["chat-9"].endpoint is None   # unrecorded: the controller stops it
    await backend.stop("chat-9")
    await asyncio.get_running_loop().run_in_executor(None, wait_until, lambda: start_ticks(lost.pid) is None)
    assert (await backend.observe())["chat-9"].exited


async def test_a_hub_source_is_cached_once_and_both_engines_start_from_the_cache(tmp_path, monkeypatch, spawned):
    from fleet.agent.cache import WeightCache
    from fleet.agent.transfer import RetryPolicy
    from fleet.testing.hub_server import HubRepo, HubServer

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    files = {"config.json": b'{"architectures": ["LlamaForCausalLM"]}', "model.safetensors": os.urandom(3_000_000)}
    static = tmp_path / "static"
    static.mkdir()
    with HubServer({"org/tiny": HubRepo(files)}, static_root=static) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        cache = WeightCache(tmp_path / "cache", retry=RetryPolicy(attempts=2, initial_s=0.0, max_s=0.0),
                            reserve_bytes=0)  # fmt: skip
        backend = LocalBackend(tmp_path / "state", "fleet-c", NODE, weights=cache)
        assert "hf://org/tiny@main" not in (await backend.inventory()).nodes[0].cached   # cold
        wants = [_sim_want(tmp_path, rid, source="hf://org/tiny") for rid in ("sim-0", "sim-1")]
        for want in wants:
            await backend.ensure(want)
        facts = await backend.observe()
        assert all(f.image_present and not f.weights_present and not f.running for f in facts.values())
        assert all(f.detail["cache"].endswith("MiB cached") for f in facts.values())

        def started() -> bool:
            return all(f.running for f in asyncio.run_coroutine_threadsafe(backend.observe(), loop).result().values())

        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, wait_until, started)
        facts = await backend.observe()
        for f in facts.values():
            spawned.append(ProcessRecord(int(f.detail["pid"]), 0, (), None, 0))
        (entry,) = cache.entries()
        assert {f.detail["weights"] for f in facts.values()} == {str(entry.path)}
        assert sorted(entry.pinned_by) == ["sim-0", "sim-1"]
        assert len(hub.log.file_gets("/model.safetensors")) == 1   # two replicas, one download
        # The node now reports the weights as held (canonical source): placement counts it warm.
        node = (await backend.inventory()).nodes[0]
        assert "hf://org/tiny@main" in node.cached
        assert "holds: hf://org/tiny@main" in node.describe()             # the Nodes line of fleet status
        for rid in ("sim-0", "sim-1"):
            await backend.kill(rid)
        await loop.run_in_executor(None, wait_until, lambda: all(
            start_ticks(int(f.detail["pid"])) is None for f in facts.values()))
        await backend.observe()
        for rid in ("sim-0", "sim-1"):
            await backend.forget(rid)
        assert cache.entries()[0].pinned_by == ()              # released: evictable again


async def test_a_source_the_cache_cannot_fetch_ends_the_replica_with_the_reason(tmp_path, monkeypatch):
    from fleet.agent.cache import WeightCache

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")   # nothing listens there
    backend = LocalBackend(tmp_path / "state", "fleet-d", NODE, weights=WeightCache(tmp_path / "cache"))
    await backend.ensure(_sim_want(tmp_path, "sim-0", source="hf://org/absent"))

    def ended() -> bool:
        return asyncio.run_coroutine_threadsafe(backend.observe(), loop).result()["sim-0"].exited

    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, wait_until, ended, 60.0)
    f = (await backend.observe())["sim-0"]
    assert f.exit_reason.startswith("weights not present: spec.model.source 'hf://org/absent': ")


async def test_the_engine_publishes_kv_events_where_its_facts_say_and_adoption_keeps_them(tmp_path, spawned):
    """`fleet up`'s engines start with --kv-events-config on ipc:// sockets of the state directory;
    a subscriber at the addresses the facts give gets vLLM's wire; a new backend on the directory,
    and one that lost replicas.json (the marker), report the same addresses."""
    import aiohttp
    import zmq
    import zmq.asyncio

    from router.kv.events import BlockStored, decode_batch

    first = LocalBackend(tmp_path, "fleet-kv", NODE)
    await first.ensure(_sim_want(tmp_path))
    facts = (await first.observe())["sim-0"]
    spawned.append(ProcessRecord(int(facts.detail["pid"]), 0, (), None, 0))
    kv = facts.kv_events
    assert kv["publisher"].startswith("ipc://") and kv["replay"].startswith("ipc://") and kv["topic"] == ""
    ctx = zmq.asyncio.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        await zmq_connected(sub, kv["publisher"])      # the SUB's connection is up before the first batch
        async with aiohttp.ClientSession(facts.endpoint) as client:
            async def healthy() -> bool:
                async with client.get("/health") as resp:
                    return resp.status == 200

            await async_wait_until(healthy, 30, interval_s=0.05, what="the engine healthy",
                                   ignoring=(aiohttp.ClientError,))
            async with client.post("/v1/completions", json={"prompt": "hello " * 300, "max_tokens": 2}) as resp:
                assert resp.status == 200
        _, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 10)
        assert int.from_bytes(seq, "big") == 0
        assert any(isinstance(e, BlockStored) for e in decode_batch(payload).events)
    finally:
        ctx.destroy(linger=0)
    assert (await LocalBackend(tmp_path, "fleet-kv", NODE).observe())["sim-0"].kv_events == kv
    (tmp_path / "replicas.json").unlink()
    adopted = LocalBackend(tmp_path, "fleet-kv", NODE)
    assert (await adopted.observe())["sim-0"].kv_events == kv    # from the engine's marker
    await adopted.stop("sim-0")
