"""A REAL Kubernetes node for the integration tests (tests/integration/test_real_node.py):
Kubernetes 1.20.2's ``kubelet`` (built with the control plane: fleet/testing/k8s/kube.py) over
Debian bookworm's ``containerd`` 1.6 and ``runc`` 1.1, pods networked by the CNI plugins (bridge
with host-local IPAM on `POD_CIDR`, portmap, loopback), and ``kube-proxy`` in iptables mode, joined
to a `RealControlPlane` as ``system:node:NAME``. Nothing in a pod's path is a stand-in: the real
scheduler binds it, the kubelet admits it against the node's capacity, containerd pulls nothing
(no registry is reachable: every image is imported, `RealNode.import_image`) and runc runs it in
its cgroups, namespaces, capabilities and seccomp profile.

Owns `RealNode` (the processes and everything they change on the machine, undone on exit). Its
images: fleet/testing/k8s/realnode_images.py. Called by tests/integration/test_real_node.py.

What a node changes on the machine, and how it is kept apart and undone:
- one MOUNT NAMESPACE of its own (``unshare --propagation private``, a holder process) for
  containerd, its shims and the kubelet: every mount they make (overlay rootfs, Secret tmpfs,
  network-namespace files) dies with it, and the paths kubelet 1.20 and containerd 1.6 hard-code
  (`HOST_PATHS`: /var/log/pods, the device-plugin directory, the shim sockets, /var/lib/cni) are
  bind mounts of the node's work directory there;
- the link ``/run/fleet-node-NAME-device-plugins`` to its device-plugins directory (a short path
  for the plugins' sockets: `RealNode.device_plugin_dir`);
- cgroups under ``/NODE_CGROUP_PREFIX-NAME`` in every cgroup v1 hierarchy (``--cgroup-root``);
- the bridge `BRIDGE`, iptables chains (the kubelet's and kube-proxy's ``KUBE-*``, the bridge
  plugin's ``CNI-*`` of `CNI_NETWORK`) and the `SYSCTLS` the kubelet, kube-proxy and the bridge set.
Two real nodes on one machine would share iptables and those sysctls, so one runs at a time
(`LOCK`). A part that cannot run here raises `Unavailable` (fleet/testing/k8s/buildcache.py) with
the measured reason.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
import urllib.error
from pathlib import Path

from fleet.testing.k8s.buildcache import Unavailable, free_port, http_ok, run_step, terminate
from fleet.testing.k8s.kube import RealControlPlane, build, install_packages
from fleet.testing.k8s.nvidia_runtime import write_wrapper
from fleet.testing.k8s.realnode_images import PAUSE_IMAGE, node_images

PACKAGES = ("containerd", "runc", "containernetworking-plugins", "iptables", "conntrack", "busybox-static",
            "gcc", "libc6-dev")  # fmt: skip
"""Debian bookworm packages the node needs (containerd 1.6.20, runc 1.1.5, the CNI plugins 1.1.1;
busybox-static and a C compiler for the images of `node_images`)."""

CNI_BIN_DIR = Path("/usr/lib/cni")   # where Debian's containernetworking-plugins puts them
POD_CIDR = "10.245.0.0/24"
BRIDGE = "fleetnode0"
CNI_NETWORK = "fleet-node"
NODE_CGROUP_PREFIX = "fleet-node"
LOCK = Path("/run/lock/fleet-realnode.lock")
HOST_PATHS = ("/run/containerd", "/run/netns", "/var/lib/cni", "/var/log/pods", "/var/log/containers",
              "/var/lib/kubelet/device-plugins")  # fmt: skip
"""Paths the node's processes use whatever their flags say (kubelet 1.20: the pod logs and the
device-plugin socket; containerd 1.6: the shim sockets and network-namespace files; libcni: its
cache): bind mounts of ``<workdir>/host/...`` inside the node's mount namespace."""
SYSCTLS = ("net/ipv4/ip_forward", "net/bridge/bridge-nf-call-iptables", "net/ipv4/conf/all/route_localnet",
           "vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
           "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")  # fmt: skip
