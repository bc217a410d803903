"""The router's view of what each endpoint holds in its KV (prefix) cache, and the prompt tokens
that view is keyed by.

vLLM's KV event wire format (`events`), the exact index fed by those events (`exact_index`), the
approximate index the router keeps from its own routing (`prefix_index`), a request's prompt
blocks (`prompt_blocks`), and the pool's own tokenizer and chat template (`tokenize`,
`token_segments`). Pure: the subscribers that feed the exact index live in `router.signals`.
"""
