"""`fleet cache ...` and `fleet node-agent`: the node agent's commands (typer + rich).

Owns argument parsing and rendering for the weight cache (``ls``, ``pull`` with a progress bar,
``rm``, ``verify``, ``manifest``) and the standalone agent loop; the work is
`fleet.agent.cache.WeightCache` and `fleet.agent.runner.NodeAgent`. Registered on the `fleet` app by
`fleet.cli`.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import (
    BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn,
)
from rich.table import Table

from fleet.agent.pod_devices import DEFAULT_SOCKET as _POD_RESOURCES_SOCKET
from fleet.cli.common import console, err_console


app = typer.Typer()
cache_app = typer.Typer(
    name="cache", no_args_is_help=True,
    help="This node's weight cache: list, pull (with progress), remove, verify cached models.",
)

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 1024, "KI": 1024, "M": 1000**2, "MB": 1000**2,
          "MIB": 1024**2, "MI": 1024**2, "G": 1000**3, "GB": 1000**3, "GIB": 1024**3, "GI": 1024**3,
          "T": 1000**4, "TB": 1000**4, "TIB": 1024**4, "TI": 1024**4}


def parse_size(text: str) -> int:
    """Bytes of ``"200GiB"``, ``"1.5 TB"``, ``"4096"``. Raises typer.BadParameter naming the value."""
    m = _SIZE.match(text)
    if not m:
        raise typer.BadParameter(f"{text!r} is not a size (e.g. 200GiB, 1.5TB, 4096)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


Root = Annotated[Optional[Path], typer.Option(
    "--root", help="Cache directory. Default: $FLEET_CACHE_DIR, $XDG_CACHE_HOME/fleet/weights or ~/.cache/fleet/weights.")]
Budget = Annotated[Optional[str], typer.Option(
    "--budget", envvar="FLEET_CACHE_BUDGET",
    help="Byte budget of the cache (e.g. 500GiB); least recently used unpinned models are evicted to stay under it.")]


def _cache(root: Optional[Path], budget: Optional[str] = None):
    from fleet.agent.cache import WeightCache, default_cache_root

    return WeightCache(root or default_cache_root(), budget_bytes=parse_size(budget) if budget else None)


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h" if s < 172800 \
        else f"{s / 86400:.0f}d"


@cache_app.command("ls")
def cache_ls(root: Root = None,
             as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """List cached models, least recently used first (what eviction takes first)."""
    from fleet.agent.cache import human_bytes

    cache = _cache(root)
    entries = cache.entries()
    if as_json:
        console.print_json(json.dumps([{**e.__dict__, "path": str(e.path)} for e in entries]))
        return
    table = Table(title=f"{cache.root}: {len(entries)} model(s), {human_bytes(cache.blob_bytes())} on disk")
    for col in ("key", "source", "revision", "size", "files", "last used", "pinned by"):
        table.add_column(col, overflow="fold")
    for e in entries:
        table.add_row(e.key, e.source, e.revision[:12], human_bytes(e.size_bytes), str(e.files),
                      _ago(e.last_used_s), ", ".join(e.pinned_by) or "-")
    console.print(table)


@cache_app.command("pull")
def cache_pull(
    source: Annotated[str, typer.Argument(help="hf://org/name[@revision], http(s)://.../fleet-manifest.json, or a path.")],
    revision: Annotated[Optional[str], typer.Option(help="Hub revision when the source names none.")] = None,
    root: Root = None, budget: Budget = None,
    link: Annotated[Optional[Path], typer.Option(
        "--link", help="Also make this path a symlink to the cached directory (replaced if it exists).")] = None,
    holder: Annotated[Optional[str], typer.Option(
        "--holder", help="Pin the model for this holder (e.g. a pod's uid): never evicted while pinned.")] = None,
) -> None:
    """Cache a model now (one download even if replicas ask at the same time), with a progress bar.

    Prints the directory an engine is given. Exit code 1 when it cannot be cached (the error names
    the model, the size and the path), 2 for a bad source string. An engine pod's init container
    runs it with ``--link`` (its model path) and ``--holder`` (its pod uid): fleet/k8s/pod_weights.py.
    """
    from fleet.agent.cache_files import CacheError
    from fleet.sources import SourceError

    cache = _cache(root, budget)
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
               TransferSpeedColumn(), TimeRemainingColumn())
    started = time.monotonic()
    with Progress(*columns, console=err_console, transient=False) as bar:
        task = bar.add_task(source, total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total or None)
        try:
            path = cache.ensure(source, revision=revision, progress=progress, pin_as=holder)
        except SourceError as err:
            err_console.print(f"[red]{err}[/]", highlight=False)
            raise typer.Exit(2) from None
        except CacheError as err:
            err_console.print(f"[red]{err}[/]", highlight=False)
            raise typer.Exit(1) from None
    err_console.print(f"cached in {time.monotonic() - started:.1f} s", highlight=False)
    if link is not None:
        import os

        tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        os.symlink(path.absolute(), tmp)
        os.replace(tmp, link)   # atomic: a reader sees the old link or the new one
    print(path)


@cache_app.command("rm")
def cache_rm(
    keys: Annotated[list[str], typer.Argument(help="Keys from `fleet cache ls`.")],
    force: Annotated[bool, typer.Option("--force", help="Remove even when a replica has it pinned.")] = False,
    root: Root = None,
) -> None:
    """Remove cached models (files other models share stay). Exit code 1 if one is pinned or unknown."""
    from fleet.agent.cache import human_bytes
    from fleet.agent.cache_files import CacheError

    cache = _cache(root)
    failed = False
    for key in keys:
        try:
            freed = cache.remove(key, force=force)
            console.print(f"removed {key} ({human_bytes(freed)} freed)", highlight=False)
        except (KeyError, CacheError) as err:
            err_console.print(f"[red]{key}: {err.args[0]}[/]", highlight=False)
            failed = True
    if failed:
        raise typer.Exit(1)


@cache_app.command("verify")
def cache_verify(
    keys: Annotated[Optional[list[str]], typer.Argument(help="Keys to re-hash. Default: every cached model.")] = None,
    root: Root = None,
) -> None:
    """Re-hash cached files against their sha256; corrupt ones are deleted so the next use fetches
    them again. Exit code 1 when any was corrupt."""
    cache = _cache(root)
    bad_any = False
    for key in keys or [e.key for e in cache.entries()]:
        try:
            bad = cache.verify(key)
        except KeyError as err:
            err_console.print(f"[red]{err.args[0]}[/]", highlight=False)
            bad_any = True
            continue
        bad_any |= bool(bad)
        console.print(f"{key}: " + (f"[red]corrupt: {', '.join(bad)}[/] (deleted; fetched again on next use)"
                                    if bad else "ok"), highlight=False)
    if bad_any:
        raise typer.Exit(1)


@cache_app.command("manifest")
def cache_manifest(
    model_dir: Annotated[Path, typer.Argument(help="A model directory to serve over http(s).")],
    no_sha256: Annotated[bool, typer.Option("--no-sha256", help="List sizes only (no hashing).")] = False,
) -> None:
    """Write fleet-manifest.json into a model directory, so that serving the directory over
    http(s) makes `http(s)://host/dir/` a model source (docs/node-agent.md)."""
    from fleet.sources import write_manifest

    if not model_dir.is_dir():
        err_console.print(f"[red]{model_dir} is not a directory[/]", highlight=False)
        raise typer.Exit(2)
    print(write_manifest(model_dir, with_sha256=not no_sha256))


@app.command("node-agent")
def node_agent(
    interval_s: Annotated[float, typer.Option("--interval-s", min=0.1, help="Seconds between health checks.")] = 30.0,
    metrics_port: Annotated[int, typer.Option(
        "--metrics-port", help="Port of /metrics (Prometheus) and /status (JSON) (0: none).")] = 9402,
    metrics_host: Annotated[str, typer.Option(
        "--host", "--metrics-host",
        help="Address /metrics and /status listen on (unauthenticated: the pod IP on Kubernetes, "
        "--host=$(POD_IP)).")] = "127.0.0.1",
    node_name: Annotated[Optional[str], typer.Option(
        "--node-name", envvar="NODE_NAME", help="Node name. Default: $NODE_NAME, else this host's name.")] = None,
    annotate_node: Annotated[bool, typer.Option(
        "--annotate-node", help="Kubernetes: publish this node's facts on its Node object: the NVLink domains "
        "(label fleet.inference.dev/nvlink-domains), the cached model sources without credentials "
        "(annotation fleet.inference.dev/cached) and the quarantined GPUs with the pods holding them "
        "(annotation fleet.inference.dev/gpu-health); in-cluster service account or kubeconfig.")] = False,
    pod_resources_socket: Annotated[Path, typer.Option(
        "--pod-resources-socket", help="The kubelet's PodResources API socket: which pods hold which GPUs "
        "(with --annotate-node; root only on a real kubelet; no socket: no allocation known).")
    ] = _POD_RESOURCES_SOCKET,
    pod_devices_file: Annotated[Optional[Path], typer.Option(
        "--pod-devices-file", help="Read which pods hold which GPUs from this file, kept by `fleet pod-devices` "
        "(a root container beside an agent that is not root), instead of the socket.")] = None,
    state_dir: Annotated[Optional[Path], typer.Option(
        "--state-dir", help="Where the quarantine state is kept across restarts (quarantine.json). "
        "Default: <cache root>/.agent.")] = None,
    status_file: Annotated[Optional[Path], typer.Option(
        "--status-file", help="Write the agent's status (JSON) here after each check.")] = None,
    hold_off_s: Annotated[float, typer.Option("--hold-off-s", help="Seconds without evidence before a quarantine lifts.")] = 600.0,
    degraded_after_s: Annotated[float, typer.Option(
        "--degraded-after-s", help="Seconds a degraded condition (PCIe, throttling, NVLink) must last to quarantine.")] = 60.0,
    max_quarantined_share: Annotated[float, typer.Option(
        "--max-quarantined-share", min=0.0, max=1.0,
        help="Most of the GPUs quarantined at once; beyond: alert only. Certain hardware faults "
        "(GPU lost, uncorrected ECC, Xid 48/63/64/79/94/95/140) are quarantined past it.")] = 0.25,
    fleet_gpus: Annotated[Optional[int], typer.Option(
        "--fleet-gpus", help="GPUs in the whole fleet (the cap's base). Default: this node's.")] = None,
    verify_every_s: Annotated[Optional[float], typer.Option(
        "--verify-every-s", min=1.0,
        help="Re-hash one cached model (the one verified longest ago) this often; default: never.")] = None,
    once: Annotated[bool, typer.Option("--once", help="Check once, print the status as JSON and exit.")] = False,
    root: Root = None, budget: Budget = None,
) -> None:
    """Run this node's agent: GPU health, quarantine, weight cache; Prometheus metrics.

    GPU health checks every --interval-s (NVML: ECC, row remapping, PCIe
    link, throttling, NVLink errors, P2P, Xid events, lost GPUs), quarantine decisions with
    hold-off and a cap (kept in --state-dir across restarts), CPU cores local to each GPU, and the
    weight cache's contents, exported as Prometheus metrics (fleet_gpu_quarantined{gpu}, ...) and
    a status file. Without an NVIDIA driver the health checks are off and say so; the cache is
    still reported."""
    from prometheus_client import CollectorRegistry

    from fleet.agent.quarantine import QuarantineConfig, QuarantinePolicy
    from fleet.agent.runner import NodeAgent, local_health_checker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name = node_name or re.sub(r"[^a-z0-9.-]+", "-", socket.gethostname().lower()).strip("-.") or "local"
    try:
        config = QuarantineConfig(hold_off_s=hold_off_s, degraded_after_s=degraded_after_s,
                                  max_quarantined_share=max_quarantined_share)
    except ValueError as err:
        err_console.print(f"[red]{err}[/]", highlight=False)
        raise typer.Exit(2) from None
    cache = _cache(root, budget)
    publish = _node_facts_publisher(name, pod_resources_socket, pod_devices_file) if annotate_node else None
    checker, why = local_health_checker(name, time.time)
    if checker is None:
        err_console.print(f"{why}: GPU health checks are off on this node.", highlight=False)
    on_step = None
    if publish is not None:
        on_step = lambda status: publish(status, checker, cache)  # noqa: E731
    agent = NodeAgent(name, checker, QuarantinePolicy(config, time.time), time.time, cache=cache,
                      registry=CollectorRegistry(), status_path=status_file, fleet_gpus=fleet_gpus,
                      verify_every_s=verify_every_s, on_step=on_step,
                      state_path=(state_dir or cache.root / ".agent") / "quarantine.json")
    if once:
        from fleet.agent.runner import status_lines

        agent.step()
        console.print_json(json.dumps(agent.status(), default=str))
        for line in status_lines(agent.status()):
            err_console.print(line, highlight=False, markup=False)
        if checker is not None:
            checker.reader.close()
        return
    if metrics_port:
        from fleet.agent.runner import serve

        serve(agent, metrics_host, metrics_port)
        err_console.print(f"metrics on http://{metrics_host}:{metrics_port}/metrics, status on /status",
                          highlight=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        agent.run(interval_s, stop)
    finally:
        if checker is not None:
            checker.reader.close()


def _node_facts_publisher(node: str, pod_resources_socket: Path, pod_devices_file: Path | None):
    """The ``on_step`` work of --annotate-node: ``publish(status, checker, cache)`` asks the
    kubelet which pods hold which GPUs (`fleet.agent.pod_devices`, their uids from the API server:
    `fleet.k8s.node_facts.PodUids`), writes this node's facts (`fleet.k8s.node_facts`) when they
    changed, and releases the cache pins of engine pods that left the node (`fleet.agent.pins`).
    Exits 2 without a cluster configuration."""
    from fleet.agent.pod_devices import PodDevicesReader, RelayFileReader
    from fleet.k8s.client import KubeClient
    from fleet.k8s.node_facts import NodeFactsPublisher, PodUids, node_facts

    try:
        kube = KubeClient.load()
        publisher = NodeFactsPublisher(kube, node)
    except Exception as err:  # noqa: BLE001 - kubernetes.config.ConfigException and file errors
        err_console.print(f"[red]--annotate-node: no cluster configuration (in-cluster service account or "
                          f"kubeconfig): {err}[/]", highlight=False)
        raise typer.Exit(2) from None
    from fleet.agent.pins import DepartedPodPins

    devices = (RelayFileReader(pod_devices_file, time.time) if pod_devices_file is not None
               else PodDevicesReader(pod_resources_socket))
    uids = PodUids(kube)
    pins = DepartedPodPins(time.time)

    def publish(status: dict, checker, cache) -> None:
        reading = (checker.last_reading if checker is not None else None) or {}
        reader = checker.reader if checker is not None else None
        domains = reader.nvlink_domains if reader is not None else None
        held, complete = uids.resolve_sync(devices.read())
        publisher.publish_sync(node_facts(status, reading.get("devices", []), held, cache.cached_sources(), domains,
                                          reader.driver_version if reader is not None else None,
                                          reader.cuda_driver_version if reader is not None else None))
        for key, uid in pins.step(cache, held if complete and not devices.stale else None):
            err_console.print(f"weight cache {key}: released the pin of pod {uid} (gone from this node)",
                              highlight=False)
    return publish


@app.command("pod-devices",
             short_help="Keep a file of which pods hold which NVIDIA devices (the kubelet's PodResources API).")
def pod_devices(
    out: Annotated[Path, typer.Option("--out", help="The file to keep the answer in (JSON, replaced atomically).")],
    pod_resources_socket: Annotated[Path, typer.Option(
        "--pod-resources-socket", help="The kubelet's PodResources API socket (root only on a real kubelet).")
    ] = _POD_RESOURCES_SOCKET,
    interval_s: Annotated[float, typer.Option("--interval-s", min=0.1, help="Seconds between questions.")] = 30.0,
    timeout_s: Annotated[float, typer.Option("--timeout-s", min=0.1, help="Deadline of one question, seconds.")] = 10.0,
    once: Annotated[bool, typer.Option("--once", help="Ask once, write the file and exit.")] = False,
) -> None:
    """Ask the kubelet which pods hold which NVIDIA devices (its PodResources API) every
    --interval-s and keep the answer in --out for `fleet node-agent --pod-devices-file`: the
    chart runs it as root, with no capability, in a container beside the agent
    (fleet/agent/pod_devices.py says why)."""
    from fleet.agent.pod_devices import PodDevicesReader, write_relay_file

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    reader = PodDevicesReader(pod_resources_socket, timeout_s)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while True:
        reader.read()
        try:
            write_relay_file(out, reader, time.time())
        except OSError as err:
            err_console.print(f"[red]--out {out}: {err.strerror or err}[/]", highlight=False)
            raise typer.Exit(1) from None
        if once or stop.wait(interval_s):
            return


app.add_typer(cache_app)
