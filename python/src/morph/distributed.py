"""torch.distributed process groups for each morph generation (docs/torch.md "Process groups").

At the first step of every generation the runtime rebuilds the default process group (the
world), the DP, TP and PP groups and a DeviceMesh ("pp", "dp", "tp") over them, with ranks
exactly morph's (rank = (p*dp + d)*tp + t). With the "morph" backend (the default on CPU) those
groups are the generation's morph communicators (morph._torch_backend), built in the prepare and
aborted by the runtime when a peer fails, so that a torch collective in flight raises at once;
other groups are torch's Gloo, bound to the job's data address (127.0.0.1 unless
MORPH_GLOO_HOSTNAME says otherwise). The rendezvous store is the job's own
(Runtime.connect_store: the coordinator's store, every connection checked with the job token,
keys scoped to the generation) behind a c10d Store: the job opens no listener of torch's. RANK,
WORLD_SIZE and LOCAL_RANK are written for libraries that read them; MASTER_ADDR and MASTER_PORT
are not (there is no TCPStore to point them at).

With torch's Gloo ("gloo"), a killed peer's neighbours raise at once (their TCP pairs close); a
rank blocked behind the dead peer, or on a peer that hangs without dying, is bounded by the
groups' timeout (`timeout`; morph.start passes 60% of morph's failure detection time).
"""
from __future__ import annotations

