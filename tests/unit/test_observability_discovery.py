"""Prometheus service discovery from the controller snapshot, the atomic file_sd writer, the
controller's replica-state metrics (fleet/observability/discovery.py) and the scrape config
(fleet/observability/scrape.py). promtool checking that config is in
tests/integration/test_observability_discovery.py."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fleet.observability.discovery import (
    JOB_CONTROLLER,
    JOB_ENGINE,
    JOB_NODE_AGENT,
    JOB_PICKER,
    JOB_ROUTER,
    REPLICA_STATUSES,
    FileSDWriter,
    LocalObservability,
    file_sd_groups,
    targets_path,
)
from fleet.observability.scrape import prometheus_config


def replica(rid: str, status: str, port: int | None, deployment: str = "chat", revision: str = "v1") -> dict:
    return {"id": rid, "deployment": deployment, "revision": revision, "status": status,
            "endpoint": f"http://127.0.0.1:{port}" if port else None}  # fmt: skip


SNAPSHOT = {
    "deployments": {
        "chat": {"desired": 3, "min": 1, "max": 4, "model": "llama", "failures_in_row": 1, "failures_total": {"v1": 1}},
        "embed": {"desired": 1, "min": 1, "max": 1, "model": "e5", "failures_in_row": 0},
    },
    "replicas": [
        replica("chat-2", "READY", 9002, revision="v2"),
        replica("chat-0", "READY", 9000),
        replica("chat-1", "DRAINING", 9001),
        replica("chat-3", "STARTING", 9003, revision="v2"),
        replica("chat-4", "FAILED_START", 9004),
        replica("chat-5", "TERMINATED", 9005),
        replica("chat-6", "PENDING", None),
        replica("embed-0", "WARMING", 9100, deployment="embed"),
    ],
}


def test_targets_are_the_router_the_controller_and_every_running_engine_with_its_labels() -> None:
    groups = file_sd_groups(SNAPSHOT, "http://127.0.0.1:8080", "http://127.0.0.1:8081")
    assert groups[0] == {"targets": ["127.0.0.1:8080"], "labels": {"job": JOB_ROUTER}}
    assert groups[1] == {"targets": ["127.0.0.1:8081"], "labels": {"job": JOB_CONTROLLER}}
    engines = groups[2:]
    assert [(g["targets"], g["labels"]) for g in engines] == [
        (["127.0.0.1:9000"], {"job": JOB_ENGINE, "deployment": "chat", "version": "v1", "replica": "chat-0"}),
        (["127.0.0.1:9001"], {"job": JOB_ENGINE, "deployment": "chat", "version": "v1", "replica": "chat-1"}),
        (["127.0.0.1:9002"], {"job": JOB_ENGINE, "deployment": "chat", "version": "v2", "replica": "chat-2"}),
        (["127.0.0.1:9003"], {"job": JOB_ENGINE, "deployment": "chat", "version": "v2", "replica": "chat-3"}),
        (["127.0.0.1:9100"], {"job": JOB_ENGINE, "deployment": "embed", "version": "v1", "replica": "embed-0"}),
    ]  # failed, terminated and pending replicas have no process to scrape


def test_router_and_controller_targets_carry_no_label_their_series_already_have() -> None:
    groups = file_sd_groups(SNAPSHOT, "http://127.0.0.1:8080/", None)
    assert [g["labels"] for g in groups if g["labels"]["job"] != JOB_ENGINE] == [{"job": JOB_ROUTER}]
    assert file_sd_groups({}, None, None) == []


def test_the_node_agent_is_a_target_of_its_own_job_after_the_controller() -> None:
    groups = file_sd_groups(SNAPSHOT, "http://127.0.0.1:8080", "http://127.0.0.1:8081", "http://127.0.0.1:9402/")
    assert groups[2] == {"targets": ["127.0.0.1:9402"], "labels": {"job": JOB_NODE_AGENT}}
    assert [g["labels"]["job"] for g in groups[3:]] == [JOB_ENGINE] * 5
    # its series say which node they are about in their own `node` label: no target label for it
    assert [g for g in file_sd_groups({}, None, None, "http://h:1") if g["labels"] != {"job": JOB_NODE_AGENT}] == []


def test_the_writer_replaces_the_file_atomically_and_only_on_change(tmp_path: Path) -> None:
    path = tmp_path / "targets.json"
    writer = FileSDWriter(path)
    groups = file_sd_groups(SNAPSHOT, "http://127.0.0.1:8080")
    assert writer.write(groups) is True
    assert json.loads(path.read_text()) == groups
    mtime = path.stat().st_mtime_ns
    assert writer.write(groups) is False and path.stat().st_mtime_ns == mtime
    assert writer.write(groups[:1]) is True and json.loads(path.read_text()) == groups[:1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["targets.json"]  # no temp file left


def _scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_replica_states_desired_bounds_and_model_are_exported() -> None:
    registry = CollectorRegistry()
    obs = LocalObservability(Path("/nonexistent-dir"), "http://127.0.0.1:8080", None, registry=registry)
    obs.collector.update(SNAPSHOT)
    m = _scrape(registry)

    def rep(dep: str, version: str, state: str) -> float:
        return m[("fleet_replicas", (("deployment", dep), ("state", state), ("version", version)))]

    assert rep("chat", "v1", "READY") == 1 and rep("chat", "v1", "DRAINING") == 1
    assert rep("chat", "v2", "READY") == 1 and rep("chat", "v2", "STARTING") == 1
    assert rep("chat", "v1", "FAILED_START") == 1 and rep("chat", "v1", "PENDING") == 1
    assert rep("embed", "v1", "WARMING") == 1 and rep("embed", "v1", "READY") == 0
    states = {dict(k[1])["state"] for k in m if k[0] == "fleet_replicas"}
    assert states == set(REPLICA_STATUSES)  # every state exported, 0 included
    assert m[("fleet_deployment_desired_replicas", (("deployment", "chat"),))] == 3
    assert m[("fleet_deployment_max_replicas", (("deployment", "chat"),))] == 4
    assert m[("fleet_deployment_min_replicas", (("deployment", "embed"),))] == 1
    assert m[("fleet_deployment_consecutive_failures", (("deployment", "chat"),))] == 1
    assert m[("fleet_deployment_info", (("deployment", "chat"), ("model", "llama")))] == 1
    assert m[("fleet_replica_failures_total", (("deployment", "chat"), ("version", "v1")))] == 1
    assert m[("fleet_replica_failures_total", (("deployment", "embed"), ("version", "v1")))] == 0


async def test_the_failure_counter_counts_trimmed_failures_and_survives_a_controller_restart(tmp_path: Path) -> None:
    """`fleet_replica_failures_total` is the controller's own counter: a failed replica trimmed
    from the snapshot's history still counts, and a restarted controller goes on from it."""
    from fleet.controller.reconcile import Controller, ControllerSettings
    from fleet.spec import load_deployments
    from tests.support.fakes import FakeEngineAPI, FakePoolSink
    from tests.support.controller import Harness, write_deployment

    h = Harness(tmp_path, [write_deployment(tmp_path, replicas=1)], history_per_deployment=1, backoff_base_s=0.5)
    h.backend.fail_launch = "engine image not present: test"
    for _ in range(3):
        await h.tick()
    snap = h.c.snapshot()
    assert len([r for r in snap["replicas"] if r["status"] == "FAILED_START"]) == 1   # older ones trimmed
    assert snap["deployments"]["chat"]["failures_total"] == {"v1": 3}
    registry = CollectorRegistry()
    obs = LocalObservability(Path("/nonexistent-dir"), "http://r", None, registry=registry)
    obs.collector.update(snap)
    key = ("fleet_replica_failures_total", (("deployment", "chat"), ("version", "v1")))
    assert _scrape(registry)[key] == 3
    again = Controller(load_deployments([tmp_path / "chat.yaml"]), backend=h.backend, engine_api=FakeEngineAPI(),
                       pool_sink=FakePoolSink(), clock=h.clock, settings=ControllerSettings())  # fmt: skip
    await again.start(snap)
    assert again.snapshot()["deployments"]["chat"]["failures_total"] == {"v1": 3}


