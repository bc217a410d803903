"""The router admin token on Kubernetes: one Secret that the router pods and the operator share.

Owns `AdminTokenSource` (where the operator takes the token from, read from its environment) and
`ensure_admin_token` (get the Secret; create it with a random token when it is the operator's own
and missing; read the token out of it). Called once by `fleet.k8s.operator_process.run_operator` at start.

Why the operator and not the chart makes the Secret: a chart that renders a random token
(`randAlphaNum`, with `lookup` to keep it) renders a different one on every `helm template`,
so under GitOps (Argo CD, Flux) the token changes on every sync and router and operator pods
that restart at different times disagree. The operator makes it once, through the API, and
never changes it; the router pods read the same Secret through `secretKeyRef` (the kubelet
retries a pod whose Secret does not exist yet: CreateContainerConfigError, then a start once
it does). Two operators starting at once (values-ha.yaml) both try to create it: one wins, the
other gets 409 AlreadyExists and reads the winner's.

Environment (set by charts/fleet/templates/operator-deployment.yaml):
- ``FLEET_ROUTER_ADMIN_TOKEN``: the token itself; when set it wins and no Secret is read
  (`fleet operator` outside a cluster, the stand-in tests).
- ``FLEET_ROUTER_ADMIN_SECRET``: the Secret's name, in the operator's namespace.
- ``FLEET_ROUTER_ADMIN_SECRET_KEY``: its key (default ``token``).
- ``FLEET_ROUTER_ADMIN_SECRET_CREATE``: ``true`` (default) when the operator owns the Secret and
  makes it when missing; ``false`` for a Secret the user provides (``router.adminToken.existingSecret``),
  which is only read: a missing one is an error naming it.
- ``FLEET_SERVICE_ACCOUNT``: the operator's ServiceAccount; a Secret the operator makes is owned
  by it, so `helm uninstall` (which deletes the ServiceAccount) leaves no Secret behind. A
  reinstall right after an uninstall may meet the old Secret before the garbage collector
  removes it; the new operator then reads a token that is about to go, and must be restarted.
"""

from __future__ import annotations

import base64
import binascii
import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fleet.k8s.client import SECRETS, SERVICE_ACCOUNTS, ApiError, Conflict, Kube, NotFound

TOKEN_ENV = "FLEET_ROUTER_ADMIN_TOKEN"
SECRET_ENV = "FLEET_ROUTER_ADMIN_SECRET"
SECRET_KEY_ENV = "FLEET_ROUTER_ADMIN_SECRET_KEY"
SECRET_CREATE_ENV = "FLEET_ROUTER_ADMIN_SECRET_CREATE"
SERVICE_ACCOUNT_ENV = "FLEET_SERVICE_ACCOUNT"   # the operator's own (downward API spec.serviceAccountName)
log = logging.getLogger("fleet.k8s.admin_token")
DEFAULT_KEY = "token"
TOKEN_BYTES = 32
"""Random bytes in a new token (`secrets.token_urlsafe(32)`: 43 URL-safe characters, 256 bits)."""

SECRET_LABELS = {"app.kubernetes.io/component": "router", "app.kubernetes.io/managed-by": "fleet-operator"}
"""Labels of a Secret the operator makes (Helm does not own it: `helm uninstall` leaves it)."""


class AdminTokenError(Exception):
    """No usable admin token: neither source configured, the user's Secret missing, or the key
    absent, empty or not base64. The message names the Secret and the key."""


