"""The endpoint picker (router/picker/): its wire, its state over several routers' picks, and a
router's client against the server on loopback, with the fallback when it does not answer."""

from __future__ import annotations

import asyncio

import pytest

from router.kv.events import BlockStored, EventBatch
from router.kv.exact_index import ExactIndex
from router.kv.prompt_blocks import RouteRequest, token_id_block_hashes
from router.kv.prompt_keys import prompt_keys
from router.picker.client import PickerClient
from router.picker import __main__ as picker_main
from router.picker.service import DRAIN_INTERVAL_S, PickerService
from router.picker.state import PickerState
from router.picker.wire import (FINISH, AnswerFrame, FrameReader, PickFrame, PlacedFrame, PoolFrame, ProgressFrame,
                                WireError, decode, encode_answer, encode_finish, encode_first_byte, encode_pick,
                                encode_placed, encode_pool)
from router.pools.endpoint import EndpointState
from router.pools.policies import make_policy
from router.signals.drain_ticks import DRAIN_INTERVAL_S as ROUTER_DRAIN_INTERVAL_S
from tests.support.waits import async_wait_until

BS = 16


def _stored(index: ExactIndex, endpoint_id: str, ids: list[int]) -> None:
    """The engine of `endpoint_id` reports the whole blocks of `ids` stored (hashes made up)."""
    n = len(ids) // BS
    hashes = [hash((endpoint_id, i)) & 0xFFFF_FFFF for i in range(n)]
    index.apply(endpoint_id, EventBatch(ts=0.0, events=[BlockStored(hashes, None, ids[:n * BS], BS)]))


def test_pick_frame_round_trips_through_a_split_stream() -> None:
    frame = encode_pick(7, "llama", 12_000, "user-1", ["sim-0", "sim-1"], [1, -2, 2**63 + 5], [3, -4], BS)
    frames = (encode_pool("llama", "kv-aware", {"sim-0": None}) + frame + encode_first_byte(7) + encode_finish(7)
              + encode_placed(7, "sim-1"))
    reader = FrameReader()
    got = [f for i in range(0, len(frames), 5) for f in reader.feed(frames[i:i + 5])]
    assert got[0] == PoolFrame("llama", "kv-aware", {"sim-0": None})
    pick = got[1]
    assert isinstance(pick, PickFrame)
    assert (pick.ticket, pick.model, pick.prompt_tokens, pick.session_key, pick.candidates) == \
        (7, "llama", 12_000, "user-1", ["sim-0", "sim-1"])
    assert pick.block_hashes == (1, 2**64 - 2, 2**63 + 5)   # their low 64 bits
    assert (pick.keys, pick.key_block_tokens) == ((3, -4), BS)
    assert got[2:] == [ProgressFrame(4, 7), ProgressFrame(FINISH, 7), PlacedFrame(7, "sim-1")]
    assert decode(encode_answer(7, 1, 640, BS)[4:]) == AnswerFrame(7, 1, 640, BS)
    no_session = decode(encode_pick(1, "m", 5, None, ["a"], [], [], BS)[4:])
    assert isinstance(no_session, PickFrame) and no_session.session_key is None


def test_bad_frames_are_refused_with_the_reason() -> None:
    with pytest.raises(WireError, match="unknown frame kind 9"):
        decode(b"\x09abc")
    with pytest.raises(WireError, match="expected"):
        decode(encode_pick(1, "m", 5, None, ["a"], [1], [2], BS)[4:] + b"x")
    with pytest.raises(WireError, match="at most"):
        FrameReader().feed(b"\xff\xff\xff\x7f")


def test_prompt_keys_match_as_the_token_ids_do() -> None:
    index = ExactIndex()
    ids = list(range(1000, 1000 + 8 * BS))
    for e in ("a", "b"):
        index.open(e)
    _stored(index, "a", ids)
    _stored(index, "b", ids[:3 * BS])
    prompt = ids + [7] * 5
    assert index.match(prompt) == index.match(prompt_keys(prompt, BS)) == {"a": 8 * BS, "b": 3 * BS}
    assert index.match(prompt_keys(prompt, 32)) == {}   # no endpoint keys by 32-token blocks
    other = [5] * (4 * BS)
    assert index.expect("b", prompt_keys(other, BS), 10.0, 0.0) == prompt_keys(other, BS).keys
    assert index.match(other, now_s=1.0) == {"b": 4 * BS}


def _pick(ticket: int, prompt: list[int], candidates: list[str], session: str | None = None) -> PickFrame:
    keys = prompt_keys(prompt, BS).keys
    hashes = tuple(token_id_block_hashes(prompt))
    return PickFrame(ticket, "m", len(prompt), session, candidates, hashes, tuple(keys), BS)


