"""The images a real node (fleet/testing/k8s/realnode.py) runs before Fleet's own image exists,
built here because no registry is reachable: the pause image every pod sandbox starts
(`PAUSE_IMAGE`, a static ``/pause`` compiled from `PAUSE_C`) and a workload image
(`BUSYBOX_IMAGE`, Debian's static busybox). Both are OCI image layouts written by hand
(`oci_archive`), which ``RealNode.import_image`` takes as it takes any image archive.

Owns `node_images`, `oci_archive`, `PAUSE_C`. Called by fleet/testing/k8s/realnode.py and
tests/integration/test_real_node.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

from fleet.testing.k8s.buildcache import Unavailable, run_step
from fleet.testing.k8s.kube import cache_dir

PAUSE_IMAGE = "k8s.gcr.io/pause:3.2"
BUSYBOX_IMAGE = "fleet.test/busybox:1.35"

PAUSE_C = r"""/* The pod sandbox's first process, as Kubernetes' build/pause/linux/pause.c (Apache-2.0):
   sleeps until SIGINT or SIGTERM and reaps the pod's orphans. */
#include <signal.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>
static void stop(int sig) { _exit(0); }
static void reap(int sig) { while (waitpid(-1, NULL, WNOHANG) > 0) {} }
int main(void) {
  struct sigaction on_stop = {.sa_handler = stop}, on_child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  if (getpid() != 1) fprintf(stderr, "Warning: pause should be the first process\n");
  if (sigaction(SIGINT, &on_stop, NULL) || sigaction(SIGTERM, &on_stop, NULL) || sigaction(SIGCHLD, &on_child, NULL))
    return 1;
  for (;;) pause();
}
"""


def node_images(cache: Path | None = None) -> dict[str, Path]:
    """``{"pause": PATH, "busybox": PATH}``: OCI archives of `PAUSE_IMAGE` (a static ``/pause``
    compiled from `PAUSE_C`) and `BUSYBOX_IMAGE` (Debian's static busybox as ``/bin/busybox``, a
    link per applet, ``/bin/sh`` among them), built once into ``cache`` (default
    ``~/.cache/fleet/realnode``, beside the kube build) under names keyed by their inputs.
    Raises `Unavailable` when gcc or busybox-static is missing."""
    cache = cache or cache_dir().parent / "realnode"
    cache.mkdir(parents=True, exist_ok=True)
    busybox = Path("/bin/busybox")
    if not busybox.exists() or shutil.which("gcc") is None:
        raise Unavailable("/bin/busybox (Debian's busybox-static) or gcc missing: the node's images cannot be built")
    gcc = subprocess.run(["gcc", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    pause_key = hashlib.sha256((PAUSE_C + "".join(gcc)).encode()).hexdigest()[:12]
    pause = cache / f"pause-{pause_key}.tar"
    if not pause.exists():
        binary = cache / "pause.bin"
        (cache / "pause.c").write_text(PAUSE_C)
        run_step("gcc pause.c", ["gcc", "-static", "-Os", "-s", "-o", str(binary), str(cache / "pause.c")],
                 time.monotonic() + 120)  # fmt: skip
        oci_archive(pause, PAUSE_IMAGE, [("pause", binary.read_bytes(), 0o755)],
                    {"Entrypoint": ["/pause"], "User": "65535:65535"})  # fmt: skip
        binary.unlink()
        (cache / "pause.c").unlink()
    data = busybox.read_bytes()
    box = cache / f"busybox-{hashlib.sha256(data).hexdigest()[:12]}.tar"
    if not box.exists():
        applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True).stdout.split()
        files = [("bin/busybox", data, 0o755), *((f"bin/{a}", "busybox", 0o777) for a in applets if a != "busybox"),
                 ("tmp/", None, 0o1777), ("root/", None, 0o700),
                 ("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n", 0o644),
                 ("etc/group", b"root:x:0:\nnogroup:x:65534:\n", 0o644)]  # fmt: skip
        oci_archive(box, BUSYBOX_IMAGE, files, {"Cmd": ["/bin/sh"], "Env": ["PATH=/bin"]})
    return {"pause": pause, "busybox": box}


def oci_archive(dest: Path, ref: str, files: list[tuple[str, bytes | str | None, int]], config: dict) -> Path:
    """Write ``dest``: a tar of an OCI image layout holding one image named ``ref`` (the
    ``io.containerd.image.name`` annotation ``ctr images import`` reads) for this machine's
    architecture, of one uncompressed layer, reproducibly (mtime 0, owner root). ``files``:
    ``(path, content, mode)`` with bytes for a file, a str for a symlink's target, None for a
    directory (path ending in ``/``); ``config``: the image config's ``config`` (Entrypoint, Cmd,
    Env, User: the OCI image spec's config.md)."""
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    layer = _tar([(path, content, mode) for path, content, mode in files])
    image_config = json.dumps({"architecture": arch, "os": "linux", "config": config,
                               "rootfs": {"type": "layers", "diff_ids": [_digest(layer)]}}).encode()  # fmt: skip
    oci = "application/vnd.oci.image"
    manifest = json.dumps({"schemaVersion": 2, "mediaType": f"{oci}.manifest.v1+json",
                           "config": _descriptor(f"{oci}.config.v1+json", image_config),
                           "layers": [_descriptor(f"{oci}.layer.v1.tar", layer)]}).encode()  # fmt: skip
    entry = {**_descriptor(f"{oci}.manifest.v1+json", manifest), "platform": {"architecture": arch, "os": "linux"},
             "annotations": {"io.containerd.image.name": ref,
                             "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[-1]}}  # fmt: skip
    index = json.dumps({"schemaVersion": 2, "manifests": [entry]}).encode()
    blobs = [(f"blobs/sha256/{_digest(b)[7:]}", b, 0o644) for b in (layer, image_config, manifest)]
    partial = dest.with_suffix(".partial")
    partial.write_bytes(_tar([("oci-layout", b'{"imageLayoutVersion": "1.0.0"}', 0o644),
                              ("index.json", index, 0o644), ("blobs/", None, 0o755), ("blobs/sha256/", None, 0o755),
                              *blobs]))  # fmt: skip
    os.replace(partial, dest)
    return dest


def _tar(files: list[tuple[str, bytes | str | None, int]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, content, mode in files:
            info = tarfile.TarInfo(path.rstrip("/"))
            info.mode, info.mtime = mode, 0
            if content is None:
                info.type = tarfile.DIRTYPE
            elif isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content
            else:
                info.size = len(content)
            tar.addfile(info, io.BytesIO(content) if isinstance(content, bytes) else None)
    return buf.getvalue()


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _descriptor(media_type: str, data: bytes) -> dict:
    return {"mediaType": media_type, "digest": _digest(data), "size": len(data)}
