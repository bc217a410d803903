"""`python -m router --peers`: two router processes tell each other the load they sent
(router.signals.peer_channel, router.signals.peer_load), seen in their metrics."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.support.waits import wait_until

REPO = Path(__file__).resolve().parents[2]
TOKEN = "peers-admin-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(base: str, name: str) -> float | None:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
        m = re.search(rf"^{re.escape(name)} (\S+)$", resp.read().decode(), re.M)
    return float(m.group(1)) if m else None


def answered_by(base: str, endpoint: str) -> float:
    """Requests the router sent to `endpoint` that it answered 200 (`fleet_router_requests_total`)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "fleet_router_requests_total" and s.labels.get("endpoint") == endpoint
               and s.labels.get("code") == "200")  # fmt: skip


def hang(base: str) -> None:
    """A completion whose endpoint never answers; the client gives up after 5 s."""
    req = urllib.request.Request(f"{base}/v1/completions", method="POST",
                                 data=json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1}).encode(),
                                 headers={"content-type": "application/json"})  # fmt: skip
    with contextlib.suppress(OSError):
        urllib.request.urlopen(req, timeout=5).close()


def peers(base: str) -> dict:
    """The router's `GET /admin/v1/peers`."""
    req = urllib.request.Request(f"{base}/admin/v1/peers", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def others_in_flight(base: str) -> float:
    """Requests the peers say they have in flight on m/e0 (`GET /admin/v1/peers`)."""
    return peers(base)["load"].get("m", {}).get("e0", [0])[0]


def peer_routers() -> tuple[list[subprocess.Popen], list[str]]:
    """Two `python -m router` processes, each with the other as its `--peers`, once both listen:
    the processes and their base URLs (both stopped again if either fails to start)."""
    ports = [free_port(), free_port()]
    bases = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [subprocess.Popen([sys.executable, "-m", "router", "--host", "127.0.0.1", "--port", str(ports[i]),
                               "--peers", bases[1 - i], "--router-id", f"r{i}"],
                              env={**os.environ, "FLEET_ROUTER_ADMIN_TOKEN": TOKEN}, cwd=REPO,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
             for i in (0, 1)]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().startswith("fleet router listening")
    except BaseException:
        stop(procs)
        raise
    return procs, bases


def start_engine(ports_file: Path) -> tuple[subprocess.Popen, dict[str, str]]:
    """A simulated engine (`python -m fleet.enginesim`) publishing its KV events on vLLM's wire;
    returns it and the `kv_events` addresses of its pool entry. Its URL: `engine_url(ports_file)`."""
    pub, replay = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": ""}
    engine = subprocess.Popen([sys.executable, "-m", "fleet.enginesim", "--model", "sim://h100-llama-8b",
                               "--served-model-name", "m", "--port", "0", "--ports-file", str(ports_file),
                               "--kv-events-config", json.dumps(config)],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return engine, {"publisher": f"tcp://127.0.0.1:{pub}", "replay": f"tcp://127.0.0.1:{replay}"}


def engine_url(ports_file: Path) -> str:
    """The URL a simulated engine wrote to its `--ports-file` (waits up to 60 s for it)."""
    wait_until(lambda: ports_file.exists() and ports_file.read_text(), 60, interval_s=0.1,
               what=f"the engine to write {ports_file.name}")
    return json.loads(ports_file.read_text())["urls"][0]


def put_pool(bases: list[str], endpoints: list[dict]) -> None:
    """`PUT /admin/v1/pools/m` (`kv-aware`, these endpoints) on every router."""
    pool = json.dumps({"policy": "kv-aware", "endpoints": endpoints}).encode()
    for base in bases:
        req = urllib.request.Request(f"{base}/admin/v1/pools/m", data=pool, method="PUT",
                                     headers={"Authorization": f"Bearer {TOKEN}"})  # fmt: skip
        urllib.request.urlopen(req, timeout=10).close()


def complete(base: str, ids: list[int]) -> None:
    """A one-token completion of the token-id prompt `ids` through `base`; must answer 200."""
    req = urllib.request.Request(f"{base}/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "m", "prompt": ids, "max_tokens": 1}).encode())
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200


def stop(procs: list[subprocess.Popen]) -> None:
    """Terminate `procs`, then wait for each (killed after 30 s)."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_two_routers_exchange_load_reports() -> None:
    silent = socket.socket()   # accepts connections (the backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    procs, bases = peer_routers()
    try:
        put_pool(bases, [{"id": "e0", "url": "http://127.0.0.1:9"}])
        wait_until(lambda: all(metric(b, "fleet_router_peers_live") == 1.0 for b in bases), 20, interval_s=0.2,
                   what="each router to see its peer live")
        for base in bases:
            assert (metric(base, "fleet_router_peer_reports_received_total") or 0) >= 1
            assert (metric(base, "fleet_router_peer_reports_sent_total") or 0) >= 1
        # A request through each router to an endpoint that accepts and never answers stays in flight: the
        # proxy says the load changed, the report goes as a signed datagram (router.signals.peer_datagram), and each
        # router sees the other's request on e0.
        put_pool(bases, [{"id": "e0", "url": f"http://127.0.0.1:{silent.getsockname()[1]}"}])
        hanging = [threading.Thread(target=hang, args=(base,), daemon=True) for base in bases]
        for thread in hanging:
            thread.start()
        wait_until(lambda: all(metric(b, "fleet_router_peer_datagrams_sent_total") and others_in_flight(b) >= 1
                               for b in bases), 20, interval_s=0.1,
                   what="each router to send a datagram and see the other's request in flight")  # fmt: skip
        for base in bases:
            assert metric(base, 'fleet_router_peer_datagrams_rejected_total{reason="signature"}') == 0.0
        # Each peer's answers count the datagrams it took, so each router's heartbeat has moved to UDP.
        wait_until(lambda: all(peers(b)["datagrams_confirmed"] for b in bases), 20, interval_s=0.1,
                   what="each router's datagrams confirmed by its peer")
        assert [peers(b)["datagrams_confirmed"] for b in bases] == [[bases[1]], [bases[0]]]
    finally:
        stop(procs)
        silent.close()


def test_a_prompt_sent_for_prefill_is_claimed_at_both_routers(tmp_path: Path) -> None:
    """Two `python -m router --peers` processes and a simulated engine publishing its KV events
    (`--kv-events-config`): once the routers' views know the engine's block size, a new prompt
    sent through router 0 is claimed at the engine (`router.kv.exact_index.ExactIndex.expect`) and the
    claim reaches router 1 as a signed datagram (`router.signals.peer_datagram.encode_claim`), which
    takes it into its own view; the engine's stored blocks then show in both views."""
    procs, bases = peer_routers()
    engine, kv = start_engine(tmp_path / "engine.json")
    try:
        put_pool(bases, [{"id": "e0", "url": engine_url(tmp_path / "engine.json"), "kv_events": kv}])

        def stream_live_and_events(base: str) -> bool:
            return (metric(base, 'fleet_router_kv_stream_live{endpoint="e0",model="m"}') == 1.0
                    and (metric(base, 'fleet_router_kv_events_total{endpoint="e0",model="m"}') or 0) >= 1)

        def first_prompt_seen() -> bool:   # the engine stores a first prompt: both views learn its block size
            complete(bases[0], list(range(1000, 1064)))
            return all(stream_live_and_events(b) for b in bases)

        wait_until(first_prompt_seen, 60, interval_s=0.2, what="both routers' views live with the engine's events")
        assert metric(bases[1], "fleet_router_peer_claims_received_total") in (None, 0.0)
        complete(bases[0], list(range(5000, 5064)))   # a new prompt: 4 blocks of 16 claimed at e0
        wait_until(lambda: (metric(bases[1], "fleet_router_peer_claims_received_total") or 0) >= 1, 20,
                   interval_s=0.1, what="router 1 to receive router 0's claim")
        assert (metric(bases[0], "fleet_router_peer_claims_sent_total") or 0) >= 1
        assert metric(bases[1], 'fleet_router_peer_datagrams_rejected_total{reason="claim"}') == 0.0

        def blocks(base: str) -> float:
            return metric(base, 'fleet_router_kv_index_blocks{endpoint="e0",model="m"}') or 0

        wait_until(lambda: min(blocks(b) for b in bases) >= 8, 20, interval_s=0.1,
                   what="8 blocks in both routers' views")
        assert [blocks(b) for b in bases] == [8.0, 8.0]   # both prompts' blocks, from the engine's events
    finally:
        stop([*procs, engine])


def test_two_routers_place_new_conversations_where_the_engines_stored_least(tmp_path: Path) -> None:
    """Two simulated engines publishing their KV events and two `python -m router --peers`
    processes, requests alternating between the routers (as behind a Kubernetes Service). Each
    new conversation (a prompt no engine holds) goes to the endpoint whose engine has stored the
    fewest blocks (`router.pools.policies.KvAware`, step 3; `router.kv.exact_index.ExactIndex.placed_blocks`),
    whichever router takes it: with prompts of one length, sent one after another, the second of
    each pair goes to the engine the first did not, so the engines' stored blocks never differ by
    more than one prompt. Placing by the prompt's hash alone (the rule before) sends these eight
    prompts 3 / 5, the first three to one engine (checked by breaking the rule)."""
    procs, bases = peer_routers()
    engines, kvs = zip(*(start_engine(tmp_path / f"engine{i}.json") for i in (0, 1)))
    try:
        urls = [engine_url(tmp_path / f"engine{i}.json") for i in (0, 1)]
        put_pool(bases, [{"id": f"e{i}", "url": urls[i], "kv_events": kvs[i]} for i in (0, 1)])

        def blocks(base: str) -> list[float]:
            return [metric(base, f'fleet_router_kv_index_blocks{{endpoint="e{i}",model="m"}}') or 0 for i in (0, 1)]

        def live(base: str) -> bool:
            return all(metric(base, f'fleet_router_kv_stream_live{{endpoint="e{i}",model="m"}}') == 1.0
                       for i in (0, 1))  # fmt: skip

        def settle(want: float) -> None:
            """Until both routers' views hold `want` blocks in all (the engines' events arrived)."""
            wait_until(lambda: all(sum(blocks(b)) == want for b in bases), 30, interval_s=0.1,
                       what=f"{want:g} blocks in both routers' views",
                       explain=lambda: f"blocks per router: {[blocks(b) for b in bases]}")

        wait_until(lambda: all(live(b) for b in bases), 60, interval_s=0.2,
                   what="both routers following both engines' KV event streams")
        # Each engine stores one 4-block prompt sent to it directly: both views learn the block size.
        for i in (0, 1):
            req = urllib.request.Request(f"{urls[i]}/v1/completions", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": "m", "prompt": list(range(100 + 64 * i, 164 + 64 * i)),
                                                          "max_tokens": 1}).encode())  # fmt: skip
            urllib.request.urlopen(req, timeout=60).close()
        settle(8)
        held = 8
        for n in range(8):   # eight new conversations of 64 tokens (4 blocks), alternating routers
            complete(bases[n % 2], list(range(5000 + 64 * n, 5064 + 64 * n)))
            held += 4
            settle(held)
            counts = blocks(bases[0])
            assert blocks(bases[1]) == counts   # both routers read the same engines
            assert abs(counts[0] - counts[1]) <= 4, f"after prompt {n}: {counts}"
            if n % 2:
                assert counts[0] == counts[1], f"after prompt {n}: {counts}"
        answered = [sum(answered_by(b, f"e{i}") for b in bases) for i in (0, 1)]
        assert answered == [4.0, 4.0]   # the engines' direct prompts went past the routers
    finally:
        stop([*procs, *engines])
