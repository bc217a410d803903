"""The vocabulary of placement: what a replica needs, what was asked, what was decided.

Owns `ReplicaShape` (one replica's needs, derived from a deployment), `PlacementRequest` (a
scale-up of N replicas of one deployment version: one decision), `Assignment` (one node's share
of a replica, with the environment that pins the engine to its devices), `ReplicaPlacement`
(one replica: one assignment, or several for a gang), `NodeClass` (nodes that fail for the same
reason), `MigAdvice` (a repartition plan) and `PlacementPlan` (the answer). Pure data, used by
every placement strategy, the controller, `fleet up` and `fleet plan`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

from fleet.sources import SourceError, parse_source, redact_source
from fleet.inventory.mig import MigSlot
from fleet.inventory.model import NodeInventory
from fleet.models.memory import MemoryNeed
from fleet.placement.compat import CudaNeed, node_reason
from fleet.spec import InferenceDeployment


@dataclass(frozen=True)
class GangShape:
    """A replica wider than a node: ``nodes`` member nodes, each with ``per_node`` GPUs inside
    one NVLink domain (see `fleet.placement.gangs`)."""

    per_node: int
    nodes: int


@dataclass(frozen=True)
class ReplicaShape:
    """One replica's needs. ``gpu_products`` are the acceptable GPU products, most preferred
    first (``spec.resources.gpuProduct``, a name or a list); () means any. ``gpu_product`` is the
    one product when exactly one is named (either field may be given; the other follows), None
    otherwise. One product is chosen for all replicas of a version either way
    (`fleet.placement.strategies`). Raises ValueError when the two disagree."""

    accelerator: str = "gpu"                # "gpu" | "cpu"
    gpu_product: str | None = None
    tensor_parallel_size: int = 1
    mig_profile: str | None = None
    cpu_cores: int = 1
    gpu_products: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.gpu_product and not self.gpu_products:
            object.__setattr__(self, "gpu_products", (self.gpu_product,))
        elif self.gpu_product is None and len(self.gpu_products) == 1:
            object.__setattr__(self, "gpu_product", self.gpu_products[0])
        elif self.gpu_product and self.gpu_products != (self.gpu_product,):
            raise ValueError(f"gpu_product {self.gpu_product!r} disagrees with gpu_products {self.gpu_products!r}")

    @classmethod
    def of(cls, dep: InferenceDeployment) -> ReplicaShape:
        r = dep.spec.resources
        return cls(r.accelerator, None, r.tensor_parallel_size, r.mig_profile, r.cpu_cores, r.gpu_products)

    @property
    def kind(self) -> str:
        """``cpu``, ``mig`` (one MIG instance) or ``gpus`` (whole GPUs in one NVLink domain, or a gang)."""
        if self.accelerator == "cpu":
            return "cpu"
        return "mig" if self.mig_profile else "gpus"

    def describe(self, product: str | None = None, gang: GangShape | None = None) -> str:
        """``2 whole GPUs of NVIDIA H100 80GB HBM3 in one NVLink domain``, ``1 MIG 3g.40gb
        instance``, ``16 whole GPUs of ... as a gang of 2 nodes x 8 GPUs in one NVLink domain``."""
        product = product or self.gpu_product or (f"one of {', '.join(self.gpu_products)}" if self.gpu_products
                                                   else None)
        if self.kind == "cpu":
            return f"{self.cpu_cores} CPU core(s)"
        if self.kind == "mig":
            return f"1 MIG {self.mig_profile} instance" + (f" of {product}" if product else "")
        n = self.tensor_parallel_size
        what = f"{n} whole GPU{'s' if n > 1 else ''} of {product or 'one product'}"
        if gang is not None:
            return what + f" as a gang of {gang.nodes} nodes x {gang.per_node} GPUs in one NVLink domain"
        return what + (" in one NVLink domain" if n > 1 else "")


@dataclass(frozen=True)
class Assignment:
    """One node's share of one replica."""

    node: str
    devices: tuple[str, ...]                      # device ids held: GPU/MIG UUIDs, "cpu:N"
    env: dict[str, str] = field(default_factory=dict)
    label: str = ""                               # for humans: "gpu:0,1", "mig:3g.40gb@gpu0", "cpu:0"
    domain: str = ""                              # "nvlink0" (NVLink domain of the node), "gpu3" (MIG parent)
    exclusive: bool = True                        # False when devices are shared with other replicas


