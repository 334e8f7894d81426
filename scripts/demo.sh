#!/usr/bin/env bash
# make demo: an elastic GPT (examples/gpt) trained under morphrun while a scripted scheduler
# changes the job: 8 workers; `morphctl resize 6`; a SIGTERM (preemption) to one worker; a
# SIGKILL (failure) to another; `morphctl resize 8`. Each worker's memory budget
# (--device-memory) holds the model's state only when it is split at least 4 ways, so the
# planner changes dp, tp and pp as the worker count changes (examples/gpt/README.md, "What the
# demo does"). Shows a live line (world, config and standby spares), each reconfiguration with
# its kind, the planner's reason and its phase timings, then a summary table, and draws
# OUT/loss.png (gnuplot).
#
#   bash scripts/demo.sh                 # BUILD_DIR=build, OUT=$BUILD_DIR/demo
#   DEMO_SHORT=1 bash scripts/demo.sh    # the CI form (gpt_demo_test): fewer steps, same events
#   DEMO_PROGRAM=torch bash scripts/demo.sh   # make demo-torch: examples/torch/handwritten.py instead
#
# DEMO_PROGRAM=torch trains the PyTorch Llama of examples/torch, the hand-written program
# (handwritten.py: the demo changes pp, which the standard train.py cannot yet; 2 layers, 4.3 MB
# of parameters and AdamW moments) with the Python package `pip install ./python` builds against the installed
# prefix (into $BUILD_DIR/demo-python; the venv from scripts/python-venv.sh): 6 workers;
# `morphctl resize 4`; SIGTERM; SIGKILL; `morphctl resize 6`. Its budget (2.6 MB) holds the
# state split 3 ways, so at 2 workers the planner goes to tp=2 or pp=2 and back to dp after.
#
# Environment: BUILD_DIR (a configured and built morph tree; the script installs it into
# $BUILD_DIR/demo-prefix and builds examples/gpt against that prefix, as a user's project would),
# OUT (results), DEMO_STEPS, DEMO_EVENT_STEPS (steps between the scheduler's events),
# DEMO_EVENTS (the scheduler's script, default "resize:6 term kill resize:8"), DEMO_MEMORY (the
# per-rank budget in bytes, default 850000), MORPH_SNAPSHOT_EVERY (default 1), DEMO_SKIP_BUILD=1
# (use $BUILD_DIR/examples/gpt/gpt, or for torch the tree's $BUILD_DIR/python package, as they
# are), DEMO_WORKERS (8; torch 6). Exit status: morphrun's, or 1 when a check failed.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
BUILD_DIR=${BUILD_DIR:-build}
case $BUILD_DIR in /*) ;; *) BUILD_DIR=$here/$BUILD_DIR ;; esac
OUT=${OUT:-$BUILD_DIR/demo}
SHORT=${DEMO_SHORT:-0}
PROGRAM=${DEMO_PROGRAM:-gpt}
case $PROGRAM in gpt|torch) ;; *) echo "demo: DEMO_PROGRAM is gpt or torch, not '$PROGRAM'" >&2; exit 2 ;; esac
if [ "$SHORT" = 1 ]; then STEPS=${DEMO_STEPS:-200}; else STEPS=${DEMO_STEPS:-300}; fi
# Steps between the scheduler's events (counted from the step at which the previous change
# landed). The old generation trains on while a change is prepared, so a slow change (joiners
# starting on a loaded machine) uses steps too: the four events need room.
if [ "$SHORT" = 1 ]; then EVENT_STEPS=${DEMO_EVENT_STEPS:-16}; else EVENT_STEPS=${DEMO_EVENT_STEPS:-$((STEPS / 8))}; fi
# resize:N (morphctl resize N), term (SIGTERM to a member: a preemption), kill (SIGKILL to a
# member: a failure and its recovery).
if [ "$PROGRAM" = torch ]; then
  read -r -a EVENTS <<<"${DEMO_EVENTS:-resize:4 term kill resize:6}"
  WORKERS=${DEMO_WORKERS:-6}
  MEMORY=${DEMO_MEMORY:-2600000}
else
  read -r -a EVENTS <<<"${DEMO_EVENTS:-resize:6 term kill resize:8}"
  WORKERS=${DEMO_WORKERS:-8}
  MEMORY=${DEMO_MEMORY:-850000}
fi
JOBS=${JOBS:-2}
say() { printf '%s\n' "demo: $*" >&2; }
die() { say "$*"; exit 1; }

# --- build: morph installed into a prefix, the example built against it as a user's would be ---
# gpt: examples/gpt with find_package(morph); torch: `pip install ./python` against the prefix.
prefix=$BUILD_DIR/demo-prefix
gpt_build=$BUILD_DIR/gpt-standalone
build_log() { tail -30 "$1"; die "$2 (log: $1)"; }
install_prefix() {
  say "building morph ($BUILD_DIR) and installing it into $prefix"
  # What the install copies (libraries, morphrun, morphctl, morphd; no tests or benchmarks).
  cmake --build "$BUILD_DIR" -j "$JOBS" --target morph_installables >"$BUILD_DIR/demo-build.log" 2>&1 ||
    build_log "$BUILD_DIR/demo-build.log" "build failed"
  cmake --install "$BUILD_DIR" --prefix "$prefix" >"$BUILD_DIR/demo-install.log" 2>&1 ||
    build_log "$BUILD_DIR/demo-install.log" "install failed"
}
if [ "$PROGRAM" = torch ]; then
  python=$(MORPH_VENV="${MORPH_VENV:-$BUILD_DIR/venv}" bash "$here/scripts/python-venv.sh" | tail -n 1)
  if [ "${DEMO_SKIP_BUILD:-0}" = 1 ]; then
    pypath=$BUILD_DIR/python
    BIN=$BUILD_DIR/runtime/tools
  else
    install_prefix
    pypath=$BUILD_DIR/demo-python
    say "pip install ./python against $prefix (into $pypath)"
    rm -rf "$pypath"
    "$python" -m pip install --no-deps --no-build-isolation --target "$pypath" "$here/python" \
      -Ccmake.define.CMAKE_PREFIX_PATH="$prefix" -Cbuild-dir="$BUILD_DIR/demo-python-build" \
      >"$BUILD_DIR/demo-pip.log" 2>&1 || build_log "$BUILD_DIR/demo-pip.log" "pip install ./python failed"
    BIN=$prefix/bin
  fi
  [ -f "$pypath/morph/__init__.py" ] || die "no morph package in $pypath"
  export PYTHONPATH=$pypath OMP_NUM_THREADS=1
  PROG=("$python" "$here/examples/torch/handwritten.py" --layers 2 --step-sleep "${DEMO_STEP_SLEEP:-0.05}")
else
  if [ "${DEMO_SKIP_BUILD:-0}" = 1 ]; then
    GPT=$BUILD_DIR/examples/gpt/gpt
    BIN=$BUILD_DIR/runtime/tools
  else
    install_prefix
    say "building examples/gpt against the installed morph ($gpt_build)"
    gen=()
    command -v ninja >/dev/null && gen=(-G Ninja)
    launcher=()
    command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
    cmake -S "$here/examples/gpt" -B "$gpt_build" "${gen[@]}" "${launcher[@]}" \
      -DCMAKE_PREFIX_PATH="$prefix" -DBUILD_TESTING=OFF \
      >"$BUILD_DIR/demo-gpt.log" 2>&1 &&
      cmake --build "$gpt_build" -j "$JOBS" >>"$BUILD_DIR/demo-gpt.log" 2>&1 ||
      build_log "$BUILD_DIR/demo-gpt.log" "examples/gpt did not build against $prefix"
    GPT=$gpt_build/gpt
    BIN=$prefix/bin
  fi
  [ -x "$GPT" ] || die "no $GPT"
  PROG=("$GPT")
fi
[ -x "$BIN/morphrun" ] && [ -x "$BIN/morphctl" ] || die "no morphrun/morphctl in $BIN"

# --- run ---
rm -rf "$OUT"
mkdir -p "$OUT/logs"
export MORPH_TOKEN=${MORPH_TOKEN:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}
export OPENBLAS_NUM_THREADS=1
# Plain ZeRO-1 keeps one copy of each Adam moment range: a killed worker's ranges survive in its
# buddy's in-memory snapshot, taken every step here (no cost measurable at this size); the
# recovery trains the steps since that snapshot again (0 or 1).
export MORPH_SNAPSHOT_EVERY=${MORPH_SNAPSHOT_EVERY:-1}
# 4 layers, 4 heads, width 64, 32-byte sequences, 16 sequences per step: 2.8 MB of parameters
# and Adam moments. The budget makes tp=2 need dp >= 4, pp=2 dp >= 3, tp=2 pp=2 dp >= 1, and
# tp=1 pp=1 never fit (the planner keeps tp and pp while they fit; when they no longer do it
# picks the fitting config with the highest estimated throughput).
GPT_ARGS=(--steps "$STEPS" --out "$OUT" --quiet --device-memory "$MEMORY")
start=$(date +%s.%N)
"$BIN/morphrun" -n "$WORKERS" --max 8 --log-dir "$OUT/logs" -- "${PROG[@]}" "${GPT_ARGS[@]}" \
  >"$OUT/morphrun.log" 2>&1 &
run_pid=$!
cleanup() { kill "$run_pid" 2>/dev/null || true; }
trap cleanup EXIT
api=""
for _ in $(seq 200); do
  api=$(sed -n 's/.*scheduler API \([0-9.]*:[0-9]*\).*/\1/p' "$OUT/morphrun.log")
  [ -n "$api" ] && break
  kill -0 "$run_pid" 2>/dev/null || break
  sleep 0.1
