# Checks shared by the examples' elastic tests (examples/gpt/elastic_test.sh,
# examples/torch/elastic_test.sh): sourced; the caller defines fail() (prints, exits 1). Both
# examples write DIR/metrics.tsv (step, loss, world, dp, tp, pp, generation, ...) on world rank 0
# and DIR/events.tsv (step, generations, worlds, configs, recovery, ...) per reconfiguration.

# elastic_seen_configs DIR: the first configuration and every one reconfigured to ("dp2tp1pp1 ...").
elastic_seen_configs() {
  printf '%s %s' "$(head -n 1 "$1/metrics.tsv" | awk -F'\t' '{ print "dp" $4 "tp" $5 "pp" $6 }')" \
    "$(cut -f7 "$1/events.tsv" | tr '\n' ' ')"
}

# elastic_check_configs DIR WANT...: every configuration in WANT was reached.
elastic_check_configs() {
  local dir=$1 seen w
  shift
  seen=$(elastic_seen_configs "$dir")
  for w in "$@"; do
    case " $seen " in *" $w "*) ;; *) fail "configuration $w not reached (saw: $seen)" ;; esac
  done
}

# elastic_check_recovery DIR: some reconfiguration was a recovery.
elastic_check_recovery() {
  awk -F'\t' '$8 == 1 { found = 1 } END { exit !found }' "$1/events.tsv" ||
    fail "no recovery among the reconfigurations: $(cat "$1/events.tsv")"
}

# elastic_check_loss REF_DIR DIR TOL KILLED: the loss of every step of DIR equals REF_DIR's (a
# fixed-configuration run with the same seed and global batch) within TOL (absolute; a step
# trained again after a recovery: its last value), and REF_DIR's loss went down by 0.5. With
# KILLED=1: world rank 0 logs a step after its update; when the SIGKILL hits rank 0 between its
# update and that line while the survivors completed the step too, the recovery resumes after
# it and nobody logs it: only the step just before the recovery's may be missing.
elastic_check_loss() {
  local ref=$1 dir=$2 tol=$3 unlogged=-1 first last
  [ "$4" = 1 ] && unlogged=$(awk -F'\t' '$8 == 1 { print $1 - 1; exit }' "$dir/events.tsv")
  awk -F'\t' -v tol="$tol" -v unlogged="$unlogged" '
    NR == FNR { ref[$1] = $2; next }
    { got[$1] = $2 }
    END {
      n = 0; worst = 0
      for (s in ref) {
        if (!(s in got) && s + 0 == unlogged + 0) continue
        if (!(s in got)) { printf "step %s missing from the elastic run\n", s; exit 1 }
        d = got[s] - ref[s]; if (d < 0) d = -d
        if (d > worst) worst = d
        if (d > tol) { printf "step %s: loss %s, reference %s (|diff| %g > %g)\n", s, got[s], ref[s], d, tol; exit 1 }
        n++
      }
      printf "%d steps match the reference, largest |diff| %g\n", n, worst
    }' "$ref/metrics.tsv" "$dir/metrics.tsv" || fail "loss differs from the reference"
  first=$(head -n 1 "$ref/metrics.tsv" | cut -f2)
  last=$(tail -n 1 "$ref/metrics.tsv" | cut -f2)
  awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.5) }' ||
    fail "the loss did not go down: $first -> $last"
  ELASTIC_LOSS="$first -> $last"
}