import atexit
import datetime
import fcntl
import os
import queue
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass
class ProcessGroups:
    """One generation's process groups. `world` is the default group (also `dist.group.WORLD`)."""

    generation: int
    rank: int
    world_size: int
    config: Any
    world: Any
    dp: Any
    tp: Any
    pp: Any
    mesh: Any
    store: Any
    seconds: float

    phases: Any = None  # diagnostic: seconds since the start of build() at the end of each phase
    hsdp: Any = None  # shard size -> HSDP mesh (hsdp_mesh)
    backends: Any = None  # the "morph" backends of these groups (invalidated by destroy)

    def stage_mesh(self) -> Any:
        """The ("dp", "tp") submesh of this rank's pipeline stage (where DTensors live)."""
        return self.mesh["dp", "tp"]

    def hsdp_mesh(self, shard_size: int) -> Any:
        """The ("dp_replicate", "dp_shard", "tp") mesh of this rank's stage for HSDP: DP split
        into dp / shard_size replicas of `shard_size` consecutive DP ranks (DP rank r*S + s has
        coordinates (r, s)), what morph's chunk_dp(shard_size) shards within. Built on first
        use (a collective: every rank of the generation calls it, in the same order), cached.
        InvalidArgumentError unless shard_size divides dp."""
        from torch.distributed.device_mesh import DeviceMesh

        from ._errors import InvalidArgumentError

        cfg = self.config
        if shard_size < 1 or cfg.dp % shard_size:
            raise InvalidArgumentError(f"HSDP shard size {shard_size} does not divide dp={cfg.dp}")
        self.hsdp = self.hsdp or {}
        if shard_size not in self.hsdp:
            ranks = torch.arange(self.world_size).reshape(cfg.pp, cfg.dp // shard_size,
                                                          shard_size, cfg.tp)
            # Its dimensions are not morph's groups: with the "morph" backend they are torch
            # Gloo groups over the generation's store (_create_backend).
            mesh = DeviceMesh(self.mesh.device_type, ranks,
                              mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
            self.hsdp[shard_size] = mesh["dp_replicate", "dp_shard", "tp"]
        return self.hsdp[shard_size]


def destroy(groups: Optional[ProcessGroups]) -> None:
    """Destroys the current generation's groups (the default group with them) and retires
    `groups`' objects (_retire)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    if groups is not None:
        _retire(groups)


_retired: "queue.SimpleQueue" = queue.SimpleQueue()  # lists to drop, or callables to run
_retirer: Optional[threading.Thread] = None


def _retire_loop() -> None:
    while True:
        item = _retired.get()
        if item is None:
            return
        if callable(item):
            item()
        else:
            item.clear()  # the last references: torch frees the groups here
        del item


def _start_retirer() -> None:
    """The thread that frees retired groups; started once (at the first build, so that a
    change's switch step does not wait for a thread to start)."""
    global _retirer
    if _retirer is None or not _retirer.is_alive():
        _retirer = threading.Thread(target=_retire_loop, name="morph-retire-groups", daemon=True)
        _retirer.start()


def _retire(groups: ProcessGroups) -> None:
    """Drops `groups`' torch objects on a thread of its own. Freeing a Gloo process group
    joins its threads (each up to Gloo's 10 ms event-loop timeout: 30 ms for a generation's
    groups, measured) and torch frees them without the GIL, so the training thread goes on.
    The fields become None: the program's old Step objects then hold none of them, and a
    generation's groups are invalid after the next change anyway."""
    for b in groups.backends or ():
        b.invalidate()  # its communicator is freed at a later switch
    objects = [groups.world, groups.dp, groups.tp, groups.pp, groups.mesh, groups.store,
               groups.hsdp, groups.backends]
    groups.world = groups.dp = groups.tp = groups.pp = groups.mesh = groups.store = None
    groups.hsdp = groups.backends = None
    _start_retirer()
    _retired.put(objects)
    del objects  # the thread's reference is the last one


def join_retired(timeout: float = 10.0) -> None:
    """Waits (at most `timeout` seconds) until the groups retired so far are freed."""
    if _retirer is not None and _retirer.is_alive():
        done = threading.Event()
        _retired.put(done.set)
        done.wait(timeout)


@atexit.register
def _stop_retirer() -> None:
    """At the interpreter's exit, before its threads are cut off: the retirer frees what is left
    and ends. A daemon thread stopped by the exit while torch frees a group in C++ ends the
    process with "terminate called without an active exception" (exit 134)."""
    if _retirer is not None and _retirer.is_alive():
        _retired.put(None)
        _retirer.join(30.0)


# ---- the "morph" backend: torch groups over the generation's morph communicators ----

_building: Optional[dict] = None  # while build() runs: ranks -> (communicator, name), backends
_registered = False


def morph_backend_available() -> bool:
    """True when morph._torch_backend (built against this torch) imports."""
    try:
        from . import _torch_backend  # noqa: F401
    except ImportError:
        return False
    return True


def _register_morph_backend() -> None:
    global _registered
    if not _registered:
        dist.Backend.register_backend("morph", _create_backend, extended_api=True,
                                      devices=["cpu"])
        _registered = True


_gloo_host = "127.0.0.1"  # the address torch's Gloo groups bind (build() sets it)


def _create_backend(opts: Any, _backend_options: Any) -> Any:
    """torch's creator of a "morph" group: while build() runs, morph's communicator when the
    group's ranks are the generation's world, a DP, TP or PP group; torch's Gloo over the
    generation's store for any other group (an HSDP mesh dimension, a program's new_group),
    bound to the job's data address."""
    from . import _torch_backend

    b = _building
    found = None
    if b is not None:
        ranks = tuple(opts.global_ranks_in_group) or tuple(range(b["world"]))
        found = b["comms"].get(ranks)
    if found is None:  # not one of morph's groups
        o = dist.ProcessGroupGloo._Options()
        o._timeout = opts.timeout
        o._devices = [dist.ProcessGroupGloo.create_device(hostname=_gloo_host)]
        return dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, o)
    comm, name = found
    backend = _torch_backend.create(comm._capsule(), f"generation {b['generation']}'s {name}",
                                    int(opts.timeout.total_seconds() * 1000))
    b["backends"].append(backend)
    return backend


def _morph_groups(step: Any) -> dict:
    """The generation's morph communicators by their ranks (world ranks, ascending)."""
    cfg, rank = step.config, step.rank
    comms = {tuple(range(step.world_size)): (step.communicator("world"), "world")}
    for name, ranks in (("dp", cfg.dp_group(rank)), ("tp", cfg.tp_group(rank)),
                        ("pp", cfg.pp_group(rank))):
        comms.setdefault(tuple(ranks), (step.communicator(name), name))
    return comms


def _rank_prefixed(base: Any, rank: int) -> Any:
    """sys.excepthook: `base`'s traceback with every line prefixed "[rank<rank>]: ", as torch's
    init_process_group makes it. torch wraps whatever hook it finds, at every call: across
    generations the prefixes stacked ("[rank1]: [rank2]: ") and named earlier ranks. This one
    wraps the program's own hook, once, with the current rank."""
    import io

    def hook(*args: Any) -> None:
        old, sys.stderr = sys.stderr, io.StringIO()
        try:
            base(*args)
        finally:
            text, sys.stderr = sys.stderr.getvalue(), old
        sys.stderr.write("\n".join(f"[rank{rank}]: {line}" if line else ""
                                   for line in text.split("\n")))
        sys.stderr.flush()

    hook._morph_base = base  # type: ignore[attr-defined]
    return hook


def _interface_of(host: str) -> Optional[str]:
    """The network interface that holds IPv4 address `host` (for torch's own Gloo groups,
    which bind GLOO_SOCKET_IFNAME's address), or None."""
    try:
        want = socket.inet_aton(socket.gethostbyname(host))
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    req = struct.pack("256s", name.encode()[:15])
                    addr = fcntl.ioctl(s.fileno(), 0x8915, req)[20:24]  # SIOCGIFADDR
                except OSError:
                    continue
                if addr == want:
                    return name
    except OSError:
        return None
    return None


def build(step: Any, *, runtime: Any, backend: str = "gloo", host: str = "127.0.0.1",
          timeout: datetime.timedelta = datetime.timedelta(seconds=300),
          local_rank: int = -1, previous: Optional[ProcessGroups] = None) -> ProcessGroups:
    """Builds the groups of `step`'s generation (every rank of it calls this at the same step).
    `runtime` is the binding's runtime (morph._morph.Runtime: its store is the rendezvous).
    `backend`: "morph" (torch groups over morph's communicators, CPU), "gloo" or "nccl".
    Raises what torch or morph's store raised when a peer failed meanwhile."""
    global _building, _gloo_host
    _gloo_host = host
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        iface = _interface_of(host)
        if iface:  # torch's own Gloo groups bind that interface's address
            os.environ["GLOO_SOCKET_IFNAME"] = iface
    if backend != "morph":
        return _build(step, runtime, backend, timeout, local_rank, previous)
    _register_morph_backend()
    _building = {"world": step.world_size, "generation": step.generation,
                 "comms": _morph_groups(step), "backends": []}
    try:
        groups = _build(step, runtime, "morph", timeout, local_rank, previous)
        groups.backends = _building["backends"]
    finally:
        _building = None
    return groups


def _build(step: Any, runtime: Any, backend: str, timeout: datetime.timedelta, local_rank: int,
           previous: Optional[ProcessGroups]) -> ProcessGroups:
    from torch.distributed.device_mesh import DeviceMesh

    from . import _torch_backend

    t0 = time.perf_counter()
    phases = {}
    _start_retirer()
    destroy(previous)
    phases["destroy"] = time.perf_counter() - t0
    cfg = step.config
    rank, world = step.rank, step.world_size
    # The job's store for this generation (its own connection, checked with the job token).
    store = _torch_backend.create_store(runtime.connect_store("torch")._capsule(),
                                        int(timeout.total_seconds() * 1000))
    phases["store"] = time.perf_counter() - t0
    device = "cuda" if backend == "nccl" else "cpu"
    for stale in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(stale, None)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(local_rank if local_rank >= 0 else 0))
    hook = sys.excepthook
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    if sys.excepthook is not hook:  # torch wrapped it: one prefix, this generation's rank
        sys.excepthook = _rank_prefixed(getattr(hook, "_morph_base", hook), rank)
    phases["init"] = time.perf_counter() - t0
    forget_meshes()
    mesh = DeviceMesh(device, torch.arange(world).reshape(cfg.pp, cfg.dp, cfg.tp),
                      mesh_dim_names=("pp", "dp", "tp"))
    return ProcessGroups(generation=step.generation, rank=rank, world_size=world, config=cfg,
                         world=dist.group.WORLD, dp=mesh.get_group("dp"), tp=mesh.get_group("tp"),
                         pp=mesh.get_group("pp"), mesh=mesh, store=store,
                         seconds=time.perf_counter() - t0, phases=phases)


