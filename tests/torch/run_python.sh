#!/usr/bin/env bash
# Runs a torch test with the venv's Python (scripts/python-venv.sh makes it on first use) and the
# package the build assembled (<build>/python). A missing torch fails the test: nothing skips.
#   run_python.sh <build dir> script.py args...
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="$1"
shift
python="$(MORPH_VENV="${MORPH_VENV:-$build/venv}" "$repo/scripts/python-venv.sh" | tail -n 1)"
export PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}"
export MORPH_PYTHON="$python" OMP_NUM_THREADS=1
exec "$python" "$@"
