"""Fault injection: `kill -9` of the controller, of the router, in the middle of a start-up and a
warm-up, two `fleet up` on one state directory, a restart right after `fleet down`, under a
steady open-loop load, counting every request.

Real `fleet up` processes over replicas of the engine SIMULATOR (`engine.kind: sim`: vLLM's API
with modelled latencies, no model; seconds to start), real router, real signals. Each test
prints its figures (failed requests, seconds to adopt, seconds the router was down); the README
records them ("Crash safety").
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from tests.support.faults import wait_s
from tests.support.fleet_up import FleetUp, all_ready, engines, router_pid, stop_cleanly
from tests.support.waits import wait_until
from tests.support.load import OpenLoopLoad

MODEL = "llama-8b-sim"


def write_fleet(tmp_path: Path, replicas: int = 3, startup_delay_s: float = 0.5, warmup_tokens: int = 8) -> Path:
    doc = {
        "apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": "sim-chat"},
        "spec": {
            "model": {"name": MODEL, "source": "sim://h100-llama-8b"},
            "engine": {"kind": "sim", "args": ["--seed", "1", "--startup-delay-s", str(startup_delay_s)],
                       "startupTimeoutSeconds": 120},
            "resources": {"accelerator": "cpu"},
            "replicas": {"min": replicas, "max": replicas},
            "warmup": {"requests": [{"kind": "completion", "prompt": "warm", "maxTokens": warmup_tokens,
                                     "repeat": 2}], "requestTimeoutSeconds": 60},
        },
    }  # fmt: skip
    f = tmp_path / "sim-fleet.yaml"
    f.write_text(yaml.safe_dump(doc))
    return f


def Load(url: str) -> OpenLoopLoad:
    """Short non-streamed completions at 20/s."""
    return OpenLoopLoad(url, MODEL)


def kill9(fleet: FleetUp) -> None:
    fleet.track_descendants()
    os.kill(fleet.proc.pid, signal.SIGKILL)
    fleet.proc.wait(timeout=30)


def test_kill_9_of_the_controller_while_serving_fails_no_request_and_a_restart_adopts_everything(sim_fleet_up, tmp_path):
    f = write_fleet(tmp_path)
    first = sim_fleet_up([f])
    state_dir = first.state_dir
    first.wait_for("3 replicas READY", lambda: all_ready(first, 3), timeout_s=120)
    before = engines(state_dir)
    router_before = router_pid(state_dir)
    with Load(first.router_url) as load:
        load.wait_for_more(40, "load on the fleet before the kill")
        kill9(first)
        load.wait_for_more(60, "load with no controller at all: the data plane serves on")
        assert engines(state_dir) == before and router_pid(state_dir) == router_before
        status = first.cli("status")
        assert "The controller is not running, but 3 engine(s)" in status.stdout, status.stdout
        second = sim_fleet_up([f], port=first.port)
        adopt_s = wait_s("the new controller to adopt", lambda: all_ready(second, 3) and "Adopted 3" in second.output(),
                         120)
        load.wait_for_more(40, "load after the adoption")
    assert load.failed == [], load.failed[:10]
    assert engines(state_dir) == before                  # same processes: nothing was restarted
    assert router_pid(state_dir) == router_before
    assert all(r.get("adopted_at_s") is not None for r in second.replicas().values())
    print(f"\nFIGURE kill -9 controller: {len(load.results)} requests at {load.rate_per_s:g}/s, "
          f"{len(load.failed)} failed; adopted 3 replicas and the router in {adopt_s:.1f} s")
    stop_cleanly(second, state_dir)


@pytest.mark.parametrize("phase", ["STARTING", "WARMING"])
def test_kill_9_in_the_middle_of_a_start_up_or_a_warm_up_converges_without_duplicates(sim_fleet_up, tmp_path, phase):
    f = write_fleet(tmp_path, replicas=3, startup_delay_s=3.0, warmup_tokens=400)
    first = sim_fleet_up([f])
    state_dir = first.state_dir
    first.wait_for(f"a replica in {phase}", lambda: any(first.status_of(f"sim-chat-{i}") == phase for i in range(3)),
                   timeout_s=120)  # fmt: skip
    kill9(first)
    started = engines(state_dir)
    second = sim_fleet_up([f], port=first.port)
    second.wait_for("3 replicas READY", lambda: all_ready(second, 3), timeout_s=180)
    running = engines(state_dir)
    assert sorted(running) == ["sim-chat-0", "sim-chat-1", "sim-chat-2"], running   # one process each
    assert {rid: running[rid] for rid in started} == started                        # none restarted
    assert sorted(second.replicas()) == ["sim-chat-0", "sim-chat-1", "sim-chat-2"]   # no replacement was needed
    stop_cleanly(second, state_dir)


def test_kill_9_of_the_router_fails_requests_only_while_it_is_down(sim_fleet_up, tmp_path):
    f = write_fleet(tmp_path)
    fleet = sim_fleet_up([f])
    state_dir = fleet.state_dir
    fleet.wait_for("3 replicas READY", lambda: all_ready(fleet, 3), timeout_s=120)
    with Load(fleet.router_url) as load:
        load.wait_for_more(40, "load on the fleet before the kill")
        old = router_pid(state_dir)
        killed_at = time.monotonic()
        os.kill(old, signal.SIGKILL)
        back_s = wait_s("the router to be back", lambda: (router_pid(state_dir) or old) != old
                        and "pools published again" in fleet.output(), 60)  # fmt: skip
        wait_until(lambda: len([r for r in load.results if r[0] > killed_at + back_s + 1.0]) >= 40, 120,
                   what="40 requests sent a second after the router was back answered")
    after = [r for r in load.results if r[0] > killed_at + back_s + 1.0]
    assert after and all(outcome == "ok" for _, outcome in after)
    failed_window_s = (max(t for t, _ in load.failed) - min(t for t, _ in load.failed)) if load.failed else 0.0
    print(f"\nFIGURE kill -9 router: {len(load.results)} requests, {len(load.failed)} failed within "
          f"{failed_window_s:.1f} s; router back with its pools {back_s:.1f} s after the kill")
    assert all(killed_at - 0.5 <= t <= killed_at + back_s + 1.0 for t, _ in load.failed)
    stop_cleanly(fleet, state_dir)


def test_a_second_fleet_up_refuses_and_a_restart_right_after_down_starts(sim_fleet_up, tmp_path):
    f = write_fleet(tmp_path, replicas=1)
    first = sim_fleet_up([f])
    first.wait_for("1 replica READY", lambda: all_ready(first, 1), timeout_s=120)
    other = sim_fleet_up([f])
    assert other.proc.wait(timeout=60) == 2
    assert "already running with state in" in other.output()
    down = first.cli("down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert first.proc.wait(timeout=60) == 0
    again = sim_fleet_up([f], port=first.port)          # same port at once: TIME-WAIT sockets do not block it
    again.wait_for("1 replica READY", lambda: all_ready(again, 1), timeout_s=120)
    stop_cleanly(again, again.state_dir)


def test_fleet_down_stops_what_a_dead_controller_left(sim_fleet_up, tmp_path):
    f = write_fleet(tmp_path, replicas=2)
    fleet = sim_fleet_up([f])
    state_dir = fleet.state_dir
    fleet.wait_for("2 replicas READY", lambda: all_ready(fleet, 2), timeout_s=120)
    kill9(fleet)
    assert len(engines(state_dir)) == 2 and router_pid(state_dir) is not None
    down = fleet.cli("down")
    assert down.returncode == 0 and "stopping what it left: 2 engine(s) and the router" in down.stdout, down.stdout
    assert engines(state_dir) == {} and router_pid(state_dir) is None
    assert fleet.leftover_pids() == []


def test_kill_9_in_the_middle_of_a_drain_finishes_it_and_serves_the_target_again(sim_fleet_up, tmp_path):
    f = write_fleet(tmp_path, replicas=2)
    first = sim_fleet_up([f])
    state_dir = first.state_dir
    first.wait_for("2 replicas READY", lambda: all_ready(first, 2), timeout_s=120)
    streamed: dict[str, object] = {}

    def long_stream() -> None:
        import httpx

        body = {"model": MODEL, "prompt": "tell me", "max_tokens": 1500, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
        events = []
        with httpx.stream("POST", f"{first.router_url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        streamed["usage"] = events[-1].get("usage") if events else None

    t = threading.Thread(target=long_stream)
    t.start()
    first.wait_for("the stream to be in flight", lambda: "sim-chat" in json.dumps(first.state()) and any(
        e["in_flight"] for e in _pools(first)), timeout_s=30)  # fmt: skip
    first.proc.send_signal(signal.SIGINT)                 # shutdown: both replicas drain
    first.wait_for("a replica DRAINING", lambda: any(r["status"] == "DRAINING" for r in first.replicas().values()),
                   timeout_s=30)  # fmt: skip
    kill9(first)
    second = sim_fleet_up([f], port=first.port)
    second.wait_for("2 new replicas READY", lambda: all_ready(second, 2), timeout_s=120)
    t.join(timeout=120)
    assert streamed.get("usage") and streamed["usage"]["completion_tokens"] == 1500   # never cut
    transitional = ("DRAINING", "STARTING", "WARMING", "PENDING", "PLACED")
    second.wait_for("the drained replicas to stop", lambda: len(engines(state_dir)) == 2 and not any(
        r["status"] in transitional for r in second.replicas().values()), timeout_s=60)  # fmt: skip
    states = {rid: r["status"] for rid, r in second.replicas().items()}
    assert sorted(rid for rid, s in states.items() if s == "READY") == sorted(engines(state_dir)), states
    assert sorted(states.values()) == ["READY", "READY", "TERMINATED", "TERMINATED"], states
    stop_cleanly(second, state_dir)


def _pools(fleet: FleetUp) -> list[dict]:
    import httpx

    try:
        pools = httpx.get(f"{fleet.router_url}/admin/v1/pools", timeout=5,
                          headers={"Authorization": f"Bearer {fleet.admin_token()}"}).json()["pools"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []
    return [e for p in pools.values() for e in p["endpoints"]]


def test_up_detach_returns_once_ready_and_logs_status_down_reach_the_background_fleet(tmp_path):
    import subprocess
    import sys

    from tests.support.fleet_up import REPO, free_port

    f = write_fleet(tmp_path, replicas=2)
    state = tmp_path / "state"
    port = free_port()
    cli = [sys.executable, "-m", "fleet.cli"]
    try:
        up = subprocess.run([*cli, "up", str(f), "--detach", "--port", str(port), "--metrics-port", str(free_port()),
                             "--state-dir", str(state)],
                            capture_output=True, text=True, cwd=REPO, timeout=180)  # fmt: skip
        assert up.returncode == 0, up.stdout + up.stderr
        assert "All 2 replica(s) READY" in up.stdout and "runs in the background" in up.stdout
        assert len(engines(state)) == 2
        logs = subprocess.run([*cli, "logs", "--state-dir", str(state), "-n", "200"], capture_output=True, text=True,
                              cwd=REPO, timeout=60)  # fmt: skip
        assert "All 2 replica(s) READY" in logs.stdout
        engine_log = subprocess.run([*cli, "logs", "sim-chat-0", "--state-dir", str(state)], capture_output=True,
                                    text=True, cwd=REPO, timeout=60)  # fmt: skip
        assert "SIMULATOR" in engine_log.stdout, engine_log.stdout
        down = subprocess.run([*cli, "down", "--state-dir", str(state)], capture_output=True, text=True, cwd=REPO,
                              timeout=200)  # fmt: skip
        assert down.returncode == 0 and "Fleet stopped." in down.stdout, down.stdout + down.stderr
        assert engines(state) == {} and router_pid(state) is None
    finally:  # a failed test leaves nothing behind: the background `fleet up`, its router and engines
        up_pid = json.loads((state / "state.json").read_text()).get("pid") if (state / "state.json").exists() else None
        left = [*engines(state).values(), router_pid(state)] if (state / "fleet-id").exists() else []
        for pid in [up_pid, *left]:
            if pid and psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


def test_kill_9_of_a_replica_fails_no_request_that_had_not_started_streaming(sim_fleet_up, tmp_path):
    f = write_fleet(tmp_path)
    fleet = sim_fleet_up([f])
    state_dir = fleet.state_dir
    fleet.wait_for("3 replicas READY", lambda: all_ready(fleet, 3), timeout_s=120)
    victim = engines(state_dir)["sim-chat-1"]
    with Load(fleet.router_url) as load:
        load.wait_for_more(40, "load on the fleet before the kill")
        os.killpg(victim, signal.SIGKILL)
        fleet.wait_for("the replica replaced", lambda: fleet.status_of("sim-chat-1") == "FAILED_CRASHED"
                       and all_ready(fleet, 3), timeout_s=120)  # fmt: skip
        load.wait_for_more(40, "load on the replaced replica's fleet")
    print(f"\nFIGURE kill -9 replica: {len(load.results)} requests, {len(load.failed)} failed")
    assert load.failed == [], load.failed[:10]
    assert "sim-chat-3" in engines(state_dir)
    stop_cleanly(fleet, state_dir)
