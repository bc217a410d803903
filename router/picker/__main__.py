"""Command line of the endpoint picker: `python -m router.picker --host 127.0.0.1 --port 8090`.

Starts `router.picker.service.PickerService` and prints one line once listening (``picker
listening on HOST:PORT``); runs until SIGTERM or SIGINT. The routers that use it are started with
`python -m router --picker HOST:PORT`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from router.picker.service import PickerService


async def _run(host: str, port: int) -> None:
    service = PickerService()
    await service.start(host, port)
    print(f"picker listening on {host}:{service.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await service.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m router.picker",
                                     description="Fleet's endpoint picker: one per pool set, asked by the routers.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8090, help="port to bind; 0 picks a free one (default 8090)")
    parser.add_argument("--log-level", default="warning", help="logging level (default warning)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    asyncio.run(_run(args.host, args.port))


if __name__ == "__main__":
    main()
