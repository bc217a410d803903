"""Routing policies: pick one endpoint of a pool for one request.

Owns the `RoutingPolicy` base class, the registry of policies by name, and the built-in
policies. Called by `router.pools.pool.Pool.pick` on the request path (once per attempt) and by
anything that wants to replay routing decisions in virtual time (the trace simulator).

Policies decide, the request path acts: a policy reads the request (`router.kv.prompt_blocks.RouteRequest`:
its prompt's block hashes, token counts, session key) and the live stats of the candidate
endpoints (`in_flight`, `prefill_tokens`, `prefilling`, `ewma_first_byte_s`, `last_sample_s`) and
returns one of them. It does no I/O and never reads a clock; the caller passes `now_s`
(seconds on the router's injected clock). State a policy keeps: a rotation counter for
breaking ties and, for `kv-aware`, its view of each endpoint's prefix cache
(`router.kv.prefix_index.PrefixIndex`).

Every policy has the same signature, `choose(candidates, request, now_s, kv_view) -> EndpointState`
(`kv_view`: the engines' own account of their KV caches, `router.kv.exact_index.ExactIndex`, which
the pool owns and hands to every policy alike; None when no endpoint of the pool publishes KV
events), and registers under a name with `class Foo(RoutingPolicy, name="foo")`.
`on_endpoints(ids)` tells a policy which endpoints its pool has now, so per-endpoint state of
departed ones is dropped.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, ClassVar

from router.kv.prefix_index import PrefixIndex
from router.pools.endpoint import EndpointState
from router.kv.exact_index import Claim, StreamState
from router.kv.prompt_blocks import BYTES_PER_TOKEN, ROUTER_BLOCK_TOKENS, RouteRequest
from fleet.base.registry import Registered, Registry

if TYPE_CHECKING:
    from router.kv.exact_index import ExactIndex


DEFAULT_POLICY = "kv-aware"
"""Name of the policy a pool gets when its spec names none: `kv-aware`, since it beat
`latency-aware` and round-robin at p99 TTFT on every trace the routing benchmark ships
(docs/benchmarks.md, "Routing that knows the KV cache")."""

DEFAULT_STALE_AFTER_S = 10.0
"""How old (seconds) an endpoint's last TTFT sample may be before `latency-aware` treats
the endpoint as unmeasured and tries it first, so a recovered endpoint is re-measured."""

DEFAULT_CACHE_TOKENS_PER_ENDPOINT = 400_000
"""Prompt tokens `kv-aware` remembers per endpoint before it forgets the least recently routed:
about the KV cache of one H100 serving an 8B model (27,000 blocks of 16 tokens = 432k tokens,
fleet/enginesim/profiles.py), a little less because running requests hold blocks too."""

DEFAULT_LOAD_BOUND = 1.5
"""`kv-aware`'s bound on an endpoint's share of the requests in flight, as a factor of the mean:
an endpoint with `ceil(bound x (in flight + 1) / endpoints)` requests in flight takes no more
until the others catch up, however much of the prompt it holds. The "c" of consistent hashing
with bounded loads (Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded
Loads", SODA 2018), whose analysis holds for any c > 1. On the Mooncake trace in the trace
simulator (docs/routing.md) p99 TTFT was 3.07 s at 1.25, 2.72 s at 1.5 and 2.64 s at 2: 1.5
keeps a popular prefix to a tighter share for a p99 within 3% of the loosest bound."""

DEFAULT_DECODE_TOKEN_WEIGHT = 64.0
"""Prefill tokens that one request decoding on an endpoint is worth in `kv-aware`'s cost: each
running decode lengthens every engine step (it reads its whole context), so it delays the
prefills queued behind it. In the trace simulator on the Mooncake trace, p99 TTFT was 2.88 s
without this term (weight 0) and 2.72 s with 64 (docs/routing.md)."""

DEFAULT_AFFINITY_SLACK = 0.25
"""When no endpoint is known to hold a request's prefix, `kv-aware` prefers its affinity key's
endpoint (rendezvous hashing) among those whose cost is within this fraction of the prompt's
tokens of the cheapest, so that a conversation starts where every router will look for it. With
one router 0 does as well (p99 TTFT 2.69 s against 2.72 s on the Mooncake trace in the trace
simulator); with two routers it keeps more conversations where they were (prefix-cache hits
20.9% against 17.5%) at about the same p99 (docs/routing.md)."""

DEFAULT_MISS_TOKEN_WEIGHT = 16.0
"""Queued prefill tokens that one prompt token an endpoint would have to prefill (not cached
there) is worth in `kv-aware`'s cost. At weight 1 the cost is this request's own wait, so a
conversation leaves its cached prefix for an idle endpoint as soon as the queue in front of its
cache exceeds the prefix; but the redone prefill is work the whole fleet pays for (every request
queued or decoding on the new endpoint waits through it, and its blocks evict others' prefixes
there), which the greedy wait does not count. 16 (with `DEFAULT_PREFIX_LOAD_BOUND` 16) is the
trace simulator's choice on Mooncake seconds 300-600 and 900 to the trace's end, two routers on
KV events and load shared between the routers (docs/routing.md, "How the defaults were chosen"): weight 1 gives
10.1% / 47.7% prefix-cache hits and p99 TTFT 3.23 s / 2.87 s, weight 4 15.5% / 57.5% and
2.73 s / 2.32 s; averaged over the simulator's seeds 0-2, weight 16 with bound 16 finds 67.8%
hits on seconds 900-1,100 at 80% and 90% load against 67.2% / 67.3% for weight 8 with bound 6
(`cache-aware`: 67.7%), p99 TTFT within 2%. Prompts that share nothing (Azure `conv`) route the
same at any weight: the term is then the same on every endpoint."""

DEFAULT_PREFIX_LOAD_BOUND = 16.0
"""`kv-aware`'s load bound (`DEFAULT_LOAD_BOUND`) for an endpoint that holds more than
`DEFAULT_PREFIX_SHARE` of the request's prompt (vllm-router's `cache_aware` stays with such a
prefix, `--cache-threshold` 0.3, until 64 more requests run on one worker than another): it may
take requests until it holds this factor of the mean in flight, where others stop at
`DEFAULT_LOAD_BOUND` (1.5). Under the general bound a conversation's turn leaves its 15k-token
prefix once its home holds 1.5x the mean, and redoes the prefill elsewhere; the cost (queued
prefill tokens) still weighs the wait there. Finite, so a prefix every request shares still
spills. Tuned with `DEFAULT_MISS_TOKEN_WEIGHT` in the trace simulator on the same two Mooncake
windows (two routers, KV events, load shared between the routers; docs/routing.md, "How the defaults were
chosen"): the general bound alone (1.5) gives 15.4% / 54.9% hits, p99 TTFT 2.74 s / 2.49 s, e2e
p50 2.96 s / 0.88 s; 4 gives 16.6% / 65.6%, 2.73 s / 2.32 s, 2.86 s / 0.65 s; 100 (no bound)
66.0% hits on the second window; `cache-aware` there 15.7% / 67.7%, 4.59 s / 2.44 s, 3.91 s /
0.70 s. With `DEFAULT_PREFIX_SHARE` 0.3, bounds of 6, 8 and 16 route alike and 4 binds; averaged
over the simulator's seeds 0-2 (the prompts' token ids, so every tie broken by hash), 16 with
weight 16 finds 0.5 points more hits than 6 with weight 8 on seconds 900-1,100 at 80% and 90%
load (67.8% against 67.2% and 67.3%; `cache-aware` 67.7%), within 0.1 point on seconds 300-600,
p99 TTFT within 2%, and routes Azure `code` and `conv` the same."""

DEFAULT_PREFIX_SHARE = 0.3
"""Share of the prompt an endpoint must hold for `DEFAULT_PREFIX_LOAD_BOUND`, not
`DEFAULT_LOAD_BOUND`, to apply to it: vllm-router's `cache_aware` `--cache-threshold` default
(0.1.17), so both stay with a prefix from the same share. In the trace simulator on Mooncake
seconds 300-600 and 900-1,100 (two routers, KV events, load shared between the routers, 80% and 90% load;
docs/routing.md, "How the defaults were chosen"), 0.3 with a prefix bound of 6 gives 16.6% /
66.2% hits at 80% and 15.8% / 66.5% at 90%, against 16.6% / 65.6% and 15.8% / 63.9% for 0.5
with a bound of 4, p99 TTFT the same or lower (2.41 s against 2.59 s on the second window at
90%); 0.2 and 0.1 give 65.1% there."""

DEFAULT_NEW_PREFIX_SLACK = 0.05
"""Where `kv-aware` starts a new conversation while the engines' KV events are live: a prompt no
endpoint holds over `DEFAULT_PREFIX_SHARE` of, with no session key, goes to the endpoint that has
taken the fewest blocks of new prompt content so far (`router.kv.exact_index.ExactIndex.placed_blocks`:
blocks its engine reported stored, plus blocks claimed there and not yet stored) among those whose
cost is within this fraction of the prompt's tokens of the cheapest. It is `cache_aware`'s third
rule (the worker with the smallest tree: the least distinct prompt text sent), read from the
engines' own account, so every router sees the same counts and places alike, where rendezvous
hashing would place a conversation by a hash of its first block (a lottery: the simulator's seeds
move its hits by up to 1.3 points). In the trace simulator (Mooncake tuning windows, two routers, KV
events, load shared between the routers, 80% and 90%, six draws of token ids and arrival order; docs/routing.md,
"How the defaults were chosen" and "Today's defaults against `cache-aware`"): prefix-cache hits
the same as placing by rendezvous hashing (30.80% against 30.73%, `cache-aware` 30.76%), p99 TTFT
lower in each of the six window-load cells (by 1-8%). At 0.05 Azure `code` and `conv` route as
they do by rendezvous hashing (p99 TTFT 6.528 s and 0.346 s); 0.1 finds as many hits but costs
`code` 1.5% of p99 TTFT."""

DEFAULT_PENDING_S = 10.0
"""How long `kv-aware` counts a prompt it sent as held at its endpoint before the engine reports
the blocks stored (`router.kv.exact_index.ExactIndex.expect`): the entry goes as soon as the engine's
`BlockStored` arrives, so this cap only ends the claims of prompts that never store (failed or
cancelled while queued). Above the p99 TTFT of every benchmark run on the Mooncake trace (2.4-4.4
s, docs/benchmarks.md). Measured in the trace simulator with a time-only expiry, 1-15 s route
alike; 0 turns the overlay off (docs/routing.md, "How the defaults were chosen")."""

ROUTING_POLICIES: Registry[RoutingPolicy] = Registry("routing policy")
"""The routing policies by name (`fleet.base.registry`): a pool's `policy` must be one of them."""


