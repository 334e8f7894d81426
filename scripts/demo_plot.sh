#!/usr/bin/env bash
# The demo's plot (scripts/demo.sh runs it): OUT/loss.png from the run's files in OUT:
# metrics.tsv (the example's, one line per step), changes.tsv (events.tsv with each change's kind
# first: resize, preemption, recovery), generations.tsv (generation, standby spares) and
# scheduler.tsv (the scheduler's actions; its SIGKILLs are marked on the loss curve).
#
#   bash scripts/demo_plot.sh OUT
# DEMO_TITLE: the program named in the title (default examples/gpt).
#
# The loss on the left axis; the world (ranks) and the workers (ranks + standby spares) on the
# right; each reconfiguration a dashed line in its kind's colour, labelled with the new config.
set -euo pipefail
OUT=$1
# A step trained again after a recovery keeps its last value; workers = world + spares.
awk -F'\t' 'FILENAME == ARGV[1] { sp[$1] = $2; next }
  { last[$1 + 0] = $0; if ($1 + 0 > max) max = $1 + 0 }
  END { for (s = 0; s <= max; ++s) if (s in last) {
          split(last[s], f, "\t"); print f[1] "\t" f[2] "\t" f[3] "\t" f[3] + sp[f[7]] } }' \
  <(cat "$OUT/generations.tsv" 2>/dev/null || true) "$OUT/metrics.tsv" \
  >"$OUT/plot.tsv"
# The SIGKILLs: the step the scheduler acted at, and the loss there.
awk -F'\t' 'FILENAME == ARGV[1] { if ($2 == "kill") k[$3] = 1; next }
  ($1 in k) { print $1 "\t" $2 }' \
  <(cat "$OUT/scheduler.tsv" 2>/dev/null || true) "$OUT/plot.tsv" \
  >"$OUT/kills.tsv"
last=$(tail -n 1 "$OUT/plot.tsv" | cut -f1)
color() {
  case $1 in
    resize) echo '#1f77b4' ;;
    preemption) echo '#ff7f0e' ;;
    recovery) echo '#d62728' ;;
    *) echo '#7f7f7f' ;;
  esac
}
{
  echo "set terminal pngcairo size 1200,650 noenhanced font ',10'"
  echo "set output '$OUT/loss.png'"
  echo "set title '${DEMO_TITLE:-examples/gpt} under morph: loss, workers and reconfigurations (by kind)'"
  echo "set xlabel 'step' offset 0, 0.5; set ylabel 'loss (nats/byte)'; set y2label 'workers'"
  echo "set xrange [0:$last]; set y2range [0:12]; set y2tics 0, 1, 8; set ytics nomirror; set grid"
  echo "set key at screen 0.5, screen 0.01 center bottom horizontal Left reverse spacing 1.2 width 2 maxrows 3"
  echo "set bmargin 7"
  i=0
  declare -A seen=()
  if [ -s "$OUT/changes.tsv" ]; then
    while IFS=$'\t' read -r kind s _ g _ _ _ cfg _; do
      i=$((i + 1))
      c=$(color "$kind")
      seen[$kind]=1
      sp=$(awk -F'\t' -v g="$g" '$1 == g && $2 > 0 { printf " +%d spare%s", $2, ($2 > 1 ? "s" : "") }' \
        "$OUT/generations.tsv" 2>/dev/null || true)
      label=$(sed -E 's/([0-9]+)/\1 /g; s/ $//' <<<"$cfg")
      echo "set arrow $i from $s, graph 0 to $s, graph 1 nohead dt 2 lw 2 lc rgb '$c' front"
      echo "set label $i '$label$sp' at $s, graph 0.98 rotate by 90 right offset -1.5, 0 font ',9' tc rgb '$c' front"
    done <"$OUT/changes.tsv"
  fi
  printf '%s' "plot '$OUT/plot.tsv' using 1:2 with lines lw 2 lc rgb 'black' title 'loss'"
  printf '%s' ", '' using 1:3 axes x1y2 with steps lw 2 lc rgb '#2ca02c' title 'world (ranks training)'"
  printf '%s' ", '' using 1:4 axes x1y2 with steps lw 2 dt 3 lc rgb '#9467bd' title 'workers (ranks + spares)'"
  for k in resize preemption recovery; do
    [ -n "${seen[$k]:-}" ] || continue
    case $k in
      resize) t='resize (morphctl resize N)' ;;
      preemption) t='preemption (SIGTERM): graceful leave' ;;
      recovery) t='recovery after a failure' ;;
    esac
    printf '%s' ", NaN with lines dt 2 lw 2 lc rgb '$(color "$k")' title '$t'"
  done
  if [ -s "$OUT/kills.tsv" ]; then
    printf '%s' ", '$OUT/kills.tsv' using 1:2 with points pt 2 ps 2.5 lw 2 lc rgb '#d62728' title 'SIGKILL (failure)'"
  fi
  printf '\n'
} >"$OUT/loss.gp"
gnuplot "$OUT/loss.gp" 2>"$OUT/gnuplot.log"
