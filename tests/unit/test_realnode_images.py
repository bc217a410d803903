"""The image archives of the real node (fleet/testing/k8s/realnode_images.py), the part that needs
no compiler or containerd: the OCI image layout `oci_archive` writes. tests/integration/
test_real_node.py imports them into a real containerd and runs them."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

from fleet.testing.k8s.realnode_images import oci_archive

FILES = [("bin/", None, 0o755), ("bin/tool", b"#!static\n", 0o755), ("bin/sh", "tool", 0o777), ("tmp/", None, 0o1777)]


def _blob(archive: tarfile.TarFile, digest: str) -> bytes:
    algorithm, hexdigest = digest.split(":")
    data = archive.extractfile(f"blobs/{algorithm}/{hexdigest}").read()
    assert hashlib.sha256(data).hexdigest() == hexdigest   # content-addressed, as the spec requires
    return data


def test_the_archive_is_an_oci_layout_named_for_ctr_import(tmp_path: Path):
    """index.json -> manifest -> config and layer, each blob named by its digest; the name
    ``ctr images import`` gives the image comes from ``io.containerd.image.name``."""
    path = oci_archive(tmp_path / "img.tar", "fleet.test/tool:1.0", FILES, {"Entrypoint": ["/bin/tool"]})
    with tarfile.open(path) as archive:
        assert json.loads(archive.extractfile("oci-layout").read()) == {"imageLayoutVersion": "1.0.0"}
        [entry] = json.loads(archive.extractfile("index.json").read())["manifests"]
        assert entry["annotations"]["io.containerd.image.name"] == "fleet.test/tool:1.0"
        manifest = json.loads(_blob(archive, entry["digest"]))
        config = json.loads(_blob(archive, manifest["config"]["digest"]))
        layer = _blob(archive, manifest["layers"][0]["digest"])
    assert config["config"] == {"Entrypoint": ["/bin/tool"]} and config["os"] == "linux"
    assert config["rootfs"]["diff_ids"] == [manifest["layers"][0]["digest"]]   # uncompressed: same digest
    with tarfile.open(fileobj=io.BytesIO(layer)) as files:
        members = {m.name: m for m in files.getmembers()}
        assert files.extractfile("bin/tool").read() == b"#!static\n"
    assert members["bin/sh"].issym() and members["bin/sh"].linkname == "tool"
    assert members["tmp"].isdir() and members["tmp"].mode == 0o1777
    assert {(m.mtime, m.uid, m.gid) for m in members.values()} == {(0, 0, 0)}


def test_the_archive_is_reproducible(tmp_path: Path):
    """The same files make the same bytes (no timestamps, no owner): an image's digest is keyed by
    its inputs only."""
    first = oci_archive(tmp_path / "a.tar", "fleet.test/tool:1.0", FILES, {}).read_bytes()
    assert oci_archive(tmp_path / "b.tar", "fleet.test/tool:1.0", FILES, {}).read_bytes() == first
    assert oci_archive(tmp_path / "c.tar", "fleet.test/tool:1.1", FILES, {}).read_bytes() != first
