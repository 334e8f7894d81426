"""torch dtypes and DTensor placements <-> morph dtypes and layouts (docs/torch.md has the table).

A DTensor's placements on a mesh with named dimensions "pp", "dp", "tp" map to a morph Layout
(docs/reshard-planner.md §1.2: torch.chunk semantics, uneven sizes allowed):

  Replicate() on every dimension              -> Layout.layer(l)                 (replicated)
  Shard(d) on "tp"                            -> Layout.layer(l).chunk_tp(d)
  Shard(0) on "dp" (FSDP2)                    -> Layout.layer(l).chunk_dp()      (rows of dim 0)
  Shard(0) on "dp", Shard(d > 0) on "tp"      -> ....chunk_tp(d).chunk_dp()      (FSDP2 + TP)
  _StridedShard(0) on "dp", Shard(0) on "tp"  -> ....chunk_tp(0).chunk_dp()      (FSDP2 + TP on
                                                  dim 0: DP chunks the TP-local rows)
  HSDP, on "dp_replicate", "dp_shard" (and "tp") instead of "dp": Replicate() on "dp_replicate",
  Shard(0) (or the strided shard) on "dp_shard" of size S -> the same with chunk_dp(S): rows
  of dim 0 chunked within groups of S consecutive DP ranks (dp = replicas * S, DP rank
  r*S + s is torch's mesh coordinate (r, s)), replicated across the groups.

Refused, with a message naming the tensor and the placement: Partial() (a pending reduction is
not state), Shard on "pp" (stages hold whole tensors by layer), Shard(d != 0) on "dp" (FSDP2
shards dim 0), a plain Shard(0) on both "dp" and "tp" (DTensor's mesh order cuts dp first:
not what FSDP2 builds, and not a morph layout), a Shard on "dp_replicate", "dp" together with
"dp_shard", and "dp_shard" without its size.
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

MESH_DIMS = ("pp", "dp", "tp", "dp_replicate", "dp_shard")


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
                           layers: Optional[Sequence[int]] = None,
                           dp_shard_size: Optional[int] = None) -> "_morph.Layout":
    """The morph Layout of a tensor placed like a DTensor: `placements[i]` on mesh dimension
    `mesh_dim_names[i]` (each of "pp", "dp", "tp", or HSDP's "dp_replicate" and "dp_shard",
    whose size `dp_shard_size` gives). `layer` (or `layers`, tied tensors) says which pipeline
    stage holds it. InvalidArgumentError naming the tensor and the placement for what morph
    cannot express."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if len(placements) != len(mesh_dim_names):
        raise InvalidArgumentError(
            f"tensor '{name}': {len(placements)} placements for mesh dimensions "
            f"{tuple(mesh_dim_names)}")
    ndim = len(shape)
    layout = _morph.Layout.layers(list(layers)) if layers else _morph.Layout.layer(layer)
    tp_dim: Optional[int] = None
    dp_shard = None  # "plain" (Shard(0)) or "strided" (_StridedShard(0))
    if "dp" in mesh_dim_names and ("dp_shard" in mesh_dim_names or
                                   "dp_replicate" in mesh_dim_names):
        raise InvalidArgumentError(
            f"tensor '{name}': mesh dimensions {tuple(mesh_dim_names)}: 'dp', or HSDP's "
            "'dp_replicate' and 'dp_shard', not both")
    hybrid = "dp_shard" in mesh_dim_names
    for p, dim in zip(placements, mesh_dim_names):
        where = f"tensor '{name}': placement {_describe(p)} on mesh dimension '{dim}'"
        if dim not in MESH_DIMS:
            raise InvalidArgumentError(f"{where}: morph's mesh dimensions are {MESH_DIMS}")
        if isinstance(p, Replicate):
            continue
        if isinstance(p, Partial):
            raise InvalidArgumentError(f"{where}: a Partial() tensor holds a pending reduction, "
                                       "not state; register it after the reduction")
        strided = type(p).__name__ == "_StridedShard"
        if not isinstance(p, Shard) and not strided:
            raise InvalidArgumentError(f"{where}: unknown placement")
        d = p.dim + ndim if p.dim < 0 else p.dim
        if not 0 <= d < ndim:
            raise InvalidArgumentError(f"{where}: dimension {p.dim} of a {ndim}-D tensor")
        if dim == "pp":
            raise InvalidArgumentError(f"{where}: pipeline stages hold whole tensors by layer; "
                                       "pass layer= (or layers=) instead")
        if dim == "dp_replicate":
            raise InvalidArgumentError(f"{where}: HSDP replicates across 'dp_replicate' "
                                       "(Replicate()) and shards over 'dp_shard'")
        if dim == "tp":
            if strided:
                raise InvalidArgumentError(f"{where}: a strided shard on tp is not a morph layout")
            tp_dim = d
            continue
        if d != 0:  # dp or dp_shard
            raise InvalidArgumentError(f"{where}: morph shards dp by rows of dimension 0 "
                                       f"(FSDP2's Shard(0)), not dimension {d}")
        if dim == "dp_shard" and (dp_shard_size is None or dp_shard_size < 1):
            raise InvalidArgumentError(f"{where}: give dp_shard_size (the size of the mesh's "
                                       "'dp_shard' dimension)")
        dp_shard = "strided" if strided else "plain"
    dp = "dp_shard" if hybrid else "dp"
    if dp_shard == "plain" and tp_dim == 0:
        raise InvalidArgumentError(
            f"tensor '{name}': Shard(0) on both '{dp}' and 'tp' cuts dim 0 over {dp} first "
            f"(DTensor's mesh order); FSDP2 over TP chunks the TP-local rows: _StridedShard(0) "
            f"on '{dp}'")
    if dp_shard == "strided" and tp_dim != 0:
        raise InvalidArgumentError(
            f"tensor '{name}': _StridedShard(0) on '{dp}' without Shard(0) on 'tp'")
    if tp_dim is not None:
        layout = layout.chunk_tp(tp_dim)
    if dp_shard:
        layout = layout.chunk_dp(dp_shard_size if hybrid else 0)
    return layout


