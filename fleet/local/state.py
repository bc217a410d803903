"""The state directory of a local fleet: where `fleet up` records what it runs, and where
`fleet status` and `fleet down` read it.

Owns the layout of the directory (``state.json``: the controller's targets and replica records,
read back by the next `fleet up`; ``admin-token``; ``fleet-id``; ``logs/``; ``up.lock``; the
local backend's ``replicas.json`` and the router's ``router.json`` belong to their owners),
atomic writes of the state snapshot, and the lock that allows one `fleet up` per directory.
Default directory: ``$FLEET_STATE_DIR``, else ``$XDG_STATE_HOME/fleet``, else
``~/.local/state/fleet`` (XDG Base Directory spec).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import time
from pathlib import Path


def default_state_dir() -> Path:
    if os.environ.get("FLEET_STATE_DIR"):
        return Path(os.environ["FLEET_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "fleet"


class AlreadyRunning(Exception):
    """Another `fleet up` holds this state directory."""


class StateStore:
    """Files of one local fleet under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.state_path = self.root / "state.json"
        self.token_path = self.root / "admin-token"
        self.log_dir = self.root / "logs"
        self._lock_file = None
        self._extra: dict = {}

    def acquire(self) -> None:
        """Take the directory for this process. Raises AlreadyRunning naming the holder's pid."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)
        f = open(self.root / "up.lock", "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            holder = (self.read() or {}).get("pid", "?")
            raise AlreadyRunning(
                f"`fleet up` is already running with state in {self.root} (pid {holder}); "
                "run `fleet down` first or pass another --state-dir"
            ) from None
        self._lock_file = f

    def release(self) -> None:
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    def fleet_id(self) -> str:
        """This state directory's fleet id (made once): the marker in the environment of every
        process the fleet starts, so a restarted controller finds them (`fleet.local.backend`)."""
        path = self.root / "fleet-id"
        try:
            return path.read_text().strip()
        except FileNotFoundError:
            self.root.mkdir(parents=True, exist_ok=True)
            fid = secrets.token_hex(8)
            path.write_text(fid)
            return fid

    def admin_token(self) -> str | None:
        """The router admin token in use, or None when there is none."""
        try:
            return self.token_path.read_text().strip() or None
        except OSError:
            return None

    def new_admin_token(self) -> str:
        """A fresh router admin token, written readable by this user only."""
        token = secrets.token_urlsafe(32)
        fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        return token

    def set_extra(self, **fields) -> None:
        """Fields merged into every snapshot written (pid, router URL, phase...)."""
        self._extra.update(fields)

    def save(self, snapshot: dict) -> None:
        """Write the snapshot atomically (temp file + rename)."""
        data = {**snapshot, **self._extra, "updated_at_unix": time.time()}
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, default=str))
        os.replace(tmp, self.state_path)

    def read(self) -> dict | None:
        """The last snapshot, or None when there is none (or it is unreadable)."""
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return None
