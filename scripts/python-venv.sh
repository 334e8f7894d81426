#!/usr/bin/env bash
# Creates (or checks) the Python venv the torch tests and `pip install ./python` use (issue 24):
# build/venv with Python 3.11 (or newer), torch MORPH_TORCH.* (a major.minor, default 2.15),
# numpy, nanobind and scikit-build-core. Idempotent: a venv that already imports the asked torch
# is left alone (any environment that does: MORPH_VENV may name one made elsewhere, and nothing is
# downloaded); one with another torch is upgraded or downgraded in place; the first run downloads
# several GiB and takes minutes. Supported: 2.15 (the current release) and 2.11 (the GPU machines
# some tasks are lent, which have no network); the package's torch backend is built for exactly
# one torch major.minor (docs/torch.md "Building").
#
#   scripts/python-venv.sh                       # build/venv, the default torch
#   MORPH_TORCH=2.11 scripts/python-venv.sh      # build/venv with torch 2.11.*
#   MORPH_VENV=/tmp/v scripts/python-venv.sh     # elsewhere
#
# Only PyPI is reachable from these machines (download.pytorch.org is not), so this installs
# PyPI's `torch` wheel, as bench/peers/setup_torch.sh does: on Linux x86-64 it is built with CUDA
# and pulls NVIDIA's runtime libraries (about 3 GiB in the venv); it runs on a CPU-only machine.
# Set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu where that index is reachable for the
# small CPU wheel. Prints the venv's python on its last line.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MORPH_VENV:-$repo/build/venv}"
torch="${MORPH_TORCH:-2.15}"
numpy_spec="${NUMPY_SPEC:-numpy==2.2.6}"
nanobind_spec="${NANOBIND_SPEC:-nanobind==2.9.2}"
skbuild_spec="${SKBUILD_SPEC:-scikit-build-core==0.11.6}"
# morph.data's StatefulDataLoader (issue 34): pure Python, any torch >= 2 (2.11 and 2.15).
torchdata_spec="${TORCHDATA_SPEC:-torchdata==0.11.0}"
need_gib="${MORPH_VENV_MIN_FREE_GIB:-6}"

log() { echo "python-venv: $*" >&2; }

[[ "$torch" =~ ^[0-9]+\.[0-9]+$ ]] || {
  log "MORPH_TORCH=$torch: a torch major.minor, e.g. 2.15 or 2.11"; exit 2; }
torch_spec="torch==$torch.*"
torch_prefix="$torch."

# A venv made before torchdata was pinned gets it here, best effort: offline (a lent GPU machine)
# it stays without, and only the test of the StatefulDataLoader integration fails.
if [[ -x "$venv/bin/python" ]] && ! "$venv/bin/python" -c 'import torchdata' 2>/dev/null; then
  "$venv/bin/python" -m pip install --disable-pip-version-check --no-input --timeout 60 -q \
    "$torchdata_spec" >&2 || log "could not install $torchdata_spec into $venv"
fi

check='import sys, numpy, torch, nanobind, scikit_build_core
assert sys.version_info >= (3, 11), sys.version
assert torch.distributed.is_available() and torch.distributed.is_gloo_available()
print(torch.__version__)'

if [[ -x "$venv/bin/python" ]] && have="$("$venv/bin/python" -c "$check" 2>/dev/null)" &&
   [[ "$have" == "$torch_prefix"* ]]; then
  echo "$venv/bin/python"
  exit 0
fi

# One installer at a time per venv (ctest runs tests in parallel; each may call this script).
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if [[ -x "$venv/bin/python" ]] && have="$("$venv/bin/python" -c "$check" 2>/dev/null)" &&
   [[ "$have" == "$torch_prefix"* ]]; then
  echo "$venv/bin/python"
  exit 0
fi

free_kib="$(df -Pk "$(dirname "$venv")" | awk 'NR == 2 {print $4}')"
if (( free_kib < need_gib * 1024 * 1024 )); then
  log "only $((free_kib / 1024 / 1024)) GiB free under $(dirname "$venv"), need $need_gib GiB" \
      "for $torch_spec and its NVIDIA libraries; free some space or set MORPH_VENV"
  exit 1
fi

py=""
for cand in "${PYTHON:-}" python3.11 python3; do  # torch 2.15 needs 3.11 or newer
  [[ -n "$cand" ]] || continue
  if command -v "$cand" >/dev/null &&
     "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    py="$cand"; break
  fi
done
[[ -n "$py" ]] || { log "no Python 3.11 or newer found (set PYTHON=/path/to/python3)"; exit 1; }

if [[ ! -x "$venv/bin/python" ]]; then
  log "creating $venv with $py"
  "$py" -m venv "$venv" || { log "$py -m venv failed (Debian: apt-get install python3-venv)"; exit 1; }
fi
index=()
[[ -n "${TORCH_INDEX_URL:-}" ]] && index=(--index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple)
[[ -n "${have:-}" ]] && log "$venv has torch $have: replacing it with $torch_spec"
log "installing $torch_spec $numpy_spec $nanobind_spec $skbuild_spec into $venv (minutes on first use)"
"$venv/bin/python" -m pip install --disable-pip-version-check --no-input --timeout 120 --retries 3 \
  "${index[@]}" "$torch_spec" "$numpy_spec" "$nanobind_spec" "$skbuild_spec" "$torchdata_spec"
have="$("$venv/bin/python" -c "$check")"
[[ "$have" == "$torch_prefix"* ]] || { log "installed torch $have is not $torch_spec"; exit 1; }
log "torch $have ready in $venv"
echo "$venv/bin/python"
