"""The Prometheus configuration that scrapes a local fleet through Fleet's service discovery.

Owns `prometheus_config`: a complete prometheus.yml (one scrape job reading the file_sd file
`fleet up` keeps current, `fleet.observability.discovery`; optionally the rules file). Printed by
`fleet prometheus-config`; the integration test starts a real Prometheus on it.
"""

from __future__ import annotations

from pathlib import Path

import yaml


def prometheus_config(targets_file: Path, *, scrape_interval: str = "15s", evaluation_interval: str | None = None,
                      rule_files: list[Path] | None = None, refresh_interval: str = "5s") -> str:  # fmt: skip
    """prometheus.yml text scraping every target in ``targets_file`` (file_sd JSON).

    The ``job`` of each target comes from the file (`discovery.JOB_ROUTER`, `JOB_ENGINE`,
    `JOB_CONTROLLER`, `JOB_NODE_AGENT`): target labels from service discovery take precedence
    over the scrape job's name. ``refresh_interval`` is how often Prometheus re-reads the file besides its
    inotify watch.
    """
    doc: dict = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": evaluation_interval or scrape_interval},
        "scrape_configs": [{
            "job_name": "fleet",
            "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": refresh_interval}],
        }],
    }  # fmt: skip
    if rule_files:
        doc["rule_files"] = [str(p) for p in rule_files]
    header = f"# Prometheus configuration for the local fleet whose targets `fleet up` writes to {targets_file}\n"
    return header + yaml.safe_dump(doc, sort_keys=False)
