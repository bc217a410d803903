"""A kubelet for the cluster in a box: runs each pod bound to its nodes from the pod spec AS
RENDERED, its containers as local processes. A TEST STAND-IN (no container runtime, no pod
network: docs/kubernetes.md, "The cluster in a box").

Owns `BoxKubelet` (watches pods, one `PodRunner` per pod bound to a node of the box) and
`PodRunner` (a pod's life: images, init containers, containers with their restart policy,
probes, status, deletion). How each container is configured from its spec (env, volumes,
security context, devices) is `fleet.testing.k8s.podconfig.PodConfig`'s. Called by
`fleet.testing.k8s.box` (the cluster in a box).

What it honours, as a kubelet does:
- images: pulled first (`fleet.testing.k8s.kubelet.ImagePuller`); every image runs the
  repository's code (Fleet's image): ``fleet`` (its ENTRYPOINT) and ``python`` map to this
  interpreter; ``sh``/``bash`` and coreutils are the machine's;
- ``command``/``args`` with ``$(VAR)`` expansion; ``env`` values, ``fieldRef`` (metadata.name,
  namespace, uid, labels/annotations, spec.nodeName, spec.serviceAccountName, status.podIP,
  status.hostIP), ``secretKeyRef`` / ``configMapKeyRef`` (a missing one: the container waits in
  CreateContainerConfigError and is retried), ``envFrom``;
- volumes, each bind-mounted at its ``mountPath`` in the container's own mount namespace
  (`fleet.testing.k8s.container`): hostPath (a per-node directory standing for the node's root;
  ``DirectoryOrCreate`` creates it root-owned 0755 as the kubelet does, ``Directory`` must exist),
  emptyDir, Secret, ConfigMap, and the service-account token (``token``, ``ca.crt``,
  ``namespace`` at /var/run/secrets/kubernetes.io/serviceaccount) unless
  ``automountServiceAccountToken`` is false;
- ``securityContext``: runAsUser / runAsGroup / fsGroup (volumes the kubelet makes get the group),
  readOnlyRootFilesystem; the process runs as that user;
- init containers in order, each to success; then the containers; ``restartPolicy`` (Always,
  OnFailure, Never) with a back-off; startup, readiness and liveness probes (httpGet) at the
  pod's address, their periods scaled by ``probe_scale``; the Ready condition;
- resources: requests and limits are recorded per node (``requested``); extended resources
  ``nvidia.com/gpu`` and ``nvidia.com/mig-*`` are allocated by the node's device plugin
  (`fleet.testing.k8s.deviceplugin.DevicePlugin`), which sets NVIDIA_VISIBLE_DEVICES; a container
  with devices, of a pod of runtime class ``nvidia``, or with NVIDIA_VISIBLE_DEVICES and no runtime
  class (a GPU node's default runtime is NVIDIA's, as the GPU Operator sets it) also gets the
  node's fake NVML (the NVIDIA container runtime's part: `fleet/testing/nvml_driver` on
  PYTHONPATH, FLEET_FAKE_NVML);
- deletion: SIGTERM, SIGKILL after the grace period, devices released, the pod removed.

Deviations, because there is no pod network: each pod gets its own loopback address
(127.0.x.y) and an argument ``0.0.0.0`` (alone or after ``=``) is replaced by it; a ZMQ wildcard
bind ``tcp://*:P`` gets a free host port and a relay from the pod's address, port P
(`fleet.testing.k8s.portmap`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from fleet.k8s.client import PODS, ApiError
from fleet.testing.k8s.kubelet import ImagePuller
from fleet.testing.k8s.podconfig import REPO, BoxNode, ConfigError, PodConfig
from fleet.testing.k8s.portmap import WildcardPorts
from fleet.testing.k8s.kubelet_api import KubeletApi
from fleet.testing.k8s.store import now_iso

log = logging.getLogger("fleet.testing.kubelet")


@dataclass
class _Container:
    name: str
    spec: dict
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    ready: bool = False
    started: bool = False
    last_exit: int | None = None
    waiting: str | None = None
    log_path: Path | None = None
    live_failures: int = 0


class PodRunner:
    """One pod on one node: from Pending to gone (see the module docstring)."""

    def __init__(self, kubelet: BoxKubelet, node: BoxNode, pod: dict, ip: str) -> None:
        self.kubelet = kubelet
        self.node = node
        self.pod = pod
        self.ip = ip
        self.ports = WildcardPorts(ip)
        meta = pod["metadata"]
        self.ns, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.dir = kubelet.work / "pods" / f"{self.ns}_{self.name}_{self.uid[:8]}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.containers = [_Container(c["name"], c) for c in pod["spec"]["containers"]]
        self.init_done: list[dict] = []
        self.deleting = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.api = kubelet.api.for_node(node.name)
        self.config = PodConfig(pod, node=node, ip=ip, pod_dir=self.dir, api=self.api,
                                token_for=kubelet.token_for, ca_pem=kubelet.ca_pem, api_port=kubelet.api_port,
                                ports=self.ports)  # fmt: skip
        self.phase = "Pending"
        self.restarts: set[asyncio.Task] = set()   # containers' restarts waiting out their back-off

    # ----- status -------------------------------------------------------------------------------

    def _status(self, patch: dict) -> None:
        try:
            self.api.patch_status(PODS, self.ns, self.name, {"status": patch})
        except ApiError:
            pass

    def _container_statuses(self) -> list[dict]:
        out = []
        for c in self.containers:
            if c.proc is not None and c.proc.returncode is None:
                state = {"running": {"startedAt": now_iso()}}
            elif c.last_exit is not None:
                state = {"terminated": {"exitCode": c.last_exit, "reason": "Completed" if c.last_exit == 0 else "Error"}}
            else:
                state = {"waiting": {"reason": c.waiting or "ContainerCreating"}}
            out.append({"name": c.name, "ready": c.ready, "started": c.started, "restartCount": c.restarts,
                        "image": c.spec["image"], "imageID": "sha256:" + c.spec["image"].encode().hex()[:32],
                        "state": state})  # fmt: skip
        return out

    def _report(self) -> None:
        ready = all(c.ready for c in self.containers)
        self._status({"phase": self.phase, "podIP": self.ip, "hostIP": "127.0.0.1",
                      "conditions": [{"type": "Ready", "status": "True" if ready else "False"},
                                     {"type": "ContainersReady", "status": "True" if ready else "False"},
                                     {"type": "Initialized", "status": "True" if len(self.init_done) ==
                                      len(self.pod["spec"].get("initContainers") or []) else "False"},
                                     {"type": "PodScheduled", "status": "True"}],   # bound here, so scheduled
                      "containerStatuses": self._container_statuses(),
                      "initContainerStatuses": self.init_done})  # fmt: skip

    # ----- the pod's life -----------------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            for t in self.restarts:   # a restart due after the kubelet stops must not start a process
                t.cancel()
            await self._kill_all(0)
            raise
        except Exception:
            log.exception("pod %s/%s", self.ns, self.name)
            raise
        finally:
            await self.ports.close()
            if self.node.plugin is not None:
                self.node.plugin.release(self.uid)
            self.node.requested.pop(self.name, None)

    async def _run(self) -> None:
        while True:   # images first
            if self.deleting.is_set():
                return await self._finish()
            try:
                pulled = self.kubelet.puller.sync(self.api, self.ns, self.name)
            except ApiError:
                return
            if pulled == "pulled":
                break
            await self._wait(0.2)
        self.node.requested[self.name] = {k: v for c in self.pod["spec"]["containers"]
                                          for k, v in ((c.get("resources") or {}).get("requests") or {}).items()}
        spec = self.pod["spec"]
        policy = spec.get("restartPolicy", "Always")
        for ic in spec.get("initContainers") or []:
            c = _Container(ic["name"], ic)
            backoff = 0.5
            while True:
                if self.deleting.is_set():
                    return await self._finish()
                code = await self._run_to_end(c)
                if code == 0:
                    break
                if policy == "Never":
                    self.phase = "Failed"
                    self.init_done.append(self._terminated(c, code))
                    self._report()
                    return await self._until_deleted()
                c.restarts += 1
                await self._wait(backoff)
                backoff = min(backoff * 2, 5.0)
            self.init_done.append(self._terminated(c, 0))
        self.phase = "Running"
        for c in self.containers:
            await self._start(c)
        self._report()
        probes = [asyncio.create_task(self._probe(c)) for c in self.containers]
        try:
            await self._supervise(policy)
        finally:
            for p in probes:
                p.cancel()

    @staticmethod
    def _terminated(c: _Container, code: int) -> dict:
        return {"name": c.name, "ready": code == 0, "restartCount": c.restarts, "image": c.spec["image"],
                "imageID": "sha256:0", "state": {"terminated": {"exitCode": code,
                                                               "reason": "Completed" if code == 0 else "Error"}}}

    async def _wait(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.deleting.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    async def _until_deleted(self) -> None:
        await self.deleting.wait()
        await self._finish()

    async def _supervise(self, policy: str) -> None:
        backoff: dict[str, float] = {}
        while True:
            if self.deleting.is_set():
                await self._kill_all(self._grace())
                return await self._finish()
            changed = False
            for c in self.containers:
                if c.proc is not None and c.proc.returncode is not None and c.last_exit is None:
                    code = c.proc.returncode
                    c.last_exit = code if code >= 0 else 128 - code
                    c.ready = False
                    changed = True
                    restart = policy == "Always" or (policy == "OnFailure" and c.last_exit != 0)
                    if restart:
                        wait = backoff.get(c.name, 0.5)
                        backoff[c.name] = min(wait * 2, 5.0)
                        self.restarts.add(asyncio.create_task(self._restart_later(c, wait)))
            if changed:
                exited = [c.last_exit for c in self.containers if c.proc is not None and c.proc.returncode is not None]
                if len(exited) == len(self.containers) and (policy == "Never" or (policy == "OnFailure" and
                                                                                  not any(exited))):
                    self.phase = "Succeeded" if not any(exited) else "Failed"
                self._report()
                if self.phase in ("Succeeded", "Failed"):
                    return await self._until_deleted()
            await self._wait(0.1)

    async def _restart_later(self, c: _Container, wait_s: float) -> None:
        try:
            await self._wait(wait_s)
            if self.deleting.is_set():
                return
            c.restarts += 1
            exited = c.proc
            await self._start(c)
            if c.proc is not exited:   # only now: `_supervise` takes an exited proc without last_exit as a new exit
                c.last_exit = None
            self._report()
        finally:
            self.restarts.discard(asyncio.current_task())

    def _grace(self) -> float:
        try:
            meta = self.api.get(PODS, self.ns, self.name).get("metadata", {})
        except ApiError:
            meta = {}
        return float(meta.get("deletionGracePeriodSeconds", self.pod["spec"].get("terminationGracePeriodSeconds", 30)))

    async def _kill_all(self, grace_s: float) -> None:
        live = [c.proc for c in self.containers if c.proc is not None and c.proc.returncode is None]
        for p in live:
            try:
                os.killpg(p.pid, signal.SIGKILL if grace_s == 0 else signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        for p in live:
            try:
                await asyncio.wait_for(p.wait(), max(0.01, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await p.wait()

    async def _finish(self) -> None:
        for t in list(self.restarts):
            t.cancel()
        await self._kill_all(0)
        logs = "".join(c.log_path.read_text(errors="replace") for c in self.containers if c.log_path)
        self.api.save_logs(self.ns, self.name, logs)
        try:
            self.api.finish_delete(PODS, self.ns, self.name)
        except ApiError as err:
            log.warning("pod %s/%s: the final delete was refused: %s", self.ns, self.name, err)

    # ----- one container ------------------------------------------------------------------------

    async def _run_to_end(self, c: _Container) -> int:
        await self._start(c)
        if c.proc is None:   # deleted while it could not be configured
            return 1
        code = await c.proc.wait()
        return code if code >= 0 else 128 - code

    async def _start(self, c: _Container) -> None:
        while True:
            try:
                spec = self.config.container_spec(c.name, c.spec)
                break
            except ConfigError as err:
                c.waiting = "CreateContainerConfigError"
                self._status({"containerStatuses": [{"name": c.name, "ready": False, "restartCount": c.restarts,
                                                     "image": c.spec["image"], "imageID": "",
                                                     "state": {"waiting": {"reason": "CreateContainerConfigError",
                                                                           "message": str(err)}}}]})  # fmt: skip
                await self._wait(0.5)
                if self.deleting.is_set():
                    return
        await self.ports.serve()
        spec_path = self.dir / f"{c.name}.json"
        spec_path.write_text(json.dumps(spec))
        c.log_path = self.dir / f"{c.name}.log"
        out = open(c.log_path, "ab")
        c.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fleet.testing.k8s.container", str(spec_path), stdout=out,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True, env={"PATH": os.environ["PATH"],
                                                                          "PYTHONPATH": str(REPO)})  # fmt: skip
        out.close()
        c.waiting = None
        c.ready = False
        c.started = False
        self.kubelet.started += 1

    # ----- probes -------------------------------------------------------------------------------

    def _port(self, c: dict, port: Any) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in c.get("ports") or []:
            if p.get("name") == port:
                return int(p["containerPort"])
        raise ValueError(f"container {c['name']}: no port named {port!r}")

    async def _check(self, http: aiohttp.ClientSession, c: dict, probe: dict) -> bool:
        get = probe.get("httpGet")
        if get is None:
            return True
        url = f"http://{self.ip}:{self._port(c, get['port'])}{get.get('path', '/')}"
        try:
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=probe.get("timeoutSeconds", 1) + 1)) as r:
                return 200 <= r.status < 400
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _probe(self, c: _Container) -> None:
        spec, scale = c.spec, self.kubelet.probe_scale
        async with aiohttp.ClientSession() as http:
            while True:
                proc = c.proc
                if proc is None or proc.returncode is not None:
                    c.started = c.ready = False
                    await asyncio.sleep(0.1)
                    continue
                startup = spec.get("startupProbe")
                if not c.started:
                    if startup and not await self._check(http, spec, startup):
                        await asyncio.sleep(startup.get("periodSeconds", 10) * scale)
                        continue
                    c.started = True
                    self._report()
                readiness = spec.get("readinessProbe")
                ready = await self._check(http, spec, readiness) if readiness else True
                if ready != c.ready and proc.returncode is None:
                    c.ready = ready
                    self._report()
                liveness = spec.get("livenessProbe")
                if liveness and not await self._check(http, spec, liveness):
                    c.live_failures += 1
                    if c.live_failures >= liveness.get("failureThreshold", 3) and proc.returncode is None:
                        log.warning("pod %s container %s: liveness failed; killed", self.name, c.name)
                        os.killpg(proc.pid, signal.SIGKILL)
                        c.live_failures = 0
                else:
                    c.live_failures = 0
                period = min((readiness or {}).get("periodSeconds", 10), (liveness or {}).get("periodSeconds", 10))
                await asyncio.sleep(period * scale)


class BoxKubelet:
    """The kubelet of every node of the box, or of hollow nodes on a real control plane (see the
    module docstring): watches pods, runs those bound to its nodes. ``api``: the API server as
    the nodes see it (`fleet.testing.k8s.kubelet_api`: the box's store, or a real API server with
    each node's identity); ``token_for(ns, sa)``: the service-account token a pod gets when its
    spec mounts none (the real ServiceAccount admission plugin of 1.20 adds the token Secret's
    volume itself); ``ca_pem``: the API server's CA; ``api_port``: where KUBERNETES_SERVICE_PORT
    points; ``pod_subnet``: the first two octets of pod addresses (``127.0``: loopback; a real
    API server refuses loopback Endpoints, so hollow nodes use a range bound on ``lo``:
    fleet/testing/k8s/hollow.py)."""

    def __init__(self, api: KubeletApi, nodes: dict[str, BoxNode], work: Path, *, token_for, ca_pem: bytes,
                 api_port: int, puller: ImagePuller | None = None, probe_scale: float = 0.2,
                 pod_subnet: str = "127.0") -> None:  # fmt: skip
        self.api = api
        self.pod_subnet = pod_subnet
        self.nodes = nodes
        self.work = work
        self.token_for = token_for
        self.ca_pem = ca_pem
        self.api_port = api_port
        self.puller = puller or ImagePuller()
        self.probe_scale = probe_scale
        self.runners: dict[str, PodRunner] = {}   # pod uid -> runner
        self.started = 0
        self._ip = 0
        self._task: asyncio.Task | None = None

    def _next_ip(self) -> str:
        self._ip += 1
        return f"{self.pod_subnet}.{1 + self._ip // 250}.{2 + self._ip % 250}"

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for r in list(self.runners.values()):
            if r.task is not None:
                r.task.cancel()
        await asyncio.gather(*(r.task for r in self.runners.values() if r.task), return_exceptions=True)

    def runner(self, ns: str, name: str) -> PodRunner | None:
        return next((r for r in self.runners.values() if r.ns == ns and r.name == name and not r.deleting.is_set()),
                    None)

    def processes(self, ns: str, name: str) -> dict[str, int]:
        """Container name -> PID of the pod's live containers (for kill -9 in tests)."""
        r = self.runner(ns, name)
        return {c.name: c.proc.pid for c in (r.containers if r else []) if c.proc and c.proc.returncode is None}

    async def _watch(self) -> None:
        async for type_, pod in self.api.pod_events(self.nodes):
            self._sync(type_, pod)

    def _sync(self, type_: str, pod: dict) -> None:
        meta = pod["metadata"]
        node = self.nodes.get((pod.get("spec") or {}).get("nodeName") or "")
        if node is None:
            return
        r = self.runners.get(meta["uid"])
        if type_ == "DELETED":
            if r is not None and r.task is not None and not r.task.done():
                r.deleting.set()
            return
        if r is None:
            if meta.get("deletionTimestamp"):
                self.api.for_node(node.name).finish_delete(PODS, meta["namespace"], meta["name"])
                return
            r = PodRunner(self, node, pod, self._next_ip())
            self.runners[meta["uid"]] = r
            r.task = asyncio.get_running_loop().create_task(r.run(), name=f"pod-{meta['name']}")
        elif meta.get("deletionTimestamp"):
            r.deleting.set()
