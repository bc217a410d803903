"""What each engine-SIMULATOR profile predicts: TTFT and TPOT over prompt length x batch size.

Pure virtual time (no sockets, no sleeping; runs in well under a second): for each profile
and cell, B requests of P distinct prompt tokens and M output tokens arrive together; prints
the mean time to first token, mean time per output token, and the cross-check against the
published measurement each GPU profile was built from (fleet/enginesim/profiles.py).

Usage: python loadtests/sim_profile_table.py [--output-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fleet.enginesim.model import Arrival, EngineModel, run_virtual  # noqa: E402
from fleet.enginesim.profiles import get_profile, profile_names  # noqa: E402

# Lambda Labs' vLLM benchmark prompt set (results/prompt_10/*.json): 10 ShareGPT prompts at once.
LAMBDA_INPUT_LENS = [13, 25, 27, 10, 329, 29, 399, 328, 4, 205]


def cell(profile: str, prompt: int, batch: int, out: int) -> tuple[float, float]:
    m = EngineModel(get_profile(profile).config, get_profile(profile).cost)
    arrivals = [Arrival(0.0, f"r{i}", list(range(i * 100_000, i * 100_000 + prompt)), out) for i in range(batch)]
    done = run_virtual(m, arrivals)
    return statistics.mean(fr.ttft_s for fr in done), statistics.mean(fr.tpot_s for fr in done)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output-tokens", type=int, default=64)
    args = ap.parse_args()
    out = args.output_tokens
    for name in profile_names():
        p = get_profile(name)
        prompts = [p for p in (128, 512, 1024, 4096) if p + out <= get_profile(name).config.max_model_len]
        print(f"\n{name}: {p.model} on {p.hardware}")
        print(f"  {'prompt':>7} " + " ".join(f"{'B=' + str(b):>21}" for b in (1, 16, 64)))
        for prompt in prompts:
            cols = []
            for b in (1, 16, 64):
                ttft, tpot = cell(name, prompt, b, out)
                cols.append(f"{ttft * 1e3:8.1f} / {tpot * 1e3:5.1f} ms")
            print(f"  {prompt:>7} " + " ".join(f"{c:>21}" for c in cols))
        if name.startswith("h100"):
            m = EngineModel(p.config, p.cost)
            done = run_virtual(m, [Arrival(0.0, f"r{i}", list(range(i * 10_000, i * 10_000 + n)), 100)
                                   for i, n in enumerate(LAMBDA_INPUT_LENS)])  # fmt: skip
            print(f"  Lambda's 10-prompt batch (1,369 prompt tokens): simulated TTFT "
                  f"{statistics.mean(fr.ttft_s for fr in done) * 1e3:.1f} ms, TPOT "
                  f"{statistics.mean(fr.tpot_s for fr in done) * 1e3:.2f} ms")
    print("\n(cells: mean TTFT / mean TPOT; B requests of `prompt` distinct tokens and "
          f"{out} output tokens arriving together)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
