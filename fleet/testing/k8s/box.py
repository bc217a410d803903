"""The cluster in a box: Fleet's Helm chart AS RENDERED, running on stand-in nodes. A TEST
STAND-IN for a Kubernetes cluster (none can run on the project's machines: docs/kubernetes.md,
"The cluster in a box"), as real as a root shell on one Linux machine allows.

`ClusterInABox` holds:
- the API server stand-in (fleet/testing/k8s/apiserver.py) over HTTPS with its own CA, enforcing
  RBAC per service account (fleet/testing/k8s/rbac.py): the chart's Roles decide what each
  component may do, and every refusal is kept (``denied``);
- the controllers and scheduler (fleet/testing/k8s/workloads.py), and the endpoints controller
  (fleet/testing/k8s/endpoints.py);
- one kubelet for all nodes (fleet/testing/k8s/podrunner.py): each pod's containers run as local
  processes in their own mount namespace, as their securityContext's user, with their volumes
  (hostPath under the node's own root directory), env, Secrets, service-account token (the real
  in-cluster configuration path of the ``kubernetes`` client), probes and restart policy;
- per GPU node, a fake NVML state file (what the node's ``pynvml`` stand-in,
  fleet/testing/nvml_driver, reads), a device plugin (fleet/testing/k8s/deviceplugin.py) and the
  kubelet's PodResources socket answering from it (fleet/testing/k8s/podresources.py).

`NODE_SHAPES` is the box's shape: a CPU node, an 8xH100 SXM node (NVSwitch: one NVLink domain), a node
of four H100 NVL cards in two NVLink-bridged pairs joined by PCIe, and an H100 cut into MIG
instances. Node objects carry the labels NVIDIA GPU Feature Discovery writes, the capacity the
device plugin advertises and, on GPU nodes, the ``nvidia.com/gpu`` NoSchedule taint of GPU node
pools; nothing Fleet's node agent publishes (the agent must).

`helm_install(values)` renders the chart (``helm template``) and creates every object as an
admin would (``kubectl apply``); `helm_uninstall` deletes them (the CRD stays, as its
``helm.sh/resource-policy: keep`` says).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import ipaddress
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fleet.inventory.gfd import image_aliases
from fleet.k8s.client import CRDS, NODES, ApiError, KubeClient, Resource
from fleet.testing.fake_nvml import inject_xid, write_state
from fleet.testing.k8s.apiserver import APIServerStandIn
from fleet.testing.k8s.deviceplugin import DevicePlugin
from fleet.testing.k8s.endpoints import EndpointsController
from fleet.testing.k8s.kubelet import ImagePuller
from fleet.testing.k8s.podconfig import REPO, BoxNode
from fleet.testing.k8s.kubelet_api import StoreKubeletApi
from fleet.testing.k8s.podresources import PodResourcesServer, serve_pod_resources
from fleet.testing.k8s.podrunner import BoxKubelet
from fleet.testing.k8s.rbac import ADMIN, Authorizer
from fleet.testing.k8s.resources import by_kind
from fleet.testing.k8s.store import ObjectStore
from fleet.testing.k8s.workloads import Workloads

H100_SXM = "NVIDIA H100 80GB HBM3"
H100_NVL = "NVIDIA H100 NVL"


def _device(index: int, name: str, memory_mib: int, nvlinks: Any, mig: list | None = None) -> dict:
    from fleet.testing.fake_nvml import device

    return device(index, name, memory_mib, nvlinks=nvlinks, mig_instances=mig,
                  uuid=f"GPU-{name.split()[-1].lower()}{index:03d}-0000-0000-0000-000000000000")


def _bus(i: int) -> str:
    return f"00000000:{0x10 + i:02x}:00.0"


def sxm8() -> dict:
    switches = [f"00000000:{0xa0 + s:02x}:00.0" for s in range(4)]
    return {"driver_version": "580.159.04", "devices": [
        _device(i, H100_SXM, 81559, [{"link": link, "remote_type": "switch", "remote_pci_bus_id": switches[link % 4]}
                                     for link in range(18)]) for i in range(8)]}  # fmt: skip


def nvl_pairs4() -> dict:
    """Four H100 NVL cards: 0-1 and 2-3 joined by NVLink bridges, the pairs by PCIe only."""
    return {"driver_version": "580.159.04", "devices": [
        _device(i, H100_NVL, 95830, [{"link": n, "remote_type": "gpu", "remote_pci_bus_id": _bus(i ^ 1)}
                                     for n in range(3)]) for i in range(4)]}  # fmt: skip


def mig1() -> dict:
    """One H100 SXM in MIG mode: two 3g.40gb instances."""
    mig = [{"uuid": f"MIG-h100mig-0-{j}", "name": f"{H100_SXM} MIG 3g.40gb", "gi_id": j + 1, "start": start}
           for j, start in enumerate((0, 4))]
    return {"driver_version": "580.159.04", "devices": [_device(0, H100_SXM, 81559, {"error": "Not Supported"}, mig)]}


@dataclass(frozen=True)
class NodeShape:
    name: str
    cpu: int
    snapshot: dict | None = None
    mig_strategy: str = "none"


NODE_SHAPES = (
    NodeShape("cpu-1", 16),
    NodeShape("sxm-8", 64, sxm8()),
    NodeShape("nvl-4", 32, nvl_pairs4()),
    NodeShape("mig-1", 16, mig1(), "mixed"),
)


def prepare_node(shape: NodeShape, root: Path) -> BoxNode:
    """Node ``shape``'s machine under ``root``: on a GPU shape, its fake NVML state file (what the
    node's ``pynvml`` stand-in reads) and its device plugin."""
    root.mkdir(parents=True, exist_ok=True)
    node = BoxNode(shape.name, root)
    if shape.snapshot is not None:
        node.nvml_state = root / "run" / "nvidia" / "state.json"
        node.nvml_state.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(node.nvml_state.parent, 0o755)
        write_state(node.nvml_state, copy.deepcopy(shape.snapshot))
        node.plugin = DevicePlugin(shape.name, node.nvml_state, root)
    return node


