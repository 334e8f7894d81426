"""morph.data on one process (ctest torch_data_test, label torch): the cursor's binding equals
what the runtime's steps hold; the loader serves exactly each step's micro-batches (ids) for many
steps and configs, with and without worker processes, through torch's DataLoader and torchdata's
StatefulDataLoader; what was prefetched for another slice or step is dropped (and only then);
bad input raises naming it; loader workers ignore the trainer's preemption signals and die with
it. Items are their own ids, so a served batch says which samples it holds."""
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import unittest
from types import SimpleNamespace

import torch
import torch.utils.data as tud

import morph

N, B, MB, SEED = 97, 10, 2, 5  # B not a multiple of most dp: uneven slices and micro-batches


class Ids(tud.Dataset):
    """Item i is the tensor i."""

    def __init__(self, n=N):
        self.n = n

    def __getitem__(self, i):
        return torch.tensor(i)

    def __len__(self):
        return self.n


class ManyIds(Ids):
    """With torch's batched fetch (__getitems__): it must receive exactly the ids."""

    def __getitems__(self, ids):
        assert all(isinstance(i, int) for i in ids), ids
        return [torch.tensor(i) for i in ids]


def fake_runtime(n=N, b=B, mb=MB, seed=SEED):
    """What the loader reads of a runtime: its cursor and Options.micro_batch."""
    return SimpleNamespace(_core=SimpleNamespace(cursor=morph.DatasetCursor(n, b, seed)),
                           options=SimpleNamespace(micro_batch=mb))


def fake_step(cursor, index, dp, d, generation=1, mb=MB, done=False):
    """A Step as the runtime hands it out for (index, dp, d): its micro-batches from the cursor
    (test_cursor_is_the_steps' checks that they are the runtime's)."""
    return SimpleNamespace(done=done, index=index, generation=generation,
                           config=SimpleNamespace(dp=dp), coords=(0, d, 0),
                           micro_batches=cursor.batch_for(index, dp, d, mb).micro_batches,
                           global_batch=cursor.global_batch)


def served(loader, step):
    return [b.tolist() for b in loader.micro_batches(step)]


def start_runtime():
    for k in list(os.environ):
        if k.startswith(("MORPH_", "OMPI_", "SLURM_")):
            del os.environ[k]
    return morph.start(lambda s: s.add_scalar("x", 8), global_batch=B, dataset_samples=N,
                       micro_batch=MB, dataset_seed=SEED, process_groups=False)


class CursorTest(unittest.TestCase):
    def test_cursor_is_the_steps(self):
        rt = start_runtime()
        try:
            c = rt._core.cursor
            self.assertEqual((c.num_samples, c.global_batch, c.seed, c.shuffle),
                             (N, B, SEED, True))
            for _ in range(12):
                with rt.step() as step:
                    b = c.batch_for(step.index, 1, 0, MB)
                    self.assertEqual(b.samples, step.samples)
                    self.assertEqual(b.micro_batches, step.micro_batches)
                    self.assertEqual(b.first_position, step.index * B)
            # And the loader serves them, on the runtime's own steps.
            loader = morph.ElasticDataLoader(rt, Ids(), num_workers=2, prefetch_factor=2)
            for _ in range(12):
                with rt.step() as step:
                    self.assertEqual(served(loader, step), step.micro_batches)
            self.assertEqual(loader.restarts, 1)
            loader.close()
            rt.finish()
        finally:
            rt.close()

    def test_one_epoch_is_a_permutation_and_slices_partition_steps(self):
        c = morph.DatasetCursor(N, B, SEED)
        epoch = [c.sample_at(p) for p in range(N)]
        self.assertEqual(sorted(epoch), list(range(N)))
        for s in range(0, 30, 7):
            for dp in (1, 2, 3, 4, 7):
                got = [i for d in range(dp) for i in c.batch_for(s, dp, d, MB).samples]
                self.assertEqual(got, [c.sample_at(p) for p in range(s * B, (s + 1) * B)])

    def test_bad_arguments_and_pickle(self):
        with self.assertRaises(morph.InvalidArgumentError):
            morph.DatasetCursor(0, 4)
        with self.assertRaises(morph.InvalidArgumentError):
            morph.DatasetCursor(10, 0)
        c = morph.DatasetCursor(N, B, SEED, shuffle=False)
        for bad in ((-1, 1, 0, 1), (0, 0, 0, 1), (0, 2, 2, 1), (0, 2, -1, 1), (0, 1, 0, 0)):
            with self.assertRaises(morph.InvalidArgumentError, msg=str(bad)):
                c.batch_for(*bad)
        with self.assertRaises(morph.InvalidArgumentError):
            c.sample_at(-1)
        self.assertEqual([c.sample_at(p) for p in range(5)], [0, 1, 2, 3, 4])
        d = pickle.loads(pickle.dumps(c))
        self.assertEqual(repr(d), repr(c))
        self.assertEqual(d.batch_for(3, 2, 1, 2).micro_batches, c.batch_for(3, 2, 1, 2).micro_batches)


