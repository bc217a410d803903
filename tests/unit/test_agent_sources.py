"""Source strings and manifests (fleet/sources.py), and the spec accepting the remote forms."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.sources import (
    HttpSource, HubSource, LocalSource, ModelSource, Scheme, SourceError, parse_manifest, parse_source,
    write_manifest,
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


@pytest.mark.parametrize("text, scheme, location, revision, remote, cached", [
    ("models/tiny", Scheme.FILE, "models/tiny", None, False, False),
    ("/models/tiny", Scheme.FILE, "/models/tiny", None, False, False),
    (" file:///models/tiny ", Scheme.FILE, "/models/tiny", None, False, False),
    ("hf://org/name", Scheme.HF, "org/name", None, True, True),
    ("hf://gpt2@v1.2", Scheme.HF, "gpt2", "v1.2", True, True),
    ("s3://bucket/path/to/model", Scheme.S3, "bucket/path/to/model", None, True, False),
    ("http://m.example/x.json", Scheme.HTTP, "http://m.example/x.json", None, True, True),
    ("https://m.example/tiny/", Scheme.HTTPS, "https://m.example/tiny/fleet-manifest.json", None, True, True),
    ("sim://tiny-gpu", Scheme.SIM, "tiny-gpu", None, False, False),
])
def test_model_source_parse_each_scheme(text, scheme, location, revision, remote, cached):
    src = ModelSource.parse(text)
    assert (src.scheme, src.location, src.revision, src.text) == (scheme, location, revision, text)
    assert (src.remote, src.cached) == (remote, cached)


def test_model_source_local_path_only_for_files(tmp_path):
    assert ModelSource.parse("models/tiny").local_path(tmp_path) == tmp_path / "models" / "tiny"
    assert ModelSource.parse("file:///models/tiny").local_path(tmp_path) == Path("/models/tiny")
    assert ModelSource.parse("~/tiny").local_path(tmp_path) == Path.home() / "tiny"
    for text in ("hf://org/name", "s3://b/m", "https://h/m.json", "sim://tiny-gpu"):
        assert ModelSource.parse(text).local_path(tmp_path) is None, text


@pytest.mark.parametrize("text, message", [
    ("", "empty"),
    ("ftp://x/y", r"unsupported scheme 'ftp://' in 'ftp://x/y'; use a path or one of file://, hf://, s3://"),
    ("HF://org/name", "unsupported scheme"),
    ("file://relative/dir", "absolute path"),
    ("hf://", "expected hf://org/name"),
    ("hf://org/name@", "expected hf://org/name"),
    ("hf://a/b/c", "expected hf://org/name"),
    ("s3://bucket", "expected s3://bucket/key"),
    ("s3://bucket/", "expected s3://bucket/key"),
    ("s3:///key", "expected s3://bucket/key"),
    ("https://m.example/model.tar", "names a manifest"),
    ("sim://", "expected sim://PROFILE"),
])
def test_model_source_refusals_name_the_source_and_reason(text, message):
    with pytest.raises(SourceError, match=message):
        ModelSource.parse(text)


@pytest.mark.parametrize("text", ["s3://bucket/model", "sim://tiny-gpu"])
def test_the_weight_cache_refuses_schemes_it_cannot_fetch(text):
    assert not ModelSource.parse(text).cached
    with pytest.raises(SourceError, match=r"unsupported scheme for the weight cache"):
        parse_source(text)


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


def test_spec_names_the_field_and_reason_for_each_refusal():
    from fleet.spec import SpecError, parse_document

    def doc(source: str) -> dict:
        return {"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
                "metadata": {"name": "m"}, "spec": {"model": {"name": "m", "source": source}}}

    for source, reason in [("s3://bucket", "expected s3://bucket/key"),
                           ("file://rel", "a file:// source needs an absolute path"),
                           ("gs://b/m", "unsupported scheme 'gs://'")]:
        with pytest.raises(SpecError) as err:
            parse_document(doc(source))
        assert [p for p in err.value.problems
                if p.startswith("spec.model.source: ") and reason in p and repr(source) in p], err.value.problems
    spec = parse_document(doc("s3://bucket/m")).spec.model
    assert spec.parsed_source.scheme is Scheme.S3 and spec.local_path(Path("/base")) is None