@dataclass(frozen=True)
class ReplicaPlacement:
    """Where one replica runs: one assignment, or one per node of a gang (members[0] leads)."""

    members: tuple[Assignment, ...]
    product: str | None = None

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for m in self.members for d in m.devices)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(m.node for m in self.members)

    @property
    def env(self) -> dict[str, str]:
        """The lead member's environment (a local replica has only one member)."""
        return self.members[0].env

    @property
    def label(self) -> str:
        if len(self.members) == 1:
            return self.members[0].label
        return " + ".join(f"{m.node}:{m.label}" for m in self.members)

    @property
    def exclusive(self) -> bool:
        return all(m.exclusive for m in self.members)

    def to_dict(self) -> dict:
        """JSON-ready form (the controller's state file); `from_dict` reads it back."""
        return {"product": self.product, "members": [
            {"node": m.node, "devices": list(m.devices), "env": dict(m.env), "label": m.label, "domain": m.domain,
             "exclusive": m.exclusive} for m in self.members]}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> ReplicaPlacement:
        return cls(tuple(Assignment(m["node"], tuple(m["devices"]), dict(m.get("env") or {}), m.get("label", ""),
                                    m.get("domain", ""), bool(m.get("exclusive", True))) for m in d["members"]),
                   d.get("product"))  # fmt: skip


@dataclass(frozen=True)
class Unplaceable:
    reason: str


WARM = 3
"""`PlacementRequest.warmth` of a node that holds the engine image and the weights."""


@functools.lru_cache(maxsize=4096)
def canonical_source(source: str) -> str:
    """``spec.model.source`` as caches report it (the ``canonical`` of `fleet.sources.parse_source`), or
    as written when it is no cacheable source (``sim://``, a relative path)."""
    if "://" not in source and not source.startswith("/"):
        return source
    try:
        return parse_source(source).canonical
    except SourceError:
        return source


