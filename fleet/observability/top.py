"""`fleet top`: a live terminal view of a local fleet, per deployment and version.

Owns the view: `TopRow` and `build_rows` (pure: state.json + router statistics -> rows),
`render` / `TopFrame` (rows -> a rich table in the layout that fits the terminal: one line per
row where it fits, else the figures in a narrow table and the rest on a line per row, readable
at 80 columns), `RouterReader` (the one I/O seam: the router's
``GET /admin/v1/stats`` with the admin token from the state directory, and ``GET /metrics`` for
the 5xx counters) and `run_top` (the refresh loop under `rich.live.Live`). Called by
`fleet.cli.observability`, which hands it the local fleet's state (`fleet.local.state.StateStore`:
``read`` and the admin token), so this module knows nothing of the state directory's layout.

Columns: replicas by state (from state.json), request rate, TTFT p50 / p99 (the router's
windowed nearest-rank quantiles, `router.stats.windows`), TPOT p99 (streamed replies), queue time p99, errors/s (5xx from endpoints plus the
router's own rejections, from counter deltas between two frames), the last scaling decision
and the rollout step (when the state has one). The router's statistics are per model; every
version of a deployment shows its model's figures until the router reports them per version.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.table import Table
from rich.text import Text

STATE_ORDER = ("READY", "WARMING", "STARTING", "PENDING", "PLACED", "PULLING", "CACHING", "DRAINING")


@dataclass(frozen=True)
class TopRow:
    deployment: str
    version: str
    model: str
    replicas: dict[str, int]        # status -> count (terminal statuses left out, FAILED_* summed)
    desired: int
    rate_per_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p99_s: float | None
    queue_p99_s: float | None
    errors_per_s: float | None
    in_flight: int | None
    queued: int | None
    last_scaling: str
    rollout: str


def _p(summary: Any, key: str) -> float | None:
    return summary.get(key) if isinstance(summary, Mapping) else None


def describe_scaling(d: Mapping[str, Any], clock_s: float | None) -> str:
    """The last change of a deployment's desired replicas, from its state entry:
    ``up 1->3 queue_time_above_target`` when the autoscaler's latest decision moved it, else
    ``=3 12 s ago: queue_time_above_target`` (when and why desired last changed), else ``-``."""
    last = d.get("last_scaling") or {}
    if last.get("direction") in ("up", "down"):
        return f"{last['direction']} {last.get('previous')}->{last.get('desired')} {last.get('reason', '')}".strip()
    at_s = d.get("desired_at_s")
    if at_s is None:
        return "-"
    reason = str(d.get("desired_reason", "")).removeprefix("autoscaler: ")
    age = f" {clock_s - at_s:.0f} s ago" if clock_s is not None else ""
    return f"={d.get('desired')}{age}: {reason}"


def describe_rollout(d: Mapping[str, Any]) -> str:
    """The rollout step of a deployment's state entry, when the controller records one: its
    ``revisions.rollout`` (`fleet.rollout.machine.RolloutState.to_dict`: ``Progressing step 1
    canary 25``), or a ``rollout`` entry of the same shape."""
    r = d.get("rollout") or (d.get("revisions") or {}).get("rollout")
    if not r:
        return "-"
    if isinstance(r, Mapping):
        step = r.get("step", r.get("step_index"))
        weight = r.get("canary_weight", r.get("weight"))
        parts = [str(r.get("phase") or r.get("state") or "")]
        if step is not None:
            parts.append(f"step {step}")
        if weight is not None:
            parts.append(f"canary {weight:g} %" if isinstance(weight, (int, float)) else f"canary {weight}")
        return " ".join(p for p in parts if p) or "-"
    return str(r)


def build_rows(state: Mapping[str, Any], stats: Mapping[str, Mapping[str, Any]],
               errors_per_s: Mapping[str, float] | None = None, now_unix: float | None = None) -> list[TopRow]:  # fmt: skip
    """One row per (deployment, version) with a replica that is not TERMINATED (a deployment
    with none gets one row under its spec's version, so it never vanishes).

    Args:
        state: state.json (`fleet.controller.reconcile.Controller.snapshot` plus `fleet up`'s extras).
        stats: ``GET /admin/v1/stats`` ``models`` (`router.stats.windows.ModelStats.snapshot` per model).
        errors_per_s: 5xx/s per model (None where unknown, e.g. the first frame).
        now_unix: the wall clock now, to age the state's controller clock (``clock_s`` was
            read at ``updated_at_unix``).
    """
    errors_per_s = errors_per_s or {}
    clock_s = state.get("clock_s")
    if clock_s is not None and state.get("updated_at_unix") is not None and now_unix is not None:
        clock_s += max(0.0, now_unix - state["updated_at_unix"])
    by_key: dict[tuple[str, str], dict[str, int]] = {}
    for r in state.get("replicas", []):
        status = r.get("status", "?")
        if status == "TERMINATED":
            continue
        key = (r["deployment"], str(r.get("revision") or ""))
        counts = by_key.setdefault(key, {})
        label = "FAILED" if status.startswith("FAILED_") else status
        counts[label] = counts.get(label, 0) + 1
    rows = []
    for name, d in state.get("deployments", {}).items():
        versions = sorted(v for (dep, v) in by_key if dep == name) or ["-"]
        model = d.get("model", "")
        s = stats.get(model, {})
        for version in versions:
            rows.append(TopRow(
                deployment=name, version=version, model=model, replicas=by_key.get((name, version), {}),
                desired=int(d.get("desired", 0)),
                rate_per_s=s.get("arrival_rate_per_s"),
                ttft_p50_s=_p(s.get("ttft_s"), "p50"), ttft_p99_s=_p(s.get("ttft_s"), "p99"),
                tpot_p99_s=_p(s.get("tpot_s"), "p99"), queue_p99_s=_p(s.get("queue_time_s"), "p99"),
                errors_per_s=errors_per_s.get(model), in_flight=s.get("in_flight"), queued=s.get("queued"),
                last_scaling=describe_scaling(d, clock_s), rollout=describe_rollout(d),
            ))  # fmt: skip
    return rows


def _s(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _replicas(counts: Mapping[str, int]) -> str:
    order = [s for s in STATE_ORDER if s in counts] + sorted(s for s in counts if s not in STATE_ORDER)
    return " ".join(f"{counts[s]} {s}" for s in order) or "none"


WIDE_COLUMNS = (("deployment", "left"), ("version", "left"), ("replicas", "left"), ("req/s", "right"),
                ("TTFT p50", "right"), ("TTFT p99", "right"), ("TPOT p99", "right"), ("queue p99", "right"),
                ("errors/s", "right"), ("in flight", "right"), ("queued", "right"), ("last scaling", "left"),
                ("rollout", "left"))  # fmt: skip
"""The one-line-per-row layout, used where it fits the terminal."""

NARROW_COLUMNS = (("deployment\nversion", "left"), ("ready\n/want", "right"), ("req/s", "right"),
                  ("TTFT\np50", "right"), ("TTFT\np99", "right"), ("TPOT\np99", "right"), ("queue\np99", "right"),
                  ("errors\n/s", "right"))  # fmt: skip
"""The layout for narrow terminals (80 columns): the figures in the table, two-line headers, and
per row a line below it with the replicas by state, in flight, queued, scaling and rollout."""


def render(rows: list[TopRow], header: str) -> TopFrame:
    """The frame: a header line and the table, in the layout that fits the console (`TopFrame`)."""
    return TopFrame(rows, header)


class TopFrame:
    """A rich renderable: the wide table (`WIDE_COLUMNS`) where it fits the console's width,
    else the narrow one (`NARROW_COLUMNS`) with one line of text per row under it, so that no
    header or value is cut at 80 columns."""

    def __init__(self, rows: list[TopRow], header: str) -> None:
        self.rows = rows
        self.header = header

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Text(self.header)
        wide = self.wide()
        unbounded = options.update_width(100_000)      # the wide table's own width, not clamped to the console
        if console.measure(wide, options=unbounded).maximum <= options.max_width:
            yield wide
            return
        yield self.narrow()
        for r in self.rows:
            yield Text(f"{r.deployment} {r.version}: {_replicas(r.replicas)} (want {r.desired}), "
                       f"{_num(r.in_flight, '{}')} in flight, {_num(r.queued, '{}')} queued; "
                       f"scaling {r.last_scaling}; rollout {r.rollout}")  # fmt: skip

    def wide(self) -> Table:
        table = _table(WIDE_COLUMNS)
        for r in self.rows:
            table.add_row(
                r.deployment, r.version, f"{_replicas(r.replicas)} (want {r.desired})", _num(r.rate_per_s),
                *_figures(r)[:4], _errors(r), _num(r.in_flight, "{}"), _num(r.queued, "{}"), r.last_scaling,
                r.rollout,
            )
        return table

    def narrow(self) -> Table:
        table = _table(NARROW_COLUMNS, first_wraps=True)
        for r in self.rows:
            table.add_row(f"{r.deployment}\n{r.version}", f"{r.replicas.get('READY', 0)}/{r.desired}",
                          _num(r.rate_per_s), *_figures(r)[:4], _errors(r))  # fmt: skip
        return table


def _table(columns: tuple[tuple[str, str], ...], first_wraps: bool = False) -> Table:
    table = Table(title=None, expand=False, pad_edge=False)
    for i, (col, justify) in enumerate(columns):
        wraps = first_wraps and i == 0                 # a long deployment name folds; figures never do
        table.add_column(col, justify=justify, no_wrap=not wraps, overflow="fold")  # type: ignore[arg-type]
    return table


def _figures(r: TopRow) -> list[str]:
    return [_s(r.ttft_p50_s), _s(r.ttft_p99_s), _s(r.tpot_p99_s), _s(r.queue_p99_s)]


def _errors(r: TopRow) -> Text:
    return Text(_num(r.errors_per_s, "{:.2f}"), style="red" if r.errors_per_s else "")


def server_errors(exposition: str) -> dict[str, float]:
    """Total 5xx answers per model in a router ``/metrics`` text: endpoint answers
    (`fleet_router_requests_total`) plus the router's own (`fleet_router_rejected_requests_total`)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        if family.name not in ("fleet_router_requests", "fleet_router_rejected_requests"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get("code", "").startswith("5"):
                model = sample.labels.get("model", "")
                out[model] = out.get(model, 0.0) + sample.value
    return out


class RouterReader:
    """The router's statistics and 5xx counters (HTTP, admin bearer token)."""

    def __init__(self, router_url: str, token: str, timeout_s: float = 3.0) -> None:
        self._http = httpx.Client(base_url=router_url, timeout=timeout_s,
                                  headers={"Authorization": f"Bearer {token}"})  # fmt: skip

    def stats(self, window_s: float) -> dict[str, dict]:
        r = self._http.get("/admin/v1/stats", params={"window_s": window_s})
        r.raise_for_status()
        return r.json()["models"]

    def errors_total(self) -> dict[str, float]:
        r = self._http.get("/metrics")
        r.raise_for_status()
        return server_errors(r.text)

    def close(self) -> None:
        self._http.close()


class ErrorRates:
    """5xx/s per model from the difference between two readings of the counters."""

    def __init__(self) -> None:
        self._last: tuple[float, dict[str, float]] | None = None

    def update(self, now_s: float, totals: Mapping[str, float]) -> dict[str, float]:
        last, self._last = self._last, (now_s, dict(totals))
        if last is None or now_s <= last[0]:
            return {}
        return {m: max(0.0, v - last[1].get(m, 0.0)) / (now_s - last[0]) for m, v in totals.items()} | {
            m: 0.0 for m in last[1] if m not in totals}


def run_top(read_state: Callable[[], dict | None], token: str, *, where: str, interval_s: float, window_s: float,
            once: bool, console: Console, clock: Callable[[], float] = time.monotonic,
            reader_factory: Callable[[str, str], RouterReader] | None = None) -> int:  # fmt: skip
    """Refresh the view every ``interval_s`` until Ctrl-C (or once); the exit code.

    ``read_state()`` is the fleet's state (``state.json`` of `fleet up`; None when there is none),
    ``token`` the router's admin token, ``where`` names the state's place in messages. Returns 1
    when there is no state."""
    state = read_state()
    if state is None:
        console.print(f"No fleet state in {where}: `fleet up` has not run there.")
        return 1
    reader = (reader_factory or RouterReader)(state.get("router_url", "http://127.0.0.1:8080"), token)
    rates = ErrorRates()

    def frame() -> TopFrame:
        current = read_state() or {}
        problem = ""
        stats: dict = {}
        errors: dict = {}
        try:
            stats = reader.stats(window_s)
            errors = rates.update(clock(), reader.errors_total())
        except (httpx.HTTPError, KeyError, ValueError) as err:
            problem = f"  router: {type(err).__name__}: {err}"
        header = (f"fleet top - {current.get('phase', '?')}, router {current.get('router_url')}, "
                  f"window {window_s:g} s, {time.strftime('%H:%M:%S')}{problem}")  # fmt: skip
        return render(build_rows(current, stats, errors, now_unix=time.time()), header)

    try:
        if once:
            console.print(frame())
            return 0
        with Live(frame(), console=console, auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(interval_s)
                live.update(frame(), refresh=True)
    except KeyboardInterrupt:
        return 0
    finally:
        reader.close()
