#!/usr/bin/env bash
# The failure soak (`make soak`, issue 10): failure_test's seeded SIGKILL trials for many seeds,
# one process per seed (MORPH_TEST_SEED=<seed>), so that one failing or hanging seed neither
# stops the others nor hides which one it was. Not part of `make test` (CI runs 20 seeds).
#
#   bash scripts/soak.sh BUILD_DIR        SOAK_TRIALS (200), SOAK_FIRST_SEED (1),
#                                         SOAK_SEED_TIMEOUT_S (300), SOAK_FILTER (FailureTest.Seeded*)
#
# Each seed runs every test SOAK_FILTER selects (the seeded tests read MORPH_TEST_SEED). A failing
# seed's output is kept in BUILD_DIR/soak/seed-<seed>.log; a seed still running after
# SOAK_SEED_TIMEOUT_S is killed and counted as failed (a hang). The last line is a JSON summary:
#   {"name":"failure_soak","trials":200,"passed":200,"failed_seeds":[],"seconds":...}
# Exit status: 0 when every seed passed, 1 otherwise, 2 for a usage error.
set -uo pipefail

build="${1:-build}"
trials="${SOAK_TRIALS:-200}"
first="${SOAK_FIRST_SEED:-1}"
seed_timeout="${SOAK_SEED_TIMEOUT_S:-300}"
filter="${SOAK_FILTER:-FailureTest.Seeded*}"
bin="$build/runtime/failure_test"

for v in "$trials" "$first" "$seed_timeout"; do
  if ! [[ "$v" =~ ^[0-9]+$ ]]; then
    echo "soak: SOAK_TRIALS, SOAK_FIRST_SEED and SOAK_SEED_TIMEOUT_S need whole numbers, got '$v'" >&2
    exit 2
  fi
done
if [ ! -x "$bin" ]; then
  echo "soak: $bin not built (cmake --build $build --target failure_test elastic_worker)" >&2
  exit 2
fi
mkdir -p "$build/soak"

passed=0
failed=()
start=$(date +%s.%N)
for ((i = 0; i < trials; i++)); do
  seed=$((first + i))
  log="$build/soak/seed-$seed.log"
  t0=$(date +%s.%N)
  # --kill-after: a trial stuck in cleanup is killed too; failure_test's own children are in its
  # Launcher's care (killed when it dies), and the test removes its temporary folders.
  MORPH_TEST_SEED=$seed timeout --kill-after=20 "$seed_timeout" \
    "$bin" --gtest_filter="$filter" >"$log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  if [ $rc -eq 0 ] && grep -q '^\[  PASSED  \]' "$log"; then
    passed=$((passed + 1))
    rm -f "$log"
    echo "soak: seed $seed passed (${secs} s) [$passed/$((i + 1))]"
  else
    why="exit $rc"
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && why="still running after ${seed_timeout} s (killed)"
    tests=$(grep -o '^\[  FAILED  \] [A-Za-z_.][A-Za-z_.]*' "$log" | sort -u | awk '{print $4}' | paste -sd, -)
    failed+=("$seed")
    echo "soak: seed $seed FAILED: $why${tests:+ in $tests} (${secs} s); log: $log"
  fi
done
end=$(date +%s.%N)
list=$(IFS=,; echo "${failed[*]:-}")
secs=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
echo "soak: $passed of $trials seeds passed (seeds $first..$((first + trials - 1)))${list:+; failed: $list}"
echo "{\"name\":\"failure_soak\",\"trials\":$trials,\"passed\":$passed,\"failed_seeds\":[${list}],\"first_seed\":$first,\"seconds\":$secs}"
[ "$passed" -eq "$trials" ]
