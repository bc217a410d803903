"""The protocol between the controller and whatever runs replicas: it speaks replicas, not processes.

Owns `ReplicaWant` (what the controller wants running: a replica of a deployment on a
placement), `ReplicaFacts` (what the backend observes about one replica: where it runs, its
endpoint, whether the image and the weights are on its node, whether the engine runs or exited
and why) and `Backend`. Ports, argv, pids, hosts and log paths belong to a backend; the
controller (`fleet.controller.reconcile`) sees replica ids, facts and endpoints only, so the local backend
(`fleet.local.backend`, child processes) and a Kubernetes backend (pods) plug in alike. Tests use
an in-memory fake (tests/support/fakes.py).

Every call is idempotent and non-blocking. `ensure` makes a replica run (starts it if the backend
has no record of it; never restarts one that exited: replacing a failed replica is the
controller's decision). `observe` lists every replica this fleet owns, including replicas
started by an earlier controller of the same fleet: that is how a restarted controller adopts
what still runs. Stopping is a request (`stop`), escalated by the controller with `kill` after a
grace period. Draining is not the backend's: the controller takes the endpoint out of the
router's pool and waits for its in-flight requests before it calls `stop`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from fleet.inventory import Inventory
    from fleet.placement import ReplicaPlacement
    from fleet.spec import InferenceDeployment


@dataclass(frozen=True)
class ReplicaWant:
    """One replica the controller wants running.

    ``spec_hash`` identifies what it serves (`fleet.spec.LoadedDeployment.serving_hash`): a backend labels the
    replica with it, and a restarted controller adopts a running replica only when it matches.
    ``base_dir`` is the directory of the deployment file (relative model paths).
    """

    replica_id: str
    deployment: InferenceDeployment
    placement: ReplicaPlacement
    spec_hash: str
    base_dir: Path


@dataclass(frozen=True)
class ReplicaFacts:
    """What a backend observed about one replica it owns, at one moment.

    ``endpoint``: base URL of the engine's OpenAI server (``http://host:port``), None until known.
    ``image_present`` / ``weights_present``: the engine image and the model weights are on the
    replica's node (the replica states PULLING and CACHING wait for them). ``running``: the
    engine process (container) runs. ``exited``: it ran and is gone; ``exit_code`` when known
    (None for a process this controller did not start, or a pod deleted under it) and
    ``exit_reason`` in words. ``problem``: why the backend cannot make the replica run at all
    (engine not installed, weights missing); the replica fails with it. ``detail``: backend
    specifics for people (pid, port, log path, pod name), shown by `fleet status`. ``sick``:
    why the backend saw the replica hold a device its node reports unhealthy (the Kubernetes
    backend reads which pod the device plugin gave a quarantined GPU); the controller drains and
    replaces it, as it does a replica whose placement names an unhealthy device. ``kv_events``:
    where a subscriber reaches the engine's KV cache events (vLLM's ``--kv-events-config``, which
    the backend gave it): ``{"publisher": address, "replay": address or None, "topic": str}``
    (`router.pools.spec.KvEventsSource`); None when the engine publishes none.
    ``unschedulable``: the scheduler's words while it cannot place the replica (a pod's
    ``PodScheduled`` condition False, reason ``Unschedulable``: ``0/4 nodes are available: 1
    Insufficient nvidia.com/gpu, ...``); None when placed or not known. The controller fails
    the replica once its start deadline passes with this set (`fleet.controller.health`).
    """

    replica_id: str
    deployment: str
    spec_hash: str
    node: str
    endpoint: str | None = None
    image_present: bool = False
    weights_present: bool = False
    running: bool = False
    exited: bool = False
    exit_code: int | None = None
    exit_reason: str | None = None
    problem: str | None = None
    detail: dict[str, str] = field(default_factory=dict)
    sick: str | None = None
    kv_events: dict[str, str | None] | None = None
    unschedulable: str | None = None


class LaunchError(Exception):
    """The backend could not start the replica at all (e.g. the executable is missing)."""


def engine_model(want: ReplicaWant) -> str:
    """The engine's model argument for ``want`` (`fleet.engines.kinds.EngineKind.model_argument`).
    Raises LaunchError naming the field when the weights are not where the spec says."""
    from fleet.engines.kinds import ModelUnavailable, get_engine

    dep = want.deployment
    try:
        return get_engine(dep.spec.engine.kind).model_argument(dep.engine_launch(want.base_dir))
    except ModelUnavailable as err:
        raise LaunchError(f"weights not present: spec.model.source {dep.spec.model.source!r}: {err}") from None


class Backend(Protocol):
    """Runs replicas. All methods are coroutines so that a backend may talk to an API server."""

    async def inventory(self) -> Inventory:
        """The nodes this backend can place replicas on, with their devices."""
        ...

    async def ensure(self, want: ReplicaWant) -> None:
        """Make the replica run on its placement: start it unless the backend already knows it
        (running or exited). Raises LaunchError when it cannot be started at all."""
        ...

    async def observe(self) -> dict[str, ReplicaFacts]:
        """Facts about every replica this fleet owns, by replica id (exited ones until `forget`)."""
        ...

    async def stop(self, replica_id: str) -> None:
        """Ask the replica's engine to exit (SIGTERM; a pod delete with its grace period). Idempotent."""
        ...

    async def kill(self, replica_id: str) -> None:
        """Force the replica's engine to exit now. Idempotent."""
        ...

    async def forget(self, replica_id: str) -> None:
        """Drop the record of an exited replica (the controller has seen it exit)."""
        ...

    async def log_tail(self, replica_id: str, lines: int = 20) -> list[str]:
        """The last ``lines`` lines of the replica's engine log ([] when there is none)."""
        ...
