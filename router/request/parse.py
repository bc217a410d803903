"""Parse step of the request path: a completion request's body and head as one typed value.

Owns `ParsedRequest` (what every later step reads of the client's request), `parse` (body and
ASGI scope to a `ParsedRequest`, or the 400 body to answer), the client headers forwarded to the
engine (`FORWARDED_REQUEST_HEADERS`, `check_forward_headers`). Called by
`router.request.proxy.Proxy` once per request, after `router.request.asgi_io.read_body`. The JSON
checks are `router.request.asgi_io.parse_request`'s. Pure: no I/O.
"""

from __future__ import annotations

from router.kv.prompt_blocks import SESSION_HEADER
from router.request.asgi_io import Scope, parse_request

FORWARDED_REQUEST_HEADERS = frozenset({b"authorization", b"x-request-id", b"traceparent", b"tracestate"})
"""The client's request headers forwarded to the engine; every other one stays at the router.
What vLLM's OpenAI server reads from a request: `authorization` (its `--api-key` check),
`x-request-id` (its request id, `--enable-request-id-headers`), `traceparent` and `tracestate`
(W3C trace context, vLLM's `TRACE_HEADERS` for OpenTelemetry). An allow-list, not a block-list:
hop-by-hop headers (RFC 9110 section 7.6.1: `Connection` and the headers it names, `Keep-Alive`,
`Proxy-*`, `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`) describe the client's connection to
the router, not the router's to the engine; headers the router acts on itself (`x-session-id`,
`accept-encoding`: bodies are relayed unencoded) or that the client library adds (`user-agent`,
`x-stainless-*`, cookies) mean nothing to an engine; and a client's headers must never be able to
steer it (say, a forged `host` or `content-length`). A header that `Connection` names is dropped
even if listed here. The router sets `content-type: application/json` itself (it has parsed the
body as JSON; aiohttp would otherwise send `application/octet-stream` for a client that sent
none, which vLLM's FastAPI refuses)."""

HOP_BY_HOP_HEADERS = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
                                b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade"})  # fmt: skip
"""RFC 9110 section 7.6.1's hop-by-hop headers (and the obsolete `Proxy-Connection`): never
forwarded, whatever `forward_headers` says."""

_SESSION_HEADER = SESSION_HEADER.encode()


def check_forward_headers(forward_headers: frozenset[bytes]) -> None:
    """Raise ValueError unless `forward_headers` are lower-case end-to-end header names."""
    hop_by_hop = sorted(h.decode() for h in forward_headers & HOP_BY_HOP_HEADERS)
    if hop_by_hop or any(h != h.lower() for h in forward_headers):
        raise ValueError(f"forward_headers must be lower-case end-to-end headers; hop-by-hop: {hop_by_hop}")


def _count(value: object) -> int:
    """A positive int field of the request body, else 0."""
    return value if type(value) is int and value > 0 else 0


class ParsedRequest:
    """One completion request as the router routes it.

    `model` (the body's model name), `doc` (the parsed JSON object), `body` (the bytes as the
    client sent them: forwarded unchanged), `target` (path and query to post to an endpoint),
    `headers` (the upstream request headers: content type and the forwarded client headers, as
    aiohttp takes them), `session` (the `x-session-id` header, or None), `stream` (the body asks
    for a stream), `max_tokens` (`max_completion_tokens`, else `max_tokens`, when a positive int;
    else None).
    """

    __slots__ = ("model", "doc", "body", "target", "headers", "session", "stream", "max_tokens")

    def __init__(self, model: str, doc: dict, body: bytes, target: str, headers: list[tuple[str, str]],
                 session: str | None) -> None:  # fmt: skip
        self.model = model
        self.doc = doc
        self.body = body
        self.target = target
        self.headers = headers
        self.session = session
        self.stream = doc.get("stream") is True
        self.max_tokens = _count(doc.get("max_completion_tokens")) or _count(doc.get("max_tokens")) or None


def parse(scope: Scope, body: bytes, forward: frozenset[bytes]) -> ParsedRequest | bytes:
    """The `ParsedRequest` of a proxied request (`scope`: its ASGI scope; `body`: its whole body;
    `forward`: the client headers to forward), or the OpenAI error body of a 400 when the body
    fails `router.request.asgi_io.parse_request`'s checks."""
    path: str = scope["path"]
    model, doc, problem = parse_request(body, path)
    if model is None or doc is None:
        return problem or b""
    session = None
    forwarded: list[tuple[bytes, bytes]] = []
    connection = b""
    for k, v in scope["headers"]:
        if k in forward:
            forwarded.append((k, v))
        elif k == _SESSION_HEADER:
            session = v.decode("latin-1")
        elif k == b"connection":
            connection += b"," + v
    if connection and forwarded:  # the headers Connection names are hop-by-hop too
        named = {token.strip().lower() for token in connection.split(b",")}
        forwarded = [(k, v) for k, v in forwarded if k not in named]
    headers = [("content-type", "application/json")]
    headers += [(k.decode("latin-1"), v.decode("latin-1")) for k, v in forwarded]
    query: bytes = scope.get("query_string", b"")
    target = f"{path}?{query.decode('latin-1')}" if query else path
    return ParsedRequest(model, doc, body, target, headers, session)
