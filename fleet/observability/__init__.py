"""Observability of a fleet: what tells Prometheus where to scrape, what SREs look at, what pages them.

Modules (none of them imports the controller; they read its JSON snapshot):
`discovery` - Prometheus file_sd target groups from the controller snapshot, the atomic writer
`fleet up` calls after each tick, and the controller's own replica-state metrics;
`scrape` - the Prometheus configuration `fleet prometheus-config` prints;
`promql` - the query lint (counters and buckets only under rate()/increase(), quantiles by le);
`dashboard` - the Grafana dashboard as code (grafana-foundation-sdk), rendered to
docs/observability/fleet-dashboard.json;
`rules` - SLO recording rules and alert rules, rendered to docs/observability/fleet-rules.yaml;
`top` - `fleet top`, the live terminal view of a local fleet.
"""
