"""The figure of a comparison: load, replicas and p99 TTFT over the trace's hour, one PNG.

Owns `plot_comparison`. Called by `fleet simulate --plot`. Needs matplotlib (the ``plot``
extra: ``pip install 'inference-fleet[plot]'``); `require_matplotlib` says so before a long
run starts. Writes one file; reads nothing.

Panels, sharing the time axis (minutes of the trace):

1. load: arrivals per second in ``bin_s`` bins;
2. replicas: READY (solid) and desired (dashed) of each contender at every decision;
3. p99 TTFT of the requests that arrived in each bin (log scale), with the SLO as a line;
   a bin where a request failed is marked at the top.
"""

from __future__ import annotations

import math
from pathlib import Path

from fleet.tracesim.compare import Comparison

DEFAULT_BIN_S = 30.0
"""Width of the load and p99 bins, seconds."""


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def require_matplotlib() -> None:
    """Raise `PlotUnavailable` (saying how to install it) when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'inference-fleet[plot]'") from None


def plot_comparison(comparison: Comparison, path: Path | str, *, bin_s: float = DEFAULT_BIN_S,
                    title: str | None = None) -> Path:  # fmt: skip
    """Draw ``comparison`` (module docstring) into the PNG at ``path``; return the path.

    Raises PlotUnavailable without matplotlib; OSError when the file cannot be written."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = comparison.results
    if not results:
        raise ValueError("nothing to plot: the comparison has no results")
    fig, (ax_load, ax_rep, ax_ttft) = plt.subplots(3, 1, figsize=(11, 9), sharex=True,
                                                   gridspec_kw={"height_ratios": [1, 1.4, 1.4]})  # fmt: skip
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    first = results[0].timeline(bin_s)
    minutes = [t / 60.0 for t in first["t_s"]]
    ax_load.step(minutes, first["arrivals_per_s"], where="post", color="black", linewidth=0.9)
    ax_load.set_ylabel("arrivals (req/s)")
    w = comparison.workload
    scale = f", rate x{w['rate_scale']}" if w.get("rate_scale", 1) != 1 else ""
    ax_load.set_title(title or f"{w['trace']}: {w['requests']} requests{scale}, {bin_s:g} s bins "
                      "(Fleet trace SIMULATOR, virtual time)", fontsize=10)  # fmt: skip

    slo_s = results[0].ttft_slo_s
    top_s = 1.0
    for k, result in enumerate(results):
        color = colors[k % len(colors)]
        tl = result.timeline(bin_s)
        ticks = [t / 60.0 for t in tl["tick_s"]]
        width = 0.8 if result.policy == "fixed" else 1.4
        ax_rep.step(ticks, tl["ready"], where="post", color=color, linewidth=width, label=f"{result.name} READY")
        if result.policy != "fixed":
            ax_rep.step(ticks, tl["desired"], where="post", color=color, linewidth=0.8, linestyle="--", alpha=0.8)
        p99 = tl["ttft_p99_s"]
        ax_ttft.step(minutes, p99, where="post", color=color, linewidth=1.1, label=result.name)
        top_s = max([top_s, *(v for v in p99 if not math.isnan(v))])
        failed_bins = [m for m, f in zip(minutes, tl["failed"]) if f]
        if failed_bins:
            ax_ttft.plot(failed_bins, [top_s * 1.5] * len(failed_bins), "v", color=color, markersize=3)
    ax_rep.set_ylabel("replicas (solid READY,\ndashed desired)")
    ax_rep.legend(fontsize=7, ncol=3, loc="upper left")
    ax_ttft.axhline(slo_s, color="red", linewidth=0.8, linestyle=":")
    ax_ttft.text(0.0, slo_s, f" SLO {slo_s:g} s", color="red", fontsize=7, va="bottom")
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("p99 TTFT (s)")
    ax_ttft.set_xlabel("trace time (minutes)")
    ax_ttft.legend(fontsize=7, ncol=3, loc="upper left")
    for ax in (ax_load, ax_rep, ax_ttft):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