class LoaderTest(unittest.TestCase):
    """Steps through changes: dp and the DP coordinate change, a generation keeps the slice, a
    recovery rolls back, a rank with no sample, a step abandoned half-way."""

    # (generation, first step, last step, dp, dp rank)
    SCRIPT = [(1, 0, 4, 1, 0),
              (2, 5, 9, 3, 2),     # a grow: another slice -> dropped, restarted
              (3, 10, 12, 3, 2),   # a change that keeps this rank's slice: kept
              (4, 11, 15, 4, 1),   # a recovery to step 11 under dp 4 (slices of 2 and 3)
              (5, 16, 18, 12, 0),  # dp > B: this rank trains nothing
              (6, 16, 22, 2, 1)]   # recovery again, back to dp 2

    def run_script(self, num_workers, loader_class=None, dataset=None):
        rt = fake_runtime()
        c = rt._core.cursor
        kw = dict(prefetch_factor=3) if num_workers else {}
        loader = morph.ElasticDataLoader(rt, dataset or Ids(), num_workers=num_workers,
                                         loader_class=loader_class, **kw)
        restarts = []
        for gen, first, last, dp, d in self.SCRIPT:
            for s in range(first, last + 1):
                step = fake_step(c, s, dp, d, gen)
                before = loader.restarts
                if gen == 4 and s == 13:  # the program leaves a step half-way
                    it = loader.micro_batches(step)
                    self.assertEqual(next(it).tolist(), step.micro_batches[0])
                    continue
                self.assertEqual(served(loader, step), step.micro_batches, (gen, s, dp, d))
                if loader.restarts != before:
                    restarts.append((gen, s))
        # Restarts exactly where the slice or the step differed from the prefetched one.
        self.assertEqual(restarts, [(1, 0), (2, 5), (4, 11), (4, 14), (6, 16)])
        if num_workers:
            self.assertGreater(loader.dropped, 0)
        else:
            self.assertEqual(loader.dropped, 0)
        st = loader.state_dict()
        self.assertEqual((st["next_step"], st["dp"], st["dp_rank"]), (23, 2, 1))
        loader.close()
        with self.assertRaises(morph.FailedPreconditionError):
            loader.micro_batches(fake_step(c, 23, 2, 1))

    def test_in_process(self):
        self.run_script(0)

    def test_worker_processes(self):
        self.run_script(2)

    def test_batched_fetch(self):
        self.run_script(2, dataset=ManyIds())

    def test_stateful_dataloader(self):
        from torchdata.stateful_dataloader import StatefulDataLoader
        self.run_script(0, StatefulDataLoader)
        self.run_script(2, StatefulDataLoader)
        rt = fake_runtime()
        loader = morph.ElasticDataLoader(rt, Ids(), num_workers=2, loader_class=StatefulDataLoader)
        step = fake_step(rt._core.cursor, 0, 2, 0)
        self.assertEqual(served(loader, step), step.micro_batches)
        self.assertIsInstance(loader.loader.state_dict(), dict)  # torchdata's own state
        loader.close()

    def test_non_persistent_workers_and_collate(self):
        rt = fake_runtime()
        c = rt._core.cursor
        loader = morph.ElasticDataLoader(rt, Ids(), num_workers=1, persistent_workers=False,
                                         collate_fn=lambda items: [int(x) + 1000 for x in items])
        for s, dp in ((0, 1), (1, 1), (2, 3), (3, 3)):
            step = fake_step(c, s, dp, 0)
            got = list(loader.micro_batches(step))
            self.assertEqual(got, [[i + 1000 for i in mb] for mb in step.micro_batches])
        self.assertEqual(loader.restarts, 2)
        loader.close()

    def test_spawned_workers(self):
        """The loader's pieces pickle: workers started by spawn serve the same."""
        rt = fake_runtime()
        c = rt._core.cursor
        loader = morph.ElasticDataLoader(rt, Ids(), num_workers=1,
                                         multiprocessing_context="spawn")
        for s, dp in ((0, 2), (1, 2), (2, 3)):
            step = fake_step(c, s, dp, 1)
            self.assertEqual(served(loader, step), step.micro_batches)
        loader.close()

    def test_done_step(self):
        rt = SimpleNamespace(runtime=fake_runtime())  # what a morph.ElasticJob holds
        loader = morph.ElasticDataLoader(rt, Ids())
        self.assertEqual(list(loader.micro_batches(SimpleNamespace(done=True))), [])
        self.assertEqual(loader.restarts, 0)


