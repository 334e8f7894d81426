"""torch dtypes and DTensor placements <-> morph dtypes and layouts (docs/torch.md has the table).

A DTensor's placements on a mesh with named dimensions "pp", "dp", "tp" map to a morph Layout:

  Replicate() on every dimension          -> Layout.layer(l)             (replicated)
  Shard(d) on "tp"                        -> Layout.layer(l).split_tp(d)  (tp equal slices)
  Shard(0) on "dp", 1-D tensor            -> Layout.layer(l).zero_shard() (torch.chunk's ranges
                                              of a 1-D tensor are exactly morph's ZeRO ranges)

Refused, with a message naming the tensor and the placement: Partial() (a pending reduction is
not state), _StridedShard (FSDP2+TP), Shard on "pp" (stages hold whole tensors by layer), and
Shard(d) on "dp" of a tensor of rank > 1 (FSDP2's dim-0 chunks: they need the dim-0 chunk layout
that morph's layout algebra does not have yet).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import _morph
from ._errors import InvalidArgumentError

_TORCH_TO_MORPH = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8",
}
_MORPH_TO_TORCH = {v: k for k, v in _TORCH_TO_MORPH.items()}

MESH_DIMS = ("pp", "dp", "tp")


def morph_dtype(dtype: torch.dtype, name: str = "?") -> str:
    """morph's name for a torch dtype; InvalidArgumentError naming the tensor when morph has none."""
    try:
        return _TORCH_TO_MORPH[dtype]
    except KeyError:
        raise InvalidArgumentError(
            f"tensor '{name}': dtype {dtype} has no morph equivalent (morph holds "
            + ", ".join(str(d) for d in _TORCH_TO_MORPH) + ")") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a morph dtype name ("f32", "bf16", ...)."""
    return _MORPH_TO_TORCH[_morph.dtype_name(name)]


def _describe(p: object) -> str:
    return type(p).__name__ + (f"({p.dim})" if hasattr(p, "dim") else "()")


def layout_from_placements(name: str, shape: Sequence[int], placements: Sequence[object],
                           mesh_dim_names: Sequence[str] = ("dp", "tp"), layer: int = 0,
                           layers: Optional[Sequence[int]] = None) -> "_morph.Layout":
    """The morph Layout of a tensor placed like a DTensor: `placements[i]` on mesh dimension
    `mesh_dim_names[i]` (each of "pp", "dp", "tp"). `layer` (or `layers`, tied tensors) says
    which pipeline stage holds it. InvalidArgumentError naming the tensor and the placement for
    what morph cannot express."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if len(placements) != len(mesh_dim_names):
        raise InvalidArgumentError(
            f"tensor '{name}': {len(placements)} placements for mesh dimensions "
            f"{tuple(mesh_dim_names)}")
    ndim = len(shape)
    layout = _morph.Layout.layers(list(layers)) if layers else _morph.Layout.layer(layer)
    tp_dim: Optional[int] = None
    dp_shard = False
    for p, dim in zip(placements, mesh_dim_names):
        where = f"tensor '{name}': placement {_describe(p)} on mesh dimension '{dim}'"
        if dim not in MESH_DIMS:
            raise InvalidArgumentError(f"{where}: morph's mesh dimensions are {MESH_DIMS}")
        if type(p).__name__ == "_StridedShard":
            raise InvalidArgumentError(
                f"{where}: _StridedShard (FSDP2 over TP) is not expressible in morph's layouts yet")
        if isinstance(p, Replicate):
            continue
        if isinstance(p, Partial):
            raise InvalidArgumentError(f"{where}: a Partial() tensor holds a pending reduction, "
                                       "not state; register it after the reduction")
        if not isinstance(p, Shard):
            raise InvalidArgumentError(f"{where}: unknown placement")
        d = p.dim + ndim if p.dim < 0 else p.dim
        if not 0 <= d < ndim:
            raise InvalidArgumentError(f"{where}: dimension {p.dim} of a {ndim}-D tensor")
        if dim == "pp":
            raise InvalidArgumentError(f"{where}: pipeline stages hold whole tensors by layer; "
                                       "pass layer= (or layers=) instead")
        if dim == "tp":
            tp_dim = d
        else:  # dp
            if ndim != 1 or d != 0:
                raise InvalidArgumentError(
                    f"{where}: FSDP2's dim-0 chunks of a {ndim}-D tensor need morph's dim-0 "
                    "chunk layout, which it does not have yet; use Replicate(), or a flat "
                    "ZeRO shard (Layout.layer(l).zero_shard()) registered without placements")
            dp_shard = True
    if tp_dim is not None and dp_shard:
        raise InvalidArgumentError(
            f"tensor '{name}': Shard on both 'dp' and 'tp' of a 1-D tensor (torch shards in "
            "mesh order, morph cuts ZeRO ranges inside the TP slice): not expressible")
    if tp_dim is not None:
        layout = layout.split_tp(tp_dim)
    if dp_shard:
        layout = layout.zero_shard()
    return layout


def placements_of(name: str, shape: Sequence[int], layout: "_morph.Layout") -> list:
    """The DTensor placements on the ("dp", "tp") mesh of a stage for a morph layout, where one
    exists (the inverse of layout_from_placements); InvalidArgumentError otherwise."""
    from torch.distributed.tensor import Replicate, Shard

    if layout.tp_blocks != 1 or layout.pad_multiple != 0:
        raise InvalidArgumentError(f"tensor '{name}': {layout!r} (block-interleaved or padded "
                                   "TP split) has no DTensor placement")
    if layout.zero_sharded and (len(shape) != 1 or layout.tp_dim >= 0 or layout.zero_group):
        raise InvalidArgumentError(f"tensor '{name}': {layout!r} (a flat ZeRO range of a "
                                   f"{len(shape)}-D tensor) has no DTensor placement")
    dp = Shard(0) if layout.zero_sharded else Replicate()
    tp = Shard(layout.tp_dim) if layout.tp_dim >= 0 else Replicate()
    return [dp, tp]
