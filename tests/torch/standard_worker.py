"""A worker of the standard-torch elastic test (standard_test.sh): a program written the standard
way — a model built on `meta`, `parallelize_module` (TP) and `fully_shard` (FSDP2) on the
generation's mesh, `to_empty`, `torch.optim.AdamW`, a warmup-cosine `LambdaLR` — handed to
morph.elastic as its build function.

At every step rank 0 appends the step's loss and learning rate to <out>/loss.jsonl. Between steps
every rank saves the state through DCP, as torch's own checkpointing writes it (the model's and
the optimizer's state dicts of torch.distributed.checkpoint.state_dict), so that at the first step
of a new generation each rank compares its parameters and optimizer state, bitwise, with DCP's
load of that save into the new layout (the oracle); one line per change in <out>/events.jsonl.

  standard_worker.py --steps 16 --out DIR [--kill-at STEP --kill-rank R] [--schedule 1f1b]

With --schedule (gpipe, 1f1b) the build makes this stage's part (the layers of ctx.layers),
a PipelineStage on ctx.pp_group and the schedule, and every step runs job.schedule.step over
2 micro-batches of the rank's samples.
"""
import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict)
from torch.utils._pytree import tree_flatten_with_path, tree_map

import morph

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=16)
p.add_argument("--out", required=True)
p.add_argument("--kill-at", type=int, default=-1)
p.add_argument("--kill-rank", type=int, default=1)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--hold-file", default=None,
               help="while this file exists every step sleeps 1.5 s more: the driver holds the "
                    "job's steps while a joiner starts (on a loaded machine its torch import and "
                    "discovery build can outlast the remaining steps)")
p.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], default=None,
               help="train through a torch.distributed.pipelining schedule (pp allowed)")
p.add_argument("--no-oracle", action="store_true",
               help="no DCP save per step, only after the last (the reference)")
a = p.parse_args()
os.makedirs(a.out, exist_ok=True)
pid = os.getpid()
if os.path.isdir(os.path.join(a.out, "pids")):
    open(os.path.join(a.out, "pids", str(pid)), "w").close()

import functools  # noqa: E402

from standard_model import (BATCH, CHUNKS, LAYERS, batch_of, build,  # noqa: E402
                            build_interleaved, init, interleaved_layer_of, loss_of,
                            pipeline_loss)


def log(name, **kv):
    kv.update(pid=pid, t=time.time())
    with open(os.path.join(a.out, name), "a") as f:
        f.write(json.dumps(kv) + "\n")


def torch_state(job):
    """The model's and the optimizer's state dicts, as torch's DCP integration writes them (by
    model part: optimizer i is part i's; flattened, so that the parts' entries merge)."""
    model, optim = {}, {}
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    for m, o in zip(job.models, job.optimizers):
        model.update(get_model_state_dict(m))
        optim.update(get_optimizer_state_dict(m, o, options=flat))
    return {"model": model, "optim": optim}


def leaves(sd):
    return {"/".join(str(k) for k in path): v for path, v in tree_flatten_with_path(sd)[0]}


def check_oracle(job, index):
    """This generation's state against DCP's load (into this layout) of the save at `index`."""
    path = os.path.join(a.out, "dcp", f"at-{index}")
    if not os.path.exists(os.path.join(path, ".metadata")):
        return "no-checkpoint", 0
    live = torch_state(job)
    want = tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, live)
    for t in leaves(want).values():  # nothing of the live state may pass for the loaded one
        if isinstance(t, torch.Tensor):
            (t.to_local() if hasattr(t, "to_local") else t).fill_(float("nan"))
    dcp.load(want, checkpoint_id=path)
    got, exp = leaves(live), leaves(want)
    n = 0
    for k, t in got.items():
        if not isinstance(t, torch.Tensor):
            continue
        x = t.to_local() if hasattr(t, "to_local") else t
        y = exp[k].to_local() if hasattr(exp[k], "to_local") else exp[k]
        if x.shape != y.shape or not torch.equal(x.reshape(-1).view(torch.uint8),
                                                 y.reshape(-1).view(torch.uint8)):
            return f"differs:{k}", n
        n += 1
    return "ok", n


extra = dict(pp_candidates=[1, 2], num_layers=LAYERS) if a.schedule else {}
fn = functools.partial(build, schedule=a.schedule)
if a.schedule == "interleaved":  # 2 stages per pipeline rank; the layers numbered for pp 2
    fn = build_interleaved
    extra.update(num_layers=CHUNKS, layer_of=interleaved_layer_of)
job = morph.elastic(fn, init=init, global_batch=BATCH, dataset_samples=10_000,
                    tp_candidates=[1, 2], **extra)
while True:
    index = None
    with job.step() as step:
        if step.done or step.index >= a.steps:
            break
        if step.reconfigured:
            rc = job.runtime.last_reconfiguration
            oracle, tensors = check_oracle(job, step.index)
            log("events.jsonl", event="reconfigured", step=step.index, rank=step.rank,
                world=step.world_size, config=[step.config.dp, step.config.tp, step.config.pp],
                recovery=rc.recovery, oracle=oracle, tensors=tensors)
        if a.kill_at == step.index and step.rank == a.kill_rank and \
                not os.path.exists(os.path.join(a.out, "kill.json")):
            with open(os.path.join(a.out, "kill.json"), "w") as f:
                json.dump({"t": time.time(), "pid": pid}, f)
            os.kill(pid, signal.SIGKILL)
        if a.schedule:  # the last stage's (one TP rank's) losses, summed over the world
            loss = pipeline_loss(job, step, batch_of(step.samples))
            total = loss.detach().clone() if step.coords[0] == step.config.pp - 1 and \
                step.coords[2] == 0 else torch.zeros(())
            dist.all_reduce(total, group=step.groups.world)
        else:
            loss = loss_of(job.model, batch_of(step.samples))
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total, group=step.groups.dp)
        lr = job.optimizers[0].param_groups[0]["lr"]
        for o in job.optimizers:  # one per model part; morph's commit vote first
            o.step()
        for sc in job.schedulers:
            sc.step()
        for o in job.optimizers:
            o.zero_grad()
        if a.step_sleep:
            time.sleep(a.step_sleep)
        if a.hold_file and os.path.exists(a.hold_file):
            time.sleep(1.5)
        if step.rank == 0:
            log("loss.jsonl", step=step.index, loss=total.item(), lr=lr,
                config=[step.config.dp, step.config.tp, step.config.pp])
        index = step.index
    if index is not None and (not a.no_oracle or index + 1 == a.steps):
        try:
            dcp.save(torch_state(job), checkpoint_id=os.path.join(a.out, "dcp", f"at-{index + 1}"))
        except Exception as e:  # a peer failed while saving: that step has no oracle
            log("events.jsonl", event="save_failed", step=index + 1, error=str(e)[:200])
job.finish()
job.close()
