"""The kubelet's PodResources API of one node. A TEST STAND-IN for the kubelet's
``v1.PodResourcesLister`` server (Kubernetes pkg/kubelet/apis/podresources, served since 1.20).

`PodResourcesServer` is a real gRPC server speaking the kubelet's proto
(fleet/agent/podresources_api/api.proto) on a unix socket, answering ``List`` from the node's
device plugin stand-in (fleet/testing/k8s/deviceplugin.py `DevicePlugin.pod_devices`: each
pod's namespace, name, containers and their devices, as the kubelet's device manager reports
them). The directory and the socket are made as a real kubelet makes them: the directory 0750,
the socket 0755 (the kubelet's umask), both root's (pkg/kubelet/kubelet.go ``setupDataDirs``,
pkg/kubelet/util/util_unix.go ``CreateListener``): only uid 0 can connect.

`serve_pod_resources(node)` starts one for a `fleet.testing.k8s.podconfig.BoxNode` with a device
plugin, at ``<node root>/var/lib/kubelet/pod-resources/kubelet.sock``; `ClusterInABox`
(fleet/testing/k8s/box.py) starts one per GPU node and stops them. Fleet's node agent asks it
through `fleet.agent.pod_devices`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent import futures
from pathlib import Path

import grpc

from fleet.agent.podresources_api import api_pb2, api_pb2_grpc
from fleet.testing.k8s.deviceplugin import DevicePlugin
from fleet.testing.k8s.podconfig import BoxNode

SOCKET = "var/lib/kubelet/pod-resources/kubelet.sock"
"""The socket's path under a node's root (the kubelet's root directory /var/lib/kubelet)."""
MAX_SOCKET_PATH = 100
"""Longer paths are bound elsewhere and renamed into place (a unix socket's path has at most
107 bytes, ``sun_path``; the kubelet too binds a temporary name and renames it)."""


def list_response(plugin: DevicePlugin) -> api_pb2.ListPodResourcesResponse:
    """What the kubelet's ``List`` answers for the plugin's allocations: one ``PodResources``
    per pod, one ``ContainerResources`` per container, one ``ContainerDevices`` per resource."""
    pods: dict[tuple[str, str], dict[str, list[api_pb2.ContainerDevices]]] = {}
    for namespace, name, container, resource, ids in plugin.pod_devices():
        devices = pods.setdefault((namespace, name), {}).setdefault(container, [])
        devices.append(api_pb2.ContainerDevices(resource_name=resource, device_ids=ids))
    return api_pb2.ListPodResourcesResponse(pod_resources=[
        api_pb2.PodResources(namespace=namespace, name=name, containers=[
            api_pb2.ContainerResources(name=c, devices=devices) for c, devices in containers.items()])
        for (namespace, name), containers in pods.items()])


class PodResourcesServer(api_pb2_grpc.PodResourcesListerServicer):
    """``List`` over ``plugin``'s allocations on the unix socket ``socket``."""

    def __init__(self, plugin: DevicePlugin, socket: Path) -> None:
        self.plugin = plugin
        self.socket = Path(socket)
        self.calls = 0
        self._server: grpc.Server | None = None

    def List(self, request: api_pb2.ListPodResourcesRequest,   # noqa: N802 - the service's method name
             context: grpc.ServicerContext) -> api_pb2.ListPodResourcesResponse:
        self.calls += 1
        return list_response(self.plugin)

    def start(self) -> PodResourcesServer:
        """Listen on the socket (a stale one is removed, as the kubelet does); returns self.
        Raises RuntimeError when the socket cannot be bound."""
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(self.socket.parent, 0o750)
        self.socket.unlink(missing_ok=True)
        path = self.socket.resolve()
        short = Path(tempfile.mkdtemp(prefix="podres-")) if len(str(path)) > MAX_SOCKET_PATH else None
        bound = short / "kubelet.sock" if short is not None else path
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(self, server)
        try:
            if not server.add_insecure_port(f"unix://{bound}"):
                raise RuntimeError(f"{bound}: cannot listen")
            server.start()
            os.chmod(bound, 0o755)
            if short is not None:
                shutil.move(bound, path)
        finally:
            if short is not None:
                shutil.rmtree(short, ignore_errors=True)
        self._server = server
        return self

    def stop(self) -> None:
        """Stop answering at once and remove the socket."""
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None
        self.socket.unlink(missing_ok=True)


def serve_pod_resources(node: BoxNode) -> PodResourcesServer:
    """Start the PodResources server of ``node`` (at `SOCKET` under its root) over its device
    plugin. Raises ValueError when the node has no device plugin."""
    if node.plugin is None:
        raise ValueError(f"node {node.name}: no device plugin to answer PodResources from")
    return PodResourcesServer(node.plugin, node.host_path(SOCKET)).start()