def test_a_late_pick_moves_its_load_and_claim_where_the_router_sent_it() -> None:
    index = ExactIndex()
    state = PickerState(lambda model: index)
    state.pool("m", "kv-aware", {"e0": {"publisher": "tcp://127.0.0.1:1"}, "e1": {"publisher": "tcp://127.0.0.1:2"}})
    for e in ("e0", "e1"):
        index.open(e)
        _stored(index, e, [9] * BS)   # teaches the block size: claims need it
    prompt = list(range(300, 300 + 8 * BS))
    chosen, _, _ = state.pick("r1", _pick(1, prompt, ["e0", "e1"]), 0.0)
    picked, other = ["e0", "e1"][chosen], ["e0", "e1"][1 - chosen]
    assert index.match(prompt, now_s=1.0) == {picked: 8 * BS}   # claimed where the picker chose
    state.placed("r1", 1, other, 0.5)   # the answer was late: the router sent it to the other
    assert index.match(prompt, now_s=1.0) == {other: 8 * BS}
    endpoints = state.pools["m"].endpoints
    assert (endpoints[picked].in_flight, endpoints[other].in_flight) == (0, 1)
    state.progress("r1", 1, finished=True)
    assert endpoints[other].in_flight == 0 and endpoints[other].prefill_tokens == 0


def test_picks_of_two_routers_share_one_load_and_are_released() -> None:
    index = ExactIndex()
    state = PickerState(lambda model: index)
    state.pool("m", "least-outstanding", {"e0": None, "e1": None})
    prompt = list(range(64))
    chosen = [state.pick(router, _pick(1, prompt, ["e0", "e1"]), 0.0)[0] for router in ("r1", "r2")]
    assert sorted(chosen) == [0, 1]   # the second router's pick saw the first's load
    loads = {e.id: e.in_flight for e in state.pools["m"].endpoints.values()}
    assert loads == {"e0": 1, "e1": 1}
    state.progress("r1", 1, finished=False)
    state.progress("r1", 1, finished=True)
    assert state.drop_connection("r2") == 1   # a router gone: what it held is released
    assert all(e.in_flight == 0 and e.prefill_tokens == 0 and e.prefilling == 0
               for e in state.pools["m"].endpoints.values())
    assert state.pick("r1", PickFrame(2, "unknown", 1, None, ["e0"], (), (), BS), 0.0) == (-1, 0, 0)


def test_the_picker_decides_as_the_routers_policy_does_on_the_same_facts() -> None:
    """kv-aware at the picker, over the exact view fed with events, against the same policy class
    in a router with the same view and load: same endpoint, same expected hit."""
    index = ExactIndex()
    state = PickerState(lambda model: index)
    state.pool("m", "kv-aware", {"e0": {"publisher": "tcp://127.0.0.1:1"}, "e1": {"publisher": "tcp://127.0.0.1:2"}})
    local_index = ExactIndex()
    for view in (index, local_index):
        for e in ("e0", "e1"):
            view.open(e)
    conversation = list(range(50, 50 + 40 * BS))
    for view in (index, local_index):
        _stored(view, "e1", conversation)
    prompt = conversation + list(range(9000, 9000 + 8 * BS))
    chosen, cached, block_tokens = state.pick("r1", _pick(1, prompt, ["e0", "e1"]), 0.0)
    local = make_policy("kv-aware")
    request = RouteRequest(block_hashes=tuple(token_id_block_hashes(prompt)), prompt_tokens=len(prompt),
                           token_ids=prompt)
    endpoints = [EndpointState("e0", "http://a"), EndpointState("e1", "http://b")]
    expected = local.choose(endpoints, request, 0.0, local_index)
    assert (["e0", "e1"][chosen], cached, block_tokens) == (expected.id, request.cached_tokens, BS)
    assert expected.id == "e1" and cached == 40 * BS


async def test_a_router_asks_the_picker_and_falls_back_when_it_is_gone() -> None:
    service = PickerService()
    await service.start("127.0.0.1", 0)
    client = PickerClient("127.0.0.1", service.port, deadline_s=2.0)
    try:
        client.put_pool("m", "least-outstanding", {"e0": None, "e1": None})
        client.start()
        await async_wait_until(lambda: client.connected and "m" in service.state.pools, 10.0,
                               what="the client connected and its pool reached the picker")
        request = RouteRequest(block_hashes=(1, 2), prompt_tokens=128, token_ids=list(range(128)))

        def own_pick() -> int:
            raise AssertionError("the picker answers: the router does not pick")

        answers = await asyncio.gather(*(client.pick("m", ["e0", "e1"], request, own_pick) for _ in range(4)))
        assert sorted(a[0] for a in answers) == [0, 0, 1, 1]   # pipelined on one connection, decided in turn
        assert all(answered for _, _, answered in answers)
        assert service.state.in_flight() == 4
        for _, ticket, _ in answers:
            ticket.first_byte()
            ticket.finish()
        await async_wait_until(lambda: service.state.in_flight() == 0, 10.0, what="the picks released")
        await service.close()
        await async_wait_until(lambda: not client.connected, 10.0, what="the client saw the picker go")
        # unreachable: the router picks alone, and no ticket is held anywhere
        assert await client.pick("m", ["e0", "e1"], request, lambda: 1) == (1, None, False)
        service = PickerService()
        await service.start("127.0.0.1", client.port)
        await async_wait_until(lambda: client.connected and "m" in service.state.pools, 10.0,
                               what="the client reconnected and sent its pool again")
        assert (await client.pick("m", ["e0", "e1"], request, own_pick))[2]
    finally:
        await client.close()
        await service.close()


