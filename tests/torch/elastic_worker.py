"""A worker of the torch elastic test (elastic_test.sh): registers a replicated matrix, a TP-free
1-D ZeRO moment (DTensor Shard(0) over dp) and a float64 vector, trains deterministic steps that
use the generation's torch process groups, and at every reconfiguration checks its new shards,
bitwise, against torch.distributed.checkpoint: the old layout's state saved at that step (after
the previous step's EndStep, through DCP over the old generation's groups) loaded into DTensors
of the new layout. Writes one JSON line per event to <out>/events.jsonl.

  elastic_worker.py --steps 12 --out DIR [--kill-at STEP --kill-rank R] [--tp-pp] [--hsdp]

--tp-pp: two layers, and two more tensors: "t0" on layer 0 split over tp on dim 0 (Shard(0) on
tp), "t1" on layer 1 split over tp on dim 1 and chunked over dp (FSDP2 + TP), for changes of tp
and pp (the test pins the configs: morphrun --config).
--hsdp: hybrid sharding (HSDP, shard groups of 2 DP ranks, replicated across groups) of every
DP-sharded tensor, "m" and "v" (1-D) and a 2-D "h": FSDP2's placements on the
("dp_replicate", "dp_shard", "tp") mesh, so that a killed worker's shards have a replica.
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

import morph

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
p.add_argument("--out", required=True)
p.add_argument("--kill-at", type=int, default=-1)
p.add_argument("--kill-rank", type=int, default=1)
p.add_argument("--step-sleep", type=float, default=0.0)
p.add_argument("--tp-pp", action="store_true")
p.add_argument("--hsdp", action="store_true")
p.add_argument("--device", default="cpu", help="cpu, or cuda (MORPH_BACKEND=nccl: the gpu case)")
a = p.parse_args()
dev = torch.device(a.device)
os.makedirs(a.out, exist_ok=True)
ck = os.path.join(a.out, "dcp")
pid = os.getpid()
open(os.path.join(a.out, "pids", str(pid)) if os.path.isdir(os.path.join(a.out, "pids"))
     else os.devnull, "w").close()

# v: 4 MiB of float64, so that its ZeRO shards (1 MiB or more) are page-mapped host blocks that
# a growing range takes over (TensorAllocator::move_pages).
W_SHAPE, M_N, V_N = (8, 6), 37, 1 << 19


def log(**kv):
    kv.update(pid=pid, t=time.time())
    with open(os.path.join(a.out, "events.jsonl"), "a") as f:
        f.write(json.dumps(kv) + "\n")


HSDP = dict(placements=[torch.distributed.tensor.Replicate(), torch.distributed.tensor.Shard(0),
                        torch.distributed.tensor.Replicate()],
            mesh_dim_names=("dp_replicate", "dp_shard", "tp"), dp_shard_size=2)


def declare(s):
    s.add_tensor("w", (torch.arange(48, dtype=torch.float32).reshape(W_SHAPE) / 8).to(dev))
    if a.hsdp:
        s.add_tensor("m", torch.zeros(M_N, device=dev), **HSDP)
        s.add_tensor("v", torch.linspace(0, 1, V_N, dtype=torch.float64).to(dev), **HSDP)
        s.add_tensor("h", torch.arange(30, dtype=torch.float32).reshape(10, 3).to(dev), **HSDP)
    else:
        s.add_tensor("m", torch.zeros(M_N, device=dev),
                     placements=[torch.distributed.tensor.Shard(0),
                                 torch.distributed.tensor.Replicate()])
        s.add_tensor("v", torch.linspace(0, 1, V_N, dtype=torch.float64).to(dev),
                     layout=morph.Layout.layer(0).zero_shard())
    s.add_scalar("count", 8)
    if a.tp_pp:
        R, S = torch.distributed.tensor.Replicate, torch.distributed.tensor.Shard
        s.add_tensor("t0", torch.arange(30, dtype=torch.float32).reshape(6, 5).to(dev),
                     placements=[R(), S(0)], layer=0)
        s.add_tensor("t1", -torch.arange(28, dtype=torch.float32).reshape(4, 7).to(dev),
                     placements=[S(0), S(1)], layer=1)


NAMES = ("w", "m", "v") + (("t0", "t1") if a.tp_pp else ()) + (("h",) if a.hsdp else ())
extra = dict(num_layers=2, tp_candidates=[1, 2], pp_candidates=[1, 2]) if a.tp_pp else {}
rt = morph.start(declare, global_batch=4, dataset_samples=1000, **extra)


def state_dict():
    """This rank's DTensors (its stage's: another stage's tensors are not held here)."""
    out = {n: rt.dtensor(n) for n in NAMES}
    return {n: t for n, t in out.items() if t is not None}


def check_oracle(step):
    """The new shards against DCP's load of the old layout's save at this step."""
    path = os.path.join(ck, f"at-{step.index}")
    if not os.path.exists(os.path.join(path, ".metadata")):
        return "no-checkpoint"
    mine = state_dict()
    want = {n: torch.distributed.tensor.zeros(t.shape, dtype=t.dtype, device_mesh=t.device_mesh,
                                              placements=t.placements)
            for n, t in mine.items()}
    dcp.load(want, checkpoint_id=path)
    for n in mine:
        a_, b_ = mine[n].to_local(), want[n].to_local()
        if a_.shape != b_.shape or not torch.equal(a_.view(torch.uint8) if a_.numel() else a_,
                                                   b_.view(torch.uint8) if b_.numel() else b_):
            return f"differs:{n}"
    return "ok"


