"""Request migration through the router over real loopback sockets: a stream whose engine dies
mid-way goes on from another endpoint of its revision, in the same stream (same `id`, summed
usage), with the prompt plus the text streamed so far and what is left of `max_tokens`; a request
that cannot be migrated ends as without migration, saying why (router.request.migrate,
router.request.proxy, router.request.relay).

Waits are on conditions with a deadline (`WAIT_S`), never on sleeps.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from router.request.migrate import MAX_TAPE_BYTES, Continuation, Tape, blocker
from tests.support.router import FakeEngine
from tests.unit.test_router_proxy import SSE_HEAD, completion, counter_value, http_chunk, put_pool, raw_upstream, \
    router



def event(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def text_event(text: str, id_: str, created: int = 1) -> bytes:
    return event({"id": id_, "object": "text_completion", "created": created, "model": "m",
                  "choices": [{"index": 0, "text": text, "finish_reason": None}]})  # fmt: skip


def chat_event(delta: dict[str, Any], id_: str) -> bytes:
    return event({"id": id_, "object": "chat.completion.chunk", "created": 1, "model": "m",
                  "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})  # fmt: skip


def dying(first: list[bytes]):  # type: ignore[no-untyped-def]
    """A raw engine that streams `first` and then drops the connection (a SIGKILLed engine)."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + b"".join(http_chunk(e) for e in first))
        await writer.drain()
        writer.transport.abort()

    return script


