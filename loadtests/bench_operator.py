"""The operator at scale, against the API-server STAND-IN (fleet/testing/k8s/apiserver.py): how long from
InferenceDeployments applied to their pods created, for 1, 100 and 1,000 deployments of 10
replicas (10 to 10,000 pods), how long one change takes to reach its pod with all of them
running (the median of ``--changes`` edits of different deployments, and the slowest), the
operator's memory, and watch events handled per second (during the run, and for a burst of up
to 2,000 pod updates written at once: the informer's throughput).

Against the Lease (15 s, renew deadline 10 s: the chart's defaults): the worst reconcile tick of
the whole run (`fleet_operator_longest_reconcile_seconds`), the longest time the operator's event
loop was held (`fleet_operator_longest_event_loop_stall_seconds`) and the longest gap between two
renewals of the Lease (`fleet_operator_longest_lease_renewal_gap_seconds`; renewals run on a
thread of their own, every 2 s); the run fails when the worst tick or the longest renewal gap
reaches the renew deadline.

The operator is the real `fleet operator` process with the real `kubernetes` client; the API
server is the stand-in (one aiohttp process: this one), so the figures include the stand-in's
own cost and are not a real API server's. Fleet's router runs in this process too (the operator
publishes every pool to it). No kubelet runs: pods stay Pending (the figures are
the operator's: decide, place, create, write status and events). Nodes: 100 CPU nodes of 128
cores, labelled as GPU Feature Discovery would label a CPU node (no GPU labels), each listing the
engine image in ``status.images`` (so no image pre-pull runs: pods are created at once).

Usage (repository root):
    .venv/bin/python -m loadtests.bench_operator [--sizes 1,100,1000] [--replicas 10] [--changes 5] [--json-out PATH]

``BENCH_PROFILE=PATH``: the operator runs under cProfile, written to PATH.<size> when it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from fleet.k8s.client import INFERENCE_DEPLOYMENTS, NODES, PODS, KubeClient
from fleet.k8s.routerpod import serve_router_pod
from fleet.testing.k8s.apiserver import APIServerStandIn
from fleet.testing.k8s.nodes import node

REPO = Path(__file__).resolve().parents[1]
NS = "fleet"
LEASE_DURATION_S = 15.0    # charts/fleet/values.yaml operator.leaderElection
RENEW_DEADLINE_S = 10.0


def _cr(i: int, replicas: int) -> dict:
    return {
        "apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": f"d{i:04d}"},
        "spec": {"model": {"name": f"model-{i:04d}", "source": "sim://h100-llama-8b"}, "engine": {"kind": "sim"},
                 "resources": {"accelerator": "cpu", "cpuCores": 1},
                 "replicas": {"min": 1, "max": replicas + 1, "initial": replicas}},
    }  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int) -> tuple[float, float]:
    """(current RSS, peak RSS) of ``pid`` in MiB, from /proc."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


