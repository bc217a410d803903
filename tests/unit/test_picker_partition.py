"""The endpoint picker cut off from one engine's KV event stream (router/picker/service.py over
router/signals/kv_streams.py), on loopback with in-process publishers speaking vLLM's protocol:
while the stream is down the picker's exact view answers nothing for that endpoint and its picks
for it go by the policy's approximate view (the router's block hashes it was sent), the router's
picks stay answered; the engine evicts during the cut, and once the stream is back (replayed from
the engine's buffer) the view holds no block the engine evicted: at no point does it hold more
than its engine."""

from __future__ import annotations

import asyncio

import zmq.asyncio

from router.kv.events import BlockRemoved, EventBatch
from router.kv.exact_index import StreamState
from router.kv.prompt_blocks import RouteRequest, token_id_block_hashes
from router.picker.client import PickerClient
from router.picker.service import PickerService
from tests.support.waits import async_wait_until
# the subscriber's unit file's helpers and its fixture `ctx`
from tests.unit.test_kv_subscriber import Publisher, ctx, ids, stored  # noqa: F401

PROMPT_BLOCKS = 64   # of BS tokens: 256 tokens, 4 router blocks


def _request(prompt: list[int]) -> RouteRequest:
    return RouteRequest(block_hashes=tuple(token_id_block_hashes(prompt)), prompt_tokens=len(prompt),
                        token_ids=prompt)  # fmt: skip


def _own_pick() -> int:
    raise AssertionError("the picker answers: the router does not pick")


async def _pick(client: PickerClient, prompt: list[int]) -> tuple[str, int]:
    """(the endpoint the picker chose, the cached tokens it expects there); the pick released."""
    request = _request(prompt)
    chosen, ticket, answered = await client.pick("m", ["e0", "e1"], request, _own_pick)
    assert answered and ticket is not None
    ticket.finish()
    return ["e0", "e1"][chosen], request.cached_tokens


async def test_a_picker_cut_from_one_stream_routes_it_on_the_approximate_view_and_never_overstates_it(
        ctx: zmq.asyncio.Context) -> None:  # fmt: skip
    pubs = [Publisher(ctx), Publisher(ctx)]
    service = PickerService()
    await service.start()
    client = PickerClient("127.0.0.1", service.port, deadline_s=2.0)
    client.put_pool("m", "kv-aware", {f"e{i}": p.source.model_dump() for i, p in enumerate(pubs)})
    client.start()
    view = service.streams.index("m")
    prompt = ids(1000, PROMPT_BLOCKS)
    try:
        await async_wait_until(lambda: view.live("e0") and view.live("e1"), 15.0, what="both streams live")
        for p in pubs:
            await p.subscribed()
            await p.publish(stored(0, 1))   # teaches the view each engine's block size
        await async_wait_until(lambda: view.blocks("e0") == view.blocks("e1") == 1, 15.0, what="the first blocks")
        await _pick(client, ids(5000, 8))   # the answer tells the router the engines' block size
        await pubs[0].publish(stored(1000, PROMPT_BLOCKS))   # e0's engine caches the prompt
        await async_wait_until(lambda: view.blocks("e0") == 1 + PROMPT_BLOCKS, 15.0, what="e0 holds the prompt")
        assert await _pick(client, prompt) == ("e0", len(prompt))   # exact view: every token cached on e0

        # The cut: e0's publisher is unreachable; its engine goes on, and evicts the prompt.
        ports, buffer, seq = (pubs[0].pub_port, pubs[0].replay_port), pubs[0].buffer, pubs[0].seq
        await pubs[0].close()
        await async_wait_until(lambda: view.state("e0") is StreamState.DOWN, 15.0, what="e0's stream down")
        assert "e0" not in view.match(prompt)          # the exact view answers nothing for e0 while down
        assert not service.metrics.registry.get_sample_value("fleet_picker_kv_stream_live",
                                                             {"model": "m", "endpoint": "e0"})  # fmt: skip
        chosen, cached = await _pick(client, prompt)  # answered, on the approximate view for e0
        assert chosen == "e0" and cached == len(prompt)   # the router blocks the policy recorded there

        pubs[0] = Publisher(ctx, *ports)
        pubs[0].buffer, pubs[0].seq = buffer, seq
        evicted = [1000 + i + 1 for i in range(PROMPT_BLOCKS)]
        await pubs[0].publish(EventBatch(0.0, [BlockRemoved(evicted, medium="GPU")]), drop=True)
        # back: the replay brings the eviction before the view is trusted again
        await async_wait_until(lambda: view.live("e0"), 15.0, what="e0's stream live again")
        assert view.blocks("e0") == 1 and "e0" not in view.match(prompt)
        await pubs[1].publish(stored(1000, PROMPT_BLOCKS))   # now e1's engine holds the prompt
        await async_wait_until(lambda: view.blocks("e1") == 1 + PROMPT_BLOCKS, 15.0, what="e1 holds the prompt")
        assert await _pick(client, prompt) == ("e1", len(prompt))
        assert service.metrics.registry.get_sample_value("fleet_picker_kv_event_gaps_total",
                                                         {"model": "m", "endpoint": "e0"}) >= 1  # fmt: skip
    finally:
        await client.close()
        await service.close()
        for p in pubs:
            await p.close()
        await asyncio.sleep(0)
