"""Canary rollouts end to end over the engine SIMULATOR: `fleet up`, a changed file handed over
with `fleet apply`, canary replicas that start and warm before they get traffic, weights that step
through, and a promotion for a good canary, a roll back within the analysis windows for a slowed
one; under a steady streamed load, counting every request: none may fail, no stream may be cut.

Real `fleet up`, router and `fleet.enginesim` engine processes (`engine.kind: sim`; no vLLM, no model).
One replica per revision fits a 2-core machine (the canary is a surge replica). Each test prints
its figures; docs/benchmarks.md records them ("Canary rollouts in the trace simulator").
"""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from tests.support.load import StreamedLoad

MODEL = "llama-8b-rollout"

# The default checks with a noise floor: the simulated TTFT is ~10 ms and TPOT a few ms, where a
# busy 2-core CI machine adds several ms of scheduling delay to one side's p99 (a p99 of 20
# samples is their maximum). A limit is the larger of stable x ratio and stable + increase
# (rollout/spec.py MetricCheck), so identical revisions pass and a 5x slower one still fails.
CHECKS = [
    {"metric": "ttftP99", "maxRatioToStable": 1.2, "maxIncreaseOverStable": 0.015},
    {"metric": "tpotP99", "maxRatioToStable": 1.1, "maxIncreaseOverStable": 0.005},
    {"metric": "tpotP50", "maxRatioToStable": 1.1, "maxIncreaseOverStable": 0.005},
    {"metric": "errorRate", "maxIncreaseOverStable": 0.005},
]


def write(tmp_path: Path, revision: str = "v1", slowdown: float | None = None) -> Path:
    args = ["--seed", "1", "--startup-delay-s", "1", "--mean-output-tokens", "32"]
    if slowdown is not None:
        args += ["--slowdown", str(slowdown)]
    doc = {
        "apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": "sim-rollout"},
        "spec": {
            "model": {"name": MODEL, "source": "sim://h100-llama-8b", "revision": revision},
            "engine": {"kind": "sim", "args": args, "startupTimeoutSeconds": 120},
            "resources": {"accelerator": "cpu"},
            "replicas": {"min": 1, "max": 1},
            "warmup": {"requests": [{"kind": "completion", "prompt": "warm", "maxTokens": 8}]},
            "rollout": {
                "strategy": "canary",
                "steps": [{"weight": 25}, {"analysis": {}}, {"weight": 50}, {"analysis": {}}],
                "analysis": {"intervalSeconds": 12, "minSamplesPerSide": 20, "excludeAfterReadySeconds": 2,
                             "failureLimit": 1, "metrics": CHECKS},
            },
        },
    }  # fmt: skip
    f = tmp_path / "rollout.yaml"
    f.write_text(yaml.safe_dump(doc))
    return f


def rollout(fleet) -> dict:
    revs = fleet.state().get("deployments", {}).get("sim-rollout", {}).get("revisions") or {}
    return revs.get("rollout") or {}


def replicas_by_revision(fleet) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in fleet.replicas().values():
        out.setdefault(r["revision"], []).append(r["status"])
    return out


def test_a_good_canary_is_promoted_with_every_request_answered(sim_fleet_up, tmp_path):
    f = write(tmp_path)
    fleet = sim_fleet_up([f])
    fleet.wait_for("1 replica READY", lambda: replicas_by_revision(fleet) == {"v1": ["READY"]}, timeout_s=120)
    with StreamedLoad(fleet.router_url, MODEL) as load:
        load.wait_for_more(24, "streamed load on v1 before the apply")
        applied = fleet.cli("apply", str(write(tmp_path, revision="v2")))
        assert applied.returncode == 0 and "canary rollout of v2@" in applied.stdout, applied.stdout + applied.stderr
        started = time.monotonic()
        fleet.wait_for("the canary at 25 %", lambda: rollout(fleet).get("weight") == 25, timeout_s=60)
        fleet.wait_for("the promotion", lambda: rollout(fleet).get("phase") == "Promoted", timeout_s=150)
        took_s = time.monotonic() - started
        fleet.wait_for("v1 gone", lambda: replicas_by_revision(fleet).get("v2") == ["READY"]
                       and "READY" not in replicas_by_revision(fleet).get("v1", []), timeout_s=60)
        load.wait_for_more(16, "streamed load on the promoted v2")
    status = fleet.cli("rollout", "status", "sim-rollout")
    assert status.returncode == 0 and "stable  v2@" in status.stdout, status.stdout
    assert [r["verdict"] for r in rollout(fleet)["runs"]].count("pass") == 2
    assert load.failed == [], load.failed[:10]
    print(f"\nFIGURE canary promoted: {len(load.results)} streamed requests at {load.rate_per_s:g}/s during "
          f"the rollout, {len(load.failed)} failed or cut; applied to promoted in {took_s:.0f} s")
    assert fleet.interrupt() == 0


def test_a_slowed_canary_is_rolled_back_with_no_failed_request_and_no_cut_stream(sim_fleet_up, tmp_path):
    f = write(tmp_path)
    fleet = sim_fleet_up([f])
    fleet.wait_for("1 replica READY", lambda: replicas_by_revision(fleet) == {"v1": ["READY"]}, timeout_s=120)
    with StreamedLoad(fleet.router_url, MODEL) as load:
        load.wait_for_more(24, "streamed load on v1 before the apply")
        applied = fleet.cli("apply", str(write(tmp_path, slowdown=5.0)))
        assert applied.returncode == 0, applied.stdout + applied.stderr
        started = time.monotonic()
        fleet.wait_for("the roll back", lambda: rollout(fleet).get("phase") == "RolledBack", timeout_s=150)
        took_s = time.monotonic() - started
        fleet.wait_for("the canary stopped", lambda: sorted(sum(replicas_by_revision(fleet).values(), []))
                       == ["READY", "TERMINATED"], timeout_s=60)
        load.wait_for_more(16, "streamed load on v1 after the roll back")
    ro = rollout(fleet)
    assert ro["weight"] == 0 and "failed analysis runs" in ro["reason"]
    assert len(ro["runs"]) <= 4                       # within the analysis windows: two failures decide
    again = fleet.cli("apply", str(write(tmp_path, slowdown=5.0)))
    assert "was rolled back; not retried" in again.stdout, again.stdout
    assert load.failed == [], load.failed[:10]
    print(f"\nFIGURE slowed canary rolled back: {len(load.results)} streamed requests at {load.rate_per_s:g}/s, "
          f"{len(load.failed)} failed or cut; applied to rolled back in {took_s:.0f} s "
          f"({len(ro['runs'])} analysis runs)")
    assert fleet.interrupt() == 0
