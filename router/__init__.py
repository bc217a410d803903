"""Fleet's data-plane router: an OpenAI-compatible reverse proxy over per-model pools.

Modules, in import order: `policies` (routing policies, pure), `spec` (pool specs,
pydantic), `stats` (windowed per-model statistics, pure), `admission` (admission queue),
`metrics` (Prometheus), `pool` (live endpoint state), `proxy` (the request path), `admin`
(admin API), `app` (`create_app`), `server` (`serve`, uvicorn).
Nothing here imports `fleet` or `autoscaler`; the control plane talks to the router over its
admin API, and the autoscaler reads `stats` over it.
This package init imports nothing, so `router.policies` stays cheap to import.
"""

from __future__ import annotations
