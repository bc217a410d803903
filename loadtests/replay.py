"""Open-loop trace replay against any OpenAI-compatible server (Fleet's router, vLLM, the engine
simulator).

Owns `replay` (the open-loop core: each request is sent at its trace time, whatever the
server is doing with the earlier ones), `PromptBuilder` (prompts of exactly the trace's token
count, sharing prefix blocks where the trace says so), `HttpSender` (one streamed
`/v1/completions` per request, measuring TTFT, TPOT and end-to-end latency), `summarize_run`
and the command line.

Prompts are sent as lists of token ids, which the OpenAI completions API and vLLM accept, so
the engine sees exactly `prompt_tokens` tokens (plus none: no special tokens are added to a
token-id prompt); outputs are `max_tokens` = the trace's output tokens with vLLM's
`ignore_eos`, so every request generates exactly its trace length. Token ids are drawn from
`[--min-token-id, --vocab-size)`: deterministic under `--seed`, identical across requests for a
shared prefix block, unique per request elsewhere.

Per request it records: scheduled and actual send time (their difference is the replayer's own
lateness, reported so an overloaded client is visible), TTFT (first token event), TPOT
((e2e - TTFT) / (tokens - 1)), end-to-end latency, tokens received, status and error. It
prints a progress line every 10 s, a summary at the end, and writes everything as JSON.

Usage:
    python -m loadtests.replay loadtests/traces/azure-llm-2023/conv.csv --url http://127.0.0.1:8080 \\
        --model tiny-llama --duration-s 60 --speedup 1 --clip-prompt-tokens 900 --json-out run.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from fleet.tracesim.traces import Trace, TraceError, TraceRequest, load_trace
from loadtests.stats import summarize


@dataclass
class Outcome:
    """What the server did with one request, timed on the replayer's clock (seconds)."""

    status: int | None = None          # HTTP status; None when no response arrived
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    error: str | None = None


@dataclass
class RequestRecord:
    index: int
    scheduled_s: float          # trace arrival (after compression), seconds from the start
    sent_s: float               # when the replayer actually sent it
    prompt_tokens: int
    max_tokens: int
    status: int | None
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    output_tokens: int
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200


Send = Callable[[int, TraceRequest], Awaitable[Outcome]]


async def replay(
    trace: Trace,
    send: Send,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    on_progress: Callable[[int, int, int], None] | None = None,
) -> list[RequestRecord]:
    """Send every request of ``trace`` at its arrival time (open loop) and wait for all.

    A request is dispatched when its time comes even if earlier ones are still running, so a
    slow server sees the load it would see in production instead of a politely slowed one.
    ``send(index, request)`` performs one request; ``on_progress(sent, done, in_flight)`` is
    called after each dispatch. Returns one record per request, in trace order.
    """
    start_s = clock()
    records: list[RequestRecord | None] = [None] * len(trace.requests)
    done = 0

    async def one(i: int, r: TraceRequest, sent_s: float) -> None:
        nonlocal done
        try:
            outcome = await send(i, r)
        except Exception as err:  # noqa: BLE001 - a sender bug must not stop the replay
            outcome = Outcome(error=f"{type(err).__name__}: {err}")
        tpot_s = None
        if outcome.ttft_s is not None and outcome.e2e_s is not None and outcome.output_tokens > 1:
            tpot_s = (outcome.e2e_s - outcome.ttft_s) / (outcome.output_tokens - 1)
        records[i] = RequestRecord(i, r.arrival_s, sent_s, r.prompt_tokens, r.output_tokens, outcome.status,
                                   outcome.ttft_s, tpot_s, outcome.e2e_s, outcome.output_tokens, outcome.error)
        done += 1

    tasks = []
    for i, r in enumerate(trace.requests):
        delay_s = start_s + r.arrival_s - clock()
        if delay_s > 0:
            await sleep(delay_s)
        tasks.append(asyncio.ensure_future(one(i, r, clock() - start_s)))
        if on_progress is not None:
            on_progress(i + 1, done, i + 1 - done)
    await asyncio.gather(*tasks)
    return [r for r in records if r is not None]


