"""Locust load test of Fleet's router (or any OpenAI-compatible server).

Each simulated user alternates, with weights 1:3, between a plain `/v1/completions` request and
a streamed `/v1/chat/completions` request read to its end. Besides locust's own per-request
statistics, two custom metrics are reported as their own rows (request type `METRIC`):

* `TTFT`: time to the first SSE event carrying content, in ms;
* `TPOT`: time per output token after the first, (end - first) / (tokens - 1), in ms, from
  the final `usage` event (`stream_options.include_usage`);
* `E2E (stream)`: request start to the stream's end, in ms (locust's own row for a streamed
  request times only the response head).

A response that is not 200, or a stream that ends without `[DONE]`, counts as a failure.

Headless, from the repository root (router on port 8080 serving `tiny-llama`):

    .venv/bin/locust -f loadtests/locustfile.py --headless -u 8 -r 2 -t 60s \\
        --host http://127.0.0.1:8080 --csv /tmp/fleet-locust

Environment: `FLEET_MODEL` (default `tiny-llama`), `FLEET_MAX_TOKENS` (default 32),
`FLEET_WAIT_S` (think time between a user's requests, default 0.5), `FLEET_USER_RATE` (requests
per second per user, steady: locust's `constant_throughput`, in place of the think time; the
whole load is users x rate while one request takes less than 1 / rate seconds). A steady load for
a canary rollout (docs/rollouts.md; 3 requests in 4 are streamed, 4.5 streamed req/s here):

    FLEET_MODEL=llama-8b-canary FLEET_USER_RATE=0.5 .venv/bin/locust -f loadtests/locustfile.py \
        --headless -u 12 -r 12 -t 10m --host http://127.0.0.1:8080
"""

from __future__ import annotations

import json
import os
import time

from locust import HttpUser, between, constant_throughput, events, task

MODEL = os.environ.get("FLEET_MODEL", "tiny-llama")
MAX_TOKENS = int(os.environ.get("FLEET_MAX_TOKENS", "32"))
WAIT_S = float(os.environ.get("FLEET_WAIT_S", "0.5"))
USER_RATE = float(os.environ.get("FLEET_USER_RATE", "0") or 0)   # requests/s per user; 0: think time instead
if USER_RATE < 0:
    raise ValueError(f"FLEET_USER_RATE: must be >= 0 requests per second per user (got {USER_RATE})")


def _report(name: str, value_ms: float) -> None:
    events.request.fire(request_type="METRIC", name=name, response_time=value_ms, response_length=0,
                        exception=None, context={})


class RouterUser(HttpUser):
    # requests-based, not FastHttpUser: geventhttpclient's read(n) waits for n bytes, which
    # would hold back the first SSE event and inflate TTFT (tests/integration/test_locustfile.py).
    wait_time = constant_throughput(USER_RATE) if USER_RATE else between(0.5 * WAIT_S, 1.5 * WAIT_S)

    @task(1)
    def completion(self) -> None:
        body = {"model": MODEL, "prompt": "The fleet manager", "max_tokens": MAX_TOKENS, "ignore_eos": True}
        with self.client.post("/v1/completions", json=body, name="completions", catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")

    @task(3)
    def streamed_chat(self) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about fleets."}],
                "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        first = None
        tokens = None
        done = False
        with self.client.post("/v1/chat/completions", json=body, name="chat (stream)", stream=True,
                              catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}")
                return
            buffer = b""
            for chunk in resp.iter_content(chunk_size=None):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data: "):
                        continue
                    if line.startswith(b"data: [DONE]"):
                        done = True
                    elif first is None and b'"content":"' in line and b'"content":""' not in line:
                        first = time.perf_counter()
                    elif b'"usage":{' in line:
                        tokens = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens")
            end = time.perf_counter()
            if not done:
                resp.failure("stream ended without [DONE]")
                return
        _report("E2E (stream)", 1e3 * (end - start))
        if first is not None:
            _report("TTFT", 1e3 * (first - start))
            if tokens and tokens > 1:
                _report("TPOT", 1e3 * (end - first) / (tokens - 1))