async def test_a_picker_address_that_accepts_and_closes_is_retried_with_backoff() -> None:
    """A proxy that accepts and closes at once (no picker behind it) is not spun against: the
    backoff (50 ms doubling) runs between connections that brought no answer."""
    accepted: list[float] = []
    loop = asyncio.get_running_loop()

    async def accept_and_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(loop.time())
        writer.close()

    server = await asyncio.start_server(accept_and_close, "127.0.0.1", 0)
    client = PickerClient("127.0.0.1", server.sockets[0].getsockname()[1], deadline_s=0.5)
    try:
        client.put_pool("m", "least-outstanding", {"e0": None})
        client.start()
        await async_wait_until(lambda: len(accepted) >= 4, 20.0, what="four connections accepted")
        assert accepted[3] - accepted[0] >= 0.05 + 0.1 + 0.2 - 0.01, accepted   # the backoff ran between them
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


async def test_a_located_picker_is_followed_when_it_moves_and_kept_when_the_locator_fails() -> None:
    """With a `Locate`, the client connects where it says, keeps that address while the locator
    fails (an OSError), moves when it names another picker (the old one still up: a client that
    kept a stale address keeps answering there), and picks alone while it names none."""
    first, second = PickerService(), PickerService()
    await first.start("127.0.0.1", 0)
    await second.start("127.0.0.1", 0)
    where: list[tuple[str, int] | None | OSError] = [("127.0.0.1", first.port)]
    failed: list[OSError] = []

    async def locate() -> tuple[str, int] | None:
        if isinstance(where[0], OSError):
            failed.append(where[0])
            raise where[0]
        return where[0]

    client = PickerClient(locate=locate, locate_interval_s=0.05, deadline_s=2.0)
    request = RouteRequest(block_hashes=(1,), prompt_tokens=16, token_ids=list(range(16)))

    def own_pick() -> int:
        raise AssertionError("the picker answers: the router does not pick")

    try:
        client.put_pool("m", "least-outstanding", {"e0": None, "e1": None})
        client.start()
        await async_wait_until(lambda: client.connected and "m" in first.state.pools, 10.0,
                               what="the client connected where the locator said")
        where[0] = OSError("the API server is unreachable")
        await async_wait_until(lambda: len(failed) >= 3, 10.0, what="three failed locates")
        assert client.connected and (client.host, client.port) == ("127.0.0.1", first.port)
        assert (await client.pick("m", ["e0", "e1"], request, own_pick))[2]
        assert first.state.in_flight() == 1
        where[0] = ("127.0.0.1", second.port)
        await async_wait_until(lambda: client.connected and "m" in second.state.pools, 10.0,
                               what="the client moved to the picker the locator names now")
        assert client.port == second.port
        await async_wait_until(lambda: first.state.in_flight() == 0, 10.0, what="the old picker released the pick")
        _, ticket, answered = await client.pick("m", ["e0", "e1"], request, own_pick)
        assert answered and second.state.in_flight() == 1 and first.state.in_flight() == 0
        ticket.finish()
        where[0] = None   # no picker is ready
        await async_wait_until(lambda: not client.connected, 10.0, what="the client left the unready picker")
        assert await client.pick("m", ["e0", "e1"], request, lambda: 1) == (1, None, False)
    finally:
        await client.close()
        await first.close()
        await second.close()


def test_a_picker_client_needs_one_address() -> None:
    async def locate() -> None:
        return None

    with pytest.raises(ValueError, match="not both or neither"):
        PickerClient()
    with pytest.raises(ValueError, match="not both or neither"):
        PickerClient("127.0.0.1", 1, locate=locate)
    with pytest.raises(ValueError, match="locate_interval_s"):
        PickerClient(locate=locate, locate_interval_s=0)


def test_the_picker_drains_its_streams_less_often_than_a_router_and_takes_an_interval() -> None:
    assert PickerService().streams.drain_interval_s == DRAIN_INTERVAL_S > ROUTER_DRAIN_INTERVAL_S
    assert PickerService(drain_interval_s=0.01).streams.drain_interval_s == 0.01


@pytest.mark.parametrize("value", ["0", "-5"])
def test_the_picker_refuses_a_drain_interval_that_is_not_positive(value: str, capsys) -> None:
    with pytest.raises(SystemExit):
        picker_main.main(["--drain-interval-ms", value])
    assert f"--drain-interval-ms must be > 0, got {float(value):g}" in capsys.readouterr().err
