#!/usr/bin/env bash
# The elastic torch examples against a fixed-configuration reference (ctest
# torch_train_elastic_<case>_test for train.py, torch_handwritten_elastic_<case>_test for
# handwritten.py; label torch).
#
#   elastic_test.sh <build dir> <morphrun> <morphctl> <case> [train|handwritten]
#                                                  (the venv and package of the build)
#   case tp:   3 workers (dp=3) -> 2 (dp=1 tp=2) -> 4 (dp=2 tp=2) -> 3 (dp=3 tp=1: tp 2 -> 1);
#              handwritten.py: the memory budget forces dp=1 tp=2; train.py (FSDP2 shards every
#              tensor over dp, so dp=2 and tp=2 need the same memory): pinned configs
#   case pp:   3 workers (dp=3) -> 2 (dp=1 pp=2) -> 4 (dp=2 pp=2) -> 3 (dp=3 pp=1: pp 2 -> 1);
#              handwritten.py: a smaller budget forces dp=1 pp=2; train.py: pinned configs
#   case kill: 4 workers (dp=4) -> one SIGKILLed (recovery from the buddy snapshots)
#   case term: 4 workers (dp=4) -> one SIGTERMed (it leaves; its state moves first)
#
# Checks: the loss of every step equals the reference run's (1 worker, the same seed and global
# batch) within TOL (absolute, nats per byte: only the order of float sums differs, and TP cuts
# the matrix products differently), the expected configurations are reached, the loss goes down.
set -euo pipefail
build=$1
morphrun=$2
morphctl=$3
case_=$4
program=${5:-handwritten}
here=$(cd "$(dirname "$0")" && pwd)
python=$(MORPH_VENV="${MORPH_VENV:-$build/venv}" bash "$here/../../scripts/python-venv.sh" | tail -n 1)
export PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}"
case $4 in tp|pp) STEPS=${STEPS:-40} ;; *) STEPS=${STEPS:-24} ;; esac
# handwritten.py's ZeRO-1 sums its updates back over dp (zeros elsewhere) and TP cuts the matrix
# products; train.py's FSDP2 reduce-scatters gradients over another dp: float sums only.
case $program in handwritten) TOL=${TOL:-2e-3} ;; *) TOL=${TOL:-1e-4} ;; esac
tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  sleep 1
  for f in "$tmp"/el/pids/*; do [ -e "$f" ] && kill -KILL "${f##*/}" 2>/dev/null || true; done
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  if [ "${KEEP:-0}" = 1 ]; then echo "kept $tmp" >&2; else rm -rf "$tmp"; fi
}
trap cleanup EXIT
fail() { echo "torch_${program}_elastic_test ($case_): $*" >&2; exit 1; }
source "$(cd "$(dirname "$0")/../.." && pwd)/scripts/elastic_checks.sh"
export MORPH_TOKEN=torch-elastic-test-token OMP_NUM_THREADS=1 MORPH_SNAPSHOT_EVERY=1
common=(--steps "$STEPS" --quiet --global-batch 12 --seed 7 --layers 2)
extra=()  # the elastic run's only
case $program/$case_ in
  # 2 layers: 0.36 M parameters, 4.3 MB with the AdamW moments (ZeRO-1 over dp). 2.6 MB holds
  # dp=3 and tp=2 but not dp=2; 2.45 MB holds dp=3 and pp=2 but not dp=2.
  handwritten/tp) extra=(--device-memory "${MEM_TP:-2600000}") common+=(--pp-candidates 1) ;;
  handwritten/pp) extra=(--device-memory "${MEM_PP:-2450000}") common+=(--tp-candidates 1) ;;
  handwritten/kill|handwritten/term) ;;
  train/tp) common+=(--tp 2) ;;
  train/pp) common+=(--pp 2) ;;
  train/kill|train/term) ;;
  *) fail "unknown case $case_ of $program" ;;
esac
case $program in
  handwritten) common=("$here/handwritten.py" "${common[@]}" --micro-batches 2) ;;
  train) common=("$here/train.py" "${common[@]}" --micro-batch 2) ;;
esac
case $case_ in
  tp) want=(dp3tp1pp1 dp1tp2pp1 dp2tp2pp1) ;;
  pp) want=(dp3tp1pp1 dp1tp1pp2 dp2tp1pp2) ;;
  kill|term) want=(dp4tp1pp1 dp3tp1pp1) ;;
esac

