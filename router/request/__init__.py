"""The request path: one OpenAI completion request from the client's bytes to the engine's answer.

One module per step, each with one owner: the client's connection and the cheap checks
(`asgi_io`), `parse` (the body and head as a `ParsedRequest`), `prepare` (the routing request the
pool's policy reads), `attempt` (one try on one endpoint: connect, the first-token deadline of
`deadline`, error mapping), `relay` (the engine's answer to the client), `refuse` (the answers the
router gives itself), and `proxy`, whose `Proxy` runs the steps in order: read, parse, resolve the
pool, prepare, admit and pick, attempt (retrying elsewhere) and relay.
"""
