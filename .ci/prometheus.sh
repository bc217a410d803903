#!/usr/bin/env bash
# Install Prometheus (prometheus + promtool) and tmux from the distribution's packages, for the
# observability tests (tests/integration/test_observability_*.py,
# tests/integration/test_chart_monitoring.py).
# Sourced by tests/run.sh. Idempotent and free when they are already there: installs only what
# is missing. Debian's prometheus package also enables a systemd service; the tests never use
# it (they start their own Prometheus on a free port with a temporary data directory).
# Without root or apt-get it installs nothing and says so: the tests that need the tools skip.
_fleet_obs_missing=()
command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || _fleet_obs_missing+=(prometheus)
command -v tmux >/dev/null 2>&1 || _fleet_obs_missing+=(tmux)
if [ "${#_fleet_obs_missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "==> Installing ${_fleet_obs_missing[*]} (Debian packages) for the observability tests"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${_fleet_obs_missing[@]}" >/dev/null; } \
      || echo "==> apt-get could not install ${_fleet_obs_missing[*]}: the tests that need them will skip" >&2
  else
    echo "==> ${_fleet_obs_missing[*]} missing and no root apt-get: the observability tests that need them will skip" >&2
  fi
fi
unset _fleet_obs_missing
