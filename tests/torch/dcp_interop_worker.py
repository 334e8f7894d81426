"""DCP in and out (dcp_interop_test.sh): the standard-torch model (standard_model.py) trained by a
plain PyTorch program — one process, torch's own Gloo group, no morph runtime — and by a morph
job, each loading what the other saved with torch.distributed.checkpoint.

  dcp_interop_worker.py plain --out DIR --steps N [--load CK --from-step K] [--save-at S]
      trains steps K..N-1 (the plain run: all of each step's samples, one rank), optionally
      loading CK first and saving DIR/ck-plain-S before step S
  dcp_interop_worker.py elastic --out DIR --steps M --offset K --load CK [--save-at J]
      a morph job (under morphrun) that loads CK at its first step and trains M steps on the
      samples of steps K.. (morph's step counter starts at 0; the data position is the
      program's offset), saving DIR/ck-morph-(K+J) before its step J with job.save

Checkpoints hold {"model", "optim"} (torch's state dicts, the optimizer's flattened as torchtitan
saves it) and "lr_scheduler". Rank 0 appends {"step", "loss", "lr"} lines to DIR/loss.jsonl, steps
counted in the plain run's numbering.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from standard_model import BATCH, batch_of, build, init  # noqa: E402
from standard_model import loss_of  # noqa: E402

import morph  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("mode", choices=["plain", "elastic"])
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, required=True)
p.add_argument("--from-step", type=int, default=0)
p.add_argument("--offset", type=int, default=0)
p.add_argument("--load", default="")
p.add_argument("--save-at", type=int, default=-1)
a = p.parse_args()
os.makedirs(a.out, exist_ok=True)
N = 10_000
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def log(step, loss, lr):
    with open(os.path.join(a.out, "loss.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, "loss": loss, "lr": lr}) + "\n")


def plain():
    """A plain torch program: one process, its own Gloo group, the same build function."""
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    ctx = morph.BuildContext(mesh=mesh, device=torch.device("cpu"), fresh=True, config=None,
                             coords=(0, 0, 0), layers=[0, 1], num_layers=2)
    model, opt, sched = build(ctx)
    with torch.no_grad():
        for fqn, prm in model.named_parameters():
            prm.to_local().copy_(init(fqn))
    if a.load:
        sd = {"model": get_model_state_dict(model),
              "optim": get_optimizer_state_dict(model, opt, options=FLAT),
              "lr_scheduler": sched.state_dict()}
        dcp.load(sd, checkpoint_id=a.load)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"], options=FLAT)
        sched.load_state_dict(sd["lr_scheduler"])
    cursor = morph.DatasetCursor(N, BATCH)
    for s in range(a.from_step, a.steps):
        if s == a.save_at:
            dcp.save({"model": get_model_state_dict(model),
                      "optim": get_optimizer_state_dict(model, opt, options=FLAT),
                      "lr_scheduler": sched.state_dict()},
                     checkpoint_id=os.path.join(a.out, f"ck-plain-{s}"))
        lo, hi = cursor.range_for(s, 1, 0)
        loss = loss_of(model, batch_of(cursor.sample_at(i) for i in range(lo, hi)))
        loss.backward()
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        opt.zero_grad()
        log(s, loss.item(), lr)
    dist.destroy_process_group()


def elastic():
    job = morph.elastic(build, init=init, global_batch=BATCH, dataset_samples=N,
                        tp_candidates=[1, 2])
    cursor = morph.DatasetCursor(N, BATCH)  # the job's (seed 0, shuffled)
    while True:
        with job.step() as step:
            if step.done or step.index >= a.steps:
                break
            s = step.index + a.offset
            if step.index == 0 and a.load:
                extra = {"lr_scheduler": job.scheduler.state_dict()}
                job.load(a.load, extra)  # the model and the optimizer, into morph's storage
                job.scheduler.load_state_dict(extra["lr_scheduler"])
            if step.index == a.save_at:
                job.save(os.path.join(a.out, f"ck-morph-{s}"),
                         {"lr_scheduler": job.scheduler.state_dict()})
            c = step.config
            lo, hi = cursor.range_for(s, c.dp, step.coords[1])
            loss = loss_of(job.model, batch_of(cursor.sample_at(i) for i in range(lo, hi)))
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total, group=step.groups.dp)
            lr = job.optimizer.param_groups[0]["lr"]
            job.optimizer.step()
            job.scheduler.step()
            job.optimizer.zero_grad()
            if step.rank == 0:
                log(s, total.item(), lr)
    job.finish()
    job.close()


plain() if a.mode == "plain" else elastic()
