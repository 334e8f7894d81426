"""Standard PyTorch training code made elastic through its build function (docs/torch.md
"Standard PyTorch").

A program written the way torchtitan writes one builds its training objects once, in order:
model on `meta`, `parallelize_module` / `fully_shard`, `to_empty`, a `torch.optim` optimizer, an
LR scheduler. It hands morph that function; morph runs it for every generation on the
generation's mesh and keeps the state the objects hold in its own storage:

    def build(ctx):                          # ctx.mesh: DeviceMesh ("pp", "dp", "tp")
        with torch.device("meta"):
            model = Transformer(args)
        if ctx.mesh["tp"].size() > 1:
            parallelize_module(model, ctx.mesh["tp"], plan)
        fully_shard(model, mesh=ctx.mesh["dp"])
        model.to_empty(device=ctx.device)
        if ctx.fresh:                        # a new job: the program initializes the weights
            model.init_weights()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)

    job = morph.elastic(build, num_layers=8, global_batch=64, dataset_samples=len(data))
    while True:
        with job.step() as step:             # after a change: the objects were built again
            if step.done or step.index >= steps:
                break
            loss = train(job.model, step.samples)
            loss.backward()
            job.optimizer.step()             # morph's commit vote first (a step pre-hook)
            job.scheduler.step()
            job.optimizer.zero_grad()
    job.finish()

What morph does with it:
- Before joining, it runs `build` once on a fake world (torch's "fake" process group, every
  tensor on `meta`: nothing allocated) of dp 2 and the largest tp candidate, to learn each
  parameter's fully qualified name, shape, dtype and placements (the layout: _placements), its
  layer (`layer_of`), and each optimizer's per-parameter state. That is also the joiner's
  warm-up: its imports and first optimizer construction happen before it is admitted.
- It registers every parameter under its FQN and every optimizer state entry as
  `state.<fqn>.<entry>` (DCP's flattened optimizer keys) with the parameter's layout (`step`:
  a one-element tensor on the parameter's layer), and the LR schedulers' and the optimizers'
  hyper-parameters (`param_groups` without the parameters) as one scalar blob.
- At the first step of every generation it calls `build(ctx)` on the real mesh and points the
  objects' tensors at morph's storage, without a copy: a plain parameter's `.data`, a DTensor's
  local tensor, an FSDP2 parameter's padded shard (its storage has room for the DP group's
  first shard: pad_dp_shards), the optimizer's state tensors (created before the first step,
  as torch would create them). On a fresh start the parameters' values the build gave are
  copied in once. Then it restores the schedulers' state and the optimizers' hyper-parameters.
- Every optimizer gets a step pre-hook that casts the step's commit vote (Runtime.commit_update)
  once per step, so that `optimizer.step()` only runs on a committed step.

Pipelines (docs/torch.md "Pipelines"): the build makes this rank's stage part(s) of ctx.layers
(ctx.virtual_stages(v) for interleaved schedules), PipelineStage(..., group=ctx.pp_group) and a
torch.distributed.pipelining schedule, returned as a fourth element (job.schedule); every
generation builds them anew on its groups.

Optimizers morph maps: Adam, AdamW, SGD (with momentum, dampening 0), Adagrad, RMSprop. Any
other, or an unsupported setting, is refused before the job starts, naming the optimizer and
what morph cannot map.
"""
from __future__ import annotations

import math
import pickle
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import _runtime, distributed
from ._errors import FailedPreconditionError, InvalidArgumentError
from ._placements import layout_from_placements

# Wrappers whose attribute names enter named_parameters() but not the model's FQNs (DCP's rule).
_WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod", "module", "_fsdp_wrapped_module")
_HYPER = "morph.elastic.hyper"  # the scalar blob: schedulers' state, optimizers' param_groups
_HYPER_BYTES = 1 << 16