class RoutingPolicy(Registered, registry=ROUTING_POLICIES):
    """Base class of routing policies; subclasses register with `name=...` (`fleet.base.registry`).

    Subclasses implement `choose`. Instances hold tie-break rotation state, so each pool
    owns its own instance (see `make_policy`).
    """

    uses_prompt_blocks: ClassVar[bool] = False
    """Whether `choose` reads `RouteRequest.block_hashes`; when a pool's policy does not,
    `router.request.prepare` does not hash prompts (the hashing is the dearest part of building a
    request's view)."""
    uses_engine_load: ClassVar[bool] = False
    """Whether the policy reads `EndpointState.others_*` (the router then polls the pool's
    engines for their load: `router.signals.engine_poll`)."""
    uses_token_ids: ClassVar[bool] = False
    """Whether `choose` reads `RouteRequest.token_ids` with a live `kv_view`: the pool then asks
    for text and chat prompts to be tokenized while some endpoint's view is live
    (`router.pools.pool.Pool.wants_token_ids`; the dearest step of a request's view,
    docs/benchmarks.md, "Tokenizing in the router")."""

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[EndpointState], request: RouteRequest, now_s: float,
               kv_view: ExactIndex | None = None) -> EndpointState:  # fmt: skip
        """Return the endpoint that should serve `request`.

        `candidates` is non-empty and holds only ready (non-draining, not yet tried)
        endpoints; `now_s` is the router clock in seconds; `kv_view` the pool's exact view of the
        engines' KV caches (`router.kv.exact_index.ExactIndex`; None: none). A policy may set
        `request.cached_tokens` (what it expects the chosen endpoint to have cached). Must
        not do I/O.
        """
        raise NotImplementedError

    def on_endpoints(self, endpoint_ids: Collection[str]) -> None:
        """The pool's endpoints are now `endpoint_ids` (draining ones included); forget state
        kept for any other. Called whenever a pool is (re)built. Default: nothing kept."""

    def learn(self, endpoint_id: str, block_hashes: Sequence[int]) -> None:
        """Another source says `endpoint_id` now holds the prompt blocks `block_hashes` (a
        placement another router made, or the engine's KV events). Default: ignored."""

    def _rotate(self, ties: Sequence[EndpointState]) -> EndpointState:
        """Pick among equally good endpoints in turn, so ties spread load evenly. A single
        candidate does not advance the turn (a retry with one endpoint left keeps the
        rotation of the first choices even)."""
        if len(ties) == 1:
            return ties[0]
        self._turn += 1
        return ties[self._turn % len(ties)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def policy_names() -> list[str]:
    """Names of all registered routing policies, sorted."""
    return ROUTING_POLICIES.names()


def make_policy(name: str) -> RoutingPolicy:
    """Return a fresh instance of the policy registered as `name`.

    Raises `KeyError` (whose message lists the known names) for an unknown name.
    """
    return ROUTING_POLICIES.get(name)()


def _fewest_in_flight(candidates: Sequence[EndpointState]) -> list[EndpointState]:
    """The candidates that have the fewest requests in flight (one pass, no sort)."""
    best = candidates[0].in_flight
    ties: list[EndpointState] = []
    for endpoint in candidates:
        n = endpoint.in_flight
        if n < best:
            best = n
            ties = [endpoint]
        elif n == best:
            ties.append(endpoint)
    return ties


class RoundRobin(RoutingPolicy, name="round-robin"):
    """Each candidate in turn, ignoring load and latency."""

    def choose(self, candidates: Sequence[EndpointState], request: RouteRequest, now_s: float,
               kv_view: ExactIndex | None = None) -> EndpointState:  # fmt: skip
        return self._rotate(candidates)


class LeastOutstanding(RoutingPolicy, name="least-outstanding"):
    """The candidate with the fewest requests in flight through this router; ties rotate."""

    def choose(self, candidates: Sequence[EndpointState], request: RouteRequest, now_s: float,
               kv_view: ExactIndex | None = None) -> EndpointState:  # fmt: skip
        return self._rotate(_fewest_in_flight(candidates))


class LatencyAware(RoutingPolicy, name="latency-aware"):
    """Fewest in flight first; among those, the lowest EWMA time to first byte.

    Among the endpoints with the fewest requests in flight, an endpoint that is unmeasured
    (no TTFT sample yet, or its last sample is more than `stale_after_s` old) is preferred,
    so that it gets measured; otherwise the endpoint with the lowest `ewma_first_byte_s` wins.
    Remaining ties rotate. Outstanding-requests-first keeps one fast endpoint from taking
    every request; the EWMA only orders equally loaded endpoints.
    """

    def __init__(self, stale_after_s: float = DEFAULT_STALE_AFTER_S) -> None:
        super().__init__()
        self.stale_after_s = stale_after_s

    def choose(self, candidates: Sequence[EndpointState], request: RouteRequest, now_s: float,
               kv_view: ExactIndex | None = None) -> EndpointState:  # fmt: skip
        ties = _fewest_in_flight(candidates)
        if len(ties) == 1:
            return ties[0]
        oldest_fresh_s = now_s - self.stale_after_s
        unknown: list[EndpointState] = []
        fastest: list[EndpointState] = []
        best_s = float("inf")
        for endpoint in ties:
            ewma_s = endpoint.ewma_first_byte_s
            sampled_s = endpoint.last_sample_s
            if ewma_s is None or sampled_s is None or sampled_s < oldest_fresh_s:
                unknown.append(endpoint)
            elif ewma_s < best_s:
                best_s = ewma_s
                fastest = [endpoint]
            elif ewma_s == best_s:
                fastest.append(endpoint)
        return self._rotate(unknown or fastest)


class KvAware(RoutingPolicy, name="kv-aware"):
    """The endpoint where the request costs least: prompt tokens it would prefill there plus
    the work already queued there, under a bound on load; ties go by rendezvous hash.

    For each candidate `e`, with `cached(e)` the request's leading prompt tokens `e` holds: from
    the engines' own KV events (`router.kv.exact_index.ExactIndex`, the pool's `kv_view`)
    when `e`'s event stream is live and the request carries token ids (`RouteRequest.token_ids`),
    else what the router believes (`router.kv.prefix_index.PrefixIndex`, fed with every prompt this
    policy routed, which also covers the time before an endpoint's events arrive); while `e`'s
    view rebuilds after a resync (`StreamState.REBUILDING`: it holds what `e` stored since, a lower
    bound), the larger of the two. On a live or rebuilding view, a prompt this router sent to `e`
    within `pending_s` whose blocks the engine has not reported stored yet counts as held
    there (`ExactIndex.expect`: it is being prefilled, and the next request sharing its prefix
    finds it cached by the time it is admitted):

        cost(e) = miss_token_weight x (prompt_tokens - cached(e))   # what e would prefill for it
                + e.prefill_tokens                     # prefill queued on e (not yet past TTFT)
                + decode_token_weight x decoding(e)    # requests decoding on e

    in prefill tokens; the prefill the request would do is weighed `miss_token_weight` times a
    queued token, because the fleet, not only this request, pays for it (`DEFAULT_MISS_TOKEN_WEIGHT`).
    The load terms (and the in-flight count of step 1) are this router's own
    plus, while fresh, its estimate of what other routers sent there (`EndpointState.others_*`,
    kept by `router.signals.engine_load.EngineLoadView` from the engines' own load). Prompts vary a hundredfold in length, so queued work is counted in
    tokens, not requests. Steps:

    1. **Bounded load** (Mirrokni et al. 2018, see `DEFAULT_LOAD_BOUND`): endpoints with
       `ceil(load_bound x (in flight + 1) / n)` or more requests in flight are left out, so a
       popular prefix spills over to other endpoints instead of piling onto one; an endpoint
       holding more than `prefix_share` of the prompt (`DEFAULT_PREFIX_SHARE`) is left out only
       from `prefix_load_bound` x the mean (`DEFAULT_PREFIX_LOAD_BOUND`), so a conversation stays
       with its prefix longer.
    2. The cheapest of the rest wins if some endpoint is believed to hold a prefix of the
       request (affinity earned by the cache); with the engines' events live, over
       `prefix_share` of it, unless the request has a session key.
    3. A new conversation, with the engines' events live (every endpoint near the cheapest
       has an exact view, no endpoint holds over `prefix_share` of the prompt, and the request
       has no session key): among the endpoints within `new_prefix_slack x prompt_tokens` of
       the cheapest, the one that has taken the fewest blocks of new prompt content
       (`ExactIndex.placed_blocks`: blocks its engine stored, plus blocks claimed there and not
       stored yet), as `cache_aware` picks its smallest tree (`DEFAULT_NEW_PREFIX_SLACK`). Every
       router reads the same events (behind the endpoint picker, one view holds every router's
       claims), so they count alike.
    4. Otherwise (no exact view, or a session key; nothing held anywhere, or a prompt shorter
       than one block) the request's affinity key (`RouteRequest.affinity_key`: session id,
       else the first block's hash) picks, by rendezvous hashing (highest random weight;
       Thaler and Ravishankar, 1998), among the endpoints within `affinity_slack x
       prompt_tokens` of the cheapest. Every router computes the same weights, so two routers
       in front of one pool place a new conversation on the same endpoint while loads are
       comparable, and each then finds the next turn's prefix where the other put it, without
       talking. No key: fewest tokens, ties rotate.

    The chosen endpoint's expected hit is written to `request.cached_tokens`, and the prompt's
    blocks are recorded as held there. Session affinity is the same rendezvous choice keyed on
    the session, so it works where prompts share no prefix.

    Args:
        cache_tokens_per_endpoint: prompt tokens remembered per endpoint (LRU beyond).
        load_bound, decode_token_weight, affinity_slack, miss_token_weight, prefix_load_bound,
            prefix_share, pending_s, new_prefix_slack: see the module constants (`pending_s` 0:
            no claims of prompts sent and not yet stored).

    Raises:
        ValueError: `load_bound` <= 1, `prefix_load_bound` < `load_bound`, `prefix_share`
            outside [0, 1], a negative weight, slack or `pending_s`, or `miss_token_weight` < 1.
    """

    uses_prompt_blocks = True
    uses_engine_load = True
    uses_token_ids = True

    def __init__(self, *, cache_tokens_per_endpoint: int = DEFAULT_CACHE_TOKENS_PER_ENDPOINT,
                 load_bound: float = DEFAULT_LOAD_BOUND, decode_token_weight: float = DEFAULT_DECODE_TOKEN_WEIGHT,
                 affinity_slack: float = DEFAULT_AFFINITY_SLACK,
                 miss_token_weight: float = DEFAULT_MISS_TOKEN_WEIGHT,
                 prefix_load_bound: float = DEFAULT_PREFIX_LOAD_BOUND,
                 prefix_share: float = DEFAULT_PREFIX_SHARE,
                 pending_s: float = DEFAULT_PENDING_S,
                 new_prefix_slack: float = DEFAULT_NEW_PREFIX_SLACK) -> None:  # fmt: skip
        super().__init__()
        if new_prefix_slack < 0:
            raise ValueError(f"new_prefix_slack must be >= 0, got {new_prefix_slack}")
        self.new_prefix_slack = new_prefix_slack
        if pending_s < 0:
            raise ValueError(f"pending_s must be >= 0, got {pending_s}")
        self.pending_s = pending_s
        if not 0.0 <= prefix_share <= 1.0:
            raise ValueError(f"prefix_share must be within [0, 1], got {prefix_share}")
        self.prefix_share = prefix_share
        if load_bound <= 1.0:
            raise ValueError(f"load_bound must be > 1, got {load_bound}")
        if prefix_load_bound < load_bound:
            raise ValueError(f"prefix_load_bound must be >= load_bound ({load_bound}), got {prefix_load_bound}")
        self.prefix_load_bound = prefix_load_bound
        if decode_token_weight < 0 or affinity_slack < 0:
            raise ValueError("decode_token_weight and affinity_slack must be >= 0")
        if miss_token_weight < 1.0:
            raise ValueError(f"miss_token_weight must be >= 1, got {miss_token_weight}")
        self.miss_token_weight = miss_token_weight
        self.index = PrefixIndex(max(1, cache_tokens_per_endpoint // ROUTER_BLOCK_TOKENS))
        self.load_bound = load_bound
        self.decode_token_weight = decode_token_weight
        self.affinity_slack = affinity_slack
        self._endpoint_hash: dict[str, int] = {}

    def learn(self, endpoint_id: str, block_hashes: Sequence[int]) -> None:
        if block_hashes:
            self.index.record(endpoint_id, block_hashes)

    def on_endpoints(self, endpoint_ids: Collection[str]) -> None:
        self.index.retain(endpoint_ids)
        for endpoint_id in [e for e in self._endpoint_hash if e not in endpoint_ids]:
            del self._endpoint_hash[endpoint_id]

    def choose(self, candidates: Sequence[EndpointState], request: RouteRequest, now_s: float,
               kv_view: ExactIndex | None = None) -> EndpointState:  # fmt: skip
        hashes = request.block_hashes
        matched = self.index.match(hashes) if hashes else {}
        prompt = request.prompt_tokens
        n = len(candidates)
        # Load per endpoint: this router's own requests, plus what other routers sent while
        # an estimate of it is fresh (`EndpointState.others_*`, `router.signals.engine_load`).
        loads = []
        total = 0
        for e in candidates:
            if e.others_until_s >= now_s:
                load = (e.in_flight + e.others_in_flight, e.prefilling + e.others_prefilling,
                        e.prefill_tokens + e.others_prefill_tokens)  # fmt: skip
            else:
                load = (e.in_flight, e.prefilling, e.prefill_tokens)
            loads.append(load)
            total += load[0]
        exact = kv_view
        token_ids = request.token_ids
        pending = self.pending_s > 0
        held = (exact.match(token_ids, rebuilding=True, now_s=now_s if pending else None)
                if exact is not None and token_ids else None)  # fmt: skip
        hits: dict[str, int] = {}
        viewed: set[str] = set()   # endpoints with an exact view (live or rebuilding)
        for e in candidates:
            believed = min(prompt, matched.get(e.id, 0) * ROUTER_BLOCK_TOKENS)
            if held is None:
                hits[e.id] = believed
                continue
            state = exact.state(e.id)  # type: ignore[union-attr]
            if state is StreamState.LIVE:
                hits[e.id] = min(prompt, held.get(e.id, 0))
                viewed.add(e.id)
            elif state is StreamState.REBUILDING:   # a lower bound: what either view knows is held
                hits[e.id] = max(believed, min(prompt, held.get(e.id, 0)))
                viewed.add(e.id)
            else:
                hits[e.id] = believed
        if n > 1:
            cap = math.ceil(self.load_bound * (total + 1) / n)
            cap_held = math.ceil(self.prefix_load_bound * (total + 1) / n)   # holds over prefix_share of it
            held_from = self.prefix_share * prompt
            pairs = [(e, load) for e, load in zip(candidates, loads)
                     if load[0] < (cap_held if hits[e.id] > held_from else cap)] or list(zip(candidates, loads))
        else:
            pairs = list(zip(candidates, loads))
        weight = self.decode_token_weight
        miss = self.miss_token_weight
        eligible: list[EndpointState] = []
        costs: list[float] = []
        best = math.inf
        for e, (in_flight, prefilling, prefill_tokens) in pairs:
            cached = hits[e.id]
            cost = miss * (prompt - cached) + prefill_tokens + weight * (in_flight - prefilling)
            eligible.append(e)
            costs.append(cost)
            if cost < best:
                best = cost
        key = request.affinity_key()
        chosen = None
        if held is not None and request.session_key is None and max(hits.values()) <= self.prefix_share * prompt:
            chosen = self._new_conversation(eligible, costs, best + self.new_prefix_slack * prompt, key, viewed,
                                            exact)  # type: ignore[arg-type]
        if chosen is None:
            if key is not None and not any(hits.values()):
                limit = best + self.affinity_slack * prompt
                chosen = self._rendezvous(key, [e for e, c in zip(eligible, costs) if c <= limit])
            else:
                chosen = self._rotate([e for e, c in zip(eligible, costs) if c == best])
        request.cached_tokens = hits[chosen.id]
        claim = None
        if held is not None and pending:
            until_s = now_s + self.pending_s
            keys = exact.expect(chosen.id, token_ids, until_s, now_s)  # type: ignore[union-attr,arg-type]
            if keys:
                claim = Claim(chosen.id, keys, until_s)
        request.claim = claim
        if hashes:
            self.index.record(chosen.id, hashes)
        return chosen

    def _new_conversation(self, eligible: Sequence[EndpointState], costs: Sequence[float], limit: float,
                          key: int | None, viewed: set[str], exact: ExactIndex) -> EndpointState | None:  # fmt: skip
        """Of the `eligible` endpoints costing at most `limit`, the one that has taken the fewest
        blocks (`exact.placed_blocks`; ties by rendezvous on `key`, else in turn): step 3 of
        the class docstring with the engines' events live. None if one of them is not in
        `viewed` (no exact view: its count would be stale), and the rendezvous choice decides."""
        near: list[EndpointState] = []
        placed: list[int] = []
        for e, c in zip(eligible, costs):
            if c <= limit:
                if e.id not in viewed:
                    return None
                near.append(e)
                placed.append(exact.placed_blocks(e.id))
        fewest = min(placed)
        ties = [e for e, n in zip(near, placed) if n == fewest]
        if key is None or len(ties) == 1:
            return self._rotate(ties)
        return self._rendezvous(key, ties)

    def _rendezvous(self, key: int, endpoints: Sequence[EndpointState]) -> EndpointState:
        """The endpoint of highest rendezvous weight for `key` (`_weight`; non-empty `endpoints`)."""
        return max(endpoints, key=lambda e: self._weight(key, e.id))

    def _weight(self, key: int, endpoint_id: str) -> int:
        """Rendezvous weight of `endpoint_id` for `key`: the same in every router process."""
        h = self._endpoint_hash.get(endpoint_id)
        if h is None:
            h = self._endpoint_hash[endpoint_id] = _mix64(zlib.crc32(endpoint_id.encode()))
        return _mix64(_mix64(key & _MASK64) ^ h)


CACHE_AWARE_TREE_CHARS = 33_554_432
"""vllm-router's ``--max-tree-size`` default: the characters of prompt text its `cache_aware` tree
keeps per worker before its periodic eviction (every ``--eviction-interval-secs``, 120 s) trims
the least recently used (vllm-router 0.1.17, the `bench` extra's version: ``vllm-router --help``).
`CacheAware` keeps it as prompt tokens at `router.kv.prompt_blocks.BYTES_PER_TOKEN` characters each:
8.4M tokens, so over a benchmark's minutes the tree forgets nothing and "the smallest tree" is the
worker that was sent the least distinct prompt text."""


class CacheAware(RoutingPolicy, name="cache-aware"):
    """vLLM's router's (and SGLang's router's) `cache_aware`, kept as a baseline: the endpoint
    holding the longest prefix of the request while loads are balanced, else the least loaded.

    Source: vllm-project/router `src/policies/cache_aware.rs` (from sglang-router), with the
    defaults of the vllm-router the benchmarks run (0.1.17, ``vllm-router --help``):
    `cache_threshold` 0.3, `balance_abs_threshold` 64, `balance_rel_threshold` 1.5, and a tree of
    `CACHE_AWARE_TREE_CHARS` per worker. With `load` this router's requests in flight per endpoint:

    1. Imbalanced (`max - min > balance_abs_threshold` and `max > balance_rel_threshold x min`):
       the least loaded endpoint.
    2. Else, if the endpoint holding the longest prefix holds more than `cache_threshold` of the
       prompt: that endpoint (ties rotate).
    3. Else the endpoint whose prefix tree is smallest (most room for new prefixes).

    Its view of the caches is this policy's own `PrefixIndex` of the prompts it routed (the
    approximate tree, `CACHE_AWARE_TREE_CHARS` per endpoint: it outlives the engines' caches, as
    vllm-router's does, so it predicts hits the engine has evicted); it reads neither KV events
    nor other routers' load. Every prompt's blocks are recorded at the chosen endpoint. Memory:
    up to ~130,000 router blocks per endpoint (about 30 MB each), reached only after 8.4M
    distinct prompt tokens were sent to it.

    Raises:
        ValueError: `cache_threshold` outside [0, 1], a negative absolute threshold or a
            relative one below 1.
    """

    uses_prompt_blocks = True

    def __init__(self, *, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5,
                 cache_tokens_per_endpoint: int = CACHE_AWARE_TREE_CHARS // BYTES_PER_TOKEN) -> None:  # fmt: skip
        super().__init__()
        if not 0.0 <= cache_threshold <= 1.0 or balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError("need 0 <= cache_threshold <= 1, balance_abs_threshold >= 0, balance_rel_threshold >= 1")
        self.index = PrefixIndex(max(1, cache_tokens_per_endpoint // ROUTER_BLOCK_TOKENS))
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def on_endpoints(self, endpoint_ids: Collection[str]) -> None:
        self.index.retain(endpoint_ids)

    def choose(self, candidates: Sequence[EndpointState], request: RouteRequest, now_s: float,
               kv_view: ExactIndex | None = None) -> EndpointState:  # fmt: skip
        hashes = request.block_hashes
        loads = [e.in_flight for e in candidates]
        low, high = min(loads), max(loads)
        matched = self.index.match(hashes) if hashes else {}
        hits = {e.id: min(request.prompt_tokens, matched.get(e.id, 0) * ROUTER_BLOCK_TOKENS) for e in candidates}
        if high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low:
            chosen = self._rotate([e for e, n in zip(candidates, loads) if n == low])
        else:
            longest = max(hits.values())
            if request.prompt_tokens and longest > self.cache_threshold * request.prompt_tokens:
                chosen = self._rotate([e for e in candidates if hits[e.id] == longest])
            else:
                smallest = min(self.index.blocks(e.id) for e in candidates)
                chosen = self._rotate([e for e in candidates if self.index.blocks(e.id) == smallest])
        request.cached_tokens = hits[chosen.id]
        if hashes:
            self.index.record(chosen.id, hashes)
        return chosen


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finalizer (Steele, Lea and Flood, "Fast splittable pseudorandom number
    generators", OOPSLA 2014): a 64-bit bijection whose output bits all depend on all input
    bits, so rendezvous weights of one key over several endpoints are independent."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
