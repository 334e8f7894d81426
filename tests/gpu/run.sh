#!/usr/bin/env bash
# Runs every `gpu` test and the GPU benchmark on a machine with a GPU, in under 8 minutes.
#
#   tests/gpu/run.sh            from a checkout: configures with CUDA, builds, runs `ctest -L gpu`
#                               and bench/pack_gpu_bench (needs our Debian build dependencies)
#   .gpu-bundle/run.sh          from a bundle made by tests/gpu/bundle.sh: runs the pre-built
#                               test binaries and benchmark, with the bundled shared libraries
#                               (for machines that have CUDA but none of our Debian libraries)
#
# Prints the NCCL version first (and sets NCCL_MULTI_RANK_GPU_ENABLE=1 from NCCL 2.30, which
# lets several ranks share the one GPU), then one line per test (PASS/SKIP/FAIL) with the
# "gpu-note:" lines it printed (measurements, skip reasons), then the benchmarks' JSON lines
# (pack_gpu_bench: kernels vs cudaMemcpy; device_reshard_gpu_bench: a 1 GiB device reshard vs
# raw NCCL p2p, NCCL init / abort / shrink times).
# The tests include gpt_nccl_test: examples/gpt's gpt_nccl (state on the GPU, NCCL, cuBLAS)
# against the CPU build. Everything printed also goes to $OUT/run.txt, each test's whole output
# to $OUT/<test>.log ($OUT: the device tool's output folder; default ./gpu-out). Exit status:
# 0 if no test failed. Environment: GPU_BENCH_MB (default 512) sizes the benchmark; BUILD_DIR
# (default build-gpu) for checkout mode.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
start=$(date +%s)
out_dir="${OUT:-$PWD/gpu-out}"
mkdir -p "$out_dir"
exec > >(tee "$out_dir/run.txt") 2>&1

# Library folders of pip-installed NVIDIA wheels (nvidia-nccl-cu13, nvidia-cuda-runtime...).
pip_nvidia_libs() {
  python3 - <<'PY' 2>/dev/null || true
import os
try:
    import nvidia
except ImportError:
    raise SystemExit(0)
for base in list(nvidia.__path__):
    for d in sorted(os.listdir(base)):
        lib = os.path.join(base, d, "lib")
        if os.path.isdir(lib):
            print(lib)
PY
}
extra=""
for d in $(pip_nvidia_libs); do extra="${extra:+$extra:}$d"; done
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && extra="${extra:+$extra:}$d"
done

bundle_mode=0
if [ -f "$here/bundle.txt" ]; then
  bundle_mode=1
  libdir="$here/lib"
  if [ -f "$here/lib.tar.gz" ]; then  # bundle.sh packs the libraries
    unpacked=$(mktemp -d)
    trap 'rm -rf "$unpacked"' EXIT
    tar -C "$unpacked" -xzf "$here/lib.tar.gz" || { echo "FAIL unpacking lib.tar.gz"; exit 1; }
    libdir="$unpacked/lib"
  fi
  export LD_LIBRARY_PATH="$libdir${extra:+:$extra}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
  export LD_LIBRARY_PATH="${extra}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

# 1. NCCL version, through ncclGetVersion.
nccl_version=$(python3 - <<'PY' 2>/dev/null
import ctypes
lib = ctypes.CDLL("libnccl.so.2")
v = ctypes.c_int(0)
assert lib.ncclGetVersion(ctypes.byref(v)) == 0
print(v.value)
PY
)
if [ -z "$nccl_version" ] && command -v cc >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  printf '#include <stdio.h>\nint ncclGetVersion(int*);\nint main(void){int v=0;if(ncclGetVersion(&v))return 1;printf("%%d\\n",v);return 0;}\n' > "$tmp/v.c"
  libdirs=""
  IFS=: read -ra parts <<< "$LD_LIBRARY_PATH"
  for d in "${parts[@]}"; do [ -n "$d" ] && libdirs="$libdirs -L$d"; done
  # shellcheck disable=SC2086
  cc "$tmp/v.c" -o "$tmp/v" $libdirs -l:libnccl.so.2 2>/dev/null && nccl_version=$("$tmp/v")
  rm -rf "$tmp"
fi
echo "NCCL version: ${nccl_version:-unknown (libnccl.so.2 not found)}"
# NCCL_VERSION_CODE is major*10000 + minor*100 + patch: 2.30.0 is 23000.
if [ -n "$nccl_version" ] && [ "$nccl_version" -ge 23000 ]; then
  export NCCL_MULTI_RANK_GPU_ENABLE=1
  echo "NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL >= 2.30: several ranks may share one GPU)"
fi
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

