"""morph.data: a torch DataLoader that serves exactly the runtime's samples of each step.

morph's dataset cursor (include/morph/dataset_cursor.h) decides which samples every step trains:
step s consumes positions [s*B, (s+1)*B) of a seeded per-epoch permutation of the N sample ids,
DP rank d of dp takes the d-th slice, cut into micro-batches of at most Options.micro_batch
(`step.samples`, `step.micro_batches`). Its whole state is the step, so a change or a recovery
only moves the step. ElasticDataLoader is the data path a PyTorch program uses on top of it: a
`torch.utils.data.DataLoader` (worker processes, prefetch, pin_memory, collate_fn) or torchdata's
`StatefulDataLoader` whose batch sampler yields this rank's micro-batches of steps s, s+1, ...
under the current config, read from the same cursor (the runtime's, `Runtime::cursor()`: no
second implementation of the order). At the first step whose slice differs from what was
prefetched (another dp or DP coordinate after a change, or another step: a recovery rolled
back, a joiner's first step), the prefetched batches are dropped and loading restarts at the
step the runtime gives.

    loader = morph.data.ElasticDataLoader(rt, dataset, num_workers=2, prefetch_factor=2)
    while True:
        with rt.step() as step:
            if step.done or step.index >= steps:
                break
            for batch in loader.micro_batches(step):   # collated, in step.micro_batches order
                (model(batch).sum() / step.global_batch).backward()   # scale by B, not by dp
            ...                                         # all_reduce(SUM) over step.groups.dp
    loader.close()

Semantics (docs/torch.md "Data"): map-style datasets only (dataset[i] for a sample id i,
len(dataset) == morph.start's dataset_samples); every sample of an epoch is trained exactly
once by the steps that count whatever changes, kills and preemptions happen (a recovery's
replayed steps train their samples again, in place of the lost ones); the global batch is fixed;
dp changes are absorbed by the number of micro-batches a rank trains (gradient accumulation).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Tuple

import torch.utils.data as tud

from . import _morph
from ._errors import FailedPreconditionError, InvalidArgumentError, MorphError

DatasetCursor = _morph.DatasetCursor

# DataLoader arguments the runtime decides: the samples, their order and the batch sizes.
_DECIDED = {
    "batch_size": "the micro-batch size is morph.start(micro_batch=...)",
    "shuffle": "the order is the runtime's (morph.start(dataset_seed=..., dataset_shuffle=...))",
    "sampler": "the runtime's cursor chooses every step's samples",
    "batch_sampler": "the runtime's cursor chooses every step's samples",
    "drop_last": "every sample of the step is trained",
    "generator": "the order is the runtime's (morph.start(dataset_seed=...))",
}


class _Request(NamedTuple):
    """One micro-batch to load: micro-batch k of step `step` for DP rank dp_rank of dp."""
    step: int
    k: int
    dp: int
    dp_rank: int
    ids: List[int]


class _Fetched(NamedTuple):
    request: _Request
    items: List[Any]


class _Fetch(tud.Dataset):
    """The program's dataset, fetched by request: the request travels with its items through the
    workers and collate_fn, so that the loader can check each batch against the step it serves."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __getitems__(self, request: _Request) -> _Fetched:
        many = getattr(self.dataset, "__getitems__", None)
        items = many(list(request.ids)) if many else [self.dataset[i] for i in request.ids]
        return _Fetched(request, items)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[i]

    def __len__(self) -> int:
        return len(self.dataset)


class _Collate:
    def __init__(self, fn: Callable[[List[Any]], Any]) -> None:
        self.fn = fn

    def __call__(self, fetched: _Fetched) -> Tuple[_Request, Any]:
        return fetched.request, self.fn(fetched.items)


class _WorkerInit:
    """Runs first in every loader worker process. A worker ends with the training process
    (PR_SET_PDEATHSIG): forked, it holds copies of the runtime's sockets, and a SIGKILLed
    trainer whose workers lived on (torch's own watchdog notices only every 5 s) would keep its
    connections open, so its peers would learn of the death late. It ignores SIGINT and SIGTERM:
    they are the trainer's preemption notices (docs/operations.md "Preemption"), sent to the
    whole process group by Ctrl-C or a scheduler, and the trainer keeps loading through the
    steps that move its state away; the loader or the trainer's death ends the workers."""

    def __init__(self, trainer_pid: int, user: Optional[Callable[[int], None]]) -> None:
        self.trainer_pid = trainer_pid
        self.user = user

    def __call__(self, worker_id: int) -> None:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        try:  # the trainer may have died before the line above
            os.kill(self.trainer_pid, 0)
        except ProcessLookupError:
            os._exit(0)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.user is not None:
            self.user(worker_id)


