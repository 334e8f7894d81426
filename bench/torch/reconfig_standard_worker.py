"""The standard-PyTorch worker of the end-to-end reconfiguration benchmark (`make bench-torch`,
issue 34): reconfig_worker.py's model, state size and step written the way a torch program is
written and handed to morph.elastic.

runtime_bench --worker-cmd "<python> bench/torch/reconfig_standard_worker.py" --label standard
launches it as it launches reconfig_worker.py (given --bytes and --out) and measures it the same
way: the log line per worker at the first step of a new generation (OUT/bench-<worker id>.jsonl:
first_step_ns, the phases, the bytes), the same step (an all-reduce of one integer over the world
on this generation's torch process group, and a 5 ms sleep; no forward, backward or optimizer
step: the benchmark is the change, not training).

The model: 8 layers (nn.ModuleDict "layers.<i>"), each an MLP of two bias-free nn.Linear,
w_in = Linear(2048, rows) (weight [rows, 2048]) and w_out = Linear(rows, 2048) (weight
[2048, rows]), built on `meta`; under TP `parallelize_module` on ctx.mesh["tp"] with
ColwiseParallel (w_in: Shard(0)) and RowwiseParallel (w_out: Shard(1), the rows dimension);
`fully_shard` (FSDP2) of every layer and the root on ctx.mesh["dp"]; under PP only the stage's
layers (ctx.layers, whole-model names); `to_empty`; torch.optim.AdamW, whose exp_avg and
exp_avg_sq morph creates (before the first step, as torch would) over its storage. The build
runs at every generation's first step: its cost is in the figure, as are the discovery build
and the fake world before joining (a joiner's setup; none joins in these changes).

The unique state is the same bytes as reconfig_worker.py's (16 matrices of rows x 2048 f32, each
with two moments: rows from ReconfigRows), plus what torch's optimizer keeps that the hand-written
one does not: AdamW's per-parameter `step` (16 x 4 bytes) and the optimizers' and schedulers'
hyper-parameters (morph.elastic's 64 KiB scalar). Its layout differs: FSDP2 shards the
parameters over DP too (ZeRO-3), where the hand-written worker replicates them (ZeRO-1; moments
sharded in both), so a DP change moves and holds fewer bytes per rank here. `--print-state`
prints both workers' registered bytes (the discovery build only, no job). Each log line also
has build_seconds (the build function's own time at that generation) and step_enter_seconds
(`with job.step()` entry to the block: the runtime's stall, then the build and morph binding
its objects to the state); with TORCH_BENCH_STANDARD_LOG=<file> the lines go there too.
"""
import time

process_start_ns = time.time_ns()  # before importing torch: a joiner's start counts it

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import morph

LAYERS = 8
COLS = 2048


def rows_for(unique_bytes: int) -> int:
    """ReconfigRows: 2 matrices per layer, 3 copies (param, m, v), 4 bytes per element."""
    per_row = LAYERS * 2 * 3 * COLS * 4
    return max(8, unique_bytes // per_row // 8 * 8)


class Block(nn.Module):
    def __init__(self, rows: int):
        super().__init__()
        self.w_in = nn.Linear(COLS, rows, bias=False)   # weight [rows, 2048]
        self.w_out = nn.Linear(rows, COLS, bias=False)  # weight [2048, rows]

    def forward(self, x):
        return x + self.w_out(torch.relu(self.w_in(x)))


class Net(nn.Module):
    def __init__(self, rows: int, layers):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block(rows) for i in layers})

    def forward(self, x):
        for b in self.layers.values():
            x = b(x)
        return x


BUILD_SECONDS = [0.0]  # the last build's own time (the objects; binding them is morph's)


