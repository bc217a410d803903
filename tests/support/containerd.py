"""A private containerd for the image tests: Debian's containerd 1.6 started on a socket, root and
state directory of its own (its CRI plugin off: no kubelet talks to it), so that ``ctr images
import`` and ``ctr run`` (runc) meet the archives fleet/testing/k8s/images.py writes, beside any
containerd the machine runs. Containers run in a namespace of the test's own, so their runc state
and cgroups never meet another containerd's.

Owns `PrivateContainerd`. Used by tests/integration/test_fleet_image.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from fleet.testing.k8s.buildcache import Unavailable
from tests.support.waits import wait_until

START_TIMEOUT_S = 30.0


class PrivateContainerd:
    """containerd with state under ``workdir`` (log: ``containerd.log``). A context manager:
    ``__enter__`` starts it and waits for its socket to answer (`START_TIMEOUT_S`), raising
    `Unavailable` when this is not root or containerd, ctr or runc is missing; ``__exit__`` stops
    it (SIGTERM, then SIGKILL after 10 s)."""

    def __init__(self, workdir: Path, namespace: str) -> None:
        self.workdir = workdir
        self.namespace = namespace
        self.socket = workdir / "containerd.sock"
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> PrivateContainerd:
        if os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("containerd", "ctr", "runc")):
            raise Unavailable("a private containerd needs root, containerd, ctr and runc (Debian: containerd, runc)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "config.toml"
        config.write_text(f'version = 2\nroot = "{self.workdir}/root"\nstate = "{self.workdir}/state"\n'
                          f'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
                          f'[grpc]\n  address = "{self.socket}"\n[ttrpc]\n  address = "{self.socket}.ttrpc"\n')  # fmt: skip
        with open(self.workdir / "containerd.log", "wb") as log:
            self._proc = subprocess.Popen(["containerd", "--config", str(config)], stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # fmt: skip
        wait_until(lambda: self._proc.poll() is not None or self.ctr("version").returncode == 0, START_TIMEOUT_S,
                   interval_s=0.2, what="containerd's socket", explain=self.log)  # fmt: skip
        if self._proc.poll() is not None:
            raise Unavailable(f"containerd exited with {self._proc.returncode}: {self.log()[-600:]!r}")
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)

    def log(self) -> str:
        path = self.workdir / "containerd.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def ctr(self, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
        """``ctr --address SOCKET -n NAMESPACE ARGS``; its completed process (text)."""
        return subprocess.run(["ctr", "--address", str(self.socket), "-n", self.namespace, *args],
                              capture_output=True, text=True, timeout=timeout_s)  # fmt: skip