class _StepBatchSampler:
    """A batch sampler yielding the requests of steps start, start+1, ... for one DP slice (an
    endless stream: the loader takes what each step needs). Lives in the training process."""

    def __init__(self, cursor: Any, micro_batch: int) -> None:
        self.cursor = cursor
        self.micro_batch = micro_batch
        self.start = (0, 1, 0)  # (step, dp, dp_rank) the next iteration begins with
        self.yielded = 0        # requests handed to the loader since the last restart

    def __iter__(self) -> Iterator[_Request]:
        step, dp, d = self.start
        cursor, mb = self.cursor, self.micro_batch
        self.yielded = 0
        lo, hi = cursor.range_for(0, dp, d)
        if hi <= lo:  # dp > B: this rank's slice is empty at every step
            return iter(())

        def requests() -> Iterator[_Request]:
            s = step
            while True:
                for k, ids in enumerate(cursor.batch_for(s, dp, d, mb).micro_batches):
                    self.yielded += 1
                    yield _Request(s, k, dp, d, ids)
                s += 1

        return requests()


def _check_dataset(dataset: Any, n: int) -> None:
    name = type(dataset).__name__
    if isinstance(dataset, tud.IterableDataset):
        raise InvalidArgumentError(
            f"morph.data: the dataset ({name}) is an IterableDataset: the runtime chooses each "
            f"step's samples by id, so the loader needs a map-style dataset (dataset[i] for a "
            f"sample id i in [0, {n})); index the stream, or read step.samples yourself")
    getitem = getattr(type(dataset), "__getitem__", None)
    if (getitem is None or getitem is tud.Dataset.__getitem__) and \
            not hasattr(dataset, "__getitems__"):
        raise InvalidArgumentError(
            f"morph.data: the dataset ({name}) has no __getitem__: the loader needs a map-style "
            f"dataset (dataset[i] for a sample id i in [0, {n}))")
    try:
        size = len(dataset)
    except TypeError:
        raise InvalidArgumentError(
            f"morph.data: the dataset ({name}) has no len(): the loader checks that it holds "
            f"the runtime's dataset_samples ({n}) samples") from None
    if size != n:
        raise InvalidArgumentError(
            f"morph.data: the dataset ({name}) holds {size} samples, the runtime's cursor {n} "
            f"(morph.start(dataset_samples=...)): "
            + ("sample ids up to %d would not exist" % (n - 1) if size < n else
               "samples from %d on would never be trained (pass a Subset for a part)" % n))


