"""The Python package's worker for the end-to-end reconfiguration benchmark (`make bench-torch`).

runtime_bench --worker-cmd "<python> bench/torch/reconfig_worker.py" --label python launches it
in place of its C++ worker mode and measures it the same way: the same model
(bench/reconfig_cases.h: 8 layers of two f32 [rows, 2048] matrices, w_in split on dim 0 and
w_out on dim 1 under TP, each with Adam moments `.adam_m`/`.adam_v` ZeRO-sharded over DP), the
same step (an all-reduce of one integer over the world, through this generation's torch process
group, and a 5 ms sleep) and the same log line per worker at the first step of a new generation
(OUT/bench-<worker id>.jsonl; the driver reads first_step_ns, the phases and the bytes).

Everything a PyTorch program pays is in the figure: morph.start, the state's tensors allocated
by torch (zero copy), torch.distributed process groups rebuilt at each generation.
"""
import time

process_start_ns = time.time_ns()  # before importing torch: a joiner's start counts it

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

import morph

LAYERS = 8
COLS = 2048


def rows_for(unique_bytes: int) -> int:
    """ReconfigRows: 2 matrices per layer, 3 copies (param, m, v), 4 bytes per element."""
    per_row = LAYERS * 2 * 3 * COLS * 4
    return max(8, unique_bytes // per_row // 8 * 8)


def declare(rows: int):
    def _declare(s: morph.State) -> None:
        for layer in range(LAYERS):
            for m, kind in enumerate(("w_in", "w_out")):
                name = f"layers.{layer}.{kind}"
                layout = morph.Layout.layer(layer).split_tp(m)
                s.add_tensor(name, shape=(rows, COLS), layout=layout)
                s.add_tensor(name + ".adam_m", shape=(rows, COLS), layout=layout.zero_shard())
                s.add_tensor(name + ".adam_v", shape=(rows, COLS), layout=layout.zero_shard())
        s.add_scalar("step", 8)
    return _declare


def status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=1 << 30)
    a = ap.parse_args()
    rt = morph.start(declare(rows_for(a.bytes)), num_layers=LAYERS, tp_candidates=[1, 2],
                     pp_candidates=[1, 2], global_batch=16, zero_stage=1,
                     dataset_samples=1 << 16)
    log = open(os.path.join(a.out, f"bench-{rt.worker_id}.jsonl"), "a")
    steady_rss = 0
    one = torch.ones(1, dtype=torch.int64)
    while True:
        with rt.step() as step:
            if step.done or step.index >= a.steps:
                break
            if step.index == 2 and step.generation == 1:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                steady_rss = status_bytes("VmRSS:")
            r = rt.last_reconfiguration
            if step.reconfigured and r is not None:
                first_step_ns = time.time_ns()
                peak = status_bytes("VmHWM:")
                log.write(json.dumps({
                    "worker": rt.worker_id, "generation": r.generation, "old_rank": r.old_rank,
                    "process_start_ns": process_start_ns, "rank": r.rank,
                    "first_step_ns": first_step_ns,
                    "communicators": r.communicators_seconds, "plan": r.plan_seconds,
                    "transfer": r.transfer_seconds, "resume": r.resume_seconds,
                    "stall": r.stall_seconds, "process_groups": step.groups.seconds, "pg_phases": step.groups.phases, "bytes_received": r.bytes_received,
                    "bytes_sent": r.bytes_sent, "local_bytes": rt.state.local_bytes,
                    "peak_bytes": r.peak_bytes, "bound_bytes": r.bound_bytes,
                    "old_state_bytes": r.old_state_bytes, "prepare_bytes": r.prepare_bytes,
                    "new_state_bytes": r.new_state_bytes,
                    "rss_extra_bytes": peak - steady_rss if steady_rss else 0}) + "\n")
                log.flush()
            dist.all_reduce(one, group=step.groups.world)
            time.sleep(0.005)
    rt.finish()
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
