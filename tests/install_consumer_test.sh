#!/usr/bin/env bash
# Installs the build tree into a temporary prefix, checks that it holds only the public surface,
# then builds and runs tests/consumer against it with find_package(morph).
# Usage: install_consumer_test.sh <build-dir> <source-dir>
set -euo pipefail
build=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
fail() { echo "install_consumer_test: $*" >&2; exit 1; }
cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" 2>&1 || {
  cat "$tmp/install.log"; exit 1; }
inc=$prefix/include
[ -f "$inc/morph/base/status.h" ] || fail "no include/morph/base/status.h installed"

# Not public: test helpers (gmock), the in-process transport, backend internals.
for h in base/testing.h base/test_main.h reshard/inproc_transport.h reshard/cuda_pack.h \
         reshard/plan_testutil.h reshard/reshard_testutil.h collectives/gloo_algorithms.h \
         collectives/gloo_support.h collectives/gloo_errors.h collectives/rank_harness.h \
         collectives/collective_checks.h; do
  [ ! -e "$inc/morph/$h" ] || fail "installed a header that is not public: include/morph/$h"
done
# Nor reachable from what is installed: no test framework, JSON library or Gloo in a public
# header, and morph's headers include each other as <morph/...> (nothing else on the path).
if grep -rnE '^\s*#\s*include\s*[<"](gmock|gtest|nlohmann|gloo)/' "$inc"; then
  fail "an installed header includes gmock/gtest/nlohmann/gloo (lines above)"
fi
if grep -rnE '^\s*#\s*include\s*[<"](inproc_transport|cuda_pack|testing)\.h' "$inc"; then
  fail "an installed header includes a header that is not public (lines above)"
fi
if grep -rnE '^\s*#\s*include\s*"(base|collectives|reshard|runtime)/' "$inc"; then
  fail "an installed header includes a morph header without the morph/ prefix (lines above)"
fi

gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$src/tests/consumer" -B "$tmp/build" "${gen[@]}" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_CXX_COMPILER="${CXX:-c++}" >"$tmp/configure.log" 2>&1 || { cat "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/build" >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }
# The installed headers must be self-sufficient: the consumer's compile lines name the prefix's
# include/ and nothing of the source or build tree, and not include/morph (consumers write
# <morph/...> only).
cc=$tmp/build/compile_commands.json
[ -f "$cc" ] || fail "no compile_commands.json"
if grep -qE -- "-I(system )?$src|-isystem $src|$build/" "$cc"; then
  fail "consumer build used the source or build tree: $(grep -oE -- "-I[^ ]*" "$cc" | sort -u | tr '\n' ' ')"
fi
if grep -qE -- "(-I|-isystem )$inc/morph" "$cc"; then fail "consumer build has include/morph on its path"; fi
grep -q "all_headers.cc" "$cc" || fail "the every-header file was not compiled"
"$tmp/build/consumer"
