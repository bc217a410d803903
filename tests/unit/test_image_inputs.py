"""Unit: what keys the cache of Fleet's image (fleet/testing/k8s/images.py `inputs_key`: a change of
any input rebuilds it, a change elsewhere does not) and how its size is measured (`image_sizes`
over an OCI archive made here)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from fleet.testing.k8s.buildcache import Unavailable
from fleet.testing.k8s.images import INPUT_FILES, image_sizes, inputs_key


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    for name in (*INPUT_FILES, "fleet/__init__.py", "router/app.py", "warmup/plan.py", "autoscaler/pid.py",
                 "fleet/testing/kube.py", "tests/test_x.py", "docs/kubernetes.md"):  # fmt: skip
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"# {name}\n")
    return tmp_path


@pytest.mark.parametrize("changed", ["charts/fleet/Dockerfile", "charts/fleet/constraints.txt", "pyproject.toml",
                                     "fleet/__init__.py", "router/app.py", "autoscaler/pid.py"])  # fmt: skip
def test_a_change_of_an_input_changes_the_key(repo: Path, changed: str) -> None:
    before = inputs_key(repo)
    (repo / changed).write_text("changed\n")
    assert inputs_key(repo) != before


def test_a_new_input_file_changes_the_key(repo: Path) -> None:
    before = inputs_key(repo)
    (repo / "warmup" / "gate.py").write_text("")
    assert inputs_key(repo) != before


@pytest.mark.parametrize("changed", ["fleet/testing/kube.py", "tests/test_x.py", "docs/kubernetes.md",
                                     "fleet/__pycache__/__init__.cpython-311.pyc"])  # fmt: skip
def test_what_the_image_does_not_hold_leaves_the_key(repo: Path, changed: str) -> None:
    before = inputs_key(repo)
    (repo / changed).parent.mkdir(parents=True, exist_ok=True)
    (repo / changed).write_text("changed\n")
    assert inputs_key(repo) == before


def test_a_missing_input_is_named(repo: Path) -> None:
    (repo / "charts/fleet/constraints.txt").unlink()
    with pytest.raises(Unavailable, match="charts/fleet/constraints.txt"):
        inputs_key(repo)


def _oci_archive(path: Path, layers: list[bytes], manifests: int = 1) -> list[bytes]:
    """An OCI archive of one image whose layers hold ``layers`` (gzip): the compressed blobs."""
    blobs: dict[str, bytes] = {}

    def add(data: bytes) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"digest": digest, "size": len(data)}

    compressed = [gzip.compress(layer, mtime=0) for layer in layers]
    manifest = add(json.dumps({"schemaVersion": 2, "config": add(b"{}"), "layers": [
        {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **add(c)} for c in compressed]}).encode())
    index = {"schemaVersion": 2, "manifests": [manifest] * manifests}
    with tarfile.open(path, "w") as tar:
        for name, data in [("index.json", json.dumps(index).encode()),
                           *((f"blobs/{d.replace(':', '/')}", b) for d, b in blobs.items())]:  # fmt: skip
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return compressed


def test_the_sizes_are_the_layers_compressed_and_unpacked(tmp_path: Path) -> None:
    layers = [b"a" * 300_000, bytes(range(256)) * 1000]
    compressed = _oci_archive(tmp_path / "image.oci.tar", layers)
    assert image_sizes(tmp_path / "image.oci.tar") == {
        "compressed_bytes": sum(map(len, compressed)), "unpacked_bytes": sum(map(len, layers)), "layers": 2}


def test_an_archive_of_two_images_is_refused(tmp_path: Path) -> None:
    _oci_archive(tmp_path / "two.oci.tar", [b"x"], manifests=2)
    with pytest.raises(ValueError, match="2 manifests"):
        image_sizes(tmp_path / "two.oci.tar")
