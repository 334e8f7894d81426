"""The PyTorch door's safety on a one-worker job (ctest torch_door_test, label torch; issue 33).

Each case runs a small program in a process of its own, as a user would write it, and checks
what a program's mistake gets: a Python exception naming it, never a segfault, a hang, silently
wrong values or a lost job. The multi-worker cases are door_worker.py under morphrun
(door_multi_test.sh).

  door_test.py [unittest args]   (PYTHONPATH holds the built package: run_python.sh sets it)
"""
import os
import signal
import subprocess
import sys
import textwrap
import time
import unittest

PRELUDE = """
import gc, os, sys, time
import torch, torch.distributed as dist
import morph
def declare(s):
    s.add_tensor("w", torch.arange(6, dtype=torch.float32))
    s.add_scalar("count", 8)
def start(**kw):
    kw.setdefault("global_batch", 2)
    kw.setdefault("dataset_samples", 100)
    return morph.start(declare, **kw)
"""


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MORPH_", "OMPI_", "SLURM_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run(body, timeout=120, env=None):
    """Runs PRELUDE + body in a fresh interpreter: (returncode, stdout, stderr)."""
    p = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)],
                       env=env or clean_env(), capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


class DoorTest(unittest.TestCase):
    def ok(self, body, want, timeout=120, env=None):
        rc, out, err = run(body, timeout, env)
        detail = f"rc {rc}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
        self.assertEqual(rc, 0, detail)
        for w in want:
            self.assertIn(w, out, detail)
        self.assertNotIn("leaked", err, detail)  # nanobind's leak warnings at exit
        return out, err

    # ---- item 4: objects that outlive their owner ----
    def test_state_after_runtime_deleted(self):
        self.ok("""
            rt = start()
            state = rt.state
            rt.finish()
            del rt
            gc.collect()
            for what, fn in (("scalar", lambda: state.scalar("count")),
                             ("tensor", lambda: state.tensor("w")),
                             ("names", lambda: state.shard("w"))):
                try:
                    fn()
                    print("NOT REFUSED", what)
                except morph.FailedPreconditionError as e:
                    print("refused", what, e)
        """, ["refused scalar", "refused tensor", "refused names", "closed"])

    def test_group_and_communicator_after_runtime_deleted(self):
        self.ok("""
            rt = start()
            with rt.step() as step:
                g = step.groups.world
                comm = step.communicator("world")
                rt.commit_update()
            rt.finish()
            del rt, step
            gc.collect()
            x = torch.ones(2)
            try:
                dist.all_reduce(x, group=g)
                print("NOT REFUSED group")
            except Exception as e:
                print("refused group", type(e).__name__, e)
            try:
                comm.barrier(1000)
                print("NOT REFUSED communicator")
            except morph.FailedPreconditionError as e:
                print("refused communicator", e)
        """, ["refused group", "refused communicator"])

    def test_step_after_close(self):
        self.ok("""
            rt = start()
            with rt.step() as step:
                print("samples", step.samples)
                rt.commit_update()
            with rt.step() as second:
                try:
                    step.samples
                    print("NOT REFUSED after next step")
                except morph.FailedPreconditionError as e:
                    print("refused after next step", e)
                rt.commit_update()
            rt.finish()
            rt.close()
            for what, fn in (("samples", lambda: second.samples),
                             ("communicator", lambda: second.communicator("world"))):
                try:
                    fn()
                    print("NOT REFUSED", what)
                except morph.FailedPreconditionError as e:
                    print("refused", what, e)
            print("index still readable", second.index)
        """, ["refused after next step", "refused samples", "refused communicator",
              "index still readable 1"])

    # ---- item 11: a program's error is the program's exception ----
    def test_commit_update_twice(self):
        rc, out, err = run("""
            rt = start()
            with rt.step() as step:
                rt.commit_update()
                rt.commit_update()
            print("SWALLOWED")
        """)
        self.assertNotEqual(rc, 0, out + err)
        self.assertNotIn("SWALLOWED", out)
        self.assertIn("FailedPreconditionError", err)
        self.assertIn("commit_update", err)
        self.assertNotIn("DATA_LOSS", err)
        self.assertNotIn("torn", err)

    # ---- item 15: smaller ----
    def test_begin_step_after_finish(self):
        self.ok("""
            rt = start()
            with rt.step() as step:
                rt.commit_update()
            rt.finish()
            try:
                s = rt.begin_step()
                print("NOT REFUSED", s)
            except morph.FailedPreconditionError as e:
                print("refused", e)
            rt.close()
        """, ["refused"])

    def test_shape_not_integral(self):
        self.ok("""
            def bad(s):
                for shape in ((4.7,), (2, "3"), (True, 2)):
                    try:
                        s.add_tensor("x%d" % len(s.names()), shape=shape)
                        print("NOT REFUSED", shape)
                    except morph.InvalidArgumentError as e:
                        print("refused", shape, e)
                s.add_tensor("w", shape=(2,))
            rt = morph.start(bad, global_batch=2, dataset_samples=10)
            print("names", rt.state.names())
            rt.finish(); rt.close()
        """, ["refused (4.7,)", "refused (2, '3')", "refused (True, 2)", "names ['w']"])

    # ---- item 14: an impossible tensor raises, never waits forever ----
    def test_tensor_too_large_for_memory(self):
        out, _ = self.ok("""
            def huge(s):
                s.add_tensor("huge", shape=(1 << 40,))  # 4 TiB of float32
            t = time.monotonic()
            try:
                morph.start(huge, global_batch=2, dataset_samples=10)
                print("NOT REFUSED")
            except morph.ResourceExhaustedError as e:
                print("refused after %.1f s:" % (time.monotonic() - t), e)
        """, ["refused after", "huge"], timeout=90)

    # ---- items 9, 10: SIGINT is a preemption notice, and honoured while the binding blocks ----
    def test_sigint_while_start_waits(self):
        """A worker of a 2-worker job waiting in morph.start for the second one: SIGINT (a
        preemption notice) ends the wait at once: start returns a runtime that is already
        finished (the program's loop sees a done step) instead of waiting out the timeout."""
        env = clean_env(MORPH_INITIAL_WORLD="2", MORPH_START_TIMEOUT_MS="60000")
        p = subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent("""
            print("starting", flush=True)
            rt = start()
            with rt.step() as step:
                print("returned; finished", rt.finished, "done", step.done, flush=True)
            rt.finish()
            rt.close()
        """)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            self.assertEqual(p.stdout.readline().strip(), "starting")
            time.sleep(3)  # inside the binding by now
            t = time.monotonic()
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=20)
            took = time.monotonic() - t
        finally:
            p.kill()
        self.assertEqual(p.returncode, 0, out + err)
        self.assertIn("returned; finished True done True", out)
        self.assertLess(took, 5, f"{took:.1f} s after SIGINT\n{err}")

    def test_sigint_while_start_dials_a_coordinator_that_is_not_there(self):
        """MORPH_COORDINATOR names a port nobody listens on: morph.start retries until its
        timeout (60 s here); SIGINT ends that at once, start returning a finished runtime."""
        env = clean_env(MORPH_COORDINATOR="127.0.0.1:1", MORPH_TOKEN="t",
                        MORPH_START_TIMEOUT_MS="60000")
        p = subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent("""
            print("starting", flush=True)
            rt = start()
            print("returned; finished", rt.finished, flush=True)
            rt.close()
        """)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            self.assertEqual(p.stdout.readline().strip(), "starting")
            time.sleep(3)
            t = time.monotonic()
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=20)
            took = time.monotonic() - t
        finally:
            p.kill()
        self.assertEqual(p.returncode, 0, out + err)
        self.assertIn("returned; finished True", out)
        self.assertLess(took, 5, f"{took:.1f} s after SIGINT\n{err}")

    def test_sigint_in_step_loop_leaves(self):
        """SIGINT to a training worker is a preemption notice: it leaves at the next step
        boundary (step.done), finishes normally and exits 0."""
        p = subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent("""
            rt = start()
            n = 0
            while True:
                with rt.step() as step:
                    if step.done:
                        break
                    if n == 0:
                        print("training", flush=True)
                    n += 1
                    time.sleep(0.01)
                    rt.commit_update()
            print("left after", n, "steps; finished", rt.finished, flush=True)
            rt.finish()
            rt.close()
        """)], env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            self.assertEqual(p.stdout.readline().strip(), "training")
            time.sleep(1)
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=30)
        finally:
            p.kill()
        self.assertEqual(p.returncode, 0, out + err)
        self.assertIn("finished True", out)
        self.assertNotIn("KeyboardInterrupt", err)

    def test_second_sigint_exits_at_once(self):
        """A worker blocked (here in a collective nobody else joins: a 1-worker job cannot
        block, so a sleep in C++ stands for it: time.sleep releases nothing) leaves at the
        next boundary after one SIGINT; a second one ends it at once."""
        p = subprocess.Popen([sys.executable, "-c", PRELUDE + textwrap.dedent("""
            rt = start()
            with rt.step() as step:
                print("in step", flush=True)
                time.sleep(60)
        """)], env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            self.assertEqual(p.stdout.readline().strip(), "in step")
            p.send_signal(signal.SIGINT)
            time.sleep(1)
            self.assertIsNone(p.poll())  # the first one is a notice
            t = time.monotonic()
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=20)
            took = time.monotonic() - t
        finally:
            p.kill()
        self.assertNotEqual(p.returncode, 0)
        self.assertLess(took, 5)
        self.assertIn("again", err)  # the first notice said what a second one does


if __name__ == "__main__":
    unittest.main(verbosity=2)
