#!/usr/bin/env bash
# Builds the store wire-format fuzz target (collectives/fuzz/store_protocol_fuzz.cc) with
# clang++-14 -fsanitize=fuzzer,address,undefined into BUILD_DIR/fuzz and runs it for SECONDS
# from the seed corpus collectives/fuzz/corpus (new inputs go to BUILD_DIR/fuzz/work, the repo
# corpus is not touched). Exits non-zero on a finding (the input lands in
# BUILD_DIR/fuzz/artifacts/), 77 when clang-14 is not installed (ctest: skipped).
#   usage: scripts/fuzz.sh [SECONDS=60] [BUILD_DIR=build]
set -euo pipefail
seconds=${1:-60}
build=${2:-build}
root=$(cd "$(dirname "$0")/.." && pwd)
cxx=${FUZZ_CXX:-clang++-14}
if ! command -v "$cxx" >/dev/null 2>&1; then
  echo "fuzz: $cxx not found; scripts/install-deps.sh installs clang-14 and libfuzzer-14-dev"
  exit 77
fi
mkdir -p "$build/fuzz/work" "$build/fuzz/artifacts"
out=$(cd "$build/fuzz" && pwd)
bin="$out/store_protocol_fuzz"
srcs=("$root/collectives/fuzz/store_protocol_fuzz.cc" "$root/collectives/store_protocol.cc"
      "$root/base/status.cc")
deps=("${srcs[@]}" "$root/collectives/store_protocol.h" "$root/collectives/store.h"
      "$root/base/status.h" "$0")
stale=0
[ -x "$bin" ] || stale=1
for f in "${deps[@]}"; do [ "$f" -nt "$bin" ] && stale=1; done
if [ "$stale" = 1 ]; then
  echo "fuzz: building $bin"
  "$cxx" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I"$root" "${srcs[@]}" -lglog -o "$bin"
fi
echo "fuzz: running for ${seconds} s"
exec "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
  -artifact_prefix="$out/artifacts/" "$out/work" "$root/collectives/fuzz/corpus"
