"""The node agent's loop: GPU health checks on a period, quarantine decisions, metrics, status.

Owns `NodeAgent` (one ``step``: check, decide, export; ``run``: steps every ``interval_s`` until
stopped, each step surviving its own errors), `AgentMetrics` (the Prometheus series below),
`serve` (``/metrics``, ``/status``, ``/healthz``), `status_lines`, and the quarantine state file
(`load_state`, `save_state`): ``NodeAgent`` loads it when it starts and rewrites it, atomically,
after every step that changed the state, so a restarted agent (a crash, a DaemonSet rollout)
keeps its quarantines and their evidence. Nothing it serves or writes carries a credential: cache
sources go through `fleet.sources.redact_source`.
Called by `fleet node-agent` (fleet/cli/agent.py); `fleet up` and the controller integrate it
through ``step`` / ``status`` (docs/node-agent.md, "Integration"), and `fleet up` serves its
``/metrics`` with `serve` as the file_sd target ``job="fleet-node-agent"`` (fleet/observability/).

Series (prometheus-client; ``gpu`` is a GPU or MIG instance UUID):

- ``fleet_gpu_quarantined{node,gpu}``: 1 while quarantined;
- ``fleet_gpu_quarantine_withheld{node,gpu}``: 1 while a quarantine is withheld by the cap;
- ``fleet_gpu_quarantine_decisions_total{node,action}``: quarantine / lift / withheld decisions;
- ``fleet_gpu_health_findings{node,gpu,check,severity}``: findings of the last check;
- ``fleet_gpu_xid_events_total{node,gpu,xid,xid_class}``: Xid events seen;
- ``fleet_node_agent_check_duration_seconds{node}`` and ``fleet_node_agent_check_errors_total{node}``;
- ``fleet_weight_cache_bytes{node}``, ``fleet_weight_cache_budget_bytes{node}``,
  ``fleet_weight_cache_models{node}``, ``fleet_weight_cache_corrupt_files_total{node}``;
- per GPU, under DCGM exporter's names and units (NVIDIA/dcgm-exporter etc/default-counters.csv)
  so dashboards written for it read Fleet's node agent too, labelled as dcgm-exporter labels them
  (``gpu``: the NVML index here, ``UUID``, ``modelName``, ``Hostname``: the node) plus the
  ``deployment`` and ``replica`` the GPU serves ("" when none; from ``serving``):
  ``DCGM_FI_DEV_GPU_UTIL`` (%), ``DCGM_FI_DEV_FB_USED`` (MiB), ``DCGM_FI_DEV_POWER_USAGE`` (W).
  Read from the health check's NVML reading (fleet/agent/nvml_health.py ``_usage``); a value
  NVML does not answer has no series.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fleet.agent.cache import WeightCache
from fleet.agent.health import Finding, GpuHealthChecker
from fleet.agent.quarantine import Decision, QuarantinePolicy, QuarantineState
from fleet.agent.xid import classify_xid
from fleet.sources import redact_source

log = logging.getLogger("fleet.node_agent")
SLOW_STEP_S = 5.0
EVENT_POLL_S = 1.0


class AgentMetrics:
    """The agent's series in ``registry`` (a fresh one per agent: tests run several)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.quarantined = Gauge("fleet_gpu_quarantined", "1 while the GPU or MIG instance is quarantined",
                                 ["node", "gpu"], registry=registry)
        self.withheld = Gauge("fleet_gpu_quarantine_withheld",
                              "1 while a quarantine of the GPU or MIG instance is withheld by the fleet-wide cap",
                              ["node", "gpu"], registry=registry)
        self.decisions = Counter("fleet_gpu_quarantine_decisions", "Quarantine decisions (quarantine, lift, withheld)",
                                 ["node", "action"], registry=registry)
        self.findings = Gauge("fleet_gpu_health_findings", "Findings of the last GPU health check",
                              ["node", "gpu", "check", "severity"], registry=registry)
        self.xids = Counter("fleet_gpu_xid_events", "Xid events reported by NVML",
                            ["node", "gpu", "xid", "xid_class"], registry=registry)
        self.check_s = Histogram("fleet_node_agent_check_duration_seconds", "Duration of one node-agent step",
                                 ["node"], registry=registry,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.errors = Counter("fleet_node_agent_check_errors", "Node-agent steps that failed", ["node"],
                              registry=registry)
        self.cache_bytes = Gauge("fleet_weight_cache_bytes", "Bytes the weight cache's files take", ["node"],
                                 registry=registry)
        self.cache_budget = Gauge("fleet_weight_cache_budget_bytes", "The weight cache's byte budget (0: none)",
                                  ["node"], registry=registry)
        self.cache_models = Gauge("fleet_weight_cache_models", "Models in the weight cache", ["node"],
                                  registry=registry)
        usage_labels = ["gpu", "UUID", "modelName", "Hostname", "deployment", "replica"]
        self.gpu_util = Gauge("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", usage_labels, registry=registry)
        self.fb_used = Gauge("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", usage_labels,
                             registry=registry)
        self.power = Gauge("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", usage_labels, registry=registry)
        self.cache_corrupt = Counter("fleet_weight_cache_corrupt_files",
                                     "Cached files found corrupt by the periodic re-hash (deleted, fetched again on use)",
                                     ["node"], registry=registry)


class NodeAgent:
    """One node's agent. ``checker`` is None on a machine without NVML (health checks off; the
    cache is still reported). ``fleet_gpus``: the cap's base (default: this node's GPUs, the
    standalone case). ``status_path``: where ``status()`` is written after each step (JSON) for
    `fleet status` / `fleet inventory`. ``on_decision``: called with every decision (events).
    ``verify_every_s``: re-hash one cached model (the one verified longest ago) at most this
    often, so silent corruption is found before a replica loads it (None: never). ``on_step``:
    called with the status after each step (the Kubernetes node facts,
    `fleet.k8s.node_facts.NodeFactsPublisher`). ``state_path``: the quarantine state file
    (`load_state` at construction, `save_state` after each step that changed it; None: in memory
    only). A state file that cannot be read is logged, set aside as ``<name>.bad`` and the agent
    starts with no quarantine (a broken file must not keep the node's health checks down).
    ``serving``: GPU UUID -> (deployment, replica id) of what runs on it now, read at each step
    for the usage series' labels (`fleet up` sets `fleet.local.backend.LocalBackend.gpu_replicas`;
    None: labels "")."""

    def __init__(self, node: str, checker: GpuHealthChecker | None, policy: QuarantinePolicy,
                 clock: Callable[[], float], cache: WeightCache | None = None,
                 registry: CollectorRegistry | None = None, status_path: Path | None = None,
                 fleet_gpus: float | None = None, on_decision: Callable[[Decision], None] | None = None,
                 verify_every_s: float | None = None,
                 on_step: Callable[[dict[str, Any]], None] | None = None,
                 state_path: Path | None = None,
                 serving: Callable[[], dict[str, tuple[str, str]]] | None = None) -> None:
        self.node = node
        self.serving = serving
        self.state_path = state_path
        self.on_step = on_step
        self.checker = checker
        self.policy = policy
        self.clock = clock
        self.cache = cache
        self.metrics = AgentMetrics(registry or CollectorRegistry())
        self.status_path = status_path
        self.fleet_gpus = fleet_gpus
        self.on_decision = on_decision
        self.verify_every_s = verify_every_s
        self._last_verify_s: float | None = None
        self._verified: dict[str, float] = {}
        self.state = load_state(state_path) if state_path is not None else QuarantineState()
        self.findings: list[Finding] = []
        self.events: deque[dict[str, Any]] = deque(maxlen=200)
        self.last_step_s: float | None = None
        self.last_error: str | None = None
        self.last_status: dict[str, Any] = {"node": node, "checked_at_s": None}

    def step(self) -> list[Decision]:
        """Check, decide, export. Raises nothing: a failing part is logged, counted and retried
        at the next step."""
        started = time.monotonic()
        decisions: list[Decision] = []
        try:
            decisions = self._health()
        except Exception as err:   # the loop survives its parts
            self.metrics.errors.labels(self.node).inc()
            self.last_error = f"health: {type(err).__name__}: {err}"
            log.exception("node agent %s: health step failed", self.node)
        try:
            self._usage_metrics()
        except Exception as err:
            self.metrics.errors.labels(self.node).inc()
            self.last_error = f"usage: {type(err).__name__}: {err}"
            log.exception("node agent %s: usage metrics failed", self.node)
        try:
            self._cache_metrics()
        except Exception as err:
            self.metrics.errors.labels(self.node).inc()
            self.last_error = f"cache: {type(err).__name__}: {err}"
            log.exception("node agent %s: cache metrics failed", self.node)
        self.last_step_s = self.clock()
        try:
            self.last_status = self.status()   # what /status serves (read from other threads)
        except Exception as err:
            self.metrics.errors.labels(self.node).inc()
            log.exception("node agent %s: status failed: %s", self.node, err)
        if self.status_path is not None:
            try:
                _write_json(self.status_path, self.last_status)
            except OSError as err:
                log.warning("node agent %s: cannot write %s: %s", self.node, self.status_path, err)
        if self.on_step is not None:
            try:
                self.on_step(self.last_status)
            except Exception:
                self.metrics.errors.labels(self.node).inc()
                log.exception("node agent %s: on_step failed", self.node)
        elapsed = time.monotonic() - started
        self.metrics.check_s.labels(self.node).observe(elapsed)
        if elapsed > SLOW_STEP_S:
            log.warning("node agent %s: step took %.1f s (> %.0f s)", self.node, elapsed, SLOW_STEP_S)
        return decisions

    def _health(self) -> list[Decision]:
        if self.checker is None:
            return []
        findings = self.checker.check()
        targets = self.checker.targets()
        gpus = sum(1 for t, (gpu, _) in targets.items() if t == gpu)
        before = self.state
        self.state, decisions = self.policy.decide(self.state, findings, targets,
                                                   self.fleet_gpus if self.fleet_gpus is not None else gpus)
        if self.state_path is not None and self.state != before:
            try:
                save_state(self.state_path, self.state)   # before acting on it
            except OSError as err:
                self.metrics.errors.labels(self.node).inc()
                self.last_error = f"state: cannot write {self.state_path}: {err}"
                log.error("node agent %s: cannot write the quarantine state %s: %s", self.node, self.state_path, err)
        self.findings = findings
        m, node = self.metrics, self.node
        m.findings.clear()
        for f in findings:
            m.findings.labels(node, f.target, f.check, f.severity.value).inc()
            if f.xid is not None:
                m.xids.labels(node, f.target, str(f.xid), classify_xid(f.xid).cls.value).inc()
        quarantined = self.state.quarantined()
        for target in set(targets) | set(quarantined):
            m.quarantined.labels(node, target).set(1 if target in quarantined else 0)
            m.withheld.labels(node, target).set(1 if self.state.targets.get(target) and
                                                self.state.targets[target].withheld else 0)
        for d in decisions:
            m.decisions.labels(node, d.action).inc()
            event = {"node": node, **asdict(d)}
            self.events.append(event)
            (log.warning if d.action != "lift" else log.info)("gpu %s %s: %s", d.target, d.action, d.reason)
            if self.on_decision is not None:
                self.on_decision(d)
        return decisions

    def _usage_metrics(self) -> None:
        """The DCGM-named series (module docstring) from the last check's reading."""
        m = self.metrics
        reading = self.checker.last_reading if self.checker is not None else None
        serving = self.serving() if self.serving is not None else {}
        for gauge in (m.gpu_util, m.fb_used, m.power):
            gauge.clear()
        for d in (reading or {}).get("devices", []):
            if d.get("lost") or not isinstance(d.get("uuid"), str):
                continue
            deployment, replica = serving.get(d["uuid"], ("", ""))
            name = d.get("name") if isinstance(d.get("name"), str) else ""
            labels = (str(d["index"]), d["uuid"], name, self.node, deployment, replica)
            for gauge, key in ((m.gpu_util, "utilization_gpu_percent"), (m.fb_used, "memory_used_mib"),
                               (m.power, "power_usage_w")):  # fmt: skip
                value = d.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    gauge.labels(*labels).set(value)

    def _cache_metrics(self) -> None:
        if self.cache is None:
            return
        m, node = self.metrics, self.node
        m.cache_bytes.labels(node).set(self.cache.blob_bytes())
        m.cache_budget.labels(node).set(self.cache.budget_bytes or 0)
        entries = self.cache.entries()
        m.cache_models.labels(node).set(len(entries))
        m.cache_corrupt.labels(node)   # exported at 0 before the first finding
        now = self.clock()
        due = self.verify_every_s is not None and (
            self._last_verify_s is None or now - self._last_verify_s >= self.verify_every_s)
        if due and entries:
            entry = min(entries, key=lambda e: (self._verified.get(e.key, float("-inf")), e.key))
            self._last_verify_s = now
            self._verified[entry.key] = now
            bad = self.cache.verify(entry.key)
            if bad:
                m.cache_corrupt.labels(node).inc(len(bad))
                event = {"node": node, "target": entry.key, "action": "cache_corrupt",
                         "reason": f"corrupt: {', '.join(bad)} (deleted; fetched again on next use)", "at_s": now}
                self.events.append(event)
                log.warning("weight cache %s: %s", entry.key, event["reason"])

    def status(self) -> dict[str, Any]:
        """What `fleet status` / `fleet inventory` show of this node: quarantined targets with
        their reason, the last findings, recent decisions, CPU cores local to each GPU, cached
        models. JSON-ready."""
        quarantined = self.state.quarantined()
        return {
            "node": self.node,
            "checked_at_s": self.last_step_s,
            "health_checks": self.checker is not None,
            "quarantined": [{"gpu": t, "reason": r, "since_s": self.state.targets[t].quarantined_since_s}
                            for t, r in sorted(quarantined.items())],
            "withheld": sorted(t for t, s in self.state.targets.items() if s.withheld),
            "findings": [f.as_dict() for f in self.findings],
            "events": list(self.events),
            "cpu_affinity": {g: list(c) for g, c in (self.checker.cpu_affinity() if self.checker else {}).items()},
            "cache": [
                {"key": e.key, "source": redact_source(e.source), "revision": e.revision, "size_bytes": e.size_bytes,
                 "pinned_by": list(e.pinned_by), "last_used_s": e.last_used_s}
                for e in (self.cache.entries() if self.cache else [])
            ],
            "last_error": self.last_error,
        }

    def run(self, interval_s: float, stop: threading.Event) -> None:
        """Step now and every ``interval_s`` seconds until ``stop`` is set; between steps, drain
        Xid events every ``EVENT_POLL_S`` (`GpuHealthChecker.poll_events`) and step at once when
        one is a certain hardware fault (`GpuHealthChecker.fault_pending`: an Xid 79 quarantines
        its GPU within about ``EVENT_POLL_S``, not up to ``interval_s`` later)."""
        while True:
            self.step()
            deadline = time.monotonic() + interval_s
            while (left := deadline - time.monotonic()) > 0:
                if stop.wait(min(left, EVENT_POLL_S)):
                    return
                if self.checker is not None and self.checker.poll_events() and self.checker.fault_pending():
                    break


def serve(agent: NodeAgent, host: str, port: int) -> ThreadingHTTPServer:
    """Serve ``GET /metrics`` (Prometheus text), ``GET /status`` (the last step's `status()`,
    JSON: what a controller on Kubernetes reads from each node's agent) and ``GET /healthz`` on
    ``host:port`` (0: any free port; see ``server.server_address``), on a daemon thread."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, ctype = generate_latest(agent.metrics.registry), CONTENT_TYPE_LATEST
            elif path == "/status":
                body, ctype = json.dumps(agent.last_status, default=str).encode(), "application/json"
            elif path == "/healthz":
                body, ctype = b"ok\n", "text/plain"
            else:
                self.send_error(404, "GET /metrics, /status or /healthz")
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="node-agent-http", daemon=True).start()
    return server


def status_lines(status: dict[str, Any]) -> list[str]:
    """One line per quarantined or withheld GPU / MIG instance of an agent's ``status()``, for
    `fleet status` and `fleet inventory`; e.g. ``node-a GPU-... quarantined since 12:00:05:
    ecc_uncorrected: 2 uncorrected ...``. Pure."""
    node = status.get("node", "?")
    lines = []
    if not status.get("health_checks", True):
        lines.append(f"{node}: GPU health checks off (no NVML)")
    for q in status.get("quarantined", []):
        since = time.strftime("%H:%M:%S", time.gmtime(q["since_s"])) if q.get("since_s") else "?"
        lines.append(f"{node} {q['gpu']} quarantined since {since} UTC: {q['reason']}")
    for gpu in status.get("withheld", []):
        lines.append(f"{node} {gpu} NOT quarantined (cap on the share of quarantined GPUs reached): see events")
    return lines


def _write_json(path: Path, doc: Any, durable: bool = False) -> None:
    """Write ``doc`` to ``path`` atomically (a temporary file renamed over it: a reader, or a
    restart after ``kill -9``, sees the old file or the new one, never half of one). ``durable``:
    fsync the file and its directory, so a node crash keeps it too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(doc, indent=1, default=str))
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_state(path: Path, state: QuarantineState) -> None:
    """Write the quarantine state (`QuarantineState.to_json`) to ``path`` atomically and durably.
    Raises OSError."""
    _write_json(path, state.to_json(), durable=True)


