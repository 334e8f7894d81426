#!/usr/bin/env bash
# ctest torch_mpirun_test (labels torch, mpi): a PyTorch program under `mpirun -np 2` (no
# morphrun): rank 0 hosts the coordinator through MPI, both ranks train, the torchrun variables
# are set for libraries that read them, and both exit 0 with the state every step wrote.
#   mpirun_test.sh <build dir> <mpiexec>
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build=$1
mpiexec=$2
python="$(MORPH_VENV="${MORPH_VENV:-$build/venv}" bash "$here/../../scripts/python-venv.sh" | tail -n 1)"
out=$(mktemp)
res=$(mktemp -d)
trap 'rm -rf "$out" "$res"' EXIT
env -u MORPH_COORDINATOR -u MORPH_TOKEN -u MORPH_TOKEN_FILE \
  timeout 240 "$mpiexec" --allow-run-as-root --oversubscribe -np 2 \
  -x PYTHONPATH="$build/python" -x OMP_NUM_THREADS=1 \
  "$python" "$here/mpirun_worker.py" --out "$res" >"$out" 2>&1 ||
  { tail -40 "$out"; echo "torch_mpirun_test: mpirun failed" >&2; exit 1; }
"$python" - "$res" <<'PY'
import glob, json, sys
lines = [json.load(open(f)) for f in sorted(glob.glob(sys.argv[1] + "/rank-*.json"))]
assert sorted(l["rank"] for l in lines) == [0, 1], lines
for l in lines:
    assert l["world"] == 2 and l["steps"] == 6 and l["w_equal"], l
    assert l["torch_rank"] == str(l["rank"]) and l["torch_world"] == "2", l
print("torch_mpirun_test: passed", json.dumps(lines))
PY
