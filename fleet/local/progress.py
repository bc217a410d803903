"""`fleet up`'s progress output: one line per replica transition and scaling decision, a
reminder for replicas slow to start, the engine's last log lines when one fails, a line when CPU
replicas come to share cores (`fleet.placement.cpu.cpu_sharing_notes`), and the line that says
every replica is READY.

Owns `ProgressPrinter`. Called by `fleet.local.up` (the controller's ``on_event``, the
autoscaler's ``on_decision``, after each tick); prints through a rich `Console`.
"""

from __future__ import annotations

import time

from rich.console import Console

from autoscaler.policy import Direction, ScalingDecision
from fleet.controller.lifecycle import ReplicaStatus
from fleet.controller.reconcile import Controller, ReplicaEvent
from fleet.placement.cpu import cpu_sharing_notes
from fleet.placement.shapes import ReplicaPlacement

_STYLE = {
    ReplicaStatus.READY: "bold green",
    ReplicaStatus.STANDBY: "cyan",
    ReplicaStatus.DRAINING: "yellow",
    ReplicaStatus.TERMINATED: "dim",
}


class ProgressPrinter:
    """Prints each replica transition, and a reminder every ``every_s`` for slow phases."""

    def __init__(self, console: Console, clock, every_s: float = 15.0) -> None:
        self.console = console
        self.clock = clock
        self.every_s = every_s
        self._last_note_s: dict[str, float] = {}
        self._all_ready_said = False
        self._sharing_said: list[str] = []

    def say(self, text: str, style: str = "") -> None:
        self.console.print(f"{time.strftime('%H:%M:%S')} {text}", style=style, highlight=False)

    def event(self, e: ReplicaEvent) -> None:
        style = "bold red" if e.new.failed() else _STYLE.get(e.new, "cyan")
        self.console.print(
            f"{time.strftime('%H:%M:%S')} {e.replica_id:<20} [{style}]{e.new.value:<16}[/] {e.detail}",
            highlight=False,
        )
        self._last_note_s[e.replica_id] = e.at_s

    def decision(self, deployment: str, d: ScalingDecision) -> None:
        """One line per scale-up or scale-down decision (holds are logged, not printed)."""
        if d.direction is Direction.HOLD:
            return
        style = "bold magenta" if d.direction is Direction.UP else "magenta"
        self.console.print(
            f"{time.strftime('%H:%M:%S')} {deployment:<20} [{style}]SCALE {d.direction.value.upper():<10}[/] "
            f"{d.previous} -> {d.desired} replica(s): {d.reason}: {d.detail}",
            highlight=False,
        )

    def failure_details(self, controller: Controller, e: ReplicaEvent) -> None:
        r = controller.replicas.get(e.replica_id)
        if r is None or r.failure is None or not r.failure.log_tail:
            return
        self.console.print(f"    last engine log lines ({r.detail.get('log', '-')}):", style="dim", highlight=False)
        for line in r.failure.log_tail[-8:]:
            self.console.print(f"    | {line}", style="dim", highlight=False, markup=False)

    def sharing(self, controller: Controller) -> None:
        """Say when CPU replicas come to share cores, or share them differently ("cpu (shared)
        on laptop: 3 replicas on 2 cores, they share CPU time")."""
        notes = cpu_sharing_notes(ReplicaPlacement.from_dict(r.placement) for r in controller.replicas.values()
                                  if r.placement is not None and not r.status.terminal())  # fmt: skip
        for note in notes:
            if note not in self._sharing_said:
                self.say(note, style="yellow")
        self._sharing_said = notes

    def tick(self, controller: Controller, router_url: str) -> None:
        now = self.clock()
        for r in controller.replicas.values():
            status = r.status
            if status not in (ReplicaStatus.PENDING, ReplicaStatus.PULLING, ReplicaStatus.CACHING,
                              ReplicaStatus.STARTING, ReplicaStatus.WARMING):
                continue
            if now - self._last_note_s.get(r.id, now) >= self.every_s:
                self._last_note_s[r.id] = now
                since = r.woke_at_s if r.woke_at_s is not None else r.launched_at_s or r.created_at_s
                since_s = now - since   # a woken replica: since its wake
                log_path = r.detail.get("log")
                where = f" (log: {log_path})" if log_path and status is ReplicaStatus.STARTING else ""
                if status is ReplicaStatus.CACHING:
                    where = f": {r.detail.get('cache', '')}"
                self.say(f"{r.id:<20} still {status.value} after {since_s:.0f} s{where}", style="dim")
        self.sharing(controller)
        want = 0 if controller.stopping else sum(ds.desired for ds in controller.deployments.values())
        ready = sum(1 for r in controller.replicas.values() if r.status is ReplicaStatus.READY)
        if want and ready == want and not self._all_ready_said:
            self._all_ready_said = True
            self.console.print(
                f"[bold green]All {ready} replica(s) READY.[/] OpenAI API: {router_url}/v1  "
                "(Ctrl-C or `fleet down` to stop)", highlight=False,
            )
        elif ready < want:
            self._all_ready_said = False
