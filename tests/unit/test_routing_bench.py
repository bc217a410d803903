"""The routing benchmarks' harness for several routers and for faults: target names with a
router count and alternating senders (loadtests.bench_routing), the fault load sent to two
routers in turn with a refused try moved to the other one (loadtests.faultload), the TCP relay
that cuts a KV event stream and its report (loadtests.routing_faults), the probe of the endpoint
picker's response time (loadtests.picker_probe), each process's CPU and scheduling counts
(loadtests.procs.sched_counts, loadtests.bench_routing.per_process)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from fleet.tracesim.traces import TraceRequest
from loadtests.bench_routing import AlternatingSender, KvEventPorts, parse_target, per_process, target_label, \
    target_options
from loadtests.faultload import FaultLoad
from loadtests.picker_probe import probe
from loadtests.procs import sched_counts
from loadtests.replay import Outcome
from loadtests.routing_faults import Prompts, TcpRelay, event_cut_report, table
from router.picker.service import PickerService
from tests.support.router import FakeEngine, dead_endpoint
from tests.support.waits import async_wait_until

REPO = Path(__file__).resolve().parents[2]


def test_a_target_names_its_router_count_or_takes_the_default() -> None:
    assert parse_target("fleet:kv-aware", 1) == ("fleet", "kv-aware", 1)
    assert parse_target("fleet:kv-aware@2", 1) == ("fleet", "kv-aware", 2)
    assert parse_target("vllm-router:cache_aware", 2) == ("vllm-router", "cache_aware", 2)
    assert target_label("fleet:kv-aware@2", 1) == "fleet:kv-aware, 2 routers"
    assert target_label("vllm-router:cache_aware", 1) == "vllm-router:cache_aware, 1 router"
    for bad in ("kv-aware", "nginx:rr", "fleet:kv-aware@0"):
        with pytest.raises(SystemExit):
            parse_target(bad, 1)


def test_a_target_may_switch_on_kv_events_and_the_picker_for_itself() -> None:
    plain = argparse.Namespace(routers=1, kv_events=False, picker=False)
    assert parse_target("fleet:kv-aware@2+kv-events+picker", 1) == ("fleet", "kv-aware", 2)
    assert target_options("fleet:kv-aware", plain) == (False, False)
    assert target_options("fleet:kv-aware+kv-events", plain) == (True, False)
    assert target_options("vllm-router:cache_aware+kv-events", plain) == (False, False)
    # the picker follows the engines' events (on)
    assert target_options("fleet:kv-aware@2+picker", plain) == (True, True)
    assert target_options("vllm-router:cache_aware+picker", plain) == (False, False)
    everywhere = argparse.Namespace(routers=2, kv_events=True, picker=True)
    assert target_options("fleet:kv-aware", everywhere) == (True, True)
    for unknown in ("fleet:kv-aware+gossip", "fleet:kv-aware@2+peers"):
        with pytest.raises(SystemExit, match="unknown option"):
            parse_target(unknown, 1)


async def test_requests_alternate_between_the_routers() -> None:
    seen: list[tuple[str, int]] = []

    def sender(name: str):
        async def send(index: int, r: TraceRequest) -> Outcome:
            seen.append((name, index))
            return Outcome(status=200)
        return send

    alternating = AlternatingSender([sender("a"), sender("b")])
    for i in range(4):
        await alternating(i, TraceRequest(0.0, 10, 1))
    assert seen == [("a", 0), ("b", 1), ("a", 2), ("b", 3)]


async def test_the_fault_load_takes_routers_in_turn_and_moves_a_refused_try_to_the_next() -> None:
    dead_sock, dead_url = dead_endpoint()
    async with FakeEngine("r0", chunks=2) as live:
        load = FaultLoad(live.url, "m", rate_per_s=40.0, urls=(live.url, dead_url), prompt_for=lambda k: [k, k + 1],
                         timeout_s=5.0)
        load.__enter__()
        await async_wait_until(lambda: len(load.done) >= 4, 30, what="four requests done", explain=load.summary)
        await asyncio.to_thread(load.__exit__, None, None, None)
    dead_sock.close()
    done = load.done
    assert len(done) >= 4
    assert all(r.outcome == "ok" and r.router == 0 and r.first_byte_at_s is not None for r in done)
    assert {r.attempts for r in done[1::2]} == {2}     # odd requests met the dead router first
    assert {r.attempts for r in done[0::2]} == {1}
    assert [0, 1] in [b["prompt"] for b in live.requests] and [1, 2] in [b["prompt"] for b in live.requests]


def test_prompts_continue_conversations_with_a_suffix_of_their_own() -> None:
    prompts = Prompts(seed=1, conversations=3, prefix_tokens=8, suffix_tokens=4)
    a, b, c = prompts(0), prompts(3), prompts(1)
    assert len(a) == 12 and a[:8] == b[:8] and a[8:] != b[8:]
    assert a[:8] != c[:8]


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1024):
        writer.write(data)
        await writer.drain()
    writer.close()


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(16) == b""
    except ConnectionResetError:
        return True


def _roundtrip(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"ping")
        return s.recv(16)


async def test_the_relay_passes_bytes_refuses_while_cut_and_passes_again_after() -> None:
    upstream = await asyncio.start_server(_echo, "127.0.0.1", 0)
    relay = TcpRelay(upstream.sockets[0].getsockname()[1])
    try:
        assert await asyncio.to_thread(_roundtrip, relay.port) == b"ping"
        held = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", relay.port), 5)
        held.sendall(b"held")
        assert await asyncio.to_thread(held.recv, 16) == b"held"
        await asyncio.to_thread(relay.cut)
        assert await asyncio.to_thread(_closed, held)   # the relayed connection is gone
        held.close()
        with pytest.raises(ConnectionRefusedError):
            await asyncio.to_thread(_roundtrip, relay.port)
        await asyncio.to_thread(relay.resume)
        assert await asyncio.to_thread(_roundtrip, relay.port) == b"ping"
    finally:
        await asyncio.to_thread(relay.stop)
        upstream.close()


def test_the_report_rows() -> None:
    stall = {"stall_s": 60.0, "first_token_timeout_s": 5.0, "bound_s": 10.0, "requests": 800,
             "failed_before_streaming": 0, "cut": 0, "waited_past_bound": 70, "longest_wait_s": 61.2,
             "refused_pool_fields": ["first_token_timeout_s"]}
    kill = {"requests": 300, "failed_before_streaming": 3, "cut": 1, "in_flight_on_killed_router": 4,
            "in_flight_failed": 3, "in_flight_cut": 1, "others_failed_or_cut": 0}
    rows = table({"stall": stall, "router-kill": kill}).splitlines()
    assert rows[2] == ("| engine SIGSTOPped 60 s, deadline 5 s (router has no first-token deadline: field refused) "
                       "| 800 | 0 | 0 | 70 (> 10 s) | 61.2 s | — | — |")
    assert rows[3] == "| one of two routers SIGKILLed | 300 | 3 | 1 | — | — | 4 (3 / 1) | 0 |"
    assert event_cut_report({"skipped": "no events"}) == "event-cut: skipped: no events"
    cut = {"cut_s": 30.0, "kv_buffer_steps": 50, "requests": 10, "failed_before_streaming": 0, "cut": 0,
           "series_at": {p: [{"fleet_router_kv_resyncs_total": v}, {"fleet_router_kv_resyncs_total": v}]
                         for p, v in (("cut", 0.0), ("resume", 0.0), ("end", 1.0))},
           "largest_index_series": {}}
    assert "| `fleet_router_kv_resyncs_total` | 0 / 0 | 0 / 0 | 1 / 1 | — |" in event_cut_report(cut)
    assert "prefix-cache hit rate" not in event_cut_report(cut)   # a run from before it was sampled
    cut["prefix_cache_hit_rate"] = {"cut": {"engine_0": 0.5, "others": 0.889}, "after": {"engine_0": 0.25, "others": 0.9}}
    assert ("engine prefix-cache hit rate, engine 0 / the others: during the cut 50.0% / 88.9%, "
            "from the resume to the end 25.0% / 90.0%") in event_cut_report(cut)


def test_the_routing_fault_table_in_the_docs_is_the_recorded_run() -> None:
    """docs/benchmarks.md shows the rows of loadtests/results/routing-faults-*.json: a rerun that
    moves a figure rewrites both."""
    text = (REPO / "docs" / "benchmarks.md").read_text()
    for path in sorted((REPO / "loadtests" / "results").glob("routing-faults-*.json")):
        results = json.loads(path.read_text())["results"]
        assert table(results) in text, f"docs/benchmarks.md lacks the table of {path.name}"


def test_kv_event_ports_follow_the_simulators_offset_per_replica() -> None:
    ports = KvEventPorts(replicas=5, processes=2)
    assert ports.per == [3, 2]
    args = json.loads(ports.args_for(1)[1])
    assert args["endpoint"] == f"tcp://*:{ports.pub[1]}" and args["replay_endpoint"] == f"tcp://*:{ports.replay[1]}"
    sources = ports.sources()
    assert [s["publisher"] for s in sources][2:4] == [f"tcp://127.0.0.1:{ports.pub[0] + 2}",
                                                      f"tcp://127.0.0.1:{ports.pub[1]}"]
    assert target_label("fleet:kv-aware@2", 1, {"kv_events": True, "picker": True}) == \
        "fleet:kv-aware, 2 routers, KV events, endpoint picker"


def test_the_scale_up_run_adds_one_replica_at_the_join() -> None:
    """`loadtests/sim_scale_up.py`: the pool runs one replica short until `--join-s`, then the
    last replica joins and takes requests only once it is ready."""
    from dataclasses import replace as replaced

    from fleet.enginesim.profiles import get_profile
    from fleet.tracesim.traces import load_trace
    from fleet.tracesim.workload import Workload
    from loadtests.sim_scale_up import TRACE, run, simulate
    from router.pools.policies import KvAware

    profile = get_profile("h100-llama-8b").with_overrides(max_model_len=32768)
    base = Workload.from_trace(load_trace(TRACE).window(600, 20), profile)
    workload = replaced(base, trace=base.trace.compressed(2.0), speedup=2.0)
    args = argparse.Namespace(replicas=3, join_s=4.0, startup_s=1.0, seed=0)
    row = run("fewest stored", KvAware, workload, profile, args)
    assert row["failed"] == 0 and row["after_requests"] > 0
    assert 0 < row["joined_share"] <= 1
    # The same run, read request by request: nothing reaches replica 2 before the join plus its start-up.
    log = simulate("fewest stored", KvAware, workload, profile, args).requests
    joined = [log.dispatch_s[i] for i in range(len(log)) if log.replica[i] == 2]
    assert joined and min(joined) >= args.join_s + 1.0


async def test_the_picker_probe_times_declined_picks_and_leaves_no_state() -> None:
    service = PickerService()
    await service.start()
    try:
        stop, samples = [False], {}
        task = asyncio.create_task(asyncio.to_thread(probe, ("127.0.0.1", service.port), [], 0.001, stop, samples))
        await async_wait_until(lambda: len(samples.get("picker", ())) >= 3 or task.done(), timeout_s=10)
        stop[0] = True
        stats = await task
    finally:
        await service.close()
    assert stats["picker"]["n"] >= 3 and 0 < stats["picker"]["p50_ms"] <= stats["picker"]["max_ms"]
    assert service.state.in_flight() == 0 and not service.state.pools   # declined: no pick held, no pool made


def test_a_process_counts_its_threads_cpu_and_sleeps() -> None:
    before = sched_counts(os.getpid())
    slept, done = threading.Event(), threading.Event()

    def sleeper() -> None:
        for _ in range(20):
            done.wait(0.001)
        slept.set()
        done.wait()   # alive while counted: a thread's counts leave with it

    thread = threading.Thread(target=sleeper)
    thread.start()
    spin_until = time.process_time() + 0.05
    while time.process_time() < spin_until:
        pass
    assert slept.wait(30)
    after = sched_counts(os.getpid())
    done.set()
    thread.join()
    assert after["threads"] >= before["threads"] + 1   # the sleeper was counted while it ran
    assert after["cpu_ns"] - before["cpu_ns"] >= 40_000_000
    assert after["voluntary"] - before["voluntary"] >= 20   # each timed wait slept


def test_a_process_share_is_divided_per_request_or_second() -> None:
    before = {"cpu_ns": 1_000_000, "voluntary": 10, "involuntary": 2, "runs": 12, "threads": 3}
    after = {"cpu_ns": 21_000_000, "voluntary": 50, "involuntary": 12, "runs": 62, "threads": 4}
    assert per_process("picker", before, after, 10, "request") == {
        "role": "picker", "cpu_ms_per_request": 2.0, "voluntary_per_request": 4.0, "involuntary_per_request": 1.0,
        "runs_per_request": 5.0, "threads": 4}
