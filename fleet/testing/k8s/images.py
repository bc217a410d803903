"""The container images the tests' real node runs, built here with no registry: Fleet's image
(charts/fleet/Dockerfile, built by charts/fleet/build-image.sh over a Debian bookworm base) and
the pause image ``k8s.gcr.io/pause:3.2`` (the Kubernetes 1.20 kubelet's default
``--pod-infra-container-image``: cmd/kubelet/app/options/container_runtime.go), each written as an
OCI archive and a docker-archive that ``ctr -n k8s.io images import`` takes.

Owns `build` (both images, found in or built into a cache keyed by their inputs), `inputs_key`,
`image_sizes`, `fleet_image`, `pause_image` and ``python -m fleet.testing.k8s.images build``
(tests/run.sh's step). Used by tests/integration/test_fleet_image.py and the real node's tests;
the build tools and the cache discipline are fleet/testing/k8s/buildcache.py's (a lock per cache
entry, a time budget, a failure remembered for six hours; ``FLEET_IMAGE_RETRY=1`` retries at once).

Where each image comes from:
- Fleet's image: ``bash charts/fleet/build-image.sh --base debian --timestamp 0`` (the command a
  user runs, with their own ``--push``; time 0, so that the same inputs give the same bytes
  whatever the commit): mmdebstrap makes the base from this machine's Debian mirror, buildah
  builds the Dockerfile on it with chroot isolation (PyPI for the pinned wheels of
  charts/fleet/constraints.txt; ``PIP_CERT`` names the CA bundle pip trusts there, behind a proxy
  that intercepts TLS). Its cache key (`inputs_key`) hashes the Dockerfile, the script, the
  constraints, .dockerignore, pyproject.toml, README.md and every file the image's packages are
  built from (fleet/, router/, warmup/, autoscaler/; not fleet/testing/, which the wheel leaves
  out). The base is made once per buildah storage and package list
  (``localhost/fleet-base:bookworm-HASH``, HASH of build-image.sh's ``base_packages``);
- the pause image: ``build/pause/linux/pause.c`` and its Makefile's TAG from Kubernetes 1.20.2's
  source, Debian bookworm's ``kubernetes`` source package (``apt-get source --download-only``,
  the deb-src entry fleet/testing/k8s/kube.py adds), compiled as that Makefile does (``gcc -Os
  -Wall -Werror -static``), then ``/pause`` alone in an image with ``USER 65535:65535`` and
  ``ENTRYPOINT ["/pause"]`` as build/pause/Dockerfile has it. Its key: that source version.

The cache: ``$FLEET_IMAGE_CACHE``, else ``$XDG_CACHE_HOME/fleet/images``, else
``~/.cache/fleet/images``: ``fleet-<key>/`` and ``pause-<version>/`` (each ``image.oci.tar``,
``image.docker.tar`` and ``build.json``: name, key, sizes, build seconds), and ``buildah/``,
buildah's storage (the Debian base and the layers a rebuild reuses). The newest `KEEP_BUILDS`
``fleet-*`` entries stay; older ones are removed after a build.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from fleet.testing.k8s.buildcache import OutOfTime, Unavailable, build_command, build_once, run_step

REPO = Path(__file__).resolve().parents[3]
FLEET_TAG = "ghcr.io/inference-fleet/fleet:0.1.0"
PAUSE_TAG = "k8s.gcr.io/pause:3.2"
PAUSE_USER = "65535:65535"
TOOLS = ("buildah", "mmdebstrap", "umoci")
"""Debian packages the builds and the tests' unpacking need, installed with apt when missing (root)."""
BUILD_TIMEOUT_S = 900.0
KEEP_BUILDS = 3
RETRY_ENV = "FLEET_IMAGE_RETRY"
INPUT_FILES = ("charts/fleet/Dockerfile", "charts/fleet/build-image.sh", "charts/fleet/constraints.txt",
               ".dockerignore", "pyproject.toml", "README.md")  # fmt: skip
INPUT_TREES = ("fleet", "router", "warmup", "autoscaler")
SKIPPED_TREES = ("fleet/testing",)