def load_state(path: Path) -> QuarantineState:
    """The quarantine state in ``path``; none when the file does not exist. A file that cannot be
    read or parsed is logged and renamed ``<name>.bad`` (kept for a person to look at), and the
    state starts empty. Never raises."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return QuarantineState()
    except OSError as err:
        log.error("quarantine state %s unreadable (%s): starting with no quarantine", path, err)
        return QuarantineState()
    try:
        state = QuarantineState.from_json(json.loads(text))
    except ValueError as err:   # json.JSONDecodeError is a ValueError
        bad = path.with_name(path.name + ".bad")
        log.error("quarantine state %s is broken (%s): set aside as %s, starting with no quarantine", path, err, bad)
        try:
            os.replace(path, bad)
        except OSError:
            pass
        return QuarantineState()
    if state.quarantined():
        log.warning("quarantine state %s: %d target(s) still quarantined: %s", path, len(state.quarantined()),
                    ", ".join(sorted(state.quarantined())))
    return state


def local_health_checker(node_name: str, clock: Callable[[], float]) -> tuple[GpuHealthChecker | None, str | None]:
    """A health checker over this machine's NVML, or (None, why) when there is no NVIDIA driver
    (health checks off). The caller closes ``checker.reader`` when done."""
    from fleet.agent.nvml_health import NvmlHealthReader
    from fleet.inventory.nvml import PynvmlReader, node_from_nvml

    try:
        domains = node_from_nvml(PynvmlReader().snapshot(), node_name).nvlink_domains
        reader = NvmlHealthReader(nvlink_domains=domains)
        reader.open()
    except RuntimeError as err:
        return None, str(err)
    return GpuHealthChecker(reader, clock), None

