"""The NVIDIA container runtime's stand-in (fleet/testing/k8s/nvidia_runtime.py): which containers
get the fake NVML driver, what they get (the mounts and variables the device plugin's ``Allocate``
answers), and which runc command lines it reads a bundle from. Pure: no runc is run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleet.testing.k8s import deviceplugin_grpc
from fleet.testing.k8s.nvidia_runtime import DRIVER_DIR, DRIVER_MOUNT, STATE_MOUNT, _bundle, inject, write_wrapper
from fleet.testing.nvml_driver import DRIVER_DIR as DRIVER_PACKAGE_DIR


def _spec(*env: str) -> dict:
    return {"process": {"env": ["PATH=/usr/bin", *env]}, "mounts": [{"destination": "/proc", "type": "proc"}]}


@pytest.mark.parametrize("visible", ["all", "GPU-1,GPU-2", "0"])
def test_a_container_asking_for_gpus_gets_the_driver(visible):
    spec = _spec(f"NVIDIA_VISIBLE_DEVICES={visible}", "PYTHONPATH=/app")
    assert inject(spec, Path("/nodes/n1/state.json"), Path("/repo/nvml_driver")) is True
    env = dict(e.split("=", 1) for e in spec["process"]["env"])
    assert env["FLEET_FAKE_NVML"] == f"{STATE_MOUNT}/state.json" and env["PYTHONPATH"] == f"{DRIVER_MOUNT}:/app"
    assert env["NVIDIA_VISIBLE_DEVICES"] == visible and env["PATH"] == "/usr/bin"
    assert [(m["destination"], m["source"], "ro" in m["options"]) for m in spec["mounts"][1:]] == [
        (STATE_MOUNT, "/nodes/n1", True), (DRIVER_MOUNT, "/repo/nvml_driver", True)]


@pytest.mark.parametrize("env", [(), ("NVIDIA_VISIBLE_DEVICES=void",), ("NVIDIA_VISIBLE_DEVICES=none",),
                                 ("NVIDIA_VISIBLE_DEVICES=",),
                                 ("NVIDIA_VISIBLE_DEVICES=GPU-1", "FLEET_FAKE_NVML=/run/fleet-fake-nvml/s.json")])
def test_other_containers_are_left_as_they_are(env):
    spec = _spec(*env)
    before = json.dumps(spec)
    assert inject(spec, Path("/nodes/n1/state.json")) is False
    assert json.dumps(spec) == before


def test_the_same_mounts_as_the_device_plugin_answers():
    assert (deviceplugin_grpc.STATE_MOUNT, deviceplugin_grpc.DRIVER_MOUNT) == (STATE_MOUNT, DRIVER_MOUNT)
    assert DRIVER_DIR == DRIVER_PACKAGE_DIR


@pytest.mark.parametrize("args, bundle", [
    (["--root", "/r", "--log", "/l", "create", "--bundle", "/b/1", "--pid-file", "p", "id"], "/b/1"),
    (["create", "-b", "/b/2", "id"], "/b/2"),
    (["create", "--bundle=/b/3", "id"], "/b/3"),
    (["--root", "/r", "start", "id"], None),
    (["--root", "/r", "exec", "--process", "/p.json", "id"], None),
])
def test_the_bundle_is_read_from_create_only(args, bundle):
    assert _bundle(args) == (None if bundle is None else Path(bundle))


def test_the_wrapper_calls_runc_through_this_module(tmp_path):
    path = write_wrapper(tmp_path / "nvidia-container-runtime", "/usr/sbin/runc", tmp_path / "state.json", "/py")
    text = path.read_text()
    assert path.stat().st_mode & 0o111 and text.startswith("#!/bin/sh\nexec \"/py\" -I -S ")
    assert '"/usr/sbin/runc"' in text and text.rstrip().endswith('-- "$@"')
