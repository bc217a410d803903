"""`fleet simulate`: replay a trace through Fleet's router and autoscaler policies in virtual time
(the trace SIMULATOR, `fleet.tracesim`), beside baselines; table, JSON and PNG.

Owns the command's arguments, help and output; the work is `fleet.tracesim.compare`. Registered
on the `fleet` app by `fleet.cli`.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from fleet.cli.common import console, err_console, load_or_exit

app = typer.Typer()


@app.command("simulate")
def simulate(
    trace: Annotated[Path, typer.Argument(
        help="Request trace: an Azure LLM trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or Fleet's JSONL, "
        "e.g. loadtests/traces/azure-llm-2023/code.csv.")],
    deployment: Annotated[Path, typer.Option(
        "--deployment", "-d", help="Deployment YAML: spec.replicas, spec.routing and spec.autoscaling are simulated; "
        "spec.model.source sim://<profile> names the simulated replica (or use --profile).")],
    compare: Annotated[bool, typer.Option(
        "--compare", help="Run the deployment's policy beside the baselines: fleet, fixed-peak, fixed-mean, "
        "keda-queue, kpa (docs/autoscaling.md).")] = False,
    policies: Annotated[str | None, typer.Option(
        "--policies", help="Comma-separated contenders (with --compare: added to its set): fleet, standby, "
        "keda-queue, kpa, "
        "fixed (spec.replicas.initial), fixed-peak, fixed-mean, fixed-N.")] = None,
    rate_scale: Annotated[int, typer.Option(
        "--rate-scale", min=1, help="K times the trace's arrival rate on the same time axis (bursts keep their "
        "length; each gap between arrivals gets K-1 more requests with other requests' sizes).")] = 1,
    speedup: Annotated[float, typer.Option(
        "--speedup", min=0.001, help="Arrivals this many times closer together (shortens bursts against start-up "
        "times; prefer --rate-scale).")] = 1.0,
    profile: Annotated[str | None, typer.Option(help="Simulator profile (default: from sim:// in the deployment).")] = None,
    ttft_slo_s: Annotated[float, typer.Option(
        "--ttft-slo-s", min=0.001, help="TTFT SLO in seconds for the 'within SLO' share. Default 2 s: MLPerf "
        "Inference's server-scenario TTFT limit for Llama 3.1 8B (loadgen/mlperf.conf).")] = 2.0,
    warm_startup_s: Annotated[float, typer.Option(
        "--warm-startup-s", min=0.0, help="Modelled seconds from placement to READY on a warm node.")] = 60.0,
    cold_startup_s: Annotated[float, typer.Option(
        "--cold-startup-s", min=0.0, help="Modelled seconds from placement to READY on a cold node.")] = 600.0,
    warm_nodes: Annotated[int | None, typer.Option(
        "--warm-nodes", min=0, help="Node slots holding image and weights at the start; replicas beyond them start "
        "cold (default spec.replicas.max plus the standby allowance: all warm).")] = None,
    standby_max: Annotated[int | None, typer.Option(
        "--standby-max", min=0, help="Most STANDBY replicas (loaded, asleep, counted in replica-hours) a scaling "
        "policy may keep; a policy without a standby target (all but `standby`) keeps this many. 0: off. "
        "Fixed fleets keep none. Default: the deployment's spec.standby.maxReplicas (0 without it).")] = None,
    wake_s: Annotated[float, typer.Option(
        "--wake-s", min=0.0, help="Modelled seconds from waking a STANDBY replica to READY (default 3: llm-d's "
        "fast-model-actuation figure for 64 GiB, docs/autoscaling.md).")] = 3.0,
    router_limit: Annotated[int | None, typer.Option(
        "--max-concurrency-per-endpoint", min=0, help="Override spec.routing.maxConcurrencyPerEndpoint for every "
        "contender (0: no limit, no router queue).")] = None,
    history: Annotated[list[Path] | None, typer.Option(
        "--history", help="Traces that came before this one, oldest first (repeatable; each takes its span "
        "rounded up to whole hours): their arrival rates are given to the policies before the run "
        "(the forecast of standby-forecast learns from them; the others ignore them).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the rate-scale copies and token ids.")] = 0,
    jobs: Annotated[int | None, typer.Option(
        "--jobs", "-j", min=1, help="Contenders simulated in parallel processes (default: one per CPU core).")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write summaries, scaling actions and "
                                                     "per-minute timelines as JSON here.")] = None,
    plot_out: Annotated[Path | None, typer.Option("--plot", help="Draw load, replicas (READY and desired) and "
                                                     "p99 TTFT over time into this PNG (needs matplotlib).")] = None,
    prices: Annotated[Path | None, typer.Option(
        "--prices", help="GPU prices (YAML: source, gpuHourUsd: {product: USD per GPU-hour}; fleet/pricing.py): "
        "adds a cost column, replica-hours x spec.resources.tensorParallelSize x the price of the "
        "deployment's gpuProduct.")] = None,
    hindsight: Annotated[bool, typer.Option(
        "--hindsight/--no-hindsight", help="Solve the hindsight-optimal schedule (the cheapest replica count per "
        "interval that keeps --within-slo, paying every warm start-up; fleet/tracesim/hindsight.py) and show each "
        "policy's replica-hours against it and against the best fixed fleet.")] = True,
    within_slo: Annotated[float, typer.Option(
        "--within-slo", min=0.5, max=1.0, help="Share of requests within the TTFT SLO that the hindsight-optimal "
        "schedule and the best fixed fleet must keep (default 0.99).")] = 0.99,
    hindsight_interval_s: Annotated[float | None, typer.Option(
        "--hindsight-interval-s", min=0.1, help="Interval of the hindsight-optimal schedule's replica counts "
        "(default: the TTFT SLO).")] = None,
) -> None:
    """Replay a trace through Fleet's router and autoscaler in virtual time (the trace SIMULATOR).

    A discrete-event simulation: every request of the trace is routed by the router's own
    policy objects to simulated replicas (fleet.enginesim latency models of vLLM under a profile, not
    real engines); the deployment's scaling policy decides every interval on the same signals
    `fleet up` gives it; new replicas become READY after the modelled warm or cold start-up;
    a scale-down drains. An hour of trace takes seconds to a minute; the same inputs always
    give the same table.

    Prints one row per contender: share of requests within the TTFT SLO (failed requests
    count as missed), p99 and p50 TTFT (of the requests answered), replica-hours (placement
    to stop, start-up included), scaling actions (target changes) and failed requests (503s,
    drain cut-offs); with --prices, the cost in USD (GPU-hours x the price, its source printed);
    each policy's replica-hours as a multiple of the hindsight-optimal schedule's ("x hindsight")
    and of the best fixed fleet's ("x best fixed": the cheapest fixed-* row that kept --within-slo,
    else the hindsight model's best fixed size). With --compare, every contender shares the
    workload, profile, routing, start-up model and replica bounds; only the scaling policy differs.
    """

    from fleet.tracesim.compare import (
        COMPARE,
        Comparison,
        config_from_deployment,
        contender,
        profile_of,
    )
    from fleet.tracesim.plot import PlotUnavailable, require_matplotlib
    from fleet.tracesim.workload import Workload, history_rates, replica_capacity_per_s
    from fleet.tracesim.traces import TraceError, load_trace

    from fleet.pricing import PricesError, load_prices

    loaded = load_or_exit([deployment])
    if len(loaded) != 1:
        err_console.print(f"[red]{deployment}: holds {len(loaded)} deployments; the simulator takes one per file[/]",
                          highlight=False)  # fmt: skip
        raise typer.Exit(2)
    dep = loaded[0].deployment
    price = None
    if prices is not None:
        if dep.spec.resources.accelerator != "gpu":
            err_console.print(f"[red]--prices: prices are per GPU-hour and {deployment} runs on "
                              f"spec.resources.accelerator {dep.spec.resources.accelerator}[/]", highlight=False)
            raise typer.Exit(2)
        try:
            gpu_prices = load_prices(prices)
            product, usd = gpu_prices.per_gpu_hour(dep.spec.resources.gpu_products)
        except PricesError as err:
            err_console.print(f"[red]--prices: {err}[/]", highlight=False)
            raise typer.Exit(2) from None
        price = (product, usd, _gpus_per_replica(dep.spec.resources), gpu_prices.source)
    for out in (json_out, plot_out):
        if out is not None and not out.resolve().parent.is_dir():
            err_console.print(f"[red]{out}: directory {out.resolve().parent} does not exist[/]", highlight=False)
            raise typer.Exit(2)
    try:
        if plot_out is not None:
            require_matplotlib()
        replica_profile = profile_of(dep, profile)
        overrides = {} if router_limit is None else {"max_concurrency_per_endpoint": router_limit or None}
        base = config_from_deployment(dep, replica_profile, ttft_slo_s=ttft_slo_s, warm_startup_s=warm_startup_s,
                                      cold_startup_s=cold_startup_s, warm_nodes=warm_nodes, seed=seed,
                                      wake_s=wake_s, **overrides,
                                      **({} if standby_max is None else {"standby_max": standby_max}))  # fmt: skip
        workload = Workload.from_trace(load_trace(trace), replica_profile, rate_scale=rate_scale, speedup=speedup,
                                       seed=seed)  # fmt: skip
        if history:
            base = replace(base, history=history_rates([load_trace(p) for p in history]))
    except (TraceError, PlotUnavailable, ValueError, KeyError) as err:
        err_console.print(f"[red]{err.args[0] if isinstance(err, KeyError) else err}[/]", highlight=False)
        raise typer.Exit(2) from None
    own = base.autoscaling.policy
    extra = [n.strip() for n in (policies or "").split(",") if n.strip()]
    if compare:
        names = [own, *(n for n in COMPARE if n != own), *extra]
    else:
        names = extra or [own]
    with err_console.status("Measuring one replica's capacity on this request mix..."):
        capacity_per_s = replica_capacity_per_s(workload.trace, replica_profile)
    sizing = workload.sizing(capacity_per_s)
    try:
        configs = [contender(base, n, sizing) for n in dict.fromkeys(names)]
    except ValueError as err:
        err_console.print(f"[red]--policies: {err}[/]", highlight=False)
        raise typer.Exit(2) from None
    comparison = Comparison(workload.describe(), capacity_per_s, sizing)
    _print_simulation_header(comparison, base, replica_profile)
    if price is not None:
        product, usd, gpus, source = price
        share = f"{gpus:.3g} GPU (MIG {dep.spec.resources.mig_profile})" if gpus < 1 else f"{gpus:g} GPU(s)"
        console.print(f"cost: {usd:g} USD per GPU-hour for {product} x {share} per replica "
                      f"(standby replicas count: they hold GPUs); prices from {source} ({prices})", highlight=False)
    comparison.results = _run_with_progress(configs, workload, jobs or min(len(configs), os.cpu_count() or 1))
    sticks = None
    if hindsight:
        from fleet.tracesim.hindsight import yardsticks

        with err_console.status("Solving the hindsight-optimal schedule..."):
            sticks = yardsticks(workload, replica_profile, base, within_slo, hindsight_interval_s)
        comparison.hindsight = sticks.to_dict()
    console.print(_simulation_table(comparison, price and price[1] * price[2]))
    if sticks is not None:
        _print_yardsticks(sticks, comparison, price and price[1] * price[2])
        console.print(_yardstick_table(comparison, sticks, price and price[1] * price[2]))
    for r in comparison.results:
        console.print(f"  {r.name}: simulated in {r.wall_s:.1f} s wall ({r.steps} engine steps)", highlight=False)
    if json_out is not None:
        json_out.write_text(json.dumps(comparison.to_dict(), indent=1) + "\n")
        console.print(f"Wrote {json_out}", highlight=False)
    if plot_out is not None:
        from fleet.tracesim.plot import plot_comparison

        plot_comparison(comparison, plot_out)
        console.print(f"Wrote {plot_out}", highlight=False)


def _print_simulation_header(comparison, base, replica_profile) -> None:
    w, s = comparison.workload, comparison.sizing
    scale = "".join(f", {k} x{w[k]:g}" for k in ("rate_scale", "speedup") if w[k] != 1)
    limit = base.max_concurrency_per_endpoint
    console.print(
        "[bold]Fleet trace SIMULATOR[/] (virtual time; replicas are fleet.enginesim latency models, not vLLM)\n"
        f"trace {w['trace']}{scale}: {w['requests']} requests over {w['duration_s'] / 60:.1f} min, mean "
        f"{w['mean_rate_per_s']:.2f} req/s, busiest minute {w['peak_rate_per_s']:.2f} req/s; "
        f"{w['mean_prompt_tokens']:.0f} prompt / {w['mean_output_tokens']:.0f} output tokens per request\n"
        f"replica {replica_profile.name} ({replica_profile.model}, {replica_profile.hardware}): "
        f"{comparison.capacity_per_s:.2f} req/s at saturation on this mix -> fixed-peak {s.peak}, fixed-mean {s.mean}\n"
        f"replicas {base.bounds.min}..{base.bounds.max} (initial {base.bounds.initial}); routing {base.routing_policy}"
        f"{f', {limit} per replica, then the router queue' if limit else ''}; start-up warm "
        f"{base.warm_startup_s:g} s / cold {base.cold_startup_s:g} s"
        f"{f'; up to {base.standby_max} standby, wake {base.wake_s:g} s' if base.standby_max else ''}; "
        f"TTFT SLO {base.ttft_slo_s:g} s",
        highlight=False,
    )


def _run_with_progress(configs, workload, jobs: int):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from fleet.tracesim.compare import run_comparison

    horizon_min = max(workload.duration_s, 1.0) / 60
    columns = (TextColumn("{task.description:<18}"), BarColumn(), TextColumn("{task.fields[at]}"), TimeElapsedColumn())
    with Progress(*columns, console=err_console, transient=True) as bar:
        tasks = [bar.add_task(c.label, total=workload.duration_s, at="") for c in configs]

        def progress(index: int, now_s: float, done: int, total: int) -> None:
            bar.update(tasks[index], completed=min(now_s, workload.duration_s),
                       at=f"{now_s / 60:5.1f}/{horizon_min:.0f} min, {done}/{total} requests")  # fmt: skip

        return run_comparison(configs, workload, jobs=jobs, progress=progress)


def _gpus_per_replica(resources) -> float:
    """GPUs a replica is priced at: its tensor parallel size, or a MIG instance's compute share
    of its GPU (`fleet.inventory.mig.mig_gpu_fraction`: 3g.40gb -> 3/7)."""
    from fleet.inventory.mig import mig_gpu_fraction

    if resources.mig_profile:
        return mig_gpu_fraction(resources.mig_profile)
    return float(resources.tensor_parallel_size)


def _best_fixed(comparison, sticks) -> tuple[str, float]:
    """(name, replica-hours) of the best fixed fleet: the cheapest simulated ``fixed*`` row that
    kept the yardsticks' share within the SLO, else the hindsight model's best fixed size."""
    kept = [r.summary() for r in comparison.results if r.policy == "fixed"]
    kept = [s for s in kept if s.within_slo >= sticks.share - 1e-12]
    if kept:
        best = min(kept, key=lambda s: s.replica_hours)
        return f"{best.name} (simulated)", best.replica_hours
    return f"fixed-{int(sticks.fixed.replicas[0])} (the model's)", sticks.fixed.replica_hours


def _print_yardsticks(sticks, comparison, usd_per_replica_hour: float | None) -> None:
    """The hindsight-optimal schedule and the best fixed fleet, with the model behind them."""
    opt, d = sticks.optimum, sticks.optimum.demand
    usd = "" if usd_per_replica_hour is None else f" ({opt.replica_hours * usd_per_replica_hour:.2f} USD)"
    name, hours = _best_fixed(comparison, sticks)
    console.print(
        f"hindsight-optimal schedule: {opt.replica_hours:.2f} replica-hours{usd}, {opt.starts} start(s) paying "
        f"{sticks.startup_s:g} s each, {opt.stops} stop(s) draining {sticks.drain_s:.1f} s each, at most "
        f"{int(opt.replicas.max())} replicas, {100 * opt.within_share:.2f}% "
        f"within the SLO by its model (one replica takes {d.capacity_per_s:.2f} req/s at "
        f"{100 * sticks.share:g}% within the TTFT SLO; replica counts per {d.interval_s:g} s; "
        f"fleet/tracesim/hindsight.py)\nbest fixed fleet: {name}, {hours:.2f} replica-hours",
        highlight=False,
    )


def _yardstick_table(comparison, sticks, usd_per_replica_hour: float | None) -> Table:
    """Each policy's replica-hours (and cost) as multiples of the hindsight-optimal schedule's and
    of the best fixed fleet's (`_best_fixed`); a cost is replica-hours x one price, so its multiple
    is the same."""
    from fleet.pricing import replica_cost_usd

    fixed_name, fixed_hours = _best_fixed(comparison, sticks)
    table = Table(title=f"against the hindsight-optimal schedule and the best fixed fleet ({fixed_name})")
    columns = ["policy", "within SLO", "replica-hours", "x hindsight", "x best fixed"]
    columns += [] if usd_per_replica_hour is None else ["cost", "hindsight cost"]
    for column in columns:
        table.add_column(column, justify="left" if column == "policy" else "right")
    for r in comparison.results:
        s = r.summary()
        hours = (s.replica_hours, sticks.optimum.replica_hours)
        cost = [] if usd_per_replica_hour is None else [
            f"{replica_cost_usd(h, 1, usd_per_replica_hour):.2f} USD" for h in hours]
        table.add_row(s.name, f"{100 * s.within_slo:.2f}%", f"{s.replica_hours:.2f}",
                      _times(s.replica_hours, sticks.optimum.replica_hours), _times(s.replica_hours, fixed_hours),
                      *cost)  # fmt: skip
    return table


def _simulation_table(comparison, usd_per_replica_hour: float | None = None) -> Table:
    """The comparison table; with ``usd_per_replica_hour`` (GPUs per replica x USD per GPU-hour),
    a cost column (`fleet.pricing.replica_cost_usd`)."""
    from fleet.pricing import replica_cost_usd

    slo_s = comparison.results[0].ttft_slo_s if comparison.results else 0.0
    table = Table(title=f"{comparison.workload['trace']}: one row per scaling policy (simulated)")
    columns = ["policy", f"within {slo_s:g} s TTFT", "p99 TTFT", "p50 TTFT", "replica-hours"]
    columns += [] if usd_per_replica_hour is None else ["cost"]
    for column in (*columns, "of which standby", "peak replicas", "scaling actions", "wake-ups", "failed"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for r in comparison.results:
        s = r.summary()
        cost = [] if usd_per_replica_hour is None else [f"{replica_cost_usd(s.replica_hours, 1, usd_per_replica_hour):.2f} USD"]
        table.add_row(
            s.name, f"{100 * s.within_slo:.1f}%", "-" if s.ttft_p99_s is None else f"{s.ttft_p99_s:.2f} s",
            "-" if s.ttft_p50_s is None else f"{s.ttft_p50_s:.2f} s", f"{s.replica_hours:.2f}", *cost,
            f"{s.standby_hours:.2f}", str(s.max_replicas), str(s.scaling_actions), str(s.wakes), str(s.failed),
        )  # fmt: skip
    return table


def _times(hours: float, yardstick_hours: float) -> str:
    """``hours`` as a multiple of ``yardstick_hours`` ("2.61x"); "-" without a yardstick."""
    return f"{hours / yardstick_hours:.2f}x" if yardstick_hours > 0 else "-"