@dataclass(frozen=True)
class Image:
    """One built image: ``name`` (``ghcr.io/inference-fleet/fleet:0.1.0``), its ``oci_archive``
    and ``docker_archive`` (paths of tar files) and ``info`` (its build.json: ``key``,
    ``compressed_bytes``, ``unpacked_bytes``, ``build_s``, ...)."""

    name: str
    oci_archive: Path
    docker_archive: Path
    info: dict


@dataclass(frozen=True)
class Images:
    """Fleet's image and the pause image."""

    fleet: Image
    pause: Image


def cache_dir() -> Path:
    """Where the images live (see the module docstring)."""
    if os.environ.get("FLEET_IMAGE_CACHE"):
        return Path(os.environ["FLEET_IMAGE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fleet" / "images"


def inputs_key(repo: Path = REPO) -> str:
    """16 hex digits of SHA-256 over the relative path and bytes of each input of Fleet's image
    (`INPUT_FILES`, and the files under `INPUT_TREES` but `SKIPPED_TREES`, ``__pycache__`` and
    ``*.pyc``), in sorted order. Raises `Unavailable` naming a missing input file."""
    paths = []
    for name in INPUT_FILES:
        if not (repo / name).is_file():
            raise Unavailable(f"the image's input {name} is missing from {repo}")
        paths.append(repo / name)
    for tree in INPUT_TREES:
        for path in (repo / tree).rglob("*"):
            rel = path.relative_to(repo).as_posix()
            if (path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
                    and not any(rel == s or rel.startswith(s + "/") for s in SKIPPED_TREES)):  # fmt: skip
                paths.append(path)
    digest = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.relative_to(repo).as_posix()):
        digest.update(path.relative_to(repo).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def image_sizes(oci_archive: Path) -> dict[str, int]:
    """``{"compressed_bytes", "unpacked_bytes", "layers"}`` of the one image in an OCI archive:
    the sum of its layers' blob sizes (what a registry stores and a node pulls) and of their
    uncompressed tar streams (about what the node's snapshotter unpacks). Raises ValueError when
    the archive holds no single image manifest."""
    with tarfile.open(oci_archive) as tar:
        def blob(digest: str) -> bytes:
            return tar.extractfile(f"blobs/{digest.replace(':', '/')}").read()

        manifests = json.loads(tar.extractfile("index.json").read()).get("manifests", [])
        if len(manifests) != 1:
            raise ValueError(f"{oci_archive}: index.json lists {len(manifests)} manifests, not 1")
        layers = json.loads(blob(manifests[0]["digest"]))["layers"]
        unpacked = 0
        for layer in layers:
            with tar.extractfile(f"blobs/{layer['digest'].replace(':', '/')}") as raw:
                stream = gzip.GzipFile(fileobj=raw) if layer["mediaType"].endswith("gzip") else raw
                while chunk := stream.read(1 << 20):
                    unpacked += len(chunk)
    return {"compressed_bytes": sum(layer["size"] for layer in layers), "unpacked_bytes": unpacked,
            "layers": len(layers)}  # fmt: skip


def built(cache: Path | None = None) -> Images | None:
    """Both images for the current inputs when the cache holds them, else None."""
    cache = cache or cache_dir()
    fleet, pause = _found(cache / f"fleet-{inputs_key()}"), _newest_pause(cache)
    return Images(fleet, pause) if fleet and pause else None


def build(cache: Path | None = None, timeout_s: float = BUILD_TIMEOUT_S) -> Images:
    """Both images, built into ``cache`` (default `cache_dir`) unless a build for the same inputs
    left them there; every step under what is left of ``timeout_s``. Raises `Unavailable` saying
    which step failed and why (`OutOfTime` when the budget ran out)."""
    deadline = time.monotonic() + timeout_s
    return Images(fleet_image(cache, timeout_s), pause_image(cache, max(deadline - time.monotonic(), 1.0)))


def fleet_image(cache: Path | None = None, timeout_s: float = BUILD_TIMEOUT_S) -> Image:
    """Fleet's image for the current inputs (`inputs_key`), built with charts/fleet/build-image.sh
    when the cache lacks it. Raises `Unavailable`."""
    cache = cache or cache_dir()
    entry = cache / f"fleet-{inputs_key()}"
    image = build_once(entry, timeout_s, found=_found, make=lambda c, d: _build_fleet(cache, c, d),
                       retry_env=RETRY_ENV, scratch=lambda c: [c / "partial"])  # fmt: skip
    _prune(cache, keep=entry)
    return image


def pause_image(cache: Path | None = None, timeout_s: float = BUILD_TIMEOUT_S) -> Image:
    """The pause image from Kubernetes 1.20.2's build/pause (see the module docstring), built
    when the cache lacks it. Raises `Unavailable`."""
    cache = cache or cache_dir()
    return build_once(cache / "pause-build", timeout_s, found=lambda c: _newest_pause(cache),
                      make=lambda c, d: _build_pause(cache, c, d), retry_env=RETRY_ENV,
                      scratch=lambda c: [c / "work", c / "partial"])  # fmt: skip


# ----- building ------------------------------------------------------------------------------------


def _found(entry: Path) -> Image | None:
    info_path = entry / "build.json"
    if not info_path.exists():
        return None
    info = json.loads(info_path.read_text())
    oci, docker = entry / "image.oci.tar", entry / "image.docker.tar"
    return Image(info["name"], oci, docker, info) if oci.exists() and docker.exists() else None


def _newest_pause(cache: Path) -> Image | None:
    """The pause image of the newest Debian source version built into ``cache``, or None."""
    entries = sorted((p for p in cache.glob("pause-*") if p.name != "pause-build"), reverse=True)
    return next((image for image in map(_found, entries) if image is not None), None)


def _install_tools(deadline: float) -> None:
    """``apt-get install`` the `TOOLS` whose command is missing (root; waits for another apt's lock)."""
    if not (missing := [t for t in TOOLS if shutil.which(t) is None]):
        return
    if os.geteuid() != 0:
        raise Unavailable(f"{', '.join(missing)} not installed and installing them needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=300", *missing]
    try:
        run_step("apt-get install", cmd, deadline, env=env)
    except OutOfTime:
        raise
    except Unavailable:
        run_step("apt-get update", ["apt-get", "update", "-qq", "-o", "DPkg::Lock::Timeout=300"], deadline)
        run_step("apt-get install", cmd, deadline, env=env)


def _finish(entry: Path, name: str, partial: Path, facts: dict) -> Image:
    """Measure ``partial``'s archives, write build.json beside them and move them into ``entry``."""
    info = {"name": name, **facts, **image_sizes(partial / "image.oci.tar"),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    for archive in ("image.oci.tar", "image.docker.tar"):
        os.replace(partial / archive, entry / archive)
    shutil.rmtree(partial, ignore_errors=True)
    (entry / "unavailable.json").unlink(missing_ok=True)
    (entry / "build.json").write_text(json.dumps(info, indent=1) + "\n")
    return Image(name, entry / "image.oci.tar", entry / "image.docker.tar", info)


def _build_fleet(cache: Path, entry: Path, deadline: float) -> Image:
    started = time.monotonic()
    _install_tools(deadline)
    partial = entry / "partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    run_step("charts/fleet/build-image.sh", [
        "bash", str(REPO / "charts/fleet/build-image.sh"), "--base", "debian", "--tag", FLEET_TAG,
        "--root", str(cache / "buildah"), "--timestamp", "0", "--oci-archive", str(partial / "image.oci.tar"),
        "--docker-archive", str(partial / "image.docker.tar")], deadline)  # fmt: skip
    return _finish(entry, FLEET_TAG, partial, {"key": entry.name.removeprefix("fleet-"),
                                               "build_s": round(time.monotonic() - started, 1)})


def _pause_source(work: Path, deadline: float) -> tuple[str, Path, str]:
    """(Debian source version, pause.c, the Makefile's TAG) of Kubernetes' build/pause, from the
    ``kubernetes`` source package's upstream tarball."""
    from fleet.testing.k8s.kube import SOURCE_PACKAGE, SUITE, _source_version

    version = _source_version(deadline)
    run_step("apt-get source --download-only", ["apt-get", "source", "--download-only", "-qq",
                                                f"{SOURCE_PACKAGE}/{SUITE}"], deadline, cwd=work)  # fmt: skip
    for tarball in sorted(work.glob(f"{SOURCE_PACKAGE}_*.orig.tar.*")):
        members = ["--wildcards", "--no-anchored", "build/pause/linux/pause.c", "build/pause/Makefile"]
        run_step("tar -x build/pause", ["tar", "-xf", str(tarball), *members], deadline, cwd=work)
        found = sorted(work.glob("*/build/pause/linux/pause.c"))
        if found:
            makefile = (found[0].parents[1] / "Makefile").read_text()
            tag = re.search(r"^TAG\s*\??=\s*(\S+)", makefile, re.M)
            return version, found[0], tag.group(1) if tag else "unknown"
    raise Unavailable(f"no build/pause/linux/pause.c in the {SOURCE_PACKAGE} {version} source's tarballs")


def _build_pause(cache: Path, entry: Path, deadline: float) -> Image:
    started = time.monotonic()
    _install_tools(deadline)
    work = entry / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    version, source, tag = _pause_source(work, deadline)
    binary = work / "pause"
    run_step("gcc pause.c", ["gcc", "-Os", "-Wall", "-Werror", "-static", f"-DVERSION=v{tag}-debian-{version}",
                             "-o", str(binary), str(source)], deadline)  # fmt: skip
    run_step("strip pause", ["strip", str(binary)], deadline)
    partial = entry / "partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    buildah = ["buildah", "--storage-driver", "overlay", "--root", str(cache / "buildah" / "storage"),
               "--runroot", str(cache / "buildah" / "run")]  # fmt: skip
    policy = work / "policy.json"
    policy.write_text('{"default": [{"type": "insecureAcceptAnything"}]}')
    sign = ["--signature-policy", str(policy)]
    ctr = run_step("buildah from scratch", [*buildah, "from", *sign, "scratch"], deadline).strip()
    run_step("buildah copy /pause", [*buildah, "copy", ctr, str(binary), "/pause"], deadline)
    run_step("buildah config", [*buildah, "config", "--user", PAUSE_USER, "--entrypoint", '["/pause"]', ctr], deadline)
    run_step("buildah commit", [*buildah, "commit", "--quiet", *sign, "--timestamp", "0", "--rm", ctr, PAUSE_TAG],
             deadline)  # fmt: skip
    for transport, archive in (("oci-archive", "image.oci.tar"), ("docker-archive", "image.docker.tar")):
        run_step(f"buildah push {transport}", [*buildah, "push", "--quiet", *sign, PAUSE_TAG,
                                               f"{transport}:{partial / archive}:{PAUSE_TAG}"], deadline)  # fmt: skip
    home = cache / f"pause-{version}"
    home.mkdir(parents=True, exist_ok=True)
    facts = {"pause_tag": tag, "debian_source": version, "build_s": round(time.monotonic() - started, 1)}
    return _finish(home, PAUSE_TAG, partial, facts)


