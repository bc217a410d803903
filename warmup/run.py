"""The warm-up run and the readiness gate.

Owns `run_warmup` (send a plan's requests to one replica through the engine's real OpenAI API,
one after another, and record what happened) and `readiness_gate` (the single rule the
controller applies before a replica may join the router's pool). Called by the controller.
Later work (convergence of warm-up latency, slow-start weights) extends `WarmupResult` and the
gate here, not at the call site.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from warmup.client import EngineAPI, EngineRequestError
from warmup.plan import WarmupPlan, WarmupRequest


@dataclass
class WarmupResult:
    passed: bool
    requests_sent: int
    latencies_s: list[float] = field(default_factory=list)   # per successful request, in order
    reason: str | None = None                                # why it failed


def request_body(req: WarmupRequest, model: str) -> tuple[str, dict]:
    """(path, JSON body) of one warm-up request in the OpenAI API."""
    if req.kind == "chat":
        path = "/v1/chat/completions"
        body: dict = {"model": model, "messages": [{"role": "user", "content": req.prompt}]}
    else:
        path = "/v1/completions"
        body = {"model": model, "prompt": req.prompt}
    body.update(max_tokens=req.max_tokens, stream=req.stream, temperature=0.0)
    return path, body


async def run_warmup(
    api: EngineAPI, endpoint: str, model: str, plan: WarmupPlan, clock: Callable[[], float]
) -> WarmupResult:
    """Send every request of ``plan`` to ``endpoint``; stop at the first failure.

    Args:
        api: engine HTTP wrapper.
        endpoint: base URL of the replica, e.g. ``http://127.0.0.1:8101``.
        model: served model name.
        plan: the deployment's warm-up plan.
        clock: monotonic seconds, injected.
    """
    result = WarmupResult(passed=False, requests_sent=0)
    if not plan.enabled:
        result.passed = True
        return result
    for req in plan.requests:
        path, body = request_body(req, model)
        for attempt in range(req.repeat):
            started_s = clock()
            result.requests_sent += 1
            try:
                await api.post(endpoint, path, body, timeout_s=plan.request_timeout_seconds)
            except EngineRequestError as err:
                result.reason = f"warm-up request {result.requests_sent} ({req.kind}, try {attempt + 1}): {err}"
                return result
            result.latencies_s.append(clock() - started_s)
    result.passed = True
    return result


def readiness_gate(health_passed: bool, warmup: WarmupResult | None) -> bool:
    """A replica joins the pool only when /health passed AND its warm-up run passed."""
    return health_passed and warmup is not None and warmup.passed
