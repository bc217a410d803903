"""The endpoint picker's wire: length-prefixed binary frames over one TCP connection per router.

Owns the frame kinds, their encoders and decoders (`encode_pool`, `encode_pick`, `encode_answer`,
`encode_first_byte`, `encode_finish`, `encode_placed`, `decode`) and `FrameReader` (frames out of a
byte stream).
Written and read by the router's client (`router.picker.client`) and the picker
(`router.picker.service`). Pure: bytes in, values out.

Every frame is a little-endian ``u32`` length, then a ``u8`` kind and its body. A router pipelines
its frames on one connection; the picker answers picks in the order it takes them.

- `POOL` (1), router -> picker: JSON ``{"model", "policy", "sources": {endpoint id: KvEventsSource
  document or null}}``.
- `PICK` (2), router -> picker: ``u32 ticket, u32 prompt tokens, u16 candidates, u16 router blocks,
  u16 key block tokens, u32 keys, u16 model bytes, u16 session bytes (0xFFFF: none)``, then the
  model, the session key, each candidate id (``u8`` length + bytes), the router block hashes
  (``u64`` each: their low 64 bits, all the picker's approximate index and rendezvous hashing
  read) and the prompt's keys (``i64`` each, `router.kv.prompt_keys.PromptKeys`).
- `ANSWER` (3), picker -> router: ``u32 ticket, i16 chosen candidate (-1: none), u32 cached tokens,
  u16 block tokens`` (the engines' block size the picker keys by; 0: not known yet).
- `FIRST_BYTE` (4), router -> picker: ``u32 ticket``: the pick's first byte reached the client.
- `FINISH` (5), router -> picker: ``u32 ticket``: the request left the endpoint (done, failed or
  cancelled).
- `PLACED` (6), router -> picker: ``u32 ticket, u8 length``, the endpoint id: the answer came too
  late and the router sent the request there itself; the picker moves the pick's load and claim.

A pick carries block hashes, never token ids: a 12,000-token prompt is 187 router blocks and 750
keys of 16-token blocks, about 7.5 KB. Tickets are the router's, unique per connection.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

POOL, PICK, ANSWER, FIRST_BYTE, FINISH, PLACED = 1, 2, 3, 4, 5, 6

MAX_FRAME_BYTES = 4 * 1024 * 1024
"""Largest frame either side accepts (bytes): a pick of a 128k-token prompt is about 80 KB."""

NO_SESSION = 0xFFFF
_MASK64 = (1 << 64) - 1
_LEN = struct.Struct("<I")
_KIND = struct.Struct("<B")
_PICK_HEAD = struct.Struct("<BIIHHHIHH")
_ANSWER = struct.Struct("<BIhIH")
_TICKET = struct.Struct("<BI")


class WireError(ValueError):
    """A frame that does not decode (unknown kind, short body, oversized): the connection is dropped."""


@dataclass(slots=True)
class PoolFrame:
    """A pool the router serves through the picker, and where its endpoints publish KV events."""

    model: str
    policy: str
    sources: dict[str, dict]


@dataclass(slots=True)
class PickFrame:
    """One pick asked by a router: the candidates it allows and the prompt as blocks."""

    ticket: int
    model: str
    prompt_tokens: int
    session_key: str | None
    candidates: list[str]
    block_hashes: tuple[int, ...]
    keys: tuple[int, ...]
    key_block_tokens: int


@dataclass(slots=True)
class AnswerFrame:
    """The picker's answer: the index of the chosen candidate (-1: none) and what it holds."""

    ticket: int
    chosen: int
    cached_tokens: int
    block_tokens: int


@dataclass(slots=True)
class PlacedFrame:
    """Where a router sent a request it picked for itself after the picker's deadline."""

    ticket: int
    endpoint_id: str


@dataclass(slots=True)
class ProgressFrame:
    """A pick's progress at the router: `FIRST_BYTE` or `FINISH`."""

    kind: int
    ticket: int


Frame = PoolFrame | PickFrame | AnswerFrame | ProgressFrame | PlacedFrame


def _framed(body: bytes) -> bytes:
    return _LEN.pack(len(body)) + body


def encode_pool(model: str, policy: str, sources: Mapping[str, dict]) -> bytes:
    """A `POOL` frame (JSON body: pools change rarely)."""
    doc = {"model": model, "policy": policy, "sources": dict(sources)}
    return _framed(_KIND.pack(POOL) + json.dumps(doc, separators=(",", ":")).encode())


