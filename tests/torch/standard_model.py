"""The model and build function of the standard-torch tests (standard_worker.py,
dcp_interop_worker.py): a small decoder-like network written the standard way — built on `meta`,
`parallelize_module` (TP) and `fully_shard` (FSDP2) on the mesh it is given, `to_empty`,
`torch.optim.AdamW`, a warmup-cosine `LambdaLR` — and layout-independent data and initial values.
"""
import math
import zlib

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

VOCAB, DIM, LAYERS, SEQ, BATCH = 13, 10, 2, 6, 12  # 13 rows: uneven over dp 2, 3 and 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, 3 * DIM)
        self.w2 = nn.Linear(3 * DIM, DIM, bias=False)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x):
        h = self.emb(x) if self.emb is not None else x  # a later pipeline stage: activations
        for b in self.layers.values():
            h = b(h)
        return self.out(self.norm(h)) if self.out is not None else h


def stage_part(ctx):
    """The whole model on `meta`, less what other pipeline stages hold (torchtitan's way): the
    layers outside ctx.layers, the embedding unless first, the head unless last. Parameter
    names stay those of the whole model ("layers.1.w1.weight")."""
    with torch.device("meta"):
        model = Net()
    for i in list(model.layers.keys()):
        if int(i) not in ctx.layers:
            del model.layers[i]
    if not ctx.first_stage:
        model.emb = None
    if not ctx.last_stage:
        model.norm = model.out = None
    return model


def warmup_cosine(step, warmup=4, total=40):
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))


# Interleaved pipelines: the model as 4 chunks (the embedding, layers.0, layers.1, the head);
# with v stages per pipeline rank the S = v * pp stages split them evenly, stage s on pipeline
# rank s % pp (torch's loop placement). morph places contiguous layers on each pipeline rank, so
# the chunks' layers are numbered for pp 2 (rank 0: chunks 0 and 2, rank 1: chunks 1 and 3),
# which at pp 1 holds everything anyway: interleaved_layer_of, jobs of pp 1 and 2.
CHUNKS = 4
_CHUNK_LAYER_PP2 = [0, 2, 1, 3]  # chunk -> morph layer: pp 2 gives layers 0-1 to rank 0


def chunk_of(fqn):
    if fqn.startswith("emb."):
        return 0
    if fqn.startswith("layers."):
        return 1 + int(fqn.split(".")[1])
    return CHUNKS - 1


def interleaved_layer_of(fqn):
    return _CHUNK_LAYER_PP2[chunk_of(fqn)]


def chunk_part(chunks):
    """The model on `meta` less every chunk not in `chunks` (names kept)."""
    with torch.device("meta"):
        model = Net()
    for i in list(model.layers.keys()):
        if 1 + int(i) not in chunks:
            del model.layers[i]
    if 0 not in chunks:
        model.emb = None
    if CHUNKS - 1 not in chunks:
        model.norm = model.out = None
    return model


def shard(model, ctx):
    if ctx.mesh["tp"].size() > 1:
        for b in model.layers.values():
            parallelize_module(b, ctx.mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    for b in model.layers.values():
        fully_shard(b, mesh=ctx.mesh["dp"])
    fully_shard(model, mesh=ctx.mesh["dp"])
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
    model.to_empty(device=ctx.device)
    return model


def build_interleaved(ctx, v=2, micro_batches=2):
    """ScheduleInterleaved1F1B: this rank's v stages (ctx.virtual_stages(v)), one part, optimizer
    and LR scheduler each (torchtitan's way: torch's optimizer state dicts go by part)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
    total = v * ctx.num_stages
    parts, opts, scheds, stages = [], [], [], []
    for s in ctx.virtual_stages(v):
        chunks = range(s * CHUNKS // total, (s + 1) * CHUNKS // total)
        part = shard(chunk_part(chunks), ctx)
        opt = torch.optim.AdamW(part.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        parts.append(part)
        opts.append(opt)
        scheds.append(torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine))
        stages.append(PipelineStage(part, s, total, ctx.device, group=ctx.pp_group))
    return parts, opts, scheds, ScheduleInterleaved1F1B(
        stages, n_microbatches=micro_batches, loss_fn=token_loss, scale_grads=False)


def build(ctx, schedule=None, micro_batches=2):
    """FSDP2 (+ TP) of this stage's part, AdamW, LambdaLR; with `schedule` ("gpipe", "1f1b") a
    PipelineStage on ctx.pp_group and that schedule over `micro_batches` micro-batches of the
    rank's samples (the loss summed, not averaged: scale_grads=False)."""
    model = stage_part(ctx)
    if ctx.mesh["tp"].size() > 1:
        for b in model.layers.values():
            parallelize_module(b, ctx.mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    for b in model.layers.values():
        fully_shard(b, mesh=ctx.mesh["dp"])
    fully_shard(model, mesh=ctx.mesh["dp"])
    for m in model.modules():  # the loss is divided by the global batch already: sum over DP
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
    model.to_empty(device=ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    if schedule is None:
        return model, opt, sched
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    stage = PipelineStage(model, ctx.stage, ctx.num_stages, ctx.device, group=ctx.pp_group)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    return model, opt, sched, kind(stage, n_microbatches=micro_batches, loss_fn=token_loss,
                                   scale_grads=False)


with torch.device("meta"):
    SHAPES = {n: tuple(t.shape) for n, t in Net().named_parameters()}


def init(fqn):
    """Layout-independent initial values: the whole tensor from a generator seeded by name."""
    g = torch.Generator().manual_seed(zlib.crc32(fqn.encode()))
    if fqn.endswith("norm.weight"):
        return torch.ones(SHAPES[fqn])
    return torch.randn(SHAPES[fqn], generator=g) * 0.3


def sample(i):
    """Sample i: SEQ + 1 tokens, a function of i only."""
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, VOCAB, (SEQ + 1,), generator=g)


def loss_of(model, batch):
    """The summed token loss of `batch` (samples x SEQ + 1 tokens) over the global batch's
    tokens: summed over DP ranks it is the global batch's mean loss."""
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1),
                                       reduction="sum") / (BATCH * SEQ)


def token_loss(logits, targets):
    """A micro-batch's summed token loss over the global batch's tokens (the pipeline's
    loss_fn): summed over micro-batches and DP ranks it is the global batch's mean loss."""
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1),
                                       reduction="sum") / (BATCH * SEQ)


def pipeline_loss(job, step, batch):
    """One step's forward and backward through the generation's schedule (job.schedule): the
    first stage feeds the tokens, the last the targets; the rank's summed loss on the last
    stage, 0 elsewhere."""
    first, last = step.coords[0] == 0, step.coords[0] == step.config.pp - 1
    losses = []
    args = (batch[:, :-1],) if first else ()
    kwargs = dict(target=batch[:, 1:], losses=losses) if last else {}
    job.schedule.step(*args, **kwargs)
    return torch.stack(losses).sum() if last else torch.zeros(())


def batch_of(ids):
    ids = [int(i) for i in ids]
    return torch.stack([sample(i) for i in ids]) if ids else \
        torch.zeros((0, SEQ + 1), dtype=torch.int64)
