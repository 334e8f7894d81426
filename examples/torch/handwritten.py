"""Elastic training of the Llama-style decoder (llama.py), written around morph (train.py is the
standard program that morph.elastic makes elastic; this one registers its state itself): TP
through DTensor (parallelize_module), DP with a ZeRO-1 sharded AdamW, PP over stages with
micro-batches (hand-written send/recv), every parameter and both AdamW moments registered in
morph. A resize,
preemption or failure changes dp, tp and pp in place; the loop goes on at the next step.

    morphrun -n 4 -- python examples/torch/handwritten.py --steps 200

Rank 0 prints one line per step (JSON with --json; nothing with --quiet). With --out DIR, as
examples/gpt does for scripts/demo.sh: rank 0 appends a line per step to DIR/metrics.tsv (step,
loss, world, dp, tp, pp, generation, ms, tokens/s, unix time) and one per reconfiguration to
DIR/events.tsv (step, generations, worlds, configs, recovery, steps lost, communicators, plan,
transfer, resume and stall ms, bytes received); every worker keeps DIR/pids/<pid>, touched at
each step it trains.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import morph

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama import (Llama, LlamaArgs, batch, init_weights, load_corpus, rope_tables,  # noqa: E402
                   tp_plan)

# Column-parallel weights are cut along dim 0 of nn.Linear's [out, in], row-parallel along 1.
TP_DIM = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "wo": 1, "w2": 1}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--json", action="store_true", help="one JSON object per step")
    p.add_argument("--quiet", action="store_true", help="no per-step line")
    p.add_argument("--out", default="", help="metrics.tsv, events.tsv and pids/ (scripts/demo.sh)")
    p.add_argument("--tp-candidates", default="1,2", help="the planner's choices of tp")
    p.add_argument("--pp-candidates", default="1,2", help="the planner's choices of pp")
    p.add_argument("--device-memory", type=int, default=0,
                   help="bytes of state a rank may hold (the planner splits the model to fit)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (demo pacing)")
    return p.parse_args()


def param_specs(args: LlamaArgs) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(name, shape, layer, tp_dim or -1) of every parameter of the whole model: blocks on their
    layer, the embedding on the first, the final norm and output head on the last."""
    full = Llama(args)
    last = args.n_layers - 1
    out = []
    for name, p in full.named_parameters():
        parts = name.split(".")
        if parts[0] == "layers":
            layer, tp_dim = int(parts[1]), TP_DIM.get(parts[-2], -1)
        else:
            layer, tp_dim = (0 if parts[0] == "tok_embeddings" else last), -1
        out.append((name, tuple(p.shape), layer, tp_dim))
    return out


def declare_state(args: LlamaArgs, seed: int):
    """The registration: each parameter replicated over DP (split over TP where the plan cuts
    it), its AdamW moments ZeRO-sharded over DP; initial values by name (llama.init_weights)."""
    full = Llama(args)
    init_weights(full, seed)
    values = dict(full.named_parameters())

    def declare(state: morph.State) -> None:
        for name, shape, layer, tp_dim in param_specs(args):
            layout = morph.Layout.layer(layer)
            if tp_dim >= 0:
                layout = layout.split_tp(tp_dim)
            state.add_tensor(name, values[name].detach(), layout)
            for moment in ("exp_avg", "exp_avg_sq"):
                state.add_tensor(f"{name}.{moment}", shape=shape, layout=layout.zero_shard())

    return declare