"""What the node sets (forwarding and bridge netfilter for Services between pods), or the kubelet
(pkg/kubelet/cm/container_manager_linux.go ``setupKernelTunables``) and kube-proxy
(``route_localnet``) set: read before the start, written back on exit."""
REQUIRED_CGROUPS = ("cpu", "cpuacct", "cpuset", "memory", "pids")
CAP_SYS_RESOURCE = 24
"""Without it (a sandboxed root) a process may not lower an ``oom_score_adj``: runc's init fails on
the -998 the kubelet gives a pod sandbox ("can't get final child's PID from pipe: EOF"), so
containerd is told to clamp (``restrict_oom_score_adj``: no container below containerd's own)."""


class RealNode:
    """See the module docstring. ``plane``: a started `RealControlPlane` made with a token for
    ``name`` (``nodes=(name,)``); ``workdir``: a directory of its own (logs ``containerd.log``,
    ``kubelet.log``, ``kube-proxy.log`` stay there; state is removed on exit).

    ``__enter__`` installs what is missing (`PACKAGES`, apt as root), measures whether overlayfs
    mounts here (else the ``native`` snapshotter: ``snapshotter``, and ``overlayfs_refused`` says
    why), starts containerd, imports the pause image, starts the kubelet and waits for the Node to
    be Ready, then kube-proxy and waits for its first sync; at most ``start_timeout_s``. Raises
    `Unavailable` saying which part could not run and why (a log's tail). ``timings_s``: seconds
    from the start to each step. ``nvml_state``: a fake NVML state file (fleet/testing/fake_nvml.py
    `write_state`) makes containerd run runc through the NVIDIA container runtime's stand-in
    (fleet/testing/k8s/nvidia_runtime.py), which gives a container asking for GPUs by
    ``NVIDIA_VISIBLE_DEVICES`` that node's fake NVML; None: plain runc.
    ``__exit__`` (idempotent) stops everything and undoes what the module docstring lists
    (``stop_timings_s``: the seconds each of its steps took); `leftovers` says what, if anything,
    it could not undo."""

    def __init__(self, plane: RealControlPlane, name: str, workdir: Path, *, start_timeout_s: float = 240.0,
                 nvml_state: Path | None = None) -> None:  # fmt: skip
        self.plane, self.name, self.workdir = plane, name, workdir
        self.start_timeout_s = start_timeout_s
        self.nvml_state = nvml_state
        self.socket = workdir / "containerd" / "containerd.sock"
        self.cgroup_root = f"/{NODE_CGROUP_PREFIX}-{name}"
        # The kubelet's device-plugins directory, seen from this machine through a short link: a
        # plugin's socket path must fit a unix socket address (107 bytes), which a work directory
        # deep under pytest's (xdist's) temporary directories need not.
        self.device_plugin_dir = Path(f"/run/fleet-node-{name}-device-plugins")
        self.pod_resources_socket = workdir / "kubelet" / "pod-resources" / "kubelet.sock"
        self.node_ip = ""
        self.snapshotter = "overlayfs"
        self.overlayfs_refused = ""
        self.timings_s: dict[str, float] = {}
        self.stop_timings_s: dict[str, float] = {}
        self._started = 0.0
        self._procs: dict[str, subprocess.Popen] = {}
        self._sysctls: dict[str, str] = {}
        self._made_dirs: list[Path] = []
        self._chains_before: frozenset[str] | None = None
        self._lock: io.TextIOWrapper | None = None

    def __enter__(self) -> RealNode:
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._lock is None:
            return
        for step in (self._stop_processes, self._remove_cgroups, self._remove_network, self._restore_sysctls,
                     self._remove_state):  # fmt: skip
            started = time.monotonic()
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                step()
            self.stop_timings_s[step.__name__.lstrip("_")] = round(time.monotonic() - started, 1)
        self._lock.close()
        self._lock = None

    # ----- reading it -----------------------------------------------------------------------------

    def log(self, name: str, tail_chars: int = 3000) -> str:
        """The tail of ``NAME.log`` (``containerd``, ``kubelet``, ``kube-proxy``)."""
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-tail_chars:] if path.exists() else ""

    def explain(self, tail_chars: int = 1500) -> str:
        """For a failure message: which processes exited, and each log's tail."""
        return "\n".join(f"{n}: {'running' if p.poll() is None else f'exited {p.returncode}'}\n"
                         f"{self.log(n, tail_chars)}" for n, p in self._procs.items() if n != "mountns")  # fmt: skip

    def ctr(self, *args: str, timeout_s: float = 60.0) -> str:
        """``ctr`` against this node's containerd in the CRI's namespace ``k8s.io``; its stdout.
        Raises `Unavailable` on a non-zero exit (with its output)."""
        return run_step(f"ctr {args[0]}", ["ctr", "--address", str(self.socket), "-n", "k8s.io", *args],
                        time.monotonic() + timeout_s)  # fmt: skip

    def import_image(self, path: Path) -> list[str]:
        """Import the image archive at ``path`` (an OCI image layout or ``docker save`` tar, named
        by its ``io.containerd.image.name`` annotation or its RepoTags) into the node, unpacked for
        its snapshotter, where the kubelet finds it (``imagePullPolicy: IfNotPresent`` or
        ``Never``): the one way an image reaches this node. Returns the references imported."""
        out = self.ctr("images", "import", "--snapshotter", self.snapshotter, str(path), timeout_s=300)
        return re.findall(r"^unpacking (\S+) \(", out, re.M)

    def task_pid(self, container_id: str) -> int:
        """The host PID of the running container ``container_id`` (a pod status's
        ``containerID`` with or without its ``containerd://``). Raises KeyError when no task runs."""
        cid = container_id.removeprefix("containerd://")
        for line in self.ctr("tasks", "ls").splitlines()[1:]:
            task, pid, status = line.split()[:3]
            if task == cid and status == "RUNNING":
                return int(pid)
        raise KeyError(f"no running task {cid} on {self.name}")

    def cgroup_dir(self, controller: str) -> Path:
        """The node's ``--cgroup-root`` in the cgroup v1 hierarchy of ``controller`` (``memory``,
        ``pids``, ...): pods' and containers' cgroups are below it. Raises KeyError for a
        controller not mounted."""
        return self._cgroup_dirs()[controller]

    def leftovers(self) -> list[str]:
        """What of the node is still on the machine (empty after a clean exit): processes it
        started, its cgroups, the bridge, its iptables chains and rules, mounts under its
        work directory, a changed sysctl, the directories it made."""
        found = [f"process {pid}" for pid in self._processes()]
        found += [f"cgroup {d}" for d in set(self._cgroup_dirs().values()) if d.exists()]
        if Path(f"/sys/class/net/{BRIDGE}").exists():
            found.append(f"link {BRIDGE}")
        found += [f"{family} {table} {what}" for family in ("iptables", "ip6tables")
                  for table, what in _iptables_ours(family, self._chains_before)]  # fmt: skip
        found += [f"mount {line.split()[4]}" for line in Path("/proc/self/mountinfo").read_text().splitlines()
                  if str(self.workdir) in line.split()[4]]  # fmt: skip
        found += [f"sysctl {k}={_sysctl(k)} (was {v})" for k, v in self._sysctls.items() if _sysctl(k) != v]
        found += [f"directory {d}" for d in self._made_dirs if d.exists()]
        found += [f"link {self.device_plugin_dir}"] if self.device_plugin_dir.is_symlink() else []
        return found

    # ----- starting it ----------------------------------------------------------------------------

    def _start(self) -> None:
        self._started = started = time.monotonic()
        deadline = started + self.start_timeout_s
        self._take_lock(deadline)
        _preflight()
        self._kill_node_processes()   # what a node of this name killed before its exit left
        self._remove_cgroups()
        self._remove_network()
        self._chains_before = _cni_chains()
        install_packages(PACKAGES, deadline)
        binaries = build()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.node_ip = _node_ip()
        if reason := _overlay_fails(self.workdir / "overlay-probe"):
            self.snapshotter, self.overlayfs_refused = "native", reason
        images = node_images()
        self._sysctls = {k: v for k in SYSCTLS if (v := _sysctl(k)) is not None}
        for key in ("net/ipv4/ip_forward", "net/bridge/bridge-nf-call-iptables"):
            Path("/proc/sys", key).write_text("1\n")
        self._make_cgroup_root()
        self._make_mount_namespace(deadline)
        self._write_configs()

        self._start_containerd(images["pause"], deadline)
        self._spawn("kubelet", self._kubelet_command(binaries["kubelet"]), ns=True)
        self._wait("kubelet", self._node_ready, deadline)
        self.timings_s["node_ready_s"] = round(time.monotonic() - started, 1)
        self._start_kube_proxy(binaries["kube-proxy"], deadline)

    def _start_containerd(self, pause: Path, deadline: float) -> None:
        self._spawn("containerd", ["containerd", "--config", str(self.workdir / "containerd" / "config.toml")], ns=True)
        self._wait("containerd", self._containerd_up, deadline)
        self.timings_s["containerd_s"] = round(time.monotonic() - self._started, 1)
        self.import_image(pause)
        self.timings_s["pause_imported_s"] = round(time.monotonic() - self._started, 1)

    def _start_kube_proxy(self, kube_proxy: Path, deadline: float) -> None:
        """kube-proxy as ``system:kube-proxy`` (the bootstrap ``system:node-proxier`` role), in
        iptables mode, leaving conntrack's limits as they are; ready once its health check
        answers and its first sync wrote the ``KUBE-SERVICES`` chain."""
        healthz = free_port()
        self._spawn("kube-proxy", [
            str(kube_proxy), "--kubeconfig", str(self.plane.kubeconfig("system:kube-proxy")),
            "--hostname-override", self.name, "--proxy-mode", "iptables", "--cluster-cidr", POD_CIDR,
            "--bind-address", self.node_ip, "--healthz-bind-address", f"127.0.0.1:{healthz}",
            "--metrics-bind-address", f"127.0.0.1:{free_port()}", "--conntrack-max-per-core", "0",
            "--conntrack-min", "0", "--conntrack-tcp-timeout-established", "0s",
            "--conntrack-tcp-timeout-close-wait", "0s", "--v", "2",
        ])  # fmt: skip

        def synced() -> bool:
            nat = subprocess.run(["iptables-save", "-t", "nat"], capture_output=True, text=True).stdout
            return ":KUBE-SERVICES " in nat and http_ok(f"http://127.0.0.1:{healthz}/healthz")

        self._wait("kube-proxy", synced, deadline)
        self.timings_s["kube_proxy_synced_s"] = round(time.monotonic() - self._started, 1)

    def _take_lock(self, deadline: float) -> None:
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        lock = open(LOCK, "w")  # noqa: SIM115 - held until __exit__
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    lock.close()
                    raise Unavailable(f"another real node held {LOCK} for {self.start_timeout_s:.0f} s") from None
                time.sleep(1.0)
        self._lock = lock

    def _make_mount_namespace(self, deadline: float) -> None:
        """The holder of the node's mount namespace, and `HOST_PATHS` bound there."""
        holder = self._spawn("mountns", ["unshare", "--mount", "--propagation", "private", "--", "sleep", "infinity"])
        own = os.readlink("/proc/self/ns/mnt")
        self._wait("mountns", lambda: os.readlink(f"/proc/{holder.pid}/ns/mnt") != own, deadline)
        for target in map(Path, HOST_PATHS):
            source = self.workdir / "host" / target.relative_to("/")
            source.mkdir(parents=True, exist_ok=True)
            self._mkdirs(target)
            run_step(f"bind {target}", ["nsenter", "-t", str(holder.pid), "-m", "--", "mount", "--bind",
                                        str(source), str(target)], deadline)  # fmt: skip
        self.device_plugin_dir.unlink(missing_ok=True)
        self.device_plugin_dir.symlink_to(self.workdir / "host" / "var/lib/kubelet/device-plugins")

    def _mkdirs(self, path: Path) -> None:
        missing = [p for p in (path, *path.parents) if not p.exists()]
        path.mkdir(parents=True, exist_ok=True)
        self._made_dirs += missing    # deepest first: removed in this order

    def _make_cgroup_root(self) -> None:
        """``--cgroup-root`` in every cgroup v1 hierarchy (the kubelet checks it exists), its
        cpuset given the machine's CPUs and memory nodes, and ``daemons`` below it in the pids
        hierarchy, where `_spawn` puts every process it starts (so containerd's shims too): all
        that a node runs is then found in its cgroups, also after a run killed before its exit."""
        dirs = self._cgroup_dirs()
        for d in set(dirs.values()):
            d.mkdir(exist_ok=True)
        (dirs["pids"] / "daemons").mkdir(exist_ok=True)
        for f in ("cpuset.cpus", "cpuset.mems"):
            (dirs["cpuset"] / f).write_text((dirs["cpuset"].parent / f).read_text())

    def _write_configs(self) -> None:
        """containerd's config (its own root, state and socket; the CRI plugin with the pause
        image, runc under cgroupfs, through the NVIDIA runtime's stand-in with ``nvml_state``, and
        the CNI config below) and the CNI network list."""
        c = self.workdir / "containerd"
        cni = self.workdir / "cni"
        for d in (c, cni):
            d.mkdir(parents=True, exist_ok=True)
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        runc = shutil.which("runc") or "runc"
        if self.nvml_state is not None:
            runc = str(write_wrapper(c / "nvidia-container-runtime", runc, self.nvml_state))
        (c / "config.toml").write_text("\n".join([
            "version = 2", f'root = "{c / "root"}"', f'state = "{c / "state"}"',
            f'[grpc]\naddress = "{self.socket}"', f'[ttrpc]\naddress = "{self.socket}.ttrpc"',
            '[metrics]\naddress = ""', f'[plugins."io.containerd.internal.v1.opt"]\npath = "{c / "opt"}"',
            f'[{cri}]\nsandbox_image = "{PAUSE_IMAGE}"\nstream_server_address = "127.0.0.1"\n'
            'stream_server_port = "0"\ndisable_hugetlb_controller = true\nenable_selinux = false\n'
            f'restrict_oom_score_adj = {str(not _has_capability(CAP_SYS_RESOURCE)).lower()}',
            f'[{cri}.containerd]\nsnapshotter = "{self.snapshotter}"\ndefault_runtime_name = "runc"',
            f'[{cri}.containerd.runtimes.runc]\nruntime_type = "io.containerd.runc.v2"',
            f'[{cri}.containerd.runtimes.runc.options]\nSystemdCgroup = false\nBinaryName = "{runc}"',
            f'[{cri}.cni]\nbin_dir = "{CNI_BIN_DIR}"\nconf_dir = "{cni}"', "",
        ]))  # fmt: skip
        (cni / "10-fleet-node.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": CNI_NETWORK, "plugins": [
                {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": True, "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR}]], "routes": [{"dst": "0.0.0.0/0"}]}},
                {"type": "portmap", "capabilities": {"portMappings": True}}]}, indent=1))  # fmt: skip

    def _kubelet_command(self, kubelet: Path) -> list[str]:
        root = self.workdir / "kubelet"
        return [
            str(kubelet), "--kubeconfig", str(self.plane.kubeconfig(f"system:node:{self.name}")),
            "--hostname-override", self.name, "--node-ip", self.node_ip, "--address", self.node_ip,
            "--port", str(free_port()), "--read-only-port", "0", "--healthz-port", "0",
            "--root-dir", str(root), "--cert-dir", str(root / "pki"),
            "--volume-plugin-dir", str(self.workdir / "volume-plugins"),
            "--container-runtime", "remote", "--container-runtime-endpoint", f"unix://{self.socket}",
            "--containerd", str(self.socket), "--runtime-request-timeout", "2m",
            "--cgroup-driver", "cgroupfs", "--cgroup-root", self.cgroup_root, "--fail-swap-on=false",
            "--pod-infra-container-image", PAUSE_IMAGE, "--cluster-domain", "cluster.local",
            "--anonymous-auth=false", "--client-ca-file", str(self.plane.kubelet_client_ca),
            "--authorization-mode", "Webhook", "--node-labels", "fleet.test/real-node=true", "--v", "2",
        ]  # fmt: skip

    def _spawn(self, name: str, cmd: list[str], ns: bool = False) -> subprocess.Popen:
        if ns:
            cmd = ["nsenter", "-t", str(self._procs["mountns"].pid), "-m", "--", *cmd]
        with open(self.workdir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)  # fmt: skip
        self._procs[name] = proc
        (self._cgroup_dirs()["pids"] / "daemons" / "cgroup.procs").write_text(f"{proc.pid}\n")
        return proc

    def _wait(self, name: str, ready, deadline: float) -> None:
        """Until ``ready()``; raises `Unavailable` with the log's tail when a process exits or
        ``deadline`` passes."""
        while not ready():
            for which, proc in self._procs.items():
                if proc.poll() is not None:
                    raise Unavailable(f"{which} exited with {proc.returncode} while starting: {self.log(which, 800)!r}")
            if time.monotonic() > deadline:
                raise Unavailable(f"{name} not ready after {self.start_timeout_s:.0f} s: {self.log(name, 800)!r}")
            time.sleep(0.2)

    def _containerd_up(self) -> bool:
        try:
            self.ctr("version", timeout_s=5)
        except Unavailable:
            return False
        return True

    def _node_ready(self) -> bool:
        try:
            node = self.plane.get_json(f"/api/v1/nodes/{self.name}")
        except (urllib.error.URLError, OSError):
            return False
        self.timings_s.setdefault("node_registered_s", round(time.monotonic() - self._started, 1))
        return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))

    # ----- stopping it ----------------------------------------------------------------------------

    def _stop_processes(self) -> None:
        """kube-proxy and the kubelet (SIGTERM, then SIGKILL after 10 s), every process in the
        node's cgroups and every containerd shim of its socket (SIGKILL), containerd, the holder
        of the mount namespace (its mounts go with it)."""
        for name in ("kube-proxy", "kubelet"):
            terminate(self._procs.get(name))
        self._kill_node_processes()
        for name in ("containerd", "mountns"):
            terminate(self._procs.get(name))

    def _kill_node_processes(self) -> None:
        """SIGKILL to every process of `_processes` until none is left (at most 5 s)."""
        for _ in range(50):
            if not (pids := self._processes()):
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
            for proc in self._procs.values():   # reap the node's own children
                proc.poll()

    def _processes(self) -> list[int]:
        """PIDs in the node's cgroups (its daemons, containerd's shims, the containers), and
        containerd shims of its socket."""
        root = self._cgroup_dirs().get("pids")
        pids = [int(p) for cg in (root.rglob("cgroup.procs") if root and root.exists() else ())
                for p in cg.read_text().split()]  # fmt: skip
        for proc in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError):
                cmdline = proc.joinpath("cmdline").read_bytes().split(b"\0")
                if b"containerd-shim" in cmdline[0] and str(self.socket).encode() in cmdline:
                    pids.append(int(proc.name))
        return pids

    def _cgroup_dirs(self) -> dict[str, Path]:
        """``{controller: the node's cgroup root in its hierarchy}``."""
        return {c: Path(mount) / self.cgroup_root.lstrip("/") for c, mount in _cgroup_mounts().items()}

    def _remove_cgroups(self) -> None:
        """The cgroups the kubelet and runc made under the node's root, deepest first."""
        for d in set(self._cgroup_dirs().values()):
            below = [p for p in d.rglob("*") if p.is_dir()] if d.exists() else []
            for sub in [*sorted(below, key=lambda p: -len(p.parts)), d]:
                with contextlib.suppress(OSError):
                    sub.rmdir()

    def _remove_network(self) -> None:
        """The bridge, and the iptables rules and chains of the kubelet, kube-proxy and the
        bridge plugin (`_iptables_ours`), IPv4 and IPv6."""
        if Path(f"/sys/class/net/{BRIDGE}").exists():
            subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True)
        for family in ("iptables", "ip6tables"):
            found = _iptables_ours(family, self._chains_before)   # read once: deleting a rule hides its chain
            for table, what in found:
                if what.startswith("-A "):
                    subprocess.run([family, "-t", table, "-D", *shlex.split(what)[1:]], capture_output=True)
            chains = [(table, what[1:]) for table, what in found if what.startswith(":")]
            for flag in ("-F", "-X"):   # every chain emptied before any is deleted: they jump to each other
                for table, chain in chains:
                    subprocess.run([family, "-t", table, flag, chain], capture_output=True)

    def _restore_sysctls(self) -> None:
        for key, value in self._sysctls.items():
            with contextlib.suppress(OSError):
                Path("/proc/sys", key).write_text(value + "\n")

    def _remove_state(self) -> None:
        """The node's directories: moved aside at once (a rename) and deleted by a detached ``rm``
        that outlives this process, as containerd's root (the unpacked images) takes ~25 s to
        delete on a busy disk and nothing waits for it. ``--one-file-system``: ``rm`` never
        descends into a mount (the node's mounts die with its namespace before this step)."""
        for d in self._made_dirs:
            with contextlib.suppress(OSError):
                d.rmdir()
        self.device_plugin_dir.unlink(missing_ok=True)
        trash = self.workdir / f".removed-{time.time_ns()}"
        for d in ("containerd", "kubelet", "cni", "host", "volume-plugins", "overlay-probe"):
            if (self.workdir / d).exists():
                trash.mkdir(exist_ok=True)
                os.rename(self.workdir / d, trash / d)
        if trash.exists():
            subprocess.Popen(["rm", "-rf", "--one-file-system", str(trash)], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip


# ----- the machine ----------------------------------------------------------------------------------


def _preflight() -> None:
    """Raise `Unavailable` when the machine cannot hold a kubelet 1.20 node: not root, or a
    cgroup v1 controller it needs not mounted (1.20 predates cgroup v2 support)."""
    if os.geteuid() != 0:
        raise Unavailable("a real node needs root (mounts, cgroups, iptables, network namespaces)")
    if missing := [c for c in REQUIRED_CGROUPS if c not in _cgroup_mounts()]:
        raise Unavailable(f"cgroup v1 controllers not mounted: {', '.join(missing)} (kubelet 1.20 needs them)")


def _cgroup_mounts() -> dict[str, str]:
    """``{controller: mount point}`` of the cgroup v1 hierarchies (``name=systemd`` included), and
    ``unified``: the cgroup v2 one of a hybrid machine, where runc makes a container's cgroup too."""
    controllers = {line.split()[0] for line in Path("/proc/cgroups").read_text().splitlines()[1:]}
    mounts = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" - ")
        if len(fields) == 2 and fields[1].split()[0] == "cgroup2":
            mounts["unified"] = fields[0].split()[4]
        elif len(fields) == 2 and fields[1].split()[0] == "cgroup":
            for option in fields[1].split()[2].split(","):
                if option in controllers or option.startswith("name="):
                    mounts[option] = fields[0].split()[4]
    return mounts


