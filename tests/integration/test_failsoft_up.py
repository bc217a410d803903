"""`fleet up` when its own records are broken: `kill -9` of the controller, then its state file
truncated and the router's record removed. `fleet status` names the file and shows what runs; a
new `fleet up` takes over from the replica records, the processes' markers and the router's own
pools, adopting every engine and the router with the same pids under load, never reusing an id;
`fleet logs controller` reads a foreground `fleet up`; `fleet down` of a dead controller with no
state and no router record stops everything. Real processes over engine SIMULATOR replicas.
The full fault table (full disk, closed output, ...): docs/crash-safety.md."""

from __future__ import annotations

import json

from tests.integration.test_fault_injection import Load, kill9, write_fleet
from tests.support.faults import wait_s
from tests.support.fleet_up import all_ready, engines, router_pid, stop_cleanly

TRUNCATED = '{"format": 3, "replicas": [{"id": "sim-ch'


def test_a_truncated_state_file_is_named_and_what_runs_is_adopted_not_stopped(sim_fleet_up, tmp_path):
    f = write_fleet(tmp_path, replicas=2)
    first = sim_fleet_up([f])
    state_dir = first.state_dir
    first.wait_for("2 replicas READY", lambda: all_ready(first, 2), timeout_s=120)
    before, router_before = engines(state_dir), router_pid(state_dir)
    with Load(first.router_url) as load:
        load.wait_for_more(20, "load before the kill")
        kill9(first)
        (state_dir / "state.json").write_text(TRUNCATED)
        (state_dir / "router.json").unlink()
        status = first.cli("status")
        assert status.returncode == 1 and "state.json is unreadable: not JSON" in status.stderr, status
        assert "Engines running: sim-chat-0, sim-chat-1" in status.stdout and "Router running" in status.stdout
        second = sim_fleet_up([f], port=first.port)
        adopt_s = wait_s("the new controller to adopt", lambda: all_ready(second, 2) and "Adopted 2" in second.output(),
                         120.0, second)
        load.wait_for_more(40, "load after the take-over")
    assert load.failed == [], load.failed[:10]
    assert engines(state_dir) == before and router_pid(state_dir) == router_before   # nothing restarted
    assert "is unreadable" in second.output() and "2 in the router's pools" in second.output()
    logs = second.cli("logs", "controller", "-n", "200")   # `fleet up` in the foreground
    assert logs.returncode == 0 and "Adopted 2 running replica(s)" in logs.stdout, logs
    print(f"\nFIGURE truncated state.json + kill -9: {len(load.results)} requests, {len(load.failed)} failed; "
          f"adopted 2 replicas and the router in {adopt_s:.1f} s")
    stop_cleanly(second, state_dir)
    assert json.loads((state_dir / "replica-ids.json").read_text()) == {"sim-chat": 2}


def test_fleet_down_with_no_state_and_no_router_record_stops_everything(sim_fleet_up, tmp_path):
    f = write_fleet(tmp_path, replicas=2)
    fleet = sim_fleet_up([f])
    state_dir = fleet.state_dir
    fleet.wait_for("2 replicas READY", lambda: all_ready(fleet, 2), timeout_s=120)
    kill9(fleet)
    (state_dir / "state.json").write_text(TRUNCATED)
    (state_dir / "router.json").unlink()
    down = fleet.cli("down")
    assert down.returncode == 0, down
    assert "stopping what it left: 2 engine(s) and the router" in down.stdout, down.stdout
    assert engines(state_dir) == {} and fleet.leftover_pids() == []
