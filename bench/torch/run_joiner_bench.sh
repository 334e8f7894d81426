#!/usr/bin/env bash
# The grow of issue 34's benchmark: 2 workers of a standard PyTorch program (morph.elastic,
# bench/torch/joiner_setup.py), `morphctl resize 3`; the joiner spends SETUP seconds (default 3)
# once, in its discovery build (before it joins: morph.elastic) or at its first build after it
# was admitted (a program that sets itself up after morph.start: as before). JSON lines: each
# run's survivor stall, then per mode the median and range of JOINER_BENCH_REPEATS runs (3).
#   BUILD_DIR=build bash bench/torch/run_joiner_bench.sh
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${BUILD_DIR:-build}"
[[ "$build" = /* ]] || build="$repo/$build"
repeats="${JOINER_BENCH_REPEATS:-3}"
setup="${SETUP:-3}"
python="$(MORPH_VENV="${MORPH_VENV:-$build/venv}" bash "$repo/scripts/python-venv.sh" | tail -n 1)"
export PYTHONPATH="$build/python" OMP_NUM_THREADS=1 MORPH_TOKEN=joiner-bench-token
tmp="$build/bench-tmp/joiner"
rm -rf "$tmp"
mkdir -p "$tmp"
run_one() {  # $1: discovery or admitted, $2: run index
  local dir="$tmp/$1-$2" api="" pid
  mkdir -p "$dir"
  : >"$dir/run.log"
  timeout 300 "$build/runtime/tools/morphrun" -n 2 --max 3 -- "$python" \
    "$repo/bench/torch/joiner_setup.py" --setup "$setup" --setup-at "$1" --out "$dir" \
    >"$dir/run.log" 2>"$dir/err.log" &
  pid=$!
  for _ in $(seq 600); do
    api=$(sed -n 's/.*scheduler API \([0-9.]*:[0-9]*\).*/\1/p' "$dir/err.log" "$dir/run.log" | head -n 1)
    [[ -n "$api" ]] && break
    sleep 0.1
  done
  [[ -n "$api" ]] || { echo "run_joiner_bench: morphrun did not start ($dir)" >&2; kill "$pid"; return 1; }
  for _ in $(seq 1200); do  # the two workers' own start, then 10 steps
    [[ -e "$dir/trained-10" ]] && break
    sleep 0.1
  done
  "$build/runtime/tools/morphctl" --addr "$api" resize 3 >/dev/null
  wait "$pid" || { echo "run_joiner_bench: the job failed ($dir)" >&2; return 1; }
  grep '"torch_joiner_setup"' "$dir/run.log" | head -n 1
}
for ((r = 0; r < repeats; ++r)); do
  for mode in discovery admitted; do
    run_one "$mode" "$r" | tee -a "$tmp/lines.jsonl"
  done
done
python3 - "$tmp/lines.jsonl" <<'PY'
import json, statistics, sys
by = {}
for line in open(sys.argv[1]):
    j = json.loads(line)
    by.setdefault(j["setup_at"], []).append(j["survivor_stall_seconds"])
for mode, xs in by.items():
    print(json.dumps({"name": "torch_joiner_setup/summary", "setup_at": mode, "runs": len(xs),
                      "survivor_stall_seconds_median": round(statistics.median(xs), 3),
                      "range": [round(min(xs), 3), round(max(xs), 3)]}))
PY
