"""torch.distributed process groups for each morph generation (docs/torch.md "Process groups").

At the first step of every generation the runtime rebuilds the default process group (the
world), the DP, TP and PP groups and a DeviceMesh ("pp", "dp", "tp") over them, with ranks
exactly morph's (rank = (p*dp + d)*tp + t). With the "morph" backend (the default on CPU) those
groups are the generation's morph communicators (morph._torch_backend), built in the prepare and
aborted by the runtime when a peer fails, so that a torch collective in flight raises at once;
other groups are torch's Gloo. The rendezvous is a torch TCPStore that a process hosts from the
first generation it is rank 0 of; its address travels over morph's world communicator (one
256-byte broadcast), so nothing but morph's own bootstrap is needed: no MASTER_ADDR/MASTER_PORT
is read. They are written, with RANK, WORLD_SIZE and LOCAL_RANK, for libraries that read them.

With torch's Gloo ("gloo"), a killed peer's neighbours raise at once (their TCP pairs close); a
rank blocked behind the dead peer, or on a peer that hangs without dying, is bounded by the
groups' timeout (`timeout`; morph.start passes 60% of morph's failure detection time).
"""
from __future__ import annotations

import datetime
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

_ADDR_BYTES = 256


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


def _create_backend(opts: Any, _backend_options: Any) -> Any:
    """torch's creator of a "morph" group: while build() runs, morph's communicator when the
    group's ranks are the generation's world, a DP, TP or PP group; torch's Gloo over the
    generation's store for any other group (an HSDP mesh dimension, a program's new_group)."""
    from . import _torch_backend

    b = _building
    found = None
    if b is not None:
        ranks = tuple(opts.global_ranks_in_group) or tuple(range(b["world"]))
        found = b["comms"].get(ranks)
    if found is None:  # not one of morph's groups
        return dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, opts.timeout)
    comm, name = found
    backend = _torch_backend.create(comm._address(), f"generation {b['generation']}'s {name}",
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


# The rendezvous store. A process hosts one TCPStore from the first generation it is rank 0
# of, for its lifetime (each generation's keys under their own prefix), and keeps its client
# connection to the store it used last: a change whose rank 0 hosted the previous generation's
# store too (the common case) creates and connects nothing.
_hosted: Any = None
_client: tuple = ("", None)  # (address, TCPStore)


def _hosted_store_address(host: str, world: int, timeout: datetime.timedelta) -> str:
    global _hosted
    if _hosted is None:
        _hosted = dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False,
                                timeout=timeout, use_libuv=True)
    return f"{host}:{_hosted.port}"


def _store_client(address: str, world: int, timeout: datetime.timedelta) -> Any:
    global _client
    if _hosted is not None and address == f"{_hosted.host}:{_hosted.port}":
        _client = (address, _hosted)  # this process hosts it
    elif _client[0] != address:
        host, port = address.rsplit(":", 1)
        _client = (address, dist.TCPStore(host, int(port), world, is_master=False,
                                          timeout=timeout, use_libuv=True))
    _client[1].set_timeout(timeout)
    return _client[1]


def build(step: Any, *, backend: str = "gloo", host: str = "127.0.0.1",
          timeout: datetime.timedelta = datetime.timedelta(seconds=300),
          local_rank: int = -1, previous: Optional[ProcessGroups] = None) -> ProcessGroups:
    """Builds the groups of `step`'s generation (every rank of it calls this at the same step).
    `backend`: "morph" (torch groups over morph's communicators, CPU), "gloo" or "nccl".
    Raises what torch or the morph broadcast raised when a peer failed meanwhile."""
    global _building
    if backend != "morph":
        return _build(step, backend, host, timeout, local_rank, previous)
    _register_morph_backend()
    _building = {"world": step.world_size, "generation": step.generation,
                 "comms": _morph_groups(step), "backends": []}
    try:
        groups = _build(step, "morph", host, timeout, local_rank, previous)
        groups.backends = _building["backends"]
    finally:
        _building = None
    return groups


def _build(step: Any, backend: str, host: str, timeout: datetime.timedelta, local_rank: int,
           previous: Optional[ProcessGroups]) -> ProcessGroups:
    from torch.distributed.device_mesh import DeviceMesh

    t0 = time.perf_counter()
    phases = {}
    _start_retirer()
    destroy(previous)
    phases["destroy"] = time.perf_counter() - t0
    cfg = step.config
    rank, world = step.rank, step.world_size
    comm = step.communicator("world")
    addr = torch.zeros(_ADDR_BYTES, dtype=torch.uint8)
    timeout_ms = int(timeout.total_seconds() * 1000)
    if rank == 0:
        text = _hosted_store_address(host, world, timeout).encode()
        addr[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    phases["store"] = time.perf_counter() - t0
    comm.broadcast(addr.data_ptr(), _ADDR_BYTES, "u8", 0, timeout_ms)
    phases["broadcast"] = time.perf_counter() - t0
    master = bytes(addr.tolist()).rstrip(b"\0").decode()
    master_host, master_port = master.rsplit(":", 1)
    store = _store_client(master, world, timeout)
    phases["connect"] = time.perf_counter() - t0
    prefixed = dist.PrefixStore(f"morph/g{step.generation}", store)
    device = "cuda" if backend == "nccl" else "cpu"
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR=master_host,
                      MASTER_PORT=master_port,
                      LOCAL_RANK=str(local_rank if local_rank >= 0 else 0))
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
    phases["init"] = time.perf_counter() - t0
    mesh = DeviceMesh(device, torch.arange(world).reshape(cfg.pp, cfg.dp, cfg.tp),
                      mesh_dim_names=("pp", "dp", "tp"))
    return ProcessGroups(generation=step.generation, rank=rank, world_size=world, config=cfg,
                         world=dist.group.WORLD, dp=mesh.get_group("dp"), tp=mesh.get_group("tp"),
                         pp=mesh.get_group("pp"), mesh=mesh, store=store,
                         seconds=time.perf_counter() - t0, phases=phases)


def is_collective_failure(exc: BaseException) -> bool:
    """True for what a torch collective raises when a peer failed or the group was aborted."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "gloo",
                            "Gloo", "NCCL", "ProcessGroup", "Timed out"))
