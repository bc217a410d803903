"""Local backend: each replica is an engine process on this machine, on a port of loopback.

Owns everything process-shaped about local replicas: the engine's argv, the port, the log file,
the process record (pid + start time, `fleet.local.procs`) and the record file
``<state dir>/replicas.json`` that lets a restarted controller find what still runs. The
controller sees replica ids, facts and endpoints only (`fleet.controller.backend`).

Crash safety: a replica's record is written before its process starts and again once it runs,
and every engine carries the fleet's marker in its environment (``FLEET_FLEET_ID``,
``FLEET_REPLICA_ID``). A backend opened on a state directory checks each recorded process by
identity (pid and start time: a reused pid is not ours) and looks for marked processes that a
crash left unrecorded; those are taken back from their markers (``FLEET_ENGINE_PORT`` and
``FLEET_ENGINE_LOG`` too), so a controller whose state file was lost can adopt them
(`fleet.local.rebuild`).

KV cache events: every engine (vLLM or the simulator) starts with ``--kv-events-config``
publishing on ``ipc://`` sockets, a PUB and a replay socket per replica, and the replica's facts
carry those addresses for the router (`ReplicaFacts.kv_events`). Not loopback TCP: vLLM binds its
PUB socket only for a wildcard or ipc address (`fleet.engines.kinds.KvEventsBind`), and
``tcp://*:P`` would publish every prompt's token ids on all of the machine's interfaces. The
socket files sit in a directory of this user only (mode 0700, checked) under
``$XDG_RUNTIME_DIR`` or the system's temporary directory, named after the state directory: not in
the state directory itself, whose path may be too long for a Unix socket (107 bytes) and whose
disk may be full (the fail-soft cases). When that directory cannot be made or is not ours, the
engine starts without events (the router keeps its approximate view). A deployment whose
``engine.args`` carry their own ``--kv-events-config`` keeps it and publishes no addresses.

Writing ``replicas.json`` fails soft (target ``replicas`` of `fleet.local.failsoft.WriteErrors`):
on a full disk the records are kept in memory and written at the next change or observation once
the backoff is over; the markers cover a crash in between. ``read_only``: `fleet status` looks at
the records and processes without writing anything.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import socket
import stat
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from fleet.controller.backend import LaunchError, ReplicaFacts, ReplicaWant, engine_model
from fleet.local.failsoft import WriteErrors, log_target
from fleet.local.procs import LocalProcesses, ProcessRecord, find_marked, read_log_tail, start_ticks
from fleet.engines.kinds import KvEventsBind, fleet_kv_events, get_engine
from fleet.inventory import Inventory, NodeInventory
from fleet.local.state import FLEET_ID_ENV, write_atomically

if TYPE_CHECKING:
    from fleet.agent.cache import WeightCache
    from fleet.agent.runner import NodeAgent

log = logging.getLogger("fleet.local.backend")

REPLICA_ID_ENV = "FLEET_REPLICA_ID"
CACHE_LISTING_TTL_S = 10.0
"""How long the node's list of cached sources is reused before the cache is read again."""
DEPLOYMENT_ENV = "FLEET_DEPLOYMENT"
SPEC_HASH_ENV = "FLEET_SPEC_HASH"
PORT_ENV = "FLEET_ENGINE_PORT"
LOG_ENV = "FLEET_ENGINE_LOG"
KV_EVENTS_ENV = "FLEET_KV_EVENTS"
"""The replica's KV event addresses (JSON of `ReplicaFacts.kv_events`) in its engine's environment."""
IPC_PATH_MAX = 100
"""Longest ipc:// socket path used (a Unix socket's path holds at most 107 bytes on Linux)."""


