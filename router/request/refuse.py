"""The answers the router gives itself on the request path, counted where they are sent.

Owns `Refusals` (one per `router.request.proxy.Proxy`): every error the proxy answers without an
engine's answer to relay (400, 404, 413, 502, 503, 504) goes through it, in OpenAI's format
(`router.protocol.errors.error_body`), counted in `fleet_router_rejected_requests_total`
(`router.stats.metrics.RouterMetrics.reject`) and, for a model with a pool, in its windowed
rejections (`router.pools.pool.PoolShared.rejected`). Called by `router.request.proxy`,
`router.request.attempt` and `router.request.relay`. Only error paths run here.
"""

from __future__ import annotations

from collections.abc import Callable

from router.pools.pool import PoolShared, PoolTable
from router.protocol.errors import error_body
from router.request.asgi_io import Send, reflect, send_json
from router.stats.metrics import RouterMetrics

MAX_LISTED_MODELS = 20
"""Most model names a 404 lists."""


class Refusals:
    """Sends and counts the router's own error answers.

    `pools`: the router's pools (whether a model named in an answer has one decides its metric
    label); `clock`: the router's clock (seconds), stamping the windowed rejection;
    `retry_after_s`: the Retry-After (whole seconds) of a 503 a client may retry soon.
    """

    __slots__ = ("_pools", "_metrics", "_clock", "retry_after")

    def __init__(self, pools: PoolTable, metrics: RouterMetrics, clock: Callable[[], float],
                 retry_after_s: int) -> None:  # fmt: skip
        self._pools = pools
        self._metrics = metrics
        self._clock = clock
        self.retry_after = [(b"retry-after", str(int(retry_after_s)).encode())]
        """The Retry-After header of a 503 a client may retry soon."""

    def count(self, model: str, status: int) -> None:
        """Count one answer of `status` the router gave itself for a request naming `model`
        ("" if none)."""
        self._metrics.reject(model, status, self._pools.get(model) is not None)

    async def reject(self, send: Send, status: int, model: str, body: bytes,
                     extra_headers: list[tuple[bytes, bytes]] | None = None,
                     shared: PoolShared | None = None) -> None:  # fmt: skip
        """Count and send the JSON error `body` with `status`; `shared`: the model's pool state,
        whose windowed stats count the rejection (None: the request never reached a pool)."""
        self.count(model, status)
        if shared is not None:
            shared.rejected(self._clock())
        await send_json(send, status, body, extra_headers)

    async def unknown_model(self, send: Send, model: str) -> None:
        """`model` has no pool: 503 + Retry-After while it is awaited after a restart
        (`router.pools.pool.PoolTable.awaiting`), else 404 listing the models served (at most
        `MAX_LISTED_MODELS`; the name echoed through `reflect`)."""
        pools = self._pools
        if pools.awaiting(model):
            self._metrics.reject(model, 503, True)   # a model of the models file: a bounded label
            await send_json(send, 503, error_body(
                f"model {reflect(model)} is not available yet: the router restarted and its pools are being "
                "published again; retry later", type_="server_error", code="model_not_published"),
                self.retry_after)  # fmt: skip
            return
        models = pools.models()
        known = ", ".join(reflect(m) for m in models[:MAX_LISTED_MODELS]) or "(none)"
        if len(models) > MAX_LISTED_MODELS:
            known += f" and {len(models) - MAX_LISTED_MODELS} more (GET /v1/models)"
        await self.reject(send, 404, model, error_body(
            f"model {reflect(model)} is not served here; known models: {known}", param="model",
            code="model_not_found"))  # fmt: skip
