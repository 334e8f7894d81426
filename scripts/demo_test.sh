#!/usr/bin/env bash
# ctest gpt_demo_test and torch_demo_test: `make demo` (`make demo-torch`) in its short form
# (DEMO_SHORT=1) on this build tree. It must exit 0, install morph, build the example against the
# installed prefix only (gpt: examples/gpt with find_package; torch: `pip install ./python`, whose
# extension must load the prefix's libmorph), and draw a valid PNG; and its outputs must show
# every kind of change the demo is for, in one run:
#   - the scheduler's four actions (morphctl resize, SIGTERM, SIGKILL, morphctl resize);
#   - reconfigurations that change dp, tp and pp (each at least once; torch: dp, and tp or pp);
#   - a preemption: the SIGTERMed worker left with exit 0 and the change that followed is one;
#   - a kill and its recovery: the SIGKILLed worker died (137) and the next change is a recovery;
#   - a standby spare, in the coordinator's view and on the live line ("+ 1 spare"; gpt only:
#     the torch demo's 6 workers never exceed what the planner uses);
#   - the loss going down across all of it: no change makes it jump back up (by more than 0.3
#     nats per byte over 5 steps; torch 0.6: its 24-sequence batches are noisier), and it ends
#     well below where it was before the first change.
#   demo_test.sh <source-dir> <build-dir> [gpt|torch]
set -euo pipefail
src=$1
build=$2
program=${3:-gpt}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fail() { echo "${program}_demo_test: $*" >&2; exit 1; }
set +e
DEMO_SHORT=1 DEMO_PROGRAM=$program BUILD_DIR=$build OUT=$out/demo bash "$src/scripts/demo.sh" \
  >"$out/demo.log" 2>&1
rc=$?
set -e
cat "$out/demo.log"
[ "$rc" = 0 ] || fail "make demo (short, $program) exited $rc"
if [ "$program" = gpt ]; then
  # The example built as a user's program: only the installed prefix on its include path.
  cc=$build/gpt-standalone/compile_commands.json
  [ -f "$cc" ] || fail "no $cc (the example was not built against the installed prefix)"
  bad=$(grep -oE -- "(-I|-isystem )[^ ]+" "$cc" | sed -E 's/^(-I|-isystem )//' | sort -u |
    grep -v "^$build/demo-prefix" | grep -E "^($src|$build)" || true)
  [ -z "$bad" ] || fail "the standalone example used the source or build tree: $bad"
  changed=(dp tp pp)
  jump=0.3
