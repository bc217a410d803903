#!/usr/bin/env bash
# Every test, in three tiers (tests/conftest.py), cheapest first:
#   tests/unit         in-process only: no process, no socket but the test's own loopback fixtures,
#                      no real Kubernetes client (guarded: tests/support/guards.py); ~45 s on 2 cores
#   tests/integration  real processes on loopback (`fleet up`, the router and the engine SIMULATOR,
#                      the API-server and hub stand-ins, Prometheus/promtool, helm), whole trace-
#                      simulator runs and real-time deadlines; minutes
#   tests/e2e          `fleet up` on real vLLM (CPU build)
# Installs what it needs into .venv first (see .ci/venv.sh). Extra arguments go to pytest instead
# of the three tiers: `./tests/run.sh tests/unit`, `./tests/run.sh -m "not e2e"`.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/.ci/venv.sh"
source "$repo/.ci/prometheus.sh"
bash "$repo/.ci/helm.sh" "$repo/.venv"   # Helm for the chart tests (tests/integration/test_k8s_chart.py)
cd "$repo"
if [ "$#" -eq 0 ]; then
  set -- tests/unit tests/integration tests/e2e   # in this order (pytest keeps it)
fi
exec "$repo/.venv/bin/python" -m pytest -p no:cacheprovider -ra "$@"
