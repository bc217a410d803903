"""The state directory of a local fleet: where `fleet up` records what it runs, and where
`fleet status` and `fleet down` read it.

Owns the layout of the directory (``state.json``: the controller's targets and replica records,
read back by the next `fleet up`; ``admin-token``; ``fleet-id``; ``replica-ids.json``: the next
replica number of each deployment, so an id is never used twice in the life of the directory;
``events.jsonl``: every replica transition, kept after `fleet status` stops showing the replica;
``logs/``; ``up.lock``: the lock that allows one `fleet up` per directory, holding its pid; the
local backend's ``replicas.json`` and the router's ``router.json`` belong to their owners), atomic
writes of the state snapshot, and the strict read of it (`StateUnreadable`).

Every write here fails soft (`fleet.local.failsoft.WriteErrors`, one per store: counted, logged,
tried again after a backoff; never raised): a full disk must not stop a fleet that serves.

Default directory: ``$FLEET_STATE_DIR``, else ``$XDG_STATE_HOME/fleet``, else
``~/.local/state/fleet`` (XDG Base Directory spec).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import secrets
import time
from pathlib import Path

from fleet.local.failsoft import WriteErrors

log = logging.getLogger("fleet.local.state")

FLEET_ID_ENV = "FLEET_FLEET_ID"
"""The marker every process of a fleet carries in its environment (its value: the fleet id)."""

_REPLICA_ID = re.compile(r"^(?P<deployment>.+)-(?P<index>\d+)$")


def default_state_dir() -> Path:
    if os.environ.get("FLEET_STATE_DIR"):
        return Path(os.environ["FLEET_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "fleet"


class AlreadyRunning(Exception):
    """Another `fleet up` holds this state directory."""


class StateUnreadable(Exception):
    """The state file exists but cannot be read or parsed. ``path``: the file; ``reason``: why
    (the OS error or the JSON error with its position)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"state file {path} is unreadable: {reason}")
        self.path = path
        self.reason = reason


