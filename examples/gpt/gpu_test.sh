#!/usr/bin/env bash
# The GPU path end to end (ctest gpt_nccl_test, label gpu; tests/gpu/run.sh runs it from the
# bundle): gpt_nccl (state in CUDA memory, the step communicators on NCCL, products through
# cuBLAS-XT) against the CPU build gpt (host memory, Gloo, OpenBLAS), same seed and batch.
#
#   gpu_test.sh <gpt> <gpt_nccl> <morphrun>
#
# Cases: 1 worker; 2 workers (dp=2: a DP reduce-scatter, allgather and the world allreduce over
# NCCL) where the machine has two GPUs or NCCL_MULTI_RANK_GPU_ENABLE=1 lets two ranks share one
# (NCCL >= 2.30; 2.28 refuses: "Duplicate GPU detected"). Checks per case: the run used NCCL
# (the runtime's "data plane: NCCL" line), every step's loss matches the CPU run's within TOL
# (absolute, nats per byte; the two differ only in the GEMMs' float summation order: cuBLAS vs
# OpenBLAS, TF32 off), and the loss went down by at least DROP over the run. Prints
# "gpu-note:" lines with what it measured. Exit 77 (skipped) without a GPU, saying why.
# Environment: STEPS (30), TOL (1e-3), DROP (1.0), DATA (the corpus folder).
set -uo pipefail
gpt=$1
gpt_nccl=$2
morphrun=$3
STEPS=${STEPS:-30}
TOL=${TOL:-1e-3}
DROP=${DROP:-1.0}
DATA=${DATA:-/usr/share/games/fortunes}
tmp=$(mktemp -d)
cleanup() {
  for f in "$tmp"/*/pids/*; do [ -e "$f" ] && kill -KILL "${f##*/}" 2>/dev/null; done
  if [ "${KEEP:-0}" = 1 ]; then echo "kept $tmp" >&2; else rm -rf "$tmp"; fi
}
trap cleanup EXIT
fail() { echo "gpt_nccl_test: $*" >&2; exit 1; }
export MORPH_TOKEN=gpt-nccl-test-token OPENBLAS_NUM_THREADS=1 NVIDIA_TF32_OVERRIDE=0
unset MORPH_BACKEND MORPH_COORDINATOR
common=(--steps "$STEPS" --quiet --seq 16 --global-batch 8 --micro-batch 2 --seed 7 --data "$DATA"
        --tp 1 --pp 1)

# No GPU (or no driver): gpt_nccl says so at start, exit 2, before it joins anything.
probe=$(MORPH_INITIAL_WORLD=1 timeout 60 "$gpt_nccl" --steps 1 --quiet --data "$DATA" \
  --out "$tmp/probe" 2>&1)
rc=$?
if [ $rc -eq 2 ] && grep -q "no CUDA device" <<< "$probe"; then
  echo "SKIPPED: no GPU: $(grep -m1 'no CUDA device' <<< "$probe")"
  exit 77
fi
[ $rc -eq 0 ] || { echo "$probe" | tail -20; fail "gpt_nccl probe run failed (exit $rc)"; }

# One case: n workers of each build, then compare.
run_case() {  # n
  local n=$1 b
  for b in cpu gpu; do
    local bin=$gpt
    [ $b = gpu ] && bin=$gpt_nccl
    timeout 240 "$morphrun" -n "$n" --log-dir "$tmp/$b$n.logs" -- "$bin" "${common[@]}" \
      --out "$tmp/$b$n" >"$tmp/$b$n.log" 2>&1 ||
      { tail -30 "$tmp/$b$n.log" "$tmp/$b$n.logs"/* 2>/dev/null; fail "$b run with $n workers failed"; }
  done
  grep -rqs "data plane: NCCL on CUDA device" "$tmp/gpu$n.log" "$tmp/gpu$n.logs" ||
    fail "$n workers: gpt_nccl did not report the NCCL data plane"
  python3 - "$tmp/cpu$n/metrics.tsv" "$tmp/gpu$n/metrics.tsv" "$n" "$STEPS" "$TOL" "$DROP" <<'PY' || exit 1
import sys
cpu_f, gpu_f, n, steps, tol, drop = sys.argv[1:]
def read(f):
    rows = [l.split("\t") for l in open(f).read().splitlines() if l]
    return {int(r[0]): (float(r[1]), r[2:6], float(r[7])) for r in rows}
cpu, gpu = read(cpu_f), read(gpu_f)
steps = int(steps)
if sorted(cpu) != list(range(steps)) or sorted(gpu) != list(range(steps)):
    sys.exit(f"gpt_nccl_test: {n} workers: expected steps 0..{steps - 1}, got cpu {sorted(cpu)[:3]}..., gpu {sorted(gpu)[:3]}...")
worst = max(abs(cpu[s][0] - gpu[s][0]) for s in range(steps))
at = max(range(steps), key=lambda s: abs(cpu[s][0] - gpu[s][0]))
ms_cpu = sorted(cpu[s][2] for s in range(1, steps))[(steps - 1) // 2]
ms_gpu = sorted(gpu[s][2] for s in range(1, steps))[(steps - 1) // 2]
print(f"gpu-note: gpt_nccl {n} worker(s), config world/dp/tp/pp {'/'.join(gpu[0][1])}: loss "
      f"{gpu[0][0]:.4f} -> {gpu[steps - 1][0]:.4f}; max |loss - cpu| {worst:.2e} at step {at} "
      f"(TOL {tol}); median ms/step gpu {ms_gpu:.1f}, cpu {ms_cpu:.1f}")
if gpu[0][1] != cpu[0][1]:
    sys.exit(f"gpt_nccl_test: {n} workers: configs differ: gpu {gpu[0][1]}, cpu {cpu[0][1]}")
if worst > float(tol):
    sys.exit(f"gpt_nccl_test: {n} workers: step {at}: loss {gpu[at][0]:.9f} vs cpu {cpu[at][0]:.9f}")
if gpu[steps - 1][0] > gpu[0][0] - float(drop):
    sys.exit(f"gpt_nccl_test: {n} workers: loss went from {gpu[0][0]:.4f} to {gpu[steps - 1][0]:.4f}")
PY
}

run_case 1
gpus=1
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  [ "${gpus:-0}" -ge 1 ] 2>/dev/null || gpus=1
fi
if [ "$gpus" -ge 2 ] || [ "${NCCL_MULTI_RANK_GPU_ENABLE:-0}" = 1 ]; then
  run_case 2
else
  echo "gpu-note: gpt_nccl 2 workers skipped: $gpus GPU and NCCL_MULTI_RANK_GPU_ENABLE unset" \
       "(NCCL < 2.30 refuses two ranks on one GPU)"
fi
echo "gpt_nccl_test: passed"
