"""The request path: one OpenAI completion request from the client's bytes to the engine's answer.

The client's connection and the cheap checks (`asgi_io`), the first-token deadline (`deadline`),
and `Proxy` (`proxy`), which runs the steps in order: parse, resolve the pool, prepare the
routing request, pick an endpoint, attempt it (retrying elsewhere) and relay the answer.
"""
