"""The stand-in NVML of fleet/testing/fake_nvml.py (shared with the benchmarks and the cluster in a
box), under the name the tests have always imported it by."""

from fleet.testing.fake_nvml import (  # noqa: F401 - re-exported
    A100_80, DATA, H100, FakeNVMLError, FakeNvml, FakePynvml, FileNvml, device, inject_xid, mig_h100, update_device,
    nvlink_pairs_4gpu, nvswitch_8gpu, partial_nvlink_8gpu, pcie_4gpu, real_h100_snapshot, write_state,
)
