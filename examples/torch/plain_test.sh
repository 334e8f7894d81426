#!/usr/bin/env bash
# train_plain.py, the standard program without morph, trains under torchrun (ctest
# torch_train_plain_test, label torch): one process, then two as dp=2, tp=2 and pp=2; every step's
# loss equals the one-process run's within TOL (DistributedSampler gives DP rank r the samples
# r, r + dp, ... of the epoch's permutation, so each step's global batch is the same set whatever
# dp is, and the initial weights are drawn whole by name).
#   plain_test.sh <build dir>
set -euo pipefail
build=$1
here=$(cd "$(dirname "$0")" && pwd)
python=$(MORPH_VENV="${MORPH_VENV:-$build/venv}" bash "$here/../../scripts/python-venv.sh" | tail -n 1)
export OMP_NUM_THREADS=1
TOL=${TOL:-1e-5}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "torch_train_plain_test: $*" >&2; exit 1; }
run() {  # run NAME NPROC ARGS...: torchrun on a free port, 6 steps
  local name=$1 n=$2
  shift 2
  timeout 240 "$python" -m torch.distributed.run --standalone --nproc-per-node "$n" \
    "$here/train_plain.py" --steps 6 --global-batch 12 --micro-batch 3 --layers 2 --quiet \
    --out "$tmp/$name" "$@" >"$tmp/$name.log" 2>&1 || { tail -n 30 "$tmp/$name.log" >&2; fail "$name failed"; }
}
run ref 1
run dp2 2
run tp2 2 --tp 2
run pp2 2 --pp 2
for name in dp2 tp2 pp2; do
  awk -F'\t' -v tol="$TOL" -v name="$name" '
    NR == FNR { ref[$1] = $2; next }
    { d = $2 - ref[$1]; if (d < 0) d = -d; if (d > worst) worst = d
      if (!($1 in ref) || d > tol) { printf "%s step %s: loss %s, one process %s\n", name, $1, $2, ref[$1]; bad = 1 }
      n++ }
    END { if (bad || n != 6) exit 1; printf "%s: 6 steps, largest |diff| %g\n", name, worst }' \
    "$tmp/ref/metrics.tsv" "$tmp/$name/metrics.tsv" || fail "$name's loss differs from one process's"
  want=$(case $name in dp2) echo 2 1 1 ;; tp2) echo 1 2 1 ;; pp2) echo 1 1 2 ;; esac)
  [ "$(cut -f4-6 "$tmp/$name/metrics.tsv" | sort -u | tr '\t' ' ')" = "$want" ] ||
    fail "$name ran as dp tp pp $(cut -f4-6 "$tmp/$name/metrics.tsv" | sort -u | tr '\t\n' '  ')"
done
echo "torch_train_plain_test: passed"