def test_tick_writes_the_targets_file_and_survives_an_unwritable_directory(tmp_path: Path, caplog) -> None:
    obs = LocalObservability(tmp_path, "http://127.0.0.1:8080", "http://127.0.0.1:8081",
                             node_agent_url="http://127.0.0.1:40123")  # fmt: skip
    obs.tick(SNAPSHOT)
    written = json.loads(targets_path(tmp_path).read_text())
    assert written == file_sd_groups(SNAPSHOT, "http://127.0.0.1:8080", "http://127.0.0.1:8081", "http://127.0.0.1:40123")
    assert {"targets": ["127.0.0.1:40123"], "labels": {"job": JOB_NODE_AGENT}} in written
    obs.stopped()  # an orderly stop leaves Prometheus nothing to scrape
    assert json.loads(targets_path(tmp_path).read_text()) == []
    broken = LocalObservability(tmp_path / "missing" / "dir", "http://127.0.0.1:8080", None)
    broken.tick(SNAPSHOT)  # logged, not raised into the controller loop
    assert "cannot write Prometheus targets" in caplog.text


def test_the_endpoint_picker_is_a_target_of_its_own_job_when_it_serves_metrics(tmp_path: Path) -> None:
    groups = file_sd_groups(SNAPSHOT, "http://127.0.0.1:8080", None, picker_url="http://127.0.0.1:8091")
    assert {"targets": ["127.0.0.1:8091"], "labels": {"job": JOB_PICKER}} in groups
    assert [g["labels"]["job"] for g in groups][:2] == [JOB_ROUTER, JOB_PICKER]
    assert JOB_PICKER not in {g["labels"]["job"] for g in file_sd_groups(SNAPSHOT, "http://127.0.0.1:8080")}
    obs = LocalObservability(tmp_path, "http://127.0.0.1:8080", None, picker_url="http://127.0.0.1:8091")
    obs.tick(SNAPSHOT)
    assert json.loads(targets_path(tmp_path).read_text()) == groups


