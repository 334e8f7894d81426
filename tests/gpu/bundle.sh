#!/usr/bin/env bash
# Builds the `gpu` tests and the GPU benchmark here and copies them, with the shared libraries
# they need that a CUDA machine may lack (glog, gflags, gtest, gloo, boost, openblas, cudart...;
# never libc, the CUDA driver, NCCL or cuBLAS, which PyTorch's pip wheels bring), into
# .gpu-bundle/ (git-ignored, at most 64 MiB), together with run.sh. examples/gpt's
# gpt_nccl_test is a script: the bundle gets its script, gpt, gpt_nccl, morphrun and the corpus
# it trains on (data/fortunes). scripts/bundle-gpu.sh is this script.
# Nothing in the bundle is built against torch (the GPU machine's python3 is 3.12 with torch
# 2.11): configure leaves the build folder's MORPH_TORCH and venv as they are. A torch piece added
# here must be built for that torch: MORPH_TORCH=2.11 and a venv of that Python (docs/torch.md
# "Torch versions").
# On the GPU machine: .gpu-bundle/run.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${BUILD_DIR:-$root/build}"
out="$root/.gpu-bundle"
cmake -S "$root" -B "$build" -G Ninja -DMORPH_WITH_CUDA=ON >/dev/null
# The gpu-labelled tests, from ctest's own list. A test's name is its target's (morph_cc_test);
# ctest lists a command only once the binary exists, so build first, then ask for the paths.
# Scripts (a command that is not the test's own binary, e.g. bash gpu_test.sh) are left out here.
gpu_tests() {  # field: name | command
  (cd "$build" && ctest -L gpu -N --show-only=json-v1) | python3 -c '
import json, os, sys
for t in json.load(sys.stdin)["tests"]:
    cmd = t.get("command") or []
    if cmd and os.path.basename(cmd[0]) != t["name"]:
        continue
    if sys.argv[1] == "name":
        print(t["name"])
    elif cmd:
        print(cmd[0])' "$1"
}
mapfile -t targets < <(gpu_tests name)
gpt_bins=()
# (grep reads all of ninja's list: with -q it would exit early and pipefail fail the pipe.)
if ninja -C "$build" -t targets all 2>/dev/null | grep '^gpt_nccl:' >/dev/null; then
  gpt_bins=(gpt gpt_nccl morphrun)
fi
ninja -C "$build" -j2 "${targets[@]}" pack_gpu_bench device_reshard_gpu_bench "${gpt_bins[@]}"
mapfile -t tests < <(gpu_tests command)
extra_bins=()
for b in "${gpt_bins[@]}"; do
  case $b in
    morphrun) extra_bins+=("$build/runtime/tools/morphrun") ;;
    *) extra_bins+=("$build/examples/gpt/$b") ;;
  esac
done
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
for b in "${tests[@]}" "$build/bench/pack_gpu_bench" "$build/bench/device_reshard_gpu_bench" \
         "${extra_bins[@]}"; do
  cp "$b" "$out/bin/"
  strip --strip-debug "$out/bin/$(basename "$b")"  # RelWithDebInfo: -g makes them 5-8x larger
  # Shared libraries outside the C/C++ runtime, the CUDA driver and NCCL (too large; the GPU
  # machine has its own, found through pip's nvidia/*/lib or /usr/local/cuda).
  ldd "$b" | awk '/=> \// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|ld-linux*|libstdc++.so*|libgcc_s.so*) ;;
      libcuda.so*|libnvidia*|libnccl.so*|libcublas*|libnvJitLink*|libnvrtc*) ;;
      *) cp -L -n "$lib" "$out/lib/" ;;
    esac
  done
done
# OpenBLAS alone is 36 MB: the libraries travel as one gzip archive, which run.sh unpacks.
tar -C "$out" -czf "$out/lib.tar.gz" lib
rm -rf "$out/lib"
cp "$root/tests/gpu/run.sh" "$out/run.sh"
if [ ${#gpt_bins[@]} -gt 0 ]; then
  mkdir -p "$out/gpt" "$out/data"
  cp "$root/examples/gpt/gpu_test.sh" "$out/gpt/"
  # The corpus (Debian's fortunes-min; the GPU machine has none of our packages).
  corpus=/usr/share/games/fortunes
  [ -d "$corpus" ] || { echo "no corpus at $corpus (apt-get install fortunes-min)" >&2; exit 1; }
  mkdir -p "$out/data/fortunes"
  find "$corpus" -maxdepth 1 -type f ! -name '*.dat' -exec cp {} "$out/data/fortunes/" \;
fi
chmod +x "$out/run.sh"
{
  echo "morph gpu bundle from $(git -C "$root" rev-parse --short HEAD) built $(date -u +%FT%TZ)"
  ls -l "$out/bin"
  tar -tzvf "$out/lib.tar.gz"
} > "$out/bundle.txt"
size=$(du -sb "$out" | cut -f1)
echo "bundle: $out, $((size / 1024 / 1024)) MiB, tests: ${targets[*]}"
if [ "$size" -gt $((64 * 1024 * 1024)) ]; then
  echo "bundle is larger than 64 MiB" >&2
  exit 1
fi
