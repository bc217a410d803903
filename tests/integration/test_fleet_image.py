"""Integration: Fleet's image and the pause image, built here with no registry
(fleet/testing/k8s/images.py: charts/fleet/build-image.sh over a Debian bookworm base; pause.c of
Kubernetes 1.20.2's build/pause), checked WITHOUT a container runtime: each OCI archive unpacked
with umoci, its commands run with ``chroot`` as the image's user on a read-only root
(tests/support/image_bundle.py).

Real here: the images' bytes (the very archives a node imports), the runtime config umoci derives
from them (user, args, environment), Python and Fleet inside the image; and where Debian's
containerd 1.6 and runc are installed, a private containerd (tests/support/containerd.py) that
imports each archive and runs both images read-only. Not here: the kubelet, CRI, seccomp and
capabilities as a pod sets them (the real node's tests).

Skips, saying why, when an image cannot be built here (no root, no apt, PyPI or Debian
unreachable) or umoci is missing. `tests/run.sh` builds both before the tiers (``python -m
fleet.testing.k8s.images build``, bounded; cached by their inputs); run alone with a cold cache,
the first test builds them (minutes). ``FLEET_IMAGE=skip`` switches them off.
"""

from __future__ import annotations

import json
import os
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fleet.testing.k8s.buildcache import Unavailable
from fleet.testing.k8s.images import BUILD_TIMEOUT_S, FLEET_TAG, PAUSE_TAG, Image, built, fleet_image, pause_image
from tests.support.containerd import PrivateContainerd
from tests.support.image_bundle import Bundle, image_env, run_in, unpack

pytestmark = pytest.mark.timeout(2 * BUILD_TIMEOUT_S + 120)

FLEET_UID = 10001
UNPACKED_LIMIT_BYTES = 600e6   # the image as measured (docs/kubernetes.md "The image") with room to grow
SITE_PACKAGES = "opt/fleet/lib/python3.11/site-packages"   # the pinned dependencies
APP = "opt/fleet-app"                                       # Fleet itself


def _image(get: Callable[[], Image]) -> Image:
    if os.environ.get("FLEET_IMAGE") == "skip":
        pytest.skip("FLEET_IMAGE=skip: the images are switched off")
    if (said := os.environ.get("FLEET_IMAGE_UNAVAILABLE")) and built() is None:
        pytest.skip(f"no images here (tests/run.sh's build step: {said})")
    try:
        return get()
    except Unavailable as err:
        pytest.skip(f"the image cannot be built here: {err}")


def _bundle(image: Image, dest: Path) -> Bundle:
    try:
        return unpack(image, dest)
    except Unavailable as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Image, Bundle]:
    image = _image(fleet_image)
    return image, _bundle(image, tmp_path_factory.mktemp("fleet-image"))


@pytest.fixture(scope="module")
def pause(tmp_path_factory: pytest.TempPathFactory) -> tuple[Image, Bundle]:
    image = _image(pause_image)
    return image, _bundle(image, tmp_path_factory.mktemp("pause-image"))


@pytest.fixture(scope="module")
def containerd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateContainerd]:
    try:
        with PrivateContainerd(tmp_path_factory.mktemp("containerd"), f"fleet-image-{os.getpid()}") as daemon:
            yield daemon
    except Unavailable as err:
        pytest.skip(str(err))


def _docker_tags(archive: Path) -> list[str]:
    with tarfile.open(archive) as tar:
        return [tag for entry in json.loads(tar.extractfile("manifest.json").read()) for tag in entry["RepoTags"]]


def test_fleet_image_runs_fleet_as_uid_10001(fleet: tuple[Image, Bundle]) -> None:
    """The chart's containers give only args: the image must bring ``fleet`` as its entrypoint and
    the user the chart's securityContext names (runAsUser 10001, runAsNonRoot)."""
    image, bundle = fleet
    assert (bundle.config["Entrypoint"], bundle.config["Cmd"]) == (["fleet"], ["--help"])
    assert bundle.config["User"] == f"{FLEET_UID}:{FLEET_UID}"
    assert (bundle.runtime["process"]["user"]["uid"], bundle.runtime["process"]["user"]["gid"]) == (FLEET_UID,) * 2
    assert image_env(bundle)["PATH"].startswith("/opt/fleet-app/bin:/opt/fleet/bin:")
    assert _docker_tags(image.docker_archive) == [FLEET_TAG]


def test_fleet_help_runs_on_a_read_only_root(fleet: tuple[Image, Bundle]) -> None:
    """The entrypoint and command as a runtime starts them (uid 10001, read-only root, only the
    image's environment) list the chart's commands."""
    proc = run_in(fleet[1])
    assert proc.returncode == 0, proc.stderr
    for command in ("operator", "router-pod", "agent"):
        assert command in proc.stdout