@dataclass
class BuildContext:
    """What `build` gets: the generation's mesh and this rank's place in it.

    `mesh` is a DeviceMesh with dimensions ("pp", "dp", "tp") (the whole world); `mesh["dp"]`,
    `mesh["tp"]`, `mesh["dp", "tp"]` are this rank's submeshes. `device` is where to
    materialize (`to_empty(device=ctx.device)`): `meta` in the discovery build. `fresh`: the
    job starts now and the build's parameter values become the state (initialize them);
    otherwise morph holds the state and overwrites whatever the build put there.
    `layers` are the model layers of this rank's pipeline stage. `groups` are the generation's
    process groups (None in the discovery build, where collectives go to a fake world).
    """

    mesh: Any
    device: torch.device
    fresh: bool
    config: Any
    coords: Tuple[int, int, int]
    layers: List[int]
    num_layers: int
    groups: Optional[distributed.ProcessGroups] = None
    discovery: bool = False

    @property
    def stage(self) -> int:
        return self.coords[0]

    @property
    def num_stages(self) -> int:
        if self.config is None:  # a context a program made itself (a plain run of its build)
            return self.mesh["pp"].size()
        return self.config.pp

    @property
    def first_stage(self) -> bool:
        return self.coords[0] == 0

    @property
    def last_stage(self) -> bool:
        return self.coords[0] == self.num_stages - 1

    def virtual_stages(self, v: int) -> List[int]:
        """The indices of this rank's `v` pipeline stages (of v * num_stages) as torch's
        interleaved schedules place them (ScheduleInterleaved1F1B, ScheduleLoopedBFS: stage s
        on pipeline rank s % num_stages): stage, stage + num_stages, ... The layers of those
        stages are not contiguous while morph gives each pipeline rank contiguous layers
        (ctx.layers): number the layers with `layer_of` so that they are (docs/torch.md
        "Pipelines")."""
        if v < 1:
            raise InvalidArgumentError(f"virtual_stages({v}): at least one stage per rank")
        return [self.stage + k * self.num_stages for k in range(v)]

    @property
    def pp_group(self) -> Any:
        """The ProcessGroup of this rank's pipeline (the mesh's "pp" dimension: ranks of the same
        (dp, tp) coordinates, one per stage, in stage order): `PipelineStage(..., group=)`. In
        the discovery build it is the fake world's pp dimension, of size 1."""
        return self.mesh.get_group("pp")


@dataclass
class Built:
    """What `build` returns (a tuple `(models, optimizers, schedulers)` is taken as one, and
    `(models, optimizers, schedulers, schedule)` with a pipeline schedule): the model parts of
    this rank's stage, their optimizers and LR schedulers; `schedule`, a
    torch.distributed.pipelining schedule over the parts' PipelineStages (job.schedule); `extra`,
    anything else the loop needs of this generation (job.extra), morph keeps no state of it."""

    models: List[torch.nn.Module]
    optimizers: List[torch.optim.Optimizer] = field(default_factory=list)
    schedulers: List[Any] = field(default_factory=list)
    schedule: Any = None
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class _Config:  # the discovery world's shape, as a ParallelConfig reads
    dp: int
    tp: int
    pp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass
class _Param:
    fqn: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    placements: Optional[List[Any]]
    mesh_dim_names: Tuple[str, ...]
    layer: int = 0


# ---- names and layers ----

