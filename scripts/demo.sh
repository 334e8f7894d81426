#!/usr/bin/env bash
# make demo: an elastic GPT (examples/gpt) trained under morphrun while a scripted scheduler
# resizes the job through morphctl: 4 workers, grow to 6, shrink to 3, a SIGTERM (preemption)
# to one worker, grow to 4, a SIGKILL to another; shows a live progress line, then a summary
# table, and draws OUT/loss.png (gnuplot).
#
#   bash scripts/demo.sh                 # BUILD_DIR=build, OUT=$BUILD_DIR/demo
#   DEMO_SHORT=1 bash scripts/demo.sh    # the CI form: fewer steps, same events but the grow back
#
# Environment: BUILD_DIR (a configured and built morph tree; the script installs it into
# $BUILD_DIR/demo-prefix and builds examples/gpt against that prefix, as a user's project would),
# OUT (results), DEMO_STEPS, DEMO_KILL (0: no SIGKILL; the tp change instead), DEMO_SKIP_BUILD=1 (use
# $BUILD_DIR/examples/gpt/gpt as it is). Exit status: morphrun's, or 1 when a check failed.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
BUILD_DIR=${BUILD_DIR:-build}
case $BUILD_DIR in /*) ;; *) BUILD_DIR=$here/$BUILD_DIR ;; esac
OUT=${OUT:-$BUILD_DIR/demo}
SHORT=${DEMO_SHORT:-0}
# DEMO_KILL=0: no SIGKILL, plain ZeRO-1 under a memory budget (the planner changes tp instead).
KILL=${DEMO_KILL:-1}
if [ "$SHORT" = 1 ]; then STEPS=${DEMO_STEPS:-80}; else STEPS=${DEMO_STEPS:-300}; fi
# Room for the fifth event: the old generation trains on while a change is prepared, so a slow
# change (joiners starting on a loaded machine) uses steps too; at 150 a loaded run once ended
# before the SIGKILL.
[ "$SHORT" = 1 ] && [ "$KILL" = 1 ] && STEPS=${DEMO_STEPS:-220}
# Steps between the scheduler's events (after the previous change landed).
EVENT_STEPS=$((STEPS / 8))
[ "$SHORT" = 1 ] && EVENT_STEPS=$((STEPS < 150 ? STEPS / 8 : 18))
JOBS=${JOBS:-2}
say() { printf '%s\n' "demo: $*" >&2; }
die() { say "$*"; exit 1; }

# --- build: morph installed into a prefix, examples/gpt built against it with find_package ---
prefix=$BUILD_DIR/demo-prefix
gpt_build=$BUILD_DIR/gpt-standalone
if [ "${DEMO_SKIP_BUILD:-0}" = 1 ]; then
  GPT=$BUILD_DIR/examples/gpt/gpt
  BIN=$BUILD_DIR/runtime
else
  gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  say "building morph ($BUILD_DIR) and installing it into $prefix"
  # What the install copies (libraries, morphrun, morphctl, morphd; no tests or benchmarks).
  cmake --build "$BUILD_DIR" -j "$JOBS" --target morph_installables >"$BUILD_DIR/demo-build.log" 2>&1 ||
    { tail -30 "$BUILD_DIR/demo-build.log"; die "build failed (log: $BUILD_DIR/demo-build.log)"; }
  cmake --install "$BUILD_DIR" --prefix "$prefix" >"$BUILD_DIR/demo-install.log" 2>&1 ||
    { tail -30 "$BUILD_DIR/demo-install.log"; die "install failed"; }
  say "building examples/gpt against the installed morph ($gpt_build)"
  launcher=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  cmake -S "$here/examples/gpt" -B "$gpt_build" "${gen[@]}" "${launcher[@]}" \
    -DCMAKE_PREFIX_PATH="$prefix" -DBUILD_TESTING=OFF \
    >"$BUILD_DIR/demo-gpt.log" 2>&1 &&
    cmake --build "$gpt_build" -j "$JOBS" >>"$BUILD_DIR/demo-gpt.log" 2>&1 ||
    { tail -30 "$BUILD_DIR/demo-gpt.log"; die "examples/gpt did not build against $prefix"; }
  GPT=$gpt_build/gpt
  BIN=$prefix/bin
fi
[ -x "$GPT" ] || die "no $GPT"
[ -x "$BIN/morphrun" ] && [ -x "$BIN/morphctl" ] || die "no morphrun/morphctl in $BIN"

# --- run ---
rm -rf "$OUT"
mkdir -p "$OUT/logs"
export MORPH_TOKEN=${MORPH_TOKEN:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}
export OPENBLAS_NUM_THREADS=1
# 4 layers, 4 heads, width 64, 32-byte sequences, 16 sequences per step. The per-rank memory
# budget makes 2 workers too few for dp=2 (ZeRO's moments shard over dp): the planner then
# changes tp/pp (docs: examples/gpt/README.md).
GPT_ARGS=(--steps "$STEPS" --out "$OUT" --quiet --device-memory "${DEMO_MEMORY:-1620000}")
# With the SIGKILL: plain ZeRO-1 keeps one copy of each moment range, which a killed worker takes
# with it (the runtime's snapshots and checkpoints are declared, not built yet); hybrid ZeRO in
# groups of 2 keeps dp / 2 copies, and the planner then keeps dp even (no memory budget: the
# run shows dp changes and a recovery instead of the tp change).
[ "$KILL" = 1 ] && GPT_ARGS=(--steps "$STEPS" --out "$OUT" --quiet --zero-group 2)
start=$(date +%s.%N)
"$BIN/morphrun" -n 4 --max 8 --log-dir "$OUT/logs" -- "$GPT" "${GPT_ARGS[@]}" \
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
ctl() { "$BIN/morphctl" --addr "$api" "$@" >>"$OUT/scheduler.log" 2>&1; }

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
wait_change() {  # until a step of a generation after $1, or $2 more steps (a spare left: no change)
  local s0
  s0=$(last_step)
  for _ in $(seq 600); do
    g=$(gen_now)
    [ -n "$g" ] && [ "$g" -gt "$1" ] && return 0
    s=$(last_step)
    [ -n "$s" ] && [ -n "$s0" ] && [ "$s" -ge $((s0 + $2)) ] && return 0
    kill -0 "$run_pid" 2>/dev/null || return 1
    sleep 0.2
  done
  return 1
}
victim() {  # a live member's pid: the newest pid file (members touch theirs every step)
  for f in $(ls -t "$OUT/pids" 2>/dev/null); do
    if kill -0 "$f" 2>/dev/null; then echo "$f"; return; fi
  done
}
event() { printf '%s\n' "$*" >>"$OUT/scheduler.tsv"; say "scheduler: $*"; }

scheduler() {
  local f=$EVENT_STEPS
  local g
  wait_step "$f" && g=$(gen_now) && event "step $(last_step): morphctl resize 6" &&
    ctl resize 6 --reason "grow" && wait_change "$g" "$f" &&
    wait_step $(($(last_step) + f)) && g=$(gen_now) && event "step $(last_step): morphctl resize 3" &&
    ctl resize 3 --reason "shrink" && wait_change "$g" "$f" &&
    wait_step $(($(last_step) + f)) && v=$(victim) && g=$(gen_now) &&
    event "step $(last_step): SIGTERM to worker pid $v (preemption)" && kill -TERM "$v" &&
    wait_change "$g" "$f" &&
    wait_step $(($(last_step) + f)) && g=$(gen_now) && event "step $(last_step): morphctl resize 4" &&
    ctl resize 4 --reason "grow back" && wait_change "$g" "$f" || return 0
  if [ "$KILL" = 1 ]; then
    wait_step $(($(last_step) + f)) && v=$(victim) &&
      event "step $(last_step): SIGKILL to worker pid $v (failure)" && kill -KILL "$v" || true
  fi
}
scheduler &
sched_pid=$!

# Live line: the newest step; each reconfiguration on its own line as it lands.
tty=0
[ -t 1 ] && tty=1
shown_events=0
shown_step=-1
show() {
  if [ -f "$OUT/events.tsv" ]; then
    local n
    n=$(wc -l <"$OUT/events.tsv")
    if [ "$n" -gt "$shown_events" ]; then
      [ $tty = 1 ] && printf '\n'
      tail -n +$((shown_events + 1)) "$OUT/events.tsv" | awk -F'\t' '{
        printf "  reconfiguration at step %d: generation %d -> %d, world %d -> %d, %s -> %s%s; communicators %.1f ms, plan %.1f ms, transfer %.1f ms, resume %.1f ms, stall %.1f ms\n",
          $1, $2, $3, $4, $5, $6, $7, ($8 == 1 ? " (recovery, " $9 " steps lost)" : ""), $10, $11, $12, $13, $14 }'
      shown_events=$n
    fi
  fi
  local l
  l=$(tail -n 1 "$OUT/metrics.tsv" 2>/dev/null) || return 0
  [ -n "$l" ] || return 0
  local s=${l%%$'\t'*}
  [ "$s" = "$shown_step" ] && return 0
  shown_step=$s
  line=$(printf '%s\n' "$l" | awk -F'\t' '{ printf "step %4d  loss %.4f  %6.0f tok/s  world %d  dp=%d tp=%d pp=%d  generation %d", $1, $2, $9, $3, $4, $5, $6, $7 }')
  if [ $tty = 1 ]; then printf '\r\033[K%s' "$line"; elif [ $((s % 10)) = 0 ]; then printf '%s\n' "$line"; fi
}
while kill -0 "$run_pid" 2>/dev/null; do
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
if [ "$rc" = 137 ] && [ "$KILL" = 1 ] && grep -q "the job completed" "$OUT/morphrun.log"; then
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

# --- summary ---
printf '\nsummary (%s s wall, morphrun exit %d)\n' "$wall" "$rc"
awk -F'\t' '
  { last[$1 + 0] = $0; if ($1 + 0 > max) max = $1 + 0 }
  function emit() {
    printf "%-12s %-6d %-16s %-6d %.3f -> %-8.3f %-10.0f %-10.1f\n", first "-" lastst, w, cfg, g, lf, ll, tk / cnt, ms / cnt
  }
  END {
    printf "%-12s %-6s %-16s %-6s %-18s %-10s %-10s\n", "steps", "world", "config", "gen", "loss first->last", "tok/s", "ms/step"
    g = ""
    for (s = 0; s <= max; ++s) {
      if (!(s in last)) continue
      split(last[s], f, "\t")
      if (f[7] != g) {
        if (g != "") emit()
        g = f[7]; first = f[1]; lf = f[2]; tk = 0; ms = 0; cnt = 0
        w = f[3]; cfg = "dp=" f[4] " tp=" f[5] " pp=" f[6]
      }
      lastst = f[1]; ll = f[2]; tk += f[9]; ms += f[8]; cnt++
    }
    if (g != "") emit()
  }' "$OUT/metrics.tsv"
if [ -s "$OUT/events.tsv" ]; then
  printf '\n%-6s %-9s %-7s %-22s %-9s %-8s %-8s %-9s %-8s %-8s\n' step gen world config recovery comm_ms plan_ms transfer resume stall_ms
  awk -F'\t' '{ printf "%-6d %d->%-6d %d->%-4d %-22s %-9s %-8.1f %-8.1f %-9.1f %-8.1f %-8.1f\n",
    $1, $2, $3, $4, $5, $6 "->" $7, ($8 == 1 ? "yes" : "no"), $10, $11, $12, $13, $14 }' "$OUT/events.tsv"
fi
first_loss=$(head -n 1 "$OUT/metrics.tsv" | cut -f2)
last_loss=$(tail -n 1 "$OUT/metrics.tsv" | cut -f2)
printf '\nloss %s -> %s over %s steps\n' "$first_loss" "$last_loss" "$(last_step)"
[ -f "$OUT/scheduler.tsv" ] && { printf 'scheduler:\n'; sed 's/^/  /' "$OUT/scheduler.tsv"; }

# --- plot ---
if command -v gnuplot >/dev/null; then
  # A step trained again after a recovery keeps its last value.
  awk -F'\t' '{ last[$1 + 0] = $0; if ($1 + 0 > max) max = $1 + 0 }
    END { for (s = 0; s <= max; ++s) if (s in last) print last[s] }' "$OUT/metrics.tsv" \
    >"$OUT/plot.tsv"
  : >"$OUT/reconf.tsv"
  [ -s "$OUT/events.tsv" ] && cut -f1,5,7 "$OUT/events.tsv" >"$OUT/reconf.tsv"
  {
    echo "set terminal pngcairo size 1100,600 noenhanced"
    echo "set output '$OUT/loss.png'"
    echo "set title 'examples/gpt under morph: loss, world size and reconfigurations'"
    echo "set xlabel 'step'; set ylabel 'loss (nats/byte)'; set y2label 'world size'"
    echo "set y2range [0:8]; set y2tics 1; set ytics nomirror; set grid"
    i=0
    while IFS=$'\t' read -r s w cfg; do
      i=$((i + 1))
      echo "set arrow $i from $s, graph 0 to $s, graph 1 nohead dt 2 lc rgb 'gray40'"
      echo "set label $i '$cfg' at $s, graph 0.97 rotate by 90 right font ',8'"
    done <"$OUT/reconf.tsv"
    echo "plot '$OUT/plot.tsv' using 1:2 with lines lw 2 title 'loss', \\"
    echo "     '' using 1:3 axes x1y2 with steps lw 2 title 'world size'"
  } >"$OUT/loss.gp"
  gnuplot "$OUT/loss.gp" 2>"$OUT/gnuplot.log" || say "gnuplot failed: $(cat "$OUT/gnuplot.log")"
  [ -s "$OUT/loss.png" ] && printf 'plot: %s\n' "$OUT/loss.png"
else
  say "gnuplot not installed: no plot (bash scripts/install-deps.sh)"
fi
printf 'demo wall time %s s\n' "$wall"
exit "$rc"
