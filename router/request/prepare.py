"""Prepare step of the request path: the routing request the pool's policy reads.

Owns `routing_request` (a parsed request to a `router.kv.prompt_blocks.RouteRequest`: token counts,
and the prompt's block hashes when the pool's policy reads them, `Pool.hashes_prompts`) and
`add_token_ids` (the prompt's token ids from the pool's tokenizer, `router.kv.tokenize`, when the
pool wants them, `Pool.wants_token_ids`). Called by `router.request.proxy.Proxy` once per request,
on the pool it resolved. What a pool's policy needs is the pool's to say; this module asks it.
"""

from __future__ import annotations

from router.kv.prompt_blocks import RouteRequest, route_request
from router.kv.tokenize import PoolTokenizers
from router.pools.pool import Pool
from router.request.parse import ParsedRequest


def routing_request(pool: Pool, parsed: ParsedRequest) -> RouteRequest:
    """The `RouteRequest` of `parsed` for `pool`: hashed into blocks only when its policy reads
    them (the hashing is the dearest part of it). Its token ids are those of a token-id prompt;
    `add_token_ids` fills them for text and chat."""
    return route_request(parsed.doc, parsed.session, hash_blocks=pool.hashes_prompts)


async def add_token_ids(tokenizers: PoolTokenizers, pool: Pool, doc: dict, request: RouteRequest) -> None:
    """For a pool with a `tokenizer` and a text or chat prompt (`request.token_ids` None): while
    the pool wants token ids, set them (and the prompt's token count, unless a batch) from the
    pool's tokenizer (a long prompt in a worker thread; left None while the tokenizer loads or
    failed: the approximate view decides); otherwise start loading the tokenizer, so it is ready
    when the pool wants it."""
    tokenizer = pool.tokenizer
    if tokenizer is None or request.token_ids is not None:
        return
    if not pool.wants_token_ids():
        tokenizers.want(tokenizer)
        return
    ids = await tokenizers.token_ids(tokenizer, doc)
    if ids is not None:
        request.token_ids = ids
        if not isinstance(doc.get("prompt"), list):   # a batch counts all its prompts
            request.prompt_tokens = len(ids)
