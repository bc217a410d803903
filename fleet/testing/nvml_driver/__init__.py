"""The per-node fake NVML "driver" of the cluster in a box: this folder holds a `pynvml` module
(fleet/testing/nvml_driver/pynvml.py) that a process gets by having `DRIVER_DIR` first on its
PYTHONPATH, with ``FLEET_FAKE_NVML`` naming its node's state file. Writing that file:
`fleet.testing.fake_nvml.write_state`, `inject_xid`, `update_device` (re-exported here)."""

from pathlib import Path

from fleet.testing.fake_nvml import FAKE_NVML_ENV, inject_xid, update_device, write_state  # noqa: F401

DRIVER_DIR = Path(__file__).resolve().parent
"""Prepend to PYTHONPATH: ``import pynvml`` then finds the stand-in."""
