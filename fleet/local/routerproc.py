"""The router process of a local fleet: started, adopted after a controller restart, watched and
restarted when it dies, stopped last.

Owns `RouterProcess`: the router's process record (``<state dir>/router.json``: pid and start
time, so a reused pid is not mistaken for it), its admin token (``admin-token``, kept while the
router lives so a new controller can adopt it), and the check that it still answers. The router
is started as ``python -m router`` in its own session and is not tied to the controller's life:
while no controller runs it keeps serving the pools it last received. Used by `fleet up` and
`fleet down` (fleet.local.up).

The listening socket outlives the router process: `RouterProcess` binds it once and hands it to
every router it starts (``--fd``, inherited), keeping its own copy open. While a dead router is
replaced, the kernel completes new connections into the socket's backlog and the next router
accepts them: a client is never refused, only the streams in flight on the dead process are cut.
(``SO_REUSEPORT`` with an overlap would need the next router up before the old one goes, which a
crash does not allow, and a dead listener's queued connections are reset with it.) A router
adopted from a previous controller holds the only copy of its socket; when it dies, the port is
bound again and handed on from then. The admin token outlives the router process too: a
restarted router gets the token of the one it replaces (held in memory), so the token file, the
controller and `fleet status` stay right however full the disk is.
Owns `PickerProcess` too: the endpoint picker (``python -m router.picker``, docs/routing.md
"Endpoint picker") that the router asks for its picks when `fleet up` runs one (``--picker-port``);
recorded in ``<state dir>/picker.json``, adopted, watched and restarted as the router is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import sys
import time
from pathlib import Path

from fleet.local.failsoft import log_target
from fleet.local.procs import LocalProcesses, ProcessRecord, find_marked, read_log_tail, start_ticks
from fleet.controller.router_admin import RouterAdminClient
from fleet.local.state import StateStore, write_atomically

log = logging.getLogger("fleet.local.routerproc")


ROUTER_MARK_ENV = "FLEET_ROUTER_OF"
"""The router's marker: the fleet id (apart from engines' ``FLEET_FLEET_ID``, which names replicas)."""
URL_ENV = "FLEET_ROUTER_URL"


class RouterStartError(Exception):
    """The router did not come up; the message holds why and the end of its log."""


ROUTER_MODELS_FILE = "router-models.json"
"""The router's models file in the state directory, beside ``admin-token`` (`router.http.remembered`):
a restarted router answers 503 + Retry-After for the models it lists until they are published again."""


LISTEN_BACKLOG = 2048
"""Connections the listening socket queues while no router accepts (uvicorn's default backlog):
at 30 new connections a second, a minute of router restarts."""


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (``SO_REUSEADDR``, backlog `LISTEN_BACKLOG`).
    Raises OSError (EADDRINUSE: the port is taken)."""
    return socket.create_server((host, port), backlog=LISTEN_BACKLOG)


class _Supervised:
    """What `RouterProcess` and `PickerProcess` share: the process ``record`` (None: not started),
    ``processes`` (the spawner), the count of ``restarts``, and the restart of a process gone.
    Subclasses give ``what`` (its name in logs) and ``start``."""

    what = "process"
    record: ProcessRecord | None
    processes: LocalProcesses
    restarts: int

    async def start(self, timeout_s: float = 30.0) -> None:
        raise NotImplementedError

    def alive(self) -> bool:
        return self.record is not None and self.processes.poll(self.record)[0]

    async def ensure_running(self) -> bool:
        """Restart the process if it is gone. True when it was restarted. Raises RouterStartError
        when it will not start."""
        if self.alive():
            return False
        log.warning("the %s (pid %s) is gone: restarting it", self.what, self.record.pid if self.record else "?")
        await self.start()
        self.restarts += 1
        return True

    async def _terminate(self, grace_s: float) -> None:
        """SIGTERM the process, SIGKILL it if it still runs after ``grace_s``; forget the record."""
        if self.record is None:
            return
        self.processes.stop(self.record)
        deadline = time.monotonic() + grace_s
        while self.processes.poll(self.record)[0] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.processes.poll(self.record)[0]:
            self.processes.kill(self.record)
        self.record = None


class RouterProcess(_Supervised):
    """The router of the fleet in ``store``, listening on ``host:port`` through a socket this
    object holds (port 0: a free one, chosen at the first start). A restarted router's pools are
    empty: the caller of `ensure_running` republishes them."""

    what = "router"

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
        self.starts = 0     # router processes started by this object (the supervisor republishes after each)
        self._unpersisted: str | None = None   # the token of a started router whose files are not written yet
        self._record_lost = False              # router.json was missing or unreadable: found by its marker
        self.listener: socket.socket | None = None   # bound at the first start, handed to each router
        self.token: str | None = None          # the admin token of the router in use
        self.picker: str | None = None         # HOST:PORT of the endpoint picker its pools ask (--picker); None: none

    # ----- adopt or start -----------------------------------------------------------------

    def recorded(self) -> ProcessRecord | None:
        """The recorded router process if it still runs (checked by identity) on this address;
        when ``router.json`` is missing or unreadable, the router process whose environment
        carries this fleet's marker and this address (`marked_router`)."""
        try:
            d = json.loads(self.record_path.read_text())
            if d.get("url") != self.url:
                return None
            record = ProcessRecord.from_dict(d["process"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            if not isinstance(err, FileNotFoundError):
                log.warning("ignoring unreadable %s: %s", self.record_path, err)
            self._record_lost = True   # written again once adopted
            return self.marked()
        return record if self.processes.is_ours(record) else None

    def marked(self) -> ProcessRecord | None:
        """The running router of this fleet on this address found by its marker, or None."""
        fleet_id = self._fleet_id()
        if fleet_id is None:
            return None
        for pid, env in find_marked(ROUTER_MARK_ENV, fleet_id).items():
            if env.get(URL_ENV) == self.url:
                ticks = start_ticks(pid)
                if ticks is not None:
                    return ProcessRecord(pid, ticks, (), str(self.log_path), 0.0)
        return None

    def _fleet_id(self) -> str | None:
        try:
            return (self.store.root / "fleet-id").read_text().strip() or None
        except OSError:
            return None

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
        self.token = token
        try:
            await self.admin.pools()   # the token is right and the admin API answers
        except Exception as err:  # noqa: BLE001 - any failure: not adoptable
            log.warning("recorded router pid %d does not answer as ours: %s", record.pid, err)
            return False
        self.record = record
        if self._record_lost:   # found by its marker: its record is written again
            self._unpersisted = token
            self.persist()
        return True

    async def start(self, timeout_s: float = 30.0) -> None:
        """Start a router on this object's listening socket (bound at the first start) with the
        admin token of the router it replaces (a new one at the first start), and wait for
        /health. Raises RouterStartError.

        The token and ``router.json`` are written before the wait; a write that fails does not
        stop the router (`persist` writes them later)."""
        listener = self._listen()
        token = self.token or secrets.token_urlsafe(32)
        self.token = token
        if self.admin is None:
            self.admin = RouterAdminClient(self.url, token)
        else:
            self.admin.set_token(token)   # one client: the controller and autoscaler hold it
        argv = [sys.executable, "-m", "router", "--host", self.host, "--port", str(self.port),
                "--fd", str(listener.fileno()), "--models-file", str(self.store.root / ROUTER_MODELS_FILE)]
        if self.picker is not None:
            argv += ["--picker", self.picker]
        try:
            env = {"FLEET_ROUTER_ADMIN_TOKEN": token, URL_ENV: self.url}
            fleet_id = self._fleet_id()
            if fleet_id:   # the marker: found again by `marked` when router.json is lost
                env[ROUTER_MARK_ENV] = fleet_id
            log_path, relay = log_target(self.log_path, self.store.write_errors, "router_log")
            self.record = self.processes.spawn(argv, env, log_path, pass_fds=(listener.fileno(),), relay=relay)
        except OSError as err:
            raise RouterStartError(f"cannot start the router: {err.strerror or err}") from err
        self.starts += 1
        self._unpersisted = token
        self.persist()
        await self._wait_healthy(timeout_s)

    def _listen(self) -> socket.socket:
        """This object's listening socket, bound now if it is not yet. Raises RouterStartError."""
        if self.listener is None:
            try:
                self.listener = listening_socket(self.host, self.port)
            except OSError as err:
                raise RouterStartError(f"cannot listen on {self.host}:{self.port}: {err.strerror or err}") from err
            self.port = self.listener.getsockname()[1]
            self.url = f"http://{self.host}:{self.port}"
        return self.listener

    async def _wait_healthy(self, timeout_s: float) -> None:
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

    def persist(self) -> bool:
        """Write the admin token and ``router.json`` of the router this process started, if they
        are not written yet (a full disk at its start). True when nothing is left to write."""
        token = self._unpersisted
        if token is None or self.record is None:
            return True
        errors = self.store.write_errors
        if not (errors.due("router_json") and errors.due("admin_token")):
            return False
        if not self.store.write_admin_token(token):
            return False
        text = json.dumps({"url": self.url, "process": self.record.to_dict()})
        if not errors.attempt("router_json", lambda: write_atomically(self.record_path, text, 0o644), force=True):
            return False
        self._unpersisted = None
        return True

    # ----- stop ---------------------------------------------------------------------------

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``; close the listening socket, forget the
        record and close the admin client."""
        if self.listener is not None:   # new connections are refused from here; the router drains
            self.listener.close()
            self.listener = None
        await self._terminate(grace_s)
        self._unpersisted = None
        try:
            self.record_path.unlink()
        except FileNotFoundError:
            pass
        except OSError as err:
            log.warning("cannot remove %s: %s", self.record_path, err)
        if self.admin is not None:
            await self.admin.aclose()
            self.admin = None
        try:   # a deliberate stop: the next router has no model to await
            (self.store.root / ROUTER_MODELS_FILE).unlink()
        except OSError:
            pass


def recorded_url(root: Path) -> str | None:
    """The URL in the router record under ``root`` (whether or not it still runs), or None."""
    try:
        url = json.loads((Path(root) / "router.json").read_text()).get("url")
    except (OSError, ValueError, AttributeError):
        return None
    return url if isinstance(url, str) else None


def router_record_alive(root: Path, processes: LocalProcesses | None = None) -> tuple[str, int] | None:
    """(url, pid) of the router recorded under the state directory ``root`` if its process still
    runs (checked by identity), else None. For `fleet status`."""
    try:
        d = json.loads((Path(root) / "router.json").read_text())
        record = ProcessRecord.from_dict(d["process"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return marked_router(root)
    return (d.get("url", "?"), record.pid) if (processes or LocalProcesses()).is_ours(record) else None


def marked_router(root: Path) -> tuple[str, int] | None:
    """(url, pid) of a running router whose environment carries the marker of the fleet of
    ``root`` (for when ``router.json`` is lost), else None."""
    try:
        fleet_id = (Path(root) / "fleet-id").read_text().strip()
    except OSError:
        return None
    for pid, env in sorted(find_marked(ROUTER_MARK_ENV, fleet_id).items()) if fleet_id else ():
        return env.get(URL_ENV, "?"), pid
    return None


class PickerProcess(_Supervised):
    """The endpoint picker of the fleet in ``store``, listening on ``host:port``: started before the
    router (which is given ``--picker HOST:PORT``), adopted by its record when a previous
    controller left it running, restarted when it dies (the routers reconnect and send their
    pools again; until then they pick for themselves), stopped after the router. ``metrics_port``:
    where it serves ``/metrics`` (``fleet_picker_*``), ``/ready`` and ``/healthz`` on ``host``
    (router/picker/metrics.py; None: not served); `metrics_url` is its base URL."""

    what = "endpoint picker"

    def __init__(self, store: StateStore, host: str, port: int, processes: LocalProcesses | None = None,
                 metrics_port: int | None = None) -> None:  # fmt: skip
        self.store = store
        self.address = f"{host}:{port}"
        self.host = host
        self.port = port
        self.metrics_port = metrics_port
        self.processes = processes or LocalProcesses()
        self.record_path = store.root / "picker.json"
        self.log_path = store.log_dir / "picker.log"
        self.record: ProcessRecord | None = None
        self.restarts = 0

    def adopt(self) -> bool:
        """Take over the recorded picker if it still runs (checked by identity) on this address."""
        try:
            d = json.loads(self.record_path.read_text())
            record = ProcessRecord.from_dict(d["process"]) if d.get("address") == self.address else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
        if record is None or not self.processes.is_ours(record):
            return False
        self.record = record
        self.metrics_port = d.get("metrics_port")   # what it serves, whatever this controller was given
        return True

    @property
    def metrics_url(self) -> str | None:
        """Base URL of the picker's ``/metrics``, or None when it serves none."""
        return f"http://{self.host}:{self.metrics_port}" if self.metrics_port else None

    async def start(self, timeout_s: float = 30.0) -> None:
        """Start the picker and wait until it accepts connections. Raises RouterStartError."""
        argv = [sys.executable, "-m", "router.picker", "--host", self.host, "--port", str(self.port)]
        if self.metrics_port:
            argv += ["--metrics-port", str(self.metrics_port)]
        try:
            log_path, relay = log_target(self.log_path, self.store.write_errors, "picker_log")
            self.record = self.processes.spawn(argv, {}, log_path, relay=relay)
        except OSError as err:
            raise RouterStartError(f"cannot start the endpoint picker: {err.strerror or err}") from err
        text = json.dumps({"address": self.address, "metrics_port": self.metrics_port,
                           "process": self.record.to_dict()})  # fmt: skip
        self.store.write_errors.attempt("picker_json", lambda: write_atomically(self.record_path, text, 0o644))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            alive, code = self.processes.poll(self.record)
            if not alive:
                tail = "\n".join(read_log_tail(self.log_path, 15))
                raise RouterStartError(f"endpoint picker exited with code {code}:\n{tail}")
            try:
                _, writer = await asyncio.open_connection(self.host, self.port)
            except OSError:
                await asyncio.sleep(0.1)
                continue
            writer.close()
            return
        raise RouterStartError(f"endpoint picker did not listen within {timeout_s:g} s (log: {self.log_path})")

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``; forget the record."""
        await self._terminate(grace_s)
        try:
            self.record_path.unlink()
        except OSError:
            pass


async def stop_recorded_picker(store: StateStore) -> bool:
    """Stop the endpoint picker recorded in ``store`` if it still runs (`fleet down` with no
    controller); True when there was one."""
    try:
        host, _, port = json.loads((store.root / "picker.json").read_text())["address"].rpartition(":")
        picker = PickerProcess(store, host, int(port))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    if not picker.adopt():
        return False
    await picker.stop()
    return True