def _node_ip() -> str:
    """The IPv4 address of the default route's interface: the kubelet refuses a loopback node IP."""
    out = subprocess.run(["ip", "-4", "-j", "route", "get", "1.1.1.1"], capture_output=True, text=True)   # sends nothing
    routes = json.loads(out.stdout or "[]")
    if not routes or not routes[0].get("prefsrc"):
        raise Unavailable(f"no IPv4 route out of this machine for a node IP: {out.stderr.strip()!r}")
    return routes[0]["prefsrc"]


def _overlay_fails(scratch: Path) -> str | None:
    """Why an overlayfs mount fails here (tried in a throwaway mount namespace), or None."""
    for d in ("lower", "upper", "work", "merged"):
        (scratch / d).mkdir(parents=True, exist_ok=True)
    opts = f"lowerdir={scratch / 'lower'},upperdir={scratch / 'upper'},workdir={scratch / 'work'}"
    proc = subprocess.run(["unshare", "--mount", "mount", "-t", "overlay", "overlay", "-o", opts,
                           str(scratch / "merged")], capture_output=True, text=True)  # fmt: skip
    shutil.rmtree(scratch, ignore_errors=True)
    return None if proc.returncode == 0 else f"mount -t overlay: exit {proc.returncode}: {proc.stderr.strip()}"


