"""The Pythonic runtime: morph.start, Runtime, State, Step (docs/torch.md).

The binding (_morph) is a thin mirror of include/morph/runtime.h; this layer adds what a PyTorch
program expects: torch tensors for the registered state (torch storage that morph adopts: no
copy in either direction), a `with rt.step() as step:` loop that ends or aborts the step,
torch.distributed process groups rebuilt at every generation, and on_reconfigure callbacks that
run once those groups exist.
"""
from __future__ import annotations

import datetime
import gc
import math
import os
import sys
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from . import _morph, distributed
from ._errors import (FailedPreconditionError, InvalidArgumentError, MorphError, NotFoundError,
                      error_code)
from ._placements import layout_from_placements, morph_dtype, placements_of, torch_dtype

Layout = _morph.Layout
Options = _morph.Options
ParallelConfig = _morph.ParallelConfig
Reconfiguration = _morph.Reconfiguration


class Shard(tuple):
    """What this rank holds of a tensor: the elements of the box (origin, shape) whose row-major
    index within it lies in [flat_begin, flat_end) (include/morph/shard.h)."""

    origin: Tuple[int, ...]
    shape: Tuple[int, ...]
    flat_begin: int
    flat_end: int

    def __new__(cls, origin: Sequence[int], shape: Sequence[int], fb: int, fe: int) -> "Shard":
        self = super().__new__(cls, (tuple(origin), tuple(shape), fb, fe))
        self.origin, self.shape, self.flat_begin, self.flat_end = tuple(origin), tuple(shape), fb, fe
        return self

    @property
    def numel(self) -> int:
        return max(self.flat_end - self.flat_begin, 0)

    @property
    def whole(self) -> bool:
        """True when the rank holds the whole box (replicated or TP-split), not a ZeRO range."""
        return self.flat_begin == 0 and self.flat_end == math.prod(self.shape)


class _Registered:
    __slots__ = ("name", "shape", "dtype", "device", "layout", "init", "buffers", "host")

    def __init__(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, layout: Any, init: Optional[torch.Tensor]) -> None:
        self.name, self.shape, self.dtype, self.device = name, shape, dtype, device
        self.layout, self.init = layout, init
        self.buffers: Dict[int, torch.Tensor] = {}  # data_ptr -> the torch storage morph holds
        self.host = device.type == "cpu"  # storage from the extension's host blocks


