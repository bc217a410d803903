"""What the router learns off the request path, each from a background loop (`background`).

The engines' own load from their `/metrics` (`engine_load`, `engine_poll`), the engines' KV cache
event streams (`kv_streams`, a `kv_subscriber` per endpoint on the shared `drain_ticks`, feeding
`router.kv.exact_index`), and the load other routers sent,
exchanged with them over the peer channel (`peer_load`, `peer_channel`, `peer_datagram`,
`peer_discovery`).
"""
