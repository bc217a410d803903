"""The endpoint picker as a Kubernetes pod, alone or active-passive on a Lease.

Owns `serve_picker_pod`, run by `fleet endpoint-picker` (fleet/cli/k8s.py), the chart's picker
pods (charts/fleet/templates/router-picker.yaml). Without a Lease name it runs
`router.picker.service.PickerService` as `python -m router.picker` does. With one (HA, the chart's
`router.picker.ha`), every replica is a candidate for the coordination.k8s.io/v1 Lease
``<namespace>/<lease>``: the operator's own election (`fleet.k8s.lease.LeaderElector`, renewed on a
thread of its own by `fleet.k8s.lease.LeaseKeeper`), with client-go's leaderelection defaults
(k8s.io/client-go/tools/leaderelection: LeaseDuration 15 s, RenewDeadline 10 s, RetryPeriod 2 s).
The picker answers picks only while `LeaderElector.holds` (its last renewal younger than the renew
deadline, so an old leader stops answering before a standby can take over); a standby declines
every pick (the routers pick alone) and its `/ready` is 503, so the picker Service's Endpoints hold
the leader alone. On SIGTERM the Lease is released, so a standby takes over at its next round
instead of a whole lease later.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass

from fleet.k8s.client import Kube
from fleet.k8s.lease import LeaderElector, LeaseKeeper

log = logging.getLogger(__name__)

LEASE_DURATION_S = 15.0
RENEW_DEADLINE_S = 10.0
RETRY_PERIOD_S = 2.0
"""client-go leaderelection's defaults (LeaseDuration, RenewDeadline, RetryPeriod), as the
operator's election uses them (fleet/k8s/operator.py)."""


@dataclass(frozen=True)
class PickerLease:
    """Which Lease the picker replicas share, and its timing (seconds). Raises ValueError (from
    `LeaderElector`) unless 0 < renew_deadline_s < lease_duration_s; `retry_period_s` must be > 0."""

    name: str
    namespace: str
    identity: str = ""                       # empty: the host name (the pod's name)
    lease_duration_s: float = LEASE_DURATION_S
    renew_deadline_s: float = RENEW_DEADLINE_S
    retry_period_s: float = RETRY_PERIOD_S

    def __post_init__(self) -> None:
        if not self.retry_period_s > 0:
            raise ValueError(f"--retry-period-s must be > 0 seconds, not {self.retry_period_s:g}")
        if not 0 < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError(f"--renew-deadline-s ({self.renew_deadline_s:g} s) must be above 0 and below "
                             f"--lease-duration-s ({self.lease_duration_s:g} s)")  # fmt: skip


def elector_for(kube: Kube, lease: PickerLease) -> LeaderElector:
    """The picker's candidate for `lease` on `kube`, on the process's clocks."""
    return LeaderElector(kube, lease.namespace, lease.name, lease.identity or socket.gethostname(),
                         clock=time.monotonic, wall=time.time, lease_duration_s=lease.lease_duration_s,
                         renew_deadline_s=lease.renew_deadline_s)  # fmt: skip


async def serve_picker_pod(host: str, port: int, metrics_port: int | None, lease: PickerLease | None,
                           kube: Kube | None = None) -> None:  # fmt: skip
    """Serve the picker until SIGTERM or SIGINT (`router.picker.__main__.serve`). With `lease`,
    answer picks only while holding it; `kube` (default `fleet.k8s.client.KubeClient.load`: the
    pod's service account) reads and writes the Lease. Raises ValueError when there are no API
    credentials, OSError when a port cannot be bound."""
    from router.picker.__main__ import serve
    from router.picker.service import PickerService

    if lease is None:
        await serve(PickerService(), host, port, metrics_port)
        return
    own_kube = None
    if kube is None:
        from fleet.k8s.client import KubeClient

        kube = own_kube = KubeClient.load_for("--lease")
    elector = elector_for(kube, lease)
    keeper = LeaseKeeper(elector, lease.retry_period_s,
                         lambda: log.warning("%s %s the picker lease %s", elector.identity,
                                             "holds" if elector.is_leader else "lost", lease.name))  # fmt: skip
    keeper.start()
    try:
        await serve(PickerService(leading=elector.holds), host, port, metrics_port)
    finally:
        await asyncio.to_thread(keeper.stop)   # gives the Lease up: a standby takes over at its next round
        if own_kube is not None:
            own_kube.close()
