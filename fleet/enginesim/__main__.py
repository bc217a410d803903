"""``python -m fleet.enginesim``: one SIMULATED replica with vLLM's command-line flags.

What `engine.kind: sim` launches (fleet.engines.kinds.SimEngine): the same flags Fleet gives vLLM's
OpenAI server (``--model``, ``--served-model-name``, ``--host``, ``--port``,
``--tensor-parallel-size``), the vLLM flags the simulator models (``--max-model-len``,
``--max-num-seqs``, ``--max-num-batched-tokens``, ``--block-size``,
``--num-gpu-blocks-override``, ``--[no-]enable-prefix-caching``, ``--kv-events-config``: KV cache
events on vLLM's wire, `fleet.enginesim.kvpublish`; ``--enable-prompt-tokens-details``: the
prefix-cache hit in each usage object), the simulator's own
(``--profile``, ``--seed``, ``--startup-delay-s``, fault switches, ``--replicas``,
``--ports-file``; ``--tokenizer DIR``, vLLM's flag too, tokenizes with a model's real tokenizer); other vLLM flags (``--enforce-eager``, ``--gpu-memory-utilization``, ...) are
accepted and ignored with a note, so a deployment can switch between ``vllm`` and ``sim``
without editing its args.

``--model`` may be a path that need not exist, or ``sim://PROFILE``.
"""

from __future__ import annotations

import argparse
import sys

from fleet.enginesim.faults import FaultPlan
from fleet.enginesim.kvpublish import KvEventsConfig, KvEventsConfigError
from fleet.enginesim.profiles import profile_names
from fleet.enginesim.runner import SimEngineOptions, run


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fleet.enginesim",
        description="Fleet engine SIMULATOR: serves vLLM's OpenAI API and metrics with modelled latencies.",
    )
    p.add_argument("--model", default="", help="Model source: a path (need not exist) or sim://PROFILE.")
    p.add_argument("--served-model-name", default=None, help="Name clients send as `model`.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="Port of the first replica (0 = any free port).")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="Accepted; the profile sets timing.")
    p.add_argument("--profile", default=None, help=f"Simulator profile: {', '.join(profile_names())}.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-delay-s", type=float, default=0.0, help="Seconds before listening.")
    p.add_argument("--fail-at-start", action="store_true", help="Fault: exit 1 instead of listening.")
    p.add_argument("--crash-after-requests", type=int, default=None, help="Fault: die after N answers.")
    p.add_argument("--slowdown", type=float, default=1.0, help="Fault: every step takes this factor longer.")
    p.add_argument("--mean-output-tokens", type=float, default=None,
                   help="Stop requests without ignore_eos at an EOS with this mean length.")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=None)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--enable-sleep-mode", action="store_true",
                   help="Serve vLLM's POST /sleep, POST /wake_up and GET /is_sleeping.")
    p.add_argument("--wake-s", type=float, default=None,
                   help="Seconds a wake from level-1 sleep takes (default: the profile's weight bytes per GPU "
                        "at llm-d's measured ~21.3 GiB/s).")
    p.add_argument("--kv-events-config", default=None,
                   help="vLLM's KV events config (JSON: enable_kv_cache_events, publisher, endpoint, replay_endpoint, "
                        "buffer_steps, hwm, topic); replica i of --replicas offsets the ports by i.")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="As vLLM's: the usage object carries prompt_tokens_details.cached_tokens "
                        "(prompt tokens found in the prefix cache).")
    p.add_argument("--replicas", type=int, default=1, help="Replicas in this process, on consecutive ports.")
    p.add_argument("--ports-file", default=None, help="Write the bound ports as JSON here.")
    p.add_argument("--tokenizer", default=None,
                   help="A model directory (tokenizer.json, tokenizer_config.json, chat template): tokenize prompts "
                        "as vLLM does with that tokenizer, so token ids agree with the router's. Default: the "
                        "simulator's word tokenizer.")
    return p


def options_from_args(argv: list[str]) -> tuple[SimEngineOptions, list[str]]:
    """Parsed options and the vLLM flags that were ignored. Raises SystemExit on bad flags."""
    args, ignored = parser().parse_known_args(argv)
    try:
        faults = FaultPlan(fail_at_start=args.fail_at_start, crash_after_requests=args.crash_after_requests,
                           slowdown=args.slowdown)  # fmt: skip
    except ValueError as err:
        parser().error(str(err))
    try:
        kv_events = KvEventsConfig.from_json(args.kv_events_config) if args.kv_events_config else None
    except KvEventsConfigError as err:
        parser().error(str(err))
    overrides = {
        "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "block_size": args.block_size,
        "num_gpu_blocks": args.num_gpu_blocks_override, "enable_prefix_caching": args.enable_prefix_caching,
    }  # fmt: skip
    opts = SimEngineOptions(
        replicas=args.replicas, host=args.host, base_port=args.port, profile=args.profile,
        model_source=args.model, served_model_name=args.served_model_name, seed=args.seed,
        startup_delay_s=args.startup_delay_s, faults=faults, mean_output_tokens=args.mean_output_tokens,
        config_overrides={k: v for k, v in overrides.items() if v is not None}, ports_file=args.ports_file,
        sleep_mode=args.enable_sleep_mode, wake_s=args.wake_s, kv_events=kv_events, tokenizer=args.tokenizer,
        prompt_tokens_details=args.enable_prompt_tokens_details,
    )  # fmt: skip
    return opts, ignored


def main(argv: list[str] | None = None) -> int:
    opts, ignored = options_from_args(sys.argv[1:] if argv is None else argv)
    if ignored:
        print(f"fleet sim: ignoring vLLM arguments the simulator does not model: {' '.join(ignored)}", flush=True)
    return run(opts)


if __name__ == "__main__":
    sys.exit(main())
