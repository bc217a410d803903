"""Routing quality on real traces: Fleet's policies against vllm-router's, in front of the same
SIMULATED vLLM replicas, driven by the same open-loop replay of a trace.

Traces: `code` and `conv` (the Azure traces, no shared prefixes), `mooncake` (Mooncake's
FAST'25 trace: multi-turn prompts sharing 512-token blocks), or any trace file
(`fleet.tracesim.traces.load_trace`: Azure CSV, Fleet JSONL, Mooncake JSONL) with `--start-s` and
`--window-s`.

For each target, a fresh fleet of `--replicas` simulated replicas (`fleet.enginesim`, profile
`--profile`, seeded, so every target meets identical engines) is started, the router under test
is put in front of it, and a window of the trace is replayed through it open loop
(`loadtests.replay`), time-compressed so the fleet runs at `--load` of its capacity. Targets:
`fleet:<policy>` (Fleet's router, `python -m router`, one pool with that policy) and
`vllm-router:<policy>` (the Rust router from PyPI with `--policy`).

**Several routers.** `--routers N` starts N processes of each target's router in front of the
same replicas, each given the same pool (Fleet) or worker list (`vllm-router`), and the replay
sends request i to router i mod N, as a Kubernetes Service spreads connections over a
Deployment's router pods. Each router keeps its own policy state (prefix index, in-flight
counts, `cache_aware`'s tree): nothing is shared but the replicas. A target may override the
count with a suffix, `fleet:kv-aware@2`, so one and two routers run in one invocation under
the same machine conditions. Router CPU per request is summed over a target's router
processes. `--kv-events` has every replica publish its KV cache events (`--kv-events-config`)
and every Fleet router subscribe to them (the endpoints' `kv_events`), as `fleet up` sets them
up; it does not change `vllm-router` targets. A target may switch it on for itself with a ``+``
suffix (``fleet:kv-aware+kv-events``), so rows with and without events run side by side.
``+picker`` (or ``--picker``) starts one endpoint picker per target (`python -m router.picker`,
docs/routing.md "Endpoint picker") and gives every Fleet router of the target ``--picker``: the
picker follows the replicas' KV events (so they publish them) and decides every router's picks;
the routers follow no events. Router CPU per request then sums the routers
and the picker (the picker's own share is printed beside); ``--picker-profile PATH`` runs the
picker under cProfile, ``--router-profile DIR`` each Fleet router; ``--probe`` samples the
picker's and each router's response times apart (`loadtests/picker_probe.py`: where late picks
come from); ``--kill-picker-at-s T`` SIGKILLs it T seconds into the replay and starts
a new one ``--picker-down-s`` later (the failed requests column says what the routers' fallback
cost); ``--picker-drain-interval-ms`` sets the picker's drain of the KV event sockets.

**Per process.** Beside the sum, each router's and the picker's share is printed per request: CPU
(ms, from the scheduler's nanoseconds), wakeups (voluntary context switches: each is a sleep
ended), preemptions (involuntary ones: a wait for a core) and timeslices, summed over its threads
(`loadtests.procs.sched_counts`). ``--idle-s S`` measures the same per second for S seconds before
the replay, the pool given and the streams followed but no request: what the tier costs when
idle.

**Load.** One replica's capacity on this trace's request mix is measured with the simulator's
pure model in virtual time (every request of the window queued at once; completed requests per
second of makespan). The arrival-rate speedup is `load x replicas x capacity / trace rate`.

**This machine.** Every streamed token costs CPU three times over on 2 shared cores (simulated
engine, router, replayer). So that the token stream stays within `--max-token-rate` tokens/s,
every replica is uniformly slowed with the simulator's `--slowdown` factor (all step times x
factor), and the speedup follows from the slowed capacity. Both factors are printed. Latencies
are then those of an H100 fleet slowed by that factor: compare targets with each other, not with
H100 figures.

**Prefix-cache hit rate.** After each target's replay every replica's
`vllm:prefix_cache_hits_total` and `vllm:prefix_cache_queries_total` are read and summed: the
share of prompt tokens the fleet found in its prefix caches. The replicas run with
``--enable-prompt-tokens-details``, so a Fleet router also counts, per answered request, what the
engine held (`fleet_router_prefix_cache_hits_total`) beside what its policy predicted there
(`fleet_router_prefix_cache_predicted_hits_total`); their ratio over the routers is printed as
"predicted / actual hits" (1.00: the routers' view of the caches is the engines' own).

Usage:
    python -m loadtests.bench_routing --trace code [--replicas 8] [--load 0.8] \\
        [--targets fleet:round-robin,fleet:least-outstanding,fleet:latency-aware,vllm-router:round_robin,vllm-router:power_of_two,vllm-router:cache_aware]
    python -m loadtests.bench_routing --trace mooncake --load 0.9 --targets fleet:kv-aware,vllm-router:cache_aware
    python -m loadtests.bench_routing --trace mooncake --targets fleet:kv-aware,fleet:kv-aware@2 --routers 1
    python -m loadtests.bench_routing --trace mooncake --targets fleet:kv-aware,fleet:kv-aware+kv-events
Prints a table; `--json-out` writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from fleet.enginesim.model import Arrival, EngineModel, run_virtual
from fleet.enginesim.profiles import Profile, get_profile
from fleet.tracesim.workload import clip as clip_workload
from fleet.tracesim.traces import Trace, load_trace
from loadtests.procs import SimFleet, cpu_s, free_port, sched_counts, wait_http
from loadtests.replay import HttpSender, Outcome, PromptBuilder, replay, summarize_run
from loadtests.routing_faults import KV_SERIES, scrape
from loadtests.stats import summarize

REPO = Path(__file__).resolve().parent.parent
PREDICTED_SERIES = re.compile(r"^fleet_router_prefix_cache_(hits|predicted_hits)_total")
RESILIENCE_SERIES = re.compile(r"^fleet_router_(retries|first_token_timeouts|endpoint_ejections)_total")
"""What Fleet's routers did besides routing once: retries, first-token deadlines missed, ejections
(each moves a request, or the next ones, off the endpoint the policy chose)."""
PICKER_SERIES = re.compile(r"^fleet_router_picker_(picks_total|pick_seconds_bucket)")
"""The routers' picks asked of the endpoint picker, by outcome, and the round trips of the answered
ones (`router.picker.client`)."""
ENDPOINT_REQUESTS_SERIES = re.compile(r"^fleet_router_requests_total\{")
ENDPOINT_LABEL = re.compile(r'endpoint="([^"]*)"')
"""Requests each endpoint answered, from the routers' `fleet_router_requests_total{endpoint=...}`:
where the policy sent them (`requests_per_endpoint` in the summary)."""
TRACES = REPO / "loadtests" / "traces"
TRACE_FILES = {"code": TRACES / "azure-llm-2023" / "code.csv", "conv": TRACES / "azure-llm-2023" / "conv.csv",
               "mooncake": TRACES / "mooncake-fast25" / "synthetic_trace.jsonl"}
DEFAULT_WINDOWS = {"code": (480.0, 1200.0), "conv": (1200.0, 300.0),   # (start s, length s): busy stretches
                   "mooncake": (600.0, 300.0)}   # conversations are under way: their later turns reuse blocks
DEFAULT_MAX_MODEL_LEN = {"mooncake": 32768}
"""Context the replicas get for a trace (default: the profile's): Mooncake's prompts average
15k tokens (Llama 3.1 8B serves 128k); prompts beyond it are cut, as every trace's are."""
ADMIN_TOKEN = "bench-routing-admin-token"
MODEL = "bench"
DEFAULT_TARGETS = ("fleet:round-robin,fleet:least-outstanding,fleet:latency-aware,"
                   "vllm-router:round_robin,vllm-router:power_of_two,vllm-router:cache_aware")


def clip(trace: Trace, max_model_len: int) -> Trace:
    """Requests that fit the engine: prompt + output <= max_model_len (prompt cut if needed)."""
    return clip_workload(trace, max_model_len)


def replica_capacity_per_s(trace: Trace, profile: Profile, slowdown: float) -> float:
    """Completed requests per second of one replica saturated with ``trace``'s request mix
    (virtual time, simulator model)."""
    model = EngineModel(profile.config, profile.cost, slowdown=slowdown)
    prompts = PromptBuilder(seed=0, vocab_size=32000)
    arrivals = [Arrival(0.0, str(i), prompts.prompt(i, r), r.output_tokens) for i, r in enumerate(trace.requests)]
    finished = run_virtual(model, arrivals)
    return len(finished) / max(f.finished_s for f in finished)


def virtual_round_robin(trace: Trace, args, slowdown: float, profile: Profile) -> dict:
    """Reference: the same requests round-robin over `replicas` simulator models in virtual time
    (no HTTP, no router, no CPU contention). Round-robin ignores load, so each replica's share
    can be simulated on its own. If the live rows sit far above this, the machine, not the
    routing, is what was measured."""
    prompts = PromptBuilder(args.seed, 32000)
    finished = []
    for k in range(args.replicas):
        model = EngineModel(profile.config, profile.cost, slowdown=slowdown)
        finished += run_virtual(model, [Arrival(r.arrival_s, str(i), prompts.prompt(i, r), r.output_tokens)
                                        for i, r in enumerate(trace.requests) if i % args.replicas == k])
    ttft = [f.ttft_s for f in finished if f.ttft_s is not None]
    out = {"ttft_s": summarize(ttft), "e2e_s": summarize([f.e2e_s for f in finished]), "failed": 0}
    if args.ttft_slo_s is not None:
        out["within_ttft_slo"] = sum(t <= args.ttft_slo_s for t in ttft) / len(trace.requests)
    return out


TARGET_OPTIONS = ("kv-events", "picker")
"""What a target may switch on for itself with a ``+`` suffix (``fleet:kv-aware@2+picker``),
beside the run-wide ``--kv-events`` / ``--picker``: rows with and without them in one run."""


VLLM_ROUTER = Path(sys.executable).with_name("vllm-router")
"""The `vllm-router` console script of this environment (the ``bench`` extra installs it)."""


def parse_target(target: str, default_routers: int) -> tuple[str, str, int]:
    """``kind:policy[@N][+option...]`` -> (kind, policy, router processes); options are read by
    `target_options`. Raises SystemExit on a bad name."""
    name, *options = target.split("+")
    name, _, count = name.partition("@")
    kind, sep, policy = name.partition(":")
    if not sep or kind not in ("fleet", "vllm-router"):
        raise SystemExit(f"unknown target {target!r}: use fleet:<policy> or vllm-router:<policy>, optionally @N routers")
    unknown = [o for o in options if o not in TARGET_OPTIONS]
    if unknown:
        raise SystemExit(f"target {target!r}: unknown option(s) {unknown}; known: {list(TARGET_OPTIONS)}")
    routers = int(count) if count else default_routers
    if routers < 1:
        raise SystemExit(f"target {target!r}: need at least one router")
    return kind, policy, routers


def target_options(target: str, args) -> tuple[bool, bool]:
    """(KV events, endpoint picker) for ``target``: its own ``+kv-events`` / ``+picker`` or the
    run-wide flags; both only for Fleet targets. The picker follows the engines' KV events, so it
    switches them on."""
    kind, _, _ = parse_target(target, args.routers)
    options = target.split("+")[1:]
    picker = kind == "fleet" and (bool(args.picker) or "picker" in options)
    kv_events = kind == "fleet" and (bool(args.kv_events) or "kv-events" in options or picker)
    return kv_events, picker


def target_label(target: str, default_routers: int, summary: dict | None = None) -> str:
    """How a target is named in the printed rows: ``fleet:kv-aware, 2 routers, KV events, endpoint
    picker`` (what ``summary`` says was on)."""
    kind, policy, routers = parse_target(target, default_routers)
    label = f"{kind}:{policy}, {routers} router{'s' if routers > 1 else ''}"
    return label + "".join(f", {name}" for key, name in (("kv_events", "KV events"),
                                                         ("picker", "endpoint picker"))
                           if (summary or {}).get(key))


def start_picker(profile: Path | None = None, port: int | None = None,
                 drain_interval_ms: float | None = None) -> tuple[subprocess.Popen, str]:
    """The endpoint picker (`python -m router.picker`, under cProfile into ``profile`` when given),
    listening on ``port`` (default: a free one), draining the KV event sockets every
    ``drain_interval_ms`` (default: the picker's): (process, ``HOST:PORT``). Raises RuntimeError if
    it exits before it listens."""
    port = port or free_port()
    prof = ["-m", "cProfile", "-o", str(profile)] if profile is not None else []
    drain = ["--drain-interval-ms", str(drain_interval_ms)] if drain_interval_ms is not None else []
    proc = subprocess.Popen([sys.executable, *prof, "-m", "router.picker", "--port", str(port), *drain],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline() if proc.stdout is not None else ""
    if not line.startswith("picker listening"):
        proc.kill()
        raise RuntimeError(f"the endpoint picker did not start: {line!r}")
    return proc, f"127.0.0.1:{port}"


def kill_picker(picker: tuple[subprocess.Popen, str], args, replaced: list) -> None:
    """``--kill-picker-at-s``: SIGKILL the picker that many seconds into the replay and start a new one
    on the same port ``--picker-down-s`` later (what `fleet up`'s supervisor does); the new one is
    appended to ``replaced``."""
    time.sleep(args.kill_picker_at_s)
    picker[0].kill()
    picker[0].wait()
    time.sleep(args.picker_down_s)
    replaced.append(start_picker(port=int(picker[1].rpartition(":")[2]),
                                 drain_interval_ms=args.picker_drain_interval_ms))


def start_router(kind: str, policy: str, urls: list[str], *, port: int | None = None,
                 kv_events: list[dict] | None = None, picker: str | None = None,
                 picker_deadline_ms: float = 5.0, profile: Path | None = None) -> tuple[subprocess.Popen, str]:
    """One router process of ``kind`` with ``policy`` in front of ``urls``, ready to serve:
    (process, base URL). A Fleet router is given ``--picker`` (the endpoint picker's address) and each endpoint's ``kv_events`` when given;
    a Fleet router runs under cProfile into ``profile`` when given. Raises RuntimeError if it exits before answering /health."""
    port = port or free_port()
    base = f"http://127.0.0.1:{port}"
    if kind == "fleet":
        run = ["-c", PROFILED_ROUTER.format(path=str(profile))] if profile is not None else ["-m", "router"]
        cmd = [sys.executable, *run, "--host", "127.0.0.1", "--port", str(port)]
        if picker:
            cmd += ["--picker", picker, "--picker-deadline-ms", str(picker_deadline_ms)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "FLEET_ROUTER_ADMIN_TOKEN": ADMIN_TOKEN})
        wait_http(f"{base}/health", proc)
        put_pool(base, policy, urls, kv_events=kv_events)
    else:
        proc = subprocess.Popen([str(VLLM_ROUTER), "--host", "127.0.0.1",
                                 "--port", str(port), "--policy", policy, "--log-level", "warning",
                                 "--prometheus-port", str(free_port()),   # its own: two instances may run
                                 "--worker-urls", *urls],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
        wait_http(f"{base}/health", proc)
    return proc, base


PROFILED_ROUTER = """
import cProfile, runpy, signal
signal.raise_signal = lambda sig: None   # uvicorn re-raises SIGTERM after its shutdown: exit normally instead
profile = cProfile.Profile()
profile.enable()
try:
    runpy.run_module("router", run_name="__main__", alter_sys=True)
finally:
    profile.disable()
    profile.dump_stats({path!r})
"""
"""`python -c` of a Fleet router under cProfile (``--router-profile``): the profile is written
when the router exits on SIGTERM."""


def start_probe(picker: str, routers: list[str]) -> subprocess.Popen:
    """``--probe``: `loadtests.picker_probe` sampling the picker's and each router's response time."""
    return subprocess.Popen([sys.executable, "-m", "loadtests.picker_probe", "--picker", picker,
                             "--routers", ",".join(routers)], stdout=subprocess.PIPE, text=True)  # fmt: skip


def stop_probe(proc: subprocess.Popen) -> dict | None:
    """The probe's samples (its JSON line), once stopped with SIGTERM; None if it printed none."""
    proc.terminate()
    out, _ = proc.communicate(timeout=30)
    return json.loads(out) if out.strip() else None


def router_profile(args, target: str, port: int) -> Path | None:
    """Where ``--router-profile DIR`` puts the cProfile of the router on ``port`` of ``target``."""
    if args.router_profile is None:
        return None
    args.router_profile.mkdir(parents=True, exist_ok=True)
    return args.router_profile / f"{re.sub(r'[^A-Za-z0-9@+-]', '_', target)}-{port}.prof"


def put_pool(base: str, policy: str, urls: list[str], extra: dict | None = None,
             kv_events: list[dict] | None = None) -> None:
    """Publish the pool of model `MODEL` (endpoints ``sim-<i>`` at ``urls``, with ``kv_events[i]``
    when given) to the Fleet router at ``base`` through its admin API, as the controller does;
    ``extra`` adds pool fields."""
    endpoints = [{"id": f"sim-{i}", "url": u} for i, u in enumerate(urls)]
    if kv_events is not None:
        endpoints = [{**e, "kv_events": kv} for e, kv in zip(endpoints, kv_events, strict=True)]
    doc = {"policy": policy, "endpoints": endpoints, **(extra or {})}
    req = urllib.request.Request(f"{base}/admin/v1/pools/{MODEL}", data=json.dumps(doc).encode(), method="PUT",
                                 headers={"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10).close()


def free_port_range(n: int, attempts: int = 50) -> int:
    """A port p with p .. p+n-1 all free on 127.0.0.1 now (the simulator offsets replica i's
    KV-event ports by i, as vLLM offsets them by data-parallel rank)."""
    for _ in range(attempts):
        base = free_port()
        socks = []
        try:
            for k in range(n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {n} consecutive free ports found")


class KvEventPorts:
    """The KV-event ports of a `SimFleet`'s replicas: process k publishes on ``pub[k] + i`` and
    answers replays on ``replay[k] + i`` for its replica i (``--kv-events-config``, vLLM's keys)."""

    def __init__(self, replicas: int, processes: int) -> None:
        processes = min(processes, replicas)
        self.per = [replicas // processes + (i < replicas % processes) for i in range(processes)]
        self.pub = [free_port_range(n) for n in self.per]
        self.replay = [free_port_range(n) for n in self.per]

    def args_for(self, k: int) -> list[str]:
        return ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.pub[k]}",
            "replay_endpoint": f"tcp://*:{self.replay[k]}", "topic": ""})]

    def sources(self) -> list[dict]:
        """Each replica's `EndpointSpec.kv_events`, in `SimFleet.urls` order."""
        return [{"publisher": f"tcp://127.0.0.1:{self.pub[k] + i}", "replay": f"tcp://127.0.0.1:{self.replay[k] + i}",
                 "topic": ""} for k, n in enumerate(self.per) for i in range(n)]


class AlternatingSender:
    """Sends request i through ``senders[i % len(senders)]``: N routers behind a Service."""

    def __init__(self, senders: list[HttpSender]) -> None:
        self.senders = senders

    async def __call__(self, index: int, r) -> Outcome:
        return await self.senders[index % len(self.senders)](index, r)


def prefix_cache_tokens(urls: list[str]) -> tuple[float, float]:
    """(hits, queries) in prompt tokens, summed over the replicas' `vllm:prefix_cache_*_total`."""
    hits = queries = 0.0
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("vllm:prefix_cache_hits_total"):
                    hits += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:prefix_cache_queries_total"):
                    queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def per_process(role: str, before: dict, after: dict, per: float, unit: str) -> dict:
    """One process's share between two `loadtests.procs.sched_counts`: CPU in ms and voluntary switches (its
    wakeups), involuntary switches (waits for a core) and timeslices, each divided by ``per``
    (requests, or seconds when idle); ``unit`` names the divisor in the keys."""
    out = {"role": role, f"cpu_ms_per_{unit}": 1e-6 * (after["cpu_ns"] - before["cpu_ns"]) / per}
    for key in ("voluntary", "involuntary", "runs"):
        out[f"{key}_per_{unit}"] = (after[key] - before[key]) / per
    out["threads"] = after["threads"]
    return out


def run_target(target: str, trace: Trace, args, slowdown: float) -> dict:
    kind, policy, n_routers = parse_target(target, args.routers)
    kv_events, with_picker = target_options(target, args)
    # Every usage object says what the prefix cache held, which Fleet's routers count beside
    # their prediction (fleet_router_prefix_cache_{hits,predicted_hits}_total).
    extra = ["--enable-prompt-tokens-details", *(["--slowdown", str(slowdown)] if slowdown != 1.0 else [])]
    if args.max_model_len is not None:
        extra += ["--max-model-len", str(args.max_model_len)]
    kv_ports = KvEventPorts(args.replicas, args.sim_processes) if kv_events else None
    with SimFleet(args.replicas, profile=args.profile, model=MODEL, processes=args.sim_processes, seed=args.seed,
                  extra_args=extra, extra_args_for=kv_ports.args_for if kv_ports else None) as sims:
        routers: list[tuple[subprocess.Popen, str]] = []
        picker: tuple[subprocess.Popen, str] | None = None
        killed: list[tuple[subprocess.Popen, str]] = []   # the picker that replaced a killed one
        prober: subprocess.Popen | None = None
        try:
            if with_picker:
                picker = start_picker(args.picker_profile, drain_interval_ms=args.picker_drain_interval_ms)
            ports = [free_port() for _ in range(n_routers)]
            for port in ports:
                routers.append(start_router(kind, policy, sims.urls, port=port,
                                            kv_events=kv_ports.sources() if kv_ports else None,
                                            picker=picker[1] if picker else None,
                                            picker_deadline_ms=args.picker_deadline_ms,
                                            profile=router_profile(args, target, port)))
            watched = [("router", proc) for proc, _ in routers] + ([("picker", picker[0])] if picker else [])
            idle: list[dict] = []
            if args.idle_s > 0:   # the tier with its pool and streams, and no request
                before = [sched_counts(proc.pid) for _, proc in watched]
                time.sleep(args.idle_s)
                idle = [per_process(role, b, sched_counts(proc.pid), args.idle_s, "s")
                        for (role, proc), b in zip(watched, before, strict=True)]
            counts0 = [sched_counts(proc.pid) for _, proc in watched]
            cpu0 = sum(cpu_s(proc.pid) for proc, _ in routers)
            picker_cpu0 = cpu_s(picker[0].pid) if picker else 0.0

            async def go():
                async with contextlib.AsyncExitStack() as stack:
                    senders = [await stack.enter_async_context(HttpSender(base, MODEL, PromptBuilder(args.seed, 32000)))
                               for _, base in routers]
                    return await replay(trace, AlternatingSender(senders))

            prober = start_probe(picker[1], [base for _, base in routers]) if picker and args.probe else None
            started = time.monotonic()
            if picker is not None and args.kill_picker_at_s is not None:
                killer = threading.Thread(target=kill_picker, args=(picker, args, killed), daemon=True)
                killer.start()
            records = asyncio.run(go())
            wall_s = time.monotonic() - started
            router_cpu_s = sum(cpu_s(proc.pid) for proc, _ in routers) - cpu0
            processes = [per_process(role, c0, sched_counts(proc.pid), max(1, len(records)), "request")
                         for (role, proc), c0 in zip(watched, counts0, strict=True) if proc.poll() is None]
            probed = stop_probe(prober) if prober is not None else None
            if killed:   # the killed picker's CPU is lost with it: the restarted one's counts from its start
                picker = killed[0]
                picker_cpu0 = 0.0
            picker_cpu_s = cpu_s(picker[0].pid) - picker_cpu0 if picker else 0.0
            picker_picks = [scrape(base, PICKER_SERIES) for _, base in routers] if picker else []
            hits, queries = prefix_cache_tokens(sims.urls)
            kv_seen = ([scrape(base, KV_SERIES) for _, base in routers] if kv_ports and kind == "fleet" and not picker
                       else [])  # fmt: skip
            predicted = [scrape(base, PREDICTED_SERIES) for _, base in routers] if kind == "fleet" else []
            resilience = [scrape(base, RESILIENCE_SERIES) for _, base in routers] if kind == "fleet" else []
            answered = [scrape(base, ENDPOINT_REQUESTS_SERIES) for _, base in routers] if kind == "fleet" else []
        finally:
            if prober is not None and prober.poll() is None:
                prober.kill()
                prober.wait()
            for proc, _ in routers:
                proc.terminate()
            for proc, _ in routers:
                proc.wait(timeout=30)
            for proc, _ in ([picker] if picker is not None else []) + killed:
                proc.terminate()
                proc.wait(timeout=60)   # under cProfile it writes its profile on the way out
    summary = summarize_run(records, args.ttft_slo_s)
    summary["picker"] = with_picker
    if killed:
        summary["picker_killed_at_s"] = args.kill_picker_at_s
    if picker_picks:   # summed over the routers, by outcome
        summary["picker_picks"] = {
            outcome: sum(v for m in picker_picks for k, v in m.items() if f'outcome="{outcome}"' in k)
            for outcome in ("answered", "timed_out", "unreachable", "declined")}
        rtt = {le: sum(v for m in picker_picks for k, v in m.items() if f'le="{le}"' in k)
               for le in ("0.0005", "0.001", "0.005", "+Inf")}
        summary["picker_rtt_share"] = {f"<= {float(le) * 1e3:g} ms": rtt[le] / rtt["+Inf"] if rtt["+Inf"] else None
                                       for le in ("0.0005", "0.001", "0.005")}   # of the answered picks
        summary["picker_cpu_ms_per_request"] = 1e3 * picker_cpu_s / max(1, len(records))
    if probed is not None:
        summary["probe"] = probed
    summary["routers"] = n_routers
    summary["kv_events"] = kv_events
    if kv_seen:   # did the events arrive? per router: events applied, streams live at the end
        summary["kv_events_seen"] = [
            {"events": sum(v for k, v in m.items() if k.startswith("fleet_router_kv_events_total")),
             "streams_live": sum(v for k, v in m.items() if k.startswith("fleet_router_kv_stream_live"))}
            for m in kv_seen]
    summary["prefix_cache_hit_rate"] = hits / queries if queries else 0.0
    summary["prefix_cache_tokens"] = {"hits": hits, "queries": queries}   # over every replica
    if predicted:   # the routers' view against the engines' own account, over the same requests
        seen = {name: sum(v for m in predicted for k, v in m.items() if k.startswith(name))
                for name in ("fleet_router_prefix_cache_hits_total", "fleet_router_prefix_cache_predicted_hits_total")}
        actual, expected = seen["fleet_router_prefix_cache_hits_total"], seen["fleet_router_prefix_cache_predicted_hits_total"]
        summary["predicted_over_actual_hits"] = expected / actual if actual else None
    if resilience:   # summed over the routers, all labels
        summary["router_resilience"] = {
            name: sum(v for m in resilience for k, v in m.items() if k.startswith(f"fleet_router_{name}_total"))
            for name in ("retries", "first_token_timeouts", "endpoint_ejections")}
    if answered:   # requests each endpoint answered, summed over the routers (where the policy sent them)
        per_endpoint: dict[str, float] = {}
        for m in answered:
            for k, v in m.items():
                found = ENDPOINT_LABEL.search(k)
                if found:
                    per_endpoint[found.group(1)] = per_endpoint.get(found.group(1), 0) + v
        summary["requests_per_endpoint"] = dict(sorted(per_endpoint.items()))
    summary["router_cpu_ms_per_request"] = 1e3 * (router_cpu_s + picker_cpu_s) / max(1, len(records))
    summary["processes"] = processes   # each router's and the picker's CPU and scheduling, per request
    if idle:
        summary["idle"] = idle   # the same, per second, before the replay (`--idle-s`)
    summary["wall_s"] = wall_s
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True,
                        help=f"{', '.join(sorted(TRACE_FILES))}, or a trace file (.csv Azure, .jsonl Fleet or Mooncake)")
    parser.add_argument("--max-model-len", type=int, help="replicas' context (default: per trace, else the profile's)")
    parser.add_argument("--start-s", type=float, help="trace window start (default: a busy stretch)")
    parser.add_argument("--window-s", type=float, help="trace window length in trace seconds (default 1200)")
    parser.add_argument("--replicas", type=int, default=8, help="simulated replicas (default 8)")
    parser.add_argument("--sim-processes", type=int, default=2, help="processes hosting them (default 2)")
    parser.add_argument("--profile", default="h100-llama-8b", help="simulator profile (default h100-llama-8b)")
    parser.add_argument("--load", type=float, default=0.8, help="offered load / fleet capacity (default 0.8)")
    parser.add_argument("--max-token-rate", type=float, default=1500.0,
                        help="most streamed tokens per second this machine should carry (default 1500)")
    parser.add_argument("--ttft-slo-s", type=float, help="also report the share within this TTFT")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--targets", default=DEFAULT_TARGETS,
                        help="comma-separated fleet:<policy> / vllm-router:<policy>, each optionally @N routers and "
                             "+kv-events / +picker (that target only)")
    parser.add_argument("--routers", type=int, default=1,
                        help="router processes per target, requests alternating between them (default 1)")
    parser.add_argument("--kv-events", action="store_true",
                        help="replicas publish their KV cache events (--kv-events-config) and Fleet's routers "
                             "subscribe (each endpoint's kv_events)")
    parser.add_argument("--picker", action="store_true",
                        help="Fleet's routers of each target ask one endpoint picker (python -m router.picker), "
                             "which follows the replicas' KV events (so --kv-events is on)")
    parser.add_argument("--picker-deadline-ms", type=float, default=5.0,
                        help="the routers' wait for the picker's answer (python -m router --picker-deadline-ms)")
    parser.add_argument("--kill-picker-at-s", type=float,
                        help="SIGKILL the endpoint picker this many seconds into each replay, and start a new one "
                             "--picker-down-s later (the routers pick alone meanwhile)")
    parser.add_argument("--picker-down-s", type=float, default=5.0)
    parser.add_argument("--picker-drain-interval-ms", type=float,
                        help="the picker's drain of the KV event sockets (python -m router.picker "
                             "--drain-interval-ms; default: the picker's own)")
    parser.add_argument("--picker-profile", type=Path,
                        help="run the endpoint picker under cProfile, writing its profile here")
    parser.add_argument("--probe", action="store_true",
                        help="beside each +picker target, sample the picker's and each router's response times "
                             "(loadtests/picker_probe.py: where late picks come from; adds ~20 picks/s of wire)")
    parser.add_argument("--router-profile", type=Path,
                        help="run each Fleet router under cProfile, writing TARGET-PORT.prof into this folder")
    parser.add_argument("--idle-s", type=float, default=0.0,
                        help="before each replay, measure every router's and the picker's CPU and wakeups per "
                             "second for this long with no request (default 0: not measured)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()

    path = TRACE_FILES.get(args.trace, Path(args.trace))
    start_s, window_s = DEFAULT_WINDOWS.get(args.trace, (0.0, None))
    start_s = args.start_s if args.start_s is not None else start_s
    window_s = args.window_s if args.window_s is not None else window_s
    if args.max_model_len is None:
        args.max_model_len = DEFAULT_MAX_MODEL_LEN.get(args.trace)
    profile = get_profile(args.profile).with_overrides(max_model_len=args.max_model_len)
    base = clip(load_trace(path).window(start_s, window_s), profile.config.max_model_len)
    mean_out = sum(r.output_tokens for r in base.requests) / len(base.requests)
    capacity_1 = replica_capacity_per_s(base, profile, 1.0)
    tokens_at_load = args.load * args.replicas * capacity_1 * mean_out
    slowdown = max(1.0, round(tokens_at_load / args.max_token_rate, 1))
    capacity = replica_capacity_per_s(base, profile, slowdown)
    speedup = args.load * args.replicas * capacity / base.mean_rate_per_s()
    trace = base.compressed(speedup)
    print(f"{args.trace}: trace seconds {start_s:g}-{start_s + base.duration_s:g}, {len(trace.requests)} requests, "
          f"mean {base.mean_rate_per_s():.2f} req/s, {mean_out:.0f} output tokens/request", flush=True)
    print(f"one {args.profile} replica: {capacity_1:.2f} req/s at saturation; slowdown x{slowdown:g} -> "
          f"{capacity:.3f} req/s; arrival speedup x{speedup:.2f} -> {trace.mean_rate_per_s():.2f} req/s offered to "
          f"{args.replicas} replicas ({args.load:.0%} load), {trace.duration_s:.0f} s per target", flush=True)

    targets = [t for t in args.targets.split(",") if t]
    for target in targets:
        kind, _, _ = parse_target(target, args.routers)   # a bad name fails before any replay
        if kind == "vllm-router" and not VLLM_ROUTER.exists():   # and so does a missing router
            parser.error(f"target {target!r} needs {VLLM_ROUTER}: pip install -e '.[bench]' (vllm-router)")
    reference = virtual_round_robin(trace, args, slowdown, profile)
    rows = []
    for target in targets:
        s = run_target(target, trace, args, slowdown)
        rows.append((target, s))
        print(f"  {target_label(target, args.routers, s)}: TTFT p50 {s['ttft_s']['p50']:.3f} s p99 {s['ttft_s']['p99']:.3f} s, "
              f"e2e p50 {s['e2e_s']['p50']:.2f} s p99 {s['e2e_s']['p99']:.2f} s, prefix-cache hits "
              f"{100 * s['prefix_cache_hit_rate']:.1f}%, failed {s['failed']}"
              + (f", predicted / actual hits {s['predicted_over_actual_hits']:.2f}"
                 if s.get("predicted_over_actual_hits") is not None else "")
              + (f", KV events seen per router {s['kv_events_seen']}" if "kv_events_seen" in s else "")
              + (f", picker picks {s['picker_picks']}, picker CPU {s['picker_cpu_ms_per_request']:.2f} ms/request"
                 if "picker_picks" in s else "")
              + (f", probe {json.dumps(s['probe'])}" if "probe" in s else ""), flush=True)
        for key, unit in (("processes", "request"), ("idle", "s")):
            for p in s.get(key, []):
                print(f"    {'idle ' if unit == 's' else ''}{p['role']}: CPU {p[f'cpu_ms_per_{unit}']:.2f} ms/{unit}, "
                      f"wakeups {p[f'voluntary_per_{unit}']:.1f}/{unit}, "
                      f"preempted {p[f'involuntary_per_{unit}']:.1f}/{unit}, "
                      f"timeslices {p[f'runs_per_{unit}']:.1f}/{unit}, {p['threads']} threads", flush=True)

    slo = f"within {args.ttft_slo_s:g} s TTFT" if args.ttft_slo_s is not None else None
    print(f"\n| router:policy | TTFT p50 | TTFT p99 | e2e p50 | e2e p99 |{f' {slo} |' if slo else ''} prefix-cache hits "
          "| failed | router CPU / request (sum over routers and the picker) |")
    print("|---|---|---|---|---|---|---|---|" + ("---|" if slo else ""))
    labelled = [(target_label(t, args.routers, s), s) for t, s in rows]
    for target, s in [("virtual-time reference: ideal round-robin, no router", {**reference, "router_cpu_ms_per_request": None}), *labelled]:
        cpu = "—" if s["router_cpu_ms_per_request"] is None else f"{s['router_cpu_ms_per_request']:.2f} ms"
        share = f" {100 * s['within_ttft_slo']:.1f}% |" if slo else ""
        hits = "—" if s.get("prefix_cache_hit_rate") is None else f"{100 * s['prefix_cache_hit_rate']:.1f}%"
        print(f"| {target} | {s['ttft_s']['p50']:.3f} s | {s['ttft_s']['p99']:.3f} s | {s['e2e_s']['p50']:.2f} s "
              f"| {s['e2e_s']['p99']:.2f} s |{share} {hits} | {s['failed']} | {cpu} |")
    if args.json_out:
        args.json_out.write_text(json.dumps({
            "trace": args.trace, "window": [start_s, window_s], "replicas": args.replicas, "profile": args.profile,
            "load": args.load, "slowdown": slowdown, "speedup": speedup, "routers": args.routers,
            "kv_events": args.kv_events, "picker": args.picker,
            "virtual_reference": reference,
            "results": dict(rows)}, indent=1))


if __name__ == "__main__":
    main()
