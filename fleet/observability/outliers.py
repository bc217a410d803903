"""What the router's outlier detection says of each endpoint, for `fleet status`.

Owns `outlier_notes` (pure: the router's `GET /admin/v1/pools` answer -> one line per endpoint
that is ejected or stalling; the fields are `router.pools.outlier.OutlierState.snapshot`'s) and
`read_outlier_notes` (the one I/O seam: that GET with the admin bearer token, a short timeout,
and `{}` when the router cannot be asked). Called by `fleet.cli.local.status`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

READ_TIMEOUT_S = 1.5
"""Longest `fleet status` waits for the router's pools (it shows the rest without them)."""

REASONS = {
    "stall": "no first token within the deadline",
    "gateway": "502/503/504 or connection failures",
    "5xx": "5xx answers",
}
"""Words for `router.pools.outlier.Outcome` values, the reasons of an ejection."""


def outlier_notes(pools: Mapping[str, Any]) -> dict[str, str]:
    """Endpoint id -> a note for `fleet status` (``ejected by the router for 27 s more: no first
    token within the deadline (ejection 1, 2 stalls)``, or ``stalling: 1 first-token timeout in a
    row``), for the endpoints of `pools` (`{model: {"endpoints": [...]}}`) that are ejected or whose
    latest attempts stalled. Endpoints without outlier fields (an older router) get no note."""
    notes: dict[str, str] = {}
    for pool in pools.values():
        for e in pool.get("endpoints", ()) if isinstance(pool, Mapping) else ():
            if not isinstance(e, Mapping) or "id" not in e:
                continue
            if e.get("ejected"):
                reason = REASONS.get(str(e.get("ejection_reason")), str(e.get("ejection_reason")))
                stalls = e.get("stalls_total") or 0
                notes[e["id"]] = (f"ejected by the router for {e.get('ejected_for_s') or 0:.0f} s more: {reason} "
                                  f"(ejection {e.get('ejections_total', 1)}, {stalls} stall(s) in all)")  # fmt: skip
            elif e.get("consecutive_stalls"):
                notes[e["id"]] = f"stalling: {e['consecutive_stalls']} first-token timeout(s) in a row"
    return notes


def read_outlier_notes(router_url: str, token: str | None, timeout_s: float = READ_TIMEOUT_S) -> dict[str, str]:
    """`outlier_notes` of the router at `router_url` (`GET /admin/v1/pools`); `{}` when it does not
    answer in `timeout_s`, refuses the token, or answers something else."""
    if not router_url or not token:
        return {}
    try:
        r = httpx.get(f"{router_url.rstrip('/')}/admin/v1/pools", headers={"Authorization": f"Bearer {token}"},
                      timeout=timeout_s)  # fmt: skip
        r.raise_for_status()
        pools = r.json()["pools"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return {}
    return outlier_notes(pools) if isinstance(pools, Mapping) else {}
