#!/usr/bin/env bash
# Installs torchtitan (examples/torchtitan/requirements.txt: torchtitan 0.3.0 and its pinned
# dependencies, about 500 MB) into a folder beside build/venv, for examples/torchtitan (issue 34).
# The venv itself is not touched: `pip install --no-deps --target`, so its torch stays the
# one morph's package is built for; the example runs with PYTHONPATH=<folder>. Idempotent: a
# folder installed from the same requirements (its stamp) is left alone and nothing is
# downloaded. Only PyPI is needed. Prints the folder on its last line.
#
#   scripts/torchtitan-venv.sh                     # build/torchtitan-pkgs, build/venv's pip
#   MORPH_TITAN_PKGS=/tmp/p scripts/torchtitan-venv.sh
#
# Exit status 77 when PyPI cannot be reached (the ctest test reports itself skipped).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${MORPH_VENV:-$repo/build/venv}"
target="${MORPH_TITAN_PKGS:-$repo/build/torchtitan-pkgs}"
req="$repo/examples/torchtitan/requirements.txt"
log() { echo "torchtitan-venv: $*" >&2; }

python="$venv/bin/python"
[[ -x "$python" ]] || { log "no venv at $venv (scripts/python-venv.sh makes it)"; exit 2; }
stamp="$target/.morph-stamp"
want="$(sha256sum "$req" | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] &&
    PYTHONPATH="$target" "$python" -c 'import torchtitan.models.llama3' 2>/dev/null; then
  echo "$target"
  exit 0
fi
torch_before="$("$python" -c 'import torch; print(torch.__version__)')"
rm -rf "$target.tmp"
if ! "$python" -m pip install --disable-pip-version-check --no-input --timeout 60 -q \
    --no-deps --target "$target.tmp" -r "$req" >&2; then
  rm -rf "$target.tmp"
  if ! "$python" -c 'import urllib.request; urllib.request.urlopen("https://pypi.org/simple/torchtitan/", timeout=15)' 2>/dev/null; then
    log "PyPI is not reachable: torchtitan not installed"
    exit 77
  fi
  log "pip install -r $req failed"
  exit 1
fi
rm -rf "$target"
mv "$target.tmp" "$target"
echo "$want" >"$stamp"
torch_after="$("$python" -c 'import torch; print(torch.__version__)')"
[[ "$torch_before" == "$torch_after" ]] || { log "torch changed: $torch_before -> $torch_after"; exit 1; }
PYTHONPATH="$target" "$python" -c 'import torchtitan.models.llama3' ||
  { log "torchtitan does not import from $target"; exit 1; }
log "torchtitan installed into $target ($(du -sh "$target" | cut -f1))"
echo "$target"