@dataclass(frozen=True)
class PlacementRequest:
    """A scale-up: ``count`` more replicas of one deployment version, decided together.

    ``existing`` holds the placements of the version's live replicas (they fix the product and
    gang width, and count toward spreading); ``warm_nodes`` are nodes known to hold the engine
    image and the weights (the controller passes nodes that run a replica of this very spec); a
    node whose ``cached`` set (what its node agent or backend reports:
    `fleet.agent.cache.WeightCache.cached_sources`, the images in ``Node.status.images``) holds both
    ``image`` and ``model_source`` is warm too (the source as written or in its canonical form,
    `canonical_source`, which is how caches report it: ``hf://org/name`` is
    ``hf://org/name@main``). With
    ``all_or_nothing`` nothing is placed unless all ``count`` replicas fit. ``memory`` (the
    model's `fleet.models.memory.MemoryNeed` at the shape's TP size; None: not known) makes
    placement skip a product or MIG profile whose per-device memory cannot hold the weights and
    one ``max_model_len`` sequence (`fleet.placement.explain.memory_reason`), and refuse every
    replica when vLLM refuses its ``--max-model-len`` for the model
    (`fleet.models.memory.MemoryNeed.max_len_problem`). ``cuda`` is what the
    engine needs of a node's driver (`fleet.placement.compat.CudaNeed`, from ``engine.cudaVersion``
    or the image; None: no driver check): a node whose driver cannot run it takes no replica
    (`node_excluded`). ``fill_shapes`` are the GPUs per replica (TP widths) that other
    deployments of the product ask for (the controller fills it from its deployments): with
    them, ``fleet`` avoids a slot that would be left with free GPUs too few for any of those
    shapes or this one (`strands`), so fewer GPUs end up stranded.
    """

    shape: ReplicaShape
    count: int = 1
    deployment: str = ""
    existing: tuple[ReplicaPlacement, ...] = ()
    warm_nodes: frozenset[str] = frozenset()
    image: str | None = None
    model_source: str | None = None
    all_or_nothing: bool = False
    memory: MemoryNeed | None = None
    cuda: CudaNeed | None = None
    fill_shapes: tuple[int, ...] = ()

    def strands(self, capacity: int) -> bool:
        """Whether taking this replica from a slot with ``capacity`` free units strands GPUs:
        it leaves some free, fewer than the narrowest of ``fill_shapes`` and this shape's width.
        Leftover-aware best fit (``fleet``) prefers slots where this is False, then the fewest
        free units. Always False without ``fill_shapes`` (nothing known of the other
        deployments) and for MIG and CPU shapes."""
        if not self.fill_shapes or self.shape.kind != "gpus":
            return False
        need = self.shape.tensor_parallel_size
        return 0 < capacity - need < min(min(self.fill_shapes), need)

    @classmethod
    def for_deployment(cls, dep: InferenceDeployment, count: int, existing: Iterable[ReplicaPlacement] = (),
                       warm_nodes: Iterable[str] = (), all_or_nothing: bool = False,
                       memory: MemoryNeed | None = None) -> PlacementRequest:
        shape = ReplicaShape.of(dep)
        engine = dep.spec.engine
        cuda = engine.cuda if shape.kind != "cpu" else None
        return cls(
            shape=shape, count=count, deployment=dep.name, existing=tuple(existing),
            warm_nodes=frozenset(warm_nodes), image=engine.image,
            model_source=dep.spec.model.source, all_or_nothing=all_or_nothing, memory=memory,
            cuda=CudaNeed(cuda[0], cuda[1], engine.cuda_compatibility == "minor-version") if cuda else None,
        )

    def node_excluded(self, node: NodeInventory) -> str | None:
        """Why ``node`` can take no replica of this request whatever is free on it (its driver
        cannot run the engine's CUDA: `fleet.placement.compat.node_reason`), or None. Names no node."""
        return node_reason(node, self.cuda) if self.cuda is not None else None

    def warmth(self, node: NodeInventory) -> int:
        """What ``node`` holds of what the replica needs: `WARM` (3: the weights and the image,
        or a node in ``warm_nodes``), 2 the weights only, 1 the image only (or no image named and
        no weights), 0 nothing. Placement prefers warmer nodes; weights count above the image (a
        model's weights are usually larger than the engine image, and an image can be pre-pulled
        ahead of need: fleet/k8s/prepull.py)."""
        if node.name in self.warm_nodes:
            return WARM
        image = self.image is None or self.image in node.cached
        # Nodes report sources canonical (the cache, the agent's annotation) or as a spec writes
        # them (an inventory file): two set lookups, not a scan of every image a node lists.
        weights = self.model_source is not None and (
            self.model_source in node.cached or canonical_source(self.model_source) in node.cached
            or redact_source(canonical_source(self.model_source)) in node.cached)   # an agent publishes it redacted
        return 2 * weights + image

    def is_warm(self, node: NodeInventory) -> bool:
        """Whether ``node`` holds the image and the weights (`warmth` is `WARM`)."""
        return self.warmth(node) == WARM


@dataclass(frozen=True)
class NodeClass:
    """Nodes that cannot take the replica for the same reason."""

    reason: str
    nodes: tuple[str, ...]

    def describe(self, examples: int = 3) -> str:
        """``3 nodes: at most 2 free GPUs in one NVLink domain, need 4 [a, b, c]``."""
        n = len(self.nodes)
        shown = ", ".join(self.nodes[:examples]) + (", ..." if n > examples else "")
        return f"{n} node{'s' if n != 1 else ''}: {self.reason} [{shown}]"


