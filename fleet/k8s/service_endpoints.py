"""A Service's ready addresses read through the Kubernetes API: the Endpoints object named like it.

Owns `EndpointsAddresses` (one GET of the Endpoints object named like a Service, its ready
addresses on a port), `ServiceLocator` (the `router.picker.client.Locate` a router pod's picker
client asks: the first ready address of the picker Service), `ready_addresses` (the pure reading
of an Endpoints object), `parse_endpoints_target` (``SERVICE:PORT``), `pod_namespace` (the
namespace the pod runs in) and `ENDPOINTS`. Called by `fleet.k8s.routerpod.serve_router_pod`
(``fleet router-pod --picker-endpoints``), which injects a `ServiceLocator` into the router's
`PickerClient` (router/ never imports this module: tests/unit/test_layers.py), and by
`fleet.cli.k8s` (`pod_namespace` for the picker's Lease).

The Endpoints object is what kube-controller-manager's endpoints controller writes for a Service
with a selector (pkg/controller/endpoint/endpoints_controller.go): ``subsets[].addresses`` are
the Ready pods' IPs, ``subsets[].notReadyAddresses`` the others, ``subsets[].ports`` the
Service's ports with ``targetPort`` resolved against each pod's container ports. It needs neither
cluster DNS nor kube-proxy. The source is a periodic GET (every
`router.picker.client.DEFAULT_LOCATE_INTERVAL_S` while connected), not a watch: a GET of one named
object is what RBAC can grant by ``resourceNames``, so the router's Role
(charts/fleet/templates/router-rbac.yaml) is ``get`` on that one Endpoints object and nothing
else; ``list`` and ``watch`` cannot be narrowed to one name without a ``metadata.name`` field
selector on every request.

Errors: no Endpoints object (no Service yet, or deleted) is no address; a 403 (the Role is
missing) is logged once as an error naming the exact rule to grant, and raised as
`EndpointsSourceError` (an OSError: the picker client keeps its last address); any other failure
is an `EndpointsSourceError`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from fleet.base.names import DNS_LABEL
from fleet.k8s.client import ApiError, Kube, NotFound, Resource

log = logging.getLogger(__name__)

ENDPOINTS = Resource("", "v1", "endpoints", "Endpoints")
SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
"""Where the kubelet puts the pod's namespace beside its service-account token."""


class EndpointsSourceError(OSError):
    """Reading the Endpoints failed (refused, unreachable, malformed): the caller keeps what it knew."""


def parse_endpoints_target(target: str, flag: str = "--picker-endpoints") -> tuple[str, int]:
    """``SERVICE:PORT`` as (Service name, port): a Service in the pod's namespace and the port
    its pods listen on (the Endpoints port, the Service's ``targetPort`` resolved).

    Raises:
        ValueError: naming ``flag``: no ``:``, a name that is not a DNS-1123 label (a Service
            name), or a port outside 1-65535.
    """
    name, sep, port = target.strip().rpartition(":")
    if not sep or not DNS_LABEL.match(name) or len(name) > 63:
        raise ValueError(f"{flag} must be SERVICE:PORT with SERVICE a Service name (a DNS-1123 label), "
                         f"got {target!r}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag}: the port must be a number in 1-65535, got {port!r} in {target!r}")
    return name, int(port)


def pod_namespace(env: dict[str, str] | None = None, sa_file: Path = SA_NAMESPACE_FILE,
                  flag: str = "--picker-endpoints") -> str:  # fmt: skip
    """The pod's namespace: ``$POD_NAMESPACE`` when set (the downward API's metadata.namespace,
    or a run outside a pod), else the service account's namespace file (`SA_NAMESPACE_FILE`,
    mounted with the token the API is read with).

    Raises:
        ValueError: naming ``flag`` (what needs the namespace): neither is there.
    """
    env = os.environ if env is None else env
    if env.get("POD_NAMESPACE", "").strip():
        return env["POD_NAMESPACE"].strip()
    try:
        namespace = sa_file.read_text().strip()
    except OSError as err:
        raise ValueError(f"{flag}: no namespace: POD_NAMESPACE is not set and {sa_file} is not "
                         f"readable ({err.strerror})") from None
    if not namespace:
        raise ValueError(f"{flag}: no namespace: POD_NAMESPACE is not set and {sa_file} is empty")
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


class EndpointsAddresses:
    """The ready addresses of the Endpoints of a Service in ``namespace``.

    Called as ``await addresses(service, port)``: the ready addresses (`ready_addresses`) of the
    Endpoints named ``service``; [] when that object does not exist. ``kube``: the pod's client
    (its service account). ``who``: the pods reading it, named in the 403 message.

    Raises (from a call):
        EndpointsSourceError: any failure but a missing object; a 403 is also logged once, with
            the rule to grant.
    """

    def __init__(self, kube: Kube, namespace: str, who: str = "router pods") -> None:
        self.kube = kube
        self.namespace = namespace
        self.who = who
        self.refused = False
        """True while the last GET was refused with 403 (the refusal was logged when it started)."""

    def missing_rule(self, service: str) -> str:
        """The RBAC rule this source needs, as a Role's rule in YAML flow style."""
        return (f'{{apiGroups: [""], resources: ["endpoints"], verbs: ["get"], resourceNames: ["{service}"]}} '
                f'in a Role of namespace "{self.namespace}" bound to the {self.who}\' service account')

    async def __call__(self, service: str, port: int) -> list[str]:
        try:
            endpoints = await self.kube.get(ENDPOINTS, self.namespace, service)
        except NotFound:
            self.refused = False
            return []
        except ApiError as err:
            if err.status == 403:
                if not self.refused:
                    log.error("reading Endpoints %r was refused (403: %s); the %s' service account needs the rule "
                              "%s (charts/fleet/templates/router-rbac.yaml). Keeping the last address.",
                              service, err.message, self.who, self.missing_rule(service))
                self.refused = True
                raise EndpointsSourceError(f"403 reading Endpoints {service!r}: grant {self.missing_rule(service)}") \
                    from err
            raise EndpointsSourceError(f"reading Endpoints {service!r}: {err}") from err
        except Exception as err:  # the client's transport errors (urllib3) are not OSError: one kind for the caller
            raise EndpointsSourceError(f"reading Endpoints {service!r}: {type(err).__name__}: {err}") from err
        self.refused = False
        return ready_addresses(endpoints, port)


class ServiceLocator:
    """A `router.picker.client.Locate` over one Service: ``await locator()`` is (the first ready
    address of ``service``'s Endpoints, ``port``), or None when no pod of it is Ready. In HA only
    the picker leader passes its readiness probe (charts/fleet/templates/router-picker.yaml), so
    the first ready address is the leader's.

    Raises (from a call):
        EndpointsSourceError: from `EndpointsAddresses` (the client keeps its last address).
    """

    def __init__(self, addresses: EndpointsAddresses, service: str, port: int) -> None:
        self.addresses = addresses
        self.service = service
        self.port = port

    async def __call__(self) -> tuple[str, int] | None:
        found = await self.addresses(self.service, self.port)
        return (found[0], self.port) if found else None
