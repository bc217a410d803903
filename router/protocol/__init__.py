"""What clients and engines say, as the router reads and writes it.

OpenAI-format error bodies (`errors`), JSON parsed with a nesting bound (`jsonlimit`), streamed
SSE events (`sse`) and the token usage of an answered request (`tokens`). Pure; the lowest room of
`router/`.
"""
