"""`fleet` over a stand-in NVML with a faulty GPU: ``python -m tests.support.fake_gpu_fleet up ...``.

For end-to-end tests on machines without an NVIDIA GPU (CI, the 2-core dev machine): installs
tests/support/fake_nvml.py's `FakePynvml` as the ``pynvml`` module (before Fleet imports it), then runs
the `fleet` command line in this process. The machine it shows: eight H100 80GB HBM3 on NVSwitch
(`nvswitch_8gpu`, each device shaped like the real H100 reading in tests/data), GPU 7 with two
volatile uncorrected ECC errors (a double-bit error) and one Xid 48 event queued once it is
registered for events, every GPU reading `BUSY_PERCENT` % utilization (the simulated engines
compute nothing on them: a constant stands in, so the busy GPU-hours of the cost row have a
known share). So `fleet up`'s node agent (fleet/agent/runner.py) runs its real checks,
finds the fault, quarantines GPU 7 and exports it, while replicas of ``accelerator: cpu``
deployments run as anywhere. Only the engine subprocesses' view differs: they import no NVML.
"""

from __future__ import annotations

import sys

from tests.support.fake_nvml import FakePynvml, nvswitch_8gpu

FAULTY_GPU = 7
XID = 48   # double-bit ECC error (fleet/agent/xid.py)
BUSY_PERCENT = 60


class FaultyGpuNvml(FakePynvml):
    """The stand-in NVML with GPU `FAULTY_GPU`'s double-bit ECC error and its Xid."""

    def __init__(self) -> None:
        super().__init__(nvswitch_8gpu())
        self.inject(FAULTY_GPU, ecc_volatile_uncorrected=2)
        for index in range(len(self.snap["devices"])):
            self.inject(index, utilization={"gpu": BUSY_PERCENT, "memory": 20})

    def nvmlDeviceRegisterEvents(self, h, types, event_set):
        super().nvmlDeviceRegisterEvents(h, types, event_set)
        if h == FAULTY_GPU:
            self.inject_xid(FAULTY_GPU, XID)


def main() -> None:
    sys.modules["pynvml"] = FaultyGpuNvml()  # type: ignore[assignment]  # a module stand-in
    from fleet.cli import app

    app(prog_name="fleet")


if __name__ == "__main__":
    main()
