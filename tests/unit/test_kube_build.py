"""The build of the real Kubernetes control plane (fleet/testing/k8s/kube.py), the parts that
need no apt, network or compiler: the version read from Debian's source version, the ldflags that
stamp it, the ``deb-src`` detection, the cache lookup, and the failure memory of `build`.
tests/integration/test_real_control_plane.py runs the real thing."""

from __future__ import annotations

import json
import time

import pytest

from fleet.testing.k8s import kube
from fleet.testing.k8s.kube import COMMANDS, OutOfTime, Unavailable, build, built, upstream_version, version_ldflags


@pytest.mark.parametrize(("debian", "upstream"), [
    ("1.20.5+really1.20.2-1.1+deb12u1", "v1.20.2"),   # bookworm's: the tarball holds 1.20.2
    ("1.28.1-2", "v1.28.1"),
    ("1:1.29.0+ds-1", "v1.29.0"),
])  # fmt: skip
def test_the_kubernetes_version_is_read_from_the_debian_source_version(debian, upstream):
    assert upstream_version(debian) == upstream


def test_the_version_is_stamped_into_both_version_packages_under_their_gopath_import_paths():
    flags = version_ldflags("v1.20.2").split()
    for pkg in ("component-base/version", "client-go/pkg/version"):   # /version answers from client-go's
        for key, value in (("gitVersion", "v1.20.2"), ("gitMajor", "1"), ("gitMinor", "20")):
            assert f"k8s.io/kubernetes/vendor/k8s.io/{pkg}.{key}={value}" in flags
    assert flags.count("-X") == 8


def test_a_deb_src_entry_is_found_in_deb822_and_one_line_form(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\n\n"
        "Types: deb-src\nURIs: http://deb.debian.org/debian-security\nSuites: bookworm-security\n")
    assert not kube._has_deb_src(tmp_path)   # bookworm's binaries; the sources of bookworm-security only
    (tmp_path / "sources.list").write_text("deb-src [signed-by=/k.gpg] http://deb.debian.org/debian bookworm main\n")
    assert kube._has_deb_src(tmp_path)
    (tmp_path / "sources.list").unlink()
    (tmp_path / "sources.list.d" / "src.sources").write_text("Types: deb deb-src\nURIs: http://m\nSuites: bookworm\n")
    assert kube._has_deb_src(tmp_path)


def _fake_build(cache, version="1.20.5+really1.20.2-1.1+deb12u1"):
    bin_dir = cache / version / "bin"
    bin_dir.mkdir(parents=True)
    for c in (*COMMANDS, "etcd"):
        (bin_dir / c).write_text("")
    (bin_dir / "build.json").write_text(json.dumps({"kubernetes": upstream_version(version)}))
    return bin_dir


def test_a_finished_build_is_found_without_building(tmp_path, monkeypatch):
    monkeypatch.setattr(kube, "_build", lambda cache, deadline: pytest.fail("built again"))
    assert built(tmp_path) is None
    bin_dir = _fake_build(tmp_path)
    found = build(tmp_path)
    assert found.bin_dir == bin_dir and found["kube-apiserver"] == bin_dir / "kube-apiserver"
    assert found.info["kubernetes"] == "v1.20.2"
    (bin_dir / "kubelet").unlink()   # half a build is no build
    assert built(tmp_path) is None


def test_a_recent_failure_is_answered_from_the_cache_and_retried_when_asked(tmp_path, monkeypatch):
    monkeypatch.delenv("FLEET_KUBE_RETRY", raising=False)
    (tmp_path / "unavailable.json").write_text(json.dumps({"reason": "make gen_openapi: exit 2", "at_s": time.time()}))
    with pytest.raises(Unavailable, match="make gen_openapi: exit 2 .*FLEET_KUBE_RETRY=1"):
        build(tmp_path)
    tried = []

    def failing(cache, deadline):
        tried.append(cache)
        (cache / "v" / "work").mkdir(parents=True)   # an unpacked tree: removed whatever happens
        raise Unavailable("apt-get install: needs root")

    monkeypatch.setattr(kube, "_build", failing)
    monkeypatch.setenv("FLEET_KUBE_RETRY", "1")
    with pytest.raises(Unavailable, match="needs root"):
        build(tmp_path)
    assert tried == [tmp_path] and not (tmp_path / "v" / "work").exists()
    assert "needs root" in json.loads((tmp_path / "unavailable.json").read_text())["reason"]


def test_running_out_of_time_is_not_remembered(tmp_path, monkeypatch):
    monkeypatch.setattr(kube, "_build", lambda cache, deadline: (_ for _ in ()).throw(OutOfTime("go build: out")))
    with pytest.raises(OutOfTime):
        build(tmp_path)
    assert not (tmp_path / "unavailable.json").exists()
