"""Per-request records of one model, by revision and endpoint: what canary analysis compares.

Owns `RequestLog`, a bounded ring of finished requests (router clock time, the endpoint's
version and id, TTFT, TPOT, end-to-end, queue time, failed or not) kept in the model's
`router.pools.pool.PoolShared` across pool replacements. `router.request.attempt`
records one entry per attempt that reached an endpoint; `router.http.admin`
(`GET /admin/v1/revisions/{model}`) returns the entries of a window, and the controller builds
each revision's samples from them (`fleet.rollout.revisions.side_samples`), leaving out a replica's first
seconds after READY. Nothing here does I/O or reads a clock.

What each value measures (router clock, seconds):

- TTFT (time to first token): request arrival at the router until the first server-sent event
  carrying generated text reached the router (`router.protocol.sse.SseRelay.first_token_s`); None for a
  reply that is not streamed (its first byte comes with the whole answer, so it says nothing
  about the first token) and for failures.
- TPOT (time per output token): `router.protocol.sse.SseRelay.time_per_output_token_s` of a streamed
  reply (the stream's `usage` token count when it has one, else its text-carrying events).
- end-to-end: arrival until the last byte was relayed; queue time: arrival until dispatch to
  the endpoint (admission queue and earlier attempts); failed: 5xx, timed out, cut mid-response.
"""

from __future__ import annotations


from router.stats.windows import LatencySummary

DEFAULT_CAPACITY = 50_000
"""Requests kept per model: at 100 requests/s, more than 8 minutes (analysis windows are ~1 min)."""


class RequestLog:
    """The newest ``capacity`` finished requests of one model; times must not decrease."""

    __slots__ = ("_rows", "_next", "capacity")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._rows: list[tuple | None] = [None] * capacity
        self._next = 0

    def record(self, now_s: float, version: str, endpoint: str, *, ttft_s: float | None, tpot_s: float | None,
               e2e_s: float | None, queue_time_s: float, failed: bool) -> None:  # fmt: skip
        """One finished request (module docstring for what each value is)."""
        i = self._next
        self._rows[i] = (now_s, version, endpoint, ttft_s, tpot_s, e2e_s, queue_time_s, failed)
        self._next = i + 1 if i + 1 < self.capacity else 0

    def rows(self, now_s: float, window_s: float) -> list[list]:
        """Requests that finished in ``[now_s - window_s, now_s]``, oldest first, as
        ``[version, endpoint, age_s, ttft_s, tpot_s, e2e_s, queue_time_s, failed]`` (age: seconds
        before ``now_s``; the layout `fleet.rollout.revisions.RequestSample.from_row` reads)."""
        since_s = now_s - window_s
        out = []
        n = self.capacity
        for k in range(n):
            row = self._rows[(self._next + k) % n]
            if row is None or not since_s <= row[0] <= now_s:
                continue
            t, version, endpoint, ttft, tpot, e2e, queue, failed = row
            out.append([version, endpoint, now_s - t, ttft, tpot, e2e, queue, failed])
        return out


def revision_summaries(log: RequestLog, now_s: float, window_s: float) -> dict[str, dict[str, object]]:
    """Per version over the window: ``requests``, ``errors`` and `router.stats.windows.LatencySummary`
    dicts of ``ttft_s``, ``tpot_s``, ``e2e_s`` and ``queue_time_s`` (the model's entry
    ``revisions`` in `GET /admin/v1/stats`)."""
    by_version: dict[str, dict[str, list]] = {}
    counts: dict[str, list[int]] = {}
    for version, _, _, ttft, tpot, e2e, queue, failed in log.rows(now_s, window_s):
        lists = by_version.setdefault(version, {"ttft_s": [], "tpot_s": [], "e2e_s": [], "queue_time_s": []})
        n = counts.setdefault(version, [0, 0])
        n[0] += 1
        n[1] += bool(failed)
        for key, value in (("ttft_s", ttft), ("tpot_s", tpot), ("e2e_s", e2e), ("queue_time_s", queue)):
            if value is not None and not (failed and key != "queue_time_s"):
                lists[key].append(value)
    return {v: {"requests": counts[v][0], "errors": counts[v][1],
                **{k: LatencySummary.of(vals).to_dict() for k, vals in lists.items()}}
            for v, lists in sorted(by_version.items())}  # fmt: skip
