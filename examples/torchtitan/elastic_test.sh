#!/usr/bin/env bash
# The torchtitan example's test (ctest torchtitan_elastic_test, label torch): installs torchtitan
# (scripts/torchtitan-venv.sh; skipped, exit 77, when PyPI cannot be reached), runs train.py as a
# one-worker job (the reference, fixed configuration), then under morphrun with 2 workers pinned
# to dp1 tp2 and `morphctl resize 3` at step 3 (pinned dp3 tp1: torchtitan's TP shards of the
# fused wqkv, w1..w3, wo, embedding and head go back whole, FSDP2's shards over 3 uneven rows).
#
#   elastic_test.sh <build dir> <morphrun> <morphctl>
#
# Checks: the job started as pinned (dp1 tp2) and changed once, to world 3 as pinned (all three
# workers reporting it), every step was trained, and
# every step's loss equals the reference's within TOL relative (default 1e-5: only the order of
# float sums differs, TP's cuts of the matrix products and FSDP2's reduce-scatter over another
# dp; measured in README.md) and its learning rate exactly (torchtitan's LambdaLR carried over).
set -euo pipefail
build=$1
morphrun=$2
morphctl=$3
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STEPS=${STEPS:-30}
TOL=${TOL:-1e-5}
python="$(MORPH_VENV="${MORPH_VENV:-$build/venv}" "$here/../../scripts/python-venv.sh" | tail -n 1)"
set +e
pkgs="$(MORPH_VENV="$(dirname "$(dirname "$python")")" MORPH_TITAN_PKGS="$build/torchtitan-pkgs" \
  "$here/../../scripts/torchtitan-venv.sh" | tail -n 1)"
rc=$?
set -e
if [ "$rc" = 77 ]; then echo "torchtitan_elastic_test: skipped: PyPI is not reachable" >&2; exit 77; fi
[ "$rc" = 0 ] || { echo "torchtitan_elastic_test: installing torchtitan failed" >&2; exit 1; }
export PYTHONPATH="$build/python:$pkgs" OMP_NUM_THREADS=1
export MORPH_TOKEN=torchtitan-elastic-test-token
tmp=$(mktemp -d)
run=""
cleanup() {
  [ -n "$run" ] && kill -TERM "$run" 2>/dev/null || true
  [ -n "$run" ] && { sleep 1; kill -KILL "$run" 2>/dev/null || true; }
  if [ "${KEEP:-0}" = 1 ]; then echo "kept $tmp" >&2; else rm -rf "$tmp"; fi
}
trap cleanup EXIT
fail() {
  echo "torchtitan_elastic_test: $*" >&2
  tail -n 30 "$tmp/run.log" >&2 || true
  cat "$tmp/out/events.jsonl" >&2 2>/dev/null || true
  for f in "$tmp"/logs/*; do [ -e "$f" ] && { echo "== $f" >&2; tail -n 25 "$f" >&2; }; done
  exit 1
}
t0=$(date +%s)
timeout 300 "$python" "$here/train.py" --steps "$STEPS" --out "$tmp/ref" >"$tmp/ref.log" 2>&1 ||
  { tail -n 30 "$tmp/ref.log" >&2; fail "reference run failed"; }
t1=$(date +%s)
: >"$tmp/run.log"
timeout 300 "$morphrun" -n 2 --max 3 --config 2=dp1tp2pp1 --config 3=dp3tp1pp1 \
  --log-dir "$tmp/logs" -- "$python" "$here/train.py" --steps "$STEPS" --out "$tmp/out" \
  --step-sleep 0.6 >"$tmp/run.log" 2>&1 &
run=$!
api=""
for _ in $(seq 300); do
  api=$(sed -n 's/.*scheduler API \([0-9.]*:[0-9]*\).*/\1/p' "$tmp/run.log")
  [ -n "$api" ] && break
  sleep 0.1
done
[ -n "$api" ] || fail "morphrun did not start"
for _ in $(seq 1800); do  # step 3 trained: grow to 3 workers
  [ "$(grep -c . "$tmp/out/loss.jsonl" 2>/dev/null || echo 0)" -ge 3 ] && break
  kill -0 "$run" 2>/dev/null || fail "the job ended before step 3"
  sleep 0.1
done
"$morphctl" --addr "$api" resize 3 >/dev/null
set +e
wait "$run"
rc=$?
set -e
run=""
[ "$rc" = 0 ] || fail "morphrun exited $rc"
t2=$(date +%s)
"$python" - "$tmp/out" "$tmp/ref" "$STEPS" "$TOL" $((t1 - t0)) $((t2 - t1)) <<'PY' || fail "checks failed"
import json, sys
out, ref, steps, tol, t_ref, t_run = (sys.argv[1], sys.argv[2], int(sys.argv[3]),
                                      float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
ev = [json.loads(l) for l in open(out + "/events.jsonl")]
by_step = {}
for e in ev:
    by_step.setdefault(e["step"], []).append(e)
changes = [(len(v), v[0]["world"], v[0]["config"]) for _, v in sorted(by_step.items())]
assert changes == [(3, 3, [3, 1, 1])], f"changes (workers reporting, world, config) {changes}"
def losses(d):
    by = {}
    for l in open(d + "/loss.jsonl"):
        e = json.loads(l)
        by[e["step"]] = e
    return by
got, exp = losses(out), losses(ref)
assert got[0]["config"] == [1, 2, 1], f"first generation {got[0]['config']}, pinned dp1 tp2"
assert sorted(exp) == list(range(steps)), f"reference steps {sorted(exp)}"
assert sorted(got) == list(range(steps)), f"steps trained {sorted(got)}"
worst = 0.0
for s in range(steps):
    g, e = got[s], exp[s]
    assert g["lr"] == e["lr"], f"step {s}: lr {g['lr']} against the reference's {e['lr']}"
    d = abs(g["loss"] - e["loss"]) / max(1.0, abs(e["loss"]))
    worst = max(worst, d)
    assert d <= tol, f"step {s}: loss {g['loss']} against {e['loss']} ({g['config']})"
print(json.dumps({"name": "torchtitan_elastic", "steps": steps, "change_at": min(by_step),
                  "loss_rel_diff_max": worst, "reference_s": t_ref, "elastic_s": t_run}))
PY
echo "torchtitan_elastic_test: passed"
