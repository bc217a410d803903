"""Draw the main panels of Fleet's Grafana dashboard from a Prometheus, as one PNG (matplotlib).

The figure in docs/observability/README.md (docs/img/observability-dashboard.png) is drawn by this script from the
Prometheus of the observability integration test (`fleet up` over simulated engines under load,
tests/integration/test_observability_sim.py), with the very queries the dashboard ships
(`fleet.observability.dashboard`):

    FLEET_DASHBOARD_PNG=docs/img/observability-dashboard.png \\
        python -m pytest -p no:cacheprovider tests/integration/test_observability_sim.py

or against any Prometheus that scrapes a fleet:

    python loadtests/plot_dashboard.py --prometheus http://127.0.0.1:9090 --minutes 15 --out dash.png
"""

from __future__ import annotations

import argparse
import math
import time
from datetime import datetime
from pathlib import Path

import httpx

MAIN_PANELS = (
    "Time to first token (streamed, router)",
    "Time per output token (streamed, router)",
    "End-to-end latency (router)",
    "Queue time (router admission queue)",
    "Requests by code",
    "Admission queue length",
    "Requests within the TTFT SLO (1 s)",
    "Replicas by state",
    "Autoscaler: desired vs ready",
    "Running and waiting requests",
    "KV-cache usage",
    "Engine time to first token",
)
"""Panels drawn, by title."""


def _legend(template: str, labels: dict[str, str]) -> str:
    out = template
    for k, v in labels.items():
        out = out.replace("{{" + k + "}}", v)
    return out.replace("{{version}}", "").strip() or "value"


def query_range(prom_url: str, expr: str, start: float, end: float, step_s: float) -> list[dict]:
    """Prometheus ``/api/v1/query_range``. Raises RuntimeError with Prometheus's error."""
    r = httpx.get(f"{prom_url}/api/v1/query_range", timeout=60,
                  params={"query": expr, "start": start, "end": end, "step": f"{step_s:g}s"})  # fmt: skip
    body = r.json()
    if body.get("status") != "success":
        raise RuntimeError(f"{expr!r}: {body.get('error')}")
    return body["data"]["result"]


def plot_dashboard(prom_url: str, start: float, end: float, out: Path, rate_interval: str = "20s") -> Path:
    """Draw `MAIN_PANELS` between ``start`` and ``end`` (unix seconds) into ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    from fleet.observability.dashboard import build_dashboard
    from fleet.observability.promql import grafana_to_promql

    doc = build_dashboard()
    panels = {p["title"]: p for p in doc["panels"] if p.get("type") != "row"}
    step_s = max(1.0, (end - start) / 300)
    cols = 3
    rows = math.ceil(len(MAIN_PANELS) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.2 * rows), squeeze=False)
    for ax, title in zip(axes.flat, MAIN_PANELS):
        panel = panels[title]
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        for target in panel["targets"]:
            expr = grafana_to_promql(target["expr"], rate_interval=rate_interval)
            for series in query_range(prom_url, expr, start, end, step_s):
                points = [(float(t), float(v)) for t, v in series["values"] if math.isfinite(float(v))]
                if not points:
                    continue
                xs = [datetime.fromtimestamp(t) for t, _ in points]
                ys = [v * 100 if unit == "percentunit" else v for _, v in points]
                ax.plot(xs, ys, linewidth=1.2, label=_legend(target.get("legendFormat", ""), series["metric"]))
        ax.set_title(title, fontsize=10)
        ax.set_ylabel({"s": "seconds", "percentunit": "%", "reqps": "req/s"}.get(unit, ""), fontsize=8)
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S"))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6, loc="upper left", ncol=2)
    for ax in list(axes.flat)[len(MAIN_PANELS):]:
        ax.axis("off")
    fig.suptitle("Fleet dashboard (fleet/observability/dashboard.py): fleet up over the engine SIMULATOR "
                 "under a closed-loop burst; scraped every 1 s by Prometheus", fontsize=11)  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prometheus", default="http://127.0.0.1:9090")
    ap.add_argument("--minutes", type=float, default=15.0, help="Range to draw, ending now.")
    ap.add_argument("--out", type=Path, default=Path("dashboard.png"))
    args = ap.parse_args()
    end = time.time()
    print(plot_dashboard(args.prometheus, end - args.minutes * 60, end, args.out))


if __name__ == "__main__":
    main()
