"""A TEST STAND-IN for the NVIDIA container runtime (NVIDIA/nvidia-container-toolkit's
``nvidia-container-runtime``): a wrapper around ``runc`` that containerd runs as its runtime
binary (``BinaryName``) on a real node (fleet/testing/k8s/realnode.py), so a container asking for
GPUs by environment gets the node's fake NVML "driver" as the toolkit gives it the real one.

What it does, as the toolkit does: on ``create`` it reads the bundle's OCI ``config.json`` and,
when the process's environment sets ``NVIDIA_VISIBLE_DEVICES`` to anything but ``void``,
``none`` or empty (the toolkit's rule: the node agent's ``all`` of
charts/fleet/templates/agent-daemonset.yaml, or the device ids a device plugin answered), adds the
driver: the state file's directory read-only at `STATE_MOUNT` with ``FLEET_FAKE_NVML`` naming the
file, and fleet/testing/nvml_driver read-only at `DRIVER_MOUNT`, first on ``PYTHONPATH`` (the
mounts and variables fleet/testing/k8s/deviceplugin_grpc.py's ``Allocate`` answers; a container
that has them already is left as it is). Every other command and container goes to runc
unchanged (``exec``).

Standard library only: containerd's shim runs it as ``python -I -S nvidia_runtime.py RUNC STATE
DRIVER -- RUNC_ARGS...`` through the script `write_wrapper` writes. Owns `inject` (pure over one
OCI spec), `write_wrapper` and the ``__main__`` entry. Called by `RealNode` (``nvml_state``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

STATE_MOUNT = "/run/fleet-fake-nvml"
"""Where a container sees the directory of its node's fake NVML state file (as
fleet/testing/k8s/deviceplugin_grpc.py `STATE_MOUNT`)."""
DRIVER_MOUNT = "/usr/local/nvidia/fleet-nvml"
"""Where a container sees fleet/testing/nvml_driver, on its PYTHONPATH (as deviceplugin_grpc.py
`DRIVER_MOUNT`)."""
FAKE_NVML_ENV = "FLEET_FAKE_NVML"
NO_DEVICES = ("", "void", "none")
"""``NVIDIA_VISIBLE_DEVICES`` values that ask for no GPU (nvidia-container-toolkit
internal/config/image ``VisibleDevices``)."""
DRIVER_DIR = Path(__file__).resolve().parent.parent / "nvml_driver"


def _env(spec: dict) -> dict[str, str]:
    pairs = (e.split("=", 1) for e in (spec.get("process") or {}).get("env") or [] if "=" in e)
    return dict(pairs)


def inject(spec: dict, state_path: Path, driver_dir: Path = DRIVER_DIR) -> bool:
    """Add the fake NVML driver to the OCI runtime ``spec`` (a ``config.json`` document, changed in
    place) when its process asks for GPUs (``NVIDIA_VISIBLE_DEVICES`` not in `NO_DEVICES`) and has
    no ``FLEET_FAKE_NVML`` yet. Returns whether it changed the spec. Pure."""
    env = _env(spec)
    if env.get("NVIDIA_VISIBLE_DEVICES", "").strip() in NO_DEVICES or FAKE_NVML_ENV in env:
        return False
    state_path = Path(state_path)
    path = [DRIVER_MOUNT, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    env.update({FAKE_NVML_ENV: f"{STATE_MOUNT}/{state_path.name}", "PYTHONPATH": os.pathsep.join(path)})
    spec["process"]["env"] = [f"{k}={v}" for k, v in env.items()]
    options = ["rbind", "ro", "nosuid", "nodev"]
    spec.setdefault("mounts", []).extend([
        {"destination": STATE_MOUNT, "type": "bind", "source": str(state_path.parent), "options": options},
        {"destination": DRIVER_MOUNT, "type": "bind", "source": str(driver_dir), "options": options},
    ])  # fmt: skip
    return True


def _bundle(args: list[str]) -> Path | None:
    """The bundle directory of a ``runc ... create [--bundle DIR] ID`` command line; None for any
    other command. runc's default bundle is the working directory."""
    if "create" not in args:
        return None
    rest = args[args.index("create") + 1:]
    for i, arg in enumerate(rest):
        if arg in ("--bundle", "-b") and i + 1 < len(rest):
            return Path(rest[i + 1])
        if arg.startswith(("--bundle=", "-b=")):
            return Path(arg.split("=", 1)[1])
    return Path.cwd()


def write_wrapper(path: Path, runc: str, state_path: Path, python: str = sys.executable) -> Path:
    """Write the executable ``path`` containerd runs in place of ``runc``: it calls this module
    with ``runc`` and ``state_path``, then runc. Returns ``path``."""
    script = Path(__file__).resolve()
    path.write_text(f'#!/bin/sh\nexec "{python}" -I -S "{script}" "{runc}" "{Path(state_path).resolve()}" '
                    f'"{DRIVER_DIR}" -- "$@"\n')  # fmt: skip
    path.chmod(0o755)
    return path


def main(argv: list[str]) -> None:
    """``RUNC STATE DRIVER -- RUNC_ARGS...``: inject into the bundle's spec on ``create``, then
    exec runc with its arguments."""
    runc, state, driver, sep, *args = argv
    if sep != "--":
        raise SystemExit(f"nvidia_runtime: usage: RUNC STATE DRIVER -- RUNC_ARGS (got {argv[:4]})")
    bundle = _bundle(args)
    if bundle is not None:
        config = bundle / "config.json"
        spec = json.loads(config.read_text())
        if inject(spec, Path(state), Path(driver)):
            tmp = config.with_name(".config.json.nvidia")
            tmp.write_text(json.dumps(spec))
            os.replace(tmp, config)
    os.execv(runc, [runc, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
