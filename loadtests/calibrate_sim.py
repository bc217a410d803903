"""Calibrate the engine SIMULATOR's step cost against real vLLM on this machine.

Starts real vLLM (CPU build) on the tiny generated Llama model, measures time to first token
(TTFT) and time per output token (TPOT) over a grid of prompt lengths x batch sizes, stops it,
then fits the simulator's per-step cost (`fleet.enginesim.cost.StepCost`, linear form) by
least squares and prints the fit and its error, cell by cell, in-sample and on held-out cells.

How a cell is measured: one `/v1/completions` request whose `prompt` is a batch of B prompts
of exactly P token ids each (random ids, so no prefix is shared), `max_tokens` M, `ignore_eos`:
vLLM admits the B sequences together, as the model assumes. TTFT and TPOT are the means over
the cell's requests from vLLM's own `vllm:time_to_first_token_seconds` and
`vllm:inter_token_latency_seconds` histograms (sum and count, scraped before and after): the
engine's timestamps. Client-side stream timing cannot resolve single steps here: on 2 shared
cores the API server forwards tokens in bursts. Each cell runs `--reps` times; the median per
cell is fitted.

How it is fitted: with every request arriving at t = 0, the simulator's schedule does not
depend on step durations, so each request's TTFT is a sum of step costs over a known list of
steps, linear in the cost parameters. The script replays each cell through
`fleet.enginesim.model.EngineModel` with the profile's scheduler config, sums each step's feature
vector up to the first token (TTFT, plus one admission time) and over the decode
(TPOT / (M - 1)), and solves non-negative least squares on relative error. Held-out cells
and the prefix-cache cell (the same long prompt twice) are reported, not fitted.

Run it under the machine's heavy lock; it refuses otherwise:

    flock /tmp/fleet-heavy.lock .venv/bin/python loadtests/calibrate_sim.py \\
        --vllm-python .venv/bin/python --model examples/models/tiny-llama

`--from-json FILE` refits saved measurements without starting vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fleet.enginesim.cost import StepCost  # noqa: E402
from fleet.enginesim.model import Arrival, EngineModel, run_virtual  # noqa: E402
from fleet.enginesim.profiles import get_profile  # noqa: E402

LOCK = "/tmp/fleet-heavy.lock"
FIT_CELLS = [(p, b) for p in (8, 64, 256, 512, 960) for b in (1, 4, 16, 64)]
HELD_OUT = [(128, 8), (384, 32), (32, 128), (700, 2)]
VOCAB = 2000          # the tiny model's tokenizer has 2,048 ids


def lock_is_held() -> bool:
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


# ----- measuring real vLLM --------------------------------------------------------------

def start_vllm(python: str, model: str, port: int, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "tiny-llama",
            "--enforce-eager", "--max-model-len", "1024", "--gpu-memory-utilization", "0.15", "--port", str(port)]  # fmt: skip
    log = open(log_path, "wb")
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the group
        except (subprocess.TimeoutExpired, ProcessLookupError):
            continue
        return


def wait_health(port: int, proc: subprocess.Popen, timeout_s: float = 240) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("vLLM did not become healthy")


def scrape(url: str) -> dict[str, float]:
    """Sum and count of vLLM's TTFT and inter-token-latency histograms."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"):
            for suffix in ("_sum", "_count"):
                if line.startswith(name + suffix + "{"):
                    out[name + suffix] = float(line.rsplit(" ", 1)[1])
    return out


async def run_cell(session, url: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, float]:
    """(mean TTFT, mean inter-token latency, client wall time) of one batched request, TTFT and
    ITL from vLLM's own histograms (engine-side timestamps; client-side streaming arrives in
    bursts on 2 shared cores and cannot resolve single steps)."""
    before = await asyncio.to_thread(scrape, url)
    body = {"model": "tiny-llama", "prompt": prompts if len(prompts) > 1 else prompts[0], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0.0}  # fmt: skip
    t0 = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        await resp.read()
    wall = time.perf_counter() - t0
    after = await asyncio.to_thread(scrape, url)

    def mean(name: str) -> float:
        n = after[name + "_count"] - before.get(name + "_count", 0.0)
        return (after[name + "_sum"] - before.get(name + "_sum", 0.0)) / n

    return mean("vllm:time_to_first_token_seconds"), mean("vllm:inter_token_latency_seconds"), wall


