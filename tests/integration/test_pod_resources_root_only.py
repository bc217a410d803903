"""The kubelet's PodResources socket is root's alone, as the kubelet stand-in makes it
(fleet/testing/k8s/podresources.py: the directory 0750, the socket 0755): ``fleet pod-devices``
run as a process of UID 10001 (the agent's user) is refused and says so in its relay file; run as
root with no capability (the chart's `pod-devices` container) it gets the answer. Why the chart
asks from a root container beside the agent (fleet/agent/pod_devices.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fleet.testing.fake_nvml import pcie_4gpu
from fleet.testing.k8s.deviceplugin import DevicePlugin
from fleet.testing.k8s.podconfig import BoxNode
from fleet.testing.k8s.podresources import serve_pod_resources
from fleet.testing.nvml_driver import write_state

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="runs processes as other users: needs root")


# Drops to the user after the imports: the interpreter and the checkout need not be theirs to read.
_AS_USER = """import os, sys
import grpc, fleet.agent.pod_devices, fleet.agent.podresources_api.api_pb2_grpc
from fleet.cli import app
uid = int(sys.argv[1])
if uid:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
app(sys.argv[2:])
"""


def _ask(socket: Path, out: Path, uid: int) -> dict:
    """``fleet pod-devices --once`` as ``uid`` (0: root with every capability dropped, as the
    chart's container runs); its relay file."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = ["pod-devices", "--once", "--out", str(out), "--pod-resources-socket", str(socket), "--timeout-s", "5"]
    argv = [sys.executable, "-c", _AS_USER, str(uid), *args]
    if uid == 0:
        argv = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", *argv]
    done = subprocess.run(argv, env=env, cwd=out.parent, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())


def test_only_root_reaches_the_socket_and_needs_no_capability(tmp_path):
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) not installed")
    short = Path(tempfile.mkdtemp(prefix="podres-"))     # a unix socket's path has at most 107 bytes
    try:
        state = write_state(short / "state.json", {**pcie_4gpu(), "devices": pcie_4gpu()["devices"][:1]})
        node = BoxNode("gpu-a", short / "root", state, DevicePlugin("gpu-a", state, short / "root"))
        (gpu,) = node.plugin.allocate("uid-1", "engine", "nvidia.com/gpu", 1, pod=("fleet", "chat-1"))
        server = serve_pod_resources(node)
        os.chmod(short, 0o755)
        drop = short / "out"
        drop.mkdir(mode=0o777)
        os.chmod(drop, 0o777)                             # an emptyDir: any container may write
        try:
            refused = _ask(server.socket, drop / "as-10001.json", 10001)
            assert refused["pods"] == [] and refused["stale"] is True
            assert "permission denied (uid 10001): only root reaches the kubelet's socket" in refused["reason"]
            answered = _ask(server.socket, drop / "as-root.json", 0)
            assert answered["pods"] == [{"namespace": "fleet", "name": "chat-1", "devices": [gpu]}]
            assert answered["stale"] is False and answered["reason"] is None
        finally:
            server.stop()
    finally:
        shutil.rmtree(short, ignore_errors=True)
