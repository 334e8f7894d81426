"""titan_model.build under torchrun, without morph: the same objects on a fixed mesh (dp x tp
over the world), the same data and loss. Prints one JSON line per step from rank 0.

  torchrun --nproc_per_node 2 train_plain.py --tp 2 --steps 8
"""
import argparse
import json
import os
import sys
import types

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import distribute_tensor  # noqa: E402

from titan_model import BATCH, batch_of, build, init, loss_of  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=8)
p.add_argument("--tp", type=int, default=1)
a = p.parse_args()
dist.init_process_group("gloo")
world, rank = dist.get_world_size(), dist.get_rank()
mesh = init_device_mesh("cpu", (1, world // a.tp, a.tp), mesh_dim_names=("pp", "dp", "tp"))
torch.manual_seed(0)
ctx = types.SimpleNamespace(mesh=mesh, device=torch.device("cpu"), fresh=True)
model, opt, sched = build(ctx)
with torch.no_grad():  # the whole tensors morph.elastic's init= gives, each rank its shard
    for name, p in model.named_parameters():
        whole = init(name)
        p.to_local().copy_(distribute_tensor(whole, p.device_mesh, p.placements,
                                             src_data_rank=None).to_local())
for m in model.modules():
    if isinstance(m, FSDPModule):
        m.set_force_sum_reduction_for_comms(True)  # a SUM (factor 1): Gloo has no PREMUL_SUM
dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
per = BATCH // dp
for step in range(a.steps):
    ids = range(step * BATCH + dp_rank * per, step * BATCH + (dp_rank + 1) * per)
    loss = loss_of(model, batch_of(ids))
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh["dp"].get_group())
    lr = opt.param_groups[0]["lr"]
    opt.step()
    sched.step()
    opt.zero_grad()
    if rank == 0:
        print(json.dumps({"step": step, "loss": total.item(), "lr": lr}), flush=True)
dist.destroy_process_group()