async def _metric(http: httpx.AsyncClient, url: str, name: str) -> float:
    text = (await http.get(url)).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def run_size(n: int, replicas: int, timeout_s: float, changes: int = 5) -> dict:
    api = APIServerStandIn(bookmark_every_s=5.0)
    await api.start()
    store = api.store
    for i in range(100):
        store.create(NODES, None, node(f"node-{i:03d}", cpu=128, images=["fleet:bench"]))
    tmp = Path(tempfile.mkdtemp(prefix="bench-operator-"))
    metrics_port, router_port, admin_port = _free_port(), _free_port(), _free_port()
    router_stop = asyncio.Event()
    router = asyncio.get_running_loop().create_task(
        serve_router_pod("127.0.0.1", router_port, admin_port, "t", stop=router_stop))
    env = {**os.environ, "KUBECONFIG": str(api.kubeconfig(tmp / "kubeconfig")), "FLEET_NAMESPACE": NS,
           "POD_NAME": "bench", "FLEET_ROUTER_ADMIN_TOKEN": "t", "FLEET_ROUTER_ADMIN_URL": f"http://127.0.0.1:{admin_port}",
           "FLEET_ROUTER_SELECTOR": "none", "FLEET_ENGINE_IMAGE": "fleet:bench", "FLEET_LOG_LEVEL": "WARNING",
           "PYTHONPATH": str(REPO)}  # fmt: skip
    log_path = tmp / "operator.log"
    profile = os.environ.get("BENCH_PROFILE")   # a cProfile of the operator, written when it stops (SIGTERM)
    prefix = [sys.executable, "-m", "cProfile", "-o", f"{profile}.{n}", "-m"] if profile else [sys.executable, "-m"]
    proc = subprocess.Popen([*prefix, "fleet.cli", "operator", "--tick-s", "0.5", "--metrics-port",
                             str(metrics_port), "--lease-duration-s", str(LEASE_DURATION_S), "--renew-deadline-s",
                             str(RENEW_DEADLINE_S)], env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    kube = KubeClient.for_host(api.url)
    http = httpx.AsyncClient(timeout=10)
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    loop = asyncio.get_running_loop()

    def pods_of(prefix: str | None = None) -> int:
        return sum(1 for (plural, _ns, name) in store.objects if plural == PODS.plural
                   and (prefix is None or name.startswith(prefix)))  # fmt: skip

    async def until(cond, what: str) -> float:
        start = loop.time()
        while not cond():
            if proc.poll() is not None:
                raise RuntimeError(f"operator exited: {log_path.read_text()[-2000:]}")
            if loop.time() - start > timeout_s:
                raise RuntimeError(f"timed out waiting for {what}: {log_path.read_text()[-2000:]}")
            await asyncio.sleep(0.05)
        return loop.time()

    try:
        while True:   # the operator is up and leads
            try:
                if "fleet_operator_leader 1.0" in (await http.get(metrics_url)).text:
                    break
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
        events0 = await _metric(http, metrics_url, "fleet_operator_watch_events{")
        requests0 = api.requests
        t0 = loop.time()
        sem = asyncio.Semaphore(16)

        async def create(i: int) -> None:
            async with sem:
                await kube.create(INFERENCE_DEPLOYMENTS, NS, _cr(i, replicas))

        await asyncio.gather(*(create(i) for i in range(n)))
        t_applied = loop.time()
        t_pods = await until(lambda: pods_of() >= n * replicas, f"{n * replicas} pods")

        def settled() -> bool:   # every status written: the operator has caught up
            crs = [o for (plural, _ns, _n), o in store.objects.items() if plural == INFERENCE_DEPLOYMENTS.plural]
            return all((o.get("status") or {}).get("nextIndex") == replicas for o in crs)

        t_status = await until(settled, "every status")
        events = await _metric(http, metrics_url, "fleet_operator_watch_events{") - events0
        elapsed_s = t_status - t0
        rss, peak = _rss_mib(proc.pid)
        # one change at a time with everything running: one more replica of one deployment
        change_s = []
        for k in range(min(changes, n)):
            name = f"d{(k * max(1, n // changes)) % n:04d}"
            t1 = loop.time()
            await kube.patch(INFERENCE_DEPLOYMENTS, NS, name, {"spec": {"replicas": {"initial": replicas + 1}}})
            change_s.append(await until(lambda: pods_of(f"{name}-") >= replicas + 1, f"{name}'s new pod") - t1)
        tick_s = await _metric(http, metrics_url, "fleet_operator_last_reconcile_seconds")
        worst_tick_s = await _metric(http, metrics_url, "fleet_operator_longest_reconcile_seconds")
        stall_s = await _metric(http, metrics_url, "fleet_operator_longest_event_loop_stall_seconds")
        renew_gap_s = await _metric(http, metrics_url, "fleet_operator_longest_lease_renewal_gap_seconds")
        leader = "fleet_operator_leader 1.0" in (await http.get(metrics_url)).text
        # watch throughput: a burst of pod updates (a label each, written straight into the store)
        burst = min(n * replicas, 2000)
        names = sorted(name for (plural, _ns, name) in store.objects if plural == PODS.plural)[:burst]
        seen0 = await _metric(http, metrics_url, 'fleet_operator_watch_events{informer="pods"}')
        t2 = loop.time()
        for name in names:
            store.patch(PODS, NS, name, {"metadata": {"labels": {"bench": "1"}}})
        while await _metric(http, metrics_url, 'fleet_operator_watch_events{informer="pods"}') < seen0 + burst:
            if loop.time() - t2 > timeout_s:
                raise RuntimeError("the burst of pod updates was not all seen")
            await asyncio.sleep(0.05)
        burst_rate = burst / (loop.time() - t2)
        if os.environ.get("BENCH_DEBUG"):
            print((await http.get(metrics_url)).text)
        return {
            "deployments": n, "pods": n * replicas,
            "apply_s": round(t_applied - t0, 2),
            "cr_to_all_pods_s": round(t_pods - t0, 2),
            "cr_to_all_statuses_s": round(t_status - t0, 2),
            "one_change_to_pod_s": round(sorted(change_s)[len(change_s) // 2], 2),
            "one_change_to_pod_max_s": round(max(change_s), 2),
            "last_tick_s": round(tick_s, 3),
            "worst_tick_s": round(worst_tick_s, 3),
            "longest_loop_stall_s": round(stall_s, 3),
            "longest_lease_renewal_gap_s": round(renew_gap_s, 3),
            "lease_duration_s": LEASE_DURATION_S, "renew_deadline_s": RENEW_DEADLINE_S, "leader_at_end": leader,
            "operator_rss_mib": round(rss, 1), "operator_peak_rss_mib": round(peak, 1),
            "watch_events": int(events), "watch_events_per_s": round(events / elapsed_s, 1),
            "watch_burst_events": burst, "watch_burst_events_per_s": round(burst_rate, 1),
            "api_requests": api.requests - requests0,
        }
    finally:
        if profile and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        await http.aclose()
        kube.close()
        router_stop.set()
        await router
        await api.stop()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,100,1000", help="Numbers of InferenceDeployments, comma-separated.")
    ap.add_argument("--replicas", type=int, default=10, help="Replicas (pods) per deployment.")
    ap.add_argument("--changes", type=int, default=5, help="Spec edits timed one after another (median, max).")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        started = time.time()
        row = await run_size(n, args.replicas, args.timeout_s, args.changes)
        rows.append(row)
        print(json.dumps(row), f"({time.time() - started:.0f} s)", flush=True)
    cols = ["deployments", "pods", "cr_to_all_pods_s", "cr_to_all_statuses_s", "one_change_to_pod_s",
            "one_change_to_pod_max_s", "worst_tick_s", "last_tick_s", "longest_loop_stall_s",
            "longest_lease_renewal_gap_s", "operator_rss_mib", "operator_peak_rss_mib", "watch_events_per_s", "watch_burst_events_per_s", "api_requests"]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))
    for r in rows:
        if r["worst_tick_s"] >= RENEW_DEADLINE_S or r["longest_lease_renewal_gap_s"] >= RENEW_DEADLINE_S \
                or not r["leader_at_end"]:
            sys.exit(f"{r['deployments']} deployments: worst tick {r['worst_tick_s']} s, longest renewal gap "
                     f"{r['longest_lease_renewal_gap_s']} s (renew deadline {RENEW_DEADLINE_S:g} s), still the "
                     f"leader at the end: {r['leader_at_end']}")


if __name__ == "__main__":
    asyncio.run(main())
