"""How the cluster in a box's kubelet configures a container: from the pod spec AS RENDERED to
what fleet/testing/k8s/container.py runs. A TEST STAND-IN (docs/kubernetes.md, "The cluster in a
box").

Owns `PodConfig` (one pod: ``command``/``args`` with ``$(VAR)`` expansion, ``env`` with
``fieldRef``, ``secretKeyRef``, ``configMapKeyRef`` and ``envFrom``, volumes as directories of
this machine, the service-account token, ``securityContext``, devices from the node's device
plugin and its fake NVML), `BoxNode` (one node of the box), `ConfigError` (a container that
cannot be configured yet: CreateContainerConfigError) and `expand`. Called by
`fleet.testing.k8s.podrunner.PodRunner` each time it starts a container; `fleet.testing.k8s.box`
makes the nodes.
"""

from __future__ import annotations

import base64
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from fleet.k8s.client import ApiError
from fleet.testing.k8s.deviceplugin import DevicePlugin
from fleet.testing.k8s.portmap import WildcardPorts
from fleet.testing.k8s.resources import CONFIGMAPS, SECRETS, SERVICE_ACCOUNTS
from fleet.testing.k8s.kubelet_api import KubeletApi

REPO = Path(__file__).resolve().parents[3]
NVML_DRIVER = REPO / "fleet" / "testing" / "nvml_driver"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


class ConfigError(Exception):
    """A container cannot be configured yet (CreateContainerConfigError): a missing Secret key."""


