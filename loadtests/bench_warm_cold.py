"""Time to READY of a quickstart replica on a cold node (weights not in the node's cache) and on
a warm one (weights cached), in `fleet up` on real vLLM.

    PYTHONPATH=. python loadtests/bench_warm_cold.py [--repeats 2]

Generates the quickstart's tiny model (`fleet make-tiny-model`, ~7 MB), writes its
fleet-manifest.json (`fleet cache manifest`, sha256 of every file) and serves it from
fleet/testing/hub_server.py (in a process of its own) on 127.0.0.1. The deployment is
examples/quickstart.yaml with one replica and ``spec.model.source`` the manifest's URL. Then,
``--repeats`` times: `fleet up --detach` with an empty weight cache (``FLEET_CACHE_DIR``: cold),
`fleet down`, `fleet up --detach` again on that same cache (warm), `fleet down`. Each `fleet up`
has a fresh state directory.

For each run, from `fleet status --json` (the controller's own timestamps): placement to weights
present (CACHING: manifest, download, sha256, rename into the store), placement to READY
(weights, vLLM start, /health, warm-up), and the model files the server sent (the goal on a
warm node: none). Prints each run and the medians.

The cold penalty here is a 7 MB download over loopback; for a real model add the fill time of
its size at the cache's measured throughput (loadtests/bench_cache_fill.py).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtests.bench_cache_fill import ServerProcess  # noqa: E402

FLEET = [sys.executable, "-m", "fleet.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deployment(work: Path, source: str) -> Path:
    doc = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    doc["spec"]["model"]["source"] = source
    doc["spec"]["replicas"] = {"min": 1, "max": 1}
    f = work / "tiny-chat.yaml"
    f.write_text(yaml.safe_dump(doc, sort_keys=False))
    return f


def fleet(*args: str, env: dict[str, str], timeout_s: float = 900) -> str:
    done = subprocess.run([*FLEET, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"fleet {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def one_run(dep: Path, state: Path, cache: Path, server: ServerProcess) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "FLEET_CACHE_DIR": str(cache)}
    sent_before = len(model_gets(server))
    port = free_port()
    try:
        fleet("up", "--detach", "--state-dir", str(state), "--port", str(port), "--metrics-port", "0", str(dep), env=env)
        doc = json.loads(fleet("status", "--json", "--state-dir", str(state), env=env))
    finally:
        fleet("down", "--state-dir", str(state), env=env)
    (r,) = [r for r in doc["replicas"] if r["status"] == "READY"]
    return {"weights_s": r["weights_ready_at_s"] - r["placed_at_s"], "ready_s": r["warmup_passed_at_s"] - r["placed_at_s"],
            "files_sent": len(model_gets(server)) - sent_before}  # fmt: skip


def model_gets(server: ServerProcess) -> list:
    """The GETs of model files (not of the manifest) the server logged: (method, path, Range)."""
    return [q for q in server.requests()
            if q[0] == "GET" and q[1].startswith("/static/") and not q[1].endswith("/fleet-manifest.json")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fleet-bench-warm-cold-"))
    model = work / "static" / "tiny-llama"
    subprocess.run([*FLEET, "make-tiny-model", str(model)], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    subprocess.run([*FLEET, "cache", "manifest", str(model)], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    size_mb = sum(p.stat().st_size for p in model.iterdir()) / 1e6
    print(f"model: tiny-llama, {size_mb:.1f} MB; machine: {os.cpu_count()} CPU(s), "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    runs: dict[str, list[dict]] = {"cold": [], "warm": []}
    with ServerProcess(work / "static") as server:
        dep = deployment(work, f"{server.url}/static/tiny-llama/")
        for i in range(args.repeats):
            cache = work / f"cache-{i}"
            for kind in ("cold", "warm"):
                r = one_run(dep, work / f"state-{i}-{kind}", cache, server)
                runs[kind].append(r)
                print(f"run {i + 1} {kind}: placement -> weights present {r['weights_s']:6.2f} s, "
                      f"-> READY {r['ready_s']:6.1f} s; model files sent by the server: {r['files_sent']}",
                      flush=True)  # fmt: skip
    for kind, rs in runs.items():
        print(f"median {kind}: weights present {statistics.median(r['weights_s'] for r in rs):.2f} s, "
              f"READY {statistics.median(r['ready_s'] for r in rs):.1f} s, "
              f"files sent {statistics.median(r['files_sent'] for r in rs):.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
