"""Command line of the router: `python -m router --host 127.0.0.1 --port 8080`.

Reads the admin API's bearer token from the environment variable
`FLEET_ROUTER_ADMIN_TOKEN` (exit status 2 if it is unset or empty) and calls
`router.http.server.serve`; `--fd N` serves a listening socket the parent holds and handed down
(`fleet up`'s supervisor, fleet/local/routerproc.py: connections wait in its backlog while a
dead router is replaced); `--models-file PATH` keeps the served models there
(`router.http.remembered`); `--peers URL,...` / `--peers-dns NAME:PORT` the peer routers it shares
its load with (`router.signals.peer_channel`, `router.signals.peer_discovery`); `--picker HOST:PORT`
the endpoint picker its pools ask (`router.picker`). Prints one line once listening.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from router.picker.client import DEFAULT_DEADLINE_S
from router.signals.engine_load import DEFAULT_POLL_INTERVAL_S
from router.signals.peer_discovery import DEFAULT_PEER_DNS_INTERVAL_S, parse_dns_target
from router.signals.peer_load import DEFAULT_PEER_INTERVAL_S
from router.http.server import serve

TOKEN_ENV = "FLEET_ROUTER_ADMIN_TOKEN"
POD_IP_ENV = "FLEET_POD_IP"


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
                             "routers without --peers see some of what the others sent (docs/routing.md; "
                             f"{DEFAULT_POLL_INTERVAL_S * 1000:g} measured best); 0: off (default)")
    parser.add_argument("--peers", default="",
                        help="comma-separated base URLs of the other routers in front of the same pools: each "
                             "router sends the others its load every --peer-interval-ms, and kv-aware counts it "
                             "(docs/routing.md, 'A shared load signal'); replaces the engine polling (default: none)")
    parser.add_argument("--peers-dns", default="", metavar="NAME:PORT",
                        help="a DNS name whose A/AAAA records are the other routers (in Kubernetes a headless "
                             "Service of the router pods) and the port of their admin API: resolved every "
                             f"{DEFAULT_PEER_DNS_INTERVAL_S:g} s, the routers found are peers as with --peers, "
                             "this router's --pod-ip left out (router.signals.peer_discovery; default: none)")
    parser.add_argument("--pod-ip", default=os.environ.get(POD_IP_ENV, ""),
                        help=f"this router's own address(es), comma-separated, left out of what --peers-dns finds "
                             f"(default: ${POD_IP_ENV}, the downward API's status.podIP in the chart)")
    parser.add_argument("--router-id", default="", help="this router's id in its load reports (default: random)")
    parser.add_argument("--peer-interval-ms", type=float, default=DEFAULT_PEER_INTERVAL_S * 1000,
                        help=f"milliseconds between two load reports to each peer (default "
                             f"{DEFAULT_PEER_INTERVAL_S * 1000:g})")
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
        host, sep, port = args.picker.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            parser.error(f"--picker: expected HOST:PORT with a port 1-65535, got {args.picker!r}")
        picker = (host, int(port), args.picker_deadline_ms / 1000)
    if args.peer_interval_ms <= 0:
        parser.error("--peer-interval-ms must be > 0")
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        parser.error(f"environment variable {TOKEN_ENV} must hold the admin API bearer token")  # exits 2
    interval_s = args.engine_load_interval_ms / 1000 if args.engine_load_interval_ms > 0 else None
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    try:
        peers_dns = parse_dns_target(args.peers_dns) if args.peers_dns else None
    except ValueError as err:
        parser.error(f"--peers-dns: {err}")
    self_addresses = [a.strip() for a in args.pod_ip.split(",") if a.strip()]
    if args.fd is not None and args.fd < 0:
        parser.error(f"--fd must be a file descriptor number >= 0, not {args.fd}")
    serve(args.host, args.port, token, fd=args.fd, log_level=args.log_level, models_path=args.models_file,
          engine_load_interval_s=interval_s, peers=peers, router_id=args.router_id,
          peer_interval_s=args.peer_interval_ms / 1000, peers_dns=peers_dns, self_addresses=self_addresses,
          picker=picker)  # fmt: skip


if __name__ == "__main__":
    main()
