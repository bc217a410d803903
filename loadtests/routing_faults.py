"""Fault runs of the routing tier: a stalled engine, a killed router, a cut KV event
stream, each under open-loop streamed load through two Fleet routers in front of SIMULATED
replicas (`fleet.enginesim`, one process per replica so that one can be stopped alone).

Owns the three runs and their report; the load is `loadtests.faultload.FaultLoad` (request k
to router k mod 2, as behind a Kubernetes Service; a refused connection is retried on the other
router), the replicas `loadtests.procs.SimFleet`. Nothing here is on a request path.

- **stall**: one engine is `SIGSTOP`ped for ``--stall-s`` (60 s) under load, then `SIGCONT`ed.
  Its port still accepts connections (the kernel's backlog) and nothing answers: the engine of
  a hung GPU whose process is alive. Counted: requests that waited for their first token past
  the pool's first-token deadline plus one retry (``2 x --first-token-timeout-s``: the retry
  has its own deadline), the longest such wait, and requests that failed before their stream
  started. The pool document asks for the deadline (``first_token_timeout_s``); a router that
  does not know the field (422) gets the pool without it, and the report says so.
- **router-kill**: one of the two routers is `SIGKILL`ed under load. Counted: requests in flight
  on it when it died (sent to it before the kill, not ended by then), how many of them failed
  or were cut, and failures of any other request (there should be none).
- **event-cut**: every engine publishes its KV cache events (`--kv-events-config`, vLLM's keys)
  and each router subscribes through a TCP relay per engine that this script runs; engine 0's
  relays (events and replay) are closed for ``--cut-s`` and reopened. The routers'
  ``fleet_router_kv_*`` series are read every ``--sample-s`` before, during and after; the
  report gives each series' value at the cut, at the resume and at the end (gaps, resyncs,
  live streams, index size), and the largest index size seen against each engine's KV cache
  (``--num-gpu-blocks``, small so that it fills and evicts in the run), and the engines' prefix-cache
  hit rate (``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``, engine 0 apart)
  during the cut and from the resume to the end. Skipped, saying why, when the
  engine simulator has no ``--kv-events-config`` or the router refuses ``kv_events``.

Usage (heavy: under the shared lock):
    flock /tmp/fleet-heavy.lock .venv/bin/python -m loadtests.routing_faults \\
        [--faults stall,router-kill,event-cut] [--json-out loadtests/results/routing-faults.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path

from loadtests.faultload import FaultLoad, Request
from loadtests.procs import SimFleet, free_port, wait_http
from loadtests.stats import summarize

ADMIN_TOKEN = "routing-faults-admin-token"
MODEL = "bench"
FAULTS = ("stall", "router-kill", "event-cut")
KV_SERIES = re.compile(r"^fleet_router_kv_")
PREFIX_SERIES = re.compile(r"^vllm:prefix_cache_(hits|queries)_total")
STALL_SERIES = re.compile(r"^fleet_router_(first_token_timeouts|retries|endpoint_errors|endpoint_eject|outlier|stall)")


# ----- prompts ----------------------------------------------------------------------------------


class Prompts:
    """Token-id prompts: request k continues conversation k mod ``conversations`` (a shared
    prefix of ``prefix_tokens`` ids) with ``suffix_tokens`` ids of its own, so the engines'
    prefix caches fill and evict and the KV events keep flowing."""

    def __init__(self, seed: int, conversations: int = 32, prefix_tokens: int = 1024, suffix_tokens: int = 128) -> None:
        self.seed, self.conversations = seed, conversations
        self.prefix_tokens, self.suffix_tokens = prefix_tokens, suffix_tokens
        self._prefixes: dict[int, list[int]] = {}

    def _ids(self, key: str, n: int) -> list[int]:
        rng = random.Random(f"{self.seed}:{key}")
        return [rng.randrange(10, 32000) for _ in range(n)]

    def __call__(self, index: int) -> list[int]:
        c = index % self.conversations
        if c not in self._prefixes:
            self._prefixes[c] = self._ids(f"conversation:{c}", self.prefix_tokens)
        return self._prefixes[c] + self._ids(f"request:{index}", self.suffix_tokens)


# ----- the routers ------------------------------------------------------------------------------


def put_pool(base: str, doc: dict) -> list[str]:
    """PUT the pool ``doc`` of `MODEL` to the router at ``base``. A field the router refuses (422
    naming it) is dropped and the PUT retried. Returns the refused fields (dotted paths)."""
    refused: list[str] = []
    while True:
        req = urllib.request.Request(f"{base}/admin/v1/pools/{MODEL}", data=json.dumps(doc).encode(), method="PUT",
                                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=10).close()
            return refused
        except urllib.error.HTTPError as err:
            text = err.read().decode(errors="replace")
            field = next((f for f in ("first_token_timeout_s", "kv_events") if f in text), None)
            if err.code != 422 or field is None:
                raise RuntimeError(f"PUT pool: HTTP {err.code}: {text[:300]}") from err
            refused.append(field)
            doc = {k: v for k, v in doc.items() if k != field}
            doc["endpoints"] = [{k: v for k, v in e.items() if k != field} for e in doc["endpoints"]]


def start_router(doc: dict) -> tuple[subprocess.Popen, str, list[str]]:
    """A Fleet router process serving the pool ``doc``: (process, base URL, refused fields)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "router", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "FLEET_ROUTER_ADMIN_TOKEN": ADMIN_TOKEN})
    wait_http(f"{base}/health", proc)
    return proc, base, put_pool(base, doc)


