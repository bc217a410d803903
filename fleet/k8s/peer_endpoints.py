"""Peer routers found through the Kubernetes API: the ready addresses of a Service's Endpoints.

Owns `EndpointsPeers` (a `router.signals.peer_discovery.Resolver`: one GET of the Endpoints
object named like the Service, its ready addresses on the peers' port), `ready_addresses` (the
pure reading of an Endpoints object), `parse_endpoints_target` (``SERVICE:PORT``),
`pod_namespace` (the namespace the router pod runs in) and `ENDPOINTS`. Injected by
`fleet.k8s.routerpod.serve_router_pod` into the router's `PeerDiscovery`, which keeps the set
arithmetic (this router's own IP left out), the polling interval and the metrics; router/ never
imports this module (tests/unit/test_layers.py).

The Endpoints object is what kube-controller-manager's endpoints controller writes for a Service
with a selector (pkg/controller/endpoint/endpoints_controller.go): ``subsets[].addresses`` are
the Ready pods' IPs, ``subsets[].notReadyAddresses`` the others, ``subsets[].ports`` the
Service's ports with ``targetPort`` resolved against each pod's container ports. It needs no
cluster DNS. The source is a periodic GET (every `PeerDiscovery.interval_s`), not a watch: a GET
of one named object is what RBAC can grant by ``resourceNames``, so the router's Role
(charts/fleet/templates/router-rbac.yaml) is ``get`` on that one Endpoints object and nothing
else; ``list`` and ``watch`` cannot be narrowed to one name without a ``metadata.name`` field
selector on every request.

Errors: no Endpoints object (no Service yet, or deleted) is an empty peer set (`NoRecords`); a 403
(the Role is missing) is logged once as an error naming the exact rule to grant, and raised as
`PeerSourceError` so `PeerDiscovery` keeps the last set; any other failure is a `PeerSourceError`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from fleet.base.names import DNS_LABEL
from fleet.k8s.client import ApiError, Kube, NotFound, Resource
from router.signals.peer_discovery import NoRecords

log = logging.getLogger(__name__)

ENDPOINTS = Resource("", "v1", "endpoints", "Endpoints")
SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
"""Where the kubelet puts the pod's namespace beside its service-account token."""


class PeerSourceError(OSError):
    """Reading the Endpoints failed (refused, unreachable, malformed): the last peer set is kept."""


def parse_endpoints_target(target: str) -> tuple[str, int]:
    """``SERVICE:PORT`` as (Service name, port): a Service in the router pod's namespace and the
    peers' admin port (the Endpoints port whose number the peers listen on).

    Raises:
        ValueError: naming ``--peers-endpoints``: no ``:``, a name that is not a DNS-1123 label
            (a Service name), or a port outside 1-65535.
    """
    name, sep, port = target.strip().rpartition(":")
    if not sep or not DNS_LABEL.match(name) or len(name) > 63:
        raise ValueError(f"--peers-endpoints must be SERVICE:PORT with SERVICE a Service name (a DNS-1123 label), "
                         f"got {target!r}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--peers-endpoints: the port must be a number in 1-65535, got {port!r} in {target!r}")
    return name, int(port)


def pod_namespace(env: dict[str, str] | None = None, sa_file: Path = SA_NAMESPACE_FILE) -> str:
    """The router pod's namespace: ``$POD_NAMESPACE`` when set (the downward API's
    metadata.namespace, or a run outside a pod), else the service account's namespace file
    (`SA_NAMESPACE_FILE`, mounted with the token the source reads the API with).

    Raises:
        ValueError: neither is there.
    """
    env = os.environ if env is None else env
    if env.get("POD_NAMESPACE", "").strip():
        return env["POD_NAMESPACE"].strip()
    try:
        namespace = sa_file.read_text().strip()
    except OSError as err:
        raise ValueError(f"--peers-endpoints: no namespace: POD_NAMESPACE is not set and {sa_file} is not "
                         f"readable ({err.strerror})") from None
    if not namespace:
        raise ValueError(f"--peers-endpoints: no namespace: POD_NAMESPACE is not set and {sa_file} is empty")
    return namespace


def ready_addresses(endpoints: dict, port: int) -> list[str]:
    """The IPs of ``subsets[].addresses`` (the Ready pods; never ``notReadyAddresses``) of every
    subset that has a port numbered ``port``, in the object's order without duplicates. Pure."""
    out: list[str] = []
    for subset in endpoints.get("subsets") or []:
        if not any(p.get("port") == port for p in subset.get("ports") or []):
            continue
        for address in subset.get("addresses") or []:
            ip = address.get("ip")
            if ip and ip not in out:
                out.append(ip)
    return out


class EndpointsPeers:
    """`router.signals.peer_discovery.Resolver` over the Endpoints of a Service in ``namespace``.

    Called as ``await peers(service, port)``: the ready addresses (`ready_addresses`) of the
    Endpoints named ``service``. ``kube``: the router pod's client (its service account).

    Raises (from a call):
        NoRecords: the Endpoints object does not exist (an empty peer set).
        PeerSourceError: any other failure; a 403 is also logged once, with the rule to grant.
    """

    def __init__(self, kube: Kube, namespace: str) -> None:
        self.kube = kube
        self.namespace = namespace
        self.refused = False
        """True while the last GET was refused with 403 (the refusal was logged when it started)."""

    def missing_rule(self, service: str) -> str:
        """The RBAC rule this source needs, as a Role's rule in YAML flow style."""
        return (f'{{apiGroups: [""], resources: ["endpoints"], verbs: ["get"], resourceNames: ["{service}"]}} '
                f'in a Role of namespace "{self.namespace}" bound to the router pods\' service account')

    async def __call__(self, service: str, port: int) -> list[str]:
        try:
            endpoints = await self.kube.get(ENDPOINTS, self.namespace, service)
        except NotFound:
            self.refused = False
            raise NoRecords(f'no Endpoints "{service}" in namespace "{self.namespace}"') from None
        except ApiError as err:
            if err.status == 403:
                if not self.refused:
                    log.error("peer routers: reading Endpoints %r was refused (403: %s); the router's service "
                              "account needs the rule %s (charts/fleet/templates/router-rbac.yaml). Keeping the last "
                              "peer set.", service, err.message, self.missing_rule(service))
                self.refused = True
                raise PeerSourceError(f"403 reading Endpoints {service!r}: grant {self.missing_rule(service)}") from err
            raise PeerSourceError(f"reading Endpoints {service!r}: {err}") from err
        except Exception as err:  # the client's transport errors (urllib3) are not OSError: one kind for the caller
            raise PeerSourceError(f"reading Endpoints {service!r}: {type(err).__name__}: {err}") from err
        self.refused = False
        return ready_addresses(endpoints, port)
