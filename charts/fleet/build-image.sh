#!/usr/bin/env bash
# Build Fleet's image (charts/fleet/Dockerfile) with buildah, from the repository root or anywhere,
# and optionally push it or write it to archives. One command; no Docker daemon, no registry needed
# with --base debian. The tests build it the same way, cached (fleet/testing/k8s/images.py).
#
#   bash charts/fleet/build-image.sh --push registry.example.com/fleet:0.1.0
#   bash charts/fleet/build-image.sh --base debian --oci-archive fleet.oci.tar   # offline
#   bash charts/fleet/build-image.sh --lock     # rewrite charts/fleet/constraints.txt (Python 3.11)
#
# Options:
#   --tag REF             the image's name (default ghcr.io/inference-fleet/fleet:<pyproject version>)
#   --base IMAGE|debian   the Dockerfile's BASE (default python:3.11-slim, pulled by buildah);
#                         `debian`: Debian bookworm made here with mmdebstrap from this machine's
#                         Debian mirror (python3, python3-venv and libstdc++6, which the grpcio and
#                         pyzmq wheels link, over the Essential set; no apt, no docs), committed as
#                         localhost/fleet-base:bookworm-<hash of its package list>
#   --push DEST           push to DEST (docker://... implied; buildah's --creds/--authfile via
#                         REGISTRY_AUTH_FILE, `buildah login` first)
#   --oci-archive PATH    write an OCI archive (`ctr -n k8s.io images import PATH`, `skopeo copy`)
#   --docker-archive PATH write a docker-archive (`docker load -i PATH`, `ctr images import PATH`)
#   --root DIR            buildah's storage in DIR/storage, DIR/run (default: buildah's own)
#   --timestamp EPOCH_S   created time and file times of the new layers (default: the last commit's
#                         time, else 0), so two builds of one tree give the same layers' files
#   --build-arg K=V       passed to buildah (VENV_OPTIONS=--system-site-packages for vLLM's image)
#   --ca-bundle FILE      certificates pip trusts inside the build, for a proxy that intercepts TLS
#                         (default: $PIP_CERT when set); mounted read-only, never stored in the image
# Needs root (or rootless buildah), buildah 1.28 or later, mmdebstrap for --base debian; the
# Dockerfile's RUN steps reach PyPI.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml" | head -n 1)"
tag="ghcr.io/inference-fleet/fleet:$version"
base="docker.io/library/python:3.11-slim"
push="" oci="" docker_archive="" root="" timestamp="" lock=0 ca_bundle="${PIP_CERT:-}"
bud_options=()
suite="bookworm"
base_packages="python3,python3-venv,libstdc++6"

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "build-image.sh: $*" >&2; exit 2; }
while [ "$#" -gt 0 ]; do
  case "$1" in
    --tag) tag="${2:?--tag needs a value}"; shift 2 ;;
    --base) base="${2:?--base needs a value}"; shift 2 ;;
    --push) push="${2:?--push needs a value}"; shift 2 ;;
    --oci-archive) oci="${2:?--oci-archive needs a path}"; shift 2 ;;
    --docker-archive) docker_archive="${2:?--docker-archive needs a path}"; shift 2 ;;
    --root) root="${2:?--root needs a directory}"; shift 2 ;;
    --timestamp) timestamp="${2:?--timestamp needs seconds since the epoch}"; shift 2 ;;
    --build-arg) bud_options+=(--build-arg "${2:?--build-arg needs K=V}"); shift 2 ;;
    --ca-bundle) ca_bundle="${2:?--ca-bundle needs a file}"; shift 2 ;;
    --lock) lock=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option $1 (--help lists them)" ;;
  esac
done
[[ "$timestamp" =~ ^[0-9]*$ ]] || die "--timestamp: $timestamp is not whole seconds since the epoch"

