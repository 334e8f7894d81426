#!/usr/bin/env bash
# ctest torch_data_elastic_test (label torch; issue 34): data_worker.py under morphrun trains on a
# dataset whose items are their own ids through morph.data.ElasticDataLoader (2 loader worker
# processes each, prefetch 2): 2 workers -> 4 (morphctl resize 4) -> 3 (resize 3) -> one SIGKILLs
# itself inside a step -> 2 survivors recover -> the run ends at an epoch boundary.
#
# Checks, over the steps that count (for each step index, the records of the newest generation
# that ended it: a recovery replays the steps after the state it resumes from, and the replay
# replaces them): every DP coordinate of the step's config recorded it once; each rank trained
# exactly the ids the runtime gave it (the loader served no batch prefetched for another
# layout or step); together they are the step's global batch, in the cursor's order; every
# sample of each epoch was trained exactly once; the final model equals a replay of full-batch
# steps on one process (the global batch kept whatever dp). And: the killed trainer's loader
# workers were gone within 1 s (they die with it), and no process of the job is left.
#   data_elastic_test.sh <build dir> <morphrun> <morphctl>
set -euo pipefail
build=$1
morphrun=$2
morphctl=$3
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="$(MORPH_VENV="${MORPH_VENV:-$build/venv}" "$here/../../scripts/python-venv.sh" | tail -n 1)"
export PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
export MORPH_TOKEN=torch-data-test-token
# The ZeRO range of a dead rank survives in buddy snapshots only: the recovery rolls back to the
# newest snapshot step and the steps after it are trained again.
export MORPH_SNAPSHOT_EVERY=4
tmp=$(mktemp -d)
out=$tmp/out
mkdir -p "$out/pids"
run=""
cleanup() {
  [ -n "$run" ] && kill -TERM "$run" 2>/dev/null || true
  for f in "$out"/pids/*; do [ -e "$f" ] && kill -KILL "${f##*/}" 2>/dev/null || true; done
  [ -n "$run" ] && kill -KILL "$run" 2>/dev/null || true
  if [ "${KEEP:-0}" = 1 ]; then echo "kept $tmp" >&2; else rm -rf "$tmp"; fi
}
trap cleanup EXIT
fail() {
  echo "torch_data_elastic_test: $*" >&2
  tail -n 30 "$tmp/run.log" >&2 || true
  cat "$out/events.jsonl" >&2 2>/dev/null || true
  for f in "$tmp"/logs/*; do [ -e "$f" ] && { echo "== $f" >&2; tail -n 25 "$f" >&2; }; done
  exit 1
}
timeout 150 "$morphrun" -n 2 --max 4 --log-dir "$tmp/logs" -- "$python" \
  "$here/data_worker.py" --out "$out" --step-sleep 0.1 >"$tmp/run.log" 2>&1 &
run=$!
api=""
for _ in $(seq 300); do
  api=$(sed -n 's/.*scheduler API \([0-9.]*:[0-9]*\).*/\1/p' "$tmp/run.log")
  [ -n "$api" ] && break
  sleep 0.1
done
[ -n "$api" ] || fail "morphrun did not start"
wait_for() {  # wait_for <what> <command...>: until the command succeeds (60 s at most)
  local what=$1
  shift
  for _ in $(seq 600); do
    "$@" && return 0
    kill -0 "$run" 2>/dev/null || fail "the job ended before $what"
    sleep 0.1
  done
  fail "no $what in 60 s"
}
trained_step() { [ -f "$out/trained.jsonl" ] && grep -q "\"step\": $1," "$out/trained.jsonl"; }
world() { grep -q "\"event\": \"reconfigured\".*\"world\": $1," "$out/events.jsonl" 2>/dev/null; }
wait_for "step 3" trained_step 3
"$morphctl" --addr "$api" resize 4 >/dev/null
wait_for "world 4" world 4
"$morphctl" --addr "$api" resize 3 >/dev/null
wait_for "world 3" world 3
touch "$out/kill-now"
wait_for "the kill" test -f "$out/kill.json"
# The killed trainer's loader workers die with it (PR_SET_PDEATHSIG), not 5 s later.
left=$("$python" - "$out/kill.json" <<'PY'
import json, os, sys, time
k = json.load(open(sys.argv[1]))


def running(p):  # exists and is not a zombie (an orphan's reaper may be slow)
    try:
        with open(f"/proc/{p}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


left = k["loader_workers"]
if not left:
    sys.exit(print("(none recorded: the trainer had no loader workers)"))
while True:
    left = [p for p in left if running(p)]
    if not left or time.time() >= k["t"] + 1.0:
        break
    time.sleep(0.02)
print(" ".join(map(str, left)))
PY
)
[ -z "$left" ] || fail "the killed trainer's loader workers $left outlived it by 1 s"
wait_for "the recovery" world 2
touch "$out/release"
set +e
wait "$run"
rc=$?
set -e
run=""
# morphrun reports the killed worker's 137 once the job completed.
if [ "$rc" = 137 ] && grep -q "the job completed" "$tmp/run.log"; then rc=0; fi
[ "$rc" = 0 ] || fail "morphrun exited $rc"
sleep 0.5
for f in "$out"/pids/*; do
  p=${f##*/}
  if [ -e "/proc/$p" ] && ! grep -q ') Z ' "/proc/$p/stat" 2>/dev/null; then
    fail "process $p of the job is still running"
  fi
done

"$python" - "$out" <<'PY' || fail "checks failed"
import json, sys
import torch
import morph
out = sys.argv[1]
N, B, SEED, EPOCH, LR = 120, 10, 7, 12, 0.05
recs = [json.loads(l) for l in open(out + "/trained.jsonl")]
ev = [json.loads(l) for l in open(out + "/events.jsonl")]
final = [e for e in ev if e["event"] == "final"]
assert len(final) == 2, final  # the two survivors
stop = final[0]["stop"]
assert stop and stop % EPOCH == 0, stop
cursor = morph.DatasetCursor(N, B, SEED)
by_step = {}
for r in recs:
    by_step.setdefault(r["step"], []).append(r)
assert sorted(by_step) == list(range(stop)), f"steps recorded {sorted(by_step)}, want 0..{stop - 1}"
replayed, dps, trained = [], set(), []
for s in range(stop):
    gen = max(r["gen"] for r in by_step[s])
    if len({r["gen"] for r in by_step[s]}) > 1:
        replayed.append(s)
    rs = sorted((r for r in by_step[s] if r["gen"] == gen), key=lambda r: r["d"])
    dp = rs[0]["dp"]
    dps.add(dp)
    assert [r["d"] for r in rs] == list(range(dp)), f"step {s} gen {gen}: DP ranks {[r['d'] for r in rs]} of {dp}"
    for r in rs:  # the loader served exactly the runtime's samples: nothing stale
        assert r["ids"] == r["want"], f"step {s} gen {gen} dp {dp} rank {r['d']}: trained {r['ids']}, the step's samples {r['want']}"
    ids = [i for r in rs for i in r["ids"]]
    assert ids == [cursor.sample_at(p) for p in range(s * B, (s + 1) * B)], f"step {s}: {ids}"
    trained += ids
for e in range(stop // EPOCH):
    got = sorted(trained[e * N:(e + 1) * N])
    assert got == list(range(N)), f"epoch {e}: not every sample once"
# dp 3's steps may all lie after the snapshot the recovery rolled back to: then replayed at dp 2.
assert {r["dp"] for r in recs} == {2, 3, 4} and dps >= {2, 4}, f"dp values trained {dps}"
# The model against full-batch steps on one process.
w = torch.zeros(4, dtype=torch.float64)
m = torch.zeros(12, dtype=torch.float64)
for s in range(stop):
    ids = torch.tensor([cursor.sample_at(p) for p in range(s * B, (s + 1) * B)])
    x = ids.to(torch.float64) / N
    X, y = torch.stack([torch.ones_like(x), x, torch.sin(7 * x), x * x], 1), 3 * x - 1
    g = 2 * ((X @ w - y)[:, None] * X).sum(0)
    w -= LR * g / B
    m = 0.9 * m + g.repeat(3)
err = 0.0
for f in final:
    lo, hi, mine = f["m"]
    err = max(err, (torch.tensor(f["w"], dtype=torch.float64) - w).abs().max().item(),
              (torch.tensor(mine, dtype=torch.float64) - m[lo:hi]).abs().max().item())
assert err < 1e-9, f"final model differs from the replay by {err}"
assert sorted(x for f in final for x in f["m"][:2]) == [0, 6, 6, 12], [f["m"][:2] for f in final]
rec = [e for e in ev if e["event"] == "reconfigured"]
kill = json.load(open(out + "/kill.json"))
recovery = [e for e in rec if e["recovery"]]
assert recovery, "no recovery"
assert replayed, "no step was trained again after the recovery"
last = {}
for r in recs:
    last[r["pid"]] = r
print(json.dumps({"name": "torch_data_elastic", "steps": stop, "epochs": stop // EPOCH,
                  "worlds": sorted({e["world"] for e in rec}), "killed_at_step": kill["step"],
                  "recovered_at_step": min(e["step"] for e in recovery),
                  "lost_steps": max(e["lost_steps"] for e in recovery),
                  "steps_replayed": replayed, "model_error": err,
                  "loader_restarts": sum(r["restarts"] for r in last.values()),
                  "prefetched_batches_dropped": sum(r["dropped"] for r in last.values())}))
PY
echo "torch_data_elastic_test: passed"