class State:
    """The registered state. Inside `declare` (morph.start's argument) add tensors and scalars;
    afterwards read this rank's shards as torch tensors: `state["w"]`, `state.tensors()`.

    A tensor's shards are storage morph adopted and torch views without a copy: host blocks the
    extension allocates (from any thread, so a change's new shards are allocated and pre-faulted
    while the old generation trains), or, on a CUDA device, torch storage. morph writes the
    resharded values into them at a change, the program reads and writes them in place. Look
    tensors up again after a change (on_reconfigure): the shards are new storage then; an old
    tensor is detached from the state (readable, its writes its own: docs/torch.md "Tensors").
    """

    def __init__(self) -> None:
        self._core: Optional[Any] = None
        self._sealed = False
        self._tensors: Dict[str, _Registered] = {}

    # ---- registration ----
    def add_tensor(self, name: str, tensor: Optional[torch.Tensor] = None,
                   layout: Optional[Any] = None, *, shape: Optional[Sequence[int]] = None,
                   dtype: Optional[torch.dtype] = None,
                   device: Union[str, torch.device, None] = None,
                   placements: Optional[Sequence[object]] = None,
                   mesh_dim_names: Sequence[str] = ("dp", "tp"), layer: int = 0,
                   layers: Optional[Sequence[int]] = None,
                   dp_shard_size: Optional[int] = None, pad_dp_shards: bool = False) -> None:
        """Registers tensor `name` (the whole, global tensor).

        `tensor` gives its shape, dtype and device (a meta tensor, the full tensor, or a
        DTensor: then its global shape, its local tensor's device, and its placements when no
        layout is given); on a fresh start a real tensor's values initialize the shards. Or give
        `shape`, `dtype` (default float32) and `device` (default cpu). The layout is `layout`
        (a morph.Layout), else the one `placements` on `mesh_dim_names` map to (DTensor style,
        layout_from_placements; HSDP's "dp_shard" with `dp_shard_size`, taken from a DTensor's
        mesh), else replicated on `layer` (or `layers`). With `pad_dp_shards`, a DP-sharded
        CPU tensor's storage has room for its DP group's first shard (FSDP2 pads every rank's
        shard to its rows: State.padded_tensor).

        Raises InvalidArgumentError naming the tensor for a dtype morph has not, a dtype or
        shape disagreeing with `tensor`, a placement morph cannot express, a name registered
        twice; FailedPreconditionError after start.
        """
        core = self._registering(name)
        init = None
        if tensor is not None:
            local = tensor
            if hasattr(tensor, "placements") and hasattr(tensor, "to_local"):  # a DTensor
                local = tensor.to_local()
                if placements is None and layout is None:
                    placements = list(tensor.placements)
                    mesh_dim_names = tensor.device_mesh.mesh_dim_names or mesh_dim_names
                    if "dp_shard" in mesh_dim_names and dp_shard_size is None:  # HSDP
                        dp_shard_size = tensor.device_mesh.size(
                            list(mesh_dim_names).index("dp_shard"))
            t_shape = tuple(tensor.shape)
            if shape is not None and tuple(shape) != t_shape:
                raise InvalidArgumentError(
                    f"tensor '{name}': shape {tuple(shape)} given, the tensor's is {t_shape}")
            if dtype is not None and dtype != tensor.dtype:
                raise InvalidArgumentError(
                    f"tensor '{name}': dtype {dtype} given, the tensor's is {tensor.dtype}")
            shape, dtype = t_shape, tensor.dtype
            device = device if device is not None else local.device
            if local.device.type != "meta" and local is tensor:
                init = tensor
        if shape is None:
            raise InvalidArgumentError(f"tensor '{name}': give a tensor or a shape")
        if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
            raise InvalidArgumentError(f"tensor '{name}': shape {shape!r} is not a sequence")
        for d in shape:
            if isinstance(d, bool) or not hasattr(d, "__index__"):
                raise InvalidArgumentError(
                    f"tensor '{name}': shape {tuple(shape)!r} holds {d!r}, not an integer")
        dtype = dtype if dtype is not None else torch.float32
        mdt = morph_dtype(dtype, name)
        device = torch.device(device if device is not None else "cpu")
        if device.type == "meta":
            device = torch.device("cpu")
        if device.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(f"tensor '{name}': device {device} (morph holds cpu or cuda)")
        shape = tuple(d.__index__() for d in shape)
        if layout is None:
            if placements is not None:
                layout = layout_from_placements(name, shape, placements, mesh_dim_names, layer,
                                                layers, dp_shard_size)
            else:
                layout = Layout.layers(list(layers)) if layers else Layout.layer(layer)
        reg = _Registered(name, shape, dtype, device, layout, init)
        is_cuda = device.type == "cuda"

        if not is_cuda:
            core.add_host_tensor(name, list(shape), mdt, layout, pad_dp_shards)
            self._tensors[name] = reg
            return

        def allocate(nbytes: int) -> Tuple[int, int, bool]:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            reg.buffers[buf.data_ptr()] = buf
            return buf.data_ptr(), nbytes, is_cuda

        def release(ptr: int) -> None:
            reg.buffers.pop(ptr, None)

        core.adopt_tensor(name, list(shape), mdt, layout, allocate, release)
        self._tensors[name] = reg

    def add_scalar(self, name: str, nbytes: int) -> None:
        """Registers a scalar blob of `nbytes` bytes kept equal on every rank and handed to
        joiners (step counters, RNG state). Read and write it with scalar()/set_scalar()."""
        self._registering(name).add_scalar(name, nbytes)

    def _registering(self, name: str) -> Any:
        if self._sealed or self._core is None:
            raise FailedPreconditionError(
                f"'{name}' registered after start: register inside morph.start's declare")
        return self._core

    # ---- access ----
    def shard(self, name: str) -> Shard:
        """What this rank holds of tensor `name` (planning coordinates, include/morph/layout.h)."""
        info = self._core_or_raise().tensor_info(name)
        return Shard(info[3], info[4], info[5], info[6])

    def tensor(self, name: str) -> torch.Tensor:
        """This rank's shard of tensor `name`, a torch tensor over morph's storage (no copy):
        shaped like the local box when the rank holds a whole box (replicated, TP-split), rows
        of dim 0 of that box for a chunk_dp layout (FSDP2's local shard: [rows, *rest], maybe
        0 rows), 1-D for a ZeRO range, empty when the rank's stage does not hold the tensor."""
        core = self._core_or_raise()
        reg = self._tensors.get(name)
        if reg is None:
            raise NotFoundError(f"no tensor '{name}' is registered")
        ptr, nbytes, _kind, origin, fshape, fb, fe = core.tensor_info(name)
        rows_of = (reg.layout.dp_chunked and len(fshape) == len(reg.shape) and len(fshape) > 1)
        row = math.prod(fshape[1:]) if rows_of else 0
        if fe <= fb or nbytes == 0:
            if rows_of:  # a chunk of no rows: torch's local shard of it is [0, *rest]
                return torch.empty((0, *fshape[1:]), dtype=reg.dtype, device=reg.device)
            return torch.empty(0, dtype=reg.dtype, device=reg.device)
        buf = _morph.host_storage(ptr, nbytes) if reg.host else reg.buffers.get(ptr)
        if buf is None:
            raise MorphError(f"tensor '{name}': storage {ptr:#x} is not one morph allocated here")
        flat = buf[:nbytes].view(reg.dtype)
        if rows_of and row > 0:  # whole rows of the TP-local box (ChunkDP)
            return flat[: (fe - fb) // row * row].view(-1, *fshape[1:])
        if fb != 0 or fe != math.prod(fshape):
            return flat
        local = list(fshape)
        if len(local) == len(reg.shape) + 1:  # block-interleaved: [k, L/k] back to one dimension
            d = reg.layout.tp_dim
            local[d: d + 2] = [local[d] * local[d + 1]]
        return flat.view(local)

    __getitem__ = tensor

    def padded_tensor(self, name: str, shape: Sequence[int]) -> Optional[torch.Tensor]:
        """The storage of this rank's shard of CPU tensor `name` as a tensor of `shape`
        (contiguous, starting with the shard's elements): the room a DP-sharded tensor
        registered with pad_dp_shards has for its DP group's first shard (FSDP2's padded
        shard). None when this rank holds nothing of it. NotFoundError when the storage is
        smaller than `shape`."""
        core = self._core_or_raise()
        reg = self._tensors.get(name)
        if reg is None:
            raise NotFoundError(f"no tensor '{name}' is registered")
        if not reg.host:
            raise InvalidArgumentError(f"tensor '{name}': padded storage is for CPU tensors")
        ptr, nbytes = core.tensor_info(name)[:2]
        if nbytes == 0:
            return None
        numel = math.prod(shape)
        want = numel * reg.dtype.itemsize
        try:
            buf = _morph.host_storage(ptr, max(want, nbytes))
        except MorphError as e:
            raise NotFoundError(f"tensor '{name}': its storage holds {nbytes} bytes, not the "
                                f"{want} of shape {tuple(shape)} (registered without "
                                f"pad_dp_shards?): {e}") from None
        return buf[:want].view(reg.dtype).view(*shape)

    def tensors(self) -> Dict[str, torch.Tensor]:
        """Every registered tensor's local shard, by name (registration order)."""
        return {n: self.tensor(n) for n in self._tensors}

    def names(self) -> List[str]:
        return list(self._tensors)

    def spec(self, name: str) -> Tuple[Tuple[int, ...], torch.dtype, Any]:
        """(global shape, dtype, layout) of tensor `name`."""
        reg = self._tensors[name]
        return reg.shape, reg.dtype, reg.layout

    def scalar(self, name: str) -> bytes:
        return self._core_or_raise().get_scalar(name)

    def set_scalar(self, name: str, value: bytes) -> None:
        self._core_or_raise().set_scalar(name, value)

    @property
    def config(self) -> Optional[Any]:
        return self._core_or_raise().config

    @property
    def rank(self) -> int:
        return self._core_or_raise().rank

    @property
    def local_bytes(self) -> int:
        return self._core_or_raise().local_bytes

    def _core_or_raise(self) -> Any:
        if self._core is None:
            raise FailedPreconditionError("the state is not started (morph.start)")
        return self._core

    def copy_from_whole(self, name: str, whole: torch.Tensor) -> None:
        """Writes this rank's shard of tensor `name` from `whole`, the whole tensor (any
        device; its dtype converted): what every rank does with the same `whole` sets the
        tensor to it, whatever the layout."""
        reg = self._tensors.get(name)
        if reg is None:
            raise NotFoundError(f"no tensor '{name}' is registered")
        if tuple(whole.shape) != reg.shape:
            raise InvalidArgumentError(f"tensor '{name}': a whole tensor of shape "
                                       f"{tuple(whole.shape)}, the tensor's is {reg.shape}")
        local = self.tensor(name)
        if local.numel() == 0:
            return
        sh = self.shard(name)
        src = whole.detach()
        if len(sh.shape) != src.dim():  # block view: index the given tensor in it
            d = reg.layout.tp_dim
            src = src.reshape(*src.shape[:d], reg.layout.tp_blocks, -1, *src.shape[d + 1:])
        box = src[tuple(slice(o, o + s) for o, s in zip(sh.origin, sh.shape))]
        box = box.reshape(-1)[sh.flat_begin: sh.flat_end]
        local.view(-1).copy_(box.to(device=local.device, dtype=local.dtype))

    def _initialize_from_given(self) -> None:
        """Fresh start: copies the values of the tensors given at registration into the shards."""
        for name, reg in self._tensors.items():
            if reg.init is None:
                continue
            self.copy_from_whole(name, reg.init)
            reg.init = None  # the given tensor is not held beyond the start


class Step:
    """One training step (include/morph/step.h): its index, this rank's place, its samples, and
    the generation's process groups (`groups.world/dp/tp/pp`, `mesh`)."""

    def __init__(self, core: Any, groups: Optional[distributed.ProcessGroups]) -> None:
        self._core = core
        self.groups = groups

    done = property(lambda self: self._core.done, doc="This worker left the job: stop training.")
    index = property(lambda self: self._core.index)
    generation = property(lambda self: self._core.generation)
    reconfigured = property(lambda self: self._core.reconfigured,
                            doc="First step of a generation this worker switched into.")
    config = property(lambda self: self._core.config)
    rank = property(lambda self: self._core.rank)
    world_size = property(lambda self: self._core.world_size)
    coords = property(lambda self: self._core.coords, doc="(p, d, t) of this rank.")
    samples = property(lambda self: self._core.samples,
                       doc="This rank's DP slice of the step's global batch (sample indices).")
    micro_batches = property(lambda self: self._core.micro_batches)
    global_batch = property(lambda self: self._core.global_batch)

    @property
    def mesh(self) -> Any:
        return self.groups.mesh if self.groups else None

    def communicator(self, which: str) -> Any:
        """morph's own communicator ("world", "dp", "tp", "pp") of this generation."""
        return self._core.communicator(which)

    def __repr__(self) -> str:
        if self.done:
            return "Step(done)"
        return f"Step({self.index}, generation {self.generation}, rank {self.rank}/{self.world_size})"


class _StepContext:
    def __init__(self, rt: "Runtime") -> None:
        self._rt = rt

    def __enter__(self) -> Step:
        return self._rt.begin_step()

    def __exit__(self, et: Any, ev: Optional[BaseException], tb: Any) -> bool:
        rt = self._rt
        if not rt._open:
            return False
        if ev is None:
            rt.end_step()
            return False
        if distributed.is_collective_failure(ev):
            # A peer failed (or the step was not committed): end the step; the next step applies
            # the recovery. The error is swallowed so that the loop goes on.
            rt.abort_step(ev)
            return True
        # The program's own error (a wrong argument, commit_update twice, ...): its exception,
        # never a recovery. The step stays open: the program decides (end_step, or exit).
        return False


class Runtime:
    """A started elastic job member (morph.start). See include/morph/runtime.h for the contract
    of each call; here every blocking call releases the GIL."""

    def __init__(self, core: Any, state: State, options: Any, process_groups: bool,
                 pg_timeout: datetime.timedelta, torch_backend: str = "gloo") -> None:
        self._core = core
        self.torch_backend = torch_backend  # the process groups' torch backend
        self.state = state
        self.options = options
        self._process_groups = process_groups
        self._pg_timeout = pg_timeout
        self._callbacks: List[Callable[[Any], None]] = []
        self._open = False
        self.groups: Optional[distributed.ProcessGroups] = None

    # ---- the step loop ----
    def step(self) -> _StepContext:
        """`with rt.step() as step:` begins a step (a committed change applies first); leaving
        the block ends it (end_step), or, when a failed collective left it (a peer lost, the
        step not committed: distributed.is_collective_failure), aborts it (abort_step) and
        swallows the error: the next step applies the recovery. Any other exception (the
        program's mistake) leaves the block as it came, the step still open. When
        `step.done`, break."""
        return _StepContext(self)

    def begin_step(self) -> Step:
        """BeginStep: returns the step to train (step.done: this worker left). After a change,
        rebuilds the process groups (if enabled), then calls the on_reconfigure callbacks."""
        while True:
            s = self._core.begin_step()
            if s.done:
                self._open = False
                distributed.destroy(self.groups)
                self.groups = None
                return Step(s, None)
            self._open = True
            if self._process_groups and (self.groups is None or
                                         self.groups.generation != s.generation):
                try:
                    self.groups = distributed.build(
                        s, runtime=self._core, backend=self.torch_backend,
                        host=self.options.data_hostname or "127.0.0.1",
                        timeout=self._pg_timeout, local_rank=self.options.launcher_local_rank,
                        previous=self.groups)
                except Exception as e:  # a peer failed while the groups were built
                    self.groups = None
                    if not (distributed.is_collective_failure(e)
                            or isinstance(e, (RuntimeError, OSError))):
                        raise
                    # That generation's failure, recovered as any other (never an exit).
                    self.abort_step(e)
                    continue
            step = Step(s, self.groups)
            if s.reconfigured and self._callbacks:
                rc = self._core.last_reconfiguration
                for cb in self._callbacks:
                    cb(rc)
            return step

    def commit_update(self) -> None:
        """The step's commit vote (CommitUpdate): call it after the step's last collective and
        before the optimizer writes the state. AbortedError: the step was not committed (do not
        apply it; leaving the `with` block ends it)."""
        self._core.commit_update()

    def begin_update(self) -> None:
        """BeginUpdate without the vote (see include/morph/runtime.h)."""
        self._core.begin_update()

    def end_step(self) -> None:
        self._open = False
        self._core.end_step()

    def abort_step(self, error: BaseException) -> None:
        """Ends the open step as failed (AbortStep), reporting `error` to the coordinator."""
        self._open = False
        self._core.abort_step(error_code(error), f"{type(error).__name__}: {error}")

    # ---- lifecycle ----
    def on_reconfigure(self, callback: Callable[[Any], None]) -> None:
        """Calls `callback(reconfiguration)` at the first step of every new generation this
        worker switches into (a joiner's arrival included), after the state moved and the
        process groups were rebuilt: rebuild modules, optimizer param groups, DTensors there."""
        self._callbacks.append(callback)

    @property
    def last_reconfiguration(self) -> Optional[Any]:
        """The last change this worker took part in (a morph.Reconfiguration), if any."""
        return self._core.last_reconfiguration

    @property
    def fresh_start(self) -> bool:
        """True when the state was allocated here, not received: initialize it."""
        return self._core.fresh_start

    def leave(self, reason: str = "leave()") -> None:
        """Asks to leave gracefully (preemption): the next steps move this worker's state away,
        then a step comes back done. Any thread."""
        self._core.leave(reason)

    def finish(self, timeout: float = 60.0) -> None:
        """Ends this worker's part normally; when it hosts the coordinator, waits (up to
        `timeout` seconds) until every worker finished. Idempotent."""
        self._core.finish(int(timeout * 1000))

    def close(self) -> None:
        """Releases the runtime and the process groups (without finish(): the job counts this
        worker lost). Objects of it kept by the program raise FailedPreconditionError from
        now on. SIGINT is as before morph.start."""
        distributed.destroy(self.groups)
        self.groups = None
        distributed.join_retired()
        if self._core is not None:
            self._core.close()
        _morph.handle_sigint(False)

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        if et is None:
            self.finish()
        self.close()

    # ---- identity ----
    finished = property(lambda self: self._core.finished)
    rank = property(lambda self: self._core.rank)
    generation = property(lambda self: self._core.generation)
    config = property(lambda self: self._core.config)
    next_step = property(lambda self: self._core.next_step)
    worker_id = property(lambda self: self._core.worker_id)
    coordinator_address = property(lambda self: self._core.coordinator_address)
    api_address = property(lambda self: self._core.api_address)

    # ---- DTensors ----
    def dtensor(self, name: str) -> Optional[Any]:
        """Tensor `name` as a DTensor over this stage's ("dp", "tp") mesh (a hybrid
        chunk_dp(S): groups.hsdp_mesh(S), built on first use on every rank), sharing morph's
        storage (DTensor.from_local, no copy); None when this rank's stage does not hold it.
        InvalidArgumentError for a layout without a DTensor placement (placements_of)."""
        from torch.distributed.tensor import DTensor

        if self.groups is None:
            raise FailedPreconditionError("no process groups (begin a step first)")
        shape, _dtype, layout = self.state.spec(name)
        local = self.state.tensor(name)
        placements = placements_of(name, shape, layout, self.groups.config.tp)
        cfg = self.groups.config
        stages = list(cfg.stage_of_layer)
        if stages and all(stages[l] != self.groups.mesh.get_coordinate()[0]
                          for l in layout.all_layers if l < len(stages)):
            return None  # another stage's tensor
        stride = [math.prod(shape[i + 1:]) for i in range(len(shape))]
        mesh = (self.groups.hsdp_mesh(layout.zero_group) if len(placements) == 3
                else self.groups.stage_mesh())
        if local.numel() == 0:  # an empty chunk: torch's local shape of it (e.g. [0, cols])
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
            want, _ = compute_local_shape_and_global_offset(torch.Size(shape), mesh, placements)
            local = local.new_empty(want)
        return DTensor.from_local(local, mesh, placements, run_check=False,
                                  shape=torch.Size(shape), stride=tuple(stride))


def start(declare: Callable[[State], None], options: Optional[Any] = None, *,
          process_groups: bool = True,
          pg_timeout: Optional[datetime.timedelta] = None,
          log_verbosity: int = 0, freeze_gc: bool = True,
          torch_backend: Optional[str] = None, handle_sigint: bool = True,
          **model: Any) -> Runtime:
    """Joins the elastic job and returns once this worker holds a rank with its state in place.

    `declare(state)` registers the job's tensors and scalars (state.add_tensor/add_scalar); it
    runs on every worker, with the same registrations everywhere. `options` default to
    morph.Options.from_env() (MORPH_* variables; morphrun, mpirun and Slurm set them); the
    keyword arguments set model fields (num_layers, tp_candidates, pp_candidates,
    global_batch, micro_batches, zero_stage, num_heads, device_memory_bytes) or options
    fields (dataset_samples, micro_batch, ...). With `process_groups`, every generation gets
    torch.distributed process groups and a DeviceMesh (morph.distributed).

    `torch_backend` is the process groups' torch backend: "morph" (the default for CPU: torch
    groups over the generation's morph communicators, built in the prepare and aborted by the
    runtime when a peer fails: docs/torch.md "Process groups"), "gloo" (torch's own), or
    "nccl" (the default with MORPH_BACKEND=nccl); MORPH_TORCH_BACKEND sets it too.

    `pg_timeout` bounds every torch collective of the process groups; by default 60% of
    morph's failure detection time (Options.heartbeat_timeout_ms, MORPH_HEARTBEAT_TIMEOUT_MS):
    Gloo ends a collective that waits on a dead peer only when a neighbour's connection closes
    (ProcessGroupGloo.abort() does not end one in flight, torch 2.11), and a recovery waits that
    long for every survivor's state report, so a rank blocked behind the dead peer must fail
    sooner to take part (docs/torch.md "Failure behaviour"). Raise it (with the heartbeat
    timeout) for collectives that legitimately run longer.

    With `freeze_gc` (the default), the objects alive once the worker started (torch's modules,
    the program's setup) go to the garbage collector's permanent generation (gc.freeze()), so
    that the collections of the step loop do not traverse them again: on these 2-core machines
    full collections over torch's objects in 4 workers took CPU from a change in progress
    (docs/torch.md "Performance"). Objects created later are collected as usual.

    With `handle_sigint` (the default), SIGINT is a preemption notice, as SIGTERM is
    (docs/operations.md "Preemption"): the first asks this worker to leave at its next step
    boundary (its step comes back done; waiting in start(), start returns a runtime that is
    already finished), a second ends the process at once. Until close().

    On a fresh start, tensors given with values at registration are copied into the shards;
    otherwise the state came from peers (or a checkpoint): rt.fresh_start says which.
    Raises the morph error of Runtime::Start, or what `declare` raised.
    """
    _morph.init_logging(os.path.basename(sys.argv[0]) or "python", log_verbosity)
    opts = options if options is not None else Options.from_env()
    for k, v in model.items():
        if hasattr(opts.model, k):
            m = opts.model
            setattr(m, k, v)
            opts.model = m
        elif hasattr(opts, k):
            setattr(opts, k, v)
        else:
            raise InvalidArgumentError(f"start(): no model or option field '{k}'")
    torch_backend = torch_backend or os.environ.get("MORPH_TORCH_BACKEND") or (
        "nccl" if opts.backend == "nccl" else
        "morph" if distributed.morph_backend_available() else "gloo")
    if torch_backend not in ("morph", "gloo", "nccl"):
        raise InvalidArgumentError(f"torch backend '{torch_backend}' (morph, gloo or nccl)")
    if torch_backend == "morph" and not distributed.morph_backend_available():
        raise InvalidArgumentError("torch backend 'morph': morph._torch_backend was not built "
                                   "(no torch where the package was built)")
    state = State()

    def _declare(core_state: Any) -> None:
        state._core = core_state
        declare(state)
        state._sealed = True

    if handle_sigint:
        _morph.handle_sigint(True)
    try:
        core = _morph.Runtime.start(opts, _declare)
    except BaseException:
        _morph.handle_sigint(False)
        raise
    finally:
        state._sealed = True
    if pg_timeout is None:
        pg_timeout = datetime.timedelta(milliseconds=0.6 * opts.heartbeat_timeout_ms)
    rt = Runtime(core, state, opts, process_groups, pg_timeout, torch_backend)
    if core.fresh_start:
        state._initialize_from_given()
    else:
        for reg in state._tensors.values():
            reg.init = None
    if freeze_gc:
        gc.freeze()
    return rt
