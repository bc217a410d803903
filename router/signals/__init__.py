"""What the router learns off the request path, each from a background loop (`background`).

The engines' own load from their `/metrics` (`engine_load`, `engine_poll`), the engines' KV cache
event streams (`kv_streams`, a `kv_subscriber` per endpoint on the shared `drain_ticks`, feeding
`router.kv.exact_index`). Several routers share one load and one KV view through the endpoint
picker (`router.picker`), not through anything here.
"""
