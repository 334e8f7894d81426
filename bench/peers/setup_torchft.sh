#!/usr/bin/env bash
# Installs TorchFT (`torchft` 0.2.0 from PyPI, whose wheel carries the Rust lighthouse and manager
# as torchft._torchft and the `torchft_lighthouse` program) into the peers venv, after torch
# (setup_torch.sh, which makes the venv on first use). Idempotent: a venv whose torchft has the
# pinned version is left alone. For bench/peers/torchft_failover.py; never run by `make test`.
#
#   bench/peers/setup_torchft.sh                      # build/peers-venv
#   PEERS_VENV=/tmp/v TORCHFT_VERSION=0.2.0 bench/peers/setup_torchft.sh
#
# Prints the venv's python on its last line.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${PEERS_VENV:-$repo/build/peers-venv}"
version="${TORCHFT_VERSION:-0.2.0}"

log() { echo "setup_torchft: $*" >&2; }

python="$(PEERS_VENV="$venv" "$repo/bench/peers/setup_torch.sh" | tail -n 1)"
if have="$("$python" -c 'import importlib.metadata as m; print(m.version("torchft"))' 2>/dev/null)" &&
   [[ "$have" == "$version" ]] && [[ -x "$venv/bin/torchft_lighthouse" ]]; then
  log "torchft $have already in $venv"
  echo "$python"
  exit 0
fi
log "installing torchft==$version from PyPI into $venv"
# torchft 0.2.0 needs torch>=2.7 (setup_torch.sh pins 2.7.1) and OpenTelemetry; its wheel is
# built for x86-64 manylinux with the lighthouse compiled in: no Rust toolchain needed.
"$python" -m pip install --disable-pip-version-check --no-input --timeout 120 --retries 3 \
  "torchft==$version"
"$python" -c 'from torchft._torchft import LighthouseServer; import torchft.manager;
print("setup_torchft: torchft with its lighthouse imports", file=__import__("sys").stderr)'
[[ -x "$venv/bin/torchft_lighthouse" ]] || { log "no $venv/bin/torchft_lighthouse after install"; exit 1; }
echo "$python"
