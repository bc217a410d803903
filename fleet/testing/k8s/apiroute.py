"""The ``kubernetes`` Service of the real control plane made to answer from a real node's pods.

`RealControlPlane` (fleet/testing/k8s/kube.py) serves on 127.0.0.1, and the API server writes its
own address into the Endpoints of the ``default/kubernetes`` Service; a real API server refuses a
loopback address there (Endpoints validation, pkg/apis/core/validation ``validateNonSpecialIP``),
so the Service has no endpoint and a pod's in-cluster client (``KUBERNETES_SERVICE_HOST``, the
Service's ClusterIP) reaches nothing. `ApiServerRoute` gives it one: a TCP relay on the node's
address (reachable from the pod network through the bridge's gateway) to the API server's
loopback port, written into those Endpoints, so kube-proxy's rules take a pod's connection to the
ClusterIP on to the relay. TLS passes through untouched: the pod checks the API server's own
certificate, whose names include the Service's ClusterIP (the API server's self-signed
certificate: cmd/kube-apiserver/app/server.go ``MaybeDefaultWithSelfSignedCerts``).

Owns `ApiServerRoute`. Used by tests/integration/test_real_node_journey.py (Fleet's pods on
`fleet.testing.k8s.realnode.RealNode`).
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
import urllib.parse

from fleet.k8s.client import KubeClient, NotFound, Resource

ENDPOINTS = Resource("", "v1", "endpoints", "Endpoints")
COPY_CHUNK_BYTES = 65536


class _Relay(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    upstream: tuple[str, int] = ("127.0.0.1", 0)


class _Pipe(socketserver.BaseRequestHandler):
    """One client connection copied both ways to the upstream address until either side closes."""

    def handle(self) -> None:
        try:
            upstream = socket.create_connection(self.server.upstream, timeout=5)
        except OSError:
            return
        upstream.settimeout(None)
        back = threading.Thread(target=_copy, args=(upstream, self.request), daemon=True)
        back.start()
        _copy(self.request, upstream)
        back.join()
        upstream.close()


def _copy(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(COPY_CHUNK_BYTES):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


class ApiServerRoute:
    """See the module docstring. ``api_url``: the API server's ``https://127.0.0.1:PORT``
    (`RealControlPlane.url`); ``node_ip``: the node's InternalIP, where the relay listens on a
    port the system picks (``port`` once entered); ``kube``: an admin client, which writes the
    Endpoints on enter and deletes them on exit (the API server's own reconciler cannot write its
    loopback address back). Raises OSError when the relay cannot bind."""

    def __init__(self, api_url: str, node_ip: str, kube: KubeClient) -> None:
        parsed = urllib.parse.urlsplit(api_url)
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 443)
        self.node_ip = node_ip
        self.kube = kube
        self.port = 0
        self._server: _Relay | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> ApiServerRoute:
        server = _Relay((self.node_ip, 0), _Pipe)
        server.upstream = self.upstream
        self._server, self.port = server, server.server_address[1]
        self._thread = threading.Thread(target=server.serve_forever, name="apiserver-relay", daemon=True)
        self._thread.start()
        body = {"apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": "kubernetes", "namespace": "default"},
                "subsets": [{"addresses": [{"ip": self.node_ip}],
                             "ports": [{"name": "https", "port": self.port, "protocol": "TCP"}]}]}  # fmt: skip
        try:
            self.kube.request("PUT", ENDPOINTS.path("default", "kubernetes"), body=body)
        except NotFound:
            self.kube.request("POST", ENDPOINTS.path("default"), body=body)
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(Exception):
            self.kube.request("DELETE", ENDPOINTS.path("default", "kubernetes"))
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