async def measure(url: str, reps: int, max_tokens: int, seed: int) -> dict:
    import aiohttp

    rng = random.Random(seed)

    def prompts(p: int, b: int) -> list[list[int]]:
        return [[rng.randrange(10, VOCAB) for _ in range(p)] for _ in range(b)]

    results: dict[str, dict] = {}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        for _ in range(3):  # warm-up
            await run_cell(s, url, prompts(64, 4), max_tokens)
        for p, b in FIT_CELLS + HELD_OUT:
            runs = [await run_cell(s, url, prompts(p, b), max_tokens) for _ in range(reps)]
            ttft = statistics.median(r[0] for r in runs)
            tpot = statistics.median(r[1] for r in runs)
            wall = statistics.median(r[2] for r in runs)
            results[f"{p}x{b}"] = {"prompt": p, "batch": b, "ttft_s": ttft, "tpot_s": tpot, "client_wall_s": wall}
            print(f"  P={p:4d} B={b:3d}: TTFT {ttft * 1e3:8.1f} ms  TPOT {tpot * 1e3:6.2f} ms  "
                  f"(client: whole request {wall * 1e3:7.1f} ms)", flush=True)  # fmt: skip
        # Prefix cache: the same long prompt twice, one after the other.
        long_prompt = prompts(960, 1)
        cold = (await run_cell(s, url, long_prompt, max_tokens))[0]
        warm = statistics.median([(await run_cell(s, url, long_prompt, max_tokens))[0] for _ in range(reps)])
        results["prefix"] = {"prompt": 960, "batch": 1, "cold_ttft_s": cold, "warm_ttft_s": warm}
        print(f"  prefix P=960: cold TTFT {cold * 1e3:.1f} ms, repeated {warm * 1e3:.1f} ms", flush=True)
    return results


# ----- fitting --------------------------------------------------------------------------

