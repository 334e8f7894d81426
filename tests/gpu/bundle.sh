#!/usr/bin/env bash
# Builds the `gpu` tests and the GPU benchmark here and copies them, with the shared libraries
# they need that a CUDA machine may lack (glog, gflags, gtest, cudart...; never libc, the CUDA
# driver or NCCL), into .gpu-bundle/ (git-ignored, at most 64 MiB), together with run.sh.
# On the GPU machine: .gpu-bundle/run.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${BUILD_DIR:-$root/build}"
out="$root/.gpu-bundle"
cmake -S "$root" -B "$build" -G Ninja -DMORPH_WITH_CUDA=ON >/dev/null
# The gpu-labelled tests, from ctest's own list. A test's name is its target's (morph_cc_test);
# ctest lists a command only once the binary exists, so build first, then ask for the paths.
gpu_tests() {  # field: name | command
  (cd "$build" && ctest -L gpu -N --show-only=json-v1) | python3 -c '
import json, sys
for t in json.load(sys.stdin)["tests"]:
    if sys.argv[1] == "name":
        print(t["name"])
    elif t.get("command"):
        print(t["command"][0])' "$1"
}
mapfile -t targets < <(gpu_tests name)
ninja -C "$build" -j2 "${targets[@]}" pack_gpu_bench
mapfile -t tests < <(gpu_tests command)
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib"
for b in "${tests[@]}" "$build/bench/pack_gpu_bench"; do
  cp "$b" "$out/bin/"
  # Shared libraries outside the C/C++ runtime, the CUDA driver and NCCL (too large; the GPU
  # machine has its own, found through pip's nvidia/*/lib or /usr/local/cuda).
  ldd "$b" | awk '/=> \// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|ld-linux*|libstdc++.so*|libgcc_s.so*) ;;
      libcuda.so*|libnvidia*|libnccl.so*) ;;
      *) cp -L -n "$lib" "$out/lib/" ;;
    esac
  done
done
cp "$root/tests/gpu/run.sh" "$out/run.sh"
chmod +x "$out/run.sh"
{
  echo "morph gpu bundle from $(git -C "$root" rev-parse --short HEAD) built $(date -u +%FT%TZ)"
  ls -l "$out/bin" "$out/lib"
} > "$out/bundle.txt"
size=$(du -sb "$out" | cut -f1)
echo "bundle: $out, $((size / 1024 / 1024)) MiB, tests: ${targets[*]}"
if [ "$size" -gt $((64 * 1024 * 1024)) ]; then
  echo "bundle is larger than 64 MiB" >&2
  exit 1
fi
