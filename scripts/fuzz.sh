#!/usr/bin/env bash
# Builds libFuzzer targets with clang++-14 -fsanitize=fuzzer,address,undefined into
# BUILD_DIR/fuzz and runs each for SECONDS from its seed corpus in the repo (new inputs go to
# BUILD_DIR/fuzz/<target>/work, the repo corpus is not touched):
#   store  the TCP store's wire format     collectives/store/fuzz/store_protocol_fuzz.cc
#   wire   the control channel's frames    runtime/protocol/fuzz/wire_fuzz.cc
#   http   the scheduler API's requests    runtime/coordinator/fuzz/http_request_fuzz.cc
# Exits non-zero on a finding (the input lands in BUILD_DIR/fuzz/<target>/artifacts/), 77 when
# clang-14 is not installed (ctest: skipped).
#   usage: scripts/fuzz.sh [SECONDS=60] [BUILD_DIR=build] [TARGET=all]
set -euo pipefail
seconds=${1:-60}
build=${2:-build}
which=${3:-all}
root=$(cd "$(dirname "$0")/.." && pwd)
cxx=${FUZZ_CXX:-clang++-14}
if ! command -v "$cxx" >/dev/null 2>&1; then
  echo "fuzz: $cxx not found; scripts/install-deps.sh installs clang-14 and libfuzzer-14-dev"
  exit 77
fi

# target -> "fuzz source;other sources;corpus;extra libFuzzer flags"
declare -A targets=(
  [store]="collectives/store/fuzz/store_protocol_fuzz.cc;collectives/store/store_protocol.cc base/status.cc;collectives/store/fuzz/corpus;"
  [wire]="runtime/protocol/fuzz/wire_fuzz.cc;runtime/protocol/wire.cc base/parallel_config.cc base/status.cc;runtime/protocol/fuzz/corpus;-malloc_limit_mb=64"
  [http]="runtime/coordinator/fuzz/http_request_fuzz.cc;runtime/coordinator/http_request.cc runtime/coordinator/http_api.cc runtime/coordinator/decider.cc runtime/coordinator/decider_change.cc runtime/coordinator/decider_persist.cc runtime/protocol/messages.cc collectives/store/store_protocol.cc base/parallel_config.cc base/status.cc;runtime/coordinator/fuzz/corpus;-malloc_limit_mb=64"
)
if [ "$which" = all ]; then
  names=(store wire http)
elif [ -n "${targets[$which]:-}" ]; then
  names=("$which")
else
  echo "fuzz: unknown target '$which' (store, wire, http, all)"
  exit 2
fi

fuzz_one() {
  local name=$1
  IFS=';' read -r main others corpus flags <<<"${targets[$name]}"
  mkdir -p "$build/fuzz/$name/work" "$build/fuzz/$name/artifacts"
  local out
  out=$(cd "$build/fuzz/$name" && pwd)
  local bin="$out/${main##*/}"
  bin="${bin%.cc}"
  local srcs=("$root/$main")
  for s in $others; do srcs+=("$root/$s"); done
  # Rebuilt when a source, any header of the tree or this script is newer than the binary.
  local stale=0
  [ -x "$bin" ] || stale=1
  if [ "$stale" = 0 ]; then
    for f in "${srcs[@]}" "$0"; do [ "$f" -nt "$bin" ] && stale=1; done
    if [ -n "$(find "$root/include" "$root/base" "$root/collectives" "$root/reshard" "$root/runtime" \
                 -name '*.h' -newer "$bin" -print -quit)" ]; then
      stale=1
    fi
  fi
  if [ "$stale" = 1 ]; then
    echo "fuzz: building $bin"
    # One object per source, compiled side by side, then linked.
    local cflags=(-std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined
                  -fno-sanitize-recover=undefined -I"$root" -I"$root/include")
    local objs=() pids=() i=0
    mkdir -p "$out/obj"
    for s in "${srcs[@]}"; do
      objs+=("$out/obj/$i.o")
      "$cxx" "${cflags[@]}" -c "$s" -o "$out/obj/$i.o" &
      pids+=($!)
      i=$((i + 1))
    done
    for p in "${pids[@]}"; do wait "$p"; done
    "$cxx" "${cflags[@]}" "${objs[@]}" -lglog -o "$bin"
  fi
  echo "fuzz: running $name for ${seconds} s"
  # shellcheck disable=SC2086  # flags is a list
  # A finding exits 1: libFuzzer's own default (77) is ctest's "skipped" code here.
  "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 $flags -print_final_stats=1 \
    -error_exitcode=1 -timeout_exitcode=1 \
    -artifact_prefix="$out/artifacts/" "$out/work" "$root/$corpus"
}

for n in "${names[@]}"; do fuzz_one "$n"; done
