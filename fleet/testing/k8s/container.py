"""Start one container of the cluster in a box: its own mount namespace, its volumes bind-mounted
at their ``mountPath``, its user and groups, then ``exec`` of its command. A TEST STAND-IN for a
container runtime (runc), used by `fleet.testing.k8s.podrunner`; Linux and root only.

``python -m fleet.testing.k8s.container SPEC.json`` where the JSON holds ``argv``, ``env``,
``mounts`` (``[{"source", "target", "readOnly"}]``: directories, or files for subPath-like
mounts), ``imagePaths`` (what the "image" holds: kept visible over volumes and reachable to the
container's user, see `_stage_image`), ``uid``, ``gid``, ``groups``, ``readOnlyRoot``. Not isolated beyond mounts and
credentials: the process shares the network, PIDs and the file system outside its mounts with
the machine (docs/kubernetes.md, "The cluster in a box").
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

CLONE_NEWNS = 0x00020000
MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6", use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(libc: ctypes.CDLL, source: str | None, target: str, flags: int) -> None:
    _check(libc.mount(source.encode() if source else None, target.encode(), None, flags, None),
           f"mount {source} {target}")


def _closed_parent(path: str) -> str | None:
    """The nearest ancestor of ``path`` that others may not traverse (mode without o+x), or None."""
    parts = os.path.abspath(path).split("/")
    for i in range(2, len(parts)):
        parent = "/".join(parts[:i])
        if not os.stat(parent).st_mode & 0o001:
            return parent
    return None


def _stage_image(libc: ctypes.CDLL, paths: list[str]) -> list[tuple[str, str]]:
    """Bind ``paths`` (the "image": the repository and this interpreter's installation) aside,
    before anything is mounted over them, and make them reachable to any user when a parent
    directory is closed (e.g. Python under /root): a tmpfs covers the closed directory in this
    namespace only. `_restore_image` puts them back at their own places."""
    staged: list[tuple[str, str]] = []
    closed: set[str] = set()
    for i, path in enumerate(paths):
        stage = f"/run/fleet-box-image/{os.getpid()}-{i}"
        os.makedirs(stage, exist_ok=True)
        _mount(libc, path, stage, MS_BIND | MS_REC)
        staged.append((stage, path))
        parent = _closed_parent(path)
        if parent is not None:
            closed.add(parent)
    for parent in sorted(closed, key=len):
        _check(libc.mount(b"tmpfs", parent.encode(), b"tmpfs", 0, b"mode=0755"), f"mount tmpfs {parent}")
    return staged


def _restore_image(libc: ctypes.CDLL, staged: list[tuple[str, str]]) -> None:
    """Bind the image back at its paths, over any volume mounted on a parent of one (an emptyDir
    at /tmp must not hide a repository checked out under /tmp)."""
    for stage, path in staged:
        os.makedirs(path, exist_ok=True)
        _mount(libc, stage, path, MS_BIND | MS_REC)


def enter(spec: dict) -> None:
    """Set the namespace up as ``spec`` says and exec its ``argv``. Raises OSError on failure."""
    libc = _libc()
    _check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(libc, None, "/", MS_REC | MS_PRIVATE)
    image = _stage_image(libc, spec.get("imagePaths", []))
    staged = []
    for i, m in enumerate(spec.get("mounts", [])):   # first all sources, before a mount hides one (/tmp)
        stage = f"/run/fleet-box-stage/{os.getpid()}/{i}"
        if os.path.isdir(m["source"]):
            os.makedirs(stage, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(stage), exist_ok=True)
            open(stage, "a").close()
        _mount(libc, m["source"], stage, MS_BIND | MS_REC)
        staged.append((stage, m))
    for stage, m in staged:
        target = m["target"]
        if os.path.isdir(stage):
            os.makedirs(target, exist_ok=True)   # mount points: empty directories on the machine
        elif not os.path.exists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "a").close()
        _mount(libc, stage, target, MS_BIND | MS_REC)
        if m.get("readOnly"):
            _mount(libc, None, target, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC)
    _restore_image(libc, image)
    if spec.get("readOnlyRoot"):   # the root only: the volumes above keep their own modes
        _mount(libc, None, "/", MS_BIND | MS_REMOUNT | MS_RDONLY)
    gid, uid = spec.get("gid", 0), spec.get("uid", 0)
    os.setgroups(list(spec.get("groups", [])))
    os.setgid(gid)
    os.setuid(uid)
    os.chdir(spec.get("cwd") or "/")
    argv = spec["argv"]
    os.execvpe(argv[0], argv, spec["env"])


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        doc = json.load(f)
    try:
        enter(doc)
    except OSError as err:
        print(f"container runtime stand-in: {err}", file=sys.stderr, flush=True)
        sys.exit(128)