@dataclass(frozen=True)
class MigAdvice:
    """A proposal (never an action) to repartition one GPU so it offers more MIG instances.

    ``keep`` are instances that stay (in use or not), ``destroy`` the idle instances to remove,
    ``create`` the new instances (profile and start slot); the resulting geometry is valid for
    the GPU's model (checked with `fleet.inventory.mig.check_geometry`).
    """

    node: str
    gpu_index: int
    gpu_uuid: str
    product: str
    enable_mig: bool
    keep: tuple[MigSlot, ...]
    destroy: tuple[str, ...]          # MIG UUIDs
    create: tuple[MigSlot, ...]
    gain: int                          # new instances of the requested profile
    profile_ids: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        steps = []
        if self.enable_mig:
            steps.append("enable MIG mode")
        if self.destroy:
            steps.append(f"destroy {len(self.destroy)} idle instance(s)")
        steps.append("create " + ", ".join(str(s) for s in self.create))
        return f"{self.node} GPU{self.gpu_index} ({self.product}): {'; '.join(steps)} -> +{self.gain}"

    def commands(self) -> list[str]:
        """nvidia-smi commands that would apply it (MIG user guide, "Getting Started with MIG";
        ``-cgi ID:start`` places a GPU instance at a start slot). Only idle instances are
        destroyed; the kept ones are never touched."""
        out = []
        gpu = f"-i {self.gpu_index}"
        if self.enable_mig:
            out.append(f"nvidia-smi {gpu} -mig 1")
        if self.destroy and not self.keep:
            out.append(f"nvidia-smi mig {gpu} -dci && nvidia-smi mig {gpu} -dgi")
        elif self.destroy:
            out.append(f"# destroy only the idle instances {', '.join(self.destroy)}: nvidia-smi mig {gpu} -dci -gi ID "
                       f"&& nvidia-smi mig {gpu} -dgi -gi ID for each (IDs from nvidia-smi mig {gpu} -lgi)")
        tuples = ",".join(f"{self.profile_ids.get(s.profile, s.profile)}:{s.start}" for s in self.create)
        out.append(f"nvidia-smi mig {gpu} -cgi {tuples} -C")
        return out


@dataclass(frozen=True)
class PlacementPlan:
    """The answer to a `PlacementRequest`: where each placed replica goes, and for the rest, why
    not (by node class) and what MIG repartitioning would help. ``skipped`` lists, placed or
    not, the nodes the request could not use at all (a driver that cannot run the engine's CUDA:
    `PlacementRequest.node_excluded`) by reason; when replicas are left, ``reasons`` holds them too."""

    request: PlacementRequest
    placements: tuple[ReplicaPlacement, ...] = ()
    product: str | None = None                   # the one product every replica uses
    reasons: tuple[NodeClass, ...] = ()
    advice: tuple[MigAdvice, ...] = ()
    strategy: str = ""
    note: str = ""                               # a reason that is not about nodes (all-or-nothing, no nodes)
    gang: GangShape | None = None                # set when each replica spans several nodes
    skipped: tuple[NodeClass, ...] = ()          # nodes excluded whatever is free on them, by reason

    @property
    def unplaced(self) -> int:
        return self.request.count - len(self.placements)

    @property
    def complete(self) -> bool:
        return self.unplaced == 0

    def explain(self) -> str:
        """Why replicas were left unplaced, in one line; empty when all were placed."""
        if self.complete:
            return ""
        n = self.request.count
        head = (f"cannot place {self.unplaced} of {n} replica{'s' if n != 1 else ''} "
                f"({self.request.shape.describe(self.product, self.gang)})")
        parts = [self.note] if self.note else []
        parts += [c.describe() for c in self.reasons]
        return head + (": " + "; ".join(parts) if parts else "")
