"""A REAL Kubernetes control plane for the integration tests (tests/integration/
test_real_control_plane.py): ``kube-apiserver``, ``kube-scheduler`` and ``kube-controller-manager``
of Kubernetes 1.20.2 over a real etcd, all on 127.0.0.1. Everything above the kubelet is
Kubernetes' own code here: admission, RBAC and Node authorization, service-account tokens, the
Deployment -> ReplicaSet -> Pod controllers, the scheduler's resource fit. It runs no kubelet:
the nodes it schedules on are hollow (Node objects the tests register and keep Ready:
fleet/testing/k8s/hollow.py) or a real kubelet over containerd joins it (fleet/testing/k8s/realnode.py).

Owns `build` (the binaries, built once into a cache directory and reused), `install_packages`
(apt, shared with the real node), `Unavailable` (why they cannot be had here, in one line) and
`RealControlPlane` (the processes, and a `KubeClient` per identity).

Where the binaries come from (no registry ships ``kube-apiserver``; docs/kubernetes.md):
- the source: Debian bookworm's ``kubernetes`` source package (``1.20.5+really1.20.2-...``, the
  whole Kubernetes 1.20.2 tree with ``vendor/``), fetched with ``apt-get source --download-only``
  through the SYSTEM's apt state: a ``deb-src`` entry for bookworm is added to
  /etc/apt/sources.list.d/debian-src.sources when none exists, and the build dependencies
  (`BUILD_DEPENDS`: Debian's Go 1.19, etcd, rsync, make, dpkg-dev, reflect2) are installed with
  ``apt-get install``; both need root, else the build is `Unavailable`;
- the tree: ``dpkg-source -x`` (Debian's patches applied), the vendored
  ``github.com/modern-go/reflect2`` 1.0.1 (broken with Go >= 1.18) swapped for Debian's 1.0.2, then
  ``make gen_openapi`` (kube-apiserver does not compile without it);
- the build: GOPATH mode, as Kubernetes' own hack/lib/init.sh does it (``GO111MODULE=off``, the tree
  linked at ``$GOPATH/src/k8s.io/kubernetes``), ``go build -trimpath`` of `COMMANDS` with the
  version ldflags of hack/lib/version.sh, so ``/version`` says ``v1.20.2`` (Helm reads
  ``.Capabilities.KubeVersion`` there); about 6-7 minutes on 2 cores with a cold Go cache;
- etcd: Debian's ``etcd-server`` (3.4), copied beside them.
A step that fails raises `Unavailable` with the step and the tail of its output, remembered for
six hours (``FLEET_KUBE_RETRY=1`` retries at once; fleet/testing/k8s/buildcache.py, shared with
apiext.py). A build that runs out of time (`OutOfTime`) is not remembered: the next one goes on
with what the Go build cache kept.

The cache: ``$FLEET_KUBE_CACHE``, else ``$XDG_CACHE_HOME/fleet/kube``, else ``~/.cache/fleet/kube``;
one directory per Debian source version, of which only ``bin/`` (the five binaries, etcd and
build.json; about 400 MB) stays after a build. The Go build cache (``gocache``, 1.5 GB) sits beside
them until a build succeeds.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from fleet.k8s.client import KubeClient, Resource
from fleet.testing.k8s.buildcache import (KEYRING, OutOfTime, Unavailable, build_command, build_once, debian_mirror,
                                           free_port, http_ok, run_step, terminate)

SOURCE_PACKAGE = "kubernetes"
SUITE = "bookworm"
GO = Path("/usr/lib/go-1.19/bin/go")
BUILD_DEPENDS = ("golang-1.19-go", "etcd-server", "rsync", "make", "dpkg-dev", "golang-github-modern-go-reflect2-dev")
REFLECT2 = Path("/usr/share/gocode/src/github.com/modern-go/reflect2")
COMMANDS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubelet", "kube-proxy")
SRC_SOURCES = Path("/etc/apt/sources.list.d/debian-src.sources")
BUILD_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Binaries:
    """``bin_dir``: the directory of `COMMANDS` and ``etcd``; ``info``: its build.json
    (versions, build seconds)."""

    bin_dir: Path
    info: dict

    def __getitem__(self, command: str) -> Path:
        """The path of ``command`` (one of `COMMANDS` or ``"etcd"``)."""
        return self.bin_dir / command


def cache_dir() -> Path:
    """Where the builds live (see the module docstring)."""
    if os.environ.get("FLEET_KUBE_CACHE"):
        return Path(os.environ["FLEET_KUBE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fleet" / "kube"


def built(cache: Path | None = None) -> Binaries | None:
    """The binaries of an earlier successful build (the newest source version's), or None."""
    for info in sorted((cache or cache_dir()).glob("*/bin/build.json"), reverse=True):
        if all((info.parent / c).exists() for c in (*COMMANDS, "etcd")):
            return Binaries(info.parent, json.loads(info.read_text()))
    return None


def build(cache: Path | None = None, timeout_s: float = BUILD_TIMEOUT_S) -> Binaries:
    """The binaries, built into ``cache`` (default `cache_dir`) unless an earlier build left
    them there. Every step runs under what is left of ``timeout_s``; a concurrent build of the
    same cache is waited for (file lock). Raises `Unavailable` saying which step failed and why."""
    return build_once(cache or cache_dir(), timeout_s, found=built, make=lambda c, d: _build(c, d),
                      retry_env="FLEET_KUBE_RETRY", scratch=lambda cache: cache.glob("*/work"))




def upstream_version(debian_version: str) -> str:
    """Kubernetes' version in a Debian source version: ``1.20.5+really1.20.2-1.1+deb12u1`` ->
    ``v1.20.2`` (Debian's ``+really`` names what the tarball holds), ``1.28.1-2`` -> ``v1.28.1``."""
    upstream = debian_version.split(":")[-1].rsplit("-", 1)[0]
    if m := re.search(r"really([0-9][0-9.]*)", upstream):
        return f"v{m.group(1)}"
    return "v" + re.match(r"[0-9][0-9.]*", upstream).group(0).rstrip(".")


def version_ldflags(version: str) -> str:
    """``-X`` flags that stamp ``version`` (``v1.20.2``) into both version packages Kubernetes
    reads, under their GOPATH import paths, as hack/lib/version.sh's ``kube::version::ldflags``
    does: ``component-base/version`` (``--version``, the API server's own config) and
    ``client-go/pkg/version`` (what the aggregator, the server in front, answers ``/version``
    from: staging/src/k8s.io/kube-aggregator/pkg/apiserver/apiserver.go)."""
    major, minor = version.lstrip("v").split(".")[:2]
    values = {"gitVersion": version, "gitMajor": major, "gitMinor": minor, "gitTreeState": "archive"}
    return " ".join(f"-X k8s.io/kubernetes/vendor/k8s.io/{pkg}.{key}={value}"
                    for pkg in ("component-base/version", "client-go/pkg/version")
                    for key, value in values.items())  # fmt: skip


def _has_deb_src(apt_etc: Path = Path("/etc/apt")) -> bool:
    """Whether the apt sources under ``apt_etc`` list a ``deb-src`` entry for `SUITE` (one-line
    ``sources.list`` form or deb822 ``.sources``)."""
    files = [apt_etc / "sources.list", *(apt_etc / "sources.list.d").glob("*.list"),
             *(apt_etc / "sources.list.d").glob("*.sources")]  # fmt: skip
    for f in files:
        text = f.read_text(errors="replace") if f.exists() else ""
        for stanza in text.split("\n\n"):   # deb822: Types and Suites in one stanza
            source = re.search(r"^Types:.*\bdeb-src\b", stanza, re.M)
            if source and re.search(rf"^Suites:(?:.*\s)?{SUITE}(?:[ \t]|$)", stanza, re.M):
                return True
        if re.search(rf"^deb-src\s+(?:\[[^]]*\]\s+)?\S+\s+{SUITE}\s", text, re.M):
            return True
    return False


def _source_version(deadline: float) -> str:
    """The Debian version of `SOURCE_PACKAGE` in `SUITE`, adding the ``deb-src`` entry (root)
    and refreshing apt's lists when apt does not know the source yet."""
    def lookup() -> str | None:
        try:
            uris = run_step("apt-get source --print-uris", ["apt-get", "source", "--print-uris", "-qq",
                                                         f"{SOURCE_PACKAGE}/{SUITE}"], deadline)  # fmt: skip
        except OutOfTime:
            raise
        except Unavailable:
            return None
        m = re.search(rf"\s{SOURCE_PACKAGE}_(\S+)\.dsc\s", uris)
        return m.group(1) if m else None

    if (version := lookup()) is not None:
        return version
    if not _has_deb_src():
        if os.geteuid() != 0:
            raise Unavailable(f"apt has no deb-src entry for {SUITE} and adding one needs root")
        SRC_SOURCES.write_text(f"Types: deb-src\nURIs: {debian_mirror()}\nSuites: {SUITE}\nComponents: main\n"
                               f"Signed-By: {KEYRING}\n")  # fmt: skip
    run_step("apt-get update", ["apt-get", "update", "-qq"], deadline)
    if (version := lookup()) is None:
        raise Unavailable(f"apt-get source: no {SOURCE_PACKAGE} source package in Debian {SUITE}")
    return version


def install_packages(packages: tuple[str, ...], deadline: float) -> None:
    """``apt-get install`` of the Debian ``packages`` not installed yet (root); one ``apt-get
    update`` and a second try when the lists are stale. Raises `Unavailable` (not Debian, not
    root, apt's error) or `OutOfTime` past ``deadline``."""
    try:
        query = subprocess.run(["dpkg-query", "-W", "-f", "${Package} ${Status}\n", *packages],
                               capture_output=True, text=True)  # fmt: skip
    except FileNotFoundError:
        raise Unavailable("dpkg-query not found: not a Debian machine") from None
    installed = {line.split()[0] for line in query.stdout.splitlines() if line.endswith(" installed")}
    if not (missing := [p for p in packages if p not in installed]):
        return
    if os.geteuid() != 0:
        raise Unavailable(f"apt-get install {' '.join(missing)}: needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]
    try:
        run_step("apt-get install", cmd, deadline, env=env)
    except OutOfTime:
        raise
    except Unavailable:
        run_step("apt-get update", ["apt-get", "update", "-qq"], deadline)
        run_step("apt-get install", cmd, deadline, env=env)


def _build(cache: Path, deadline: float) -> Binaries:
    started = time.monotonic()
    timings: dict[str, float] = {}

    def timed(step: str, t0: float) -> None:
        timings[step] = round(time.monotonic() - t0, 1)

    t0 = time.monotonic()
    install_packages(BUILD_DEPENDS, deadline)
    debian_version = _source_version(deadline)
    version = upstream_version(debian_version)
    home = cache / debian_version
    src = home / "src"
    src.mkdir(parents=True, exist_ok=True)
    dsc = src / f"{SOURCE_PACKAGE}_{debian_version}.dsc"
    if not dsc.exists():
        run_step("apt-get source --download-only", ["apt-get", "source", "--download-only", "-qq",
                                                f"{SOURCE_PACKAGE}/{SUITE}"], deadline, cwd=src)  # fmt: skip
    timed("fetch", t0)

    t0 = time.monotonic()
    work = home / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    tree = work / "kubernetes"
    run_step("dpkg-source -x", ["dpkg-source", "--no-check", "-x", str(dsc), str(tree)], deadline, cwd=work)
    reflect2 = tree / "vendor" / "github.com" / "modern-go" / "reflect2"
    gopath = work / "gopath"
    try:
        shutil.rmtree(reflect2, ignore_errors=True)
        shutil.copytree(REFLECT2, reflect2, symlinks=True)
        (reflect2 / "go.mod").unlink(missing_ok=True)
        (gopath / "src" / "k8s.io").mkdir(parents=True)
        (gopath / "src" / "k8s.io" / "kubernetes").symlink_to(tree)
    except OSError as err:
        raise Unavailable(f"reflect2 swap and GOPATH: {err}") from None
    timed("unpack", t0)

    env = {"PATH": f"{GO.parent}:/usr/bin:/bin", "HOME": str(work), "GOPATH": str(gopath), "GO111MODULE": "off",
           "CGO_ENABLED": "0", "GOCACHE": str(cache / "gocache"), "GOFLAGS": "", "GOTOOLCHAIN": "local"}  # fmt: skip
    t0 = time.monotonic()
    run_step("make gen_openapi", ["make", "gen_openapi"], deadline, cwd=tree, env=env)
    timed("gen_openapi", t0)

    t0 = time.monotonic()
    bin_dir = home / "bin"
    partial = home / "bin.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    run_step(f"go build {' '.join(COMMANDS)}", [
        str(GO), "build", "-trimpath", "-ldflags", f"-s -w {version_ldflags(version)}", "-o", f"{partial}/",
        *(f"k8s.io/kubernetes/cmd/{c}" for c in COMMANDS)], deadline, env=env)  # fmt: skip
    timed("compile", t0)
    try:
        shutil.copy2("/usr/bin/etcd", partial / "etcd")
    except OSError as err:
        raise Unavailable(f"etcd: {err}") from None
    stamped = run_step("kube-apiserver --version", [str(partial / "kube-apiserver"), "--version"], deadline).strip()
    if not stamped.endswith(version):
        raise Unavailable(f"version ldflags: kube-apiserver --version says {stamped!r}, not {version}")
    etcd_version = run_step("etcd --version", [str(partial / "etcd"), "--version"], deadline).splitlines()[0]
    info = {"kubernetes": version, "debian_source": debian_version, "suite": SUITE,
            "go": run_step("go version", [str(GO), "version"], deadline).strip(), "etcd": etcd_version,
            "build_s": round(time.monotonic() - started, 1), "steps_s": timings,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    (partial / "build.json").write_text(json.dumps(info, indent=1) + "\n")
    shutil.rmtree(bin_dir, ignore_errors=True)
    os.replace(partial, bin_dir)
    for leftover in (src, work, cache / "gocache", cache / "unavailable.json"):
        shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)
    return Binaries(bin_dir, info)


