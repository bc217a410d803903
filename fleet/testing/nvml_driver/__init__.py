"""The per-node fake NVML "driver" of the cluster in a box and the real node: this folder holds a
`pynvml` module (fleet/testing/nvml_driver/pynvml.py) that a process gets by having `DRIVER_DIR`
first on its PYTHONPATH, with ``FLEET_FAKE_NVML`` naming its node's state file, and the one
implementation it serves (fleet/testing/nvml_driver/fleet_nvml_stand_in.py, stdlib only). Writing
that file: `write_state`, `inject_xid`, `update_device` (re-exported here)."""

from pathlib import Path

from fleet.testing.nvml_driver.fleet_nvml_stand_in import (  # noqa: F401 - re-exported
    FAKE_NVML_ENV, inject_xid, update_device, write_state,
)

DRIVER_DIR = Path(__file__).resolve().parent
"""Prepend to PYTHONPATH: ``import pynvml`` then finds the stand-in."""