def placements_of(name: str, shape: Sequence[int], layout: "_morph.Layout",
                  tp_size: int = 1) -> list:
    """The DTensor placements on the ("dp", "tp") mesh of a stage for a morph layout, where one
    exists (the inverse of layout_from_placements; `tp_size` for FSDP2+TP's strided shard); for
    a hybrid chunk_dp(S), on HSDP's ("dp_replicate", "dp_shard", "tp") mesh (Replicate() first).
    InvalidArgumentError otherwise."""
    from torch.distributed.tensor import Replicate, Shard

    if layout.tp_blocks != 1 or layout.pad_multiple != 0:
        raise InvalidArgumentError(f"tensor '{name}': {layout!r} (block-interleaved or padded "
                                   "TP split) has no DTensor placement")
    if layout.zero_group and not layout.dp_chunked:
        raise InvalidArgumentError(f"tensor '{name}': {layout!r} (hybrid flat ZeRO ranges) "
                                   "has no DTensor placement")
    if layout.zero_sharded and not layout.dp_chunked and (len(shape) != 1 or layout.tp_dim >= 0):
        raise InvalidArgumentError(f"tensor '{name}': {layout!r} (a flat ZeRO range of a "
                                   f"{len(shape)}-D tensor) has no DTensor placement")
    tp = Shard(layout.tp_dim) if layout.tp_dim >= 0 else Replicate()
    if not layout.zero_sharded:
        return [Replicate(), tp]
    hsdp = [Replicate()] if layout.zero_group else []
    if layout.tp_dim == 0 and tp_size > 1:  # FSDP2 + TP on dim 0
        from torch.distributed.tensor.placement_types import _StridedShard
        return hsdp + [_StridedShard(0, split_factor=tp_size), tp]
    return hsdp + [Shard(0), tp]
