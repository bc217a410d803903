"""Command line of the endpoint picker: `python -m router.picker --host 127.0.0.1 --port 8090`.

Starts `router.picker.service.PickerService` and prints one line once listening (``picker
listening on HOST:PORT``); with ``--metrics-port`` also serves `/metrics`, `/ready` and `/healthz`
there (`router.picker.metrics.serve_http`). Runs until SIGTERM or SIGINT. The routers that use it
are started with `python -m router --picker HOST:PORT`. `serve` is the run itself, for callers that
make the service with their own leadership (`fleet endpoint-picker --lease`,
`fleet/k8s/picker_pod.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from router.picker.metrics import serve_http
from router.picker.service import DRAIN_INTERVAL_S, PickerService


async def serve(service: PickerService, host: str, port: int, metrics_port: int | None = None) -> None:
    """Run `service` on `host`:`port` (and its HTTP side on `host`:`metrics_port`; None: none)
    until SIGTERM or SIGINT, then close it. Raises OSError if a port cannot be bound."""
    await service.start(host, port)
    runner = None
    try:
        if metrics_port is not None:
            runner, bound = await serve_http(service.metrics, host, metrics_port)
            print(f"picker metrics on {host}:{bound}", flush=True)
        print(f"picker listening on {host}:{service.port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        if runner is not None:
            await runner.cleanup()
        await service.close()


def parser() -> argparse.ArgumentParser:
    """The picker's options (`python -m router.picker --help`)."""
    p = argparse.ArgumentParser(prog="python -m router.picker",
                                description="Fleet's endpoint picker: one per pool set, asked by the routers.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8090, help="port to bind; 0 picks a free one (default 8090)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="port of /metrics, /ready and /healthz on --host; 0 picks a free one (default: none)")
    p.add_argument("--drain-interval-ms", type=float, default=DRAIN_INTERVAL_S * 1e3,
                   help="milliseconds between two drains of the engines' KV event sockets "
                        f"(default {DRAIN_INTERVAL_S * 1e3:g}; router.picker.service.DRAIN_INTERVAL_S)")
    p.add_argument("--log-level", default="warning", help="logging level (default warning)")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    if not args.drain_interval_ms > 0:
        p.error(f"--drain-interval-ms must be > 0, got {args.drain_interval_ms:g}")
    logging.basicConfig(level=args.log_level.upper())
    service = PickerService(drain_interval_s=args.drain_interval_ms / 1e3)
    asyncio.run(serve(service, args.host, args.port, args.metrics_port))


if __name__ == "__main__":
    main()
