"""Process plumbing shared by the benchmarks: CPU time and memory of a process, free ports,
waiting for HTTP readiness, and `SimFleet` (simulated vLLM replicas in child processes).

Used by the scripts in `loadtests/`; nothing here is on a request path.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def sched_counts(pid: int) -> dict[str, int]:
    """What the scheduler did with process `pid`, summed over its live threads: ``cpu_ns`` (time on
    a CPU, nanoseconds: finer than `cpu_s`'s clock ticks), ``voluntary`` context switches (the
    thread slept: each is followed by a wakeup), ``involuntary`` ones (preempted while it could
    run: a wait for a core), ``runs`` (timeslices it ran), ``threads``. Sources:
    /proc/PID/task/TID/status (``voluntary_ctxt_switches``, ``nonvoluntary_ctxt_switches``) and
    /proc/PID/task/TID/schedstat (time on CPU, time waiting, timeslices: Linux
    Documentation/scheduler/sched-stats.rst). A thread that exits between the listing and the
    read is skipped."""
    out = {"cpu_ns": 0, "voluntary": 0, "involuntary": 0, "runs": 0, "threads": 0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
            on_cpu_ns, _, runs = (int(v) for v in (task / "schedstat").read_text().split()[:3])
        except (FileNotFoundError, ProcessLookupError):
            continue
        for line in status.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                out["voluntary"] += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches:"):
                out["involuntary"] += int(line.split()[1])
        out["cpu_ns"] += on_cpu_ns
        out["runs"] += runs
        out["threads"] += 1
    return out


def rss_mib(pid: int) -> float:
    """Resident memory of process `pid` in MiB (VmRSS of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 60.0) -> None:
    """Wait until GET ``url`` answers 200. Raises RuntimeError if ``proc`` exits or on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout_s} s")


class SimFleet:
    """`replicas` SIMULATED vLLM replicas (`python -m fleet.enginesim`) spread over `processes` child
    processes, each replica on its own loopback port. Use as a context manager; `urls` lists the
    replicas' base URLs, `pids` the processes (for CPU accounting and signals: with one replica
    per process, `pids[i]` serves `urls[i]`). `extra_args_for(k)` adds arguments of process k
    alone (e.g. its own KV-events ports)."""

    def __init__(self, replicas: int, *, profile: str, model: str, processes: int = 1, seed: int = 0,
                 extra_args: list[str] | None = None,
                 extra_args_for: Callable[[int], list[str]] | None = None) -> None:
        if replicas < processes:
            processes = replicas
        self.replicas, self.processes, self.profile, self.model = replicas, processes, profile, model
        self.seed = seed
        self.extra_args = extra_args or []
        self.extra_args_for = extra_args_for
        self.urls: list[str] = []
        self.pids: list[int] = []
        self._procs: list[subprocess.Popen] = []
        self._tmp = Path(tempfile.mkdtemp(prefix="fleet-simfleet-"))

    def __enter__(self) -> SimFleet:
        per = [self.replicas // self.processes + (i < self.replicas % self.processes) for i in range(self.processes)]
        for k, n in enumerate(per):
            ports_file = self._tmp / f"ports-{k}.json"
            self._procs.append(subprocess.Popen(
                [sys.executable, "-m", "fleet.enginesim", "--model", f"sim://{self.profile}", "--served-model-name",
                 self.model, "--port", "0", "--replicas", str(n), "--seed", str(self.seed + k),
                 "--ports-file", str(ports_file), *self.extra_args,
                 *(self.extra_args_for(k) if self.extra_args_for else [])],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        try:
            for k, proc in enumerate(self._procs):
                ports_file = self._tmp / f"ports-{k}.json"
                deadline = time.monotonic() + 60
                while not ports_file.exists():
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"simulator process {k} did not start (exit code {proc.poll()})")
                    time.sleep(0.05)
                self.urls.extend(json.loads(ports_file.read_text())["urls"])
                self.pids.append(proc.pid)
            for url in self.urls:
                wait_http(f"{url}/health", timeout_s=60)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