def scrape(base: str, pattern: re.Pattern) -> dict[str, float]:
    """The router's ``/metrics`` samples whose name matches ``pattern`` ({'name{labels}': value}),
    less the ``_created`` timestamps of counters. Empty if the router does not answer."""
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and pattern.match(line) and "_created" not in line.split("{")[0]:
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out


@contextmanager
def routers(n: int, doc: dict):
    """``n`` routers serving ``doc``; yields [(process, base URL)] and the refused fields."""
    started: list[tuple[subprocess.Popen, str]] = []
    refused: list[str] = []
    try:
        for _ in range(n):
            proc, base, refused = start_router(doc)
            started.append((proc, base))
        yield started, refused
    finally:
        for proc, _ in started:
            if proc.poll() is None:
                proc.terminate()
        for proc, _ in started:
            proc.wait(timeout=30)


# ----- a TCP relay that can be cut --------------------------------------------------------------


class TcpRelay:
    """Listens on ``port`` (127.0.0.1) and relays each connection to ``upstream_port``; `cut`
    closes the listener and every relayed connection (new connections are refused), `resume`
    listens again on the same port. Runs its own event loop in a thread."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.AbstractServer | None = None
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name=f"relay-{self.port}", daemon=True).start()
        self.resume()

    def _call(self, coro) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self._writers -= {writer, up_writer}

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._writers):
            w.transport.abort()   # a reset, as a cut cable or a dropped rule gives

    def resume(self) -> None:
        self._call(self._listen())

    def cut(self) -> None:
        self._call(self._close())

    async def _cancel_all(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        """Cut, end the relayed connections' tasks and stop the relay's loop."""
        self.cut()
        self._call(self._cancel_all())
        self._loop.call_soon_threadsafe(self._loop.stop)


def enginesim_has_kv_events() -> bool:
    """Whether `python -m fleet.enginesim` takes ``--kv-events-config``."""
    out = subprocess.run([sys.executable, "-m", "fleet.enginesim", "--help"], capture_output=True, text=True, timeout=60)
    return "--kv-events-config" in out.stdout


# ----- the runs ---------------------------------------------------------------------------------


def pool_doc(args, urls: list[str], kv_events: list[dict] | None = None) -> dict:
    endpoints = [{"id": f"sim-{i}", "url": u} for i, u in enumerate(urls)]
    if kv_events is not None:
        endpoints = [{**e, "kv_events": kv} for e, kv in zip(endpoints, kv_events, strict=True)]
    return {"policy": args.policy, "endpoints": endpoints, "first_token_timeout_s": args.first_token_timeout_s}


def load_for(args, bases: list[str]) -> FaultLoad:
    return FaultLoad(bases[0], MODEL, rate_per_s=args.rate, max_tokens=args.max_tokens, urls=tuple(bases),
                     prompt_for=Prompts(args.seed), timeout_s=args.stall_s + 60)


def outcomes(requests: list[Request]) -> dict:
    return {"requests": len(requests), "ok": sum(r.outcome == "ok" for r in requests),
            "failed_before_streaming": sum(r.outcome == "failed" for r in requests),
            "cut": sum(r.outcome == "cut" for r in requests),
            "retried": sum(r.attempts > 1 for r in requests),
            "failure_details": sorted({r.detail for r in requests if r.outcome in ("failed", "cut")})[:5]}


def first_token_wait_s(r: Request) -> float:
    """Seconds from the first try to the first token (or to the end, when none came)."""
    return (r.first_byte_at_s if r.first_byte_at_s is not None else r.ended_at_s) - r.sent_at_s


def run_stall(args) -> dict:
    with SimFleet(args.replicas, profile=args.profile, model=MODEL, processes=args.replicas, seed=args.seed) as sims, \
            routers(2, pool_doc(args, sims.urls)) as (started, refused):
        bases = [b for _, b in started]
        before = [scrape(b, STALL_SERIES) for b in bases]
        with load_for(args, bases) as load:
            time.sleep(args.warmup_s)
            stopped_at = time.monotonic()
            os.kill(sims.pids[0], signal.SIGSTOP)
            print(f"  engine sim-0 (pid {sims.pids[0]}) stopped", flush=True)
            try:
                time.sleep(args.stall_s)
            finally:
                os.kill(sims.pids[0], signal.SIGCONT)
            resumed_at = time.monotonic()
            print("  engine sim-0 continued", flush=True)
            time.sleep(args.tail_s)
        after = [scrape(b, STALL_SERIES) for b in bases]
    done = load.done
    bound_s = 2 * args.first_token_timeout_s
    waits = [first_token_wait_s(r) for r in done]
    during = [r for r in done if stopped_at - args.first_token_timeout_s <= r.sent_at_s <= resumed_at]
    over = [r for r in done if first_token_wait_s(r) > bound_s]
    return {**outcomes(done), "refused_pool_fields": refused, "stall_s": args.stall_s,
            "first_token_timeout_s": args.first_token_timeout_s, "bound_s": bound_s,
            "sent_during_stall": len(during),
            "waited_past_deadline": sum(first_token_wait_s(r) > args.first_token_timeout_s for r in done),
            "waited_past_bound": len(over),
            "failed_before_streaming_during_stall": sum(r.outcome == "failed" for r in during),
            "first_token_wait_s": summarize(waits), "longest_wait_s": max(waits, default=0.0),
            "router_series_delta": [_delta(b, a) for b, a in zip(before, after, strict=True)]}


def run_router_kill(args) -> dict:
    with SimFleet(args.replicas, profile=args.profile, model=MODEL, processes=args.replicas, seed=args.seed) as sims, \
            routers(2, pool_doc(args, sims.urls)) as (started, refused):
        bases = [b for _, b in started]
        with load_for(args, bases) as load:
            time.sleep(args.warmup_s)
            killed_at = time.monotonic()
            started[1][0].kill()
            print(f"  router 1 (pid {started[1][0].pid}) killed", flush=True)
            time.sleep(args.tail_s)
    done = load.done
    in_flight = [r for r in done if r.router == 1 and r.last_try_at_s <= killed_at <= r.ended_at_s]
    others = [r for r in done if r not in in_flight]
    return {**outcomes(done), "refused_pool_fields": refused, "in_flight_on_killed_router": len(in_flight),
            "in_flight_failed": sum(r.outcome == "failed" for r in in_flight),
            "in_flight_cut": sum(r.outcome == "cut" for r in in_flight),
            "in_flight_ok": sum(r.outcome == "ok" for r in in_flight),
            "others_failed_or_cut": sum(r.outcome in ("failed", "cut") for r in others),
            "others_details": sorted({r.detail for r in others if r.outcome in ("failed", "cut")})[:5]}


def run_event_cut(args) -> dict:
    if not enginesim_has_kv_events():
        return {"skipped": "the engine simulator takes no --kv-events-config on this code"}
    ports = [(free_port(), free_port()) for _ in range(args.replicas)]

    def kv_args(k: int) -> list[str]:
        pub, replay = ports[k]
        return ["--num-gpu-blocks-override", str(args.num_gpu_blocks), "--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
            "replay_endpoint": f"tcp://*:{replay}", "buffer_steps": args.kv_buffer_steps, "topic": ""})]

    samples: list[dict] = []
    with ExitStack() as stack:
        sims = stack.enter_context(SimFleet(args.replicas, profile=args.profile, model=MODEL, processes=args.replicas,
                                            seed=args.seed, extra_args_for=kv_args))
        relays = [(TcpRelay(pub), TcpRelay(replay)) for pub, replay in ports]
        for pair in relays:
            stack.callback(lambda pair=pair: [r.stop() for r in pair])
        kv = [{"publisher": f"tcp://127.0.0.1:{p.port}", "replay": f"tcp://127.0.0.1:{r.port}", "topic": ""}
              for p, r in relays]
        started, refused = stack.enter_context(routers(2, pool_doc(args, sims.urls, kv)))
        if "kv_events" in refused:
            return {"skipped": "the router refuses the endpoints' kv_events on this code"}
        bases = [b for _, b in started]
        t0 = time.monotonic()
        marks: dict[str, float] = {}

        def prefix_cache() -> list[tuple[float, float]]:   # per engine: (hit tokens, queried tokens)
            out = []
            for url in sims.urls:
                series = scrape(url, PREFIX_SERIES)
                out.append((sum(v for k, v in series.items() if k.startswith("vllm:prefix_cache_hits")),
                            sum(v for k, v in series.items() if k.startswith("vllm:prefix_cache_queries"))))
            return out

        def sample() -> None:
            samples.append({"t_s": round(time.monotonic() - t0, 2),
                            "routers": [scrape(b, KV_SERIES) for b in bases], "engines_prefix_cache": prefix_cache()})

        cache_at: dict[str, list[tuple[float, float]]] = {}

        with load_for(args, bases) as load:
            for phase, seconds, action in (("cut", args.warmup_s, lambda: [r.cut() for r in relays[0]]),
                                           ("resume", args.cut_s, lambda: [r.resume() for r in relays[0]]),
                                           ("end", args.tail_s, lambda: None)):
                until = time.monotonic() + seconds
                while time.monotonic() < until:
                    sample()
                    time.sleep(min(args.sample_s, max(0.0, until - time.monotonic())))
                sample()
                marks[phase] = samples[-1]["t_s"]
                cache_at[phase] = samples[-1]["engines_prefix_cache"]
                action()
                print(f"  {phase} at {marks[phase]:.1f} s", flush=True)
    at = {phase: next(s for s in samples if s["t_s"] == t)["routers"] for phase, t in marks.items()}
    largest: dict[str, float] = {}
    for s in samples:
        for series in s["routers"]:
            for key, value in series.items():
                if "block" in key or "size" in key or "entries" in key:
                    largest[key] = max(largest.get(key, 0.0), value)
    hit_rates = {}   # engine prefix-cache hit rate (hit tokens / queried tokens) between two marks
    for name, a, b in (("cut", "cut", "resume"), ("after", "resume", "end")):
        pairs = [(hb - ha, qb - qa) for (ha, qa), (hb, qb) in zip(cache_at[a], cache_at[b])]
        hit_rates[name] = {"engine_0": pairs[0][0] / max(1.0, pairs[0][1]),
                           "others": sum(h for h, _ in pairs[1:]) / max(1.0, sum(q for _, q in pairs[1:]))}
    return {**outcomes(load.done), "refused_pool_fields": refused, "cut_s": args.cut_s,
            "prefix_cache_hit_rate": hit_rates,
            "kv_buffer_steps": args.kv_buffer_steps, "engine_gpu_blocks": args.num_gpu_blocks,
            "series_at": at, "largest_index_series": largest,
            "samples": samples}


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


RUNS = {"stall": run_stall, "router-kill": run_router_kill, "event-cut": run_event_cut}


# ----- the report -------------------------------------------------------------------------------


def table(results: dict[str, dict]) -> str:
    """Markdown rows of the stall and router-kill runs."""
    lines = ["| fault | requests | failed before streaming | streams cut | waited past the deadline + one retry "
             "| longest wait for a first token | in flight on the killed router (failed / cut) | failed elsewhere |",
             "|---|---|---|---|---|---|---|---|"]
    if "stall" in results:
        r = results["stall"]
        note = "" if not r["refused_pool_fields"] else " (router has no first-token deadline: field refused)"
        lines.append(f"| engine SIGSTOPped {r['stall_s']:g} s, deadline {r['first_token_timeout_s']:g} s{note} "
                     f"| {r['requests']} | {r['failed_before_streaming']} | {r['cut']} "
                     f"| {r['waited_past_bound']} (> {r['bound_s']:g} s) | {r['longest_wait_s']:.1f} s | — | — |")
    if "router-kill" in results:
        r = results["router-kill"]
        lines.append(f"| one of two routers SIGKILLed | {r['requests']} | {r['failed_before_streaming']} | {r['cut']} "
                     f"| — | — | {r['in_flight_on_killed_router']} ({r['in_flight_failed']} / {r['in_flight_cut']}) "
                     f"| {r['others_failed_or_cut']} |")
    return "\n".join(lines)


def event_cut_report(r: dict) -> str:
    if "skipped" in r:
        return f"event-cut: skipped: {r['skipped']}"
    keys = sorted({k for phase in r["series_at"].values() for series in phase for k in series})
    lines = [f"event-cut ({r['cut_s']:g} s, engine replay buffer {r['kv_buffer_steps']} batches, "
             f"engine KV cache {r.get('engine_gpu_blocks', '?')} blocks): "
             f"{r['requests']} requests, {r['failed_before_streaming']} failed before streaming, {r['cut']} cut",
             *([f"engine prefix-cache hit rate, engine 0 / the others: during the cut "
                f"{hits['cut']['engine_0']:.1%} / {hits['cut']['others']:.1%}, from the resume to the end "
                f"{hits['after']['engine_0']:.1%} / {hits['after']['others']:.1%}"]
               if (hits := r.get("prefix_cache_hit_rate")) else []),
             "| series (router 0 / router 1) | at the cut | at the resume | at the end | largest |", "|---|---|---|---|---|"]
    for k in keys:
        cells = [" / ".join(f"{series[k]:g}" if k in series else "—" for series in r["series_at"][p])
                 for p in ("cut", "resume", "end")]
        lines.append(f"| `{k}` | {' | '.join(cells)} | {r['largest_index_series'].get(k, '—')} |")
    if not keys:
        lines.append("| (the routers export no fleet_router_kv_* series) | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    p.add_argument("--replicas", type=int, default=4, help="simulated replicas, one process each (default 4)")
    p.add_argument("--profile", default="h100-llama-8b")
    p.add_argument("--policy", default="kv-aware")
    p.add_argument("--rate", type=float, default=8.0, help="requests per second (default 8)")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (default 16)")
    p.add_argument("--first-token-timeout-s", type=float, default=5.0,
                   help="the pool's first-token deadline asked of the router (default 5)")
    p.add_argument("--stall-s", type=float, default=60.0, help="how long the engine stays stopped (default 60)")
    p.add_argument("--cut-s", type=float, default=30.0, help="how long the event stream stays cut (default 30)")
    p.add_argument("--kv-buffer-steps", type=int, default=5,
                   help="the engines' replay buffer in batches (vLLM's buffer_steps): small, so that a cut outlasts "
                        "it and the routers must resync (default 5)")
    p.add_argument("--num-gpu-blocks", type=int, default=2000,
                   help="event-cut: each engine's KV cache in blocks (--num-gpu-blocks-override), small so that it "
                        "fills and evicts within the run and the index's bound shows (default 2000)")
    p.add_argument("--warmup-s", type=float, default=20.0, help="load before the fault (default 20)")
    p.add_argument("--tail-s", type=float, default=20.0, help="load after the fault (or its end) (default 20)")
    p.add_argument("--sample-s", type=float, default=2.0, help="metrics sampling period in event-cut (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        p.error(f"unknown faults {unknown}: use {', '.join(FAULTS)}")
    results: dict[str, dict] = {}
    for fault in faults:
        print(f"{fault}:", flush=True)
        results[fault] = RUNS[fault](args)
        shown = {k: v for k, v in results[fault].items() if k not in ("samples", "series_at")}
        print(f"  {json.dumps(shown)}", flush=True)
    if {"stall", "router-kill"} & set(results):
        print()
        print(table(results))
    if "event-cut" in results:
        print()
        print(event_cut_report(results["event-cut"]))
    if args.json_out:
        args.json_out.write_text(json.dumps({"args": vars(args) | {"json_out": str(args.json_out)},
                                             "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