done
[ -n "$api" ] || { cat "$OUT/morphrun.log"; die "morphrun did not start"; }
ctl() { "$BIN/morphctl" --addr "$api" --timeout-ms 5000 "$@" >>"$OUT/scheduler.log" 2>&1; }

last_step() { tail -n 1 "$OUT/metrics.tsv" 2>/dev/null | cut -f1 || true; }
gen_now() { tail -n 1 "$OUT/metrics.tsv" 2>/dev/null | cut -f7 || true; }
wait_step() {  # until step >= $1 (or the run ended)
  while kill -0 "$run_pid" 2>/dev/null; do
    s=$(last_step)
    [ -n "$s" ] && [ "$s" -ge "$1" ] && return 0
    sleep 0.2
  done
  return 1
}
wait_change() {  # until a step of a generation after $1 (every event changes it), at most 120 s
  for _ in $(seq 600); do
    g=$(gen_now)
    [ -n "$g" ] && [ "$g" -gt "$1" ] && return 0
    kill -0 "$run_pid" 2>/dev/null || return 1
    sleep 0.2
  done
  say "no change 120 s after the scheduler's event: the scheduler stops"
  return 1
}
victim() {  # a live member's pid: the newest pid file (members touch theirs every step)
  for f in $(ls -t "$OUT/pids" 2>/dev/null); do
    if kill -0 "$f" 2>/dev/null; then echo "$f"; return; fi
  done
}
# OUT/scheduler.tsv: the generation the job trained in when the scheduler acted (the change it
# caused starts from that one), kind (resize, preemption, kill), step, what it did.
# The main loop prints them (a line of their own, not after the live line).
event() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$OUT/scheduler.tsv"; }

