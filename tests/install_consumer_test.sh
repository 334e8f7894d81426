#!/usr/bin/env bash
# Installs the build tree into a temporary prefix and checks that it holds the public surface and
# nothing else: include/morph/*.h (the headers of include/morph/ in the tree, each including only
# <morph/...> and the standard library), one library (libmorph) and the programs; then builds
# tests/consumer against it with find_package(morph) and runs it, and shows that an internal
# header is not there (a consumer that includes one does not build).
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

# Headers: exactly the public ones, flat under include/morph/.
want=$(cd "$src/include" && find morph -name '*.h' | sort)
have=$(cd "$inc" && find . -type f | sed 's|^\./||' | sort)
[ "$want" = "$have" ] || fail "installed headers differ from include/morph/:
$(diff <(echo "$want") <(echo "$have"))"
[ -f "$inc/morph/morph.h" ] || fail "no include/morph/morph.h"
if grep -rnE '^\s*#\s*include\s*"' "$inc" | grep -vE '#\s*include\s*"morph/[a-z_]+\.h"'; then
  fail "an installed header includes something other than morph/*.h (lines above)"
fi
if grep -rnE '^\s*#\s*include\s*<' "$inc" | grep -E '<(morph/[a-z_]+/|gloo|glog|boost|nlohmann|gtest|gmock|cuda|nccl|mpi)'; then
  fail "an installed header includes an internal or third-party header (lines above)"
fi
# Libraries: libmorph only.
libs=$(cd "$prefix" && find . \( -name '*.a' -o -name '*.so*' \) | sed 's|^\./||' | sort)
for l in $libs; do
  case $(basename "$l") in libmorph.so*) ;; *) fail "installed a library other than libmorph: $l" ;; esac
done
ls "$prefix"/lib*/libmorph.so >/dev/null 2>&1 || fail "no libmorph.so installed"

gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$src/tests/consumer" -B "$tmp/build" "${gen[@]}" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_CXX_COMPILER="${CXX:-c++}" -DCONSUMER_INTERNAL_HEADER=reshard/plan.h \
  >"$tmp/configure.log" 2>&1 || { cat "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/build" >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }
# The consumer's compile lines name the prefix's include/ and nothing of the source or build tree.
cc=$tmp/build/compile_commands.json
[ -f "$cc" ] || fail "no compile_commands.json"
if grep -qE -- "-I(system )?$src|-isystem $src|$build/" "$cc"; then
  fail "consumer build used the source or build tree: $(grep -oE -- "-I[^ ]*" "$cc" | sort -u | tr '\n' ' ')"
fi
# An internal header is not there, under any spelling a consumer might try.
for h in reshard/plan.h morph/reshard/plan.h runtime/state/state.h morph/runtime/api/runtime.h \
         base/params.h morph/base/params.h collectives/gloo/gloo_communicator.h; do
  echo "#include <$h>" > "$tmp/internal.cc"
  if "${CXX:-c++}" -std=c++20 -fsyntax-only -I"$inc" "$tmp/internal.cc" 2>"$tmp/internal.log"; then
    fail "an internal header is reachable from the prefix: <$h>"
  fi
  grep -q "No such file" "$tmp/internal.log" || { cat "$tmp/internal.log"; fail "<$h>: not a missing file"; }
done
if cmake --build "$tmp/build" --target internal_header >"$tmp/internal_build.log" 2>&1; then
  fail "a consumer that includes <reshard/plan.h> built"
fi
grep -q "reshard/plan.h: No such file" "$tmp/internal_build.log" || {
  cat "$tmp/internal_build.log"; fail "the internal-header consumer failed for another reason"; }
MORPH_INITIAL_WORLD=1 "$tmp/build/consumer"
