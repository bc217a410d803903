"""Command line of the router: `python -m router --host 127.0.0.1 --port 8080`.

Reads the admin API's bearer token from the environment variable
`FLEET_ROUTER_ADMIN_TOKEN` (exit status 2 if it is unset or empty) and calls
`router.http.server.serve`; `--fd N` serves a listening socket the parent holds and handed down
(`fleet up`'s supervisor, fleet/local/routerproc.py: connections wait in its backlog while a
dead router is replaced); `--models-file PATH` keeps the served models there
(`router.http.remembered`); `--picker HOST:PORT` the endpoint picker its pools ask
(`router.picker`). Prints one line once listening.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from router.picker.client import DEFAULT_DEADLINE_S, parse_address
from router.signals.engine_load import DEFAULT_POLL_INTERVAL_S
from router.http.server import serve

TOKEN_ENV = "FLEET_ROUTER_ADMIN_TOKEN"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m router", description="Fleet's OpenAI-compatible request router.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port to bind; 0 picks a free one (default 8080)")
    parser.add_argument("--fd", type=int, default=None,
                        help="serve the listening TCP socket inherited as this file descriptor instead of binding "
                             "--host/--port (default: bind)")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    parser.add_argument("--models-file", type=Path, default=None,
                        help="file that keeps the models the router serves, so that after a restart it answers "
                             "503 + Retry-After for them (not 404) until they are published again (default: none)")
    parser.add_argument("--engine-load-interval-ms", type=float, default=0.0,
                        help="milliseconds between polls of each kv-aware endpoint's /metrics for its load, so that "
                             "a router without a picker sees some of what the others sent (docs/routing.md; "
                             f"{DEFAULT_POLL_INTERVAL_S * 1000:g} measured best); 0: off (default)")
    parser.add_argument("--picker", default="", metavar="HOST:PORT",
                        help="the endpoint picker (python -m router.picker) every pool asks for its picks; the "
                             "router then follows no KV event stream itself (default: none, the router picks alone)")
    parser.add_argument("--picker-deadline-ms", type=float, default=DEFAULT_DEADLINE_S * 1000,
                        help=f"milliseconds to wait for the picker's answer before picking alone (default "
                             f"{DEFAULT_DEADLINE_S * 1000:g})")
    args = parser.parse_args(argv)
    if args.picker_deadline_ms <= 0:
        parser.error("--picker-deadline-ms must be > 0")
    picker = None
    if args.picker:
        try:
            picker = (*parse_address(args.picker), args.picker_deadline_ms / 1000)
        except ValueError as err:
            parser.error(str(err))
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        parser.error(f"environment variable {TOKEN_ENV} must hold the admin API bearer token")  # exits 2
    interval_s = args.engine_load_interval_ms / 1000 if args.engine_load_interval_ms > 0 else None
    if args.fd is not None and args.fd < 0:
        parser.error(f"--fd must be a file descriptor number >= 0, not {args.fd}")
    serve(args.host, args.port, token, fd=args.fd, log_level=args.log_level, models_path=args.models_file,
          engine_load_interval_s=interval_s, picker=picker)  # fmt: skip


if __name__ == "__main__":
    main()