class Stage:
    """This rank's pipeline stage for one generation: the module over morph's storage (TP-split
    weights as DTensors from rt.dtensor, the rest as plain tensors sharing the shards)."""

    def __init__(self, rt: morph.Runtime, step: morph.Step, args: LlamaArgs):
        cfg = step.config
        self.p, self.d, self.t = step.coords
        stages = list(cfg.stage_of_layer) or [0] * args.n_layers
        layers = [i for i in range(args.n_layers) if stages[i] == self.p]
        self.first, self.last = self.p == 0, self.p == cfg.pp - 1
        self.pp, self.dp, self.tp = cfg.pp, cfg.dp, cfg.tp
        self.rank = step.rank
        self.groups = step.groups
        with torch.device("meta"):
            module = Llama(args, range(layers[0], layers[-1] + 1), self.first, self.last)
        if self.tp > 1:
            from torch.distributed.tensor.parallel import parallelize_module
            for block in module.layers.values():
                parallelize_module(block, step.groups.mesh["tp"], tp_plan())
        self.generation = step.generation
        self.names = []
        for name, _ in list(module.named_parameters()):
            owner, leaf = _owner(module, name)
            local = rt.state.tensor(name)  # morph's shard: the parameter's storage, no copy
            tp_dim = TP_DIM.get(name.split(".")[-2], -1) if name.startswith("layers.") else -1
            if self.tp > 1 and tp_dim >= 0:
                from torch.distributed.tensor import DTensor, Shard
                local = DTensor.from_local(local, step.groups.mesh["tp"], [Shard(tp_dim)],
                                           run_check=False)
            owner.register_parameter(leaf, torch.nn.Parameter(local))
            self.names.append(name)
        cos, sin = rope_tables(args)
        module.rope_cos, module.rope_sin = cos, sin
        self.module = module

    def neighbour(self, delta: int) -> int:
        """The world rank of the same (dp, tp) place on stage p + delta."""
        return ((self.p + delta) * self.dp + self.d) * self.tp + self.t


def _owner(module: torch.nn.Module, name: str):
    *path, leaf = name.split(".")
    for part in path:
        module = getattr(module, part) if not isinstance(module, torch.nn.ModuleDict) \
            else module[part]
    return module, leaf


def train_step(stage: Stage, corpus: torch.Tensor, args: LlamaArgs, step: morph.Step,
               global_batch: int, micro: int, seed: int) -> torch.Tensor:
    """Forward and backward of this rank's samples in `micro` micro-batches (all forwards, then
    all backwards); returns the summed loss of this rank's samples (last stage) / the global
    token count, so that summing over DP gives the global batch's mean loss."""
    samples = list(step.samples)
    chunks = [c for c in (samples[i::micro] for i in range(micro)) if c]
    tokens = global_batch * args.seq
    inputs, outputs, total = [], [], torch.zeros(())
    for chunk in chunks:
        x, y = batch(corpus, args.seq, step.index, chunk, seed)
        if stage.first:
            h_in = x
        else:
            h_in = torch.empty(len(chunk), args.seq, args.dim)
            dist.recv(h_in, src=stage.neighbour(-1))
            h_in.requires_grad_(True)
        h = stage.module(h_in)
        if stage.last:
            loss = F.cross_entropy(h.flatten(0, 1), y.flatten(), reduction="sum") / tokens
            total += loss.detach()
            outputs.append(loss)
        else:
            dist.send(h.detach().contiguous(), dst=stage.neighbour(1))
            outputs.append(h)
        inputs.append(h_in)
    for h_in, out in zip(reversed(inputs), reversed(outputs)):
        if stage.last:
            out.backward()
        else:
            g = torch.empty_like(out)
            dist.recv(g, src=stage.neighbour(1))
            out.backward(g)
        if not stage.first:
            dist.send(h_in.grad.contiguous(), dst=stage.neighbour(-1))
    return total


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def adamw_zero1(rt: morph.Runtime, stage: Stage, step_index: int, lr: float,
                betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0) -> None:
    """ZeRO-1 AdamW: gradients averaged over DP; each DP rank updates its ZeRO range of every
    TP-local parameter with its moment shards, and the ranges are summed back over DP (zeros
    elsewhere: exact)."""
    dp_group = stage.groups.dp
    b1, b2 = betas
    t = step_index + 1
    for name in stage.names:
        p = rt.state.tensor(name)
        owner, leaf = _owner(stage.module, name)
        g = local_of(getattr(owner, leaf).grad).reshape(-1)
        if stage.dp > 1:
            dist.all_reduce(g, group=dp_group)
        flat = p.view(-1)
        lo, hi = morph.zero_range(flat.numel(), stage.dp, stage.d)
        m = rt.state.tensor(f"{name}.exp_avg").view(-1)  # this DP rank's ZeRO range
        v = rt.state.tensor(f"{name}.exp_avg_sq").view(-1)
        gi = g[lo:hi]
        m.mul_(b1).add_(gi, alpha=1 - b1)
        v.mul_(b2).addcmul_(gi, gi, value=1 - b2)
        mhat = m / (1 - b1 ** t)
        vhat = v / (1 - b2 ** t)
        update = torch.zeros_like(flat)
        update[lo:hi] = flat[lo:hi] * (1 - lr * weight_decay) - lr * mhat / (vhat.sqrt() + eps)
        if stage.dp > 1:
            dist.all_reduce(update, group=dp_group)
        flat.copy_(update)


