"""The router's tokenizers: for each pool that names one, the token ids the engine will compute
for a prompt.

Owns `PoolTokenizers`, the router's set of loaded tokenizers
(`router.kv.prompt_tokenizer.PromptTokenizer`): loaded in a worker thread
(`router.kv.tokenizer_files.load_tokenizer`) when a pool names a directory or an ``hf://`` source
(`router.pools.spec.PoolSpec.tokenizer`), used by `router.request.prepare.add_token_ids` for every
request of such a pool to fill `router.kv.prompt_blocks.RouteRequest.token_ids`, which the exact KV
index matches against the engines' KV events. A pool whose tokenizer is loading or failed still
routes, on the approximate (text-block) view only; a failed load is logged with its reason and
counted. Also owns `prompt_chars`, which decides where a prompt is tokenized.

**Cost.** Tokenization is Rust, but `tokenizers.Tokenizer.encode` holds the GIL while it runs;
``encode_batch_fast`` releases it (pyo3 ``py.detach``, bindings/python/src/tokenizer.rs) and,
without character offsets, is also faster. So a prompt of at least `OFFLOAD_CHARS` characters is
rendered and tokenized in a worker thread while the event loop serves other requests; a shorter
one inline, where the hop to a thread would cost more than the work (figures and command:
docs/benchmarks.md, "Tokenizing in the router").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from router.kv.chat_template import UnsupportedPrompt
from router.kv.prompt_tokenizer import PromptTokenizer
from router.kv.tokenizer_files import TokenizerError, load_tokenizer

log = logging.getLogger(__name__)

OFFLOAD_CHARS = 2_048
"""Prompts of at least this many characters (text, or the sum of a chat's message contents) are
tokenized in a worker thread; shorter ones on the event loop. Measured (docs/benchmarks.md,
"Tokenizing in the router"; shared machine): the round trip to a thread costs 44-121 us of wall
time, what tokenizing ~200 characters does, while 2 KiB take 0.4-1.2 ms and 4 KiB 1.6-2.6 ms:
below this the loop is held for about a millisecond at most, above it the hop costs about a
tenth of the work it moves off the loop."""
TOKENIZE_THREADS = 2
"""Worker threads that tokenize long prompts (one per core of the router's usual 2-core pod)."""
MAX_PENDING = 64
"""Long prompts waiting for a tokenizing thread beyond which a request is routed without token
ids (approximately) rather than queued: routing must not wait behind a burst of long prompts."""
MAX_TOKENIZERS = 32
"""Tokenizers kept loaded; the least recently used directory is dropped beyond it."""
RETRY_AFTER_S = 60.0
"""Seconds before a directory whose load failed is tried again (its files may arrive later)."""

LOAD_OUTCOMES = ("ok", "missing", "unreadable", "invalid", "chat_template")
"""Values of the `outcome` label of `fleet_router_tokenizer_loads_total` (the `reason` of
`TokenizerError`, or ok)."""
TOKENIZE_OUTCOMES = ("inline", "thread", "unsupported", "failed", "busy", "not_loaded")
"""Values of the `outcome` label of `fleet_router_prompt_tokenizations_total`: tokenized on the
loop or in a thread; a prompt that cannot be reproduced (see the module docstring), a template or
tokenizer error, too many long prompts waiting, the pool's tokenizer not (yet) loaded."""


def prompt_chars(doc: Mapping[str, Any]) -> int:
    """Characters of a body's prompt (text, the first of a batch) or of what its messages give the
    chat template (text content and parts, an assistant's reasoning, tool-call arguments given as
    text): what decides between tokenizing on the loop and in a thread. Cheap (no copy)."""
    prompt = doc.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return len(prompt[0]) if prompt and isinstance(prompt[0], str) else 0
    messages = doc.get("messages")
    total = 0
    if isinstance(messages, list):
        for m in messages:
            if not isinstance(m, Mapping):
                continue
            content = m.get("content")
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                for p in content:
                    text = p.get("text") if isinstance(p, Mapping) else p
                    total += len(text) if isinstance(text, str) else 0
            reasoning = m.get("reasoning")
            total += len(reasoning) if isinstance(reasoning, str) else 0
            calls = m.get("tool_calls")
            if isinstance(calls, list):
                for call in calls:
                    function = call.get("function") if isinstance(call, Mapping) else None
                    arguments = function.get("arguments") if isinstance(function, Mapping) else None
                    total += len(arguments) if isinstance(arguments, str) else 0
    return total


# ----- the router's tokenizers ------------------------------------------------------------------

@dataclass(eq=False)
class _Entry:
    tokenizer: PromptTokenizer | None = None
    loading: asyncio.Future | None = None
    error: TokenizerError | None = None
    failed_at_s: float = 0.0


class PoolTokenizers:
    """The tokenizers of the router's pools, one per directory, loaded in a worker thread.

    `want(directory)` (on a pool put, and lazily on a request) starts a load unless the directory
    is loaded, loading, or failed less than `RETRY_AFTER_S` ago; `get` returns the loaded
    tokenizer or None; `token_ids(directory, doc)` the prompt's ids or None (not loaded, not
    reproducible, too busy). Metrics on ``registry``: `fleet_router_tokenizer_loads_total{outcome}`,
    `fleet_router_tokenizers{state}` (loaded, loading, failed directories) and
    `fleet_router_prompt_tokenizations_total{outcome}`. ``clock``: monotonic seconds (retries).
    Must be used from one event loop; `close` stops the threads.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, clock: Callable[[], float] = time.monotonic,
                 loader: Callable[[str], PromptTokenizer] = load_tokenizer, offload_chars: int = OFFLOAD_CHARS,
                 threads: int = TOKENIZE_THREADS, max_pending: int = MAX_PENDING,
                 max_tokenizers: int = MAX_TOKENIZERS) -> None:  # fmt: skip
        self._entries: dict[str, _Entry] = {}
        self._clock = clock
        self._loader = loader
        self.offload_chars = offload_chars
        self._threads = threads
        self._executor: ThreadPoolExecutor | None = None
        self._pending = 0
        self._max_pending = max_pending
        self._max_tokenizers = max_tokenizers
        registry = registry if registry is not None else CollectorRegistry()
        self._loads = Counter("fleet_router_tokenizer_loads", "Tokenizer loads from a pool's tokenizer directory, "
                              "by outcome: ok, or why it failed (missing, unreadable, invalid, chat_template); a pool "
                              "whose tokenizer failed routes on the approximate prefix view only.",
                              ["outcome"], registry=registry)  # fmt: skip
        self._states = Gauge("fleet_router_tokenizers", "Tokenizer directories by state (loaded, loading, failed).",
                             ["state"], registry=registry)  # fmt: skip
        self._states.labels("loaded").set_function(lambda: self._count("loaded"))
        self._states.labels("loading").set_function(lambda: self._count("loading"))
        self._states.labels("failed").set_function(lambda: self._count("failed"))
        tokenized = Counter("fleet_router_prompt_tokenizations", "Requests of pools with a tokenizer, by outcome: "
                            "inline (tokenized on the event loop), thread (a long prompt, in a worker thread), "
                            "unsupported (images, tools, ...: no token ids), failed (the chat template or tokenizer "
                            "refused it), busy (too many long prompts waiting), not_loaded.",
                            ["outcome"], registry=registry)  # fmt: skip
        self._outcome = {o: tokenized.labels(o) for o in TOKENIZE_OUTCOMES}

    def _count(self, state: str) -> int:
        n = 0
        for e in self._entries.values():
            s = "loaded" if e.tokenizer is not None else "loading" if e.loading is not None else "failed"
            n += s == state
        return n

    def error(self, directory: str) -> TokenizerError | None:
        """Why ``directory``'s last load failed, or None."""
        entry = self._entries.get(directory)
        return entry.error if entry is not None else None

    def get(self, directory: str) -> PromptTokenizer | None:
        """The loaded tokenizer of ``directory``; None while loading or after a failure."""
        entry = self._entries.get(directory)
        return entry.tokenizer if entry is not None else None

    def want(self, directory: str | None) -> None:
        """Start loading ``directory`` in a thread unless it is loaded, loading, or failed less
        than `RETRY_AFTER_S` ago. Needs a running event loop; None does nothing."""
        if directory is None:
            return
        entry = self._entries.get(directory)
        if entry is not None:
            if entry.tokenizer is not None or entry.loading is not None:
                self._entries[directory] = self._entries.pop(directory)   # most recently wanted last
                return
            if self._clock() - entry.failed_at_s < RETRY_AFTER_S:
                return
        entry = entry or _Entry()
        self._entries[directory] = entry
        entry.loading = asyncio.get_running_loop().run_in_executor(self._pool(), self._loader, directory)
        entry.loading.add_done_callback(lambda f, d=directory, e=entry: self._loaded(d, e, f))
        while len(self._entries) > self._max_tokenizers:
            del self._entries[next(iter(self._entries))]

    def _loaded(self, directory: str, entry: _Entry, future: asyncio.Future) -> None:
        entry.loading = None
        if future.cancelled():
            return
        exc = future.exception()
        if exc is None:
            entry.tokenizer, entry.error = future.result(), None
            self._loads.labels("ok").inc()
            log.info("tokenizer loaded from %s", directory)
            return
        if not isinstance(exc, TokenizerError):
            exc = TokenizerError(directory, "invalid", f"{type(exc).__name__}: {exc}")
        entry.error, entry.failed_at_s = exc, self._clock()
        self._loads.labels(exc.reason).inc()
        log.warning("%s; its pool routes on the approximate prefix view (retried in %.0f s)", exc, RETRY_AFTER_S)

    async def wait_loaded(self, directory: str) -> PromptTokenizer | None:
        """Start loading ``directory`` if needed and wait for the outcome (tests, benchmarks)."""
        self.want(directory)
        entry = self._entries.get(directory)
        if entry is not None and entry.loading is not None:
            await asyncio.wait([entry.loading])
        return self.get(directory)

    async def token_ids(self, directory: str, doc: Mapping[str, Any]) -> list[int] | None:
        """The token ids of ``doc``'s prompt under ``directory``'s tokenizer (see
        `PromptTokenizer.prompt_token_ids`), or None: tokenizer not loaded (a load is started),
        a prompt that cannot be reproduced, a template error, or `MAX_PENDING` long prompts
        already waiting. Long prompts (`offload_chars`) go to a worker thread. Never raises."""
        tokenizer = self.get(directory)
        if tokenizer is None:
            self.want(directory)
            self._outcome["not_loaded"].inc()
            return None
        if prompt_chars(doc) < self.offload_chars:
            outcome = "inline"
            try:
                ids = tokenizer.prompt_token_ids(doc)
            except UnsupportedPrompt:
                outcome, ids = "unsupported", None
            except ValueError:
                outcome, ids = "failed", None
            self._outcome[outcome].inc()
            return ids
        if self._pending >= self._max_pending:
            self._outcome["busy"].inc()
            return None
        self._pending += 1
        try:
            outcome, ids = await asyncio.get_running_loop().run_in_executor(self._pool(), _tokenize, tokenizer, doc)
        finally:
            self._pending -= 1
        self._outcome[outcome].inc()
        return ids

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._threads, thread_name_prefix="tokenize")
        return self._executor

    def close(self) -> None:
        """Stop the worker threads (loads in flight finish in the background)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def _tokenize(tokenizer: PromptTokenizer, doc: Mapping[str, Any]) -> tuple[str, list[int] | None]:
    """`PromptTokenizer.prompt_token_ids` in a worker thread, with its outcome label."""
    try:
        return "thread", tokenizer.prompt_token_ids(doc)
    except UnsupportedPrompt:
        return "unsupported", None
    except ValueError:
        return "failed", None

