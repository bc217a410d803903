"""Source strings and manifests (fleet/sources.py), and the spec accepting the remote forms."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.sources import (
    HttpSource, HubSource, LocalSource, SourceError, parse_manifest, parse_source, write_manifest,
)
from fleet.agent.cache import WeightCache


def test_parse_source_forms(tmp_path):
    assert parse_source("hf://org/name") == HubSource("org/name", "main")
    assert parse_source("hf://org/name@v1.2") == HubSource("org/name", "v1.2")
    assert parse_source("hf://gpt2") == HubSource("gpt2", "main")
    assert parse_source("https://m.example/tiny/") == HttpSource("https://m.example/tiny/fleet-manifest.json")
    assert parse_source("http://m.example/x.json") == HttpSource("http://m.example/x.json")
    assert parse_source("file:///models/tiny") == LocalSource(Path("/models/tiny"))
    assert parse_source("models/tiny", base_dir=tmp_path) == LocalSource(tmp_path / "models" / "tiny")


@pytest.mark.parametrize("source, message", [
    ("hf://", "expected hf://org/name"),
    ("hf://org/name@", "expected hf://org/name"),
    ("hf://a/b/c", "expected hf://org/name"),
    ("https://m.example/model.tar", "names a manifest"),
    ("file://relative/dir", "absolute path"),
    ("s3://bucket/model", "unsupported scheme"),
])
def test_parse_source_errors_name_the_source(source, message):
    with pytest.raises(SourceError, match=message):
        parse_source(source)


@pytest.mark.parametrize("doc, message", [
    ({"files": []}, "fleetManifest"),
    ({"fleetManifest": 1, "files": []}, "no files"),
    ({"fleetManifest": 1, "files": [{"path": "../etc/passwd", "size": 1}]}, r"files\[0\].path.*inside the model"),
    ({"fleetManifest": 1, "files": [{"path": "/abs", "size": 1}]}, r"files\[0\].path"),
    ({"fleetManifest": 1, "files": [{"path": "a", "size": -1}]}, r"files\[0\].size"),
    ({"fleetManifest": 1, "files": [{"path": "a", "sha256": "xyz"}]}, r"files\[0\].sha256"),
    ({"fleetManifest": 1, "files": [{"path": "a"}]}, "give size or sha256"),
    ({"fleetManifest": 1, "files": [{"path": "a", "size": 1}, {"path": "a", "size": 1}]}, r"files\[1\].path.*twice"),
])
def test_manifest_errors_name_the_entry(doc, message):
    with pytest.raises(SourceError, match=message):
        parse_manifest(doc, "http://h/m/fleet-manifest.json")


def test_manifest_urls_are_relative_to_the_manifest(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a b.json").write_text("{}")
    import json
    doc = json.loads(write_manifest(tmp_path).read_text())
    [f] = parse_manifest(doc, "http://h/models/m/fleet-manifest.json")
    assert f.path == "sub/a b.json" and f.url == "http://h/models/m/sub/a%20b.json" and f.size == 2


def test_cache_keys_are_readable_and_distinct():
    k1 = WeightCache.key_for("hf://org/name", "0123456789abcdef")
    k2 = WeightCache.key_for("hf://org/name", "fedcba9876543210")
    assert k1.startswith("hf--org--name--0123456789ab-") and k1 != k2


def test_spec_accepts_remote_sources_and_rejects_malformed_ones():
    from fleet.spec import ModelSpec

    assert ModelSpec(name="m", source="hf://org/name@main").source == "hf://org/name@main"
    assert ModelSpec(name="m", source="https://h/m/").source == "https://h/m/"
    with pytest.raises(Exception, match="expected hf://org/name"):
        ModelSpec(name="m", source="hf://org/name@")
    with pytest.raises(Exception, match="names a manifest"):
        ModelSpec(name="m", source="https://h/m.bin")