@dataclass(frozen=True)
class _Record:
    replica_id: str
    deployment: str
    spec_hash: str
    node: str
    host: str
    port: int | None
    log_path: str | None
    process: ProcessRecord | None = None     # None: written before the process started
    caching: bool = False                    # its weights are being fetched into the node's cache
    model_dir: str | None = None             # the cached weights it runs from (pinned by its replica id)
    exited: bool = False
    exit_code: int | None = None
    exit_reason: str | None = None
    placement: dict | None = None            # `ReplicaPlacement.to_dict()`: its devices (for a rebuild)
    kv_events: dict | None = None            # `ReplicaFacts.kv_events`: where its engine publishes KV events

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "process"}
        d["process"] = self.process.to_dict() if self.process else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> _Record:
        process = ProcessRecord.from_dict(d["process"]) if d.get("process") else None
        known = cls.__dataclass_fields__
        return cls(**{**{k: v for k, v in d.items() if k != "process" and k in known}, "process": process})


class LocalBackend:
    """Engine processes on this machine (`fleet.controller.backend.Backend`)."""

    def __init__(self, root: Path, fleet_id: str, node: NodeInventory, *, host: str = "127.0.0.1",
                 processes: LocalProcesses | None = None, weights: WeightCache | None = None,
                 agent: NodeAgent | None = None, write_errors: WriteErrors | None = None,
                 read_only: bool = False) -> None:  # fmt: skip
        """``root``: the state directory (records in ``replicas.json``, logs in ``logs/``);
        ``fleet_id``: the marker of this fleet's processes; ``node``: this machine's devices;
        ``weights``: the node's weight cache, which fetches http(s):// and hf:// sources (None:
        such sources cannot start here); ``agent``: the node agent, whose quarantined GPUs and
        MIG instances the inventory reports (placement skips them, the controller drains what
        runs on them); ``write_errors``: where failed writes of ``replicas.json`` are counted;
        ``read_only``: never write (`fleet status`)."""
        self.root = Path(root)
        self.fleet_id = fleet_id
        self.node = node
        self.host = host
        self.records_path = self.root / "replicas.json"
        self.log_dir = self.root / "logs"
        self.processes = processes or LocalProcesses()
        self._records: dict[str, _Record] = {}
        self._engine_problems: dict[str, str | None] = {}   # engine kind -> why it cannot run here
        self.weights = weights
        self._caching: dict[str, asyncio.Task] = {}
        self._progress: dict[str, tuple[int, int]] = {}      # replica id -> (bytes cached, bytes in all)
        self.agent = agent
        self._images: frozenset[str] = frozenset()     # engine images whose engine started here
        self._sources: frozenset[str] = frozenset()    # the weight cache's canonical sources
        self._sources_read_at, self._sources_dirty = 0.0, True
        self._inventory = Inventory((node,))
        self.write_errors = write_errors or WriteErrors()
        self.read_only = read_only
        self._unsaved = False
        self._load()

    # ----- Backend ------------------------------------------------------------------------

    async def inventory(self) -> Inventory:
        """This node as placement must see it: devices the node agent quarantines marked so, and
        ``cached`` holding what the node holds (the declared inventory's entries, the canonical
        sources in the weight cache, the images of engines that started here). The same object
        is returned while nothing changes (placement caches tables per inventory)."""
        node = self._inventory.nodes[0]
        quarantined = node.quarantined
        if self.agent is not None:
            status = self.agent.last_status   # replaced whole after each of the agent's steps: safe to read
            quarantined = {q["gpu"]: q["reason"] for q in status.get("quarantined", [])}
        cached = self.node.cached | self._images | await self._cached_sources()
        if quarantined != node.quarantined or cached != node.cached:
            self._inventory = Inventory((replace(self.node, cached=cached).with_quarantine(quarantined),))
        return self._inventory

    async def _cached_sources(self) -> frozenset[str]:
        """The weight cache's sources, read again when a fill ended here or after
        `CACHE_LISTING_TTL_S` (another process, `fleet cache pull`, may fill it too)."""
        now = time.monotonic()
        if self.weights is not None and (self._sources_dirty or now - self._sources_read_at >= CACHE_LISTING_TTL_S):
            self._sources = await asyncio.to_thread(self.weights.cached_sources)
            self._sources_read_at, self._sources_dirty = now, False
        return self._sources

    async def ensure(self, want: ReplicaWant) -> None:
        rid = want.replica_id
        if rid in self._records:
            return
        dep = want.deployment
        engine = get_engine(dep.spec.engine.kind)
        if dep.spec.engine.kind not in self._engine_problems:  # the node's "image": checked once per kind
            self._engine_problems[dep.spec.engine.kind] = engine.preflight()
        problem = self._engine_problems[dep.spec.engine.kind]
        if problem:
            raise LaunchError(f"engine image not present: {problem}")
        if dep.spec.engine.image is not None:   # the installed engine stands for the image here
            self._images |= {dep.spec.engine.image}
        remote = dep.spec.model.parsed_source.remote   # fetched into the node's weight cache
        if remote and self.weights is None:
            raise LaunchError(f"weights not present: spec.model.source {dep.spec.model.source!r} is remote and "
                              "this backend has no weight cache")  # fmt: skip
        model = None if remote else engine_model(want)
        log_path = self.log_dir / f"{rid}.log"
        kv_events = self._kv_events_addresses(rid) if fleet_kv_events(dep.spec.engine.args) else None
        record = _Record(rid, dep.name, want.spec_hash, want.placement.nodes[0], self.host, self._free_port(),
                         str(log_path), caching=remote, placement=want.placement.to_dict(),
                         kv_events=kv_events)  # fmt: skip
        self._records[rid] = record
        self._save()  # before the process exists: a crash from here on leaves a record to check
        if remote:   # CACHING: the engine starts once the weights are in the node's cache
            self._progress[rid] = (0, 0)
            self._caching[rid] = asyncio.get_running_loop().create_task(self._cache_then_start(want),
                                                                        name=f"cache-{rid}")  # fmt: skip
            return
        try:
            self._spawn(want, model)
        except OSError as err:
            del self._records[rid]
            self._save()
            raise LaunchError(f"cannot start the engine: {err.strerror or err}") from err

    def _spawn(self, want: ReplicaWant, model: str) -> None:
        """Start the engine of a recorded replica on ``model``. Raises OSError."""
        rid, dep = want.replica_id, want.deployment
        record = self._records[rid]
        engine = get_engine(dep.spec.engine.kind)
        launch = dep.engine_launch(want.base_dir)
        env = {
            **engine.env(launch), **dep.spec.engine.env, **want.placement.env,
            FLEET_ID_ENV: self.fleet_id, REPLICA_ID_ENV: rid, DEPLOYMENT_ENV: dep.name, SPEC_HASH_ENV: want.spec_hash,
            PORT_ENV: str(record.port), LOG_ENV: record.log_path or "",
            **({KV_EVENTS_ENV: json.dumps(record.kv_events)} if record.kv_events else {}),
        }  # fmt: skip
        kv = record.kv_events
        bind = KvEventsBind(kv["publisher"], kv.get("replay"), kv.get("topic", "")) if kv else None
        argv = engine.command(launch, model, self.host, record.port, bind)
        cores = self.pinned_cores(want)
        if cores and shutil.which("taskset"):
            argv = ["taskset", "-c", ",".join(map(str, cores)), *argv]
        log_path, relay = Path(record.log_path) if record.log_path else None, False
        if log_path is not None:
            log_path, relay = log_target(log_path, self.write_errors, "engine_log")
        process = self.processes.spawn(argv, env, log_path, relay=relay)
        self._records[rid] = replace(self._records[rid], process=process)
        self._save()

    def pinned_cores(self, want: ReplicaWant) -> tuple[int, ...]:
        """The CPU cores the replica's whole process tree runs on (``taskset``); () for no pinning.

        A CPU replica: its placed cores (``cpu:N`` devices). vLLM binds only its OpenMP threads
        there (VLLM_CPU_OMP_THREADS_BIND); the API server and engine-core processes would float,
        and a starting engine's ``import torch`` pins itself to every allowed core in turn (its
        cpuinfo probe) -- on a core where another replica's worker is busy it was seen to wait
        minutes for its turn. A GPU replica: the cores local to its GPUs (`numa_cores`)."""
        cpu = tuple(int(d.split(":", 1)[1]) for d in want.placement.devices if d.startswith("cpu:"))
        return cpu or self.numa_cores(want)

    def numa_cores(self, want: ReplicaWant) -> tuple[int, ...]:
        """CPU cores local to the replica's GPUs (NVML's CPU affinity, read by the node agent);
        () when unknown (no agent, no GPU, or NVML gave none)."""
        if self.agent is None or self.agent.checker is None:
            return ()
        from fleet.agent.health import local_cores

        gpu_uuids = {g.uuid for g in self.node.gpus}
        parents = {m.uuid: g.uuid for g in self.node.gpus for m in g.mig_instances}
        gpus = sorted({d if d in gpu_uuids else parents[d] for d in want.placement.devices
                       if d in gpu_uuids or d in parents})  # fmt: skip
        return local_cores(self.agent.checker.cpu_affinity(), gpus)

    async def _cache_then_start(self, want: ReplicaWant) -> None:
        """Fetch the replica's weights into the node's cache (pinned for it), then start its
        engine on the cached directory; a failure ends the replica with the reason."""
        from fleet.agent.cache_files import CacheError
        from fleet.sources import SourceError

        rid, source = want.replica_id, want.deployment.spec.model.source

        def progress(done: int, total: int) -> None:   # called from the download's thread
            self._progress[rid] = (done, total)

        why = None
        path = None
        try:
            path = await asyncio.to_thread(self.weights.ensure, source, None, progress, rid)
        except (CacheError, SourceError, OSError) as err:
            why = f"weights not present: spec.model.source {source!r}: {err}"
        except Exception as err:  # noqa: BLE001 - whatever the download raised ends this replica, says why
            log.exception("caching %s for %s failed", source, rid)
            why = f"weights not present: spec.model.source {source!r}: {type(err).__name__}: {err}"
        self._caching.pop(rid, None)
        self._sources_dirty = True
        rec = self._records.get(rid)
        if rec is None or rec.exited:       # stopped while caching: let the weights go
            if path is not None:
                self.weights.unpin(path.name, rid)
            return
        if why is None:
            self._records[rid] = rec = replace(rec, caching=False, model_dir=str(path))
            try:
                self._spawn(want, str(path))
                return
            except OSError as err:
                why = f"cannot start the engine: {err.strerror or err}"
        self._records[rid] = replace(rec, caching=False, exited=True, exit_reason=why)
        self._save()

    async def observe(self) -> dict[str, ReplicaFacts]:
        changed = False
        for rid, rec in list(self._records.items()):
            if rec.exited or rec.process is None:
                continue
            alive, code = self.processes.poll(rec.process)
            if not alive:
                why = f"engine exited with code {code}" if code is not None else "engine process is gone"
                self._records[rid] = replace(rec, exited=True, exit_code=code, exit_reason=why)
                changed = True
        if changed or self._unsaved:
            self._save()
        return {rid: self._facts(rec) for rid, rec in self._records.items()}

    async def stop(self, replica_id: str) -> None:
        rec = self._records.get(replica_id)
        if rec is not None and rec.caching and not rec.exited:   # the download finishes for the cache
            self._records[replica_id] = replace(rec, caching=False, exited=True, exit_reason="stopped while caching")
            self._save()
        elif rec is not None and rec.process is not None and not rec.exited:
            self.processes.stop(rec.process)

    async def kill(self, replica_id: str) -> None:
        rec = self._records.get(replica_id)
        if rec is not None and rec.process is not None and not rec.exited:
            self.processes.kill(rec.process)

    async def forget(self, replica_id: str) -> None:
        rec = self._records.get(replica_id)
        if rec is None or not rec.exited:
            return
        if rec.process is not None:
            self.processes.release(rec.process)
        if rec.model_dir and self.weights is not None:
            self.weights.unpin(Path(rec.model_dir).name, replica_id)
        del self._records[replica_id]
        self._progress.pop(replica_id, None)
        self._save()

    async def log_tail(self, replica_id: str, lines: int = 20) -> list[str]:
        rec = self._records.get(replica_id)
        return read_log_tail(rec.log_path, lines) if rec is not None else []

    # ----- for `fleet up` / `fleet down` ----------------------------------------------------

    def placements(self) -> dict[str, dict | None]:
        """Replica id -> the placement (`ReplicaPlacement.to_dict()`) recorded for it, None when
        unknown (a replica taken back from its marker alone)."""
        return {rid: rec.placement for rid, rec in self._records.items()}

    def gpu_replicas(self) -> dict[str, tuple[str, str]]:
        """Device UUID -> (deployment, replica id) of every replica whose process has not exited,
        from the placements recorded for them (a MIG instance's replica is also its parent GPU's,
        ids joined with "," when several share it): the labels of the node agent's usage series
        (`fleet.agent.runner.NodeAgent` ``serving``). Read from the agent's thread: a snapshot."""
        parents = {m.uuid: g.uuid for g in self.node.gpus for m in g.mig_instances}
        out: dict[str, tuple[str, str]] = {}
        for rec in list(self._records.values()):
            if rec.exited or not rec.placement:
                continue
            for member in rec.placement.get("members", []):
                for device in member.get("devices", []):
                    for uuid in (device, parents.get(device)):
                        if uuid is None:
                            continue
                        have = out.get(uuid)
                        if have is None:
                            out[uuid] = (rec.deployment, rec.replica_id)
                        elif rec.replica_id not in have[1].split(","):
                            out[uuid] = (",".join(sorted({*have[0].split(","), rec.deployment})),
                                         ",".join(sorted([*have[1].split(","), rec.replica_id])))
        return out

    def live_process_count(self) -> int:
        """Recorded engine processes not yet seen to exit."""
        return sum(1 for r in self._records.values() if r.process is not None and not r.exited)

    def kill_all(self) -> None:
        """SIGKILL every live engine process now (a second Ctrl-C)."""
        for rec in self._records.values():
            if rec.process is not None and not rec.exited:
                self.processes.kill(rec.process)

    # ----- internals ----------------------------------------------------------------------

    def _facts(self, rec: _Record) -> ReplicaFacts:
        running = rec.process is not None and not rec.exited
        endpoint = f"http://{self.host}:{rec.port}" if rec.port is not None and rec.process is not None else None
        detail = {"port": str(rec.port) if rec.port is not None else "-", "log": rec.log_path or "-"}
        if rec.process is not None:
            detail["pid"] = str(rec.process.pid)
        if rec.caching:
            done, total = self._progress.get(rec.replica_id, (0, 0))
            detail["cache"] = f"{_mib(done)} / {_mib(total) if total else '?'} MiB cached"
        if rec.model_dir:
            detail["weights"] = rec.model_dir
        return ReplicaFacts(
            replica_id=rec.replica_id, deployment=rec.deployment, spec_hash=rec.spec_hash, node=rec.node,
            endpoint=endpoint, image_present=True, weights_present=rec.process is not None, running=running,
            exited=rec.exited, exit_code=rec.exit_code, exit_reason=rec.exit_reason, detail=detail,
            kv_events=rec.kv_events if endpoint is not None else None,
        )  # fmt: skip

    def _kv_events_addresses(self, rid: str) -> dict[str, str | None] | None:
        """The ipc:// PUB and replay addresses of replica ``rid``; None when their directory
        cannot be made or is not this user's alone (see the module docstring)."""
        name = rid if len(rid) <= 40 else hashlib.sha1(rid.encode()).hexdigest()[:16]
        leaf = f"fleet-kv-{os.getuid()}-{hashlib.sha1(str(self.root.resolve()).encode()).hexdigest()[:12]}"
        kv_dir = Path(tempfile.gettempdir()) / leaf
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        if runtime and len(str(Path(runtime) / leaf)) + len(name) + 8 <= IPC_PATH_MAX:
            kv_dir = Path(runtime) / leaf
        try:
            kv_dir.mkdir(mode=0o700, exist_ok=True)
            st = kv_dir.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise PermissionError(f"{kv_dir} is not a directory of this user alone (mode 0700)")
        except OSError as err:
            log.warning("replica %s starts without KV events: %s", rid, err)
            return None
        base = kv_dir / name
        return {"publisher": f"ipc://{base}.pub", "replay": f"ipc://{base}.replay", "topic": ""}

    def _free_port(self) -> int:
        taken = {r.port for r in self._records.values() if not r.exited}
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((self.host, 0))
                port = s.getsockname()[1]
            if port not in taken:
                return port
        raise LaunchError("no free TCP port found on loopback")

    def _load(self) -> None:
        """Read the record file and check every recorded process by identity; adopt marked
        processes a crash left unrecorded."""
        try:
            raw = json.loads(self.records_path.read_text())
        except FileNotFoundError:
            raw = {"replicas": []}
        except (OSError, ValueError) as err:
            log.warning("ignoring unreadable %s: %s", self.records_path, err)
            raw = {"replicas": []}
        for d in raw.get("replicas", []):
            rec = _Record.from_dict(d)
            self._records[rec.replica_id] = rec
        marked = find_marked(FLEET_ID_ENV, self.fleet_id)
        by_replica = {env.get(REPLICA_ID_ENV, ""): pid for pid, env in marked.items()}
        for rid, rec in list(self._records.items()):
            if rec.exited:
                continue
            if rec.process is None:  # crashed between the record and the start: did it start?
                pid = by_replica.get(rid)
                if pid is not None:
                    self._records[rid] = replace(rec, process=_adopted_record(pid, rec.log_path), caching=False)
                else:   # it never started: forget it, so the controller asks again (a download resumes)
                    if rec.model_dir and self.weights is not None:
                        self.weights.unpin(Path(rec.model_dir).name, rid)
                    del self._records[rid]
            elif not self.processes.is_ours(rec.process):
                self._records[rid] = replace(rec, exited=True, exit_reason="engine process is gone")
        for rid, pid in by_replica.items():
            if rid and rid not in self._records:   # started, then the record was lost: its marker says what it is
                env = marked[pid]
                port = env.get(PORT_ENV, "")
                log_path = env.get(LOG_ENV) or None
                self._records[rid] = _Record(rid, env.get(DEPLOYMENT_ENV, "?"), env.get(SPEC_HASH_ENV, ""),
                                             self.node.name, self.host, int(port) if port.isdigit() else None,
                                             log_path, _adopted_record(pid, log_path),
                                             kv_events=_kv_marker(env.get(KV_EVENTS_ENV)))  # fmt: skip
                log.warning("replica %s (pid %d) runs without a record: taken back from its marker", rid, pid)
        self._save()

    def _save(self) -> None:
        """Write ``replicas.json`` (atomically); a failure is counted, never raised, and the write
        is tried again at the next change or observation."""
        if self.read_only:
            return
        text = json.dumps({"replicas": [r.to_dict() for r in self._records.values()]}, indent=1)

        def write() -> None:
            self.root.mkdir(parents=True, exist_ok=True)
            write_atomically(self.records_path, text, 0o644)

        self._unsaved = not self.write_errors.attempt("replicas", write)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def _kv_marker(text: str | None) -> dict | None:
    """The KV event addresses an engine's marker carries (None when absent or unreadable)."""
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("publisher"), str) else None


def _adopted_record(pid: int, log_path: str | None) -> ProcessRecord:
    return ProcessRecord(pid, start_ticks(pid) or -1, (), log_path, 0.0)