def make_build(rows: int):
    def build(ctx):
        t = time.perf_counter()
        with torch.device("meta"):
            model = Net(rows, ctx.layers)  # this pipeline stage's layers, whole-model names
        if ctx.mesh["tp"].size() > 1:
            for b in model.layers.values():
                parallelize_module(b, ctx.mesh["tp"],
                                   {"w_in": ColwiseParallel(), "w_out": RowwiseParallel()})
        for b in model.layers.values():
            fully_shard(b, mesh=ctx.mesh["dp"])
        fully_shard(model, mesh=ctx.mesh["dp"])
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
        model.to_empty(device=ctx.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        BUILD_SECONDS[0] = time.perf_counter() - t
        return model, opt
    return build


def status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def print_state(unique_bytes: int) -> int:
    """Both workers' registered state, from the discovery build (morph.elastic's first part)."""
    from morph._elastic import _HYPER_BYTES, _discover
    rows = rows_for(unique_bytes)
    params, opts, _ = _discover(make_build(rows), 2, LAYERS, None)
    tensor = step = 0
    for p in params:
        n = 4 * torch.Size(p.shape).numel()
        tensor += n
        for entry, kind in opts[0].get(p.fqn, []):
            if kind == "param":
                tensor += n
            else:
                step += 4
    hand = LAYERS * 2 * 3 * rows * COLS * 4
    print(json.dumps({
        "name": "torch_state_bytes", "requested_bytes": unique_bytes, "rows": rows,
        "handwritten_tensor_bytes": hand, "handwritten_scalar_bytes": 8,
        "standard_tensor_bytes": tensor, "standard_step_bytes": step,
        "standard_hyper_bytes": _HYPER_BYTES, "tensors_equal": tensor == hand,
        "params": len(params),
        "shapes": sorted({str(list(p.shape)) for p in params})}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--out")
    ap.add_argument("--steps", type=int, default=1 << 30)
    ap.add_argument("--print-state", action="store_true")
    a = ap.parse_args()
    if a.print_state:
        return print_state(a.bytes)
    job = morph.elastic(make_build(rows_for(a.bytes)), num_layers=LAYERS, tp_candidates=[1, 2],
                        pp_candidates=[1, 2], global_batch=16, zero_stage=1,
                        dataset_samples=1 << 16)
    rt = job.runtime
    log = open(os.path.join(a.out, f"bench-{rt.worker_id}.jsonl"), "a")
    # run_torch_bench.sh's copy of the lines (runtime_bench removes OUT): the build's share.
    extra = os.environ.get("TORCH_BENCH_STANDARD_LOG")
    extra = open(extra, "a") if extra else None
    steady_rss = 0
    one = torch.ones(1, dtype=torch.int64)
    while True:
        enter = time.perf_counter()
        with job.step() as step:  # at a generation's first step: the build ran, state bound
            enter = time.perf_counter() - enter
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
                line = json.dumps({
                    "worker": rt.worker_id, "generation": r.generation, "old_rank": r.old_rank,
                    "process_start_ns": process_start_ns, "rank": r.rank,
                    "first_step_ns": first_step_ns,
                    "communicators": r.communicators_seconds, "plan": r.plan_seconds,
                    "transfer": r.transfer_seconds, "resume": r.resume_seconds,
                    "stall": r.stall_seconds, "process_groups": step.groups.seconds,
                    "pg_phases": step.groups.phases, "bytes_received": r.bytes_received,
                    "bytes_sent": r.bytes_sent, "local_bytes": rt.state.local_bytes,
                    "peak_bytes": r.peak_bytes, "bound_bytes": r.bound_bytes,
                    "old_state_bytes": r.old_state_bytes, "prepare_bytes": r.prepare_bytes,
                    "new_state_bytes": r.new_state_bytes,
                    "rss_extra_bytes": peak - steady_rss if steady_rss else 0,
                    "step_enter_seconds": enter, "build_seconds": BUILD_SECONDS[0]}) + "\n"
                log.write(line)
                log.flush()
                if extra:
                    extra.write(json.dumps({"out": a.out, "change_generation": r.generation,
                                            **json.loads(line)}) + "\n")
                    extra.flush()
            dist.all_reduce(one, group=step.groups.world)
            time.sleep(0.005)
    job.finish()
    job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
