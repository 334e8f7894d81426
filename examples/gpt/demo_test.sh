#!/usr/bin/env bash
# ctest gpt_demo_test: `make demo` in its short form (DEMO_SHORT=1) on this build tree: it must
# exit 0, install morph, build examples/gpt against the installed prefix, go through every
# scheduled event, and draw a valid PNG of nonzero size.
#   demo_test.sh <source-dir> <build-dir>
set -euo pipefail
src=$1
build=$2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fail() { echo "gpt_demo_test: $*" >&2; exit 1; }
set +e
DEMO_SHORT=1 BUILD_DIR=$build OUT=$out/demo bash "$src/scripts/demo.sh" >"$out/demo.log" 2>&1
rc=$?
set -e
cat "$out/demo.log"
[ "$rc" = 0 ] || fail "make demo (short) exited $rc"
# The example built as a user's program: only the installed prefix on its include path.
cc=$build/gpt-standalone/compile_commands.json
[ -f "$cc" ] || fail "no $cc (the example was not built against the installed prefix)"
bad=$(grep -oE -- "(-I|-isystem )[^ ]+" "$cc" | sed -E 's/^(-I|-isystem )//' | sort -u |
  grep -v "^$build/demo-prefix" | grep -E "^($src|$build)" || true)
[ -z "$bad" ] || fail "the standalone example used the source or build tree: $bad"
png=$out/demo/loss.png
[ -s "$png" ] || fail "no plot at $png"
magic=$(head -c 8 "$png" | od -An -tx1 | tr -d ' \n')
[ "$magic" = 89504e470d0a1a0a ] || fail "$png is not a PNG (magic $magic)"
grep -q "summary (" "$out/demo.log" || fail "no summary table"
n=$(wc -l <"$out/demo/events.tsv")
[ "$n" -ge 4 ] || fail "only $n reconfigurations (want grow, shrink, preemption, grow back)"
if [ "${DEMO_KILL:-1}" = 1 ]; then
  awk -F'\t' '$8 == 1 { found = 1 } END { exit !found }' "$out/demo/events.tsv" ||
    fail "the SIGKILL was not followed by a recovery"
fi
echo "gpt_demo_test: passed ($n reconfigurations, plot $(stat -c %s "$png") bytes)"