def test_the_engine_simulator_runs_from_the_image(fleet: tuple[Image, Bundle]) -> None:
    proc = run_in(fleet[1], ["python", "-m", "fleet.enginesim", "--help"])
    assert proc.returncode == 0, proc.stderr
    assert "--port" in proc.stdout


def test_the_root_is_read_only_even_to_root(fleet: tuple[Image, Bundle]) -> None:
    """The harness's read-only root is real: root itself cannot write to it, so the commands above
    ran without writing a byte to the image (no .pyc, no cache)."""
    proc = run_in(fleet[1], ["python", "-c", "open('/opt/fleet/probe', 'w')"], uid=0, gid=0)
    assert proc.returncode != 0
    assert "Read-only file system" in proc.stderr


def test_the_image_holds_fleet_compiled_and_no_build_tools(fleet: tuple[Image, Bundle]) -> None:
    """Fleet's packages in /opt/fleet-app without the tests' stand-ins (fleet/testing is not in the
    wheel), found through a .pth file of the dependencies' environment, which holds no pip or
    setuptools; .pyc files Python does not check against their sources (PEP 552 flags 0b01), so
    a read-only root costs no recompilation at start."""
    app, site = fleet[1].rootfs / APP, fleet[1].rootfs / SITE_PACKAGES
    for package in ("fleet", "router", "warmup", "autoscaler"):
        assert (app / package / "__init__.py").is_file(), package
    assert not (app / "fleet" / "testing").exists()
    assert (site / "fleet-app.pth").read_text().split() == ["/" + APP]
    assert not [p.name for p in site.iterdir() if p.name.startswith(("pip", "setuptools"))]
    assert not (site / "fleet").exists() and not (site / "router").exists()   # Fleet is in its own layer
    for pyc in (app / "fleet" / "__pycache__" / "__init__.cpython-311.pyc",
                next((site / "yaml" / "__pycache__").glob("__init__.cpython-311*.pyc"))):  # fmt: skip
        assert int.from_bytes(pyc.read_bytes()[4:8], "little") == 0b01, pyc


def test_the_fleet_image_size(fleet: tuple[Image, Bundle]) -> None:
    """The measured size, printed (pytest -s), and bounded so that growth is noticed."""
    info = fleet[0].info
    print(f"\n{FLEET_TAG}: {info['compressed_bytes'] / 1e6:.1f} MB compressed, "
          f"{info['unpacked_bytes'] / 1e6:.1f} MB unpacked, {info['layers']} layers (built in {info['build_s']} s)")
    assert 0 < info["compressed_bytes"] < info["unpacked_bytes"] < UNPACKED_LIMIT_BYTES


def test_the_pause_image_is_a_static_pause_alone(pause: tuple[Image, Bundle]) -> None:
    """``/pause`` alone (no libc beside it: it must be static), as build/pause/Dockerfile makes it:
    user 65535, entrypoint /pause; ``-v`` prints the version it was compiled with."""
    image, bundle = pause
    assert (bundle.config["Entrypoint"], bundle.config["User"]) == (["/pause"], "65535:65535")
    assert [p.name for p in bundle.rootfs.iterdir()] == ["pause"]
    proc = run_in(bundle, ["/pause", "-v"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"pause.c v{image.info['pause_tag']}")
    assert _docker_tags(image.docker_archive) == [PAUSE_TAG]


@pytest.mark.parametrize("archive", ["oci_archive", "docker_archive"])
def test_containerd_imports_each_archive_by_name_and_runc_runs_it(
        fleet: tuple[Image, Bundle], pause: tuple[Image, Bundle], containerd: PrivateContainerd, archive: str) -> None:
    """containerd 1.6's ``ctr images import`` names both images from either archive (no
    ``--base-name``), and runc runs them read-only: ``fleet --help`` as uid 10001, ``/pause -v``."""
    for image in (fleet[0], pause[0]):
        containerd.ctr("images", "rm", image.name)   # from the other archive's run; absent the first time
        proc = containerd.ctr("images", "import", str(getattr(image, archive)), timeout_s=300)
        assert proc.returncode == 0, proc.stderr
        assert image.name in containerd.ctr("images", "ls", "-q").stdout.split()
    help_ = containerd.ctr("run", "--rm", "--read-only", FLEET_TAG, f"fleet-help-{archive}")
    assert help_.returncode == 0, help_.stderr
    assert "router-pod" in help_.stdout
    user = containerd.ctr("run", "--rm", "--read-only", FLEET_TAG, f"fleet-id-{archive}", "id", "-u")
    assert user.stdout.strip() == str(FLEET_UID), user.stderr
    version = containerd.ctr("run", "--rm", "--read-only", PAUSE_TAG, f"pause-{archive}", "/pause", "-v")
    assert version.stdout.startswith("pause.c v"), version.stderr
