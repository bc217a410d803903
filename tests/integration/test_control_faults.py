"""A fault of the control plane never reaches serving: one row per fault an operator's machine
has, each under a steady open-loop streamed load, counting every request.

Rows: the state directory's filesystem full (a tmpfs in a private mount namespace, with
`fleet up`'s output in it as `fleet up --detach` has it) while a replica crashes, and while the
router is restarted; `fleet up`'s stdout reader gone; `state.json` truncated under a restart;
`kill -9` of the router (30 req/s for 60 s: no connection refused, since `fleet up` holds the
listening socket), of a replica's engine, of `fleet up`. Each row asserts that no request
failed before its stream started (the router's own `kill -9`: none but those in flight on it),
that the fleet is back at full strength within `RECOVERY_DEADLINE_S`, and that `fleet down`
leaves no engine, router or other process behind.

Real `fleet up` processes over three replicas of the engine SIMULATOR (`engine.kind: sim`), the
real router, real signals, a real full filesystem. The load: `loadtests.faultload.FaultLoad`
(25 streamed completions/s; refused connections and 503/429 retried as OpenAI's SDKs do, nothing
else). Each test records its row (`FAULT-ROW {json}` in its output) once its load has run,
before its assertions; the table in docs/crash-safety.md comes from
`python -m loadtests.fault_table`, which runs this file.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from loadtests.faultload import FaultLoad
from tests.support.fleet_up import FleetUp, all_ready, engines, router_pid
from tests.support.faults import (
    MODEL,
    ROWS_ENV,
    FaultFleet,
    TmpfsNamespace,
    control_write_errors,
    down_leaves_nothing,
    kill_9_router,
    kill_engine,
    pool_endpoints,
    ready_since,
    record_row,
    sim_fleet_file,
    stdout_pipe_to,
    wait_s,
)

REPLICAS = 3
READY_TIMEOUT_S = 120.0
RECOVERY_DEADLINE_S = 90.0
"""Back at full strength within this: a crashed replica is replaced after the controller's first
backoff (10 s, `ControllerSettings.backoff_base_s`) plus an engine start and warm-up, on a busy
2-core machine."""
FULL_HOLD_S = 3.0
"""How long the disk stays full after the router is killed: the router supervisor (every 1 s)
tries to restart it on the full disk at least twice."""

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def fleet_file(tmp_path: Path) -> Path:
    return sim_fleet_file(tmp_path, REPLICAS)


@pytest.fixture
def started(tmp_path: Path):
    """Every `fleet up` a test starts, killed with all it started if the test left it running."""
    fleets: list[FleetUp] = []
    yield fleets
    for f in fleets:
        if f.proc.poll() is None or f.leftover_pids():
            f.kill_everything()


@pytest.fixture
def tmpfs(tmp_path: Path):
    ns = TmpfsNamespace(tmp_path / "state", size_mib=64)
    try:
        ns.start()
    except TmpfsNamespace.Unavailable as err:
        pytest.skip(f"state dir full: {err}")
    yield ns
    ns.close()


def _up(started: list, fleet: FleetUp) -> FleetUp:
    started.append(fleet)
    wait_s(f"{REPLICAS} replicas READY", lambda: all_ready(fleet, REPLICAS), READY_TIMEOUT_S, fleet)
    return fleet


def _kill9(fleet: FleetUp) -> None:
    fleet.track_descendants()
    os.kill(fleet.proc.pid, signal.SIGKILL)
    fleet.proc.wait(timeout=30)


def _assert_none_failed_before_streaming(load: FaultLoad) -> None:
    assert load.failed == [], f"{load.summary()}; first failures: {load.failed[:5]}"


def _in_flight_on_the_router(load: FaultLoad, killed_at_s: float) -> int:
    """Failures a router kill may cause: tries in flight on it when it died (sent before the
    kill, ended by a reset or a closed connection, never an HTTP status)."""
    return sum(1 for r in load.failed if r.last_try_at_s <= killed_at_s and not r.detail.split()[0].isdigit())


def _assert_only_in_flight_on_the_router_failed(load: FaultLoad, killed_at_s: float) -> None:
    bad = [r for r in load.failed if r.last_try_at_s > killed_at_s or r.detail.split()[0].isdigit()]
    assert bad == [], f"{len(bad)} requests failed that were not in flight on the killed router: {bad[:5]}; " \
                      f"{load.summary()}"


# ----- the state directory's filesystem full ---------------------------------------------------


def _full_disk_fleet(tmpfs: TmpfsNamespace, started: list, fleet_file: Path) -> FaultFleet:
    """`fleet up` with its state directory on ``tmpfs`` and its output in ``logs/fleet-up.log``
    there (as `fleet up --detach` writes it), 3 replicas READY."""
    state = tmpfs.mountpoint
    log = state / "logs" / "fleet-up.log"
    return _up(started, FaultFleet([fleet_file], state, prefix=tmpfs.enter(), view=tmpfs.view(state),
                                   out_path=tmpfs.view(log), shell_out=log))  # fmt: skip


def _fill_and_check_status(tmpfs: TmpfsNamespace, fleet: FaultFleet) -> int:
    filled = tmpfs.fill()
    assert tmpfs.free_bytes() == 0
    status = fleet.cli("status")
    assert status.returncode == 0 and "sim-chat-0" in status.stdout, \
        f"`fleet status` on a full disk: exit {status.returncode}\n{status.stdout}\n{status.stderr}"
    return filled


def test_state_dir_full_while_a_replica_crashes_never_reaches_serving(tmpfs, started, fleet_file):
    fleet = _full_disk_fleet(tmpfs, started, fleet_file)
    view = fleet.state_dir
    before = engines(view)
    victim = fleet.replicas()["sim-chat-1"]["endpoint"]
    with FaultLoad(fleet.router_url, MODEL) as load:
        load.wait_for_more(40, "load on the fleet before the disk fills")
        _fill_and_check_status(tmpfs, fleet)
        kill_engine(view, "sim-chat-1")
        wait_s("the crashed replica out of the router's pool (the controller saw it on a full disk)",
               lambda: (eps := pool_endpoints(fleet)) is not None and len(eps) == REPLICAS - 1
               and all(victim not in str(e) for e in eps), 60, fleet)  # fmt: skip
        load.wait_for_more(50, "load with the disk full and a replica gone")
        assert fleet.proc.poll() is None, f"`fleet up` exited {fleet.proc.returncode} on a full disk"
        tmpfs.free()
        freed_unix = time.time()
        recovery_s = wait_s(f"{REPLICAS} replicas READY in a state written after the disk was freed",
                            lambda: ready_since(fleet, REPLICAS, freed_unix), RECOVERY_DEADLINE_S, fleet)  # fmt: skip
        load.wait_for_more(50, "load after the recovery")
    record_row("state dir full, replica kill -9", load, recovery_s, "disk freed -> 3 READY recorded")
    _assert_none_failed_before_streaming(load)
    errors = control_write_errors(fleet)
    assert sum(errors.values()) > 0, f"the failed writes were not counted: {errors}"
    assert fleet.status_of("sim-chat-1") == "FAILED_CRASHED"
    running = engines(view)
    assert all(running.get(k) == pid for k, pid in before.items() if k != "sim-chat-1"), running  # not restarted
    down_leaves_nothing(fleet)


def test_state_dir_full_while_the_router_restarts_fails_only_what_was_in_flight_on_it(tmpfs, started, fleet_file):
    fleet = _full_disk_fleet(tmpfs, started, fleet_file)
    view = fleet.state_dir
    before = engines(view)
    with FaultLoad(fleet.router_url, MODEL) as load:
        load.wait_for_more(40, "load on the fleet before the disk fills")
        _fill_and_check_status(tmpfs, fleet)
        killed_at = kill_9_router(view)
        time.sleep(FULL_HOLD_S)   # the fault's length, not a wait for a condition
        assert fleet.proc.poll() is None, f"`fleet up` exited {fleet.proc.returncode} on a full disk"
        tmpfs.free()
        wait_s("a request answered by the restarted router", lambda: load.first_ok_try_after(killed_at),
               RECOVERY_DEADLINE_S, fleet)  # fmt: skip
        load.wait_for_more(50, "load after the recovery")
    record_row("state dir full, router kill -9", load, load.first_ok_try_after(killed_at) - killed_at,
               f"kill -> first request served by the new router; disk full for {FULL_HOLD_S:g} s after the kill",
               lost_in_flight=_in_flight_on_the_router(load, killed_at))  # fmt: skip
    _assert_only_in_flight_on_the_router_failed(load, killed_at)
    assert engines(view) == before
    down_leaves_nothing(fleet)


# ----- stdout reader gone ----------------------------------------------------------------------


def test_stdout_reader_gone_never_reaches_serving(tmp_path, started, fleet_file):
    out = tmp_path / "fleet-up.out"
    w, reader = stdout_pipe_to(out)
    fleet = FaultFleet([fleet_file], tmp_path / "state", stdout=w, out_path=out)
    os.close(w)
    _up(started, fleet)
    with FaultLoad(fleet.router_url, MODEL) as load:
        load.wait_for_more(40, "load on the fleet before the reader dies")
        reader.kill()
        reader.wait(timeout=10)
        kill_engine(fleet.state_dir, "sim-chat-1")   # something to print: the crash, the replacement
        killed_at_unix = time.time()
        recovery_s = wait_s("the crashed replica replaced, with no one reading `fleet up`'s output",
                            lambda: fleet.status_of("sim-chat-1") == "FAILED_CRASHED"
                            and ready_since(fleet, REPLICAS, killed_at_unix), RECOVERY_DEADLINE_S, fleet)  # fmt: skip
        load.wait_for_more(50, "load after the replacement")
    record_row("stdout reader gone, replica kill -9", load, recovery_s, "kill -> replaced, 3 READY")
    assert fleet.proc.poll() is None, "`fleet up` exited with its stdout gone"
    _assert_none_failed_before_streaming(load)
    errors = control_write_errors(fleet)
    assert errors.get("stdout", 0) > 0, f"the failed writes to stdout were not counted: {errors}"
    down_leaves_nothing(fleet)


# ----- state file truncated ---------------------------------------------------------------------


def test_truncated_state_file_is_named_and_the_restart_adopts_every_engine(tmp_path, started, fleet_file):
    first = _up(started, FaultFleet([fleet_file], tmp_path / "state", out_path=tmp_path / "fleet-up-0.out"))
    state = first.state_dir
    before = engines(state)
    with FaultLoad(first.router_url, MODEL) as load:
        load.wait_for_more(40, "load on the fleet before the crash")
        _kill9(first)
        text = (state / "state.json").read_bytes()
        (state / "state.json").write_bytes(text[: len(text) // 2])   # cut mid-document, as a torn write leaves it
        status = first.cli("status")
        restarted_unix = time.time()
        second = FaultFleet([fleet_file], state, port=first.port, out_path=tmp_path / "fleet-up-1.out")
        started.append(second)
        recovery_s = wait_s("the restarted controller to adopt every engine",
                            lambda: ready_since(second, REPLICAS, restarted_unix), RECOVERY_DEADLINE_S, second)  # fmt: skip
        load.wait_for_more(50, "load after the adoption")
    record_row("state.json truncated, fleet up restarted", load, recovery_s, "restart -> 3 adopted READY")
    _assert_none_failed_before_streaming(load)
    assert engines(state) == before, "an engine was stopped or restarted instead of adopted"
    assert sorted(second.replicas()) == sorted(before), "replica ids changed or were reused"
    assert "state.json" in second.output(), "the unreadable state file is not named"
    said = status.stdout + status.stderr
    assert "state.json" in said and "has not run" not in said, f"`fleet status` of a truncated state:\n{said}"
    down_leaves_nothing(second, first)


def test_fleet_down_from_a_truncated_state_with_no_controller_leaves_nothing(tmp_path, started, fleet_file):
    fleet = _up(started, FaultFleet([fleet_file], tmp_path / "state"))
    _kill9(fleet)
    path = fleet.state_dir / "state.json"
    path.write_bytes(path.read_bytes()[:40])
    said = down_leaves_nothing(fleet)   # no controller runs: `fleet down` adopts what it finds and stops it
    assert "Fleet stopped." in said, said


# ----- kill -9 of the router, of a replica, of `fleet up` ---------------------------------------


ROUTER_KILL_RATE_PER_S = 30.0
ROUTER_KILL_S = 60 if os.environ.get(ROWS_ENV) else 20
"""The router kill row's load: 30 streamed completions/s for 60 s when loadtests/fault_table.py
records the row (``$FLEET_FAULT_ROWS`` set), 20 s in the test suite; the kill a third of the way in."""
ROUTER_KILL_REQUESTS = int(ROUTER_KILL_RATE_PER_S * ROUTER_KILL_S)


def test_router_kill_9_refuses_no_connection_and_fails_only_the_streams_in_flight_on_it(tmp_path, started,
                                                                                       fleet_file):  # fmt: skip
    fleet = _up(started, FaultFleet([fleet_file], tmp_path / "state"))
    before = engines(fleet.state_dir)
    with FaultLoad(fleet.router_url, MODEL, rate_per_s=ROUTER_KILL_RATE_PER_S) as load:
        load.wait_for_more(ROUTER_KILL_REQUESTS // 3, "load on the fleet before the kill")
        killed_at = kill_9_router(fleet.state_dir)
        wait_s("a request answered by the restarted router", lambda: load.first_ok_try_after(killed_at),
               RECOVERY_DEADLINE_S, fleet)  # fmt: skip
        load.wait_for_more(ROUTER_KILL_REQUESTS - len(load.done), f"the rest of the {ROUTER_KILL_S} s of load")
    record_row(f"router kill -9 ({ROUTER_KILL_RATE_PER_S:g}/s for {ROUTER_KILL_S} s)", load,
               load.first_ok_try_after(killed_at) - killed_at, "kill -> first request served by the new router",
               lost_in_flight=_in_flight_on_the_router(load, killed_at))  # fmt: skip
    assert load.refused == 0, f"{load.refused} connections refused while the router restarted; {load.summary()}"
    _assert_only_in_flight_on_the_router_failed(load, killed_at)
    late_cuts = [r for r in load.cut if r.last_try_at_s > killed_at]
    assert late_cuts == [], f"streams cut that were sent after the kill: {late_cuts[:5]}"
    assert engines(fleet.state_dir) == before
    down_leaves_nothing(fleet)


def test_replica_kill_9_fails_no_request_that_had_not_started_streaming(tmp_path, started, fleet_file):
    fleet = _up(started, FaultFleet([fleet_file], tmp_path / "state"))
    with FaultLoad(fleet.router_url, MODEL) as load:
        load.wait_for_more(40, "load on the fleet before the kill")
        kill_engine(fleet.state_dir, "sim-chat-1")
        killed_at_unix = time.time()
        recovery_s = wait_s("the crashed replica replaced",
                            lambda: fleet.status_of("sim-chat-1") == "FAILED_CRASHED"
                            and ready_since(fleet, REPLICAS, killed_at_unix), RECOVERY_DEADLINE_S, fleet)  # fmt: skip
        load.wait_for_more(50, "load after the replacement")
    record_row("replica kill -9", load, recovery_s, "kill -> replaced, 3 READY")
    _assert_none_failed_before_streaming(load)
    down_leaves_nothing(fleet)


def test_fleet_up_kill_9_fails_no_request_and_a_restart_adopts_everything(tmp_path, started, fleet_file):
    first = _up(started, FaultFleet([fleet_file], tmp_path / "state", out_path=tmp_path / "fleet-up-0.out"))
    state = first.state_dir
    before, router_before = engines(state), router_pid(state)
    with FaultLoad(first.router_url, MODEL) as load:
        load.wait_for_more(40, "load on the fleet before the kill")
        _kill9(first)
        load.wait_for_more(40, "load with no controller at all: the data plane serves on")
        restarted_unix = time.time()
        second = FaultFleet([fleet_file], state, port=first.port, out_path=tmp_path / "fleet-up-1.out")
        started.append(second)
        recovery_s = wait_s("the restarted controller to adopt every engine and the router",
                            lambda: ready_since(second, REPLICAS, restarted_unix)
                            and f"Adopted {REPLICAS}" in second.output(), RECOVERY_DEADLINE_S, second)  # fmt: skip
        load.wait_for_more(50, "load after the adoption")
    record_row("fleet up kill -9, restarted", load, recovery_s, "restart -> 3 adopted READY")
    _assert_none_failed_before_streaming(load)
    assert engines(state) == before and router_pid(state) == router_before   # adopted, not restarted
    down_leaves_nothing(second, first)
