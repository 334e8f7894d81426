#!/usr/bin/env bash
# `make bench-runtime`: morph's end-to-end reconfiguration (bench/runtime_bench.cc, through the
# Launcher with real worker processes) next to the C++ restart baseline and PyTorch DCP
# (run_peers.sh), on the same model and changes (bench/reconfig_cases.h), in one session; then
# BeginStep+EndStep's cost. JSON lines; the comparison lines carry ratio_vs_dcp and
# ratio_vs_cpp_baseline (peer seconds / morph seconds, request -> first step at the new size).
#
#   RUNTIME_BYTES=1GiB RUNTIME_CHANGES="dp4to2 tp2to1" bench/peers/run_runtime_bench.sh
#   RUNTIME_PEERS=0 ...   # morph only (no torch install)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${BUILD_DIR:-build}"
[[ "$build" = /* ]] || build="$repo/$build"
bytes="${RUNTIME_BYTES:-1GiB}"
changes="${RUNTIME_CHANGES:-dp4to2 dp2to4 tp2to1 pp2to1}"
peers="${RUNTIME_PEERS:-1}"
tmp="$build/bench-tmp"
mkdir -p "$tmp"
morph_lines="$tmp/runtime_bench.jsonl"
"$build/bench/runtime_bench" --bytes "$bytes" --changes "${changes// /,}" | tee "$morph_lines"
if [[ "$peers" == 1 ]]; then
  peer_lines="$tmp/peers.jsonl"
  BUILD_DIR="$build" PEERS_BYTES="$bytes" PEERS_CHANGES="$changes" \
    bash "$repo/bench/peers/run_peers.sh" | tee "$peer_lines"
  python3 - "$morph_lines" "$peer_lines" <<'PY'
import json, sys
morph = {j["change"]: j for j in map(json.loads, open(sys.argv[1])) if j.get("name") == "reconfigure"}
for line in open(sys.argv[2]):
    j = json.loads(line)
    if not j.get("name", "").startswith("restart_baseline_vs_dcp/"):
        continue
    m = morph.get(j["change"])
    if m is None:
        continue
    print(json.dumps({
        "name": "morph_vs_peers/" + j["change"], "change": j["change"], "bytes": m["bytes"],
        "seconds": m["seconds"], "stall_seconds": m["stall_seconds"],
        "cpp_baseline_seconds": j["seconds"], "dcp_seconds": j["dcp_seconds"],
        "ratio_vs_cpp_baseline": round(j["seconds"] / m["seconds"], 1),
        "ratio_vs_dcp": round(j["dcp_seconds"] / m["seconds"], 1),
        "ratio_vs_dcp_excl_import": round(j["dcp_seconds_excl_import"] / m["seconds"], 1)}))
PY
fi
"$build/bench/runtime_bench" --step-cost
