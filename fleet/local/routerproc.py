"""The router process of a local fleet: started, adopted after a controller restart, watched and
restarted when it dies, stopped last.

Owns `RouterProcess`: the router's process record (``<state dir>/router.json``: pid and start
time, so a reused pid is not mistaken for it), its admin token (``admin-token``, kept while the
router lives so a new controller can adopt it), and the check that it still answers. The router
is started as ``python -m router`` in its own session and is not tied to the controller's life:
while no controller runs it keeps serving the pools it last received. Used by `fleet up` and
`fleet down` (fleet.local.up).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path

from fleet.local.procs import LocalProcesses, ProcessRecord, read_log_tail
from fleet.controller.router_admin import RouterAdminClient
from fleet.local.state import StateStore

log = logging.getLogger("fleet.local.routerproc")


class RouterStartError(Exception):
    """The router did not come up; the message holds why and the end of its log."""


ROUTER_MODELS_FILE = "router-models.json"
"""The router's models file in the state directory, beside ``admin-token`` (`router.remembered`):
a restarted router answers 503 + Retry-After for the models it lists until they are published again."""


class RouterProcess:
    """The router of the fleet in ``store``, listening on ``host:port``."""

    def __init__(self, store: StateStore, host: str, port: int, processes: LocalProcesses | None = None) -> None:
        self.store = store
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}"
        self.processes = processes or LocalProcesses()
        self.record_path = store.root / "router.json"
        self.log_path = store.log_dir / "router.log"
        self.record: ProcessRecord | None = None
        self.admin: RouterAdminClient | None = None
        self.restarts = 0

    # ----- adopt or start -----------------------------------------------------------------

    def recorded(self) -> ProcessRecord | None:
        """The recorded router process if it still runs (checked by identity) on this address."""
        try:
            d = json.loads(self.record_path.read_text())
        except (OSError, ValueError):
            return None
        if d.get("url") != self.url:
            return None
        record = ProcessRecord.from_dict(d["process"])
        return record if self.processes.is_ours(record) else None

    async def adopt(self) -> bool:
        """Take over the running router of a previous controller: True when its process is ours
        and it answers /health with the recorded token's fleet."""
        record = self.recorded()
        token = self.store.admin_token()
        if record is None or token is None:
            return False
        if self.admin is None:
            self.admin = RouterAdminClient(self.url, token)
        else:
            self.admin.set_token(token)
        try:
            await self.admin.pools()   # the token is right and the admin API answers
        except Exception as err:  # noqa: BLE001 - any failure: not adoptable
            log.warning("recorded router pid %d does not answer as ours: %s", record.pid, err)
            return False
        self.record = record
        return True

    async def start(self, timeout_s: float = 30.0) -> None:
        """Start a new router with a new admin token and wait for /health. Raises RouterStartError."""
        token = self.store.new_admin_token()
        if self.admin is None:
            self.admin = RouterAdminClient(self.url, token)
        else:
            self.admin.set_token(token)   # one client: the controller and autoscaler hold it
        argv = [sys.executable, "-m", "router", "--host", self.host, "--port", str(self.port),
                "--models-file", str(self.store.root / ROUTER_MODELS_FILE)]
        try:
            self.record = self.processes.spawn(argv, {"FLEET_ROUTER_ADMIN_TOKEN": token}, self.log_path)
        except OSError as err:
            raise RouterStartError(f"cannot start the router: {err.strerror or err}") from err
        self._save()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            alive, code = self.processes.poll(self.record)
            if not alive:
                tail = "\n".join(read_log_tail(self.log_path, 15))
                raise RouterStartError(f"router exited with code {code}:\n{tail}")
            if await self.admin.healthy():
                return
            await asyncio.sleep(0.2)
        raise RouterStartError(f"router did not answer /health within {timeout_s:g} s (log: {self.log_path})")

    # ----- watch --------------------------------------------------------------------------

    def alive(self) -> bool:
        return self.record is not None and self.processes.poll(self.record)[0]

    async def ensure_running(self) -> bool:
        """Restart the router if its process is gone. True when it was restarted (its pools are
        empty: the caller republishes them). Raises RouterStartError when it will not start."""
        if self.alive():
            return False
        log.warning("the router (pid %s) is gone: restarting it", self.record.pid if self.record else "?")
        await self.start()
        self.restarts += 1
        return True

    # ----- stop ---------------------------------------------------------------------------

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``; forget the record and close the admin client."""
        if self.record is not None:
            self.processes.stop(self.record)
            deadline = time.monotonic() + grace_s
            while self.processes.poll(self.record)[0] and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            if self.processes.poll(self.record)[0]:
                self.processes.kill(self.record)
            self.record = None
        try:
            self.record_path.unlink()
        except FileNotFoundError:
            pass
        if self.admin is not None:
            await self.admin.aclose()
            self.admin = None
        try:   # a deliberate stop: the next router has no model to await
            (self.store.root / ROUTER_MODELS_FILE).unlink()
        except OSError:
            pass

    def _save(self) -> None:
        tmp = self.record_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"url": self.url, "process": self.record.to_dict()}))
        os.replace(tmp, self.record_path)


def router_record_alive(root: Path, processes: LocalProcesses | None = None) -> tuple[str, int] | None:
    """(url, pid) of the router recorded under the state directory ``root`` if its process still
    runs (checked by identity), else None. For `fleet status`."""
    try:
        d = json.loads((Path(root) / "router.json").read_text())
        record = ProcessRecord.from_dict(d["process"])
    except (OSError, ValueError, KeyError):
        return None
    return (d.get("url", "?"), record.pid) if (processes or LocalProcesses()).is_ours(record) else None