class Continuer:
    """An engine that takes continuations: streams `events` (its own id) and keeps each body."""

    def __init__(self, events: list[bytes], usage: dict[str, int] | None = None) -> None:
        self.events = events
        self.usage = usage
        self.bodies: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for e in self.events:
            await resp.write(e)
        if self.usage is not None:
            await resp.write(event({"id": "cmpl-b", "created": 2, "choices": [], "usage": self.usage}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def datas(body: bytes) -> list[Any]:
    out = []
    for e in body.split(b"\n\n"):
        if e.startswith(b"data: ") and e != b"data: [DONE]":
            out.append(json.loads(e[len(b"data: "):]))
    return out


async def test_a_completion_stream_whose_engine_dies_goes_on_from_another_endpoint() -> None:
    first = [text_event(" one", "cmpl-a"), text_event(" two", "cmpl-a")]
    rest = Continuer([text_event(" three", "cmpl-b", created=2), text_event(" four", "cmpl-b", created=2)],
                     usage={"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5})  # fmt: skip
    async with raw_upstream(dying(first)) as (dying_url, _), FakeEngine("b", handler=rest.handle) as b, \
            router() as (app, client):  # fmt: skip
        await put_pool(client, "m", [{"id": "a", "url": dying_url}, {"id": "b", "url": b.url}], policy="round-robin")
        body = {"model": "m", "prompt": "count:", "max_tokens": 4, "stream": True, "temperature": 0.5,
                "stream_options": {"include_usage": True}}  # fmt: skip
        served: list[bytes] = []
        for _ in range(2):   # round-robin: one of the two starts on the dying engine
            async with client.post("/v1/completions", json=body) as resp:
                assert resp.status == 200
                served.append(await resp.read())
        migrated = next(s for s in served if b" one" in s)
        docs = datas(migrated)
        assert "".join(d["choices"][0]["text"] for d in docs if d["choices"]) == " one two three four"
        assert {d["id"] for d in docs} == {"cmpl-a"} and {d["created"] for d in docs} == {1}
        assert docs[-1]["usage"] == {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}
        assert migrated.endswith(b"data: [DONE]\n\n") and b'"error"' not in migrated
        continuation = next(d for d in rest.bodies if d["prompt"] != "count:")
        assert continuation["prompt"] == "count: one two" and continuation["max_tokens"] == 2
        assert continuation["temperature"] == 0.5 and continuation["stream_options"] == {"include_usage": True}
        assert counter_value(app, "fleet_router_migrations_total", model="m", reason="interrupted") == 1
        assert app.metrics.registry.get_sample_value("fleet_router_migration_seconds_count", {"model": "m"}) == 1


async def test_a_chat_stream_continues_the_assistant_message() -> None:
    first = [chat_event({"role": "assistant", "content": ""}, "chatcmpl-a"),
             chat_event({"content": "Hel"}, "chatcmpl-a")]
    rest = Continuer([chat_event({"role": "assistant", "content": ""}, "chatcmpl-b"),
                      chat_event({"content": "lo"}, "chatcmpl-b")])  # fmt: skip
    async with raw_upstream(dying(first)) as (dying_url, _), FakeEngine("b", handler=rest.handle) as b, \
            router() as (app, client):  # fmt: skip
        await put_pool(client, "m", [{"id": "a", "url": dying_url}, {"id": "b", "url": b.url}], policy="round-robin")
        messages = [{"role": "user", "content": "greet"}]
        served = []
        for _ in range(2):
            async with client.post("/v1/chat/completions", json={"model": "m", "messages": messages,
                                                                 "stream": True}) as resp:  # fmt: skip
                served.append(await resp.read())
        migrated = next(s for s in served if b"Hel" in s)
        docs = datas(migrated)
        assert [d["choices"][0]["delta"] for d in docs] == [{"role": "assistant", "content": ""}, {"content": "Hel"},
                                                            {"content": "lo"}]  # fmt: skip
        assert {d["id"] for d in docs} == {"chatcmpl-a"}
        continuation = next(d for d in rest.bodies if len(d["messages"]) == 2)
        assert continuation["messages"][1] == {"role": "assistant", "content": "Hel"}
        assert continuation["continue_final_message"] is True and continuation["add_generation_prompt"] is False


async def test_a_stream_that_cannot_be_migrated_ends_with_an_error_event_saying_why() -> None:
    first = [text_event(" one", "cmpl-a")]
    rest = Continuer([text_event(" two", "cmpl-b")])
    async with raw_upstream(dying(first)) as (dying_url, _), FakeEngine("b", handler=rest.handle) as b, \
            router() as (app, client):  # fmt: skip
        await put_pool(client, "m", [{"id": "a", "url": dying_url}, {"id": "b", "url": b.url}], policy="round-robin")
        served = []
        for _ in range(2):
            async with client.post("/v1/completions", json=completion(stream=True, n=2)) as resp:
                served.append(await resp.read())
        broken = next(s for s in served if b" one" in s)
        error = datas(broken)[-1]["error"]
        assert error["code"] == "upstream_interrupted" and "not migrated (n)" in error["message"]
        assert broken.endswith(b"data: [DONE]\n\n")
        assert counter_value(app, "fleet_router_unmigrated_streams_total", model="m", reason="n") == 1
        assert all(d.get("prompt") == "hi" for d in rest.bodies)   # no continuation was sent


async def test_a_stream_moves_only_to_an_endpoint_of_its_own_revision() -> None:
    first = [text_event(" one", "cmpl-a")]
    rest = Continuer([text_event(" two", "cmpl-b")])
    async with raw_upstream(dying(first)) as (dying_url, _), FakeEngine("b", handler=rest.handle) as b, \
            router() as (app, client):  # fmt: skip
        await put_pool(client, "m", [{"id": "a", "url": dying_url, "version": "v1"}], policy="round-robin")
        await put_pool(client, "m", [{"id": "a", "url": dying_url, "version": "v1"},
                                     {"id": "b", "url": b.url, "version": "v2", "weight": 0}])  # fmt: skip
        async with client.post("/v1/completions", json=completion(stream=True)) as resp:
            body = await resp.read()
        assert "not migrated (no_endpoint)" in datas(body)[-1]["error"]["message"]
        assert rest.bodies == []


# --- pure parts -------------------------------------------------------------------------


def test_blocker_names_the_field_that_rules_migration_out() -> None:
    assert blocker({"prompt": "x"}, chat=False) is None
    assert blocker({"messages": []}, chat=True) is None
    assert blocker({"prompt": "x", "logprobs": 2}, chat=False) == "logprobs"
    assert blocker({"messages": [], "logprobs": True}, chat=True) == "logprobs"
    assert blocker({"prompt": "x", "echo": True}, chat=False) == "echo"
    assert blocker({"prompt": [1, 2]}, chat=False) == "prompt_not_text"
    assert blocker({"messages": [], "tools": [{"type": "function"}]}, chat=True) == "tools"
    assert blocker({"messages": [], "response_format": {"type": "json_object"}}, chat=True) == "structured_output"


def test_a_tape_past_its_limit_keeps_nothing_and_cannot_continue() -> None:
    tape = Tape()
    tape.add(b"x" * (MAX_TAPE_BYTES + 1))
    assert tape.full and tape.pieces == []
    assert Continuation.of({"prompt": "p"}, False, tape, 1, None) == "too_long"


def test_a_continuation_with_no_tokens_left_is_not_made() -> None:
    tape = Tape()
    tape.add(text_event(" a", "x"))
    assert Continuation.of({"prompt": "p", "max_tokens": 1}, False, tape, 1, 1) == "nothing_left"


async def test_a_stream_moves_at_most_migration_limit_times() -> None:
    first = [text_event(" one", "cmpl-a")]
    async with raw_upstream(dying(first)) as (a_url, a_conns), raw_upstream(dying(first)) as (b_url, b_conns), \
            router() as (app, client):  # fmt: skip
        await put_pool(client, "m", [{"id": "a", "url": a_url}, {"id": "b", "url": b_url}], policy="round-robin",
                       migration_limit=1)  # fmt: skip
        async with client.post("/v1/completions", json=completion(stream=True)) as resp:
            body = await resp.read()
        assert (len(a_conns), len(b_conns)) == (1, 1)   # the first attempt and one migration
        assert "not migrated (limit)" in datas(body)[-1]["error"]["message"]
        assert counter_value(app, "fleet_router_migrations_total", model="m", reason="interrupted") == 1
        assert counter_value(app, "fleet_router_unmigrated_streams_total", model="m", reason="limit") == 1


async def test_a_stream_that_goes_silent_is_cut_and_migrated() -> None:
    async def silent_after_one(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(text_event(" one", "cmpl-a"))
        await asyncio.sleep(30)
        return resp

    rest = Continuer([text_event(" two", "cmpl-b")])
    async with FakeEngine("a", handler=silent_after_one) as a, FakeEngine("b", handler=rest.handle) as b, \
            router() as (app, client):  # fmt: skip
        await put_pool(client, "m", [{"id": "a", "url": a.url}, {"id": "b", "url": b.url}], policy="round-robin",
                       first_token_timeout_s=0.3)  # fmt: skip
        served = []
        for _ in range(2):
            async with client.post("/v1/completions", json=completion(stream=True)) as resp:
                served.append(await resp.read())
        migrated = next(s for s in served if b" one" in s)
        assert "".join(d["choices"][0]["text"] for d in datas(migrated)) == " one two"
        assert counter_value(app, "fleet_router_migrations_total", model="m", reason="stalled") == 1
