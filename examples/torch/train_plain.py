"""Trains the Llama-style decoder of llama.py on the fortunes bytes, written the standard way: a
build function (model on `meta`, `parallelize_module` on the "tp" mesh, `fully_shard` on "dp",
`to_empty`, `torch.optim.AdamW`, a warmup-cosine `LambdaLR`), a map-style dataset, a loop of
micro-batches. train_plain.py runs it on one fixed mesh under torchrun; train.py is the same
program made elastic by morph (`diff -u train_plain.py train.py`, README.md):

    torchrun --nproc-per-node 4 examples/torch/train_plain.py --tp 2 --steps 200
    morphrun -n 4 -- python examples/torch/train.py --tp 2 --steps 200

Rank 0 prints a line per step (none with --quiet); --out DIR: metrics.py's files.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama import (Fortunes, Llama, LlamaArgs, init_weights, load_corpus,  # noqa: E402
                   stage_layers, tp_plan)
from metrics import Metrics  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--global-batch", type=int, default=24, help="samples per step, all ranks")
    p.add_argument("--micro-batch", type=int, default=6, help="samples per forward and backward")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10, help="steps of linear warmup, then cosine")
    p.add_argument("--seed", type=int, default=1, help="initial weights and the sample order")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size (train.py: the planner picks one of its divisors)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (train.py: its divisors)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (pacing)")
    p.add_argument("--quiet", action="store_true", help="no line per step")
    p.add_argument("--out", default="", help="metrics.tsv, events.tsv and pids/ (metrics.py)")
    return p.parse_args()


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def build(ctx, a: argparse.Namespace):
    """The model, its optimizer, LR scheduler and pipeline schedule on `ctx.mesh` ("pp", "dp" and
    "tp" dimensions): this stage's layers `ctx.layers`, materialized on `ctx.device`, initialized
    when `ctx.fresh`; with pipeline stages a PipelineStage on the pp group and a GPipe schedule
    over the rank's micro-batches (None without)."""
    args = LlamaArgs(n_layers=a.layers)
    with torch.device("meta"):
        model = Llama(args, ctx.layers, 0 in ctx.layers, args.n_layers - 1 in ctx.layers)
    if ctx.mesh["tp"].size() > 1:
        for block in model.layers.values():
            parallelize_module(block, ctx.mesh["tp"], tp_plan())
    for block in model.layers.values():
        fully_shard(block, mesh=ctx.mesh["dp"])
    fully_shard(model, mesh=ctx.mesh["dp"])
    for module in model.modules():  # the loss is divided by the global batch: sum over DP
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a SUM: Gloo has no PREMUL_SUM
    model.to_empty(device=ctx.device)
    model.reset_buffers()
    if ctx.fresh:
        init_weights(model, a.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        opt, functools.partial(warmup_cosine, warmup=a.warmup, total=a.steps))
    if ctx.num_stages == 1:
        return model, opt, scheduler, None
    dp, d = ctx.mesh["dp"].size(), ctx.mesh["dp"].get_local_rank()
    samples = a.global_batch // dp + (d < a.global_batch % dp)  # this DP rank's slice
    stage = PipelineStage(model, ctx.stage, ctx.num_stages, ctx.device, group=ctx.pp_group)
    return model, opt, scheduler, ScheduleGPipe(
        stage, n_microbatches=-(-samples // a.micro_batch),
        loss_fn=functools.partial(token_loss, a=a), scale_grads=False)


def token_loss(logits, y, a):
    """A micro-batch's token loss summed, over the global batch's token count: summed over
    micro-batches and DP ranks it is the global batch's mean loss (FSDP2 sums over DP)."""
    tokens = a.global_batch * LlamaArgs.seq
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / tokens


def train_step(index, model, optimizer, scheduler, schedule, micro_batches, mesh, metrics, a):
    """One step: forward and backward of this rank's micro-batches (through the pipeline
    schedule when there is one: it cuts the rank's samples itself), the optimizer's step."""
    total = torch.zeros(())
    if schedule is None:
        for x, y in micro_batches:
            loss = token_loss(model(x), y, a)
            loss.backward()
            total += loss.detach()
    else:
        x, y = (torch.cat(t) for t in zip(*micro_batches))
        stage, losses = mesh["pp"].get_local_rank(), []
        last = dict(target=y, losses=losses) if stage == mesh["pp"].size() - 1 else {}
        schedule.step(*([x] if stage == 0 else []), **last)
        total += sum(loss.detach() for loss in losses)
    if mesh["tp"].get_local_rank() != 0:  # the last stages' losses, each DP rank's once
        total.zero_()
    dist.all_reduce(total)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    time.sleep(a.step_sleep)
    metrics.step(index, total.item(), mesh)


def main() -> int:
    a = parse_args()
    data = Fortunes(load_corpus(), LlamaArgs.seq)
    metrics = Metrics(a.out, a.quiet, a.global_batch * LlamaArgs.seq)
    dist.init_process_group("gloo")
    mesh = dist.init_device_mesh("cpu", (a.pp, dist.get_world_size() // (a.pp * a.tp), a.tp),
                                 mesh_dim_names=("pp", "dp", "tp"))
    stage = mesh["pp"].get_local_rank()
    ctx = SimpleNamespace(mesh=mesh, device=torch.device("cpu"), fresh=True, stage=stage,
                          num_stages=a.pp, pp_group=mesh["pp"].get_group(),
                          layers=stage_layers(a.layers, a.pp, stage))
    model, optimizer, scheduler, schedule = build(ctx, a)
    sampler = DistributedSampler(data, mesh["dp"].size(), mesh["dp"].get_local_rank(), seed=a.seed)
    loader = DataLoader(data, a.global_batch // mesh["dp"].size(), sampler=sampler, drop_last=True)
    for index, (x, y) in zip(range(a.steps), loader):  # one epoch at most
        micro_batches = zip(x.split(a.micro_batch), y.split(a.micro_batch))
        train_step(index, model, optimizer, scheduler, schedule, micro_batches, mesh, metrics, a)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
