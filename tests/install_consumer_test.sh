#!/usr/bin/env bash
# Installs the build tree into a temporary prefix, then builds and runs tests/consumer against
# it with find_package(morph). Usage: install_consumer_test.sh <build-dir> <source-dir>
set -euo pipefail
build=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >"$tmp/install.log" 2>&1 || {
  cat "$tmp/install.log"; exit 1; }
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$src/tests/consumer" -B "$tmp/build" "${gen[@]}" -DCMAKE_PREFIX_PATH="$tmp/prefix" \
  -DCMAKE_CXX_COMPILER="${CXX:-c++}" >"$tmp/configure.log" 2>&1 || { cat "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/build" >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }
# The installed headers must be self-sufficient: nothing may be found from the source tree.
if grep -q -- "-I$src" "$tmp/build.log"; then echo "consumer build used the source tree"; exit 1; fi
"$tmp/build/consumer"