else
  # The package pip built: its extension resolves libmorph in the installed prefix.
  ext=$(ls "$build"/demo-python/morph/_morph*.so 2>/dev/null | head -n 1)
  [ -n "$ext" ] || fail "no pip-installed extension under $build/demo-python/morph"
  lib=$(ldd "$ext" | awk '$1 ~ /^libmorph\.so/ { print $3 }')
  case $lib in "$build"/demo-prefix/lib/*) ;; *) fail "$ext loads libmorph from '$lib', not the prefix" ;; esac
  changed=(dp tp+pp)
  jump=0.6
fi
d=$out/demo
png=$d/loss.png
[ -s "$png" ] || fail "no plot at $png"
magic=$(head -c 8 "$png" | od -An -tx1 | tr -d ' \n')
[ "$magic" = 89504e470d0a1a0a ] || fail "$png is not a PNG (magic $magic)"
grep -q "summary (" "$out/demo.log" || fail "no summary table"

# The scheduler acted four times, in order (scheduler.tsv: generation, kind, step, what).
kinds=$(cut -f2 "$d/scheduler.tsv" | tr '\n' ' ')
[ "$kinds" = "resize preemption kill resize " ] || fail "the scheduler's actions were: $kinds"
# changes.tsv: events.tsv with the kind first: kind, step, from/to generation, from/to world,
# from/to config (dp4tp2pp1), recovery, steps trained again, ...
n=$(wc -l <"$d/changes.tsv")
[ "$n" = 4 ] || fail "$n reconfigurations (want 4: one per scheduler action)"
for what in "${changed[@]}"; do  # "tp+pp": tp or pp
  awk -F'\t' -v w="$what" '
    function get(c, k) { match(c, k "[0-9]+"); return substr(c, RSTART + length(k), RLENGTH - length(k)) }
    { n = split(w, ks, "+"); for (i = 1; i <= n; ++i) if (get($7, ks[i]) != get($8, ks[i])) f = 1 }
    END { exit !f }' "$d/changes.tsv" ||
    fail "no reconfiguration changed $what: $(cut -f1,7,8 "$d/changes.tsv" | tr '\n' ' ')"
done
# Each action caused the change out of the generation it was taken in, of its kind.
while IFS=$'\t' read -r g kind step what; do
  want=$kind
  [ "$kind" = kill ] && want=recovery
  got=$(awk -F'\t' -v g="$g" '$3 == g { print $1 }' "$d/changes.tsv")
  [ "$got" = "$want" ] || fail "after '$what' at step $step (generation $g): a change of kind '$got', want '$want'"
done <"$d/scheduler.tsv"
exit_of() {  # morphrun's line for a worker pid: its exit status
  sed -n "s/.*(pid $1) exited with \([0-9]*\).*/\1/p" "$d/morphrun.log" | head -n 1
}
term=$(awk -F'\t' '$2 == "preemption"' "$d/scheduler.tsv" | grep -oE 'pid [0-9]+' | cut -d' ' -f2)
[ "$(exit_of "$term")" = 0 ] || fail "the preempted worker (pid $term) did not leave with exit 0"
killed=$(awk -F'\t' '$2 == "kill"' "$d/scheduler.tsv" | grep -oE 'pid [0-9]+' | cut -d' ' -f2)
[ "$(exit_of "$killed")" = 137 ] || fail "the SIGKILLed worker (pid $killed) did not die of it"
awk -F'\t' '$1 == "recovery" && $9 == 1 { f = 1 } END { exit !f }' "$d/changes.tsv" ||
  fail "no recovery in events.tsv"
# Spares: the coordinator showed a standby one while stable, and the live line said so.
if [ "$program" = gpt ]; then
  awk -F'\t' '$2 > 0 { f = 1 } END { exit !f }' "$d/generations.tsv" ||
    fail "no generation had a standby spare (generations.tsv)"
  grep -qE "^step +[0-9]+ .* world [0-9]+ \(dp[0-9]+ tp[0-9]+ pp[0-9]+\) \+ 1 spare " "$out/demo.log" ||
    fail "no live line showed the spare"
fi
# The loss: the mean of 5 steps after each change at most 0.3 above the 5 before it (a wrong
# reshard sends it back towards 5.5), and the last 10 steps at least 0.3 below the 10 before the
# first change.
awk -F'\t' -v jump="$jump" 'FILENAME == ARGV[1] { at[++nc] = $2; next }
  { loss[$1 + 0] = $2; if ($1 + 0 > max) max = $1 + 0 }
  function mean(a, b,  s, n, i) { for (i = a; i < b; ++i) if (i in loss) { s += loss[i]; n++ }
    return n ? s / n : -1 }
  END {
    for (c = 1; c <= nc; ++c) {
      before = mean(at[c] - 5, at[c]); after = mean(at[c], at[c] + 5)
      if (before < 0 || after < 0 || after > before + jump) {
        printf "loss around the change at step %d: %.3f before, %.3f after\n", at[c], before, after; bad = 1 }
    }
    first = mean(at[1] - 10, at[1]); last = mean(max - 9, max + 1)
    if (!(last < first - 0.3)) { printf "loss %.3f before the first change, %.3f at the end\n", first, last; bad = 1 }
    exit bad
  }' "$d/changes.tsv" "$d/metrics.tsv" || fail "the loss did not keep going down"
echo "${program}_demo_test: passed ($n reconfigurations: $(cut -f1 "$d/changes.tsv" | tr '\n' ' ')plot $(stat -c %s "$png") bytes)"
