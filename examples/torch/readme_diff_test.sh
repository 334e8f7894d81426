#!/usr/bin/env bash
# README.md shows `diff -u train_plain.py train.py` and counts its changed lines; this checks both
# against the files as they are (ctest torch_train_readme_diff_test), so the README cannot go
# stale. The block sits between the lines "<!-- diff: begin -->" and "<!-- diff: end -->", inside
# a ```diff fence; the count is the line "... N lines change ..." just before it.
#   readme_diff_test.sh            (in any directory)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
fail() { echo "torch_train_readme_diff_test: $*" >&2; exit 1; }
want=$(cd "$here" && diff -u --label train_plain.py --label train.py train_plain.py train.py || true)
[ -n "$want" ] || fail "train_plain.py and train.py are the same"
shown=$(awk '/^<!-- diff: end -->/ { on = 0 } on && !/^```/ { print } /^<!-- diff: begin -->/ { on = 1 }' \
  "$here/README.md")
[ -n "$shown" ] || fail "README.md has no diff block between <!-- diff: begin --> and <!-- diff: end -->"
if [ "$shown" != "$want" ]; then
  diff <(echo "$shown") <(echo "$want") >&2 || true
  fail "README.md's diff (<) is not diff -u train_plain.py train.py (>): paste the new one"
fi
n=$(echo "$want" | grep -c '^[-+]\([^-+]\|$\)' || true)
said=$(sed -n 's/.* \([0-9][0-9]*\) lines change.*/\1/p' "$here/README.md" | head -n 1)
[ "$said" = "$n" ] || fail "README.md says ${said:-no number of} lines change, the diff changes $n"
echo "torch_train_readme_diff_test: passed ($n changed lines)"
