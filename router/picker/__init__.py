"""The endpoint picker: one process per pool set that the routers ask once per request.

It follows each engine's KV event stream once, holds the in-flight load of every router's
requests, and answers "which endpoint, and what it holds of this prompt" in one round trip
(docs/routing.md, "Endpoint picker"). `wire` (the binary frames), `state` (the pools, the policy,
the picks; pure), `service` (the TCP server, `python -m router.picker`), `client` (a router's
connection to it, with fallback).
"""