def node_object(shape: NodeShape, plugin: DevicePlugin | None) -> dict:
    """The Node as the kubelet registers it and GPU Feature Discovery labels it."""
    labels = {"kubernetes.io/hostname": shape.name, "kubernetes.io/os": "linux"}
    capacity = {"cpu": str(shape.cpu), "memory": "256Gi", "pods": "110"}
    if shape.snapshot and plugin is not None:
        dev = shape.snapshot["devices"]
        labels.update({"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": dev[0]["name"].replace(" ", "-"),
                       "nvidia.com/gpu.count": str(len(dev)), "nvidia.com/gpu.memory": str(dev[0]["memory_total_mib"]),
                       "nvidia.com/mig.strategy": shape.mig_strategy})  # fmt: skip
        for res, ids in plugin.resources().items():
            capacity[res] = str(len(ids))
            if res.startswith("nvidia.com/mig-"):
                labels[f"{res}.count"] = str(len(ids))
    taints = [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}] if shape.snapshot else []
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": shape.name, "labels": labels},
            "spec": {"taints": taints}, "status": {"capacity": dict(capacity), "allocatable": dict(capacity),
                                   "conditions": [{"type": "Ready", "status": "True"}]}}  # fmt: skip


def _certs(where: Path) -> tuple[Path, Path, bytes]:
    """A CA and a serving certificate for 127.0.0.1 (the cluster's "kubernetes" Service address)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "box-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("kubernetes.default.svc")]), critical=False)
            .sign(ca_key, hashes.SHA256()))  # fmt: skip
    where.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = where / "apiserver.crt", where / "apiserver.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path, ca.public_bytes(serialization.Encoding.PEM)


class ClusterInABox:
    """See the module docstring. ``work``: a directory of its own (node roots, pod logs)."""

    def __init__(self, work: Path, image: str = "ghcr.io/inference-fleet/fleet:0.1.0") -> None:
        self.work = work
        self.image = image
        self.store = ObjectStore()
        self.authorizer = Authorizer(self.store)
        self.api = APIServerStandIn(self.store, authorizer=self.authorizer)
        self.admin_token = self.authorizer.issue_token(ADMIN)
        self.nodes: dict[str, BoxNode] = {}
        self.workloads = Workloads(self.store)
        self.kubelet: BoxKubelet | None = None
        self.kube: KubeClient | None = None
        self.rendered: list[dict] = []
        self.pod_resources: dict[str, PodResourcesServer] = {}   # GPU node -> its kubelet's PodResources
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    @property
    def denied(self) -> list[str]:
        return self.authorizer.denied

    async def start(self) -> None:
        import ssl

        cert, key, ca_pem = _certs(self.work / "pki")
        self.ca_pem = ca_pem
        (self.work / "pki" / "ca.crt").write_bytes(ca_pem)
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(cert, key)
        await self.api.start(ssl_context=ctx)
        for shape in NODE_SHAPES:
            root = self.work / "nodes" / shape.name
            root.mkdir(parents=True, exist_ok=True)
            node = prepare_node(shape, root)
            if node.plugin is not None:
                self.pod_resources[shape.name] = serve_pod_resources(node)
            self.nodes[shape.name] = node
            self.store.create(NODES, None, node_object(shape, node.plugin))
        self.kubelet = BoxKubelet(StoreKubeletApi(self.store), self.nodes, self.work, token_for=self.authorizer.service_account_token,
                                  ca_pem=ca_pem, api_port=self.api.port, puller=ImagePuller())  # fmt: skip
        self.kubelet.start()
        self._tasks.append(asyncio.get_running_loop().create_task(self.workloads.run(self._stop)))
        self._tasks.append(asyncio.get_running_loop().create_task(EndpointsController(self.store).run(self._stop)))
        self._tasks.append(asyncio.get_running_loop().create_task(self._device_health()))
        self.kube = self.client(self.admin_token)

    def client(self, token: str) -> KubeClient:
        """A `KubeClient` of this API server with ``token`` (HTTPS, the box's CA)."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.api.url
        cfg.ssl_ca_cert = str(self.work / "pki" / "ca.crt")
        cfg.api_key = {"authorization": token}
        cfg.api_key_prefix = {"authorization": "Bearer"}
        return KubeClient(client.ApiClient(cfg))

    async def _device_health(self) -> None:
        """The device plugin's health loop: a GPU it marks unhealthy leaves the Node's allocatable."""
        while not self._stop.is_set():
            for name, node in self.nodes.items():
                if node.plugin is not None and node.plugin.refresh_health():
                    self.store.patch_status(NODES, None, name, {"status": {"allocatable": node.plugin.allocatable()}})
            await asyncio.sleep(0.2)

    async def stop(self) -> None:
        self._stop.set()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.kubelet is not None:
            await self.kubelet.stop()
        for server in self.pod_resources.values():
            server.stop()
        if self.kube is not None:
            self.kube.close()
        await self.api.stop()
        for stage in (Path("/run/fleet-box-stage"), Path("/run/fleet-box-image")):   # containers' mount points
            for d in sorted((p for p in stage.glob("**/*") if p.is_dir()), key=lambda p: -len(p.parts)):
                try:
                    d.rmdir()   # empty once no container holds a mount there
                except OSError:
                    pass

    # ----- the node images, the chart -----------------------------------------------------------

    def preload_image(self, image: str) -> None:
        """Every node already holds ``image`` (as a cluster whose nodes pulled it before)."""
        for name in self.nodes:
            node = self.store.get(NODES, None, name)
            images = list((node.get("status") or {}).get("images") or [])
            images.append({"names": [max(image_aliases(image), key=lambda n: (n.count("/"), len(n)))],
                           "sizeBytes": 2_000_000_000})
            self.store.patch_status(NODES, None, name, {"status": {"images": images}})

    def render(self, values: dict, namespace: str = "fleet", release: str = "fleet") -> list[dict]:
        """``helm template`` of charts/fleet with ``values`` (raises RuntimeError with helm's stderr)."""
        values_path = self.work / "values.yaml"
        values_path.write_text(yaml.safe_dump(values))
        helm = os.environ.get("HELM", str(Path(os.sys.executable).parent / "helm"))
        proc = subprocess.run([helm, "template", release, str(REPO / "charts" / "fleet"), "-n", namespace,
                               "-f", str(values_path)], capture_output=True, text=True, timeout=120)  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"helm template failed: {proc.stderr}")
        return [d for d in yaml.safe_load_all(proc.stdout) if d]

    def helm_install(self, values: dict, namespace: str = "fleet", release: str = "fleet") -> list[dict]:
        """Render and create every object (CRDs first), as ``helm install`` does. Raises ApiError."""
        docs = self.render(values, namespace, release)
        order = {"CustomResourceDefinition": 0, "Namespace": 0, "ServiceAccount": 1, "Secret": 1, "ConfigMap": 1,
                 "ClusterRole": 2, "Role": 2, "ClusterRoleBinding": 3, "RoleBinding": 3}
        docs.sort(key=lambda d: order.get(d["kind"], 5))
        for doc in docs:
            res = by_kind(doc["apiVersion"], doc["kind"])
            self.store.create(res, namespace if res.namespaced else None, doc)
            if res is CRDS:
                self.store.patch_status(CRDS, None, doc["metadata"]["name"], {"status": {"conditions": [
                    {"type": "Established", "status": "True"}]}})
        self.rendered = docs
        return docs

    def helm_upgrade(self, values: dict, namespace: str = "fleet", release: str = "fleet") -> list[dict]:
        """Render with ``values`` and apply, as ``helm upgrade`` does: changed objects replaced,
        new ones created, those the new rendering drops deleted (unless kept). Raises ApiError."""
        docs = self.render(values, namespace, release)
        new = {(d["kind"], d["metadata"]["name"]) for d in docs}
        for doc in docs:
            res = by_kind(doc["apiVersion"], doc["kind"])
            ns = namespace if res.namespaced else None
            try:
                self.store.get(res, ns, doc["metadata"]["name"])
            except ApiError:
                self.store.create(res, ns, doc)
                continue
            if res is not CRDS:
                self.store.replace(res, ns, doc["metadata"]["name"], doc)
        for doc in self.rendered:
            keep = (doc["metadata"].get("annotations") or {}).get("helm.sh/resource-policy") == "keep"
            if (doc["kind"], doc["metadata"]["name"]) not in new and not keep:
                res = by_kind(doc["apiVersion"], doc["kind"])
                self.store.delete(res, namespace if res.namespaced else None, doc["metadata"]["name"])
        self.rendered = docs
        return docs

    def helm_uninstall(self, namespace: str = "fleet") -> None:
        """Delete what `helm_install` created, except objects marked ``helm.sh/resource-policy: keep``."""
        for doc in reversed(self.rendered):
            if (doc["metadata"].get("annotations") or {}).get("helm.sh/resource-policy") == "keep":
                continue
            res = by_kind(doc["apiVersion"], doc["kind"])
            try:
                self.store.delete(res, namespace if res.namespaced else None, doc["metadata"]["name"])
            except ApiError:
                pass

    # ----- reading it (the surface tests/support/journey.py uses on both clusters) ---------------

    def list(self, res: Resource, namespace: str | None, selector: str | None = None) -> tuple[list[dict], str]:
        """Objects and the list's resourceVersion."""
        return self.store.list(res, namespace, selector)

    def get(self, res: Resource, namespace: str | None, name: str) -> dict:
        """One object. Raises NotFound."""
        return self.store.get(res, namespace, name)

    def leftovers(self, namespace: str) -> list[str]:
        """``plural/name`` of every object left but Nodes, Events, CRDs and Leases."""
        return sorted(f"{plural}/{name}" for plural, _ns, name in self.store.objects
                      if plural not in ("nodes", "events", "customresourcedefinitions", "leases"))  # fmt: skip

    # ----- faults -------------------------------------------------------------------------------

    def inject_xid(self, node: str, gpu_index: int, xid: int) -> str:
        """An Xid on GPU ``gpu_index`` of ``node``'s fake NVML (as the driver reports it); returns
        the GPU's UUID."""
        state = self.nodes[node].nvml_state
        assert state is not None, f"{node} has no GPUs"
        uuid = next(d["uuid"] for d in json.loads(state.read_text())["devices"] if d["index"] == gpu_index)
        inject_xid(state, uuid, xid)
        return uuid
