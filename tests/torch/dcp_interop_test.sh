#!/usr/bin/env bash
# DCP in and out (ctest torch_dcp_interop_test, label torch): a plain PyTorch run and a morph job
# of the same standard-torch program load each other's torch.distributed.checkpoint saves.
#
#   dcp_interop_test.sh <build dir> <morphrun>
#
# (1) plain run A: one process, torch's Gloo, no morph runtime: steps 0-9, saving before step 4;
# (2) a morph job of 2 workers (FSDP2 over dp 2, shards of 13 rows uneven) loads A's checkpoint
#     at its first step (job.load) and trains A's steps 4-9, saving before step 7 (job.save);
# (3) plain run B loads the morph job's checkpoint and trains steps 7-9.
# Checks: the job's losses equal A's within TOL (only the order of float sums differs: 2.4e-7
# measured) and its learning rates exactly; B's losses equal A's within TOL: what each wrote is
# the state the other had.
set -euo pipefail
build=$1
morphrun=$2
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="$(MORPH_VENV="${MORPH_VENV:-$build/venv}" "$here/../../scripts/python-venv.sh" | tail -n 1)"
export PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
export MORPH_TOKEN=torch-dcp-interop-test-token
TOL=${TOL:-1e-5}
tmp=$(mktemp -d)
trap 'if [ "${KEEP:-0}" = 1 ]; then echo "kept $tmp" >&2; else rm -rf "$tmp"; fi' EXIT
w="$here/dcp_interop_worker.py"
fail() {
  echo "torch_dcp_interop_test: $*" >&2
  for f in "$tmp"/*.log; do [ -e "$f" ] && { echo "== $f" >&2; tail -n 25 "$f" >&2; }; done
  exit 1
}
timeout 120 "$python" "$w" plain --out "$tmp/a" --steps 10 --save-at 4 >"$tmp/a.log" 2>&1 ||
  fail "plain run A failed"
timeout 300 "$morphrun" -n 2 -- "$python" "$w" elastic --out "$tmp/m" --steps 6 --offset 4 \
  --load "$tmp/a/ck-plain-4" --save-at 3 >"$tmp/m.log" 2>&1 || fail "the morph job failed"
timeout 120 "$python" "$w" plain --out "$tmp/b" --steps 10 --from-step 7 \
  --load "$tmp/m/ck-morph-7" >"$tmp/b.log" 2>&1 || fail "plain run B failed"
"$python" - "$tmp" "$TOL" <<'PY' || fail "checks failed"
import json, sys
tmp, tol = sys.argv[1], float(sys.argv[2])
def losses(d):
    return {json.loads(l)["step"]: json.loads(l) for l in open(f"{tmp}/{d}/loss.jsonl")}
a, m, b = losses("a"), losses("m"), losses("b")
assert sorted(m) == list(range(4, 10)), f"the job trained {sorted(m)}"
assert sorted(b) == list(range(7, 10)), f"run B trained {sorted(b)}"
worst = 0.0
for run, got in (("the morph job", m), ("run B", b)):
    for s, e in got.items():
        d = abs(e["loss"] - a[s]["loss"]) / max(1.0, abs(a[s]["loss"]))
        worst = max(worst, d)
        assert d <= tol, f"{run}, step {s}: loss {e['loss']} against run A's {a[s]['loss']}"
        assert e["lr"] == a[s]["lr"], f"{run}, step {s}: lr {e['lr']} against {a[s]['lr']}"
print(json.dumps({"name": "torch_dcp_interop", "loss_rel_diff_max": worst}))
PY
echo "torch_dcp_interop_test: passed"
