"""torchtitan's Llama 3 debug model, parallelized by torchtitan, made elastic by morph: the
build function of titan_model.py handed to morph.elastic, and a training loop. Run under
morphrun (README.md); alone it is a one-worker job.

  morphrun -n 2 --max 4 -- python train.py --steps 16 --out DIR

Rank 0 appends each step's loss and learning rate to DIR/loss.jsonl; the first step of every
generation appends the new world and configuration to DIR/events.jsonl.
"""
import argparse
import json
import os
import sys
import time

import torch.distributed as dist

import morph

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from titan_model import BATCH, batch_of, build, init, loss_of  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=16)
p.add_argument("--out", required=True)
p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to wait after each step")
a = p.parse_args()
os.makedirs(a.out, exist_ok=True)


def log(name, **kv):
    kv.update(pid=os.getpid(), t=time.time())
    with open(os.path.join(a.out, name), "a") as f:
        f.write(json.dumps(kv) + "\n")


job = morph.elastic(build, init=init, global_batch=BATCH, dataset_samples=100_000,
                    tp_candidates=[1, 2])
while True:
    with job.step() as step:
        if step.done or step.index >= a.steps:
            break
        config = [step.config.dp, step.config.tp, step.config.pp]
        if step.reconfigured:
            log("events.jsonl", event="reconfigured", step=step.index, rank=step.rank,
                world=step.world_size, config=config)
        loss = loss_of(job.model, batch_of(step.samples))
        loss.backward()
        total = loss.detach().clone()  # this rank's part of the global batch's mean loss
        dist.all_reduce(total, group=step.groups.dp)
        lr = job.optimizer.param_groups[0]["lr"]
        job.optimizer.step()  # morph's commit vote first
        job.scheduler.step()
        job.optimizer.zero_grad()
        if step.rank == 0:
            log("loss.jsonl", step=step.index, loss=total.item(), lr=lr, config=config)
        if a.step_sleep:
            time.sleep(a.step_sleep)
job.finish()
job.close()