def cell_vectors(p: int, b: int, max_tokens: int, profile_name: str) -> tuple[np.ndarray, np.ndarray]:
    """Mean TTFT and TPOT feature vectors of a cell (B prompts of P distinct tokens at t=0)."""
    profile = get_profile(profile_name)
    model = EngineModel(profile.config, StepCost(fixed_s=1.0))  # any cost: the schedule ignores it
    rng = random.Random(p * 1000 + b)
    for i in range(b):
        model.add_request(f"r{i}", [rng.randrange(10, 10**6) for _ in range(p)], max_tokens, 0.0)
    steps: list[np.ndarray] = []
    first_step: dict[str, int] = {}
    last_step: dict[str, int] = {}
    t = 0.0
    while model.has_work():
        res = model.step(t)
        t = res.end_s
        steps.append(np.array(res.features.vector()))
        for rid, idx in res.emitted.items():
            if idx == 0:
                first_step[rid] = len(steps) - 1
            last_step[rid] = len(steps) - 1
    cum = np.cumsum(np.array(steps), axis=0)
    ttft = np.mean([cum[first_step[r]] for r in first_step], axis=0)
    tpot = np.mean([(cum[last_step[r]] - cum[first_step[r]]) / (max_tokens - 1) for r in first_step], axis=0)
    # Last column: admission time (StepCost.admission_s), in every TTFT and in no TPOT.
    return np.append(ttft, 1.0), np.append(tpot, 0.0)


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares by dropping negative coefficients and refitting."""
    active = list(range(a.shape[1]))
    while True:
        theta_a, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if (theta_a >= 0).all():
            theta = np.zeros(a.shape[1])
            theta[active] = theta_a
            return theta
        active.pop(int(np.argmin(theta_a)))


def fit(results: dict, max_tokens: int, profile_name: str) -> tuple[StepCost, list[dict]]:
    rows, targets, keys = [], [], []
    vecs = {}
    for key, r in results.items():
        if key == "prefix":
            continue
        vecs[key] = cell_vectors(r["prompt"], r["batch"], max_tokens, profile_name)
    for (p, b) in FIT_CELLS:
        key = f"{p}x{b}"
        if key not in results:
            continue
        ttft_v, tpot_v = vecs[key]
        r = results[key]
        for v, y in ((ttft_v, r["ttft_s"]), (tpot_v, r["tpot_s"])):
            rows.append(v / y)    # relative error: divide the row and the target by the measurement
            targets.append(1.0)
        keys.append(key)
    theta = nnls(np.array(rows), np.array(targets))
    cost = StepCost.from_vector(theta[:5], admission_s=theta[5])
    report = []
    for key, r in results.items():
        if key == "prefix":
            continue
        ttft_v, tpot_v = vecs[key]
        report.append({
            "cell": key, "held_out": (r["prompt"], r["batch"]) in HELD_OUT,
            "ttft_s": r["ttft_s"], "ttft_pred_s": float(ttft_v @ theta),
            "tpot_s": r["tpot_s"], "tpot_pred_s": float(tpot_v @ theta),
        })
    return cost, report


def prefix_prediction(profile_name: str, cost: StepCost, max_tokens: int) -> tuple[float, float]:
    """Simulated TTFT of a 960-token prompt, cold and then repeated."""
    model = EngineModel(get_profile(profile_name).config, cost)
    prompt = list(range(100, 1060))
    cold = run_virtual(model, [Arrival(0.0, "cold", prompt, max_tokens)])[0]
    warm = run_virtual(model, [Arrival(100.0, "warm", prompt, max_tokens)], start_s=100.0)[0]
    return cold.ttft_s, warm.ttft_s


def print_report(cost: StepCost, report: list[dict], results: dict, profile_name: str, max_tokens: int) -> dict:
    print("\nFitted StepCost (linear; seconds):")
    for k, v in vars(cost).items():
        print(f"  {k} = {v:.6g}")
    print(f"\n{'cell PxB':>10} {'TTFT meas':>10} {'pred':>9} {'err':>7}   {'TPOT meas':>10} {'pred':>9} {'err':>7}")
    summary = {}
    for group in (False, True):
        errs_ttft, errs_tpot = [], []
        for r in report:
            if r["held_out"] != group:
                continue
            e1 = (r["ttft_pred_s"] - r["ttft_s"]) / r["ttft_s"]
            e2 = (r["tpot_pred_s"] - r["tpot_s"]) / r["tpot_s"]
            errs_ttft.append(abs(e1))
            errs_tpot.append(abs(e2))
            print(f"{r['cell']:>10} {r['ttft_s'] * 1e3:9.1f}ms {r['ttft_pred_s'] * 1e3:8.1f}ms {e1:+7.1%}   "
                  f"{r['tpot_s'] * 1e3:9.2f}ms {r['tpot_pred_s'] * 1e3:8.2f}ms {e2:+7.1%}"
                  + ("  (held out)" if group else ""))  # fmt: skip
        if errs_ttft:
            name = "held-out" if group else "in-sample"
            summary[name] = {"ttft_mape": float(np.mean(errs_ttft)), "ttft_max_err": float(max(errs_ttft)),
                             "tpot_mape": float(np.mean(errs_tpot)), "tpot_max_err": float(max(errs_tpot)),
                             "cells": len(errs_ttft)}  # fmt: skip
            print(f"  {name}: TTFT mean |err| {np.mean(errs_ttft):.1%} (max {max(errs_ttft):.1%}), "
                  f"TPOT mean |err| {np.mean(errs_tpot):.1%} (max {max(errs_tpot):.1%}) over {len(errs_ttft)} cells")
    if "prefix" in results:
        cold_p, warm_p = prefix_prediction(profile_name, cost, max_tokens)
        pr = results["prefix"]
        print(f"\nPrefix cache, P=960 twice: measured TTFT {pr['cold_ttft_s'] * 1e3:.1f} -> {pr['warm_ttft_s'] * 1e3:.1f} ms, "
              f"simulated {cold_p * 1e3:.1f} -> {warm_p * 1e3:.1f} ms")  # fmt: skip
        summary["prefix"] = {**pr, "cold_pred_s": cold_p, "warm_pred_s": warm_p}
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=".venv/bin/python")
    ap.add_argument("--model", default="examples/models/tiny-llama")
    ap.add_argument("--port", type=int, default=8311)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--profile", default="cpu-tiny-llama", help="Scheduler config the fit replays.")
    ap.add_argument("--out", default=str(REPO / "loadtests" / "results" / "calibrate-cpu-tiny-llama.json"))
    ap.add_argument("--from-json", default=None, help="Refit saved measurements; do not start vLLM.")
    ap.add_argument("--save", action="store_true", help="With --from-json: write the new fit back into that file.")
    args = ap.parse_args()

    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        results, meta = saved["measurements"], saved.get("meta", {})
    else:
        if not lock_is_held():
            print(f"Run me under the machine's heavy lock: flock {LOCK} {' '.join(sys.argv)}", file=sys.stderr)
            return 2
        log_path = Path(args.out).with_suffix(".vllm.log")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        proc = start_vllm(args.vllm_python, args.model, args.port, log_path)
        try:
            startup_s = wait_health(args.port, proc)
            print(f"real vLLM healthy after {startup_s:.1f} s; measuring (M={args.max_tokens}, reps={args.reps})",
                  flush=True)  # fmt: skip
            results = asyncio.run(measure(f"http://127.0.0.1:{args.port}", args.reps, args.max_tokens, args.seed))
        finally:
            stop(proc)
        meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{os.cpu_count()} cores", "startup_s": startup_s,
                "vllm": "0.32.0 (CPU build)", "max_tokens": args.max_tokens, "reps": args.reps}  # fmt: skip
    cost, report = fit(results, args.max_tokens, args.profile)
    summary = print_report(cost, report, results, args.profile, args.max_tokens)
    out = args.from_json if args.from_json and args.save else None if args.from_json else args.out
    if out:
        Path(out).write_text(json.dumps({"meta": meta, "measurements": results, "fit": vars(cost),
                                         "report": report, "summary": summary}, indent=1))  # fmt: skip
        print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
