#!/usr/bin/env bash
# `make bench-failures` (issue 10): morph's recovery from a SIGKILLed worker
# (build/bench/failures_bench: real worker processes through the Launcher) next to, in the same
# session, the checkpoint-restart baselines (the C++ restart baseline for dp 4 -> 3 and PyTorch
# DCP for dp 4 -> 2, run_peers.sh's programs on the same model) and TorchFT
# (torchft_failover.py: two replica groups, one killed). JSON lines; the comparison lines
# `failure_vs_peers/<case>` carry ratio_vs_baseline (peer seconds / morph seconds).
#
#   FAILURES_BYTES=1GiB bench/peers/run_failures_bench.sh
#   FAILURES_CASES="hybrid,stall" FAILURES_PEERS=0 FAILURES_TORCHFT=0 ...   # morph only
#   TORCHFT_TRIALS=1 TORCHFT_ARGS="--jobs stall --stall-heartbeats-ms 1000" ...  # a short TorchFT
#
# Why DCP runs dp 4 -> 2 and not 4 -> 3: DCP keeps a ZeRO moment as a row-sharded DTensor, and
# dp 3's flat ranges of these matrices are not whole rows. 4 -> 2 loads fewer bytes (1.43 GB
# against 1.79 GB for 4 -> 3), so it favours DCP. DCP's `seconds` include the save, as in the
# runtime benchmark; `restart_load_seconds` (restart + load) is what remains once the save is
# taken to have happened before the failure (periodic checkpoints), the fairest reading for DCP.
# Never part of `make test`.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${BUILD_DIR:-build}"
[[ "$build" = /* ]] || build="$repo/$build"
bytes="${FAILURES_BYTES:-1GiB}"
cases="${FAILURES_CASES:-hybrid,snapshot,stall,heal,step_cost}"
peers="${FAILURES_PEERS:-1}"
torchft="${FAILURES_TORCHFT:-1}"
timeout_s="${PEERS_TIMEOUT_S:-900}"
tmp="$build/bench-tmp"
mkdir -p "$tmp"
morph_lines="$tmp/failures_bench.jsonl"
: >"$morph_lines"
rc=0
"$build/bench/failures_bench" --bytes "$bytes" --cases "$cases" | tee "$morph_lines" || {
  echo "run_failures_bench: failures_bench failed (morph rows above are the ones measured)" >&2
  rc=1
}
peer_lines="$tmp/failures_peers.jsonl"
: >"$peer_lines"
if [[ "$peers" == 1 ]]; then
  timeout "$timeout_s" "$build/bench/restart_baseline_bench" --bytes="$bytes" --changes=dp4to3 \
    --dir="$tmp/restart_baseline" | tee -a "$peer_lines" || rc=1
  python="$(PEERS_VENV="${PEERS_VENV:-$build/peers-venv}" "$repo/bench/peers/setup_torch.sh" | tail -n 1)"
  timeout "$timeout_s" "$python" "$repo/bench/peers/dcp_reconfig.py" --change dp4to2 \
    --bytes "$bytes" --layout-bin "$build/bench/restart_baseline_bench" --dir "$tmp/dcp" \
    --timeout "$timeout_s" 2>"$tmp/dcp-failures.log" | tee -a "$peer_lines" ||
    { echo "run_failures_bench: DCP failed, see $tmp/dcp-failures.log" >&2; rc=1; }
fi
if [[ "$torchft" == 1 ]]; then
  python="$(PEERS_VENV="${PEERS_VENV:-$build/peers-venv}" "$repo/bench/peers/setup_torchft.sh" | tail -n 1)"
  timeout "$timeout_s" "$python" "$repo/bench/peers/torchft_failover.py" \
    --trials "${TORCHFT_TRIALS:-3}" --dir "$tmp/torchft" ${TORCHFT_ARGS:-} | tee -a "$peer_lines" ||
    { echo "run_failures_bench: TorchFT failed, see $tmp/torchft/" >&2; rc=1; }
fi
python3 - "$morph_lines" "$peer_lines" <<'PY'
import json, sys
morph = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
peers = [json.loads(l) for l in open(sys.argv[2]) if l.strip().startswith("{")]
by = {p["name"]: p for p in peers}
cpp, dcp = by.get("restart_baseline/dp4to3"), by.get("dcp/dp4to2")
def torchft(kind, hb, size=None):
    for p in peers:
        n = p["name"].split("/")
        if n[:2] == ["torchft", kind] and n[-1] == f"hb{hb}ms" and (size is None or n[2] == size):
            return p
for m in morph:
    name, sec = m["name"], m["seconds"]
    short = name[len("failure/"):] if name.startswith("failure/") else name
    out = {"name": "failure_vs_peers/" + short, "bytes": m["bytes"],
           "seconds": sec}
    if name in ("failure/hybrid", "failure/snapshot") and sec > 0:
        if cpp:
            out.update(cpp_restart_seconds=cpp["seconds"],
                       ratio_vs_cpp_baseline=round(cpp["seconds"] / sec, 1))
        if dcp:
            rl = dcp["restart_s"] + dcp["load_s"]
            out.update(dcp_seconds=dcp["seconds"], ratio_vs_baseline=round(dcp["seconds"] / sec, 1),
                       ratio_vs_dcp=round(dcp["seconds"] / sec, 1),
                       dcp_restart_load_seconds=round(rl, 4),
                       ratio_vs_dcp_restart_load=round(rl / sec, 1),
                       dcp_seconds_excl_import=dcp["seconds_excl_import"],
                       ratio_vs_dcp_excl_import=round(dcp["seconds_excl_import"] / sec, 1),
                       target_ratio_vs_dcp=10)
    elif name == "failure/stall" and m["stall_seconds"] > 0:
        out["stall_seconds"] = m["stall_seconds"]
        for hb in (5000, 1000):
            t = torchft("stall", hb)
            if t:
                out[f"torchft_stall_hb{hb}ms_seconds"] = t["seconds"]
                out[f"ratio_vs_torchft_hb{hb}ms"] = round(t["seconds"] / m["stall_seconds"], 1)
        out["ratio_vs_baseline"] = out.get("ratio_vs_torchft_hb1000ms")
    elif name.startswith("heal/") and sec > 0:
        t = torchft("heal", 5000, name.split("/")[1])
        if t:
            out.update(torchft_heal_seconds=t["seconds"],
                       torchft_heal_seconds_excl_import=t["seconds_excl_import"],
                       ratio_vs_baseline=round(t["seconds"] / sec, 1),
                       ratio_vs_torchft_excl_import=round(t["seconds_excl_import"] / sec, 1))
    else:
        continue
    print(json.dumps(out))
PY
exit "$rc"
