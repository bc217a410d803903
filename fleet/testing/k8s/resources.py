"""The kinds the cluster in a box serves beyond those Fleet's own client names
(`fleet.k8s.client`): what the Helm chart renders (workloads, Services, RBAC, Secrets, ...).
A TEST STAND-IN's table, not Kubernetes' discovery.

`BOX_RESOURCES` is every kind the stand-in API server (fleet/testing/k8s/apiserver.py) routes;
`by_kind(apiVersion, kind)` finds the one a manifest names (raises KeyError naming it).
"""

from __future__ import annotations

from fleet.k8s import client
from fleet.k8s.client import Resource

_EXTRA = (
    Resource("", "v1", "namespaces", "Namespace", namespaced=False),
    Resource("", "v1", "services", "Service"),
    Resource("", "v1", "endpoints", "Endpoints"),
    Resource("", "v1", "secrets", "Secret"),
    Resource("", "v1", "configmaps", "ConfigMap"),
    Resource("", "v1", "serviceaccounts", "ServiceAccount"),
    Resource("apps", "v1", "deployments", "Deployment"),
    Resource("apps", "v1", "daemonsets", "DaemonSet"),
    Resource("apps", "v1", "replicasets", "ReplicaSet"),
    Resource("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget"),
    Resource("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy"),
    Resource("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    Resource("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    Resource("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", namespaced=False),
    Resource("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", namespaced=False),
    Resource("node.k8s.io", "v1", "runtimeclasses", "RuntimeClass", namespaced=False),
)


def _all() -> tuple[Resource, ...]:
    seen: dict[tuple[str, str], Resource] = {}
    for r in (*(v for v in vars(client).values() if isinstance(v, Resource)), *_EXTRA):
        seen.setdefault((r.group, r.plural), r)
    return tuple(seen.values())


BOX_RESOURCES = _all()
SECRETS = next(r for r in BOX_RESOURCES if r.plural == "secrets")
CONFIGMAPS = next(r for r in BOX_RESOURCES if r.plural == "configmaps")
SERVICE_ACCOUNTS = next(r for r in BOX_RESOURCES if r.plural == "serviceaccounts")
DEPLOYMENTS = next(r for r in BOX_RESOURCES if r.plural == "deployments")
DAEMONSETS = next(r for r in BOX_RESOURCES if r.plural == "daemonsets")
SERVICES = next(r for r in BOX_RESOURCES if r.plural == "services")
ENDPOINTS = next(r for r in BOX_RESOURCES if r.plural == "endpoints")   # fleet/testing/k8s/endpoints.py writes them


def by_kind(api_version: str, kind: str) -> Resource:
    """The resource of a manifest's ``apiVersion`` and ``kind``. Raises KeyError naming them."""
    for r in BOX_RESOURCES:
        if r.api_version == api_version and r.kind == kind:
            return r
    raise KeyError(f"the cluster in a box does not serve {api_version} {kind}")
