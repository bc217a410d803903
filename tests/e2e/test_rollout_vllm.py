"""A canary rollout end to end on real vLLM (CPU build) and the generated tiny model: `fleet up`
with two replicas, the file's `spec.model.revision` changed and handed over with `fleet apply`,
the canary replica starts and warms (in place of a stable one: `rollout.surge: false`, as two
replicas fill a 2-core machine), the weight steps to 50 %, analysis passes, it is promoted, and
every streamed request during the rollout is answered (counted). Needs vLLM, as
`test_fleet_up.py` does."""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from tests.support.fleet_up import READY_TIMEOUT_S
from tests.support.load import StreamedLoad


def write(tmp_path: Path, tiny_model: Path, revision: str) -> Path:
    doc = {
        "apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": "tiny-rollout"},
        "spec": {
            "model": {"name": "tiny-llama", "source": str(tiny_model), "revision": revision},
            "engine": {"kind": "vllm", "args": ["--enforce-eager", "--max-model-len", "1024",
                                                "--gpu-memory-utilization", "0.15"],
                       "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}, "startupTimeoutSeconds": 600},
            "resources": {"accelerator": "cpu", "cpuCores": 1},
            "replicas": {"min": 2, "max": 2},
            "warmup": {"requests": [{"kind": "completion", "maxTokens": 4}], "requestTimeoutSeconds": 120},
            "rollout": {
                "strategy": "canary", "surge": False,
                "steps": [{"weight": 50}, {"analysis": {}}],
                # Two replicas sharing two busy cores: judge errors strictly, latency loosely.
                "analysis": {"intervalSeconds": 20, "minSamplesPerSide": 10, "excludeAfterReadySeconds": 5,
                             "failureLimit": 2, "metrics": [
                                 {"metric": "errorRate", "maxIncreaseOverStable": 0.005},
                                 {"metric": "ttftP99", "maxRatioToStable": 3.0, "maxIncreaseOverStable": 0.5}]},
            },
        },
    }  # fmt: skip
    f = tmp_path / "tiny-rollout.yaml"
    f.write_text(yaml.safe_dump(doc))
    return f


def test_a_new_revision_is_canaried_and_promoted_on_real_vllm_with_every_request_answered(fleet_up, tmp_path,
                                                                                         tiny_model):  # fmt: skip
    fleet = fleet_up([write(tmp_path, tiny_model, "v1")])
    ids = ["tiny-rollout-0", "tiny-rollout-1"]
    fleet.wait_for("both replicas READY", lambda: all(fleet.status_of(i) == "READY" for i in ids), READY_TIMEOUT_S)

    def rollout() -> dict:
        revs = fleet.state().get("deployments", {}).get("tiny-rollout", {}).get("revisions") or {}
        return revs.get("rollout") or {}

    with StreamedLoad(fleet.router_url, "tiny-llama", rate_per_s=2.0, max_tokens=8) as load:
        load.wait_for_more(6, "streamed load on v1 before the apply")
        applied = fleet.cli("apply", str(write(tmp_path, tiny_model, "v2")))
        assert applied.returncode == 0 and "canary rollout of v2@" in applied.stdout, applied.stdout + applied.stderr
        started = time.monotonic()
        fleet.wait_for("the canary at 50 %", lambda: rollout().get("weight") == 50, READY_TIMEOUT_S)
        fleet.wait_for("the promotion", lambda: rollout().get("phase") == "Promoted", 300)
        took_s = time.monotonic() - started
        fleet.wait_for("two v2 replicas READY", lambda: [r["status"] for r in fleet.replicas().values()
                                                         if r["revision"] == "v2"].count("READY") == 2,
                       READY_TIMEOUT_S)  # fmt: skip
        load.wait_for_more(4, "streamed load on the promoted v2")
    assert load.failed == [], load.failed[:10]
    assert "ROLLOUT promoted: every step passed" in fleet.output()
    print(f"\nFIGURE real vLLM canary promoted: {len(load.results)} streamed requests at {load.rate_per_s:g}/s "
          f"during the rollout, {len(load.failed)} failed or cut; applied to promoted in {took_s:.0f} s")
    assert fleet.interrupt() == 0
