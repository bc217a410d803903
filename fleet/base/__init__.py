"""The base every Fleet package builds on; it imports nothing of Fleet's.

`spec` holds `SpecModel` and `FieldError`, the pydantic base of every YAML document and spec
section (camelCase fields, unknown fields refused, errors that name the field); `rules` holds
`CrossFieldRule`, a rule over several fields of a section declared once for pydantic and for the
CRD's CEL (`x-kubernetes-validations`); `registry` holds
`Registry`, the one helper by which implementations of a kind register by name (routing and
scaling policies, placement strategies, engine kinds, rollout judges); `names` holds the name
patterns several documents check (a DNS-1123 label, a MIG profile). The data plane (`router/`),
the scaling policies (`autoscaler/`) and the warm-up gate (`warmup/`) import these modules and
nothing else of `fleet/` (docs/architecture.md).
"""