@dataclass
class BoxNode:
    """One node of the box: its name, its root directory (hostPath volumes live under it), its
    fake NVML state file (None: no GPUs) and its device plugin."""

    name: str
    root: Path
    nvml_state: Path | None = None
    plugin: DevicePlugin | None = None
    requested: dict[str, dict[str, str]] = field(default_factory=dict)   # pod -> resource requests

    def host_path(self, path: str) -> Path:
        return self.root / path.lstrip("/")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a defined variable is replaced, ``$$(`` escapes."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text.replace("$$(", "\0")).replace("\0", "$(")


class PodConfig:
    """The configuration of one pod's containers on ``node`` at address ``ip`` (files under
    ``pod_dir``). ``api``: the API server as the node sees it (Secrets, ConfigMaps, ServiceAccounts:
    `fleet.testing.k8s.kubelet_api.KubeletApi`);
    ``token_for(ns, sa)``: the service-account token; ``ca_pem``: the API server's CA;
    ``api_port``: where KUBERNETES_SERVICE_PORT points; ``ports``: the pod's wildcard-bind relays
    (argv rewritten through them)."""

    def __init__(self, pod: dict, *, node: BoxNode, ip: str, pod_dir: Path, api: KubeletApi,
                 token_for: Callable[[str, str], str], ca_pem: bytes, api_port: int,
                 ports: WildcardPorts) -> None:  # fmt: skip
        self.pod = pod
        self.node = node
        self.ip = ip
        self.dir = pod_dir
        self.api = api
        self.token_for = token_for
        self.ca_pem = ca_pem
        self.api_port = api_port
        self.ports = ports
        meta = pod["metadata"]
        self.ns, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.devices: dict[str, list[str]] = {}   # container name -> device ids allocated to it
        self._volumes: dict[str, Path] | None = None

    def _field(self, path: str) -> str:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        simple = {"metadata.name": meta["name"], "metadata.namespace": self.ns, "metadata.uid": self.uid,
                  "spec.nodeName": spec.get("nodeName", ""), "spec.serviceAccountName":
                  spec.get("serviceAccountName", "default"), "status.podIP": self.ip, "status.hostIP": "127.0.0.1"}
        if path in simple:
            return simple[path]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return (meta.get(m.group(1)) or {}).get(m.group(2), "")
        raise ConfigError(f"fieldRef {path}: not supported")

    def _key_ref(self, res, ref: dict) -> str | None:
        try:
            obj = self.api.get(res, self.ns, ref["name"])
        except ApiError:
            if ref.get("optional"):
                return None
            raise ConfigError(f'{res.kind.lower()} "{ref["name"]}" not found') from None
        if res is SECRETS:
            data = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
            data.update(obj.get("stringData") or {})
        else:
            data = dict(obj.get("data") or {})
        if ref["key"] not in data:
            if ref.get("optional"):
                return None
            raise ConfigError(f'couldn\'t find key {ref["key"]} in {res.kind} {self.ns}/{ref["name"]}')
        return data[ref["key"]]

    def _env(self, c: dict) -> dict[str, str]:
        env: dict[str, str] = {}
        for src in c.get("envFrom") or []:
            for res, key in ((SECRETS, "secretRef"), (CONFIGMAPS, "configMapRef")):
                if key in src:
                    obj = self.api.get(res, self.ns, src[key]["name"])
                    data = obj.get("data") or {}
                    env.update({src.get("prefix", "") + k: base64.b64decode(v).decode() if res is SECRETS else v
                                for k, v in data.items()})  # fmt: skip
        for e in c.get("env") or []:
            if "value" in e:
                env[e["name"]] = expand(str(e["value"]), env)
            elif "valueFrom" in e:
                vf = e["valueFrom"]
                if "fieldRef" in vf:
                    env[e["name"]] = self._field(vf["fieldRef"]["fieldPath"])
                elif "secretKeyRef" in vf:
                    v = self._key_ref(SECRETS, vf["secretKeyRef"])
                    if v is not None:
                        env[e["name"]] = v
                elif "configMapKeyRef" in vf:
                    v = self._key_ref(CONFIGMAPS, vf["configMapKeyRef"])
                    if v is not None:
                        env[e["name"]] = v
                elif "resourceFieldRef" in vf:
                    env[e["name"]] = "0"
            else:
                env[e["name"]] = ""
        return env

    def _security(self, c: dict) -> tuple[int, int, list[int], bool]:
        pod_sc = self.pod["spec"].get("securityContext") or {}
        sc = c.get("securityContext") or {}
        uid = sc.get("runAsUser", pod_sc.get("runAsUser", 0))
        gid = sc.get("runAsGroup", pod_sc.get("runAsGroup", uid if uid else 0))
        groups = [g for g in (pod_sc.get("fsGroup"), *(pod_sc.get("supplementalGroups") or [])) if g is not None]
        if (sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))) and uid == 0:
            raise ConfigError("container has runAsNonRoot and image will run as root")
        return int(uid), int(gid), [int(g) for g in groups], bool(sc.get("readOnlyRootFilesystem"))

    def _volume_dirs(self) -> dict[str, Path]:
        """Each volume of the pod as a directory (or file) on this machine; made once per pod."""
        if self._volumes is not None:
            return self._volumes
        spec = self.pod["spec"]
        fs_group = (spec.get("securityContext") or {}).get("fsGroup")
        out: dict[str, Path] = {}
        for v in spec.get("volumes") or []:
            name = v["name"]
            if "hostPath" in v:
                hp = v["hostPath"]
                path = self.node.host_path(hp["path"])
                kind = hp.get("type", "")
                if kind == "DirectoryOrCreate" and not path.exists():
                    path.mkdir(parents=True, mode=0o755)
                    os.chmod(path, 0o755)
                elif kind in ("Directory", "File", "Socket") and not path.exists():
                    raise ConfigError(f"MountVolume.SetUp failed for volume {name!r}: hostPath type check failed: "
                                      f"{hp['path']} is not a directory")
                elif not path.exists():
                    path.mkdir(parents=True)
                out[name] = path
            elif "emptyDir" in v:
                path = self.dir / "volumes" / name
                path.mkdir(parents=True, exist_ok=True)
                os.chmod(path, 0o777)
                out[name] = path
            elif "secret" in v or "configMap" in v:
                res, src = (SECRETS, v["secret"]) if "secret" in v else (CONFIGMAPS, v["configMap"])
                ref_name = src.get("secretName") or src.get("name")
                path = self.dir / "volumes" / name
                path.mkdir(parents=True, exist_ok=True)
                try:
                    obj = self.api.get(res, self.ns, ref_name)
                except ApiError:
                    if src.get("optional"):
                        obj = {}
                    else:
                        raise ConfigError(f'{res.kind.lower()} "{ref_name}" not found') from None
                mode = src.get("defaultMode", 0o644)
                for k, val in (obj.get("data") or {}).items():
                    f = path / k
                    f.write_bytes(base64.b64decode(val) if res is SECRETS else val.encode())
                    os.chmod(f, mode)
                    if fs_group is not None:
                        os.chown(f, 0, fs_group)
                out[name] = path
            elif "projected" in v or "downwardAPI" in v:
                path = self.dir / "volumes" / name
                path.mkdir(parents=True, exist_ok=True)
                out[name] = path
            if fs_group is not None and name in out and "hostPath" not in v:
                os.chown(out[name], 0, fs_group)
                os.chmod(out[name], os.stat(out[name]).st_mode | 0o2070)
        self._volumes = out
        return out

    def _service_account_dir(self, c: dict) -> Path | None:
        """The token directory this kubelet makes, unless the pod opts out or a volume is mounted
        there already (on a real 1.20 API server the ServiceAccount admission plugin adds the
        token Secret's volume and its mount to every container)."""
        spec = self.pod["spec"]
        sa = spec.get("serviceAccountName") or "default"
        if spec.get("automountServiceAccountToken") is False:
            return None
        if any(m.get("mountPath", "").rstrip("/") == SA_DIR for m in c.get("volumeMounts") or []):
            return None
        try:
            sa_obj = self.api.get(SERVICE_ACCOUNTS, self.ns, sa)
        except ApiError:
            if sa != "default":
                raise ConfigError(f'serviceaccount "{sa}" not found') from None
            sa_obj = {}
        if sa_obj.get("automountServiceAccountToken") is False and spec.get("automountServiceAccountToken") is None:
            return None
        path = self.dir / "serviceaccount"
        if not path.exists():
            path.mkdir(parents=True)
            (path / "token").write_text(self.token_for(self.ns, sa))
            (path / "ca.crt").write_bytes(self.ca_pem)
            (path / "namespace").write_text(self.ns)
            for f in path.iterdir():
                os.chmod(f, 0o644)
        return path

    def _argv(self, c: dict, env: dict[str, str]) -> list[str]:
        command = list(c.get("command") or ["fleet"])   # Fleet's image: ENTRYPOINT ["fleet"]
        args = list(c.get("args") or ([] if c.get("command") else ["--help"]))
        argv = [expand(a, env) for a in command + args]
        if argv[0] == "fleet":
            argv = [sys.executable, "-m", "fleet", *argv[1:]]
        elif argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        elif argv[0] == "vllm":
            raise ConfigError("the cluster in a box runs Fleet's image only (engine.kind: sim); vllm is not in it")
        argv = [self.ip if a == "0.0.0.0" else re.sub(r"=0\.0\.0\.0$", "=" + self.ip, a) for a in argv]
        return self.ports.rewrite(argv)

    def container_spec(self, name: str, spec: dict) -> dict:
        """What fleet.testing.k8s.container runs for container ``name`` of spec ``spec``: argv, env,
        mounts, user and groups, read-only root, working directory. Devices of the node's plugin are
        allocated on the first call for ``name``. Raises ConfigError (CreateContainerConfigError)."""
        uid, gid, groups, ro_root = self._security(spec)
        env = self._env(spec)
        volumes = self._volume_dirs()
        mounts = []
        for m in spec.get("volumeMounts") or []:
            if m["name"] not in volumes:
                raise ConfigError(f"volume {m['name']!r} not found")
            source = volumes[m["name"]] / m["subPath"] if m.get("subPath") else volumes[m["name"]]
            mounts.append({"source": str(source), "target": m["mountPath"], "readOnly": bool(m.get("readOnly"))})
        sa = self._service_account_dir(spec)
        if sa is not None:
            mounts.append({"source": str(sa), "target": SA_DIR, "readOnly": True})
        base_env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOSTNAME": self.name,
                    "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO),
                    "HOME": "/nonexistent", "KUBERNETES_SERVICE_HOST": "127.0.0.1",
                    "KUBERNETES_SERVICE_PORT": str(self.api_port)}  # fmt: skip
        resources = spec.get("resources") or {}
        wanted = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
        gpu = {k: int(v) for k, v in wanted.items() if k.startswith("nvidia.com/")}
        if gpu and self.node.plugin is not None:
            ids = self.devices.get(name)
            if ids is None:
                ids = []
                for res, n in sorted(gpu.items()):
                    got = self.node.plugin.allocate(self.uid, name, res, n, pod=(self.ns, self.name))
                    if got is None:
                        raise ConfigError(f"UnexpectedAdmissionError: allocate failed due to requested number of "
                                          f"devices unavailable for {res}. Requested: {n}")
                    ids += got
                self.devices[name] = ids
            env["NVIDIA_VISIBLE_DEVICES"] = ",".join(ids)
        elif gpu:
            raise ConfigError(f"node {self.node.name} has no {', '.join(gpu)}")
        # The NVIDIA runtime: asked for by name, or the GPU node's default (the GPU Operator makes it
        # containerd's default_runtime_name), which reads the container's NVIDIA_VISIBLE_DEVICES.
        runtime = self.pod["spec"].get("runtimeClassName")
        gpu_runtime = bool(gpu) or runtime == "nvidia" or (not runtime and "NVIDIA_VISIBLE_DEVICES" in env)
        if gpu_runtime and self.node.nvml_state is not None:
            base_env["PYTHONPATH"] = f"{NVML_DRIVER}:{REPO}"
            base_env["FLEET_FAKE_NVML"] = "/run/fleet-fake-nvml/state.json"
            mounts.append({"source": str(self.node.nvml_state.parent), "target": "/run/fleet-fake-nvml",
                           "readOnly": True})
        full_env = {**base_env, **env}
        image = sorted({sys.base_prefix, sys.prefix, str(REPO)})
        return {"argv": self._argv(spec, full_env), "env": full_env, "mounts": mounts, "uid": uid, "gid": gid,
                "imagePaths": image,
                "groups": groups, "readOnlyRoot": ro_root, "cwd": spec.get("workingDir") or "/"}  # fmt: skip
