#!/usr/bin/env bash
# The peers of morph's end-to-end reconfiguration benchmark, in one run: for each change, the
# C++ restart baseline (build/bench/restart_baseline_bench) and PyTorch DCP
# (bench/peers/dcp_reconfig.py, torch installed on first use by setup_torch.sh), then a line
# comparing them. JSON lines on stdout; DCP's logs in $BUILD_DIR/bench-tmp/dcp-<change>.log.
#
#   bench/peers/run_peers.sh                       # 1 GiB, dp4to2 dp2to4 tp2to1 pp2to1
#   PEERS_BYTES=48MiB PEERS_CHANGES=dp4to2 bench/peers/run_peers.sh   # a smoke run
#
# `make bench-runtime-peers` builds the baseline and runs this. Never part of `make test`.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${BUILD_DIR:-build}"
[[ "$build" = /* ]] || build="$repo/$build"
bytes="${PEERS_BYTES:-1GiB}"
changes="${PEERS_CHANGES:-dp4to2 dp2to4 tp2to1 pp2to1}"
timeout_s="${PEERS_TIMEOUT_S:-900}"
bin="$build/bench/restart_baseline_bench"
[[ -x "$bin" ]] || { echo "run_peers: $bin not built (cmake --build $build --target restart_baseline_bench)" >&2; exit 1; }

python="$(PEERS_VENV="${PEERS_VENV:-$build/peers-venv}" "$repo/bench/peers/setup_torch.sh" | tail -n 1)"
tmp="$build/bench-tmp"
mkdir -p "$tmp"
rc=0
for change in $changes; do
  cpp="$(timeout "$timeout_s" "$bin" --bytes="$bytes" --changes="$change" \
         --dir="$tmp/restart_baseline")" || { echo "run_peers: restart baseline $change failed" >&2; rc=1; continue; }
  echo "$cpp"
  dcp="$(timeout "$timeout_s" "$python" "$repo/bench/peers/dcp_reconfig.py" --change "$change" \
         --bytes "$bytes" --layout-bin "$bin" --dir "$tmp/dcp" --timeout "$timeout_s" \
         2>"$tmp/dcp-$change.log")" || { echo "run_peers: DCP $change failed, see $tmp/dcp-$change.log" >&2; rc=1; continue; }
  echo "$dcp"
  python3 - "$cpp" "$dcp" <<'PY'
import json, sys
cpp, dcp = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(json.dumps({
    "name": "restart_baseline_vs_dcp/" + cpp["change"], "change": cpp["change"],
    "bytes": cpp["bytes"], "seconds": cpp["seconds"], "dcp_seconds": dcp["seconds"],
    "ratio_vs_dcp": round(dcp["seconds"] / cpp["seconds"], 2),
    "dcp_seconds_excl_import": dcp["seconds_excl_import"],
    "ratio_vs_dcp_excl_import": round(dcp["seconds_excl_import"] / cpp["seconds"], 2),
    "verified": cpp["verified"] and dcp["verified"]}))
PY
done
exit "$rc"