def forget_meshes() -> None:
    """Empties DTensor's caches of sharding decisions (C++ and Python) and of mesh topology.
    They are keyed by DeviceMesh equality (ranks, shape, names), not identity: a generation's
    mesh equal to an earlier one's (dp 2 again after dp 3, or the fake world of morph.elastic's
    discovery build) would otherwise get results holding the earlier mesh object, whose
    coordinates are those of this process's earlier rank, and DTensor ops (FSDP2's sharded
    parameters, DCP's offsets) would place local tensors at another rank's offsets. Called
    whenever the groups of a generation are built."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._collective_utils import MeshTopoInfo
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:  # pragma: no cover (torch without DTensor)
        return
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()
    prop = DTensor._op_dispatcher.sharding_propagator
    for cached in (getattr(prop, "propagate_op_sharding", None),
                   getattr(ShardingPropagator, "_propagate_tensor_meta_cached", None),
                   getattr(MeshTopoInfo, "build_from_mesh", None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


def is_collective_failure(exc: BaseException) -> bool:
    """True for what a collective raises when a peer failed or the group was aborted (the step
    is then aborted and the job recovers); False for a program's mistake (a wrong argument, a
    group used from another thread, a call out of order), which is the program's to handle.
    The morph backend says which by type (DistBackendError, DistNetworkError, DistStoreError:
    failures; ValueError, RuntimeError: the program's); torch's own Gloo and NCCL groups raise
    a RuntimeError for a lost peer, told apart by its text. An exception raised `from` one
    (torch.distributed.pipelining's "[Stage 1] failed to run forward" RuntimeError around
    FSDP2's aborted all_gather) is one too: its causes are looked at."""
    seen = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        if _is_collective_failure(e):
            return True
        seen.add(id(e))
        e = e.__cause__
    return False


def _is_collective_failure(exc: BaseException) -> bool:
    from ._errors import MorphError

    if isinstance(exc, MorphError):
        return exc.code_name in ("ABORTED", "UNAVAILABLE", "DEADLINE_EXCEEDED")
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    if type(exc) is not RuntimeError or text.startswith("morph backend:"):
        return False
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer",
                                   "gloo", "Gloo", "NCCL", "ProcessGroup", "Timed out"))
