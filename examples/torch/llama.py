"""A small Llama-style decoder in plain PyTorch, and the fortunes corpus it trains on.

RMSNorm, rotary attention with grouped-query heads, a SwiGLU MLP; byte-level tokens. Written so
that torch's own parallel APIs apply unchanged:

- tensor parallelism: ``tp_plan()`` is the ``parallelize_module`` plan of one block
  (``ColwiseParallel`` on wq/wk/wv and w1/w3, ``RowwiseParallel`` on wo and w2); attention
  reshapes with ``-1`` heads, so a block runs on its TP-local heads;
- pipeline parallelism: ``Llama(args, layers=range(a, b), first=..., last=...)`` builds one stage
  (the embedding on the first, the norm and output head on the last);
- data parallelism: any wrapper (FSDP2's ``fully_shard``, DDP) over the stage.

Data: ``Fortunes`` is the corpus as a map-style dataset (sample i: the bytes from position i), which
train.py and train_plain.py load through a DataLoader; handwritten.py draws ``batch``es that depend
only on (seed, step, sample index), so the data position of its elastic job is its step and nothing
else: any world size sees the same global batch at a step.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.data
from torch import nn


@dataclass(frozen=True)
class LlamaArgs:
    vocab: int = 256  # bytes
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4  # grouped-query attention: n_heads / n_kv_heads queries per key/value
    ffn_hidden: int = 256
    seq: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rope_tables(args: LlamaArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [seq, head_dim / 2] (real-valued: no complex tensors under DTensor)."""
    half = args.head_dim // 2
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, half, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(args.seq, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim]; rotates each (even, odd) pair by its position's angle."""
    t = x.shape[1]
    c, s = cos[:t, None, :], sin[:t, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.groups = args.n_heads // args.n_kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under TP each rank holds its own slice of the heads (ColwiseParallel).
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = k.repeat_interleave(self.groups, dim=2)
        v = v.repeat_interleave(self.groups, dim=2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


def tp_plan() -> dict:
    """parallelize_module's plan for one Block (torch.distributed.tensor.parallel)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }


def stage_layers(n_layers: int, pp: int, stage: int) -> range:
    """The layers of pipeline stage `stage` of `pp`: contiguous, the first stages one larger."""
    base, extra = divmod(n_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


class Llama(nn.Module):
    """The whole model, or one pipeline stage of it: `layers` (global indices), with the token
    embedding when `first` and the final norm and output head when `last`. Parameter names use
    global layer indices (``layers.5.attention.wq.weight``), so they do not change with pp."""

    def __init__(self, args: LlamaArgs, layers: range | None = None, first: bool = True,
                 last: bool = True):
        super().__init__()
        self.args = args
        layers = range(args.n_layers) if layers is None else layers
        self.tok_embeddings = nn.Embedding(args.vocab, args.dim) if first else None
        self.layers = nn.ModuleDict({str(i): Block(args) for i in layers})
        self.norm = RMSNorm(args.dim, args.norm_eps) if last else None
        self.output = nn.Linear(args.dim, args.vocab, bias=False) if last else None
        cos, sin = rope_tables(args)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def reset_buffers(self) -> None:
        """The rotary tables again: a model built on `meta` and materialized with `to_empty`
        holds uninitialized buffers."""
        device = self.rope_cos.device
        self.rope_cos, self.rope_sin = (t.to(device) for t in rope_tables(self.args))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [batch, seq] on the first stage, hidden states [batch, seq, dim] after it;
        logits [batch, seq, vocab] from the last."""
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for block in self.layers.values():
            x = block(x, self.rope_cos, self.rope_sin)
        if self.output is not None:
            x = self.output(self.norm(x))
        return x


def init_weights(model: Llama, seed: int) -> None:
    """Deterministic initialisation by parameter name (the same values whatever the layout):
    normal(0, 0.02) for matrices, scaled by 1/sqrt(2 n_layers) for the residual outputs; norm
    gains 1. A DTensor parameter (TP, FSDP2) keeps its shard of the whole tensor, which every
    rank draws alike (no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            with torch.no_grad():
                p.fill_(1.0)
            continue
        std = 0.02
        if name.endswith(("wo.weight", "w2.weight")):
            std /= math.sqrt(2 * model.args.n_layers)
        g = torch.Generator().manual_seed(seed * 1_000_003 + _stable_hash(name))
        whole = torch.randn(p.shape, generator=g) * std
        if isinstance(p, DTensor):
            whole = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
        with torch.no_grad():
            p.copy_(whole)


def _stable_hash(s: str) -> int:
    h = 2166136261
    for ch in s.encode():
        h = ((h ^ ch) * 16777619) & 0x7FFFFFFF
    return h


def load_corpus(folder: str = "/usr/share/games/fortunes") -> torch.Tensor:
    """Every text file of the fortunes package, concatenated in name order, as byte tokens."""
    try:
        names = sorted(n for n in os.listdir(folder)
                       if not n.endswith(".dat") and os.path.isfile(os.path.join(folder, n))
                       and not os.path.islink(os.path.join(folder, n)))
    except OSError as e:
        raise RuntimeError(f"cannot read {folder}: {e} (apt-get install fortunes-min)") from e
    data = b"".join(open(os.path.join(folder, n), "rb").read() for n in names)
    if len(data) < 4096:
        raise RuntimeError(f"corpus under {folder} has only {len(data)} bytes")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class Fortunes(torch.utils.data.Dataset):
    """The corpus as a map-style dataset: sample i is the `seq` bytes from byte i and their
    next-byte targets (every byte position starts a sample)."""

    def __init__(self, corpus: torch.Tensor, seq: int):
        self.corpus, self.seq = corpus, seq

    def __len__(self) -> int:
        return self.corpus.numel() - self.seq

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.corpus[i:i + self.seq + 1]
        return window[:-1], window[1:]


def batch(corpus: torch.Tensor, seq: int, step: int, samples: range,
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets [len(samples), seq] of global samples `samples` at `step`:
    a function of (seed, step, sample) only."""
    starts = []
    for i in samples:
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 65_537 + i)
        starts.append(int(torch.randint(0, corpus.numel() - seq - 1, (1,), generator=g)))
    idx = torch.tensor(starts)[:, None] + torch.arange(seq + 1)[None, :]
    tokens = corpus[idx]
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