@dataclass(frozen=True)
class AdminTokenSource:
    """Where the operator takes the router admin token from: ``token`` when given explicitly, else
    the Secret ``secret`` (key ``key``), made by the operator when ``create``."""

    token: str = ""
    secret: str = ""
    key: str = DEFAULT_KEY
    create: bool = True
    owner_service_account: str = ""
    """The operator's ServiceAccount (``FLEET_SERVICE_ACCOUNT``): a Secret the operator makes is
    owned by it, so uninstalling the release (which deletes the ServiceAccount) deletes the
    Secret too (Kubernetes' garbage collector)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> AdminTokenSource:
        """The source the environment names (see the module docstring). Raises `AdminTokenError`
        when it names neither a token nor a Secret, or ``FLEET_ROUTER_ADMIN_SECRET_CREATE`` is
        not ``true``/``false``."""
        create = env.get(SECRET_CREATE_ENV, "true").strip().lower()
        if create not in ("true", "false"):
            raise AdminTokenError(f"{SECRET_CREATE_ENV} must be true or false, not {env[SECRET_CREATE_ENV]!r}")
        source = cls(token=env.get(TOKEN_ENV, ""), secret=env.get(SECRET_ENV, ""),
                     key=env.get(SECRET_KEY_ENV, "") or DEFAULT_KEY, create=create == "true",
                     owner_service_account=env.get(SERVICE_ACCOUNT_ENV, ""))  # fmt: skip
        if not source.token and not source.secret:
            raise AdminTokenError(f"neither {TOKEN_ENV} nor {SECRET_ENV} is set: the router admin API needs a token")
        return source

    async def resolve(self, kube: Kube, namespace: str) -> str:
        """The token: the explicit one, else `ensure_admin_token` of the Secret in ``namespace``."""
        if self.token:
            return self.token
        owner = None
        if self.create and self.owner_service_account:
            try:
                sa = await kube.get(SERVICE_ACCOUNTS, namespace, self.owner_service_account)
                owner = {"apiVersion": "v1", "kind": "ServiceAccount", "name": sa["metadata"]["name"],
                         "uid": sa["metadata"]["uid"]}
            except ApiError as err:   # the Secret is still made; it outlives an uninstall
                log.warning("cannot read ServiceAccount %s to own the admin token Secret: %s",
                            self.owner_service_account, err)
        return await ensure_admin_token(kube, namespace, self.secret, self.key, create=self.create, owner=owner)


async def ensure_admin_token(kube: Kube, namespace: str, name: str, key: str = DEFAULT_KEY, *, create: bool = True,
                             new_token: Callable[[], str] = lambda: secrets.token_urlsafe(TOKEN_BYTES),
                             owner: dict | None = None) -> str:  # fmt: skip
    """The admin token in Secret ``namespace/name`` under ``key``. A missing Secret is created
    (``create``) with ``new_token()``; when another operator created it first (409 AlreadyExists)
    theirs is read. An existing Secret is never written. Raises `AdminTokenError` when the Secret
    is missing and not ours to create, or holds no usable token under ``key``; other API
    refusals (403, 5xx) raise `fleet.k8s.client.ApiError`. ``owner``: an owner reference
    (apiVersion, kind, name, uid) the created Secret gets."""
    try:
        secret = await kube.get(SECRETS, namespace, name)
    except NotFound:
        if not create:
            raise AdminTokenError(
                f"Secret {namespace}/{name} (router.adminToken.existingSecret) does not exist: create it with "
                f"the admin token under key {key!r}, e.g. kubectl create secret generic {name} -n {namespace} "
                f"--from-literal={key}=$(openssl rand -base64 32)") from None  # fmt: skip
        body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                "metadata": {"name": name, "namespace": namespace, "labels": dict(SECRET_LABELS)},
                "data": {key: base64.b64encode(new_token().encode()).decode()}}  # fmt: skip
        if owner is not None:
            body["metadata"]["ownerReferences"] = [{**owner, "blockOwnerDeletion": False}]
        try:
            secret = await kube.create(SECRETS, namespace, body)
        except Conflict as err:
            if err.reason != "AlreadyExists":
                raise
            secret = await kube.get(SECRETS, namespace, name)   # another operator won the race
    return _token_of(secret, namespace, name, key)


def _token_of(secret: dict, namespace: str, name: str, key: str) -> str:
    encoded = (secret.get("data") or {}).get(key)
    if not encoded:
        raise AdminTokenError(f"Secret {namespace}/{name} has no key {key!r} (router.adminToken.existingSecretKey)")
    try:
        token = base64.b64decode(encoded, validate=True).decode("ascii")
    except (binascii.Error, UnicodeDecodeError):
        raise AdminTokenError(f"Secret {namespace}/{name} key {key!r} is not base64 of ASCII text") from None
    if not token or not all(" " < c <= "~" for c in token):
        # the router pods read the value as it is; a bearer token must be visible ASCII (RFC 6750)
        raise AdminTokenError(f"Secret {namespace}/{name} key {key!r} is empty or holds whitespace or control "
                              "characters (a trailing newline from --from-file?)")  # fmt: skip
    return token
