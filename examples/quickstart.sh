#!/usr/bin/env bash
# The main job on a machine with no GPU: install Fleet and real vLLM (CPU build), generate the
# tiny Llama model locally (no model hub needed), and serve examples/quickstart.yaml: two vLLM
# replicas behind Fleet's router on http://127.0.0.1:8080/v1 until Ctrl-C.
# Extra arguments go to `fleet up` (e.g. --port 9000).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/.ci/venv.sh"
echo "==> Generating the tiny model (random weights, ~7 MB) in examples/models/tiny-llama"
"$repo/.venv/bin/fleet" make-tiny-model "$repo/examples/models/tiny-llama"
exec "$repo/.venv/bin/fleet" up "$repo/examples/quickstart.yaml" "$@"
