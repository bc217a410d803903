"""The warm-up plan of a deployment (`spec.warmup` in the YAML).

Parsed as part of `fleet.spec.InferenceDeployment`; executed by `warmup.run.run_warmup`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fleet.base.rules import CrossFieldRule
from fleet.base.spec import SpecModel


class WarmupRequest(SpecModel):
    """One warm-up request sent to the engine's OpenAI API, ``repeat`` times in a row."""

    kind: Literal["completion", "chat"] = Field(
        "completion", description="`completion` posts /v1/completions; `chat` posts /v1/chat/completions."
    )
    prompt: str = Field("Hello, warm-up.", min_length=1, description="Prompt text (chat: the user message).")
    max_tokens: int = Field(16, ge=1, le=4096, description="`max_tokens` of the request.")
    stream: bool = Field(False, description="Request a streamed (SSE) response and read it to the end.")
    repeat: int = Field(1, ge=1, le=1000, description="How many times the request is sent, one after another.")


def _default_requests() -> list[WarmupRequest]:
    # One plain completion and one streamed chat completion: exercises both API routes, the
    # tokenizer's chat template and the streaming path before any client request arrives.
    return [
        WarmupRequest(kind="completion", prompt="Hello, warm-up.", max_tokens=16, repeat=2),
        WarmupRequest(kind="chat", prompt="Say hello.", max_tokens=16, stream=True),
    ]


class WarmupPlan(SpecModel):
    """What a replica must pass, after ``/health``, before it joins the router's pool."""

    enabled: bool = Field(True, description="False admits a replica as soon as /health passes.")
    requests: list[WarmupRequest] = Field(
        default_factory=_default_requests,
        description="The warm-up requests, sent one after another; the first that fails fails the warm-up.",
    )
    request_timeout_seconds: float = Field(
        120.0, gt=0, description="Timeout of each warm-up request, in seconds."
    )

    cross_field_rules = (
        CrossFieldRule(
            cel="!self.enabled || !has(self.requests) || size(self.requests) > 0",
            holds=lambda w: not w.enabled or bool(w.requests),
            field="requests", message="must list at least one request when warm-up is enabled",
            breaks={"warmup": {"enabled": True, "requests": []}},
            keeps=({"warmup": {"enabled": False, "requests": []}}, {"warmup": {"enabled": True}}),
        ),
    )

    @property
    def total_requests(self) -> int:
        """Number of requests one warm-up run sends."""
        return sum(r.repeat for r in self.requests) if self.enabled else 0
