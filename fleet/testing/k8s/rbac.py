"""Authentication and RBAC authorization for the stand-in API server, as a real API server
applies them (kubernetes.io/docs/reference/access-authn-authz/rbac/). A TEST STAND-IN.

Owns `Authorizer`: bearer tokens map to users (`issue_token`: a service account's
``system:serviceaccount:<ns>:<name>``, or an admin that may do anything, the test harness's own
client); `Authorizer.allowed(user, attrs)` evaluates the Roles, ClusterRoles, RoleBindings and
ClusterRoleBindings held in the `ObjectStore` at that moment: a RoleBinding grants its Role (or a
ClusterRole) within its namespace; a ClusterRoleBinding grants a ClusterRole everywhere. A rule
matches on apiGroups, resources (``pods``, ``pods/log``, ``inferencedeployments/status``, ``*``),
verbs (``get list watch create update patch delete``, ``*``) and resourceNames (which never
restrict list, watch or create, as in Kubernetes). `RequestAttributes.from_http` derives the verb
from the HTTP method as the API server does (GET on a collection is list, ``?watch=true``
is watch, PUT is update).

Every refusal is kept in ``denied`` with the message a real API server gives, so a test fails
when any component asks outside its Role.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from fleet.testing.k8s.store import ObjectStore

ADMIN = "system:admin"


@dataclass(frozen=True)
class RequestAttributes:
    verb: str
    group: str
    resource: str
    subresource: str
    namespace: str | None
    name: str | None

    @classmethod
    def from_http(cls, method: str, group: str, resource: str, subresource: str | None, namespace: str | None,
                  name: str | None, watch: bool) -> RequestAttributes:  # fmt: skip
        if method == "GET":
            verb = "watch" if watch else ("get" if name else "list")
        else:
            verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method, method.lower())
        if verb == "delete" and not name:
            verb = "deletecollection"
        return cls(verb, group, resource, subresource or "", namespace, name)

    def describe(self, user: str) -> str:
        """The API server's Forbidden message."""
        res = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        what = f'{res} "{self.name}"' if self.name else res
        where = f' in the namespace "{self.namespace}"' if self.namespace else " at the cluster scope"
        return (f'{what} is forbidden: User "{user}" cannot {self.verb} resource "{res}" in API group '
                f'"{self.group}"{where}')


def _rule_allows(rule: dict, a: RequestAttributes) -> bool:
    groups = rule.get("apiGroups") or []
    if "*" not in groups and a.group not in groups:
        return False
    wanted = f"{a.resource}/{a.subresource}" if a.subresource else a.resource
    resources = rule.get("resources") or []
    if "*" not in resources and wanted not in resources and not (a.subresource and f"{a.resource}/*" in resources):
        return False
    verbs = rule.get("verbs") or []
    if "*" not in verbs and a.verb not in verbs:
        return False
    names = rule.get("resourceNames") or []
    if names and (a.name is None or a.name not in names):
        return False
    return True


class Authorizer:
    """Tokens -> users, and RBAC over ``store`` (see the module docstring)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.users: dict[str, str] = {}
        self.denied: list[str] = []
        self.allowed_count = 0

    def issue_token(self, user: str) -> str:
        """A bearer token for ``user`` (``ADMIN`` or ``system:serviceaccount:NS:NAME``)."""
        token = secrets.token_urlsafe(24)
        self.users[token] = user
        return token

    def service_account_token(self, namespace: str, name: str) -> str:
        return self.issue_token(f"system:serviceaccount:{namespace}:{name}")

    def user(self, authorization: str | None) -> str | None:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":   # the scheme is case-insensitive (RFC 7235); in-cluster config sends "bearer"
            return None
        return self.users.get(token.strip())

    def _subject_matches(self, subject: dict, user: str, binding_ns: str | None) -> bool:
        kind = subject.get("kind")
        if kind == "ServiceAccount":
            ns = subject.get("namespace") or binding_ns
            return user == f"system:serviceaccount:{ns}:{subject.get('name')}"
        if kind == "User":
            return user == subject.get("name")
        if kind == "Group":
            group = subject.get("name")
            return group == "system:authenticated" or (group == "system:serviceaccounts" and
                                                        user.startswith("system:serviceaccount:"))
        return False

    def _role_rules(self, ref: dict, namespace: str | None) -> list[dict]:
        kind, name = ref.get("kind"), ref.get("name")
        plural = "clusterroles" if kind == "ClusterRole" else "roles"
        obj = self.store.objects.get((plural, None if kind == "ClusterRole" else namespace, name))
        return list((obj or {}).get("rules") or [])

    def allowed(self, user: str, a: RequestAttributes) -> bool:
        """True when a binding grants ``user`` the request; a refusal is recorded in ``denied``."""
        if user == ADMIN:
            return True
        grants: list[dict] = []
        for (plural, ns, _name), obj in list(self.store.objects.items()):
            if plural == "clusterrolebindings":
                if any(self._subject_matches(s, user, None) for s in obj.get("subjects") or []):
                    grants += self._role_rules(obj.get("roleRef") or {}, None)
            elif plural == "rolebindings" and a.namespace is not None and ns == a.namespace:
                if any(self._subject_matches(s, user, ns) for s in obj.get("subjects") or []):
                    grants += self._role_rules(obj.get("roleRef") or {}, ns)
        if any(_rule_allows(rule, a) for rule in grants):
            self.allowed_count += 1
            return True
        self.denied.append(a.describe(user))
        return False
