"""The per-node fake NVML "driver" of the cluster in a box (fleet/testing/nvml_driver/pynvml.py over
fleet/testing/fake_nvml.py `FileNvml`): the state file, NVIDIA_VISIBLE_DEVICES, Xid events once
per process and only after registration, and every public name existing in nvidia-ml-py. The
real readers (`PynvmlReader`, `NvmlHealthReader`) run over it. In-process: the module is loaded
under another name, beside the real `pynvml`."""

from __future__ import annotations

import importlib.util
import json

import pynvml as real_pynvml
import pytest

from fleet.agent.health import GpuHealthChecker, Severity
from fleet.agent.nvml_health import NvmlHealthReader
from fleet.inventory.nvml import PynvmlReader, node_from_nvml
from fleet.testing.fake_nvml import FileNvml, mig_h100, nvlink_pairs_4gpu, nvswitch_8gpu
from fleet.testing.nvml_driver import DRIVER_DIR, inject_xid, update_device, write_state
from tests.support.fakes import FakeClock


def _driver_module(name: str = "fleet_fake_pynvml"):
    spec = importlib.util.spec_from_file_location(name, DRIVER_DIR / "pynvml.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_of_the_driver_exists_in_nvidia_ml_py():
    module = _driver_module()
    public = [n for n in vars(module) if not n.startswith("_")]
    assert len(public) > 40 and "nvmlInit" in public and "NVMLError" in public
    assert [n for n in public if not hasattr(real_pynvml, n)] == []


def test_without_a_state_file_nvml_is_unavailable(tmp_path):
    nv = FileNvml(environ={"FLEET_FAKE_NVML": str(tmp_path / "none.json")})
    with pytest.raises(RuntimeError, match="NVML unavailable: NVML Shared Library Not Found"):
        PynvmlReader(nv).snapshot()
    with pytest.raises(RuntimeError, match="Not Found"):
        PynvmlReader(FileNvml(environ={})).snapshot()


def test_the_real_reader_sees_the_nodes_topology_through_the_driver(tmp_path):
    path = write_state(tmp_path / "node.json", nvlink_pairs_4gpu())
    nv = _driver_module()
    nv._driver._environ = {"FLEET_FAKE_NVML": str(path), "NVIDIA_VISIBLE_DEVICES": "all"}
    inv = node_from_nvml(PynvmlReader(nv).snapshot(), "n")
    assert inv.nvlink_domains == ((0, 1), (2, 3)) and len(inv.gpus) == 4


@pytest.mark.parametrize("visible, uuids", [
    ("all", [0, 1, 2, 3, 4, 5, 6, 7]), (None, [0, 1, 2, 3, 4, 5, 6, 7]), ("none", []), ("", []),
    ("2,5", [2, 5]), ("GPU-00000006-0000-0000-0000-000000000000,1", [1, 6]),
])
def test_nvidia_visible_devices_picks_and_renumbers_the_gpus(tmp_path, visible, uuids):
    path = write_state(tmp_path / "node.json", nvswitch_8gpu())
    env = {"FLEET_FAKE_NVML": str(path)} | ({} if visible is None else {"NVIDIA_VISIBLE_DEVICES": visible})
    snap = PynvmlReader(FileNvml(environ=env)).snapshot()
    assert [d["uuid"] for d in snap["devices"]] == [f"GPU-{i:08d}-0000-0000-0000-000000000000" for i in uuids]
    assert [d["index"] for d in snap["devices"]] == list(range(len(uuids)))   # numbered 0.. as in a container


def test_a_mig_device_makes_its_gpu_visible_with_that_instance_only(tmp_path):
    path = write_state(tmp_path / "node.json", mig_h100([[("3g.40gb", 0), ("3g.40gb", 4)]] * 2))
    snap = PynvmlReader(FileNvml(environ={"FLEET_FAKE_NVML": str(path), "NVIDIA_VISIBLE_DEVICES": "MIG-1-1"})).snapshot()
    [gpu] = snap["devices"]
    assert [m["uuid"] for m in gpu["mig_instances"]] == ["MIG-1-1"]
    with pytest.raises(RuntimeError, match="Not Found"):
        PynvmlReader(FileNvml(environ={"FLEET_FAKE_NVML": str(path), "NVIDIA_VISIBLE_DEVICES": "MIG-9"})).snapshot()


def test_xids_written_to_the_file_reach_the_health_checker_once_and_only_new_ones(tmp_path):
    path = write_state(tmp_path / "node.json", nvswitch_8gpu())
    uuid = "GPU-00000003-0000-0000-0000-000000000000"
    inject_xid(path, uuid, 48, at_s=1.0)                              # before anyone registered: history
    env = {"FLEET_FAKE_NVML": str(path), "NVIDIA_VISIBLE_DEVICES": "all"}
    checker = GpuHealthChecker(NvmlHealthReader(FileNvml(environ=env)), FakeClock())
    assert checker.check() == []
    inject_xid(path, uuid, 79)
    inject_xid(path, "GPU-00000009-0000-0000-0000-000000000000", 79)   # not on this node: never delivered
    [f] = checker.check()
    assert (f.target, f.xid, f.severity, f.certain) == (uuid, 79, Severity.FAULT, True)
    assert checker.check() == []                                     # once per process
    other = GpuHealthChecker(NvmlHealthReader(FileNvml(environ=env)), FakeClock())
    assert other.check() == []                                       # a new process: history again
    update_device(path, uuid, lost=True)
    [f] = checker.check()
    assert f.check == "gpu_lost" and f.target == uuid


def test_an_event_wait_with_a_timeout_returns_when_the_file_gets_one(tmp_path):
    import threading

    path = write_state(tmp_path / "node.json", nvswitch_8gpu())
    nv = FileNvml(environ={"FLEET_FAKE_NVML": str(path)})
    nv.nvmlInit()
    events = nv.nvmlEventSetCreate()
    nv.nvmlDeviceRegisterEvents(nv.nvmlDeviceGetHandleByIndex(2), nv.nvmlEventTypeXidCriticalError, events)
    with pytest.raises(nv.NVMLError) as err:
        nv.nvmlEventSetWait_v2(events, 0)
    assert err.value.value == nv.NVML_ERROR_TIMEOUT
    timer = threading.Timer(0.05, inject_xid, (path, "GPU-00000002-0000-0000-0000-000000000000", 94, 3))
    timer.start()
    try:
        data = nv.nvmlEventSetWait(events, 30_000)
    finally:
        timer.join()
    assert (data.device, data.eventData, data.gpuInstanceId) == (2, 94, 3)
    assert json.loads(path.read_text())["xid_events"][0]["xid"] == 94


def test_the_driver_needs_nothing_but_the_stdlib():
    """A container of Fleet's image has no fleet/testing: every import of the driver directory's
    modules (imports inside functions too) is of the standard library, and pynvml.py finds its
    implementation by its own path, not by a package import."""
    import ast
    import sys

    imported = {}
    for path in sorted(DRIVER_DIR.glob("*.py")):
        if path.name == "__init__.py":   # the tests' door into the folder, never on a container's path
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            for name in names:
                imported.setdefault(name.split(".")[0], set()).add(path.name)
    assert {"pynvml.py", "fleet_nvml_stand_in.py"} <= {p for ps in imported.values() for p in ps}
    assert {m: ps for m, ps in imported.items() if m not in sys.stdlib_module_names and m != "__future__"} == {}