def cfg_text(c) -> str:
    return f"dp{c.dp}tp{c.tp}pp{c.pp}"


def append(out: str, name: str, fields: list) -> None:
    with open(os.path.join(out, name), "a") as f:
        f.write("\t".join(str(x) for x in fields) + "\n")


def record_change(out: str, r) -> None:
    """One line of events.tsv for reconfiguration `r` (the columns of examples/gpt's)."""
    ms = [round(x * 1e3, 2) for x in (r.communicators_seconds, r.plan_seconds,
                                      r.transfer_seconds, r.resume_seconds, r.stall_seconds)]
    append(out, "events.tsv", [r.step, r.from_generation, r.generation, r.old_config.world,
                               r.config.world, cfg_text(r.old_config), cfg_text(r.config),
                               int(r.recovery), r.lost_steps, *ms, r.bytes_received, 0])


def main() -> int:
    a = parse_args()
    args = LlamaArgs(n_layers=a.layers)
    corpus = load_corpus()
    rt = morph.start(declare_state(args, a.seed), num_layers=args.n_layers,
                     num_heads=args.n_kv_heads,
                     tp_candidates=[int(x) for x in a.tp_candidates.split(",")],
                     pp_candidates=[int(x) for x in a.pp_candidates.split(",")],
                     global_batch=a.global_batch, micro_batches=a.micro_batches,
                     **({"device_memory_bytes": a.device_memory} if a.device_memory else {}))
    pid_file = ""
    if a.out:
        os.makedirs(os.path.join(a.out, "pids"), exist_ok=True)
        pid_file = os.path.join(a.out, "pids", str(os.getpid()))
        open(pid_file, "w").write(str(rt.worker_id))
    stage = None
    tokens = a.global_batch * args.seq
    last_end = time.time()
    while True:
        with rt.step() as step:
            if step.done or step.index >= a.steps:
                break
            if stage is None or stage.generation != step.generation:  # new local tensors
                stage = Stage(rt, step, args)
                r = rt.last_reconfiguration
                if a.out and step.rank == 0 and step.reconfigured and r is not None:
                    record_change(a.out, r)
            if pid_file:
                os.utime(pid_file)
            for p in stage.module.parameters():
                p.grad = None
            loss = train_step(stage, corpus, args, step, a.global_batch, a.micro_batches,
                              a.seed)
            report = loss.clone()
            if stage.t != 0:
                report.zero_()
            dist.all_reduce(report, group=step.groups.world)
            rt.commit_update()
            adamw_zero1(rt, stage, step.index, a.lr)
            if a.step_sleep > 0:
                time.sleep(a.step_sleep)
            now = time.time()
            secs, last_end = now - last_end, now
            if step.rank == 0:
                c = step.config
                if a.out:
                    append(a.out, "metrics.tsv",
                           [step.index, f"{report.item():.9f}", c.world, c.dp, c.tp, c.pp,
                            step.generation, f"{secs * 1e3:.2f}", f"{tokens / secs:.0f}",
                            f"{now:.3f}"])
                line = {"step": step.index, "loss": round(report.item(), 5),
                        "generation": step.generation, "config": cfg_text(c),
                        "world": c.world, "seconds": round(secs, 3)}
                if a.json:
                    print(json.dumps(line), flush=True)
                elif not a.quiet:
                    print(f"step {line['step']:4d}  loss {line['loss']:.4f}  generation "
                          f"{line['generation']}  {line['config']}  {secs:.2f} s", flush=True)
    rt.finish()
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
