#!/usr/bin/env bash
# Every test, in three tiers (tests/conftest.py), cheapest first:
#   tests/unit         in-process only: no process, no socket but the test's own loopback fixtures,
#                      no real Kubernetes client (guarded: tests/support/guards.py); ~45 s on 2 cores
#   tests/integration  real processes on loopback (`fleet up`, the router and the engine SIMULATOR,
#                      the API-server and hub stand-ins, a real apiextensions-apiserver over etcd
#                      and a real Kubernetes 1.20 control plane where they build, Prometheus/
#                      promtool, helm), whole trace-
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
# The real apiextensions-apiserver of tests/integration/test_crd_real_apiserver.py: built once
# into ~/.cache/fleet/apiext (Debian unstable's Go sources; ~6.5 min on 2 busy cores), then found in a
# second. Bounded: past FLEET_APIEXT_BUILD_S (default 420) the layer is skipped this run and the
# next run goes on from the Go build cache; a failed build is remembered for 6 h. Never fails the run.
case " $* " in
  *" tests/integration"*|*" tests "*|*test_crd_real_apiserver*)
    if [ "${FLEET_APIEXT:-}" != "skip" ]; then
      apiext="$(timeout "$(( ${FLEET_APIEXT_BUILD_S:-420} + 60 ))" "$repo/.venv/bin/python" -m fleet.testing.k8s.apiext \
                build --timeout-s "${FLEET_APIEXT_BUILD_S:-420}" 2>&1 | tail -n 1)" || true
      echo "==> $apiext"
      case "$apiext" in
        "apiextensions-apiserver "*) ;;   # built or found: "apiextensions-apiserver 0.36.4-1 and etcd ..."
        *) export FLEET_APIEXT_UNAVAILABLE="${apiext:-the build step printed nothing}" ;;   # the test file skips
      esac
    fi
    ;;
esac
# The real Kubernetes 1.20.2 control plane of tests/integration/test_real_control_plane.py
# (kube-apiserver, kube-scheduler, kube-controller-manager over etcd): built once into
# ~/.cache/fleet/kube from Debian bookworm's kubernetes source (apt as root: a deb-src entry and the
# build dependencies; ~7 min on 2 busy cores with a cold Go cache), then found in a second. Bounded:
# past FLEET_KUBE_BUILD_S (default 600) the layer is skipped this run and the next run goes on from
# the Go build cache; a failed build is remembered for 6 h. Never fails the run.
case " $* " in
  *" tests/integration"*|*" tests "*|*test_real_control_plane*)
    if [ "${FLEET_KUBE:-}" != "skip" ]; then
      kube="$(timeout "$(( ${FLEET_KUBE_BUILD_S:-600} + 60 ))" "$repo/.venv/bin/python" -m fleet.testing.k8s.kube \
              build --timeout-s "${FLEET_KUBE_BUILD_S:-600}" 2>&1 | tail -n 1)" || true
      echo "==> $kube"
      case "$kube" in
        "kubernetes v"*) ;;   # built or found: "kubernetes v1.20.2 (1.20.5+really1.20.2-...) and etcd ..."
        *) export FLEET_KUBE_UNAVAILABLE="${kube:-the build step printed nothing}" ;;   # the test file skips
      esac
    fi
    ;;
esac
exec "$repo/.venv/bin/python" -m pytest -p no:cacheprovider -ra --durations=15 "$@"
