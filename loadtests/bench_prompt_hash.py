"""CPU the router spends reading a prompt's blocks, beside what it already spends parsing it.

For prompts of several lengths in the three forms the proxy sees (token ids, text, chat
messages), times `json.loads` of the body (the proxy parses every body anyway), then
`router.prompt_blocks.route_request` on the parsed body (block hashes, token estimate, session
key), then one `kv-aware` decision (`router.policies.KvAware.choose`: index match, scoring over
8 endpoints, recording the blocks). Process CPU time, best of `--repeats` runs of `--n` calls.

Usage: python -m loadtests.bench_prompt_hash [--n 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from router.policies import KvAware
from router.endpoint import EndpointState
from router.prompt_blocks import route_request


def bodies(tokens: int, rng: random.Random) -> dict[str, bytes]:
    ids = [rng.randrange(10, 32000) for _ in range(tokens)]
    words = " ".join(f"w{rng.randrange(1000)}" for _ in range(tokens))   # ~4-5 bytes per "token"
    half = len(words) // 2
    chat = [{"role": "system", "content": words[:half]}, {"role": "user", "content": words[half:]}]
    return {
        "token ids": json.dumps({"model": "m", "prompt": ids, "max_tokens": 16}).encode(),
        "text": json.dumps({"model": "m", "prompt": words, "max_tokens": 16}).encode(),
        "chat": json.dumps({"model": "m", "messages": chat, "max_tokens": 16}).encode(),
    }


def best_us(fn, n: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, time.process_time() - start)
    return 1e6 * best / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200, help="calls per timing (default 200)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per cell, best kept (default 5)")
    args = parser.parse_args()
    rng = random.Random(0)
    endpoints = [EndpointState(f"e{i}", f"http://127.0.0.1:{9000 + i}") for i in range(8)]
    print("| prompt | form | body | json.loads | route_request | kv-aware choose | blocks / parse |")
    print("|---|---|---|---|---|---|---|")
    for tokens in (1_000, 8_000, 32_000):
        for form, body in bodies(tokens, rng).items():
            doc = json.loads(body)
            policy = KvAware()
            request = route_request(doc)
            parse_us = best_us(lambda: json.loads(body), args.n, args.repeats)
            blocks_us = best_us(lambda: route_request(doc), args.n, args.repeats)
            choose_us = best_us(lambda: policy.choose(endpoints, request, 0.0), args.n, args.repeats)
            print(f"| {tokens:,} tokens | {form} | {len(body) / 1024:.0f} KiB | {parse_us:.0f} us | {blocks_us:.0f} us "
                  f"| {choose_us:.0f} us | {(blocks_us + choose_us) / parse_us:.2f} |", flush=True)


if __name__ == "__main__":
    main()