failed=0
run_one() {  # name, command...
  local name=$1; shift
  local out rc
  out=$(timeout 300 "$@" 2>&1); rc=$?
  printf '%s\n' "$out" > "$out_dir/$name.log"
  grep '^gpu-note:' <<< "$out" | sed 's/^/  /'
  if [ $rc -eq 0 ] && grep -q "SKIPPED" <<< "$out" && ! grep -q "\[  PASSED  \] [1-9]" <<< "$out"; then
    echo "SKIP $name: $(grep -m1 -iE 'no usable gpu|no GPU:|two ranks need' <<< "$out")"
  elif [ $rc -eq 0 ]; then
    echo "PASS $name"
  elif [ $rc -eq 77 ]; then
    echo "SKIP $name: $(grep -m1 -iE 'no usable gpu|no GPU:|two ranks need' <<< "$out")"
  else
    echo "FAIL $name (exit $rc)"; echo "$out" | tail -40; failed=1
  fi
}

if [ $bundle_mode -eq 1 ]; then
  echo "bundle: $(head -1 "$here/bundle.txt")"
  # Libraries the machine must bring itself (NCCL, cuBLAS: pip's nvidia wheels) and lacks.
  for b in "$here"/bin/*; do
    ldd "$b" 2>/dev/null | awk -v b="$(basename "$b")" '/not found/ {print "MISSING " b ": " $1}'
  done | sort -u
  for t in "$here"/bin/*_test; do
    [ -x "$t" ] && run_one "$(basename "$t")" "$t"
  done
  # examples/gpt end to end: gpt_nccl against the CPU build, on the bundled corpus.
  if [ -x "$here/bin/gpt_nccl" ]; then
    run_one gpt_nccl_test env DATA="$here/data/fortunes" bash "$here/gpt/gpu_test.sh" \
      "$here/bin/gpt" "$here/bin/gpt_nccl" "$here/bin/morphrun"
  else
    echo "FAIL gpt_nccl_test: bin/gpt_nccl is not in the bundle"; failed=1
  fi
  bench="$here/bin/pack_gpu_bench"
else
  root="$(cd "$here/../.." && pwd)"
  build="${BUILD_DIR:-$root/build-gpu}"
  # RelWithDebInfo (-O2), the project default: GCC 12 at -O3 reports false -Wrestrict errors
  # (GCC bug 105329) in std::string code.
  cmake -S "$root" -B "$build" -G Ninja -DMORPH_WITH_CUDA=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null \
    || { echo "FAIL configure"; exit 1; }
  # Build only what the gpu tests and the benchmark need (the whole tree if ctest's list
  # cannot be read).
  mapfile -t targets < <(cd "$build" && ctest -L gpu -N --show-only=json-v1 2>/dev/null |
    python3 -c 'import json, sys
for t in json.load(sys.stdin)["tests"]:
    if t["name"] == "gpt_nccl_test":  # a script: it runs these binaries
        print("gpt\ngpt_nccl\nmorphrun")
    else:
        print(t["name"])' 2>/dev/null)  # a test's name is its target's (morph_cc_test)
  if [ ${#targets[@]} -gt 0 ]; then
    cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" pack_gpu_bench \
      device_reshard_gpu_bench >/dev/null \
      || { echo "FAIL build"; exit 1; }
  else
    cmake --build "$build" -j "$(nproc)" >/dev/null || { echo "FAIL build"; exit 1; }
  fi
  (cd "$build" && timeout 480 ctest -L gpu --output-on-failure) || failed=1
  # Measurements and skip reasons the tests print ("gpu-note: ...").
  grep -h '^gpu-note:' "$build/Testing/Temporary/LastTest.log" 2>/dev/null | sed 's/^/  /'
  bench="$build/bench/pack_gpu_bench"
fi

if [ -x "$bench" ]; then
  timeout 120 "$bench" --mb="${GPU_BENCH_MB:-512}" || { echo "FAIL pack_gpu_bench"; failed=1; }
else
  echo "FAIL pack_gpu_bench not found at $bench"; failed=1
fi
# The device data path: a 1 GiB reshard over NCCL vs raw NCCL p2p, NCCL init / abort / shrink.
reshard_bench="$(dirname "$bench")/device_reshard_gpu_bench"
if [ -x "$reshard_bench" ]; then
  timeout 180 "$reshard_bench" --mb="${GPU_RESHARD_MB:-1024}" ||
    { echo "FAIL device_reshard_gpu_bench"; failed=1; }
else
  echo "FAIL device_reshard_gpu_bench not found at $reshard_bench"; failed=1
fi
echo "gpu run: $(( $(date +%s) - start )) s, $([ $failed -eq 0 ] && echo OK || echo FAILED)"
exit $failed