def canonical_fqn(name: str) -> str:
    """A parameter's name without wrapper modules' attribute names (activation checkpointing,
    torch.compile, DDP), as DCP names it."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPERS)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def default_layer_of(fqns: Sequence[str], num_layers: int) -> Dict[str, int]:
    """Each parameter's layer: the index after a `layers` component ("layers.3.attn.wq.weight":
    3); a parameter before the first such one in registration order is on layer 0 (the
    embedding), one after the last on the last layer (final norm, output head)."""
    out: Dict[str, int] = {}
    seen_layer = False
    for fqn in fqns:
        m = _LAYER.search(fqn)
        if m:
            out[fqn] = int(m.group(1))
            seen_layer = True
        else:
            out[fqn] = num_layers - 1 if seen_layer else 0
    return out


# ---- optimizers ----

def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def state_entries(opt: torch.optim.Optimizer, group: Dict[str, Any]) -> List[Tuple[str, str]]:
    """The per-parameter state `opt` keeps for a parameter of `group`, as (entry, kind): kind
    "param" (shaped like the parameter) or "step" (a scalar tensor). InvalidArgumentError naming
    the optimizer and the setting for one morph cannot map."""
    t, name = type(opt), type(opt).__name__
    if group.get("differentiable"):
        raise InvalidArgumentError(f"optimizer {name}: differentiable=True is not supported")
    if t in (torch.optim.Adam, torch.optim.AdamW):
        e = [("step", "step"), ("exp_avg", "param"), ("exp_avg_sq", "param")]
        return e + ([("max_exp_avg_sq", "param")] if group.get("amsgrad") else [])
    if t is torch.optim.SGD:
        if not group.get("momentum"):
            return []
        if group.get("dampening"):
            raise InvalidArgumentError(
                f"optimizer SGD: dampening={group['dampening']} with momentum: torch creates the "
                "momentum buffer at the first step as the gradient itself, which morph's buffer "
                "(zeros, held before the first step) only equals with dampening 0")
        return [("momentum_buffer", "param")]
    if t is torch.optim.Adagrad:
        return [("step", "step"), ("sum", "param")]
    if t is torch.optim.RMSprop:
        e = [("step", "step"), ("square_avg", "param")]
        e += [("momentum_buffer", "param")] if group.get("momentum") else []
        return e + ([("grad_avg", "param")] if group.get("centered") else [])
    raise InvalidArgumentError(
        f"optimizer {name}: morph maps the state of Adam, AdamW, SGD, Adagrad and RMSprop, not "
        f"of {t.__module__}.{name}")


def _initial(opt: torch.optim.Optimizer, group: Dict[str, Any], entry: str) -> float:
    """The value torch gives a state entry before the first step (Adagrad's initial sum)."""
    if type(opt) is torch.optim.Adagrad and entry == "sum":
        return float(group.get("initial_accumulator_value", 0.0))
    return 0.0


# ---- the build's objects ----

def _as_built(out: Any, ctx: Optional[BuildContext] = None) -> Built:
    if isinstance(out, Built):
        b = out
    elif isinstance(out, torch.nn.Module):
        b = Built([out])
    elif isinstance(out, (tuple, list)) and 1 <= len(out) <= 4:
        parts = [list(x) if isinstance(x, (list, tuple)) else ([] if x is None else [x])
                 for x in out[:3]]
        b = Built(*parts, schedule=out[3] if len(out) == 4 else None)
    else:
        raise InvalidArgumentError(
            f"build returned {type(out).__name__}: return (model(s), optimizer(s), "
            "scheduler(s)[, pipeline schedule]) or a morph.Built")
    for m in b.models:
        if not isinstance(m, torch.nn.Module):
            raise InvalidArgumentError(f"build returned a model part of type {type(m).__name__}")
    for o in b.optimizers:
        if not isinstance(o, torch.optim.Optimizer):
            raise InvalidArgumentError(f"build returned an optimizer of type {type(o).__name__}")
    for s in b.schedulers:
        if not (hasattr(s, "state_dict") and hasattr(s, "load_state_dict")):
            raise InvalidArgumentError(
                f"build returned a scheduler of type {type(s).__name__} without state_dict")
    if b.schedule is not None:
        _check_schedule(b, ctx)
    return b


def _check_schedule(b: Built, ctx: Optional[BuildContext]) -> None:
    """A pipeline schedule's stages run the build's model parts on the mesh's pp group, at this
    rank's stage indices (one stage per rank: ctx.stage of ctx.num_stages; v per rank, as
    torch's interleaved schedules place them: ctx.stage + k * ctx.num_stages of
    v * ctx.num_stages)."""
    if not hasattr(b.schedule, "step"):
        raise InvalidArgumentError(
            f"build returned a pipeline schedule of type {type(b.schedule).__name__} without "
            "step(): a torch.distributed.pipelining schedule")
    stages = getattr(b.schedule, "_stages", None)
    if stages is None:
        one = getattr(b.schedule, "_stage", None)
        stages = [one] if one is not None else []
    parts = {id(m) for m in b.models}
    for st in stages:
        idx = getattr(st, "stage_index", "?")
        if id(getattr(st, "submod", None)) not in parts:
            raise InvalidArgumentError(
                f"pipeline stage {idx} runs a module that is not one of the build's model "
                "parts: return every stage's module as a model part (morph binds only the "
                "parts' parameters)")
        if ctx is None:
            continue
        pp = ctx.num_stages
        group = getattr(st, "group", None)
        want = ctx.pp_group
        if group is not want and (group is None or _ranks(group) != _ranks(want)):
            raise InvalidArgumentError(
                f"pipeline stage {idx} communicates on "
                f"{'the default group' if group is None else 'another group'} (ranks "
                f"{_ranks(group)}): give PipelineStage group=ctx.pp_group (ranks {_ranks(want)})")
        v = len(stages)
        if st.num_stages != v * pp or st.stage_index % pp != ctx.stage:
            raise InvalidArgumentError(
                f"pipeline stage {idx} of {st.num_stages} on pipeline rank {ctx.stage} of {pp} "
                f"with {v} stage(s) per rank: a rank's stages are ctx.stage + k * "
                f"ctx.num_stages of {v} * ctx.num_stages (ctx.virtual_stages(v))")


def _ranks(group: Any) -> Optional[List[int]]:
    import torch.distributed as dist
    try:
        return list(dist.get_process_group_ranks(group if group is not None
                                                 else dist.group.WORLD))
    except Exception:
        return None


def _named_params(built: Built) -> List[Tuple[str, torch.nn.Parameter]]:
    out, seen = [], {}
    for m in built.models:
        for name, p in m.named_parameters(remove_duplicate=False):
            fqn = canonical_fqn(name)
            if id(p) in seen:
                if seen[id(p)] != fqn:
                    raise InvalidArgumentError(
                        f"parameter '{fqn}' is the same tensor as '{seen[id(p)]}' (tied "
                        "weights): morph holds each parameter under one name; untie them")
                continue
            seen[id(p)] = fqn
            out.append((fqn, p))
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _fsdp_params(built: Built) -> Dict[int, Any]:
    """id(sharded parameter) -> FSDP2's FSDPParam, for every fully_shard module of the parts."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover (torch without FSDP2)
        return {}
    out = {}
    for m in built.models:
        for mod in m.modules():
            if not isinstance(mod, FSDPModule):
                continue
            group = getattr(mod._get_fsdp_state(), "_fsdp_param_group", None)
            for fp in getattr(group, "fsdp_params", []) or []:
                out[id(fp.sharded_param)] = fp
    return out


# ---- discovery ----

class _EveryLayer(list):
    """The discovery build's ctx.layers when morph.elastic was not told num_layers: it holds
    every layer (`i in ctx.layers` is True: a build that drops the layers of other pipeline
    stages keeps them all) but cannot be listed."""

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and layer >= 0

    def __iter__(self):  # type: ignore[override]
        raise InvalidArgumentError(self._WHY)

    def __len__(self) -> int:
        raise InvalidArgumentError(self._WHY)

    _WHY = ("ctx.layers of the discovery build: morph.elastic was not given num_layers, so the "
            "layers cannot be listed; pass morph.elastic(build, num_layers=...)")

def _discover(build: Callable[[BuildContext], Any], tp: int, num_layers: Optional[int],
              layer_of: Optional[Callable[[str], int]]) -> Tuple[List[_Param], List[Dict], int]:
    """The discovery build on a fake world of dp 2 x tp (meta tensors): parameters, their
    placements and layers, and each optimizer's state entries per parameter."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise FailedPreconditionError(
            "morph.elastic: torch.distributed is initialized already; morph builds the "
            "process groups of every generation itself")
    cfg = _Config(dp=2, tp=tp)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cfg.world)
    try:
        mesh = init_device_mesh("cpu", (1, cfg.dp, cfg.tp), mesh_dim_names=("pp", "dp", "tp"))
        ctx = BuildContext(mesh=mesh, device=torch.device("meta"), fresh=False, config=cfg,
                           coords=(0, 0, 0),
                           layers=list(range(num_layers)) if num_layers else _EveryLayer(),
                           num_layers=num_layers or 1, discovery=True)
        built = _as_built(build(ctx), ctx)
        named = _named_params(built)
        params = []
        for fqn, p in named:
            placements, dims = None, ("dp", "tp")
            if hasattr(p, "placements"):
                placements = list(p.placements)
                dims = tuple(p.device_mesh.mesh_dim_names or ())
            params.append(_Param(fqn, tuple(p.shape), p.dtype, placements, dims))
        fqn_of = {id(p): fqn for fqn, p in named}
        opts = []
        for i, opt in enumerate(built.optimizers):
            entries = {}
            for group in opt.param_groups:
                e = state_entries(opt, group)
                for p in group["params"]:
                    if id(p) not in fqn_of:
                        raise InvalidArgumentError(
                            f"optimizer {i} ({type(opt).__name__}) holds a tensor of shape "
                            f"{tuple(p.shape)} that is no parameter of the model parts")
                    if fqn_of[id(p)] in entries:
                        raise InvalidArgumentError(
                            f"parameter '{fqn_of[id(p)]}' is in two optimizer param groups")
                    entries[fqn_of[id(p)]] = e
            opts.append(entries)
        for entries in opts[1:]:
            for fqn in entries:
                if any(fqn in o for o in opts[: opts.index(entries)]):
                    raise InvalidArgumentError(f"parameter '{fqn}' is in two optimizers")
    finally:
        dist.destroy_process_group()
        distributed.forget_meshes()  # the fake world's mesh equals a real one of dp 2
    layers_known = default_layer_of([p.fqn for p in params], num_layers or 1)
    if num_layers is None:
        num_layers = max([layers_known[p.fqn] for p in params if _LAYER.search(p.fqn)] or [0]) + 1
        layers_known = default_layer_of([p.fqn for p in params], num_layers)
    for p in params:
        p.layer = layer_of(p.fqn) if layer_of is not None else layers_known[p.fqn]
        if not 0 <= p.layer < num_layers:
            raise InvalidArgumentError(
                f"parameter '{p.fqn}': layer {p.layer} is outside the model's {num_layers}")
    return params, opts, num_layers