scheduler() {
  local f=$EVENT_STEPS at=$EVENT_STEPS g s v n
  for ev in "${EVENTS[@]}"; do
    wait_step "$at" || return 0
    g=$(gen_now)
    s=$(last_step)
    case $ev in
      resize:*)
        n=${ev#resize:}
        event "$g" resize "$s" "morphctl resize $n"
        ctl resize "$n" --reason "demo" || { say "morphctl resize $n failed"; return 0; }
        ;;
      term)
        v=$(victim)
        [ -n "$v" ] || return 0
        event "$g" preemption "$s" "SIGTERM to worker pid $v (preemption)"
        kill -TERM "$v" || return 0
        ;;
      kill)
        v=$(victim)
        [ -n "$v" ] || return 0
        event "$g" kill "$s" "SIGKILL to worker pid $v (failure)"
        kill -KILL "$v" || return 0
        ;;
      *) say "unknown event '$ev' in DEMO_EVENTS"; return 0 ;;
    esac
    wait_change "$g" || return 0
    at=$(($(last_step) + f))
  done
}
scheduler &
sched_pid=$!

# The coordinator's view (morphctl status --json): per generation, its standby spares (seen
# while stable, no resize in progress) and the planner's explanation of the change that made it.
declare -A SPARES=() WHY=() SAID=()
last_status=""
poll_status() {
  local j
  j=$("$BIN/morphctl" --addr "$api" --timeout-ms 1000 --json status 2>/dev/null) || return 0
  local f
  f=$(printf '%s\n' "$j" | awk '
    function grab(re, strip,  s) {
      if (!match($0, re)) return ""
      s = substr($0, RSTART, RLENGTH); sub(strip, "", s); return s
    }
    {
      g = grab("[{,]\"generation\":[0-9]+", "^.*:")
      ph = grab("\"phase\":\"[a-z_]+\"", "^\"phase\":")
      gsub(/"/, "", ph)
      sb = grab("\"standby\":\\[[0-9,]*\\]", "^\"standby\":")
      gsub(/[][]/, "", sb)
      n = (sb == "") ? 0 : split(sb, a, ",")
      tg = grab("\"to_generation\":[0-9]+", "^.*:")
      ex = grab("\"explanation\":\"([^\"\\\\]|\\\\.)*\"", "^\"explanation\":\"")
      sub(/"$/, "", ex)
      gsub(/\\"/, "\"", ex)
      w = grab("\"world_size\":[0-9]+", "^.*:")
      if (index($0, "\"resize_in_progress\":true")) ph = ph "+resize"
      # "-" for an empty field: read splits on runs of tabs.
      printf "%s\t%s\t%d\t%s\t%s\t%s\t%s\n", nz(g), nz(ph), n, nz(tg), nz(w), nz(sb), nz(ex)
    }
    function nz(v) { return v == "" ? "-" : v }')
  local g ph n tg w sb ex
  IFS=$'\t' read -r g ph n tg w sb ex <<<"$f" || return 0
  [ "$g" != - ] || return 0
  [ "$sb" = - ] && sb=""
  [ "$tg" = - ] && tg=""
  [ "$ex" = - ] && ex=""
  # OUT/status.tsv: each new (generation, phase, world, standby) the coordinator showed.
  if [ "$g $ph $w $sb" != "$last_status" ]; then
    last_status="$g $ph $w $sb"
    printf '%s\t%s\t%s\t%s\t[%s]\n' "$(last_step)" "$g" "$ph" "$w" "$sb" >>"$OUT/status.tsv"
  fi
  # Joiners a grow started wait as standby until the change: not the generation's spares.
  [ "$ph" = stable ] && SPARES[$g]=$n
  [ -n "$tg" ] && [ -n "$ex" ] && WHY[$tg]=$ex
  return 0
}
spares_text() {  # " + N spare(s)" for generation $1, when the coordinator showed some
  local n=${SPARES[$1]:-0}
  [ "$n" -gt 0 ] || return 0
  [ "$n" = 1 ] && printf ' + 1 spare' || printf ' + %d spares' "$n"
}
# events.tsv lines with the kind of each change first: the scheduler's action that the job's
# generation was in when it acted, "recovery" for a recovery (after a SIGKILL).
with_kinds() {
  awk -F'\t' -v OFS='\t' 'FILENAME == ARGV[1] { k[$1] = $2; next }
    { kind = ($8 == 1) ? "recovery" : (($2 in k) ? k[$2] : "change"); print kind, $0 }' \
    <(cat "$OUT/scheduler.tsv" 2>/dev/null || true) "$1"
}

# awk: "dp4tp2pp1" -> "dp4 tp2 pp1".
CFG_AWK='function cfg(c) { gsub(/[0-9]+/, "& ", c); sub(/ $/, "", c); return c } '

# Live line: the newest step; each reconfiguration on its own line as it lands, then the
# planner's reason once the coordinator shows it.
tty=0
[ -t 1 ] && tty=1
shown_events=0
shown_sched=0
shown_step=-1
printed=""  # without a terminal: the step tens and generation of the last line printed
note() { if [ $tty = 1 ]; then printf '\r\033[K%s\n' "$*"; else printf '%s\n' "$*"; fi; shown_step=-1; }
show() {
  if [ -f "$OUT/scheduler.tsv" ]; then
    local k
    k=$(wc -l <"$OUT/scheduler.tsv")
    if [ "$k" -gt "$shown_sched" ]; then
      while IFS=$'\t' read -r _ _ st what; do note "scheduler, step $st: $what"; done \
        < <(tail -n +$((shown_sched + 1)) "$OUT/scheduler.tsv")
      shown_sched=$k
    fi
  fi
  if [ -f "$OUT/events.tsv" ]; then
    local n
    n=$(wc -l <"$OUT/events.tsv")
    if [ "$n" -gt "$shown_events" ]; then
      while IFS= read -r l; do note "$l"; done < <(
        with_kinds <(tail -n +$((shown_events + 1)) "$OUT/events.tsv") | awk -F'\t' "$CFG_AWK"'{
          c6 = cfg($7); c7 = cfg($8)
          printf "  %s at step %d: generation %d -> %d, world %d -> %d, %s -> %s%s; stall %.0f ms (communicators %.0f ms beside training, plan %.1f ms, transfer %.1f ms, resume %.1f ms)\n",
            $1, $2, $3, $4, $5, $6, c6, c7, ($9 == 1 ? ", steps trained again: " $10 : ""), $15, $11, $12, $13, $14 }')
      shown_events=$n
    fi
  fi
  local g r
  for g in "${!WHY[@]}"; do
    [ -n "${SAID[$g]:-}" ] && continue
    # Only once the change shows in events.tsv (the coordinator may know it first).
    r=$(awk -F'\t' -v g="$g" '$3 == g { print $8 }' "$OUT/events.tsv" 2>/dev/null)
    [ -n "$r" ] || continue
    SAID[$g]=1
    if [ "$r" = 1 ]; then note "    coordinator: recovers ${WHY[$g]}"; else note "    planner: ${WHY[$g]}"; fi
  done
  local l
  l=$(tail -n 1 "$OUT/metrics.tsv" 2>/dev/null) || return 0
  [ -n "$l" ] || return 0
  local s=${l%%$'\t'*}
  [ "$s" = "$shown_step" ] && return 0
  shown_step=$s
  local gen
  gen=$(cut -f7 <<<"$l")
  line=$(printf '%s\n' "$l" | awk -F'\t' -v sp="$(spares_text "$gen")" '{
    printf "step %4d  loss %.4f  %6.0f tok/s  world %d (dp%d tp%d pp%d)%s  generation %d", $1, $2, $9, $3, $4, $5, $6, sp, $7 }')
  if [ $tty = 1 ]; then
    printf '\r\033[K%s' "$line"
  elif [ "$((s / 10)) $gen" != "$printed" ]; then  # every 10 steps and at each new generation
    printed="$((s / 10)) $gen"
    printf '%s\n' "$line"
  fi
}
while kill -0 "$run_pid" 2>/dev/null; do
  poll_status
  show
  sleep 0.3
done
set +e
wait "$run_pid"
rc=$?
set -e
show
[ $tty = 1 ] && printf '\n'
kill "$sched_pid" 2>/dev/null || true
wait "$sched_pid" 2>/dev/null || true
trap - EXIT
# morphrun exits with a worker's status when one ended abnormally, the SIGKILLed one included
# (128 + 9), even when the job recovered and completed: that is the scheduled kill, not a failure.
if [ "$rc" = 137 ] && grep -q "the job completed" "$OUT/morphrun.log" &&
  [ -f "$OUT/scheduler.tsv" ] && cut -f2 "$OUT/scheduler.tsv" | grep -qx kill; then
  say "morphrun exited 137 (the worker the scheduler killed); the job completed"
  rc=0
fi
end=$(date +%s.%N)
wall=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
if [ "$rc" != 0 ]; then
  say "morphrun exited $rc; last lines of its log and the workers' logs:"
  tail -20 "$OUT/morphrun.log" >&2
  for f in "$OUT"/logs/*; do [ -f "$f" ] && { echo "== $f" >&2; tail -5 "$f" >&2; }; done
fi
[ -s "$OUT/metrics.tsv" ] || die "no metrics written"
# OUT/generations.tsv: generation, standby spares, the planner's explanation.
for g in $(cut -f7 "$OUT/metrics.tsv" | sort -un); do
  printf '%s\t%s\t%s\n' "$g" "${SPARES[$g]:-0}" "${WHY[$g]:-}"
done >"$OUT/generations.tsv"
: >"$OUT/changes.tsv"
[ -s "$OUT/events.tsv" ] && with_kinds "$OUT/events.tsv" >"$OUT/changes.tsv"

# --- summary ---
printf '\nsummary (%s s wall, morphrun exit %d)\n' "$wall" "$rc"
awk -F'\t' '
  FILENAME == ARGV[1] { sp[$1] = $2; next }
  FILENAME == ARGV[2] { how[$4] = $1; next }
  { last[$1 + 0] = $0; if ($1 + 0 > max) max = $1 + 0 }
  function emit() {
    printf "%-10s %-6d %-7d %-12s %-4d %-11s %.3f -> %-8.3f %-8.0f %-8.1f\n", first "-" lastst, w,
      sp[g] + 0, cfg, g, (g in how) ? how[g] : "start", lf, ll, tk / cnt, ms / cnt
  }
  END {
    printf "%-10s %-6s %-7s %-12s %-4s %-11s %-18s %-8s %-8s\n", "steps", "world", "spares", "config", "gen", "began by", "loss first->last", "tok/s", "ms/step"
    g = ""
    for (s = 0; s <= max; ++s) {
      if (!(s in last)) continue
      split(last[s], f, "\t")
      if (f[7] != g) {
        if (g != "") emit()
        g = f[7]; first = f[1]; lf = f[2]; tk = 0; ms = 0; cnt = 0
        w = f[3]; cfg = "dp" f[4] " tp" f[5] " pp" f[6]
      }
      lastst = f[1]; ll = f[2]; tk += f[9]; ms += f[8]; cnt++
    }
    if (g != "") emit()
  }' "$OUT/generations.tsv" "$OUT/changes.tsv" "$OUT/metrics.tsv"
if [ -s "$OUT/changes.tsv" ]; then
  printf '\n%-6s %-11s %-8s %-7s %-26s %-6s %-8s %-8s %-8s %-9s %-8s\n' step kind gen world config "again" stall_ms comm_ms plan_ms transfer resume
  awk -F'\t' "$CFG_AWK"'{ c6 = cfg($7); c7 = cfg($8)
    printf "%-6d %-11s %d->%-5d %d->%-4d %-26s %-6d %-8.1f %-8.1f %-8.1f %-9.1f %-8.1f\n",
      $2, $1, $3, $4, $5, $6, c6 "->" c7, $10, $15, $11, $12, $13, $14 }' "$OUT/changes.tsv"
  printf '\nwhy (the coordinator'"'"'s explanation of each change):\n'
  awk -F'\t' 'FILENAME == ARGV[1] { rec[$4] = ($1 == "recovery"); next }
    $3 != "" { printf "  generation %d: %s%s\n", $1, (rec[$1] ? "recovers " : ""), $3 }' \
    "$OUT/changes.tsv" "$OUT/generations.tsv"
fi
first_loss=$(head -n 1 "$OUT/metrics.tsv" | cut -f2)
last_loss=$(tail -n 1 "$OUT/metrics.tsv" | cut -f2)
printf '\nloss %s -> %s over %s steps\n' "$first_loss" "$last_loss" "$(last_step)"
[ -f "$OUT/scheduler.tsv" ] &&
  { printf 'scheduler:\n'; awk -F'\t' '{ printf "  step %d: %s\n", $3, $4 }' "$OUT/scheduler.tsv"; }

# --- plot ---
if command -v gnuplot >/dev/null; then
  DEMO_TITLE="examples/$PROGRAM" bash "$here/scripts/demo_plot.sh" "$OUT" || say "gnuplot failed: $(cat "$OUT/gnuplot.log" 2>/dev/null)"
  [ -s "$OUT/loss.png" ] && printf 'plot: %s\n' "$OUT/loss.png"
else
  say "gnuplot not installed: no plot (bash scripts/install-deps.sh)"
fi
printf 'demo wall time %s s\n' "$wall"
exit "$rc"
