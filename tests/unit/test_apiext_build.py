"""The build of the real apiextensions-apiserver (fleet/testing/k8s/apiext.py), the parts that
need no network or process: which Debian packages it fetches, and how a failure is remembered."""

from __future__ import annotations

import json
import time

import pytest

from fleet.testing.k8s import apiext
from fleet.testing.k8s.apiext import Unavailable, build, go_dependencies
from fleet.testing.k8s.buildcache import FAILURE_TTL_S

AVAIL = """\
Package: golang-k8s-apiextensions-apiserver-dev
Version: 0.36.4-1
Depends: golang-k8s-apiserver-dev, golang-yaml.v2-dev | golang-gopkg-yaml.v2-dev, golang-any

Package: golang-k8s-apiserver-dev
Version: 0.36.4-1
Depends: golang-k8s-klog-dev (>= 2.0), libc6 (>= 2.34)

Package: golang-k8s-klog-dev
Version: 2.130.1-1

Package: golang-gopkg-yaml.v2-dev
Version: 2.4.0-4
Provides: golang-yaml.v2-dev

Package: golang-any
Version: 2:1.24~2
Depends: golang-1.24-go

Package: libc6
Version: 2.41-6
"""


def test_dependencies_follow_go_source_packages_through_alternatives_and_provides():
    assert go_dependencies(AVAIL) == ["golang-gopkg-yaml.v2-dev", "golang-k8s-apiextensions-apiserver-dev",
                                      "golang-k8s-apiserver-dev", "golang-k8s-klog-dev"]  # fmt: skip


def test_a_missing_go_dependency_is_unavailable_naming_it():
    broken = AVAIL.replace("Package: golang-k8s-klog-dev\n", "Package: golang-k8s-klog-was-renamed-dev\n")
    with pytest.raises(Unavailable, match="golang-k8s-klog-dev is not in Debian unstable"):
        go_dependencies(broken)


def test_a_recent_failure_is_answered_from_the_cache_and_retried_when_asked(tmp_path, monkeypatch):
    monkeypatch.delenv("FLEET_APIEXT_RETRY", raising=False)
    (tmp_path / "unavailable.json").write_text(json.dumps({"reason": "go build: exit 1: boom", "at_s": time.time()}))
    with pytest.raises(Unavailable, match="go build: exit 1: boom .*FLEET_APIEXT_RETRY=1"):
        build(tmp_path)
    tried = []

    def fake_build(cache, deadline):
        tried.append(cache)
        raise Unavailable("apt-get update: exit 100: unreachable")

    monkeypatch.setattr(apiext, "_build", fake_build)
    monkeypatch.setenv("FLEET_APIEXT_RETRY", "1")
    with pytest.raises(Unavailable, match="unreachable"):
        build(tmp_path)
    assert tried == [tmp_path]
    assert "unreachable" in json.loads((tmp_path / "unavailable.json").read_text())["reason"]


def test_running_out_of_time_is_not_remembered(tmp_path, monkeypatch):
    def slow_build(cache, deadline):
        raise apiext.OutOfTime("go build: the build's time budget ran out during this step")

    monkeypatch.setattr(apiext, "_build", slow_build)
    with pytest.raises(Unavailable, match="time budget"):
        build(tmp_path)
    assert not (tmp_path / "unavailable.json").exists()


def test_an_old_failure_is_tried_again(tmp_path, monkeypatch):
    monkeypatch.delenv("FLEET_APIEXT_RETRY", raising=False)
    old_s = time.time() - FAILURE_TTL_S - 60
    (tmp_path / "unavailable.json").write_text(json.dumps({"reason": "old", "at_s": old_s}))
    monkeypatch.setattr(apiext, "_build", lambda cache, deadline: (_ for _ in ()).throw(Unavailable("new")))
    with pytest.raises(Unavailable, match="^new$"):
        build(tmp_path)