timeout 300 "$morphrun" -n 1 -- "$python" "${common[@]}" --out "$tmp/ref" >"$tmp/ref.log" 2>&1 ||
  { tail -20 "$tmp/ref.log"; fail "reference run failed"; }

n=3
case $case_ in kill|term) n=4 ;; esac
# Joiners start Python and import torch (seconds on 2 loaded cores): the grow needs the run to
# last that long after the request.
pace=()
case $case_ in tp|pp) pace=(--step-sleep 0.4) ;; esac
# At 3 workers the config is pinned to dp=3 (what the planner picks at the start too): the last
# resize, from dp=2 tp=2 (pp=2), makes tp (pp) 2 -> 1, which the planner, keeping tp and pp
# while they fit, would not.
# train.py: FSDP2 shards everything over dp, so no budget makes the planner prefer tp: every
# config is pinned.
pins=()
case $case_ in tp|pp) pins=(--config 3=dp3tp1pp1) ;; esac
[ "$program/$case_" = train/tp ] && pins+=(--config 2=dp1tp2pp1 --config 4=dp2tp2pp1)
[ "$program/$case_" = train/pp ] && pins+=(--config 2=dp1tp1pp2 --config 4=dp2tp1pp2)
timeout 400 "$morphrun" -n "$n" --max 6 "${pins[@]}" --log-dir "$tmp/logs" -- "$python" "${common[@]}" \
  --out "$tmp/el" "${extra[@]}" "${pace[@]}" >"$tmp/el.log" 2>&1 &
run=$!
pids+=("$run")
api=""
for _ in $(seq 600); do
  api=$(sed -n 's/.*scheduler API \([0-9.]*:[0-9]*\).*/\1/p' "$tmp/el.log")
  [ -n "$api" ] && break
  sleep 0.1
done
[ -n "$api" ] || { cat "$tmp/el.log"; fail "morphrun did not start"; }
at_step() {  # waits until the elastic run logged step >= $1
  for _ in $(seq 3000); do
    s=$(tail -n 1 "$tmp/el/metrics.tsv" 2>/dev/null | cut -f1) || true
    [ -n "$s" ] && [ "$s" -ge "$1" ] && return 0
    kill -0 "$run" 2>/dev/null || return 1
    sleep 0.1
  done
  fail "step $1 not reached"
}
victim() { ls -t "$tmp/el/pids" | head -n 1; }
case $case_ in
  kill) at_step 4 && kill -KILL "$(victim)" ;;
  term) at_step 4 && kill -TERM "$(victim)" ;;
  *)
    at_step 3 && "$morphctl" --addr "$api" resize 2 >/dev/null
    at_step 8 && "$morphctl" --addr "$api" resize 4 >/dev/null
    # Back to 3 workers once the 4 train: tp (pp) 2 -> 1 (the pinned dp=3; it fits the budget).
    for _ in $(seq 1500); do
      [ "$(tail -n 1 "$tmp/el/events.tsv" 2>/dev/null | cut -f5)" = 4 ] && break
      kill -0 "$run" 2>/dev/null || break
      sleep 0.2
    done
    "$morphctl" --addr "$api" resize 3 >/dev/null
    ;;
esac
set +e
wait "$run"
rc=$?
set -e
# morphrun reports the SIGKILLed worker's status (137) even when the job recovered and completed.
if [ "$case_" = kill ] && [ "$rc" = 137 ] && grep -q "the job completed" "$tmp/el.log"; then rc=0; fi
if [ "$rc" != 0 ]; then
  tail -20 "$tmp/el.log" >&2
  for f in "$tmp"/logs/*; do [ -f "$f" ] && { echo "== $f" >&2; tail -8 "$f" >&2; }; done
  fail "elastic run exited $rc"
fi

[ -s "$tmp/el/events.tsv" ] || fail "no reconfiguration happened"
elastic_check_configs "$tmp/el" "${want[@]}"
if [ "$case_" = tp ] || [ "$case_" = pp ]; then  # the last change took tp (pp) back to 1
  last_cfg=$(tail -n 1 "$tmp/el/events.tsv" | cut -f7)
  [ "$last_cfg" = dp3tp1pp1 ] || fail "the last change went to $last_cfg, not dp3tp1pp1"
fi
[ "$case_" = kill ] && elastic_check_recovery "$tmp/el"
elastic_check_loss "$tmp/ref" "$tmp/el" "$TOL" "$([ "$case_" = kill ] && echo 1 || echo 0)"
echo "torch_${program}_elastic_test ($case_): passed; configurations $(elastic_seen_configs "$tmp/el"); loss $ELASTIC_LOSS"