class ElasticDataLoader:
    """This rank's micro-batches of each step, loaded by a torch DataLoader (or any subclass:
    `loader_class=torchdata.stateful_dataloader.StatefulDataLoader`) from a map-style dataset.

    `rt` is the started runtime (morph.start, or a morph.ElasticJob's): its cursor and
    Options.micro_batch decide the samples. The DataLoader arguments are torch's (num_workers, prefetch_factor, pin_memory,
    collate_fn, worker_init_fn, multiprocessing_context, timeout, persistent_workers, ...),
    except those the runtime decides: batch_size, shuffle, sampler, batch_sampler, drop_last,
    generator, in_order=False (InvalidArgumentError naming the argument). persistent_workers
    defaults to True with worker processes: a restart then drains the workers' queues instead
    of forking new workers.

    Raises InvalidArgumentError naming the dataset when it is not map-style (an
    IterableDataset, no __getitem__, no len()) or its length is not the runtime's
    dataset_samples.

    The training thread's: call micro_batches() from the thread that runs the steps.
    """

    def __init__(self, rt: Any, dataset: Any, *, num_workers: int = 0,
                 collate_fn: Optional[Callable[[List[Any]], Any]] = None,
                 worker_init_fn: Optional[Callable[[int], None]] = None,
                 persistent_workers: Optional[bool] = None,
                 loader_class: Optional[type] = None, **loader_kwargs: Any) -> None:
        for k in loader_kwargs:
            if k in _DECIDED:
                raise InvalidArgumentError(f"morph.data: DataLoader argument '{k}': {_DECIDED[k]}")
        if loader_kwargs.get("in_order", True) is not True:
            raise InvalidArgumentError(
                "morph.data: DataLoader argument 'in_order=False': batches are served in the "
                "step's order")
        if not hasattr(rt, "_core") and hasattr(rt, "runtime"):  # a morph.ElasticJob
            rt = rt.runtime
        core = getattr(rt, "_core", None)
        if core is None:
            raise FailedPreconditionError("morph.data: the runtime is closed or not started "
                                          "(pass what morph.start returned)")
        self._cursor = core.cursor
        self._micro_batch = int(rt.options.micro_batch)
        _check_dataset(dataset, self._cursor.num_samples)
        loader_class = loader_class or tud.DataLoader
        if not (isinstance(loader_class, type) and issubclass(loader_class, tud.DataLoader)):
            raise InvalidArgumentError(
                f"morph.data: loader_class {loader_class!r} is not a torch DataLoader class")
        if persistent_workers is None:
            persistent_workers = num_workers > 0
        self.dataset = dataset
        self._sampler = _StepBatchSampler(self._cursor, self._micro_batch)
        self.loader = loader_class(
            _Fetch(dataset), batch_sampler=self._sampler, num_workers=num_workers,
            collate_fn=_Collate(collate_fn or tud.default_collate),
            worker_init_fn=_WorkerInit(os.getpid(), worker_init_fn) if num_workers > 0
            else worker_init_fn,
            persistent_workers=persistent_workers, **loader_kwargs)
        self._it: Optional[Iterator[Tuple[_Request, Any]]] = None
        self._key: Optional[Tuple[int, int]] = None  # (dp, dp_rank) being prefetched
        self._next: Tuple[int, int] = (-1, 0)        # (step, k) the iterator serves next
        self._served = 0                             # batches served since the last restart
        self.restarts = 0  # times loading restarted (the first start included)
        self.dropped = 0   # prefetched batches dropped at restarts

    # ---- the step's batches ----
    def micro_batches(self, step: Any) -> Iterator[Any]:
        """This rank's micro-batches of `step`, collated, in step.micro_batches order (none when
        step.done or the rank has no sample). Call it inside the step; the step's ids are read
        here, the batches come from the loader's prefetch. A step other than the one prefetched
        next, or another DP slice, drops what was prefetched and restarts loading there."""
        if self._cursor is None:
            raise FailedPreconditionError("morph.data: the loader is closed")
        if step.done:
            return iter(())
        want = step.micro_batches
        if not want:
            return iter(())
        key = (int(step.config.dp), int(step.coords[1]))
        index = int(step.index)
        if self._it is None or key != self._key or (index, 0) != self._next:
            self._restart(index, key)
        return self._serve(index, key, want)

    def _serve(self, index: int, key: Tuple[int, int], want: List[List[int]]) -> Iterator[Any]:
        n = len(want)
        for k in range(n):
            if self._next != (index, k):  # a later call restarted the loader under this one
                raise FailedPreconditionError(
                    f"morph.data: step {index}'s batches read after another step's")
            request, batch = next(self._it)
            self._served += 1
            if (request.step, request.k, request.dp, request.dp_rank) != (index, k, *key) or \
                    list(request.ids) != list(want[k]):
                raise MorphError(
                    f"morph.data: internal: the loader served micro-batch {request.k} of step "
                    f"{request.step} (dp {request.dp}, rank {request.dp_rank}) for micro-batch "
                    f"{k} of step {index} (dp {key[0]}, rank {key[1]})")
            self._next = (index, k + 1) if k + 1 < n else (index + 1, 0)
            yield batch

    def _restart(self, index: int, key: Tuple[int, int]) -> None:
        if self._it is not None:
            self.dropped += max(self._sampler.yielded - self._served, 0)
        if not self.loader.persistent_workers:
            self._it = None  # its workers end before new ones start
        self._sampler.start = (index, *key)
        self._key, self._next, self._served = key, (index, 0), 0
        self._it = iter(self.loader)  # persistent workers: their queues are drained
        self.restarts += 1

    # ---- lifecycle ----
    def close(self) -> None:
        """Ends the worker processes. Idempotent."""
        it, self._it = self._it, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self.loader = None
        self._cursor = None

    def __enter__(self) -> "ElasticDataLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def state_dict(self) -> dict:
        """Where loading stands: the step and slice served next. Informational: the position is
        the runtime's step (a checkpoint or recovery restores it), nothing to load back."""
        return {"next_step": self._next[0], "next_micro_batch": self._next[1],
                "dp": self._key[0] if self._key else None,
                "dp_rank": self._key[1] if self._key else None}


__all__ = ["ElasticDataLoader", "DatasetCursor"]
