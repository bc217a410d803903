"""An image's contents run WITHOUT a container runtime: the OCI archive unpacked with umoci into a
runtime bundle (``rootfs/`` and the ``config.json`` a runtime would get: user, args, env, cwd), and
a command run in it as runc would run it, minus the isolation a test does not check: a private
mount namespace, the root file system bind-mounted read-only (the chart's
``readOnlyRootFilesystem: true``), the host's /dev and a fresh /proc, ``chroot`` as the image's
user with only the image's environment.

Owns `Bundle`, `unpack`, `image_env` and `run_in`. Used by tests/integration/test_fleet_image.py
(and by whoever checks an image's contents before a node runs it). Needs root, ``umoci`` and
util-linux's ``unshare`` and coreutils' ``chroot``; `unpack` raises `Unavailable` without them.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

from fleet.testing.k8s.buildcache import Unavailable
from fleet.testing.k8s.images import Image


@dataclass(frozen=True)
class Bundle:
    """An unpacked image: ``rootfs`` (its file system), ``runtime`` (umoci's runtime-spec
    config.json, a dict) and ``config`` (the image's own OCI config: ``Entrypoint``, ``Cmd``,
    ``User``, ``Env``, ...)."""

    rootfs: Path
    runtime: dict
    config: dict


def unpack(image: Image, dest: Path) -> Bundle:
    """Unpack ``image``'s OCI archive under ``dest`` (``layout/`` and ``bundle/``). Raises
    `Unavailable` when this is not root or umoci is missing, CalledProcessError when umoci fails."""
    if os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("umoci", "unshare", "chroot")):
        raise Unavailable("unpacking an image and running in it needs root, umoci, unshare and chroot")
    layout, bundle = dest / "layout", dest / "bundle"
    with tarfile.open(image.oci_archive) as tar:
        tar.extractall(layout, filter="tar")
    subprocess.run(["umoci", "unpack", "--image", f"{layout}:{image.name}", str(bundle)], check=True,
                   capture_output=True, text=True)  # fmt: skip
    index = json.loads((layout / "index.json").read_text())
    manifest = _blob(layout, index["manifests"][0]["digest"])
    config = _blob(layout, manifest["config"]["digest"])
    return Bundle(bundle / "rootfs", json.loads((bundle / "config.json").read_text()), config.get("config", {}))


def image_env(bundle: Bundle) -> dict[str, str]:
    """The environment a container of ``bundle`` starts with: the image's ``Env`` and the HOME a
    runtime derives from the user's /etc/passwd entry (containerd's ``WithUser``), as umoci
    wrote them into the runtime config."""
    return dict(item.split("=", 1) for item in bundle.runtime["process"]["env"])


def run_in(bundle: Bundle, args: list[str] | None = None, *, uid: int | None = None, gid: int | None = None,
           timeout_s: float = 60.0) -> subprocess.CompletedProcess:  # fmt: skip
    """Run ``args`` (default: the image's entrypoint and command) in ``bundle`` as ``uid``:``gid``
    (default: the image's user) on a read-only root, in /, with only the image's environment
    (`image_env`); its completed process (stdout, stderr as text). The host's ``env`` and
    ``chroot`` start it, so an image without a shell (the pause image) runs too. Raises
    TimeoutExpired."""
    process = bundle.runtime["process"]
    uid = process["user"]["uid"] if uid is None else uid
    gid = process["user"]["gid"] if gid is None else gid
    argv = args if args is not None else process["args"]
    root = shlex.quote(str(bundle.rootfs))
    env = [f"{k}={v}" for k, v in image_env(bundle).items()]
    script = "\n".join([
        "set -e",
        f"mount --bind {root} {root} && mount -o remount,bind,ro {root}",
        f"if [ -d {root}/dev ]; then mount --rbind /dev {root}/dev; fi",   # an image without them (pause)
        f"if [ -d {root}/proc ]; then mount -t proc proc {root}/proc; fi",
        f"exec env -i {shlex.join(env)} {shutil.which('chroot')} --userspec={uid}:{gid} {root} {shlex.join(argv)}",
    ])  # fmt: skip
    return subprocess.run(["unshare", "--mount", "--pid", "--fork", "sh", "-c", script], capture_output=True,
                          text=True, timeout=timeout_s)  # fmt: skip


def _blob(layout: Path, digest: str) -> dict:
    return json.loads((layout / "blobs" / digest.replace(":", "/")).read_text())