def encode_pick(ticket: int, model: str, prompt_tokens: int, session_key: str | None, candidates: Sequence[str],
                block_hashes: Sequence[int], keys: Sequence[int], key_block_tokens: int) -> bytes:  # fmt: skip
    """A `PICK` frame. Raises `struct.error` for a field out of its range (over 65,535 candidates)."""
    model_b = model.encode()
    session_b = session_key.encode("utf-8", "replace") if session_key is not None else b""
    ids = [c.encode() for c in candidates]
    head = _PICK_HEAD.pack(PICK, ticket, min(prompt_tokens, 0xFFFFFFFF), len(ids), len(block_hashes),
                           key_block_tokens, len(keys), len(model_b),
                           NO_SESSION if session_key is None else len(session_b))  # fmt: skip
    parts = [head, model_b, session_b]
    for c in ids:
        parts.append(bytes((len(c),)))
        parts.append(c)
    parts.append(struct.pack(f"<{len(block_hashes)}Q", *[h & _MASK64 for h in block_hashes]))
    parts.append(struct.pack(f"<{len(keys)}q", *keys))
    return _framed(b"".join(parts))


def encode_answer(ticket: int, chosen: int, cached_tokens: int, block_tokens: int) -> bytes:
    """An `ANSWER` frame."""
    return _framed(_ANSWER.pack(ANSWER, ticket, chosen, min(cached_tokens, 0xFFFFFFFF), block_tokens))


def encode_first_byte(ticket: int) -> bytes:
    """A `FIRST_BYTE` frame."""
    return _framed(_TICKET.pack(FIRST_BYTE, ticket))


def encode_finish(ticket: int) -> bytes:
    """A `FINISH` frame."""
    return _framed(_TICKET.pack(FINISH, ticket))


def encode_placed(ticket: int, endpoint_id: str) -> bytes:
    """A `PLACED` frame."""
    endpoint = endpoint_id.encode()
    return _framed(_TICKET.pack(PLACED, ticket) + bytes((len(endpoint),)) + endpoint)


def decode(body: bytes | memoryview) -> Frame:
    """The frame of one body (after its length prefix). Raises `WireError` if it does not decode."""
    try:
        kind = body[0]
        if kind == PICK:
            return _decode_pick(body)
        if kind == ANSWER:
            return AnswerFrame(*_ANSWER.unpack(body)[1:])
        if kind in (FIRST_BYTE, FINISH):
            return ProgressFrame(kind, _TICKET.unpack(body)[1])
        if kind == PLACED:
            at = _TICKET.size
            if len(body) != at + 1 + body[at]:
                raise WireError(f"placed frame of {len(body)} bytes")
            return PlacedFrame(_TICKET.unpack_from(body)[1], bytes(body[at + 1:]).decode())
        if kind == POOL:
            doc = json.loads(bytes(body[1:]))
            return PoolFrame(str(doc["model"]), str(doc["policy"]), dict(doc["sources"]))
    except (IndexError, struct.error, ValueError, KeyError, TypeError) as err:
        raise WireError(f"frame of kind {body[0] if len(body) else None}: {err}") from err
    raise WireError(f"unknown frame kind {kind}")


def _decode_pick(body: bytes | memoryview) -> PickFrame:
    (_, ticket, prompt_tokens, n_candidates, n_hashes, key_block_tokens, n_keys, model_len,
     session_len) = _PICK_HEAD.unpack_from(body)  # fmt: skip
    at = _PICK_HEAD.size
    model = bytes(body[at:at + model_len]).decode()
    at += model_len
    session = None
    if session_len != NO_SESSION:
        session = bytes(body[at:at + session_len]).decode("utf-8", "replace")
        at += session_len
    candidates = []
    for _ in range(n_candidates):
        n = body[at]
        candidates.append(bytes(body[at + 1:at + 1 + n]).decode())
        at += 1 + n
    hashes = struct.unpack_from(f"<{n_hashes}Q", body, at)
    at += 8 * n_hashes
    keys = struct.unpack_from(f"<{n_keys}q", body, at)
    if at + 8 * n_keys != len(body):
        raise WireError(f"pick frame of {len(body)} bytes, expected {at + 8 * n_keys}")
    return PickFrame(ticket, model, prompt_tokens, session, candidates, hashes, keys, key_block_tokens)


class FrameReader:
    """Frames out of a byte stream: `feed(data)` returns the frames completed by `data`.

    Raises `WireError` for a frame longer than `MAX_FRAME_BYTES` or one that does not decode."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        buf = self._buf
        buf += data
        frames: list[Frame] = []
        at = 0
        while len(buf) - at >= 4:
            (n,) = _LEN.unpack_from(buf, at)
            if n > MAX_FRAME_BYTES or n == 0:
                raise WireError(f"frame of {n} bytes (at most {MAX_FRAME_BYTES})")
            if len(buf) - at - 4 < n:
                break
            frames.append(decode(bytes(buf[at + 4:at + 4 + n])))
            at += 4 + n
        if at:
            del buf[:at]
        return frames