def _has_capability(bit: int) -> bool:
    """Whether this process holds the capability numbered ``bit`` (linux/capability.h)."""
    effective = re.search(r"^CapEff:\s*(\S+)", Path("/proc/self/status").read_text(), re.M).group(1)
    return bool(int(effective, 16) >> bit & 1)


def _sysctl(key: str) -> str | None:
    path = Path("/proc/sys", key)
    return path.read_text().strip() if path.exists() else None


def _iptables_ours(family: str, before: frozenset[str] | None = None) -> list[tuple[str, str]]:
    """``(table, "-A CHAIN ...")`` for each rule of a node, then ``(table, ":CHAIN")`` for each
    of its chains: chains ``KUBE-*`` (the kubelet's and kube-proxy's), the bridge plugin's chains
    of `CNI_NETWORK` (jumped to by rules whose comment names it, or, given ``before`` (the
    `_cni_chains` before the node started), any ``CNI-*`` chain not in it: the plugin's teardown
    can leave one empty), any ``CNI-*`` chain jumped to by nothing, portmap's shared
    ``CNI-HOSTPORT-*`` chains once no port mapping is left in them, and every rule jumping to one
    or carrying that comment."""
    found: list[tuple[str, str]] = []
    if shutil.which(f"{family}-save") is None:
        return found
    for table in ("filter", "nat", "mangle"):
        out = subprocess.run([f"{family}-save", "-t", table], capture_output=True, text=True).stdout
        rules = [line for line in out.splitlines() if line.startswith("-A ")]
        ours = {c for c in re.findall(r"^:(\S+)", out, re.M) if c.startswith("KUBE-")}
        tagged = [r for r in rules if f'name: \\"{CNI_NETWORK}\\"' in r or f'name: "{CNI_NETWORK}"' in r]
        ours |= {m.group(1) for r in tagged if (m := re.search(r" -j (CNI-\S+)", r))}
        if before is not None:
            ours |= {c for c in re.findall(r"^:(CNI-\S+)", out, re.M) if f"{family} {table} {c}" not in before}
        chains = set(re.findall(r"^:(\S+)", out, re.M))
        targets = {m.group(1) for r in rules if (m := re.search(r" -[jg] (\S+)", r))}
        ours |= {c for c in chains if c.startswith("CNI-") and c not in targets}   # jumped to by nothing
        mappings = [r for r in rules if r.split()[1] == "CNI-HOSTPORT-DNAT"]
        if "CNI-HOSTPORT-DNAT" in chains and all(r in tagged or r.split()[-1] in ours for r in mappings):
            ours |= {"CNI-HOSTPORT-DNAT", "CNI-HOSTPORT-MASQ", "CNI-HOSTPORT-SETMARK"} & chains
        found += [(table, r) for r in rules if r in tagged or r.split()[1] not in ours and
                  (m := re.search(r" -[jg] (\S+)", r)) and m.group(1) in ours]  # fmt: skip
        found += [(table, f":{c}") for c in sorted(ours)]
    return found


def _cni_chains() -> frozenset[str]:
    """``"FAMILY TABLE CHAIN"`` of every ``CNI-*`` chain on the machine."""
    return frozenset(f"{family} {table} {c}" for family in ("iptables", "ip6tables") if shutil.which(f"{family}-save")
                     for table in ("filter", "nat", "mangle")
                     for c in re.findall(r"^:(CNI-\S+)", subprocess.run([f"{family}-save", "-t", table],
                                         capture_output=True, text=True).stdout, re.M))  # fmt: skip


