"""Routers that tell each other the load they sent: the peer channel's reports and their sum.

Owns `own_report` (what one router tells its peers: its own load on every endpoint of its
`kv-aware` pools) and `PeerLoadView` (the latest report of each peer, summed per endpoint and
handed to `router.pools.endpoint.EndpointState.set_others_load`). Called by
`router.signals.peer_channel.PeerSender` (which sends this router's report to every peer every
`DEFAULT_PEER_INTERVAL_S`) and by the admin API's `POST /admin/v1/peer-load` (which hands a peer's report to `receive`); the trace
simulator's ``peers`` load signal is the same exchange in virtual time. Pure: no I/O, times are
passed in.

**Why.** docs/routing.md, "A shared load signal": in the trace simulator on the Mooncake trace
with two routers and the engines' KV events, routers that shared their dispatches brought p99
TTFT to within 5-10% of one router's (2.90-3.05 s against 2.76 s); the engines' own request
counts (`router.signals.engine_load`) took it only to 3.78 s, because what queues up on an endpoint is
prompt tokens, which vLLM does not export.

**Report** (JSON, what `PeerSender` sends): ``{"router": id, "boot": token, "seq": n, "pools":
{model: {endpoint_id: [in_flight, prefilling, prefill_tokens]}}}``: this router's own counts
(`EndpointState.in_flight`, `prefilling`, `prefill_tokens`). A report is a snapshot, not a
delta: a lost one is made good by the next, and a peer that stops reporting drops out
`max_age_s` after its last report. ``boot`` (random per sender start) and ``seq`` (counting up
per new report) order the reports of one sender, which arrive by two paths (UDP datagrams and
HTTP, `router.signals.peer_datagram`): an older report than the one held is dropped, the same one
again only refreshes its age. Both are optional (a report without them is taken as newest).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from router.pools.endpoint import EndpointState

DEFAULT_PEER_INTERVAL_S = 0.01
"""Seconds between two reports of a router to each peer (while its load changes; see
`router.signals.peer_channel.HEARTBEAT_S`), so what a peer knows is at most about 10 ms old. In the
trace simulator on the Mooncake trace with two routers and KV events (docs/routing.md, "A shared
load signal") p99 TTFT was 2.90 s with instant sharing, 3.05 s 10 ms late, 3.26 s 25 ms late and
3.60 s 50 ms late, against 2.76 s for one router: a third of that trace's requests arrive within
50 ms of the one before."""

DEFAULT_PEER_MAX_AGE_S = 1.0
"""Seconds after its last report that a peer's load still counts (20 reports at the default
interval): past it the peer is taken to be gone (its requests fail with it)."""

MAX_REPORT_ENDPOINTS = 100_000
"""Most pools and endpoints one report may carry, counted together (a larger one is refused:
`ValueError`)."""

Load = tuple[int, int, float]   # in flight, prefilling, prefill tokens


Order = tuple[str, int]   # (boot, seq) of a report


def own_report(router_id: str, pools: Mapping[str, Sequence[EndpointState]],
               order: Order | None = None) -> dict[str, object]:  # fmt: skip
    """This router's report: its own load on each endpoint of `pools` (model -> endpoints);
    `order`: its (boot, seq) (module docstring)."""
    report: dict[str, object] = {"router": router_id}
    if order is not None:
        report["boot"], report["seq"] = order
    report["pools"] = {model: {e.id: [e.in_flight, e.prefilling, e.prefill_tokens] for e in endpoints}
                       for model, endpoints in pools.items()}  # fmt: skip
    return report


def report_order(doc: object) -> Order | None:
    """A report document's (boot, seq), None when it carries neither.

    Raises:
        ValueError: one without the other, or mistyped (boot a string, seq an int >= 0)."""
    if not isinstance(doc, dict) or ("boot" not in doc and "seq" not in doc):
        return None
    boot, seq = doc.get("boot"), doc.get("seq")
    if not isinstance(boot, str) or type(seq) is not int or seq < 0:
        raise ValueError("a peer load report's boot must be a string and seq an int >= 0, both or neither")
    return boot, seq


def load_fingerprint(pools: Mapping[str, Sequence[EndpointState]]) -> tuple:
    """What `own_report` would say, as a cheap comparable value (no JSON): the sender checks it
    every `DEFAULT_PEER_INTERVAL_S` and encodes a report only when it changed. Equal
    fingerprints mean equal reports."""
    return tuple((model, tuple((e.id, e.in_flight, e.prefilling, e.prefill_tokens) for e in endpoints))
                 for model, endpoints in pools.items())  # fmt: skip


def parse_report(doc: object) -> tuple[str, dict[str, dict[str, Load]]]:
    """(router id, model -> endpoint id -> load) of a report document.

    Raises:
        ValueError: not a report (shape, types, negative or non-finite numbers, too many pools and
            endpoints).
    """
    if not isinstance(doc, dict) or not isinstance(doc.get("router"), str) or not isinstance(doc.get("pools"), dict):
        raise ValueError("a peer load report is {router: str, pools: {model: {endpoint: [n, n, tokens]}}}")
    pools: dict[str, dict[str, Load]] = {}
    count = 0
    for model, endpoints in doc["pools"].items():
        if not isinstance(endpoints, dict):
            raise ValueError(f"pool {model!r}: endpoints must be a mapping")
        count += 1 + len(endpoints)   # a pool counts too: empty pools cost the receiver as much
        if count > MAX_REPORT_ENDPOINTS:
            raise ValueError(f"a report carries at most {MAX_REPORT_ENDPOINTS} pools and endpoints")
        loads: dict[str, Load] = {}
        for endpoint_id, load in endpoints.items():
            if (not isinstance(load, list) or len(load) != 3
                    or not all(type(x) in (int, float) and 0 <= x < math.inf for x in load)):  # fmt: skip
                raise ValueError(f"endpoint {endpoint_id!r}: load must be [in_flight, prefilling, prefill_tokens], "
                                 "finite and >= 0")  # fmt: skip
            loads[endpoint_id] = (int(load[0]), int(load[1]), float(load[2]))
        pools[model] = loads
    return doc["router"], pools


class PeerLoadView:
    """The latest report of each peer router, summed per endpoint into `EndpointState.others_*`
    (through `EndpointState.set_others_load`).

    `receive(router_id, pools, endpoints, now_s)` stores a peer's report (router-clock seconds
    `now_s`) and rewrites the others' load of the endpoints it names, from every peer whose
    report is at most `max_age_s` old; `others_until_s` is when the oldest report counted goes
    stale. A report from this router itself (`self_id`) is ignored.

    Raises:
        ValueError: `max_age_s` <= 0.
    """

    def __init__(self, self_id: str, max_age_s: float = DEFAULT_PEER_MAX_AGE_S) -> None:
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
        self.self_id = self_id
        self.max_age_s = max_age_s
        self._reports: dict[str, tuple[float, dict[str, dict[str, Load]]]] = {}
        self._orders: dict[str, Order] = {}   # (boot, seq) of the report held per peer

    def peers(self, now_s: float) -> list[str]:
        """Ids of the peers whose last report still counts, sorted."""
        return sorted(p for p, (at_s, _) in self._reports.items() if now_s - at_s <= self.max_age_s)

    def totals(self, now_s: float) -> dict[str, dict[str, list[float]]]:
        """The peers' load summed per endpoint, from the reports that still count at `now_s`:
        model -> endpoint id -> [in_flight, prefilling, prefill_tokens] (what
        `GET /admin/v1/peers` shows)."""
        out: dict[str, dict[str, list[float]]] = {}
        for at_s, report in self._reports.values():
            if now_s - at_s > self.max_age_s:
                continue
            for model, loads in report.items():
                summed = out.setdefault(model, {})
                for endpoint_id, load in loads.items():
                    total = summed.setdefault(endpoint_id, [0, 0, 0.0])
                    for i in range(3):
                        total[i] += load[i]
        return out

    def receive(self, router_id: str, pools: dict[str, dict[str, Load]],
                endpoints: Mapping[str, Sequence[EndpointState]], now_s: float,
                order: Order | None = None) -> bool:  # fmt: skip
        """Store `router_id`'s report and update the endpoints of `endpoints` (model -> this
        router's endpoint states) that it names. `order`: the report's (boot, seq); one older
        than the report held from the same boot is dropped (False). Returns whether it was taken."""
        if router_id == self.self_id:
            return False
        if order is not None:
            held = self._orders.get(router_id)
            if held is not None and held[0] == order[0] and order[1] < held[1]:
                return False   # overtaken: a newer report came by the other path
            self._orders[router_id] = order
        self._reports[router_id] = (now_s, pools)
        for peer in [p for p, (at_s, _) in self._reports.items() if now_s - at_s > self.max_age_s]:
            del self._reports[peer]   # gone quiet: its load no longer counts
            self._orders.pop(peer, None)
        fresh = list(self._reports.values())
        for model, loads in pools.items():
            for e in endpoints.get(model, ()):
                if e.id not in loads:
                    continue
                in_flight = prefilling = 0
                tokens = 0.0
                oldest_s = now_s
                for at_s, report in fresh:
                    load = report.get(model, {}).get(e.id)
                    if load is not None:
                        in_flight += load[0]
                        prefilling += load[1]
                        tokens += load[2]
                        oldest_s = min(oldest_s, at_s)
                e.set_others_load(in_flight, prefilling, tokens, oldest_s + self.max_age_s)
        return True