class PromptBuilder:
    """Token-id prompts of exact lengths; shared prefix blocks give identical leading ids."""

    def __init__(self, seed: int = 0, vocab_size: int = 2048, min_token_id: int = 10) -> None:
        if not 0 <= min_token_id < vocab_size:
            raise ValueError(f"need 0 <= min_token_id < vocab_size, got {min_token_id}, {vocab_size}")
        self.seed = seed
        self.low = min_token_id
        self.high = vocab_size

    def _ids(self, key: str, n: int) -> list[int]:
        rng = random.Random(f"{self.seed}:{key}")
        return [rng.randrange(self.low, self.high) for _ in range(n)]

    def prompt(self, index: int, r: TraceRequest, clip_tokens: int | None = None) -> list[int]:
        """``r.prompt_tokens`` ids (at most ``clip_tokens``): prefix blocks first, then ids
        unique to request ``index``."""
        n = r.prompt_tokens if clip_tokens is None else min(r.prompt_tokens, clip_tokens)
        ids: list[int] = []
        for block in r.prefix_blocks:
            ids.extend(self._ids(f"block:{block}", r.prefix_block_tokens))
        ids = ids[:n]
        ids.extend(self._ids(f"request:{index}", n - len(ids)))
        return ids


class HttpSender:
    """One streamed `POST {url}/v1/completions` per request over a shared aiohttp session.

    TTFT is taken at the first SSE event that carries a token (a non-empty `choices`); tokens
    are read from the final `usage` event (`stream_options.include_usage`), or counted as token
    events when the server sends no usage. Only the usage event is parsed as JSON, so the
    replayer stays cheap at high token rates.
    """

    def __init__(self, url: str, model: str, prompts: PromptBuilder, *, clip_prompt_tokens: int | None = None,
                 clip_output_tokens: int | None = None, timeout_s: float = 600.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.url = url.rstrip("/") + "/v1/completions"
        self.model = model
        self.prompts = prompts
        self.clip_prompt_tokens = clip_prompt_tokens
        self.clip_output_tokens = clip_output_tokens
        self.timeout_s = timeout_s
        self.clock = clock
        self._session = None

    async def __aenter__(self) -> HttpSender:
        import aiohttp

        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=self.timeout_s)
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.close()

    def body(self, index: int, r: TraceRequest) -> dict:
        max_tokens = r.output_tokens if self.clip_output_tokens is None else min(r.output_tokens, self.clip_output_tokens)
        return {
            "model": self.model,
            "prompt": self.prompts.prompt(index, r, self.clip_prompt_tokens),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def __call__(self, index: int, r: TraceRequest) -> Outcome:
        import aiohttp

        body = json.dumps(self.body(index, r)).encode()
        out = Outcome()
        start_s = self.clock()
        try:
            async with self._session.post(self.url, data=body, headers={"Content-Type": "application/json"}) as resp:
                out.status = resp.status
                if resp.status != 200:
                    out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    out.e2e_s = self.clock() - start_s
                    return out
                events = 0
                usage_tokens = None
                finished = False
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    if line.startswith(b"data: [DONE]"):
                        finished = True
                        break
                    if b'"choices":[{' in line:
                        if out.ttft_s is None:
                            out.ttft_s = self.clock() - start_s
                        events += 1
                    if b'"usage":{' in line:
                        usage = json.loads(line[6:]).get("usage") or {}
                        usage_tokens = usage.get("completion_tokens")
                out.e2e_s = self.clock() - start_s
                out.output_tokens = usage_tokens if usage_tokens is not None else events
                if not finished:
                    out.error = "stream ended without [DONE]"
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as err:
            out.error = f"{type(err).__name__}: {err}"
            out.e2e_s = self.clock() - start_s
        return out


def summarize_run(records: list[RequestRecord], ttft_slo_s: float | None = None) -> dict:
    """Counts, rates and latency summaries (seconds) of one replay."""
    ok = [r for r in records if r.ok]
    span_s = max((r.sent_s + (r.e2e_s or 0.0) for r in records), default=0.0)
    out = {
        "requests": len(records),
        "succeeded": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "span_s": span_s,
        "output_tokens": sum(r.output_tokens for r in ok),
        "ttft_s": summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": summarize([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": summarize([r.e2e_s for r in ok if r.e2e_s is not None]),
        "send_lag_s": summarize([r.sent_s - r.scheduled_s for r in records]),
    }
    if ttft_slo_s is not None:
        within = sum(1 for r in ok if r.ttft_s is not None and r.ttft_s <= ttft_slo_s)
        out["ttft_slo_s"] = ttft_slo_s
        out["within_ttft_slo"] = within / len(records) if records else None   # failures count as misses
    return out


def print_summary(name: str, s: dict) -> None:
    def ms(d: dict, k: str) -> str:
        return "-" if d[k] is None else f"{1e3 * d[k]:.1f}"

    print(f"\n{name}: {s['requests']} requests, {s['succeeded']} ok, {s['failed']} failed, "
          f"{s['output_tokens']} output tokens in {s['span_s']:.1f} s")
    for e in s["errors"]:
        print(f"  error: {e}")
    print(f"{'ms':<10}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}")
    for key in ("ttft_s", "tpot_s", "e2e_s", "send_lag_s"):
        d = s[key]
        print(f"{key[:-2]:<10}" + "".join(f"{ms(d, k):>9}" for k in ("mean", "p50", "p90", "p99", "max")))
    if "within_ttft_slo" in s:
        print(f"within TTFT SLO ({s['ttft_slo_s']} s): {100 * s['within_ttft_slo']:.1f}%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="Azure CSV (.csv) or Fleet JSONL (.jsonl) trace")
    parser.add_argument("--url", required=True, help="base URL of the OpenAI-compatible server, e.g. http://127.0.0.1:8080")
    parser.add_argument("--model", required=True, help="model name to send")
    parser.add_argument("--start-s", type=float, default=0.0, help="skip the trace's first seconds (default 0)")
    parser.add_argument("--duration-s", type=float, help="replay only this many trace seconds (default: all)")
    parser.add_argument("--speedup", type=float, default=1.0, help="time compression: 2 = twice the arrival rate")
    parser.add_argument("--clip-prompt-tokens", type=int, help="cap prompt tokens (e.g. below the engine's max length)")
    parser.add_argument("--clip-output-tokens", type=int, help="cap output tokens")
    parser.add_argument("--vocab-size", type=int, default=2048, help="token ids are drawn below this (default 2048)")
    parser.add_argument("--min-token-id", type=int, default=10, help="and at or above this (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt token ids (default 0)")
    parser.add_argument("--ttft-slo-s", type=float, help="report the share of requests with TTFT within this")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout (default 600)")
    parser.add_argument("--json-out", type=Path, help="write the summary and every request's record here")
    args = parser.parse_args(argv)

    try:
        trace = load_trace(args.trace).window(args.start_s, args.duration_s).compressed(args.speedup)
    except TraceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not trace.requests:
        print(f"error: no requests in the chosen window of {args.trace}", file=sys.stderr)
        return 2
    print(f"Replaying {len(trace.requests)} requests of {trace.name} over {trace.duration_s:.1f} s "
          f"({trace.mean_rate_per_s():.2f} req/s) to {args.url}", flush=True)
    last = [time.monotonic()]

    def progress(sent: int, done: int, in_flight: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 10.0:
            last[0] = now
            print(f"  sent {sent}/{len(trace.requests)}, in flight {in_flight}", flush=True)

    async def run() -> list[RequestRecord]:
        prompts = PromptBuilder(args.seed, args.vocab_size, args.min_token_id)
        async with HttpSender(args.url, args.model, prompts, clip_prompt_tokens=args.clip_prompt_tokens,
                              clip_output_tokens=args.clip_output_tokens, timeout_s=args.timeout_s) as sender:
            return await replay(trace, sender, on_progress=progress)

    records = asyncio.run(run())
    summary = summarize_run(records, args.ttft_slo_s)
    print_summary(trace.name, summary)
    if args.json_out:
        args.json_out.write_text(json.dumps({"summary": summary, "requests": [asdict(r) for r in records]}))
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