# ---- the elastic job ----

class ElasticJob:
    """A started elastic job around a build function (morph.elastic). `model`, `optimizer`,
    `scheduler` (or the lists `models`, `optimizers`, `schedulers`) are this generation's
    objects: look them up at every step, a change builds new ones."""

    def __init__(self, build: Callable[[BuildContext], Any], params: List[_Param],
                 opts: List[Dict], num_layers: int, runtime: _runtime.Runtime,
                 init: Optional[Callable[[str], torch.Tensor]] = None) -> None:
        self._build = build
        self._init = init
        self._params = {p.fqn: p for p in params}
        self._opts = opts
        self.num_layers = num_layers
        self.runtime = runtime
        self.built: Optional[Built] = None
        self._generation = -1
        self._committed = False
        self._first_bind = True
        self._check_alias = False
        self._hooks: List[Any] = []

    # ---- the build's objects of this generation ----
    @property
    def models(self) -> List[torch.nn.Module]:
        return self._built().models

    @property
    def optimizers(self) -> List[torch.optim.Optimizer]:
        return self._built().optimizers

    @property
    def schedulers(self) -> List[Any]:
        return self._built().schedulers

    @property
    def model(self) -> torch.nn.Module:
        return self._one(self.models, "model part")

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._one(self.optimizers, "optimizer")

    @property
    def scheduler(self) -> Any:
        return self._one(self.schedulers, "scheduler")

    @property
    def schedule(self) -> Any:
        """This generation's pipeline schedule (Built.schedule; None without one): call its
        `step(...)` inside the step block; a change builds a new one."""
        return self._built().schedule

    @property
    def extra(self) -> Dict[str, Any]:
        """This generation's Built.extra."""
        return self._built().extra

    @property
    def state(self) -> _runtime.State:
        return self.runtime.state

    # ---- torch.distributed.checkpoint ----
    def state_dict(self) -> Dict[str, Any]:
        """{"model": ..., "optim": ...}: the model parts' and the optimizers' state as torch's
        checkpointing gives it (get_model_state_dict, get_optimizer_state_dict with
        flatten_optimizer_state_dict, as torchtitan saves it: "state.<fqn>.<entry>" and
        "param_groups.<fqn>.<key>"), DTensors over morph's storage (no copy). With several
        model parts (pipeline stages), optimizer i goes with part i."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict,
                                                             get_optimizer_state_dict)
        b = self._built()
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        model: Dict[str, Any] = {}
        optim: Dict[str, Any] = {}
        for m in b.models:
            model.update(get_model_state_dict(m))
        if b.optimizers and len(b.optimizers) not in (1, len(b.models)):
            raise FailedPreconditionError(
                f"{len(b.optimizers)} optimizers for {len(b.models)} model parts: one per part")
        for i, o in enumerate(b.optimizers):
            m = b.models[i] if len(b.optimizers) == len(b.models) else b.models[0]
            optim.update(get_optimizer_state_dict(m, o, options=opts))
        return {"model": model, "optim": optim}

    def save(self, checkpoint_id: str, extra: Optional[Dict[str, Any]] = None) -> None:
        """torch.distributed.checkpoint.save of state_dict() and the entries of `extra` (say
        {"lr_scheduler": job.scheduler.state_dict()}, as torchtitan saves it). Every rank calls
        it, inside a step (before the optimizer step or after it) or between steps: a
        checkpoint a plain torch or torchtitan run loads."""
        import torch.distributed.checkpoint as dcp
        dcp.save({**(extra or {}), **self.state_dict()}, checkpoint_id=checkpoint_id)

    def load(self, checkpoint_id: str, extra: Optional[Dict[str, Any]] = None) -> None:
        """Loads a DCP checkpoint of the same model (written by save, or by a plain torch or
        torchtitan run with flattened optimizer state) into this generation's objects: DCP reads
        every tensor in place, into morph's storage, whatever layout wrote it; the optimizers'
        hyper-parameters (param_groups) are set from it. Every rank calls it, inside a step
        before the optimizer steps (it writes the state). The step counter and the data
        position stay the runtime's. `extra`'s entries are loaded too (replaced in the dict)."""
        import torch.distributed.checkpoint as dcp
        sd = {**(extra or {}), **self.state_dict()}
        dcp.load(sd, checkpoint_id=checkpoint_id)
        for k in extra or {}:
            extra[k] = sd[k]
        fqn_of = {id(p): fqn for fqn, p in _named_params(self._built())}
        for o in self._built().optimizers:
            for g in o.param_groups:
                if not g["params"]:
                    continue
                first = fqn_of.get(id(g["params"][0]))
                for k in list(g):
                    key = f"param_groups.{first}.{k}"
                    if k != "params" and key in sd["optim"]:
                        g[k] = sd["optim"][key]
        self._check_alias = True  # the next optimizer step verifies the state is still morph's

    def _built(self) -> Built:
        if self.built is None:
            raise FailedPreconditionError("no objects built yet: begin a step first")
        return self.built

    @staticmethod
    def _one(xs: List[Any], what: str) -> Any:
        if len(xs) != 1:
            raise FailedPreconditionError(f"the build returned {len(xs)} {what}s: use the list")
        return xs[0]

    # ---- the step loop ----
    def step(self) -> "_ElasticStep":
        """`with job.step() as step:` as Runtime.step, with this generation's objects built
        (at its first step) before the block runs; leaving it normally saves the schedulers'
        and optimizers' hyper-parameters in the state, then ends the step."""
        return _ElasticStep(self)

    def commit_update(self) -> None:
        """The step's commit vote, once per step (the optimizers' pre-hook calls it)."""
        if not self._committed:
            self._committed = True
            self.runtime.commit_update()

    def finish(self, timeout: float = 60.0) -> None:
        self.runtime.finish(timeout)

    def close(self) -> None:
        self._drop()
        self.runtime.close()

    def __enter__(self) -> "ElasticJob":
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        if et is None:
            self.finish()
        self.close()

    # ---- binding a generation ----
    def _begin(self) -> _runtime.Step:
        rt = self.runtime
        while True:
            step = rt.begin_step()
            self._committed = False
            if step.done:
                self._drop()
                return step
            if step.generation == self._generation:
                return step
            try:
                self._bind(step)
                return step
            except Exception as e:
                if not distributed.is_collective_failure(e):
                    raise
                self._drop()
                rt.abort_step(e)  # that generation's failure: recovered as any other

    def _drop(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.built = None
        self._generation = -1

    def _bind(self, step: _runtime.Step) -> None:
        self._drop()
        cfg = step.config
        stages = list(cfg.stage_of_layer) or [0] * self.num_layers
        layers = [l for l in range(self.num_layers) if stages[l] == step.coords[0]]
        fresh = self._first_bind and self.runtime.fresh_start
        ctx = BuildContext(mesh=step.groups.mesh, device=torch.device("cpu"), fresh=fresh,
                           config=cfg, coords=tuple(step.coords), layers=layers,
                           num_layers=self.num_layers, groups=step.groups)
        built = _as_built(self._build(ctx), ctx)
        named = _named_params(built)
        self._bind_params(named, built, layers, fresh)
        fqn_of = {id(p): fqn for fqn, p in named}
        for i, opt in enumerate(built.optimizers):
            self._bind_optimizer(i, opt, fqn_of, fresh)
            self._hooks.append(opt.register_step_pre_hook(lambda *_: self.commit_update()))
            self._hooks.append(opt.register_step_post_hook(lambda o, *_: self._after_step(o)))
        self.built = built
        if not fresh:
            self._restore_hyper()
        self._generation = step.generation
        self._first_bind = False
        self._check_alias = True

    def _bind_params(self, named: List[Tuple[str, torch.nn.Parameter]], built: Built,
                     layers: List[int], fresh: bool) -> None:
        state = self.runtime.state
        fsdp = _fsdp_params(built)
        mine = {f for f, p in self._params.items() if p.layer in layers}
        for fqn, p in named:
            if fqn not in self._params:
                raise InvalidArgumentError(
                    f"parameter '{fqn}' was not built in the discovery build: the build "
                    "function must build the same parameters on every mesh")
            if fqn not in mine:
                raise InvalidArgumentError(
                    f"parameter '{fqn}' (layer {self._params[fqn].layer}) built on the stage "
                    f"of layers {layers}: build only ctx.layers' parameters")
            mine.discard(fqn)
            view = state.tensor(fqn)
            local = _local(p)
            if tuple(local.shape) != tuple(view.shape) or local.dtype != view.dtype:
                raise InvalidArgumentError(
                    f"parameter '{fqn}': the build's local tensor is {tuple(local.shape)} "
                    f"{local.dtype}, morph's shard {tuple(view.shape)} {view.dtype} (placements "
                    f"{getattr(p, 'placements', None)} differ from the discovery build's "
                    f"{self._params[fqn].placements})")
            if fresh and self._init is not None:
                state.copy_from_whole(fqn, self._init(fqn))
            elif fresh and view.numel():
                view.copy_(local.detach())
            fp = fsdp.get(id(p))
            if fp is not None:
                _alias_fsdp(fp, state, fqn, view)
            elif hasattr(p, "_local_tensor"):
                p._local_tensor = view
            else:
                p.data = view
        if mine:
            raise InvalidArgumentError(
                "the build did not build parameters of this stage's layers: " +
                ", ".join(sorted(mine)[:8]))

    def _bind_optimizer(self, i: int, opt: torch.optim.Optimizer, fqn_of: Dict[int, str],
                        fresh: bool) -> None:
        state = self.runtime.state
        want = self._opts[i] if i < len(self._opts) else None
        if want is None:
            raise InvalidArgumentError(f"the build returned optimizer {i} ({type(opt).__name__}) "
                                       "that the discovery build did not")
        for group in opt.param_groups:
            entries = state_entries(opt, group)
            for p in group["params"]:
                fqn = fqn_of.get(id(p))
                if fqn is None or want.get(fqn) != entries:
                    raise InvalidArgumentError(
                        f"optimizer {i} ({type(opt).__name__}): parameter "
                        f"'{fqn or tuple(p.shape)}' has other state than in the discovery build")
                st = {}
                for entry, kind in entries:
                    view = state.tensor(f"state.{fqn}.{entry}")
                    if fresh and view.numel():
                        view.fill_(_initial(opt, group, entry))
                    st[entry] = view.view(()) if kind == "step" else _like(p, view)
                opt.state[p] = st

    def _after_step(self, opt: torch.optim.Optimizer) -> None:
        """After the first optimizer step of a generation: every state tensor is still morph's
        storage (an optimizer that replaced one would train on state morph never moves)."""
        if not self._check_alias:
            return
        self._check_alias = False
        for group in opt.param_groups:
            for p in group["params"]:
                for entry, t in opt.state.get(p, {}).items():
                    if isinstance(t, torch.Tensor) and t.numel() and \
                            not _morph_owned(self.runtime.state, _local(t)):
                        raise FailedPreconditionError(
                            f"optimizer {type(opt).__name__} replaced its state '{entry}' of "
                            f"a parameter of shape {tuple(p.shape)}: morph would not keep it")

    # ---- hyper-parameters ----
    def _save_hyper(self) -> None:
        if self.built is None:
            return
        blob = pickle.dumps({
            "schedulers": [s.state_dict() for s in self.built.schedulers],
            "param_groups": [[{k: v for k, v in g.items() if k != "params"}
                              for g in o.param_groups] for o in self.built.optimizers],
        })
        if len(blob) + 4 > _HYPER_BYTES:
            raise InvalidArgumentError(
                f"the schedulers' and optimizers' hyper-parameters take {len(blob)} bytes "
                f"pickled, more than the {_HYPER_BYTES - 4} morph keeps for them")
        self.runtime.state.set_scalar(
            _HYPER, struct.pack("<I", len(blob)) + blob + bytes(_HYPER_BYTES - 4 - len(blob)))

    def _restore_hyper(self) -> None:
        raw = self.runtime.state.scalar(_HYPER)
        n = struct.unpack("<I", raw[:4])[0]
        if n == 0:
            return
        saved = pickle.loads(raw[4: 4 + n])
        for opt, groups in zip(self.built.optimizers, saved["param_groups"]):
            if len(groups) != len(opt.param_groups):
                raise InvalidArgumentError(
                    f"optimizer {type(opt).__name__}: {len(opt.param_groups)} param groups, "
                    f"{len(groups)} saved")
            for g, s in zip(opt.param_groups, groups):
                g.update(s)
        for sched, sd in zip(self.built.schedulers, saved["schedulers"]):
            sched.load_state_dict(sd)


def _like(p: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """A state tensor over morph's `view` shaped as torch's zeros_like(p) would be."""
    if not hasattr(p, "placements"):
        return view.view(p.shape)
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(view, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def _alias_fsdp(fp: Any, state: _runtime.State, fqn: str, view: torch.Tensor) -> None:
    """Points FSDP2's sharded parameter at morph's storage: its padded shard (what FSDP2
    all-gathers) is morph's block, of the DP group's first shard's rows (pad_dp_shards), and the
    parameter's local tensor the rows this rank holds (FSDPParam.reset_sharded_param then sees
    the same storage and keeps it)."""
    rows = view.shape[0] if view.dim() else 0
    if view.numel() == 0:
        return  # an empty chunk: FSDP2's own zero padding, nothing of the state here
    padded = tuple(fp.padded_sharded_param_size)
    if fp.fsdp_placement.dim != 0:
        raise InvalidArgumentError(f"parameter '{fqn}': FSDP2 shards dimension "
                                   f"{fp.fsdp_placement.dim}; morph holds Shard(0)")
    storage = state.padded_tensor(fqn, padded)
    fp._sharded_param_data = storage.view(-1)
    fp.sharded_param._local_tensor = storage.narrow(0, 0, rows)


def _morph_owned(state: _runtime.State, t: torch.Tensor) -> bool:
    """Whether `t` lies in a block of morph's host storage (its data pointer is one)."""
    from . import _morph
    try:
        _morph.host_storage(t.data_ptr(), t.numel() * t.element_size())
        return True
    except Exception:
        return False


class _ElasticStep:
    def __init__(self, job: ElasticJob) -> None:
        self._job = job
        self._inner = _runtime._StepContext(job.runtime)

    def __enter__(self) -> _runtime.Step:
        return self._job._begin()

    def __exit__(self, et: Any, ev: Optional[BaseException], tb: Any) -> bool:
        if ev is None and self._job.runtime._open:
            self._job._save_hyper()
        return self._inner.__exit__(et, ev, tb)


def elastic(build: Callable[[BuildContext], Any], *,
            init: Optional[Callable[[str], torch.Tensor]] = None,
            layer_of: Optional[Callable[[str], int]] = None, **start_kwargs: Any) -> ElasticJob:
    """Starts an elastic job around `build` (module docstring): the discovery build, the
    registration of every parameter, optimizer state and hyper-parameter, then morph.start with
    `start_kwargs` (num_layers, global_batch, dataset_samples, tp_candidates, ...). The first
    step builds the objects.

    A new job's parameters are what the first build left in them (`ctx.fresh`: initialize
    them there), or, with `init`, `init(fqn)`: the whole tensor (any device), of which each
    rank keeps its shard, so that the values do not depend on the layout the job starts in (a
    seeded generator, a pretrained checkpoint). `layer_of(fqn)` gives a parameter's layer
    (default: default_layer_of). Raises InvalidArgumentError naming what morph cannot map (an
    optimizer, a placement, a dtype) before the job starts."""
    model_kw = start_kwargs.get("num_layers")
    tps = start_kwargs.get("tp_candidates") or [1]
    if max(start_kwargs.get("pp_candidates") or [1]) > 1 and not model_kw:
        raise InvalidArgumentError(
            "pp_candidates above 1 without num_layers: pipeline stages split the model's layers; "
            "pass morph.elastic(build, num_layers=..., pp_candidates=...)")
    params, opts, num_layers = _discover(build, max(tps), model_kw, layer_of)
    start_kwargs["num_layers"] = num_layers
    if start_kwargs.get("torch_backend", "morph") == "gloo":
        raise InvalidArgumentError("morph.elastic runs on the morph backend's process groups")
    entries_of = {}
    for o in opts:
        entries_of.update(o)

    def declare(state: _runtime.State) -> None:
        for p in params:
            state.add_tensor(p.fqn, shape=p.shape, dtype=p.dtype, placements=p.placements,
                             mesh_dim_names=p.mesh_dim_names, layer=p.layer, pad_dp_shards=True)
        for p in params:
            for entry, kind in entries_of.get(p.fqn, []):
                name = f"state.{p.fqn}.{entry}"
                if kind == "step":
                    state.add_tensor(name, shape=(1,), dtype=_scalar_dtype(), layer=p.layer)
                else:
                    state.add_tensor(name, shape=p.shape, dtype=p.dtype,
                                     placements=p.placements, mesh_dim_names=p.mesh_dim_names,
                                     layer=p.layer)
        state.add_scalar(_HYPER, _HYPER_BYTES)

    rt = _runtime.start(declare, **start_kwargs)
    return ElasticJob(build, params, opts, num_layers, rt, init)
