"""`fleet up` end to end on real vLLM (CPU build) and the generated tiny model: the quickstart
serves completions and streamed chat completions through the router, `fleet status` shows the
replicas, Ctrl-C leaves no process; a replica whose engine cannot start ends FAILED with its
reason and log lines while the other deployment keeps serving."""

from __future__ import annotations

import json

import httpx
import yaml
from openai import OpenAI

from tests.support.fleet_up import READY_TIMEOUT_S, REPO
from tests.support.waits import wait_until

QUICKSTART = REPO / "examples" / "quickstart.yaml"


def test_quickstart_serves_completions_and_streamed_chat_then_stops_cleanly(fleet_up) -> None:
    fleet = fleet_up([QUICKSTART])
    ids = ["tiny-chat-0", "tiny-chat-1"]
    fleet.wait_for("both replicas READY", lambda: all(fleet.status_of(i) == "READY" for i in ids), READY_TIMEOUT_S)
    fleet.wait_for("the all-ready line", lambda: "All 2 replica(s) READY" in fleet.output(), 30)

    # Progress output walked each replica through its lifecycle, in order.
    out = fleet.output()
    for rid in ids:
        lines = [line for line in out.splitlines() if rid in line]
        states = [s for s in ("STARTING", "WARMING", "READY") if any(f" {s} " in f" {line} " for line in lines)]
        assert states == ["STARTING", "WARMING", "READY"], lines
    # Each replica was warmed through the engine's real API before it joined the pool.
    for r in fleet.replicas().values():
        assert r["healthy_at_s"] <= r["warmup_started_at_s"] <= r["warmup_passed_at_s"]

    client = OpenAI(base_url=f"{fleet.router_url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]

    completion = client.completions.create(
        model="tiny-llama", prompt="The fleet", max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 12
    assert completion.choices[0].text

    stream = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "Say hello."}], max_tokens=10,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    # Random weights emit byte-level tokens; vLLM's detokenizer holds back an incomplete UTF-8
    # sequence and sends it with the next token, so 10 tokens arrive in 2..10 content chunks.
    # More than one chunk means the stream was relayed, not buffered into one blob (chunk
    # timing itself is checked in tests/unit/test_router_proxy.py).
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) >= 2, chunks
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10

    # Both replicas are in the router's pool and the router measured them.
    pools = httpx.get(f"{fleet.router_url}/admin/v1/pools",
                      headers={"Authorization": f"Bearer {fleet.admin_token()}"}).json()["pools"]
    assert sorted(e["id"] for e in pools["tiny-llama"]["endpoints"]) == ids
    assert sum(e["requests_total"] for e in pools["tiny-llama"]["endpoints"]) >= 2
    metrics = httpx.get(f"{fleet.router_url}/metrics").text
    assert 'fleet_router_requests_total{code="200",endpoint="tiny-chat-' in metrics

    status = fleet.cli("status")
    assert status.returncode == 0, status.stderr
    for rid in ids:
        row = next(line for line in status.stdout.splitlines() if rid in line)
        assert "READY" in row and "http://127.0.0.1:" in row and "cpu:" in row, row
    as_json = json.loads(fleet.cli("status", "--json").stdout)
    assert as_json["running"] is True
    assert {r["assignment"] for r in as_json["replicas"]} == {"cpu:0", "cpu:1"}

    engine_pids = [int(r["detail"]["pid"]) for r in fleet.replicas().values()]
    assert fleet.interrupt() == 0
    assert fleet.leftover_pids() == [], f"processes left behind: {fleet.leftover_pids()}"
    assert all(pid in fleet.seen_pids for pid in engine_pids)
    assert "TERMINATED" in fleet.output() and "Stopped." in fleet.output()
    after = fleet.cli("status")
    assert "not running" in after.stdout


def test_replica_that_cannot_start_fails_with_reason_while_the_other_keeps_serving(fleet_up, tmp_path, tiny_model) -> None:
    # A directory that exists (so the spec and preflight accept it) but is not a model: the
    # engine itself fails at start, as with a wrong path inside a mounted volume.
    broken = tmp_path / "not-a-model"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    common = {
        "engine": {"kind": "vllm", "args": ["--enforce-eager", "--max-model-len", "512",
                                            "--gpu-memory-utilization", "0.15"],
                   "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
        "resources": {"accelerator": "cpu", "cpuCores": 1},
        "replicas": {"min": 1, "max": 1},
        "warmup": {"requests": [{"kind": "completion", "maxTokens": 4}]},
    }
    docs = [
        {"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
         "metadata": {"name": "good"}, "spec": {"model": {"name": "good", "source": str(tiny_model)}, **common}},
        {"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
         "metadata": {"name": "broken"}, "spec": {"model": {"name": "broken", "source": str(broken)}, **common}},
    ]
    spec_file = tmp_path / "two.yaml"
    spec_file.write_text(yaml.safe_dump_all(docs))

    fleet = fleet_up([spec_file])
    fleet.wait_for("broken-0 FAILED_START", lambda: fleet.status_of("broken-0") == "FAILED_START", READY_TIMEOUT_S)
    fleet.wait_for("good-0 READY", lambda: fleet.status_of("good-0") == "READY", READY_TIMEOUT_S)

    failed = fleet.replicas()["broken-0"]
    assert "engine exited with code" in failed["failure"]["reason"]
    assert failed["failure"]["log_tail"], "the engine's last log lines are kept with the failure"
    assert any("no-such-architecture" in line or "Error" in line for line in failed["failure"]["log_tail"])

    # The healthy deployment keeps serving after its neighbour failed.
    for _ in range(3):
        r = httpx.post(f"{fleet.router_url}/v1/completions", timeout=120,
                       json={"model": "good", "prompt": "still here", "max_tokens": 4})
        assert r.status_code == 200, r.text
    # The broken model has a pool with no ready endpoint: 503 with Retry-After, not a hang.
    r = httpx.post(f"{fleet.router_url}/v1/completions", json={"model": "broken", "prompt": "x"}, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"]

    status = fleet.cli("status")
    assert "FAILED_START" in status.stdout
    assert "engine exited with code" in status.stdout
    assert "last engine log lines" in status.stdout
    # `fleet up` printed the failure and the engine's last lines as it happened.
    assert "FAILED_START" in fleet.output() and "last engine log lines" in fleet.output()

    down = fleet.cli("down")
    assert down.returncode == 0, down.stdout + down.stderr
    fleet.proc.wait(timeout=60)
    wait_until(lambda: not fleet.leftover_pids(), 60, interval_s=0.1, what="the processes `fleet up` started to be gone")
    assert fleet.leftover_pids() == []
