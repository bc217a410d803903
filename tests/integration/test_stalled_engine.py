"""No request waits on a stalled engine: `fleet up` with two replicas of the engine SIMULATOR, one of
them stalled under a streamed open-loop load (its engine stops stepping while its `/health` still
answers 200: the simulator's `stall` fault, fleet/enginesim/faults.py). Through the real router:
every request is served by the other replica within the first-token deadline plus one retry, none
that had not started streaming fails (one the engine stalled in mid-stream is cut with an error
event), the stalled replica is ejected (metrics, `fleet status`), the requests it held are aborted
there, and it gets traffic again once it recovers and its ejection is over.

Prints its figures (requests, slowest time to first byte, stalled attempts, seconds until the
replica was back); docs/routing.md records them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

import aiohttp

from tests.support.fleet_up import all_ready, stop_cleanly
from tests.support.waits import wait_until

MODEL = "llama-8b-sim"
DEADLINE_S = 1.0          # routing.firstTokenTimeoutSeconds
BASE_EJECTION_S = 30.0    # router.pools.outlier's default (Envoy's base_ejection_time)


def write_fleet(tmp_path: Path) -> Path:
    doc = {
        "apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": "sim-chat"},
        "spec": {
            "model": {"name": MODEL, "source": "sim://h100-llama-8b"},
            "engine": {"kind": "sim", "args": ["--seed", "1"], "startupTimeoutSeconds": 120},
            "resources": {"accelerator": "cpu"},
            "replicas": {"min": 2, "max": 2},
            "routing": {"policy": "round-robin", "firstTokenTimeoutSeconds": DEADLINE_S},
            "warmup": {"requests": [{"kind": "completion", "prompt": "warm", "maxTokens": 4}],
                       "requestTimeoutSeconds": 60},
        },
    }  # fmt: skip
    f = tmp_path / "sim-fleet.yaml"
    f.write_text(yaml.safe_dump(doc))
    return f


class TimedLoad:
    """Streamed completions at `rate_per_s`, open loop, in a thread: `results` holds
    `(sent_s, outcome, time to first body byte s)`; outcome "ok" for a stream that ended with
    `data: [DONE]`, "cut" for one that ended with the router's error event, else the status or the
    client error's name."""

    def __init__(self, url: str, rate_per_s: float = 10.0) -> None:
        self.url, self.rate_per_s = url, rate_per_s
        self.results: list[tuple[float, str, float | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> TimedLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    async def _run(self) -> None:
        body = {"model": MODEL, "prompt": "hello " * 20, "max_tokens": 16, "stream": True}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            async def one() -> None:
                sent = time.monotonic()
                first: float | None = None
                try:
                    async with session.post(f"{self.url}/v1/completions", json=body) as r:
                        data = b""
                        async for chunk in r.content.iter_any():
                            first = first if first is not None else time.monotonic() - sent
                            data += chunk
                        ended = r.status == 200 and data.rstrip().endswith(b"data: [DONE]")
                        outcome = ("cut" if b'"error"' in data else "ok") if ended else str(r.status)
                except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                    outcome = type(err).__name__
                self.results.append((sent, outcome, first))

            tasks: set[asyncio.Task] = set()
            next_s = time.monotonic()
            while not self._stop.is_set():
                task = asyncio.create_task(one())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                next_s += 1.0 / self.rate_per_s
                await asyncio.sleep(max(0.0, next_s - time.monotonic()))
            if tasks:
                await asyncio.wait(tasks, timeout=30)


def router_counter(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def test_a_stalled_engine_delays_no_request_past_the_deadline_and_one_retry(sim_fleet_up, tmp_path):
    fleet = sim_fleet_up([write_fleet(tmp_path)])
    fleet.wait_for("2 replicas READY", lambda: all_ready(fleet, 2), timeout_s=120)
    replicas = fleet.replicas()
    stalled_id, other_id = sorted(replicas)
    stalled_url = replicas[stalled_id]["endpoint"]
    with TimedLoad(fleet.router_url) as load:
        wait_until(lambda: len(load.results) >= 20, 60, what="20 requests before the stall")
        r = httpx.post(f"{stalled_url}/sim/faults", json={"stall": True}, timeout=5)
        assert r.json()["stall"] is True
        stalled_at = time.monotonic()
        assert httpx.get(f"{stalled_url}/health", timeout=5).status_code == 200   # it still looks healthy
        wait_until(lambda: len([x for x in load.results if x[0] > stalled_at + 1]) >= 60, 60,
                   what="60 requests answered after the stall began")
        # The requests it held were given up by the router: the engine aborted them.
        state = httpx.get(f"{stalled_url}/sim/state", timeout=5).json()
        assert state["stalled"] and state["running"] + state["waiting"] == 0, state
        status = fleet.cli("status")
        assert "ejected by the router" in status.stdout and "no first token" in status.stdout, status.stdout
        answered_before = state["answered"]
        httpx.post(f"{stalled_url}/sim/faults", json={"stall": False}, timeout=5)
        back = wait_until(lambda: httpx.get(f"{stalled_url}/sim/state", timeout=5).json()["answered"]
                          > answered_before, BASE_EJECTION_S + 30, interval_s=0.2, what="the replica serving again")
        back_after_s = time.monotonic() - stalled_at
        assert back
    during = [x for x in load.results if x[0] >= stalled_at]
    # A stream the engine stalled in after its first tokens is cut (an error event, then [DONE]):
    # allowed; a request that had not started streaming must never fail.
    failed = [x for x in load.results if x[1] != "ok" and not (x[1] == "cut" and x[2] is not None)]
    cut = [x for x in load.results if x[1] == "cut"]
    slowest = max(x[2] for x in during if x[2] is not None)
    slow = [x for x in load.results if x[2] is not None and x[2] > DEADLINE_S]
    timeouts = router_counter(fleet.router_url, "fleet_router_first_token_timeouts_total", endpoint=stalled_id)
    ejections = router_counter(fleet.router_url, "fleet_router_endpoint_ejections_total", endpoint=stalled_id,
                               reason="stall")  # fmt: skip
    retries = router_counter(fleet.router_url, "fleet_router_retries_total", model=MODEL)
    print(f"\nstalled engine: {len(load.results)} requests ({len(during)} after the stall began), "
          f"{len(failed)} failed before streaming, {len(cut)} cut mid-stream; slowest time to first byte {slowest:.2f} s (deadline {DEADLINE_S:g} s); "
          f"{len(slow)} request(s) waited out the deadline; {timeouts:g} first-token timeouts, {retries:g} retries, "
          f"{ejections:g} ejection(s); back in service {back_after_s:.1f} s after the stall began")
    assert failed == []
    assert slowest < DEADLINE_S + 1.0            # the deadline plus one retry on the healthy replica
    assert ejections == 1 and timeouts >= 2 and retries >= timeouts
    assert len(slow) <= timeouts                  # only the attempts that met the stall paid for it
    assert back_after_s >= BASE_EJECTION_S        # ejected until its ejection ended
    assert other_id in fleet.replicas()
    stop_cleanly(fleet, fleet.state_dir)