class BadInputTest(unittest.TestCase):
    def refused(self, dataset=None, rt=None, **kw):
        with self.assertRaises(morph.MorphError) as cm:
            morph.ElasticDataLoader(rt or fake_runtime(), Ids() if dataset is None else dataset,
                                    **kw)
        return str(cm.exception)

    def test_datasets(self):
        class Stream(tud.IterableDataset):
            def __iter__(self):
                return iter(range(N))

        class NoLen:
            def __getitem__(self, i):
                return i

        class NoItem(tud.Dataset):
            def __len__(self):
                return N

        m = self.refused(Stream())
        self.assertIn("the dataset (Stream) is an IterableDataset", m)
        self.assertIn("map-style", m)
        self.assertIn("the dataset (NoLen) has no len()", self.refused(NoLen()))
        self.assertIn("the dataset (NoItem) has no __getitem__", self.refused(NoItem()))
        m = self.refused(Ids(N - 1))
        self.assertIn(f"the dataset (Ids) holds {N - 1} samples, the runtime's cursor {N}", m)
        self.assertIn("dataset_samples", m)
        self.assertIn("would never be trained", self.refused(Ids(N + 5)))
        self.assertIsInstance(
            morph._errors._from_status(3, "x", [], None, None), ValueError)  # InvalidArgument

    def test_arguments_the_runtime_decides(self):
        for k, v in (("batch_size", 4), ("shuffle", True), ("sampler", [1]),
                     ("batch_sampler", [[1]]), ("drop_last", True), ("in_order", False)):
            self.assertIn(f"'{k}", self.refused(**{k: v}))
        self.assertIn("not a torch DataLoader class", self.refused(loader_class=dict))
        self.assertIn("the runtime is closed or not started", self.refused(rt=object()))


WORKERS_SCRIPT = textwrap.dedent("""
    import os, sys, time, torch, torch.utils.data as tud, morph
    from types import SimpleNamespace
    class Ids(tud.Dataset):
        def __getitem__(self, i): return torch.tensor(i)
        def __len__(self): return 50
    rt = SimpleNamespace(_core=SimpleNamespace(cursor=morph.DatasetCursor(50, 4)),
                         options=SimpleNamespace(micro_batch=2))
    pids = []
    loader = morph.ElasticDataLoader(rt, Ids(), num_workers=2,
                                     worker_init_fn=lambda w: open(sys.argv[1] + "/" + str(os.getpid()), "w").close())
    step = SimpleNamespace(done=False, index=0, config=SimpleNamespace(dp=1), coords=(0, 0, 0),
                           micro_batches=rt._core.cursor.batch_for(0, 1, 0, 2).micro_batches)
    for b in loader.micro_batches(step): pass
    print("ready", flush=True)
    time.sleep(60)
""")


def running(pid):
    """The process exists and is not a zombie (an orphan's reaper may be slow)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class WorkerProcessTest(unittest.TestCase):
    def test_workers_ignore_preemption_signals_and_die_with_the_trainer(self):
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            p = subprocess.Popen([sys.executable, "-c", WORKERS_SCRIPT, tmp],
                                 stdout=subprocess.PIPE, text=True)
            try:
                self.assertEqual(p.stdout.readline().strip(), "ready")
                pids = [int(f) for f in os.listdir(tmp)]
                self.assertEqual(len(pids), 2)
                for w in pids:  # the trainer's notices, sent to its whole group
                    os.kill(w, signal.SIGINT)
                    os.kill(w, signal.SIGTERM)
                time.sleep(0.3)
                for w in pids:
                    os.kill(w, 0)  # still there
                p.kill()
                p.wait()
                t0 = time.time()
                alive = pids
                while alive and time.time() - t0 < 3:
                    alive = [w for w in alive if running(w)]
                    time.sleep(0.02)
                # torch's own watchdog would take up to 5 s; PR_SET_PDEATHSIG at once.
                self.assertEqual(alive, [], "loader workers outlived their trainer")
                self.assertLess(time.time() - t0, 1.0)
            finally:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                p.stdout.close()


if __name__ == "__main__":
    unittest.main()