def held_state(held):
    """What became of an old shard the program kept a view of across a change: "moved" (morph
    moved its pages into the new shard, no copy: the view's range now maps the same pages
    privately, so it reads the values they had and its own writes stay its own), "intact"
    (not moved, unchanged), or "differs" (its values changed: never)."""
    view, copy = held
    addr = view.data_ptr()
    moved = False
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi:
                moved = fields[1].endswith("p") and "morph-host-tensors" in line
                break
    if not torch.equal(view, copy):
        return "differs"
    return "moved" if moved else "intact"


def idx(name):
    sh = rt.state.shard(name)
    return torch.arange(sh.flat_begin, sh.flat_end, dtype=torch.float64, device=dev)


held = None  # a shard as the program held it after its last step, and a copy of its values
while True:
    index = None  # set when the step's body completed (not when a failure aborted it)
    with rt.step() as step:
        if step.done or step.index >= a.steps:
            break
        if step.reconfigured:
            rc = rt.last_reconfiguration
            # An old shard the program still holds reads its values at the change, whether it
            # stayed or its pages moved into the new shard (docs/torch.md "Tensors").
            old_held = held_state(held) if held is not None else None
            held = None
            log(event="reconfigured", step=step.index, rank=step.rank, world=step.world_size,
                recovery=rc.recovery, oracle=check_oracle(step), pg_seconds=rt.groups.seconds,
                backend=dist.get_backend(rt.groups.world),
                stall=rc.stall_seconds, old_rank=rc.old_rank, old_held=old_held,
                old_state_bytes=rc.old_state_bytes, prepare_bytes=rc.prepare_bytes)
        # The step's collectives, on the generation's torch groups.
        x = torch.tensor([float(step.rank + 1)], device=dev)
        kill_file = os.path.join(a.out, "kill.json")
        if a.kill_at == step.index and step.rank == a.kill_rank and not os.path.exists(kill_file):
            time.sleep(0.5)  # the peers are inside the all_reduce below by now
            with open(kill_file, "w") as f:
                json.dump({"t": time.time(), "pid": pid}, f)
            os.kill(pid, signal.SIGKILL)
        t0 = time.time()
        try:
            dist.all_reduce(x)  # world
        except Exception as e:
            log(event="collective_failed", step=step.index, rank=step.rank, t_fail=time.time(),
                t_start=t0, error=f"{type(e).__name__}: {e}"[:300])
            raise
        n = step.world_size
        assert x.item() == n * (n + 1) / 2, (x.item(), n)
        g = torch.tensor([1.0], device=dev)
        dist.all_reduce(g, group=step.groups.dp)
        assert g.item() == step.config.dp
        if a.step_sleep:
            time.sleep(a.step_sleep)
        rt.commit_update()
        s = float(step.index + 1)
        w = rt.state["w"]
        w.mul_(0.5).add_(s)
        rt.state["m"].add_(idx("m").float() * s)
        rt.state["v"].mul_(1.5).add_(idx("v") / s)
        for n in NAMES[3:]:  # elementwise: the same whatever the layout
            rt.state[n].mul_(0.5).add_(s)
        c = int.from_bytes(rt.state.scalar("count"), "little") + 1
        rt.state.set_scalar("count", c.to_bytes(8, "little"))
        index, rank = step.index, step.rank
        held = (rt.state["v"], rt.state["v"].clone()) if dev.type == "cpu" else None
    # Between steps: the state at step index+1 in this generation's layout, saved through DCP as
    # the oracle of a change that applies at that step.
    if index is not None and rt.groups is not None:
        try:
            dcp.save(state_dict(), checkpoint_id=os.path.join(ck, f"at-{index + 1}"))
        except Exception as e:  # a peer failed while saving: that step has no oracle
            log(event="save_failed", step=index + 1, error=str(e)[:200])

# The final state against a replay of the same updates on whole tensors (one rank's view).
if not rt.finished and rt.rank >= 0:
    w = torch.arange(48, dtype=torch.float32).reshape(W_SHAPE) / 8
    m = torch.zeros(M_N)
    v = torch.linspace(0, 1, V_N, dtype=torch.float64)
    for i in range(a.steps):
        s = float(i + 1)
        w.mul_(0.5).add_(s)
        m.add_(torch.arange(M_N, dtype=torch.float64).float() * s)
        v.mul_(1.5).add_(torch.arange(V_N, dtype=torch.float64) / s)
    ok = torch.equal(rt.state["w"].cpu(), w)
    finals = [("m", m), ("v", v)]
    if a.hsdp:
        h = torch.arange(30, dtype=torch.float32).reshape(10, 3)
        for i in range(a.steps):
            h.mul_(0.5).add_(float(i + 1))
        finals.append(("h", h.flatten()))
    for n, full in finals:
        sh = rt.state.shard(n)
        ok = ok and torch.equal(rt.state[n].cpu().flatten(), full[sh.flat_begin: sh.flat_end])
    count = int.from_bytes(rt.state.scalar("count"), "little")
    log(event="final", rank=rt.rank, world=rt.config.world, equal=bool(ok), count=count,
        steps=a.steps)
rt.finish()
rt.close()
