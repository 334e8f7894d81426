"""A grow whose joiner has a slow setup (issue 34): how long do the survivors stall?

A standard PyTorch program (FSDP2 + AdamW, handed to morph.elastic) whose process spends
--setup seconds once before its first build (what a real program spends importing torch's
compiler stack at its first optimizer construction, loading a tokenizer, warming kernels):

  --setup-at discovery   the setup runs in the discovery build, before the process joins (what
                         morph.elastic does with a program's first build)
  --setup-at admitted    the setup runs at the process's first build after it was admitted (as a
                         program that sets itself up after morph.start returns: before issue 34)

Run under morphrun -n 2 with `morphctl resize 3` (run_torch_bench.sh): every worker records each
step's wall time; rank 0 of the new generation prints one JSON line: the survivors' stall, the
longest step around the change minus the median step before it.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import morph

p = argparse.ArgumentParser()
p.add_argument("--setup", type=float, default=3.0)
p.add_argument("--setup-at", choices=["discovery", "admitted"], default="discovery")
p.add_argument("--steps", type=int, default=120)
p.add_argument("--step-sleep", type=float, default=0.05)
p.add_argument("--out", required=True)
a = p.parse_args()
os.makedirs(a.out, exist_ok=True)
setup_done = False


def build(ctx):
    global setup_done
    if not setup_done and ctx.discovery == (a.setup_at == "discovery"):
        time.sleep(a.setup)
        setup_done = True
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    for layer in model:
        fully_shard(layer, mesh=ctx.mesh["dp"])
    fully_shard(model, mesh=ctx.mesh["dp"])
    model.to_empty(device=ctx.device)
    if ctx.fresh:
        with torch.no_grad():
            for prm in model.parameters():
                prm.to_local().normal_(0, 0.02)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


job = morph.elastic(build, global_batch=8, dataset_samples=1000)
times, generation_of, first_new = {}, {}, None
last = time.perf_counter()
while True:
    with job.step() as step:
        if step.done or step.index >= a.steps:
            break
        x = torch.randn(len(step.samples), 256)
        job.model(x).square().sum().backward()
        job.optimizer.step()
        job.optimizer.zero_grad()
        time.sleep(a.step_sleep)
        now = time.perf_counter()
        times[step.index], last = now - last, now
        generation_of[step.index] = step.generation
        if step.index == 10 and step.rank == 0:
            open(os.path.join(a.out, "trained-10"), "w").close()  # the runner resizes now
        if step.reconfigured and first_new is None:
            first_new = (step.index, step.rank, step.world_size)
job.finish()
job.close()
if first_new is not None and first_new[1] == 0 and first_new[2] == 3 and \
        any(i < first_new[0] for i in times):
    s = first_new[0]  # rank 0 of the new generation, a survivor (it trained before the change)
    before = [times[i] for i in range(max(0, s - 30), s) if i in times]
    around = [times[i] for i in range(s - 1, min(s + 3, a.steps)) if i in times]
    print(json.dumps({"name": "torch_joiner_setup", "setup_at": a.setup_at,
                      "setup_seconds": a.setup, "switch_step": s,
                      "step_seconds_median": round(statistics.median(before), 4),
                      "survivor_stall_seconds": round(max(around) - statistics.median(before), 4),
                      }), flush=True)
