"""The control channel of a running `fleet up`: `fleet apply` and `fleet rollout ...` hand it
requests through its state directory.

Owns the request and reply files (``<state dir>/control/<id>.json`` written by the CLI,
``<id>.reply.json`` written by `fleet up`), `submit` (the CLI side: write a request atomically,
wait for its reply with a deadline) and `ControlServer` (the `fleet up` side: every
``interval_s`` take the requests in name order, hand them to the controller, write each reply,
then remove the request). Called by `fleet.cli.rollout` and `fleet.local.up`.

Why files in the state directory and not an HTTP API: the request is on disk before anything
acts on it (a controller that crashes mid-request finds it again after a restart, and every
request is idempotent: applying the same spec twice changes nothing, a second pause or promote
finds nothing to do); no further port, token or TLS to manage, since the state directory's owner
is who may control the fleet (the directory holds the router's admin token already); and the
same documents can come from a Kubernetes operator's watch later.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from fleet.controller.rollouts import UnknownDeployment
from fleet.local.failsoft import WriteErrors
from fleet.spec import LoadedDeployment, SpecError, parse_document

log = logging.getLogger("fleet.local.control")

DEFAULT_REPLY_TIMEOUT_S = 15.0
"""How long `submit` waits for the running `fleet up` to answer (it looks every second or so)."""


class ControlError(Exception):
    """The request could not be delivered or was not answered in time."""


def control_dir(state_root: Path) -> Path:
    return Path(state_root) / "control"


def _write_atomically(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, default=str))
    os.replace(tmp, path)


def apply_request(loaded: list[LoadedDeployment]) -> dict:
    """The request of `fleet apply`: the validated documents and where they came from."""
    return {"kind": "apply", "documents": [
        {"document": ld.deployment.to_document(), "path": str(Path(ld.path).resolve()), "index": ld.index}
        for ld in loaded]}  # fmt: skip


def rollout_request(deployment: str, command: str) -> dict:
    return {"kind": "rollout", "deployment": deployment, "command": command}


def submit(state_root: Path, request: dict, *, timeout_s: float = DEFAULT_REPLY_TIMEOUT_S,
           clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
           alive: Callable[[], bool] = lambda: True) -> dict:  # fmt: skip
    """Write ``request`` for the running `fleet up` of ``state_root`` and return its reply
    (``{"ok": bool, "lines": [...], ...}``). ``alive``: whether a `fleet up` still runs there.
    Raises ControlError when none answers within ``timeout_s`` (the request is withdrawn when
    it was not taken yet)."""
    d = control_dir(state_root)
    d.mkdir(parents=True, exist_ok=True)
    rid = f"{time.time_ns():020d}-{secrets.token_hex(4)}"
    path, reply = d / f"{rid}.json", d / f"{rid}.reply.json"
    _write_atomically(path, {**request, "id": rid})
    deadline_s = clock() + timeout_s
    while clock() < deadline_s:
        if reply.exists():
            data = json.loads(reply.read_text())
            reply.unlink(missing_ok=True)
            return data
        if not alive():
            break
        sleep(0.1)
    try:
        path.unlink()
        taken = False
    except FileNotFoundError:
        taken = True
    if taken:
        raise ControlError(f"`fleet up` took the request but did not answer within {timeout_s:g} s; "
                           "see its output and `fleet status`")  # fmt: skip
    raise ControlError(f"no running `fleet up` answered within {timeout_s:g} s (state directory {state_root})")


class ControlServer:
    """`fleet up`'s side: handles requests with ``controller`` (`Controller.apply`,
    `Controller.rollout_command`); ``say`` prints one line per handled request; ``write_errors``
    counts replies that could not be written (target ``control``; the request stays and is
    handled again, as every request is idempotent)."""

    def __init__(self, state_root: Path, controller, say: Callable[[str], None] = lambda line: None,
                 write_errors: WriteErrors | None = None) -> None:  # fmt: skip
        self.dir = control_dir(state_root)
        self.controller = controller
        self.say = say
        self.write_errors = write_errors or WriteErrors()

    def handle_pending(self) -> int:
        """Handle every waiting request, in the order they were written. Returns how many."""
        try:
            names = sorted(p.name for p in self.dir.glob("*.json") if not p.name.endswith(".reply.json"))
        except OSError:
            return 0
        for name in names:
            path = self.dir / name
            try:
                request = json.loads(path.read_text())
            except FileNotFoundError:
                continue   # withdrawn by its sender
            except (OSError, ValueError) as err:
                request = {"id": name[: -len(".json")], "kind": "?", "error": f"unreadable request: {err}"}
            reply = self.handle(request)
            reply_path = self.dir / f"{request.get('id') or name[:-5]}.reply.json"
            if not self.write_errors.attempt("control", lambda: _write_atomically(reply_path, reply), force=True):
                continue   # the request stays: answered again at the next look
            try:
                path.unlink(missing_ok=True)
            except OSError as err:
                log.warning("cannot remove the handled request %s: %s", path, err)
        return len(names)

    def handle(self, request: dict) -> dict:
        """The reply to one request (never raises)."""
        if "error" in request:
            return {"ok": False, "lines": [request["error"]]}
        try:
            if request.get("kind") == "apply":
                loaded = []
                for d in request.get("documents") or []:
                    where = f"{d.get('path')}[{d.get('index')}] "
                    loaded.append(LoadedDeployment(parse_document(d["document"], where), Path(d["path"]),
                                                   int(d["index"])))  # fmt: skip
                lines = self.controller.apply(loaded)
                for line in lines:
                    self.say(f"apply: {line}")
                return {"ok": True, "lines": lines}
            if request.get("kind") == "rollout":
                out = self.controller.rollout_command(str(request["deployment"]), str(request["command"]))
                if request["command"] != "status":
                    self.say(f"rollout {request['command']} {request['deployment']}: {out.get('message')}")
                return {"ok": True, "lines": [out.get("message") or ""], "status": out}
            return {"ok": False, "lines": [f"unknown request kind {request.get('kind')!r}"]}
        except SpecError as err:
            return {"ok": False, "lines": err.problems}
        except UnknownDeployment as err:
            return {"ok": False, "lines": [str(err.args[0])]}
        except (KeyError, TypeError, ValueError) as err:
            return {"ok": False, "lines": [f"malformed request: {err}"]}
        except Exception as err:  # noqa: BLE001 - a reply says what went wrong; the fleet goes on
            log.exception("control request failed")
            return {"ok": False, "lines": [f"internal error: {err!r}"]}

    async def run(self, stop: asyncio.Event, interval_s: float = 0.5) -> None:
        """Handle requests every ``interval_s`` seconds until ``stop`` is set. Never raises: a
        failed look is logged and the next one comes ``interval_s`` later."""
        while not stop.is_set():
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                self.handle_pending()
            except Exception:  # noqa: BLE001 - the control channel survives its parts
                log.exception("control channel: handling requests failed")
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
            except asyncio.TimeoutError:
                pass
