"""vLLM's sleep mode as the engine SIMULATOR models it: the state one replica is in and how long
it takes to wake.

What vLLM does (sources, all in vllm-project/vllm):

- ``--enable-sleep-mode`` turns it on; the HTTP endpoints exist only with
  ``VLLM_SERVER_DEV_MODE=1`` (docs/features/sleep_mode.md, "Online inference"):
  ``POST /sleep?level=N`` (level 1 by default; an empty 200), ``POST /wake_up`` (an empty 200
  once the weights are back), ``GET /is_sleeping`` (``{"is_sleeping": bool}``)
  (vllm/entrypoints/openai/api_server.py, the dev-mode routes).
- Level 1 copies the weights to CPU memory and discards the KV cache; level 2 discards both
  (docs/features/sleep_mode.md, "Sleep levels"). Fleet keeps standby replicas at level 1 only.
- While asleep, endpoints that need the weights (``/v1/completions``,
  ``/v1/chat/completions``, ...) answer 503; ``/v1/models`` and the other weight-free endpoints
  keep working (docs/source/features/sleep_mode.md, "Protected Endpoints").
- Only some platforms can sleep: ``ModelConfig`` raises ``ValueError("Sleep mode is not
  supported on current platform.")`` unless ``current_platform.is_sleep_mode_available()``,
  which is true for CUDA (and ROCm, XPU in later releases) and false for the CPU platform
  (vllm/config/model.py; vllm/platforms/interface.py).

Wake time: llm-d's fast-model-actuation measured about 3 s to wake a model with 64 GiB of
tensor data from level 1 (llm-d-incubation/llm-d-fast-model-actuation, README.md), i.e. the
weights stream host -> device at ~21.3 GiB/s; `wake_time_s` scales that by the weight bytes one
GPU holds (tensor-parallel shards wake in parallel).
"""

from __future__ import annotations

from dataclasses import dataclass

LLMD_WAKE_S = 3.0                    # llm-d fast-model-actuation README: ~3 s ...
LLMD_WAKE_BYTES = 64 * 2**30         # ... for 64 GiB of tensor data
WAKE_BYTES_PER_S = LLMD_WAKE_BYTES / LLMD_WAKE_S


def wake_time_s(weight_bytes_per_gpu: int) -> float:
    """Seconds to wake from level-1 sleep with `weight_bytes_per_gpu` bytes of weights on each GPU.

    Raises:
        ValueError: a negative byte count.
    """
    if weight_bytes_per_gpu < 0:
        raise ValueError(f"weight_bytes_per_gpu must be >= 0, got {weight_bytes_per_gpu}")
    return weight_bytes_per_gpu / WAKE_BYTES_PER_S


def parse_level(raw: str | None) -> int:
    """The ``level`` query parameter of ``POST /sleep`` (absent: 1, vLLM's default).

    Raises:
        ValueError: not an integer, not 1 or 2, or 2 (vLLM's level 2 discards the weights, so
            a wake needs a weight reload the simulator does not model; Fleet sleeps at level 1).
    """
    if raw is None or raw == "":
        return 1
    try:
        level = int(raw)
    except ValueError:
        raise ValueError(f"level: must be 1 or 2, got {raw!r}") from None
    if level == 2:
        raise ValueError("level: 2 discards the weights and is not modelled by the simulator; use 1")
    if level != 1:
        raise ValueError(f"level: must be 1 or 2, got {level}")
    return level


@dataclass
class SleepState:
    """Whether one replica sleeps, in the replica's clock seconds.

    ``level`` is 0 awake, else the level it was put to sleep at. A replica is asleep from the
    ``/sleep`` call until its ``/wake_up`` finishes (weights back on the GPU): a request that
    arrives while it wakes is refused too, as it would find no weights.
    """

    level: int = 0
    slept_at_s: float | None = None
    waking: bool = False
    sleeps: int = 0
    wakes: int = 0

    @property
    def asleep(self) -> bool:
        return self.level != 0

    def sleep(self, level: int, now_s: float) -> None:
        """Go to sleep (again: a no-op, as in vLLM, keeping the first level)."""
        if self.asleep:
            return
        self.level, self.slept_at_s = level, now_s
        self.sleeps += 1

    def woke(self) -> None:
        """The weights are back: serve again."""
        if self.asleep:
            self.wakes += 1
        self.level, self.slept_at_s, self.waking = 0, None, False

    def to_dict(self) -> dict[str, object]:
        return {"is_sleeping": self.asleep, "level": self.level, "waking": self.waking,
                "sleeps": self.sleeps, "wakes": self.wakes}  # fmt: skip
