#!/usr/bin/env bash
# Every test: unit tests, then end-to-end tests that run `fleet up` on real vLLM (CPU build).
# Installs what it needs into .venv first (see .ci/venv.sh). Extra arguments go to pytest.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/.ci/venv.sh"
source "$repo/.ci/prometheus.sh"
bash "$repo/.ci/helm.sh" "$repo/.venv"   # Helm for the chart tests (tests/unit/test_k8s_chart.py)
cd "$repo"
exec "$repo/.venv/bin/python" -m pytest -p no:cacheprovider -ra "${@:-tests}"