def test_a_targets_file_that_cannot_be_written_is_logged_once_then_with_backoff_and_its_recovery_said(
        tmp_path: Path, caplog) -> None:  # fmt: skip
    from fleet.local.failsoft import WriteErrors
    from tests.support.fakes import FakeClock

    clock = FakeClock(0.0)
    errors = WriteErrors(clock)
    obs = LocalObservability(tmp_path / "state", "http://127.0.0.1:8080", None, write_errors=errors)
    for _ in range(10):            # ten ticks in the first second, the directory missing
        obs.tick(SNAPSHOT)
    warnings = [r.getMessage() for r in caplog.records if "prometheus_targets" in r.getMessage()]
    assert len(warnings) == 1 and "next try in 1 s" in warnings[0], warnings
    assert errors.state("prometheus_targets").errors == 1 and errors.state("prometheus_targets").dropped == 9
    clock.advance(1.0)
    obs.tick(SNAPSHOT)                     # tried again, failed: the backoff doubles
    assert errors.state("prometheus_targets").delay_s == 2.0
    (tmp_path / "state").mkdir()
    clock.advance(2.0)
    obs.tick(SNAPSHOT)
    assert json.loads(targets_path(tmp_path / "state").read_text())
    assert "writing prometheus_targets works again" in caplog.text
    assert not errors.state("prometheus_targets").failing


def test_the_scrape_config_reads_the_targets_file_and_loads_the_rules(tmp_path: Path) -> None:
    text = prometheus_config(tmp_path / "t.json", scrape_interval="1s", rule_files=[tmp_path / "r.yaml"])
    doc = yaml.safe_load(text)
    assert doc["global"] == {"scrape_interval": "1s", "evaluation_interval": "1s"}
    assert doc["scrape_configs"][0]["file_sd_configs"][0]["files"] == [str(tmp_path / "t.json")]
    assert doc["rule_files"] == [str(tmp_path / "r.yaml")]