if [ "$lock" = 1 ]; then
  # The closure of Fleet's runtime dependencies (no extras), as wheels for this Python, pinned.
  python="${PYTHON:-python3}"
  "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || die "--lock: $python is not Python 3.11, the image's (set PYTHON=python3.11)"
  report="$(mktemp)"; trap 'rm -f "$report"' EXIT
  # PyPI, as the build's pip sees it: this machine's pip configuration files, find-links, extra
  # indexes and constraints left out (PIP_CERT, a CA bundle, still applies).
  env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT -u PIP_INDEX_URL PIP_CONFIG_FILE=/dev/null \
    "$python" -m pip install --quiet --dry-run --ignore-installed --only-binary :all: \
    --index-url https://pypi.org/simple --report "$report" "$repo"
  {
    echo "# Fleet's runtime dependencies as the image installs them (charts/fleet/Dockerfile), pinned."
    echo "# Written by: bash charts/fleet/build-image.sh --lock   (Python 3.11, Linux x86_64 wheels)"
    "$python" - "$report" <<'EOF'
import json, sys
items = json.load(open(sys.argv[1]))["install"]
pins = sorted(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in items
              if i["metadata"]["name"] != "inference-fleet")
print("\n".join(pins))
EOF
  } > "$repo/charts/fleet/constraints.txt"
  echo "==> wrote charts/fleet/constraints.txt ($(grep -vc '^#' "$repo/charts/fleet/constraints.txt") pins)"
  exit 0
fi

command -v buildah >/dev/null || die "buildah not found (Debian: apt-get install buildah)"
storage=(--storage-driver overlay)
if [ -n "$root" ]; then
  mkdir -p "$root"
  storage+=(--root "$root/storage" --runroot "$root/run")
fi
policy="$(mktemp)"
trap 'rm -f "$policy"' EXIT
# Local images and the pushes this script makes need no signature; a registry's own policy
# (/etc/containers/policy.json) still governs `buildah pull` outside this script.
echo '{"default": [{"type": "insecureAcceptAnything"}]}' > "$policy"
b() { buildah "${storage[@]}" "$@"; }
if [ -z "$timestamp" ]; then
  timestamp="$(git -C "$repo" log -1 --format=%ct 2>/dev/null || echo 0)"
fi

if [ "$base" = "debian" ]; then
  base="localhost/fleet-base:$suite-$(printf %s "$base_packages" | sha256sum | cut -c1-8)"
  if ! b inspect --type image "$base" >/dev/null 2>&1; then
    command -v mmdebstrap >/dev/null || die "--base debian: mmdebstrap not found (apt-get install mmdebstrap)"
    mirror="${DEBIAN_MIRROR:-$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n 1)}"
    mirror="${mirror:-http://deb.debian.org/debian}"
    rootfs="$(mktemp -d)"
    trap 'rm -f "$policy"; rm -rf "$rootfs"' EXIT
    echo "==> Debian $suite base from $mirror"
    # The merged-usr hook makes /bin -> usr/bin itself (Debian 12's usrmerge package would pull perl).
    SOURCE_DATE_EPOCH="$timestamp" mmdebstrap --quiet --variant=essential --include="$base_packages" \
      --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
      --dpkgopt='path-include=/usr/share/doc/*/copyright' --skip=output/dev \
      "$suite" "$rootfs/rootfs.tar" "$mirror"
    ctr="$(b from --signature-policy "$policy" scratch)"
    b add "$ctr" "$rootfs/rootfs.tar" /
    b config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd '["python3"]' \
      --label "org.opencontainers.image.base.name=debian:$suite" "$ctr"
    b commit --quiet --signature-policy "$policy" --timestamp "$timestamp" --rm "$ctr" "$base" >/dev/null
  fi
fi

if [ -n "$ca_bundle" ]; then
  [ -f "$ca_bundle" ] || die "--ca-bundle: $ca_bundle is not a file"
  bud_options+=(--volume "$(realpath "$ca_bundle"):/run/fleet-build-ca.crt:ro"
                --build-arg PIP_CERT=/run/fleet-build-ca.crt)
fi

echo "==> $tag from $base"
b bud --signature-policy "$policy" --isolation chroot --format oci --layers --pull=false \
  --timestamp "$timestamp" --build-arg "BASE=$base" "${bud_options[@]}" \
  -f "$repo/charts/fleet/Dockerfile" -t "$tag" "$repo"
if [ -n "$oci" ]; then
  rm -f "$oci"
  b push --signature-policy "$policy" --quiet "$tag" "oci-archive:$oci:$tag"
fi
if [ -n "$docker_archive" ]; then
  rm -f "$docker_archive"
  b push --signature-policy "$policy" --quiet "$tag" "docker-archive:$docker_archive:$tag"
fi
if [ -n "$push" ]; then
  b push --signature-policy "$policy" "$tag" "docker://${push#docker://}"
fi
echo "==> built $tag ($(b inspect --type image --format '{{.FromImageDigest}}' "$tag"))"
