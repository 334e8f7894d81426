#!/usr/bin/env bash
# `make bench-torch` (issue 24): morph's Python package next to the C++ runtime and PyTorch DCP
# on the same model, changes and machine, in one run. JSON lines on stdout.
#
# For each change (dp4to2, tp2to1, pp2to1; bench/reconfig_cases.h) and each of TORCH_BENCH_REPEATS
# rounds (default 3), interleaved:
#   - runtime_bench with its C++ workers                       ("workers": "cpp")
#   - runtime_bench with bench/torch/reconfig_worker.py workers ("workers": "python")
#   - runtime_bench with bench/torch/reconfig_standard_worker.py workers ("workers": "standard":
#     the same model, bytes and step written the standard way, nn.Modules on meta,
#     parallelize_module, FSDP2's fully_shard, to_empty, AdamW, handed to morph.elastic, whose
#     build runs again at the change: issue 34)
#   - bench/peers/dcp_reconfig.py: dcp.save, every process exits, a fresh world imports torch
#     and dcp.load-s into the new layout (torchrun-style restart; the same torch as the package)
# Each line as the tool prints it, then per change a summary line (name "torch_vs_peers/<change>")
# with the medians and ranges of request -> first step at the new size, ratio_vs_dcp (DCP
# seconds / morph Python seconds), ratio_vs_dcp_excl_import (DCP without its processes' torch
# import), python_vs_cpp (Python seconds / C++ seconds - 1; target 0.10), and for the standard
# program standard_seconds, standard_vs_handwritten (standard seconds / python seconds: what the
# build function costs over a program written around morph.start), ratio_vs_dcp_standard and
# ratio_vs_dcp_standard_excl_import (DCP seconds / standard seconds), with the bytes each moved
# and held (FSDP2 shards the parameters over DP, the hand-written worker replicates them: the
# same unique bytes, checked first by the "torch_state_bytes" line, laid out differently).
# At 1 GiB (2026-12-07, 3 rounds, load 1-13) the standard program took 1.35x / 0.72x / 1.04x the
# hand-written one's seconds for dp4to2 / tp2to1 / pp2to1: its build and binding add 0.10-0.16 s
# at the change, and FSDP2's layout moves 536 MB where ZeRO-1 moves 358 / 715 / 715 MB.
# TORCH_BENCH_RECONFIG_ONLY=1 stops after the summaries. Then the step loop's
# cost (bench/torch/step_overhead.py under morphrun -n 1; target 0.01), and the latency of a
# torch all_reduce with the "morph" backend next to torch's Gloo (bench/torch/collectives.py),
# and a grow whose joiner has a slow setup (bench/torch/run_joiner_bench.sh).
#
#   TORCH_BENCH_BYTES=1GiB TORCH_BENCH_CHANGES="dp4to2 tp2to1 pp2to1" TORCH_BENCH_REPEATS=3 \
#     BUILD_DIR=build bash bench/torch/run_torch_bench.sh
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${BUILD_DIR:-build}"
[[ "$build" = /* ]] || build="$repo/$build"
bytes="${TORCH_BENCH_BYTES:-1GiB}"
changes="${TORCH_BENCH_CHANGES:-dp4to2 tp2to1 pp2to1}"
repeats="${TORCH_BENCH_REPEATS:-3}"
timeout_s="${TORCH_BENCH_TIMEOUT:-600}"
python="$(MORPH_VENV="${MORPH_VENV:-$build/venv}" bash "$repo/scripts/python-venv.sh" | tail -n 1)"
for f in bench/runtime_bench bench/restart_baseline_bench runtime/tools/morphrun python/morph/__init__.py; do
  [[ -e "$build/$f" ]] || { echo "run_torch_bench: no $build/$f (make bench-torch builds it)" >&2; exit 1; }
done
export PYTHONPATH="$build/python" OMP_NUM_THREADS=1
tmp="$build/bench-tmp/torch"
mkdir -p "$tmp"
lines="$tmp/lines.jsonl"
: >"$lines"
: >"$tmp/collectives.jsonl"
: >"$tmp/standard-workers.jsonl"
emit() { [[ -n "$1" ]] && { echo "$1"; echo "$1" >>"$lines"; }; }
# The unique state of both Python workers, from the standard one's discovery build (no job).
"$python" "$repo/bench/torch/reconfig_standard_worker.py" --print-state \
  --bytes "$(python3 -c 'import re, sys; n, u = re.fullmatch(r"(\d+)([KMG]iB)?", sys.argv[1]).groups()
print(int(n) << {None: 0, "KiB": 10, "MiB": 20, "GiB": 30}[u])' "$bytes")" ||
  { echo "run_torch_bench: reconfig_standard_worker.py --print-state failed" >&2; exit 1; }
for ((r = 0; r < repeats; ++r)); do
  for change in $changes; do
    emit "$(timeout "$timeout_s" "$build/bench/runtime_bench" --bytes "$bytes" --changes "$change" \
            2>"$tmp/cpp-$change.log" | grep '"reconfigure"')" ||
      { echo "run_torch_bench: runtime_bench (cpp) $change failed: $tmp/cpp-$change.log" >&2; exit 1; }
    emit "$(timeout "$timeout_s" "$build/bench/runtime_bench" --bytes "$bytes" --changes "$change" \
            --worker-cmd "$python $repo/bench/torch/reconfig_worker.py" --label python \
            2>"$tmp/python-$change.log" | grep '"reconfigure"')" ||
      { echo "run_torch_bench: runtime_bench (python) $change failed: $tmp/python-$change.log" >&2; exit 1; }
    emit "$(TORCH_BENCH_STANDARD_LOG="$tmp/standard-workers.jsonl" timeout "$timeout_s" \
            "$build/bench/runtime_bench" --bytes "$bytes" --changes "$change" \
            --worker-cmd "$python $repo/bench/torch/reconfig_standard_worker.py" --label standard \
            2>"$tmp/standard-$change.log" | grep '"reconfigure"')" ||
      { echo "run_torch_bench: runtime_bench (standard) $change failed: $tmp/standard-$change.log" >&2; exit 1; }
    emit "$(timeout "$timeout_s" "$python" "$repo/bench/peers/dcp_reconfig.py" --change "$change" \
            --bytes "$bytes" --layout-bin "$build/bench/restart_baseline_bench" --dir "$tmp/dcp" \
            --timeout "$timeout_s" 2>"$tmp/dcp-$change.log")" ||
      { echo "run_torch_bench: DCP $change failed: $tmp/dcp-$change.log" >&2; exit 1; }
  done
done
python3 - "$lines" "$tmp/standard-workers.jsonl" <<'PY'
import json, statistics, sys
runs = {}
# The standard workers' lines at each run's new generation (generation 2), by run (its OUT
# directory, morph-rtbench-<change>-<pid>): the slowest worker's build, and its step entry less
# the runtime's stall (the build and morph binding the objects to the state).
std_runs = {}
for line in open(sys.argv[2]):
    j = json.loads(line)
    if j["generation"] == 2:
        std_runs.setdefault(j["out"], []).append(j)
def std_phase(change, f):
    xs = [max(f(j) for j in js) for out, js in std_runs.items()
          if out.rsplit("/", 1)[-1].startswith("morph-rtbench-" + change + "-")]
    return [round(statistics.median(xs), 4), round(min(xs), 4), round(max(xs), 4)] if xs else None
for line in open(sys.argv[1]):
    j = json.loads(line)
    kind = j.get("workers", "dcp") if j["name"] == "reconfigure" else "dcp"
    runs.setdefault(j["change"], {}).setdefault(kind, []).append(j)
def med(xs): return round(statistics.median(xs), 4)
def rng(xs): return [round(min(xs), 4), round(max(xs), 4)]
for change, by in runs.items():
    py = [j["seconds"] for j in by.get("python", [])]
    cpp = [j["seconds"] for j in by.get("cpp", [])]
    dcp = [j["seconds"] for j in by.get("dcp", [])]
    dcp_x = [j["seconds_excl_import"] for j in by.get("dcp", [])]
    if not (py and cpp and dcp):
        continue
    print(json.dumps({
        "name": "torch_vs_peers/" + change, "change": change, "bytes": by["python"][0]["bytes"],
        "runs": len(py), "python_seconds": med(py), "python_seconds_range": rng(py),
        "python_stall_seconds": med([j["stall_seconds"] for j in by["python"]]),
        "cpp_seconds": med(cpp), "cpp_seconds_range": rng(cpp),
        "dcp_seconds": med(dcp), "dcp_seconds_range": rng(dcp),
        "dcp_seconds_excl_import": med(dcp_x), "dcp_seconds_excl_import_range": rng(dcp_x),
        "ratio_vs_dcp": round(statistics.median(dcp) / statistics.median(py), 1),
        "ratio_vs_dcp_excl_import": round(statistics.median(dcp_x) / statistics.median(py), 1),
        "python_vs_cpp": round(statistics.median(py) / statistics.median(cpp) - 1, 3),
        "python_vs_cpp_target": 0.10,
        "verified_dcp": all(j.get("verified") for j in by["dcp"])}))
    std = [j["seconds"] for j in by.get("standard", [])]
    if not std:
        continue
    def bytes_of(kind):
        js = by[kind]
        return {"bytes_moved": med([j["bytes_moved"] for j in js]),
                "state_bytes_before_max": med([j["memory"]["before_bytes_max"] for j in js]),
                "state_bytes_after_max": med([j["memory"]["after_bytes_max"] for j in js])}
    print(json.dumps({
        "name": "torch_standard_vs_peers/" + change, "change": change,
        "bytes": by["standard"][0]["bytes"], "runs": len(std),
        "standard_seconds": med(std), "standard_seconds_range": rng(std),
        "standard_stall_seconds": med([j["stall_seconds"] for j in by["standard"]]),
        "python_seconds": med(py), "python_seconds_range": rng(py),
        "standard_vs_handwritten": round(statistics.median(std) / statistics.median(py), 2),
        "ratio_vs_dcp_standard": round(statistics.median(dcp) / statistics.median(std), 1),
        "ratio_vs_dcp_standard_excl_import":
            round(statistics.median(dcp_x) / statistics.median(std), 1),
        "standard_build_seconds_median_min_max": std_phase(change, lambda j: j["build_seconds"]),
        "standard_enter_minus_stall_seconds_median_min_max":
            std_phase(change, lambda j: j["step_enter_seconds"] - j["stall"]),
        "standard_moved": bytes_of("standard"), "python_moved": bytes_of("python")}))
PY
[[ "${TORCH_BENCH_RECONFIG_ONLY:-0}" = 1 ]] && exit 0
MORPH_TOKEN="${MORPH_TOKEN:-bench-torch}" timeout "$timeout_s" "$build/runtime/tools/morphrun" -n 1 -- \
  "$python" "$repo/bench/torch/step_overhead.py" 2>"$tmp/step.log" | grep '"torch_step_overhead"' ||
  { echo "run_torch_bench: step_overhead failed: $tmp/step.log" >&2; exit 1; }
# torch all_reduce latency on the generation's groups: the "morph" backend next to torch's Gloo.
for backend in morph gloo; do
  MORPH_TORCH_BACKEND=$backend MORPH_TOKEN="${MORPH_TOKEN:-bench-torch}" timeout "$timeout_s" \
    "$build/runtime/tools/morphrun" -n 2 -- "$python" "$repo/bench/torch/collectives.py" \
    2>"$tmp/collectives-$backend.log" | grep '"torch_collectives"' >>"$tmp/collectives.jsonl" ||
    { echo "run_torch_bench: collectives ($backend) failed: $tmp/collectives-$backend.log" >&2; exit 1; }
done
python3 - "$tmp/collectives.jsonl" <<'PY'
import json, sys
by = {}
for line in open(sys.argv[1]):
    j = json.loads(line)
    by[j["backend"]] = j["allreduce_us"]
    print(line.strip())
m, g = by["morph"], by["gloo"]
print(json.dumps({"name": "torch_collectives/morph_vs_gloo", "world": 2,
                  "gloo_over_morph": {k: round(g[k] / m[k], 2) for k in m}}))
PY
# A grow whose joiner spends 3 s on its setup: the survivors' stall with the setup in
# morph.elastic's discovery build (before the joiner is admitted) and after admission (issue 34).
BUILD_DIR="$build" bash "$repo/bench/torch/run_joiner_bench.sh"
