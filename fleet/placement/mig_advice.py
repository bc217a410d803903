"""MIG repartition advice: when a MIG profile is short, which GPUs could offer it, and how.

Owns `advise`, called by `PlacementStrategy.place_replicas` when replicas of a MIG shape are
left unplaced. It proposes plans, never actions (repartitioning needs the GPU idle, and NVIDIA's
MIG manager applies it). Candidates, least disruptive first:

1. a MIG-mode GPU whose free memory slices can hold new instances beside the existing ones
   (needs the existing instances' start slots);
2. a MIG-mode GPU repartitioned around its busy instances: idle instances of other profiles
   are destroyed and replaced by as many instances of the profile as fit;
3. an idle whole GPU: enable MIG mode, fill it with the profile.

Every proposed geometry is valid for the GPU's model under `fleet.inventory.mig`'s rules (NVIDIA
MIG user guide placement tables for H100 80GB, A100 40GB and 80GB). When the request carries the
model's memory need, a GPU whose instance of the profile cannot hold the model (weights and one
``max_model_len`` sequence, `fleet.placement.explain.memory_reason`) gets no advice: creating
such instances adds nothing the model can start on. Warm nodes come first within a tier; advice
stops once it covers the shortfall. Pure.
"""

from __future__ import annotations

from collections import Counter

from fleet.inventory.mig import MigSlot, max_instances, mig_model_for
from fleet.inventory.model import Inventory, product_key
from fleet.placement.explain import memory_reason
from fleet.placement.shapes import MigAdvice, PlacementRequest


def advise(request: PlacementRequest, inventory: Inventory, held: Counter[str], product: str | None,
           shortfall: int) -> tuple[MigAdvice, ...]:
    """Repartition plans that together add at least ``shortfall`` instances where possible.

    ``product`` restricts advice to the version's product (homogeneity); None allows any
    product whose MIG table has the profile.
    """
    profile = request.shape.mig_profile
    pk = product_key(product) if product else None
    tiers: list[list[tuple[bool, int, MigAdvice]]] = [[], [], []]
    for pos, node in enumerate(inventory.nodes):
        cold = not request.is_warm(node)
        for gpu in node.gpus:
            if (pk and gpu.product_key != pk) or not gpu.health.healthy:
                continue
            model = mig_model_for(gpu.product, gpu.memory_mib)
            if model is None or model.profile(profile) is None:
                continue
            if request.memory is not None and memory_reason(request.memory, request.shape, gpu) is not None:
                continue   # an instance of the profile cannot hold the model: nothing to gain
            ids = {p.name: p.profile_id for p in model.profiles}

            def plan(enable: bool, keep, destroy, create) -> MigAdvice:
                return MigAdvice(node.name, gpu.index, gpu.uuid, gpu.product, enable, tuple(keep),
                                 tuple(destroy), tuple(create), len(create), ids)

            if not gpu.mig_enabled:
                if not held[gpu.uuid]:
                    create = max_instances(model, profile)
                    if create:
                        tiers[2].append((cold, pos, plan(True, (), (), create)))
                continue
            if any(m.start is None for m in gpu.mig_instances):
                continue   # geometry unknown: cannot reason about free slices
            slots = {m.uuid: MigSlot(m.profile, m.start) for m in gpu.mig_instances}
            beside = max_instances(model, profile, list(slots.values()))
            if beside:
                tiers[0].append((cold, pos, plan(False, slots.values(), (), beside)))
                continue
            busy = [slots[m.uuid] for m in gpu.mig_instances if held[m.uuid]]
            idle_other = [m.uuid for m in gpu.mig_instances if not held[m.uuid] and m.profile != profile]
            kept_same = [slots[m.uuid] for m in gpu.mig_instances if not held[m.uuid] and m.profile == profile]
            around = max_instances(model, profile, busy + kept_same)
            if idle_other and around:
                tiers[1].append((cold, pos, plan(False, busy + kept_same, idle_other, around)))
    out: list[MigAdvice] = []
    covered = 0
    for tier in tiers:
        for _, _, advice in sorted(tier, key=lambda t: (t[0], t[1], t[2].gpu_index)):
            if covered >= shortfall:
                return tuple(out)
            out.append(advice)
            covered += advice.gain
    return tuple(out)
