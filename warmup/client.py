"""HTTP calls from the control plane to an engine replica: `/health`, `/metrics` and OpenAI API
requests.

Owns `EngineClient`, the one thin wrapper (httpx) through which the controller, the warm-up
run and the autoscaler (`fleet.controller.autoscaling`, scraping `/metrics`) talk to engines, so unit tests
can replace it with a fake. Not on the router's request path.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Protocol

import httpx


class EngineRequestError(Exception):
    """An engine request failed: connection error, timeout, non-2xx status or a bad body."""


@contextlib.contextmanager
def _engine_errors(what: str, timeout_s: float) -> Iterator[None]:
    """httpx's failures of request ``what`` (``POST /sleep``) as EngineRequestError."""
    try:
        yield
    except httpx.TimeoutException as err:
        raise EngineRequestError(f"{what}: timed out after {timeout_s:g} s") from err
    except httpx.HTTPError as err:
        raise EngineRequestError(f"{what}: {type(err).__name__}: {err}") from err


class EngineAPI(Protocol):
    async def health(self, endpoint: str, timeout_s: float = 2.0) -> bool:
        """True when ``GET {endpoint}/health`` answers 200 within ``timeout_s``."""
        ...

    async def post(self, endpoint: str, path: str, body: dict, timeout_s: float) -> int:
        """POST an OpenAI API request and read the whole response (a stream to its ``[DONE]``).

        Returns the number of completion tokens the engine reported (``usage``), or of streamed
        chunks when it reported none. Raises EngineRequestError.
        """
        ...

    async def metrics(self, endpoint: str, timeout_s: float = 2.0) -> str:
        """The Prometheus text of ``GET {endpoint}/metrics``. Raises EngineRequestError."""
        ...

    async def sleep(self, endpoint: str, level: int, timeout_s: float) -> None:
        """``POST {endpoint}/sleep?level=N`` (vLLM sleep mode). Raises EngineRequestError."""
        ...

    async def wake_up(self, endpoint: str, timeout_s: float) -> None:
        """``POST {endpoint}/wake_up``, answered once the weights are back. Raises EngineRequestError."""
        ...


class EngineClient:
    """`EngineAPI` over httpx with one pooled connection set per process."""

    def __init__(self) -> None:
        # Idle connections go after 4 s, before the engine's 5 s keep-alive closes them
        # (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`): a scrape every 5 s must not reuse a closing one.
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(10.0), limits=httpx.Limits(keepalive_expiry=4.0))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def health(self, endpoint: str, timeout_s: float = 2.0) -> bool:
        try:
            r = await self._http.get(f"{endpoint}/health", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    async def metrics(self, endpoint: str, timeout_s: float = 2.0) -> str:
        try:
            r = await self._http.get(f"{endpoint}/metrics", timeout=timeout_s)
        except httpx.HTTPError as err:
            raise EngineRequestError(f"GET /metrics: {type(err).__name__}: {err}") from err
        if r.status_code != 200:
            raise EngineRequestError(f"GET /metrics: HTTP {r.status_code}")
        return r.text

    async def sleep(self, endpoint: str, level: int, timeout_s: float) -> None:
        await self._control(endpoint, "/sleep", {"level": str(level)}, timeout_s)

    async def wake_up(self, endpoint: str, timeout_s: float) -> None:
        await self._control(endpoint, "/wake_up", {}, timeout_s)

    async def _control(self, endpoint: str, path: str, params: dict[str, str], timeout_s: float) -> None:
        with _engine_errors(f"POST {path}", timeout_s):
            r = await self._http.post(f"{endpoint}{path}", params=params, timeout=timeout_s)
        if r.status_code != 200:
            raise EngineRequestError(f"POST {path}: HTTP {r.status_code}: {r.text[:300]}")

    async def post(self, endpoint: str, path: str, body: dict, timeout_s: float) -> int:
        url = f"{endpoint}{path}"
        with _engine_errors(f"POST {path}", timeout_s):
            if body.get("stream"):
                return await self._post_stream(url, body, timeout_s)
            r = await self._http.post(url, json=body, timeout=timeout_s)
        if r.status_code != 200:
            raise EngineRequestError(f"POST {path}: HTTP {r.status_code}: {r.text[:300]}")
        try:
            data = r.json()
            choices = data["choices"]
        except (ValueError, KeyError, TypeError) as err:
            raise EngineRequestError(f"POST {path}: response is not an OpenAI completion: {r.text[:300]}") from err
        if not choices:
            raise EngineRequestError(f"POST {path}: response has no choices")
        return int((data.get("usage") or {}).get("completion_tokens") or 0)

    async def _post_stream(self, url: str, body: dict, timeout_s: float) -> int:
        chunks = 0
        done = False
        async with self._http.stream("POST", url, json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")
                raise EngineRequestError(f"POST {url}: HTTP {r.status_code}: {text[:300]}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                try:
                    json.loads(payload)
                except ValueError as err:
                    raise EngineRequestError(f"POST {url}: bad SSE event: {payload[:200]}") from err
                chunks += 1
        if not done:
            raise EngineRequestError(f"POST {url}: stream ended without [DONE] after {chunks} chunks")
        return chunks
