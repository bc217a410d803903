"""`fleet sim-engine` and `fleet make-tiny-model`: engines to serve without a GPU or a model hub.

Owns the two commands' arguments, help and output; the work is done by `fleet.enginesim.runner`
(the engine SIMULATOR) and `fleet.engines.tinymodel` (a tiny random-weights Llama that real vLLM
serves). Registered on the `fleet` app by `fleet.cli`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from fleet.cli.common import console, err_console

app = typer.Typer()


@app.command("sim-engine")
def sim_engine(
    replicas: Annotated[int, typer.Option(help="Simulated replicas in this process, each on its own port.")] = 1,
    base_port: Annotated[int, typer.Option(help="Port of replica 0; replica i gets base+i. 0 = free ports, printed.")] = 0,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    profile: Annotated[Optional[str], typer.Option(help="Simulator profile (default cpu-tiny-llama).")] = None,
    model_name: Annotated[Optional[str], typer.Option(help="Served model name (default: the profile's model).")] = None,
    seed: Annotated[int, typer.Option(help="Output text and EOS positions depend only on seed and prompt.")] = 0,
    startup_delay_s: Annotated[float, typer.Option("--startup-delay-s", help="Seconds before listening (weight loading stand-in).")] = 0.0,
    fail_at_start: Annotated[bool, typer.Option("--fail-at-start", help="Fault: never listen; exit 1.")] = False,
    crash_after_requests: Annotated[Optional[int], typer.Option(help="Fault: a replica dies after answering N requests.")] = None,
    slowdown: Annotated[float, typer.Option(help="Fault: every engine step takes this factor longer.")] = 1.0,
    mean_output_tokens: Annotated[Optional[float], typer.Option(help="Requests without ignore_eos stop at an EOS with this mean length.")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="Override the profile's max_model_len.")] = None,
    num_gpu_blocks: Annotated[Optional[int], typer.Option(help="Override the profile's KV blocks.")] = None,
    ports_file: Annotated[Optional[Path], typer.Option(help="Write the bound ports and URLs as JSON here.")] = None,
    enable_sleep_mode: Annotated[bool, typer.Option("--enable-sleep-mode", help="Serve vLLM's POST /sleep, POST /wake_up, GET /is_sleeping.")] = False,
    wake_s: Annotated[Optional[float], typer.Option("--wake-s", help="Seconds a wake from level-1 sleep takes (default: from the profile's weight bytes).")] = None,
    kv_events_config: Annotated[Optional[str], typer.Option("--kv-events-config", help="vLLM's KV events config (JSON); replica i offsets the ports by i.")] = None,
    tokenizer: Annotated[Optional[Path], typer.Option(help="A model directory: tokenize prompts with its real tokenizer and chat template, as vLLM does (default: the simulator's word tokenizer).")] = None,
    list_profiles: Annotated[bool, typer.Option("--list-profiles", help="List the profiles and exit.")] = False,
) -> None:
    """Run simulated vLLM replicas (the Fleet engine SIMULATOR; no model runs).

    Each replica serves vLLM's OpenAI API (/v1/completions, /v1/chat/completions with SSE
    streaming, /v1/models, /health) and /metrics with vLLM's metric names, with latencies from a
    model of vLLM's scheduler (continuous batching, chunked prefill, KV-cache capacity,
    preemption, prefix caching) under a profile fitted to real vLLM or published GPU figures.
    Prints one line per replica with its URL; Ctrl-C stops. Fault switches apply to every
    replica; POST /sim/faults changes one at run time.
    """
    from fleet.enginesim.faults import FaultPlan
    from fleet.enginesim.profiles import get_profile, profile_names
    from fleet.enginesim.runner import SimEngineOptions, run

    if list_profiles:
        for name in profile_names():
            p = get_profile(name)
            c = p.config
            console.print(
                f"[bold]{name}[/]: {p.model} on {p.hardware}; max_num_seqs {c.max_num_seqs}, "
                f"max_num_batched_tokens {c.max_num_batched_tokens}, KV {c.num_gpu_blocks} x {c.block_size} tokens, "
                f"max_model_len {c.max_model_len}", highlight=False,
            )
        return
    try:
        faults = FaultPlan(fail_at_start=fail_at_start, crash_after_requests=crash_after_requests, slowdown=slowdown)
    except ValueError as err:
        err_console.print(f"[red]{err}[/]", highlight=False)
        raise typer.Exit(2) from None
    from fleet.enginesim.kvpublish import KvEventsConfig, KvEventsConfigError

    try:
        kv_events = KvEventsConfig.from_json(kv_events_config) if kv_events_config else None
    except KvEventsConfigError as err:
        err_console.print(f"[red]{err}[/]", highlight=False)
        raise typer.Exit(2) from None
    overrides = {"max_model_len": max_model_len, "num_gpu_blocks": num_gpu_blocks}
    options = SimEngineOptions(
        replicas=replicas, host=host, base_port=base_port, profile=profile, served_model_name=model_name,
        seed=seed, startup_delay_s=startup_delay_s, faults=faults, mean_output_tokens=mean_output_tokens,
        config_overrides={k: v for k, v in overrides.items() if v is not None},
        ports_file=str(ports_file) if ports_file else None, sleep_mode=enable_sleep_mode, wake_s=wake_s,
        kv_events=kv_events, tokenizer=str(tokenizer) if tokenizer else None,
    )
    raise typer.Exit(run(options, out=lambda line: print(line, flush=True)))


@app.command("make-tiny-model",
             short_help="Generate a tiny Llama model (~7 MB, random weights) that vLLM serves on CPU.")
def make_tiny_model_cmd(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the model into.")],
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
) -> None:
    """Generate a tiny Llama model (random weights, ~7 MB) that real vLLM serves without a GPU
    or a model hub. Its output is noise; every request still runs through vLLM for real."""
    from fleet.engines.tinymodel import make_tiny_model

    with console.status(f"Generating tiny model in {out_dir}..."):
        path = make_tiny_model(out_dir, seed=seed)
    console.print(f"Tiny model ready: {path}")
