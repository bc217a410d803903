"""What `fleet up` and `fleet down` take over when ``state.json`` cannot be read.

Owns `rebuild_snapshot`: a controller snapshot (the format `fleet.controller.restart.Adoption`
reads) made from the records that survive beside the state file, so the controller adopts what
runs instead of stopping it as unknown:

- the local backend's replica records (``replicas.json``) and the fleet-id markers in the
  environment of the engines it started (`fleet.local.backend`): which replica runs, of which
  deployment and serving hash, on which port and devices;
- the router's own pools (``GET /admin/v1/pools`` of the adopted router): a replica the router
  lists was READY and stays in the pool (no second warm-up, no gap in serving); one it does not
  list is probed and warmed again before it joins;
- the replica numbers ever used (`fleet.local.state.StateStore.replica_numbers`): ids are never
  reused.

Pure: the caller reads the records and the router. Called by `fleet.local.up`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from fleet.controller.backend import ReplicaFacts
from fleet.controller.lifecycle import Replica
from fleet.controller.targets import STATE_FORMAT
from fleet.placement import ReplicaPlacement
from fleet.spec import LoadedDeployment


def pooled_endpoint_ids(pools: Mapping | None) -> set[str] | None:
    """Endpoint ids in the router's ``GET /admin/v1/pools`` answer (``{model: {"endpoints":
    [{"id": ...}, ...]}}``) that are not draining; None when the router could not be asked."""
    if pools is None:
        return None
    ids: set[str] = set()
    for pool in pools.values():
        for e in (pool or {}).get("endpoints") or []:
            if isinstance(e, dict) and e.get("id") and not e.get("draining"):
                ids.add(str(e["id"]))
    return ids


def rebuild_snapshot(
    loaded: Iterable[LoadedDeployment],
    facts: Mapping[str, ReplicaFacts],
    placements: Mapping[str, dict | None],
    pooled: set[str] | None,
    numbers: Mapping[str, int],
    now_s: float,
) -> dict:
    """A snapshot for `Controller.start` made without ``state.json``.

    ``loaded``: today's deployments; ``facts``: the backend's replicas (`Backend.observe`; only
    running ones are taken); ``placements``: replica id -> `ReplicaPlacement.to_dict()` the
    backend recorded (None: unknown; the replica then holds no devices in placement's eyes);
    ``pooled``: endpoint ids the router serves (`pooled_endpoint_ids`; None: unknown);
    ``numbers``: deployment -> next replica number never used; ``now_s``: controller clock.

    Each deployment's target is the number of its replicas running now (at least what its spec
    starts with: `DeploymentRecord.restore` clamps it to min..max), so an autoscaled fleet is
    not scaled back to ``spec.replicas.initial``. Replicas of other deployments or serving
    hashes are taken too: adoption drains and replaces them, as for any previous controller.
    """
    declared = {ld.deployment.name: ld for ld in loaded}
    running = {rid: f for rid, f in facts.items() if f.running and f.endpoint is not None}
    deployments: dict[str, dict] = {}
    for name in sorted(set(numbers) | {f.deployment for f in running.values()} | set(declared)):
        mine = [f for f in running.values() if f.deployment == name]
        entry: dict = {"next_index": int(numbers.get(name, 0))}
        for rid in (f.replica_id for f in mine):
            index = rid.rsplit("-", 1)[-1]
            if index.isdigit():
                entry["next_index"] = max(entry["next_index"], int(index) + 1)
        if mine and name in declared:
            entry["desired"] = max(len(mine), declared[name].deployment.spec.replicas.desired_at_start)
            entry["desired_reason"] = "rebuilt: replicas found running"
        deployments[name] = entry
    replicas = []
    for rid, f in sorted(running.items()):
        ld = declared.get(f.deployment)
        placement = placements.get(rid)
        label = None
        if placement:
            try:
                label = ReplicaPlacement.from_dict(placement).label
            except (KeyError, TypeError, ValueError):
                placement = None
        serving = pooled is not None and rid in pooled
        r = Replica(
            id=rid, deployment=f.deployment, created_at_s=now_s, spec_hash=f.spec_hash,
            revision=ld.deployment.spec.model.revision if ld is not None and ld.serving_hash == f.spec_hash else "?",
            placed_at_s=now_s, assignment=label, placement=placement, image_ready_at_s=now_s,
            weights_ready_at_s=now_s if f.weights_present else None, launched_at_s=now_s, node=f.node,
            endpoint=f.endpoint, detail=dict(f.detail), kv_events=f.kv_events,
            # The router serves it: it passed warm-up under the previous controller and stays in
            # the pool. Otherwise /health and the warm-up run again before it joins.
            healthy_at_s=now_s if serving else None, warmup_started_at_s=now_s if serving else None,
            warmup_passed_at_s=now_s if serving else None,
        )  # fmt: skip
        replicas.append({**r.to_dict(), "waiting_reason": None})
    return {"format": STATE_FORMAT, "rebuilt": True, "clock_s": now_s, "deployments": deployments,
            "replicas": replicas}  # fmt: skip
