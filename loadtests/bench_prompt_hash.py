"""CPU the router spends reading a prompt's blocks and tokens, beside what it already spends parsing it.

For prompts of several lengths in the three forms the proxy sees (token ids, text, chat
messages), times `json.loads` of the body (the proxy parses every body anyway), then
`router.kv.prompt_blocks.route_request` on the parsed body (block hashes, token estimate, session
key), then one `kv-aware` decision (`router.pools.policies.KvAware.choose`: index match, scoring over
8 endpoints, recording the blocks), then tokenization with the pool's tokenizer
(`router.kv.prompt_tokenizer.PromptTokenizer.prompt_token_ids`: the chat template and `tokenizers`, what a
pool with `tokenizer` adds for text and chat; token-id prompts need none): a prompt seen for the
first time, and the next turn of a chat whose earlier turn was tokenized before (its history's
pieces remembered, `router.kv.token_segments`; a 40-token reply and a 40-token question added). Process CPU time, best
of `--repeats` runs of `--n` calls. Prompt lengths are counted in tokens of that tokenizer (the
generated tiny model's by default, `fleet.engines.tinymodel.make_tiny_tokenizer`; `--tokenizer
DIR` for another model's).

Then, for `router.kv.tokenize.OFFLOAD_CHARS` and the GIL: the wall time of a round trip to a worker
thread (`run_in_executor` of a no-op) against the time to tokenize texts of several sizes, and how
much a pure-Python loop on the main thread still gets done while a worker thread tokenizes long
prompts with `Tokenizer.encode` (holds the GIL) or `encode_batch_fast` (releases it).

Usage: python -m loadtests.bench_prompt_hash [--n 200] [--repeats 5] [--gil-seconds 2] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from router.pools.endpoint import EndpointState
from router.pools.policies import KvAware
from router.kv.prompt_blocks import route_request
from router.kv.prompt_tokenizer import PromptTokenizer
from router.kv.tokenizer_files import load_tokenizer

_WORDS = ("the scheduler inside each engine builds a batch at every step prefill processes prompt tokens of new "
          "requests decode produces one token for every running sequence chunked splits long prompts so that "
          "decoding sequences are not starved when cache is full preempts youngest frees its blocks and "
          "recomputes them later router spreads traffic replica queue placement memory warmup").split()  # fmt: skip


def text_of(tokens: int, tok: PromptTokenizer, rng: random.Random) -> str:
    """Words of ordinary English text, about ``tokens`` tokens long under ``tok``."""
    sample = " ".join(rng.choice(_WORDS) for _ in range(2000))
    per_word = len(tok.encode(sample, False)) / 2000
    return " ".join(rng.choice(_WORDS) for _ in range(int(tokens / per_word)))


def bodies(tokens: int, tok: PromptTokenizer, rng: random.Random) -> dict[str, bytes]:
    ids = [rng.randrange(10, 2000) for _ in range(tokens)]
    words = text_of(tokens, tok, rng)
    half = len(words) // 2
    chat = [{"role": "system", "content": words[:half]}, {"role": "user", "content": words[half:]}]
    reply = text_of(40, tok, rng)
    next_turn = [*chat, {"role": "assistant", "content": reply}, {"role": "user", "content": text_of(40, tok, rng)}]
    return {
        "token ids": json.dumps({"model": "m", "prompt": ids, "max_tokens": 16}).encode(),
        "text": json.dumps({"model": "m", "prompt": words, "max_tokens": 16}).encode(),
        "chat": json.dumps({"model": "m", "messages": chat, "max_tokens": 16}).encode(),
        "chat, next turn": json.dumps({"model": "m", "messages": next_turn, "max_tokens": 16}).encode(),
    }


def best_us(fn, n: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, time.process_time() - start)
    return 1e6 * best / n


def wall_us(fn, n: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - start)
    return 1e6 * best / n


def cost_table(tok: PromptTokenizer, n: int, repeats: int) -> None:
    rng = random.Random(0)
    forget = tok.segments.clear if tok.segments is not None else (lambda: None)
    endpoints = [EndpointState(f"e{i}", f"http://127.0.0.1:{9000 + i}") for i in range(8)]
    print("| prompt | form | body | json.loads | route_request | kv-aware choose | tokenize | tokenize / parse |")
    print("|---|---|---|---|---|---|---|---|")
    for tokens in (1_000, 8_000, 32_000):
        calls = max(5, n * 1_000 // tokens)   # long prompts: fewer calls per timing
        forms = bodies(tokens, tok, rng)
        for form, body in forms.items():
            doc = json.loads(body)
            policy = KvAware()
            request = route_request(doc)
            parse_us = best_us(lambda: json.loads(body), calls, repeats)
            blocks_us = best_us(lambda: route_request(doc), calls, repeats)
            choose_us = best_us(lambda: policy.choose(endpoints, request, 0.0), calls, repeats)
            if form == "token ids":
                tokenize, ratio, count = "—", "—", tokens
            else:
                count = len(tok.prompt_token_ids(doc))
                if form == "chat, next turn":   # the earlier turn's messages were tokenized before
                    tok.prompt_token_ids(json.loads(forms["chat"]))
                    tokenize_us = best_us(lambda: tok.prompt_token_ids(doc), calls, repeats)
                else:                           # first sight: nothing remembered
                    tokenize_us = best_us(lambda: (forget(), tok.prompt_token_ids(doc)), calls, repeats)
                tokenize, ratio = f"{tokenize_us:,.0f} us", f"{tokenize_us / parse_us:.1f}x"
            print(f"| {count:,} tokens | {form} | {len(body) / 1024:.0f} KiB | {parse_us:,.0f} us | {blocks_us:,.0f} us "
                  f"| {choose_us:,.0f} us | {tokenize} | {ratio} |", flush=True)


def offload_table(tok: PromptTokenizer, n: int, repeats: int) -> None:
    rng = random.Random(1)
    pool = ThreadPoolExecutor(1)

    async def hop() -> float:
        loop = asyncio.get_running_loop()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(n):
                await loop.run_in_executor(pool, int)
            best = min(best, time.perf_counter() - start)
        return 1e6 * best / n

    hop_us = asyncio.run(hop())
    print(f"\nround trip to a worker thread (run_in_executor of a no-op, wall): {hop_us:.0f} us\n")
    print("| text | tokens | tokenize on the loop (wall) |")
    print("|---|---|---|")
    for chars in (1_024, 4_096, 16_384, 65_536):
        text = text_of(chars, tok, rng)[:chars]
        doc = {"prompt": text}
        us = wall_us(lambda: tok.prompt_token_ids(doc), max(5, n * 1_024 // chars), repeats)
        print(f"| {chars:,} chars | {len(tok.prompt_token_ids(doc)):,} | {us:,.0f} us |", flush=True)
    pool.shutdown()


def gil_table(tok: PromptTokenizer, seconds: float = 2.0) -> None:
    """How much a pure-Python loop on the main thread gets done while a worker thread tokenizes."""
    text = text_of(32_000, tok, random.Random(2))
    raw = tok.tokenizer

    def spin(duration_s: float) -> int:
        count, end = 0, time.perf_counter() + duration_s
        while time.perf_counter() < end:
            count += 1
        return count

    def with_worker(work) -> float:
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                work()

        worker = threading.Thread(target=loop)
        worker.start()
        spin(0.2)   # the worker under way
        count = spin(seconds)
        stop.set()
        worker.join()
        return count

    alone = spin(seconds)
    held = with_worker(lambda: raw.encode(text))
    released = with_worker(lambda: raw.encode_batch_fast([text]))
    print("\n| a worker thread tokenizing 32k-token prompts | main-thread Python loop progress |")
    print("|---|---|")
    print(f"| none | 100% ({alone:,} iterations in {seconds:g} s) |")
    print(f"| `Tokenizer.encode` | {100 * held / alone:.0f}% |")
    print(f"| `Tokenizer.encode_batch_fast` | {100 * released / alone:.0f}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200, help="calls per timing for 1k-token prompts (default 200)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per cell, best kept (default 5)")
    parser.add_argument("--gil-seconds", type=float, default=2.0, help="length of each GIL measurement (default 2)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a model directory with tokenizer.json (default: the generated tiny model's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.tokenizer
        if directory is None:
            from fleet.engines.tinymodel import make_tiny_tokenizer

            directory = make_tiny_tokenizer(Path(tmp) / "tokenizer")
        tok = load_tokenizer(str(directory))
    cost_table(tok, args.n, args.repeats)
    offload_table(tok, args.n, args.repeats)
    gil_table(tok, args.gil_seconds)


if __name__ == "__main__":
    main()
