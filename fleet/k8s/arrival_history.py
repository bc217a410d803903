"""The autoscaler's arrival history on Kubernetes: one ConfigMap the operator keeps.

Owns `ConfigMapHistoryStore`, the `fleet.controller.arrival_history.ArrivalHistoryStore` of
`fleet operator`: the history document (`fleet.controller.arrival_history.encode`) under the key
`DATA_KEY` of ConfigMap ``<lease name>-arrival-history`` in the operator's namespace (one per
release, as the Lease is). A new leader reads it before its first decisions, so a forecast keeps
its seasons across operator restarts and fail-overs. The ConfigMap is created on the first save,
owned by the operator's ServiceAccount when it can be read (so `helm uninstall` leaves nothing
behind, as for the admin token Secret, `fleet.k8s.admin_token`). A history document is small:
three days of 30-minute bins are 144 pairs (~4 KiB) per deployment, far under a ConfigMap's
1 MiB. Needs ``get``, ``create`` and ``update`` on configmaps (charts/fleet/templates/operator-rbac.yaml).
"""

from __future__ import annotations

import logging

from fleet.controller.arrival_history import History, decode, encode
from fleet.k8s.client import CONFIGMAPS, SERVICE_ACCOUNTS, ApiError, Conflict, Kube, NotFound

log = logging.getLogger("fleet.autoscaling")

DATA_KEY = "history.json"


class ConfigMapHistoryStore:
    """``ArrivalHistoryStore`` in ConfigMap ``namespace/name`` (module docstring).
    ``owner_service_account``: the operator's ServiceAccount, the ConfigMap's owner ("" for none)."""

    def __init__(self, kube: Kube, namespace: str, name: str, owner_service_account: str = "") -> None:
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.owner_service_account = owner_service_account

    async def load(self) -> History:
        try:
            cm = await self.kube.get(CONFIGMAPS, self.namespace, self.name)
        except NotFound:
            return {}
        text = (cm.get("data") or {}).get(DATA_KEY)
        return decode(text, f"ConfigMap {self.namespace}/{self.name} {DATA_KEY}") if text else {}

    async def save(self, history: History) -> None:
        data = {DATA_KEY: encode(history)}
        try:
            cm = await self.kube.get(CONFIGMAPS, self.namespace, self.name)
        except NotFound:
            body = {"apiVersion": "v1", "kind": "ConfigMap", "data": data,
                    "metadata": {"name": self.name, "namespace": self.namespace,
                                 "labels": {"app.kubernetes.io/managed-by": "fleet-operator"}}}  # fmt: skip
            owner = await self._owner()
            if owner is not None:
                body["metadata"]["ownerReferences"] = [{**owner, "blockOwnerDeletion": False}]
            try:
                await self.kube.create(CONFIGMAPS, self.namespace, body)
                return
            except Conflict:   # created meanwhile (another operator was leader a moment ago): replace it
                cm = await self.kube.get(CONFIGMAPS, self.namespace, self.name)
        await self.kube.replace(CONFIGMAPS, self.namespace, self.name, {**cm, "data": data})

    async def _owner(self) -> dict | None:
        if not self.owner_service_account:
            return None
        try:
            sa = await self.kube.get(SERVICE_ACCOUNTS, self.namespace, self.owner_service_account)
        except ApiError as err:   # the ConfigMap is still made; it outlives an uninstall
            log.warning("cannot read ServiceAccount %s to own the arrival history ConfigMap: %s",
                        self.owner_service_account, err)
            return None
        return {"apiVersion": "v1", "kind": "ServiceAccount", "name": sa["metadata"]["name"],
                "uid": sa["metadata"]["uid"]}