def write_atomically(path: Path, text: str, mode: int | None = None) -> None:
    """Write ``text`` to ``path`` through a temp file and a rename (readers see the old or the
    new file, never half of one); ``mode``: the new file's permissions. Raises OSError (the
    temp file is removed)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if mode is None else mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


class StateStore:
    """Files of one local fleet under ``root``. ``write_errors``: where failed writes are counted
    (shared with the backend, the router supervisor and the output streams of one `fleet up`)."""

    def __init__(self, root: Path, write_errors: WriteErrors | None = None) -> None:
        self.root = Path(root)
        self.state_path = self.root / "state.json"
        self.token_path = self.root / "admin-token"
        self.ids_path = self.root / "replica-ids.json"
        self.events_path = self.root / "events.jsonl"
        self.lock_path = self.root / "up.lock"
        self.log_dir = self.root / "logs"
        self.write_errors = write_errors or WriteErrors()
        self._lock_file = None
        self._extra: dict = {}
        self._next_index: dict[str, int] | None = None   # as last written to replica-ids.json

    # ----- the lock -------------------------------------------------------------------------

    def acquire(self) -> None:
        """Take the directory for this process (its pid goes into the lock file). Raises
        AlreadyRunning naming the holder's pid."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)
        f = open(self.lock_path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise AlreadyRunning(
                f"`fleet up` is already running with state in {self.root} (pid {self.holder_pid() or '?'}); "
                "run `fleet down` first or pass another --state-dir"
            ) from None
        try:   # who holds it, for `fleet down` and `fleet status` when state.json is unreadable
            f.seek(0)
            f.truncate()
            f.write(str(os.getpid()))
            f.flush()
        except OSError as err:
            self.write_errors.failed("lock", err)
        self._lock_file = f

    def release(self) -> None:
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    def holder_pid(self) -> int | None:
        """The pid of the `fleet up` that holds the lock now, or None when nobody holds it (read
        from the lock itself, not from state.json: it works when the state file does not)."""
        try:
            with open(self.lock_path) as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    text = f.read().strip()
                    return int(text) if text.isdigit() else None
                fcntl.flock(f, fcntl.LOCK_UN)
                return None
        except OSError:
            return None

    # ----- identity and the router's token ------------------------------------------------

    def fleet_id(self) -> str:
        """This state directory's fleet id (made once): the marker in the environment of every
        process the fleet starts, so a restarted controller finds them (`fleet.local.backend`).
        Raises OSError when it must be made and cannot be written."""
        path = self.root / "fleet-id"
        try:
            return path.read_text().strip()
        except FileNotFoundError:
            self.root.mkdir(parents=True, exist_ok=True)
            fid = secrets.token_hex(8)
            write_atomically(path, fid, 0o644)
            return fid

    def admin_token(self) -> str | None:
        """The router admin token in use, or None when there is none."""
        try:
            return self.token_path.read_text().strip() or None
        except OSError:
            return None

    def write_admin_token(self, token: str) -> bool:
        """Persist the router admin token (readable by this user only, written atomically: a
        failed write leaves the previous file whole). False when it could not be written
        (counted under ``admin_token``; the caller tries again)."""
        return self.write_errors.attempt("admin_token", lambda: write_atomically(self.token_path, token, 0o600))

    # ----- the state snapshot ---------------------------------------------------------------

    def set_extra(self, **fields) -> None:
        """Fields merged into every snapshot written (pid, router URL, phase...)."""
        self._extra.update(fields)

    def save(self, snapshot: dict, *, force: bool = False) -> bool:
        """Write the snapshot atomically (temp file + rename), with this store's write errors
        (``control_write_errors``) in it. Never raises: a failed write is counted under
        ``state`` and tried again with the next snapshot once its backoff is over (``force``:
        now; the last complete file stays in place meanwhile). True when written. Also keeps
        ``replica-ids.json`` at the highest replica number any deployment reached."""
        self._keep_replica_numbers(snapshot)
        if not force and not self.write_errors.due("state"):
            self.write_errors.dropped("state")
            return False
        data = {**snapshot, **self._extra, "updated_at_unix": time.time(),
                "control_write_errors": self.write_errors.snapshot()}  # fmt: skip
        text = json.dumps(data, indent=1, default=str)
        return self.write_errors.attempt("state", lambda: write_atomically(self.state_path, text, 0o644), force=force)

    def read(self) -> dict | None:
        """The last snapshot, or None when there is none.

        Raises StateUnreadable when the file exists but cannot be read, is not JSON (truncated by
        a full disk, edited by hand), is not a JSON object, or its ``deployments`` is not an
        object or its ``replicas`` not a list: no silent fresh start."""
        try:
            text = self.state_path.read_text()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as err:
            raise StateUnreadable(self.state_path, str(err)) from err
        try:
            data = json.loads(text)
        except ValueError as err:
            raise StateUnreadable(self.state_path, f"not JSON ({err}; {len(text)} bytes)") from err
        if not isinstance(data, dict):
            raise StateUnreadable(self.state_path, f"not a JSON object but {type(data).__name__}")
        for key, kind in (("deployments", dict), ("replicas", list)):
            if not isinstance(data.get(key, kind()), kind):
                raise StateUnreadable(self.state_path, f"{key!r} is a {type(data[key]).__name__}, not a "
                                      f"{'JSON object' if kind is dict else 'list'}")  # fmt: skip
        return data

    def read_or_none(self) -> dict | None:
        """`read` for displays that go on without it (`fleet top`): None when unreadable (logged)."""
        try:
            return self.read()
        except StateUnreadable as err:
            log.warning("%s", err)
            return None

    # ----- replica numbers and events -------------------------------------------------------

    def replica_numbers(self) -> dict[str, int]:
        """Deployment -> the next replica number never used in this directory: the highest of
        ``replica-ids.json`` and of the replica logs under ``logs/`` (``<deployment>-<n>.log``,
        one per replica ever launched) plus one. Read when state.json could not be."""
        numbers: dict[str, int] = {}
        try:
            for name, n in json.loads(self.ids_path.read_text()).items():
                numbers[str(name)] = int(n)
        except (OSError, ValueError, TypeError, AttributeError):
            pass
        try:
            logs = [p.stem for p in self.log_dir.glob("*.log")]
        except OSError:
            logs = []
        for stem in logs:
            m = _REPLICA_ID.match(stem)
            if m:
                numbers[m["deployment"]] = max(numbers.get(m["deployment"], 0), int(m["index"]) + 1)
        return numbers

    def _keep_replica_numbers(self, snapshot: dict) -> None:
        seen = {name: int(d.get("next_index", 0)) for name, d in (snapshot.get("deployments") or {}).items()
                if isinstance(d, dict)}  # fmt: skip
        if self._next_index is None:
            self._next_index = self.replica_numbers()
        merged = {**self._next_index, **{k: max(v, self._next_index.get(k, 0)) for k, v in seen.items()}}
        if merged == self._next_index:
            return
        if self.write_errors.attempt("replica_ids", lambda: write_atomically(self.ids_path, json.dumps(merged), 0o644)):
            self._next_index = merged

    def append_event(self, event: dict) -> None:
        """One line of ``events.jsonl`` (a replica transition, JSON with ``at_unix``). Fails soft
        (``events``); an event that cannot be written is lost, not retried."""
        line = json.dumps({"at_unix": round(time.time(), 3), **event}, default=str) + "\n"

        def append() -> None:
            with open(self.events_path, "a") as f:
                f.write(line)

        self.write_errors.attempt("events", append)
