#!/usr/bin/env bash
# The torch elastic test (ctest torch_elastic_*_test, label torch): elastic_worker.py under
# morphrun, checked against torch.distributed.checkpoint at every change.
#
#   elastic_test.sh <build dir> <morphrun> <morphctl> <case>
#   case grow:   2 workers (dp=2) -> 4 (morphctl resize 4, dp=4) -> 3 (resize 3, dp=3)
#   case kill:   4 workers (dp=4, buddy snapshots every step) -> one SIGKILLs itself while its
#                peers are inside a torch all_reduce -> 3 survivors (dp=3)
#   case hsdp:   4 workers (dp=4), every DP-sharded tensor hybrid (HSDP: shard groups of 2, no
#                snapshots) -> one SIGKILLs itself inside a torch all_reduce -> the survivors'
#                replicas restore its shards: dp=2 (a hybrid group size divides dp), one spare
#   case cuda:   grow's changes with the state on the GPU (add_tensor on cuda: torch storage),
#                MORPH_BACKEND=nccl and torch's NCCL groups (ctest label gpu; exits 77, skipped,
#                without a CUDA device)
#   case reshape: 4 workers pinned to dp=1 tp=2 pp=2 -> 2 (pinned dp=2 tp=1 pp=1: tp and pp 2 -> 1
#                at once) -> 3 (dp=3); two more tensors split over tp, one chunked over dp
#
# Checks: (a) at every reconfiguration each worker of the new generation compared its new
# shards of every tensor, bitwise, with DCP's load of the old layout's save at that step
# (oracle=ok; a recovery's step may lack a complete save: then no-checkpoint is allowed once);
# (b) the final state equals a replay on whole tensors, and the step counter scalar equals the
# steps (no step lost or applied twice); (c) kill: the survivors' torch collective raised, and
# how long after the kill (printed as JSON: collective_error_seconds); (d) a shard the program
# held before a change still reads its values after it, also (grow's 4 -> 3) where its pages
# moved into the new shard, and in the grow a survivor pre-allocated its new shards before the switch step
# (prepare_bytes).
set -euo pipefail
build=$1
morphrun=$2
morphctl=$3
case_=$4
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="$(MORPH_VENV="${MORPH_VENV:-$build/venv}" "$here/../../scripts/python-venv.sh" | tail -n 1)"
export PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
export MORPH_TOKEN=torch-elastic-test-token
STEPS=${STEPS:-32}
tmp=$(mktemp -d)
mkdir -p "$tmp/out/pids"
run=""
cleanup() {
  [ -n "$run" ] && kill -TERM "$run" 2>/dev/null || true
  sleep 1
  for f in "$tmp"/out/pids/*; do [ -e "$f" ] && kill -KILL "${f##*/}" 2>/dev/null || true; done
  [ -n "$run" ] && kill -KILL "$run" 2>/dev/null || true
  if [ "${KEEP:-0}" = 1 ]; then echo "kept $tmp" >&2; else rm -rf "$tmp"; fi
}
trap cleanup EXIT
fail() {
  echo "torch_elastic_test ($case_): $*" >&2
  tail -n 30 "$tmp/run.log" >&2 || true
  cat "$tmp/out/events.jsonl" >&2 2>/dev/null || true
  for f in "$tmp"/logs/*; do [ -e "$f" ] && { echo "== $f" >&2; tail -n 25 "$f" >&2; }; done
  exit 1
}
# Joiners start Python and import torch (seconds on 2 loaded cores): steps are paced so that
# the job still runs when they arrive.
args=(--steps "$STEPS" --out "$tmp/out" --step-sleep 0.4)
pins=()
case $case_ in
  grow) n=2 ;;
  reshape)  # dp1 tp2 pp2 -> dp2 tp1 pp1 in one change, then dp3 (the configs pinned)
    n=4
    args+=(--tp-pp)
    pins=(--config 4=dp1tp2pp2 --config 2=dp2tp1pp1)
    ;;
  kill)
    n=4
    args+=(--kill-at 5 --kill-rank 2)
    export MORPH_SNAPSHOT_EVERY=1
    ;;
  cuda)
    if ! "$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
      echo "torch_elastic_test (cuda): skipped: torch finds no CUDA device"
      exit 77
    fi
    "$python" -c "import torch; print('NCCL', '.'.join(map(str, torch.cuda.nccl.version())), \
      'on', torch.cuda.get_device_name(0))"
    n=2
    args+=(--device cuda)
    # Ranks share the GPU (NCCL >= 2.30 allows it with this variable).
    export MORPH_BACKEND=nccl NCCL_MULTI_RANK_GPU_ENABLE=1
    ;;
  hsdp)
    n=4
    args+=(--kill-at 5 --kill-rank 2 --hsdp)
    ;;
  *) fail "unknown case $case_" ;;
esac
: >"$tmp/run.log"  # before the loop below reads it (the launch runs in the background)
timeout 300 "$morphrun" -n "$n" --max 6 "${pins[@]}" --log-dir "$tmp/logs" -- "$python" \
  "$here/elastic_worker.py" "${args[@]}" >"$tmp/run.log" 2>&1 &
run=$!
api=""
for _ in $(seq 300); do
  api=$(sed -n 's/.*scheduler API \([0-9.]*:[0-9]*\).*/\1/p' "$tmp/run.log")
  [ -n "$api" ] && break
  sleep 0.1
done
[ -n "$api" ] || fail "morphrun did not start"
at_step() {  # waits until some worker logged a DCP save for step >= $1
  for _ in $(seq 1200); do
    [ -d "$tmp/out/dcp/at-$1" ] && return 0
    kill -0 "$run" 2>/dev/null || return 1
    sleep 0.1
  done
  fail "step $1 not reached"
}
at_world() {  # waits until a worker reported a reconfiguration into world $1
  for _ in $(seq 1200); do
    grep -q "\"event\": \"reconfigured\".*\"world\": $1," "$tmp/out/events.jsonl" 2>/dev/null &&
      return 0
    kill -0 "$run" 2>/dev/null || return 1
    sleep 0.1
  done
  fail "no reconfiguration into world $1"
}
if [[ "$case_" = grow || "$case_" = cuda ]]; then
  at_step 3 && "$morphctl" --addr "$api" resize 4 >/dev/null
  at_world 4 && "$morphctl" --addr "$api" resize 3 >/dev/null
fi
if [ "$case_" = reshape ]; then
  at_step 3 && "$morphctl" --addr "$api" resize 2 >/dev/null
  at_world 2 && "$morphctl" --addr "$api" resize 3 >/dev/null
fi
set +e
wait "$run"
rc=$?
set -e
run=""
if [[ "$case_" = kill || "$case_" = hsdp ]] && [ "$rc" = 137 ] && grep -q "the job completed" "$tmp/run.log"; then rc=0; fi
[ "$rc" = 0 ] || fail "morphrun exited $rc"

"$python" - "$tmp/out" "$case_" <<'PY' || fail "checks failed"
import json, os, sys
out, case = sys.argv[1], sys.argv[2]
ev = [json.loads(l) for l in open(out + "/events.jsonl")]
rec = [e for e in ev if e["event"] == "reconfigured"]
final = [e for e in ev if e["event"] == "final"]
steps = {}
for e in rec:
    steps.setdefault(e["step"], []).append(e)
worlds = [max(x["world"] for x in v) for _, v in sorted(steps.items())]
# The process groups' torch backend: "morph" unless MORPH_TORCH_BACKEND chose another.
backend = os.environ.get("MORPH_TORCH_BACKEND") or ("nccl" if case == "cuda" else "morph")
assert all(x["backend"] == backend for x in rec), f"backends {[x['backend'] for x in rec]}"
want = {"grow": [4, 3], "cuda": [4, 3], "reshape": [2, 3], "hsdp": [2]}.get(case, [3])
assert worlds == want, f"worlds after each change {worlds}, want {want}"
for s, v in sorted(steps.items()):
    assert len(v) == v[0]["world"], f"step {s}: {len(v)} workers reported, world {v[0]['world']}"
    bad = [x for x in v if x["oracle"] != "ok" and not (x["recovery"] and x["oracle"] == "no-checkpoint")]
    assert not bad, f"step {s}: oracle {[x['oracle'] for x in v]}"
# A shard the program held before a change reads its values after it, whether it stayed or its
# pages moved into the new shard; in the grow case's 4 -> 3, rank 0's ZeRO range grows in place.
held = [x["old_held"] for x in rec if x["old_held"] is not None]
assert case == "cuda" or held, "no old shard held across a change"
assert all(h in ("intact", "moved") for h in held), f"old shards held: {held}"
if case == "grow":  # 4 -> 3: rank 0's range grows at offset 0
    assert "moved" in held, f"no growing shard was moved: {held}"
# The package's host tensors are pre-allocated while the old generation trains (not for a
# recovery): a survivor of a planned change held its new shards before the switch step.
if case == "grow":
    pre = [x for x in rec if x["old_rank"] >= 0 and x["prepare_bytes"] > x["old_state_bytes"]]
    assert pre, f"no survivor pre-allocated its new shards: {rec}"
assert final and all(f["equal"] for f in final), f"final state differs: {final}"
assert all(f["count"] == f["steps"] for f in final), f"step counter differs: {final}"
res = {"name": f"torch_elastic/{case}", "changes": len(steps),
       "oracle_ok": sum(x["oracle"] == "ok" for v in steps.values() for x in v),
       "pg_rebuild_seconds_max": round(max(x["pg_seconds"] for x in rec), 3),
       "stall_seconds_max": round(max(x["stall"] for x in rec), 3)}
if case in ("kill", "hsdp"):
    kill = json.load(open(out + "/kill.json"))
    failed = [e for e in ev if e["event"] == "collective_failed"]
    assert len(failed) == 3, f"survivors whose torch collective raised: {failed}"
    res["collective_error_seconds"] = [round(e["t_fail"] - kill["t"], 3) for e in failed]
    # Within morph's detection time (the survivors' reports are awaited that long); with the
    # "morph" backend the runtime aborts the collective when it learns of the death (the
    # coordinator sees the process's connection close): well within 2 s.
    detect = int(os.environ.get("MORPH_HEARTBEAT_TIMEOUT_MS", "10000")) / 1000
    if backend == "morph":
        detect = 2.0
    late = [s for s in res["collective_error_seconds"] if s > detect]
    assert not late, f"torch collectives raised {late} s after the kill (detection {detect} s)"
    res["recovery"] = any(x["recovery"] for x in rec)
print(json.dumps(res))
PY
echo "torch_elastic_test ($case_): passed"
