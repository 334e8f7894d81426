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
        h = self.emb(x)
        for b in self.layers.values():
            h = b(h)
        return self.out(self.norm(h))


def warmup_cosine(step, warmup=4, total=40):
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))


def build(ctx):
    with torch.device("meta"):
        model = Net()
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
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)


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


def batch_of(ids):
    ids = [int(i) for i in ids]
    return torch.stack([sample(i) for i in ids]) if ids else \
        torch.zeros((0, SEQ + 1), dtype=torch.int64)