def _prune(cache: Path, keep: Path) -> None:
    """Remove ``fleet-*`` entries beyond the newest `KEEP_BUILDS` (by build.json's time), never ``keep``."""
    entries = sorted((p for p in cache.glob("fleet-*") if (p / "build.json").exists() and p != keep),
                     key=lambda p: (p / "build.json").stat().st_mtime, reverse=True)  # fmt: skip
    for old in entries[KEEP_BUILDS - 1:]:
        shutil.rmtree(old, ignore_errors=True)


def _describe(images: Images) -> str:
    fleet, pause = images.fleet.info, images.pause.info
    return (f"fleet image {images.fleet.name} ({fleet['compressed_bytes'] / 1e6:.0f} MB compressed, "
            f"{fleet['unpacked_bytes'] / 1e6:.0f} MB unpacked) and {images.pause.name} "
            f"(pause {pause.get('pause_tag')}) in {images.fleet.oci_archive.parent.parent}")


def main(argv: list[str] | None = None) -> int:
    """``python -m fleet.testing.k8s.images build [--timeout-s S] [--strict]``
    (`fleet.testing.k8s.buildcache.build_command`)."""
    return build_command(
        argv, prog="python -m fleet.testing.k8s.images", layer="images", timeout_s=BUILD_TIMEOUT_S,
        build=lambda timeout_s: build(timeout_s=timeout_s), describe=_describe,
        info=lambda images: {"build_s": images.fleet.info.get("build_s"),
                             "steps_s": {"pause": images.pause.info.get("build_s")}})  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
