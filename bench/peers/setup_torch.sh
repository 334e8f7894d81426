#!/usr/bin/env bash
# Installs PyTorch (CPU use; the PyPI wheel) into a virtual environment under build/, for the
# peer benchmarks of `make bench-runtime-peers` (bench/peers/dcp_reconfig.py). Idempotent: a venv
# whose torch already has the pinned version is left alone. Never run by `make test`.
#
#   bench/peers/setup_torch.sh            # creates build/peers-venv
#   PEERS_VENV=/tmp/v TORCH_VERSION=2.7.1 NUMPY_VERSION=2.2.6 bench/peers/setup_torch.sh
#
# Only PyPI is reachable from these machines, so this installs PyPI's `torch` wheel. On Linux
# x86-64 that wheel is built with CUDA and pulls NVIDIA's runtime libraries (about 3 GiB in
# the venv, about 6 GiB free needed while installing); it runs on a CPU-only machine. Prints
# the venv's python on its last line.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${PEERS_VENV:-$repo/build/peers-venv}"
version="${TORCH_VERSION:-2.7.1}"
numpy_version="${NUMPY_VERSION:-2.2.6}"  # torch.distributed's object collectives need numpy
need_gib="${PEERS_MIN_FREE_GIB:-6}"

log() { echo "setup_torch: $*" >&2; }

if [[ -x "$venv/bin/python" ]] &&
   have="$("$venv/bin/python" -c 'import numpy, torch; print(torch.__version__)' 2>/dev/null)" &&
   [[ "${have%%+*}" == "$version" ]]; then
  log "torch $have already in $venv"
  echo "$venv/bin/python"
  exit 0
fi

mkdir -p "$(dirname "$venv")"
free_kib="$(df -Pk "$(dirname "$venv")" | awk 'NR == 2 {print $4}')"
if (( free_kib < need_gib * 1024 * 1024 )); then
  log "only $((free_kib / 1024 / 1024)) GiB free under $(dirname "$venv"), need $need_gib GiB" \
      "for torch $version and its NVIDIA libraries; free some space or set PEERS_VENV"
  exit 1
fi

command -v python3 >/dev/null || { log "python3 not found (apt-get install python3-venv)"; exit 1; }
if [[ ! -x "$venv/bin/python" ]]; then
  log "creating $venv"
  python3 -m venv "$venv" || {
    log "python3 -m venv failed (Debian: apt-get install python3-venv)"
    exit 1
  }
fi
log "installing torch==$version numpy==$numpy_version from PyPI into $venv (several minutes on first use)"
# A bounded wait per connection; pip retries a few times on its own.
"$venv/bin/python" -m pip install --disable-pip-version-check --no-input --timeout 120 \
  --retries 3 "torch==$version" "numpy==$numpy_version"
"$venv/bin/python" -c 'import torch, torch.distributed.checkpoint as dcp;
assert torch.distributed.is_gloo_available(), "this torch has no Gloo backend"
print("setup_torch: torch", torch.__version__, "with gloo", file=__import__("sys").stderr)'
echo "$venv/bin/python"
