#!/usr/bin/env bash
# Every test, in three tiers (tests/conftest.py), cheapest first:
#   tests/unit         in-process only: no process, no socket but the test's own loopback fixtures,
#                      no real Kubernetes client (guarded: tests/support/guards.py); ~4 min on 2 busy cores
#   tests/integration  real processes on loopback (`fleet up`, the router and the engine SIMULATOR,
#                      the API-server and hub stand-ins, a real apiextensions-apiserver over etcd
#                      and a real Kubernetes 1.20 control plane where they build, Prometheus/
#                      promtool, helm), whole trace-
#                      simulator runs and real-time deadlines; minutes
#   tests/e2e          `fleet up` on real vLLM (CPU build)
# Installs what it needs into .venv first (see .ci/venv.sh). Extra arguments go to pytest instead
# of the three tiers: `./tests/run.sh tests/unit`, `./tests/run.sh -m "not e2e"`.
# Runs the tests on FLEET_TEST_WORKERS pytest-xdist workers (default 2; 0: in this process, in
# order); the tests that hold the whole machine run on one of them, one after another
# (tests/conftest.py `ONE_AT_A_TIME`).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/.ci/venv.sh"
source "$repo/.ci/prometheus.sh"
bash "$repo/.ci/helm.sh" "$repo/.venv"   # Helm for the chart tests (tests/integration/test_k8s_chart.py)
cd "$repo"
if [ "$#" -eq 0 ]; then
  set -- tests/unit tests/integration tests/e2e   # collected in this order; the two workers take them in it
fi
# The real Kubernetes layers of the integration tier, each built once into ~/.cache/fleet/NAME and
# then found in a second (fleet/testing/k8s/buildcache.py): the apiextensions-apiserver of
# test_crd_real_apiserver.py (Debian unstable's Go sources; ~6.5 min on 2 busy cores) and the
# Kubernetes 1.20.2 control plane of the tests named *_real_* and *_real.py (the user's journey on
# it: test_real_cluster_journey.py) (Debian bookworm's kubernetes source, apt as root
# for a deb-src entry and the build dependencies; ~7 min with a cold Go cache). Each is bounded
# (FLEET_APIEXT_BUILD_S, default 420; FLEET_KUBE_BUILD_S, default 600): past it the layer skips this
# run and the next run goes on from the Go build cache; a failed build is remembered for 6 h. Never
# fails the run; FLEET_APIEXT=skip and FLEET_KUBE=skip switch a layer off.
# real_layer MODULE SWITCH BUDGET_S FOUND_PREFIX UNAVAILABLE_VAR: build or find one layer; when it
# cannot be had, export UNAVAILABLE_VAR with the build's last line (the test files skip saying it).
real_layer() {
  local module="$1" switch="$2" budget_s="$3" found="$4" unavailable="$5" line
  [ "${!switch:-}" = "skip" ] && return 0
  line="$(timeout "$(( budget_s + 60 ))" "$repo/.venv/bin/python" -m "fleet.testing.k8s.$module" \
          build --timeout-s "$budget_s" 2>&1 | tail -n 1)" || true
  echo "==> $line"
  case "$line" in
    "$found"*) ;;   # built or found: "apiextensions-apiserver 0.36.4-1 and etcd ...", "kubernetes v1.20.2 ..."
    *) export "$unavailable=${line:-the build step printed nothing}" ;;
  esac
}
case " $* " in
  *" tests/integration"*|*" tests "*|*test_crd_real_apiserver*)
    real_layer apiext FLEET_APIEXT "${FLEET_APIEXT_BUILD_S:-420}" "apiextensions-apiserver " FLEET_APIEXT_UNAVAILABLE ;;
esac
case " $* " in
  *" tests/integration"*|*" tests "*|*_real_*|*_real.py*)
    real_layer kube FLEET_KUBE "${FLEET_KUBE_BUILD_S:-600}" "kubernetes v" FLEET_KUBE_UNAVAILABLE ;;
esac
# Fleet's image and the pause image (fleet/testing/k8s/images.py: charts/fleet/build-image.sh over a
# Debian base made here, pause.c of the kubernetes source; apt as root for buildah, mmdebstrap,
# umoci), cached in ~/.cache/fleet/images by a hash of their inputs; bounded by FLEET_IMAGE_BUILD_S
# (default 600); FLEET_IMAGE=skip switches them off. Used by test_fleet_image.py and
# test_real_node_journey.py (Fleet's pods on the real node).
case " $* " in
  *" tests/integration"*|*" tests "*|*test_fleet_image*|*test_real_node_journey*)
    real_layer images FLEET_IMAGE "${FLEET_IMAGE_BUILD_S:-600}" "fleet image " FLEET_IMAGE_UNAVAILABLE ;;
esac
exec "$repo/.venv/bin/python" -m pytest -p no:cacheprovider -ra --durations=15 \
     -n "${FLEET_TEST_WORKERS:-2}" "$@"