# ----- the control plane --------------------------------------------------------------------------

# The admission plugins a kubeadm cluster of 1.20 runs (its defaults, which are on without being
# named, plus NodeRestriction), named so a reader sees them. PodSecurity is not among them: Pod
# Security admission first ships in 1.22 (alpha); 1.20 has only the deprecated PodSecurityPolicy,
# which refuses every pod until policies exist, and no kubeadm cluster enables it.
ADMISSION_PLUGINS = ("NamespaceLifecycle", "LimitRanger", "ServiceAccount", "DefaultStorageClass", "ResourceQuota",
                     "NodeRestriction", "Priority", "DefaultTolerationSeconds", "PersistentVolumeClaimResize",
                     "RuntimeClass", "CertificateApproval", "CertificateSigning", "CertificateSubjectRestriction",
                     "DefaultIngressClass", "StorageObjectInUseProtection", "TaintNodesByCondition",
                     "MutatingAdmissionWebhook", "ValidatingAdmissionWebhook")  # fmt: skip
SERVICE_CIDR = "10.96.0.0/16"
ISSUER = "https://kubernetes.default.svc.cluster.local"


class RealControlPlane:
    """etcd, ``kube-apiserver``, ``kube-scheduler`` and ``kube-controller-manager`` as processes
    on 127.0.0.1 (free ports), state under ``workdir`` (logs: ``etcd.log``, ``kube-apiserver.log``,
    ``kube-scheduler.log``, ``kube-controller-manager.log``). A context manager: ``__enter__``
    starts them and waits for ``/readyz`` and for the controller-manager's first ServiceAccount
    token (at most ``start_timeout_s``), raising `Unavailable` with a log's tail when one does
    not come up or exits; ``__exit__`` stops every process (SIGTERM, then
    SIGKILL after 10 s) and removes etcd's data, the keys, certificates, tokens and kubeconfigs
    (the logs stay).

    The API server: HTTPS (its self-signed certificate: ``ca_file``), ``--authorization-mode
    Node,RBAC``, `ADMISSION_PLUGINS`, a token file with one bearer token per identity
    (``tokens``: the admin in ``system:masters``, ``system:kube-scheduler``,
    ``system:kube-controller-manager``, ``system:kube-proxy`` (bound to the ``system:node-proxier``
    role by the bootstrap RBAC policy), and ``system:node:NAME`` in ``system:nodes`` for each of
    ``nodes``), and a service-account key pair and issuer, so the controller-manager's token
    controller mints each ServiceAccount's token Secret. For logs and exec it reaches a kubelet
    at the Node's InternalIP (``--kubelet-preferred-address-types``) with a client certificate
    (``system:masters``) signed by ``kubelet_client_ca``, the CA a real kubelet is told to trust
    (``--client-ca-file``: fleet/testing/k8s/realnode.py). The scheduler and the controller-manager
    run as their own users (the bootstrap RBAC roles decide what they may do), without leader
    election; the controller-manager with ``--use-service-account-credentials`` (each controller
    as its own service account) and ``--node-monitor-grace-period`` of
    ``node_monitor_grace_period_s`` (a hollow node heartbeats within it:
    fleet/testing/k8s/hollow.py)."""

    def __init__(self, binaries: Binaries, workdir: Path, *, nodes: tuple[str, ...] = (),
                 start_timeout_s: float = 120.0, node_monitor_grace_period_s: float = 120.0) -> None:  # fmt: skip
        self.binaries = binaries
        self.workdir = workdir
        self.start_timeout_s = start_timeout_s
        self.node_monitor_grace_period_s = node_monitor_grace_period_s
        self.url = ""
        self.ca_file = workdir / "certs" / "apiserver.crt"
        self.kubelet_client_ca = workdir / "certs" / "kubelet-client-ca.crt"
        self.tokens = {user: secrets.token_hex(16) for user in (
            "admin", "system:kube-scheduler", "system:kube-controller-manager", "system:kube-proxy",
            *(f"system:node:{n}" for n in nodes))}  # fmt: skip
        self._procs: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> RealControlPlane:
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for proc in reversed(list(self._procs.values())):
            terminate(proc)
        self._procs.clear()
        for path in (*(self.workdir / s for s in ("etcd", "certs", "tokens.csv", "sa.key", "sa.pub")),
                     *self.workdir.glob("*.kubeconfig")):  # fmt: skip
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)

    # ----- reading it -----------------------------------------------------------------------------

    def log(self, name: str, tail_chars: int = 3000) -> str:
        """The tail of ``NAME.log`` (``etcd``, ``kube-apiserver``, ``kube-scheduler``,
        ``kube-controller-manager``)."""
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-tail_chars:] if path.exists() else ""

    def explain(self, tail_chars: int = 1500) -> str:
        """For a failure message: which processes exited, and each log's tail."""
        lines = [f"{name}: {'running' if p.poll() is None else f'exited {p.returncode}'}\n{self.log(name, tail_chars)}"
                 for name, p in self._procs.items()]  # fmt: skip
        return "\n".join(lines)

    def get_json(self, path: str, token: str | None = "") -> dict:
        """GET ``path`` (``/version``, ``/apis/apps/v1``) as ``token``'s user (``""``: the admin);
        the decoded body. Raises urllib.error.HTTPError on a non-2xx answer."""
        token = self.tokens["admin"] if token == "" else token
        request = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {token}"} if token else {})
        context = ssl.create_default_context(cafile=str(self.ca_file))
        with urllib.request.urlopen(request, timeout=10, context=context) as resp:
            return json.loads(resp.read())

    def resource(self, api_version: str, kind: str) -> Resource:
        """The `Resource` of ``kind`` in ``api_version``, from the server's discovery. Raises
        KeyError naming them when the server does not serve that kind in that version (its
        discovery answers 404 for a group version it lacks: ``policy/v1`` on 1.20)."""
        group, _, version = api_version.rpartition("/")
        try:
            listing = self.get_json(f"/apis/{api_version}" if group else f"/api/{version}")
        except urllib.error.HTTPError as err:
            raise KeyError(f"the API server does not serve {api_version} (HTTP {err.code})") from None
        for r in listing.get("resources", []):
            if r["kind"] == kind and "/" not in r["name"]:
                return Resource(group, version, r["name"], kind, namespaced=r["namespaced"])
        raise KeyError(f"the API server serves no {kind} in {api_version}")

    def client(self, token: str | None = "") -> KubeClient:
        """`KubeClient` of the API server: the official client with the server's CA and a bearer
        token (``""``: the admin's; ``None``: anonymous; ``self.tokens[user]`` for another)."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        cfg.ssl_ca_cert = str(self.ca_file)
        token = self.tokens["admin"] if token == "" else token
        if token:
            cfg.api_key = {"authorization": token}
            cfg.api_key_prefix = {"authorization": "Bearer"}
        return KubeClient(client.ApiClient(cfg))

    def kubeconfig(self, user: str = "admin", path: Path | None = None) -> Path:
        """Write a kubeconfig for ``user`` (a key of ``self.tokens``: ``"admin"`` by default) to
        ``path`` (default ``<workdir>/<user>.kubeconfig``) and return its path: the API server's URL
        and CA, the user's bearer token. What ``helm`` and ``kubectl`` take as ``--kubeconfig``.
        Raises KeyError for a user the token file does not hold."""
        path = path or self.workdir / f"{user.replace(':', '-')}.kubeconfig"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fleet-test",
            "clusters": [{"name": "fleet-test", "cluster": {"server": self.url, "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": user, "user": {"token": self.tokens[user]}}],
            "contexts": [{"name": "fleet-test", "context": {"cluster": "fleet-test", "user": user}}],
        }))  # fmt: skip
        return path

    # ----- starting it ----------------------------------------------------------------------------

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        with open(self.workdir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)  # fmt: skip
        self._procs[name] = proc
        return proc

    def _wait(self, name: str, ready, deadline: float) -> None:
        """Until ``ready()``; raises `Unavailable` with the log's tail when a process exits
        (any started one) or ``deadline`` passes."""
        while not ready():
            for which, proc in self._procs.items():
                if proc.poll() is not None:
                    raise Unavailable(f"{which} exited with {proc.returncode} while starting: {self.log(which, 600)!r}")
            if time.monotonic() > deadline:
                raise Unavailable(f"{name} not ready after {self.start_timeout_s:.0f} s: {self.log(name, 600)!r}")
            time.sleep(0.2)

    def _has_token(self, namespace: str = "default") -> bool:
        """Whether ``namespace``'s ServiceAccount ``default`` has its token Secret: the
        controller-manager's service-account and token controllers are at work."""
        try:
            return bool(self.get_json(f"/api/v1/namespaces/{namespace}/serviceaccounts/default").get("secrets"))
        except OSError:
            return False

    def _write_credentials(self) -> None:
        """The service-account key pair, the token file and a kubeconfig per component."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        (self.workdir / "sa.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()))
        (self.workdir / "sa.pub").write_bytes(key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))  # fmt: skip
        rows = []
        for user, token in self.tokens.items():
            groups = {"admin": "system:masters"}.get(user, "system:nodes" if user.startswith("system:node:") else "")
            rows.append(f'{token},{user},{user},"{groups}"' if groups else f"{token},{user},{user}")
        (self.workdir / "tokens.csv").write_text("\n".join(rows) + "\n")
        for component in ("kube-scheduler", "kube-controller-manager"):
            self.kubeconfig(f"system:{component}", self.workdir / f"{component}.kubeconfig")
        self._write_kubelet_client_cert()

    def _write_kubelet_client_cert(self) -> None:
        """``certs/kubelet-client-ca.crt`` (`kubelet_client_ca`) and the API server's client
        certificate for kubelets signed by it (``certs/kubelet-client.{crt,key}``: CN
        ``kube-apiserver-kubelet-client``, O ``system:masters``, as kubeadm makes it)."""
        import datetime

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        now = datetime.datetime.now(datetime.timezone.utc)
        ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fleet-test-kubelet-client-ca")])
        name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:masters"),
                          x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver-kubelet-client")])

        def signed(subject: x509.Name, public_key, ca: bool) -> x509.Certificate:
            return (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(public_key)
                    .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                    .not_valid_after(now + datetime.timedelta(days=7))
                    .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
                    .sign(ca_key, hashes.SHA256()))  # fmt: skip

        certs = self.kubelet_client_ca.parent
        certs.mkdir(parents=True, exist_ok=True)
        pem = serialization.Encoding.PEM
        self.kubelet_client_ca.write_bytes(signed(ca_name, ca_key.public_key(), True).public_bytes(pem))
        (certs / "kubelet-client.crt").write_bytes(signed(name, key.public_key(), False).public_bytes(pem))
        (certs / "kubelet-client.key").write_bytes(key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))  # fmt: skip

    def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.start_timeout_s
        client_port, peer_port, secure_port = free_port(), free_port(), free_port()
        self.url = f"https://127.0.0.1:{secure_port}"
        self._write_credentials()
        etcd_url, peer_url = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
        self._spawn("etcd", [
            str(self.binaries["etcd"]), "--name", "fleet-test", "--data-dir", str(self.workdir / "etcd"),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"fleet-test={peer_url}", "--unsafe-no-fsync", "--log-level", "warn",
        ])  # fmt: skip
        self._wait("etcd", lambda: http_ok(f"{etcd_url}/health"), deadline)
        w = self.workdir
        self._spawn("kube-apiserver", [
            str(self.binaries["kube-apiserver"]), "--etcd-servers", etcd_url,
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1", "--secure-port", str(secure_port),
            "--insecure-port", "0", "--cert-dir", str(self.ca_file.parent),
            "--authorization-mode", "Node,RBAC", "--token-auth-file", str(w / "tokens.csv"),
            "--service-account-key-file", str(w / "sa.pub"), "--service-account-signing-key-file", str(w / "sa.key"),
            "--service-account-issuer", ISSUER, "--service-cluster-ip-range", SERVICE_CIDR,
            "--enable-admission-plugins", ",".join(ADMISSION_PLUGINS), "--allow-privileged=true",
            "--profiling=false", "--kubelet-preferred-address-types", "InternalIP,Hostname",
            "--kubelet-client-certificate", str(self.kubelet_client_ca.parent / "kubelet-client.crt"),
            "--kubelet-client-key", str(self.kubelet_client_ca.parent / "kubelet-client.key"),
        ])  # fmt: skip
        self._wait("kube-apiserver", lambda: self.ca_file.exists() and http_ok(
            f"{self.url}/readyz", ca_file=self.ca_file, token=self.tokens["admin"]), deadline)  # fmt: skip
        self._spawn("kube-scheduler", [
            str(self.binaries["kube-scheduler"]), "--kubeconfig", str(w / "kube-scheduler.kubeconfig"),
            "--leader-elect=false", "--bind-address", "127.0.0.1", "--port", "0", "--secure-port", "0",
        ])  # fmt: skip
        self._spawn("kube-controller-manager", [
            str(self.binaries["kube-controller-manager"]),
            "--kubeconfig", str(w / "kube-controller-manager.kubeconfig"),
            "--leader-elect=false", "--bind-address", "127.0.0.1", "--port", "0", "--secure-port", "0",
            "--use-service-account-credentials=true", "--service-account-private-key-file", str(w / "sa.key"),
            "--root-ca-file", str(self.ca_file), "--controllers", "*",
            "--node-monitor-grace-period", f"{self.node_monitor_grace_period_s:.0f}s",
        ])  # fmt: skip
        self._wait("kube-controller-manager", self._has_token, deadline)   # the scheduler: alive by then


def main(argv: list[str] | None = None) -> int:
    """``python -m fleet.testing.k8s.kube build [--timeout-s S] [--strict]``
    (`fleet.testing.k8s.buildcache.build_command`)."""
    return build_command(
        argv, prog="python -m fleet.testing.k8s.kube", layer="kubernetes control plane",
        build=lambda timeout_s: build(timeout_s=timeout_s), timeout_s=BUILD_TIMEOUT_S, info=lambda b: b.info,
        describe=lambda b: f"kubernetes {b.info.get('kubernetes')} ({b.info.get('debian_source')}) and "
                           f"{b.info.get('etcd')} in {b.bin_dir}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
