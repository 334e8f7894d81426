"""The morph package's API on a one-worker job (ctest torch_api_test, label torch): errors as
exception classes, the placement mapping, bad input refused with a clear exception while the job
goes on, tensors shared with torch without copies, the step loop with process groups."""
import os
import sys
import unittest

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import morph


class ErrorsTest(unittest.TestCase):
    def test_codes_are_classes(self):
        for cls in (morph.AbortedError, morph.DataLossError, morph.UnavailableError,
                    morph.InvalidArgumentError, morph.DeadlineExceededError):
            self.assertTrue(issubclass(cls, morph.MorphError))
        e = morph._errors._from_status(10, "step 3 was not committed", [1, 2], "peer_closed", "dp/p0t0")
        self.assertIsInstance(e, morph.AbortedError)
        self.assertEqual(e.failed_peers, (1, 2))
        self.assertEqual(e.group, "dp/p0t0")
        self.assertIn("ABORTED: step 3", str(e))
        self.assertIsInstance(morph._errors._from_status(3, "x", [], None, None), ValueError)

    def test_collective_failures_through_wrappers(self):
        """A collective's failure raised `from` by a library (torch.distributed.pipelining's
        "[Stage 1] failed to run forward" around FSDP2's aborted all_gather) is one too; a
        program's own RuntimeError is not."""
        import torch.distributed as dist
        from morph.distributed import is_collective_failure
        failed = dist.DistNetworkError("morph backend: all_gather on generation 1's dp: ABORTED")
        try:
            try:
                raise failed
            except dist.DistNetworkError as e:
                raise RuntimeError("[Stage 1] failed to run forward") from e
        except RuntimeError as wrapped:
            self.assertTrue(is_collective_failure(wrapped))
        self.assertFalse(is_collective_failure(RuntimeError("[Stage 1] failed to run forward")))
        try:
            try:
                raise ValueError("shapes differ")
            except ValueError as e:
                raise RuntimeError("wrapped") from e
        except RuntimeError as wrapped:
            self.assertFalse(is_collective_failure(wrapped))

    def test_binding_raises_the_class(self):
        with self.assertRaises(morph.InvalidArgumentError) as cm:
            morph.shard_of("w", [4, 6], "f32", morph.Layout.layer(0).split_tp(5),
                           morph.ParallelConfig(), 0)
        self.assertIn("'w'", str(cm.exception))
        c = morph.ParallelConfig()
        c.dp = -1
        with self.assertRaises(morph.InvalidArgumentError):
            c.validate()


def _held(rows, dp, d):
    """Global element indices DP rank d holds of a [rows, 3] tensor under ChunkDP (shard_of)."""
    cfg = morph.ParallelConfig()
    cfg.dp = dp
    sh = morph.shard_of("w", [rows, 3], "f32", morph.Layout.layer(0).chunk_dp(), cfg, d)
    return list(range(sh[0][0] * 3 + sh[2], sh[0][0] * 3 + sh[3])) if sh[3] > sh[2] else []


class PlacementsTest(unittest.TestCase):
    def test_mapping(self):
        L = morph.Layout
        self.assertEqual(morph.layout_from_placements("w", (4, 6), [Replicate(), Replicate()]),
                         L.layer(0))
        self.assertEqual(morph.layout_from_placements("w", (4, 6), [Replicate(), Shard(1)], layer=2),
                         L.layer(2).chunk_tp(1))
        self.assertEqual(morph.layout_from_placements("w", (4, 6), [Replicate(), Shard(-2)]),
                         L.layer(0).chunk_tp(0))
        self.assertEqual(morph.layout_from_placements("b", (37,), [Shard(0), Replicate()]),
                         L.layer(0).chunk_dp())
        self.assertEqual(morph.layout_from_placements("w", (4, 6), [Shard(1)], ["tp"]),
                         L.layer(0).chunk_tp(1))
        # FSDP2: dim-0 rows over dp; with TP on dim 1; with TP on dim 0 (the strided shard).
        self.assertEqual(morph.layout_from_placements("w", (5, 6), [Shard(0), Replicate()]),
                         L.layer(0).chunk_dp())
        self.assertEqual(morph.layout_from_placements("w", (5, 6), [Shard(0), Shard(1)]),
                         L.layer(0).chunk_tp(1).chunk_dp())
        self.assertEqual(morph.layout_from_placements(
            "w", (10, 6), [_StridedShard(0, split_factor=2), Shard(0)]),
            L.layer(0).chunk_tp(0).chunk_dp())

    def test_hsdp_mapping(self):
        """HSDP (FSDP2 with a replicate and a shard mesh dimension) -> chunk_dp(S)."""
        L = morph.Layout
        hs = ["dp_replicate", "dp_shard", "tp"]
        self.assertEqual(morph.layout_from_placements(
            "w", (5, 6), [Replicate(), Shard(0), Replicate()], hs, dp_shard_size=2),
            L.layer(0).chunk_dp(2))
        self.assertEqual(morph.layout_from_placements(
            "w", (5, 6), [Replicate(), Shard(0), Shard(1)], hs, layer=1, dp_shard_size=3),
            L.layer(1).chunk_tp(1).chunk_dp(3))
        self.assertEqual(morph.layout_from_placements(
            "w", (10, 6), [Replicate(), _StridedShard(0, split_factor=2), Shard(0)], hs,
            dp_shard_size=2), L.layer(0).chunk_tp(0).chunk_dp(2))
        for layout, tp in [(L.layer(0).chunk_dp(2), 1), (L.layer(0).chunk_tp(1).chunk_dp(2), 2),
                           (L.layer(0).chunk_tp(0).chunk_dp(4), 2)]:
            got = morph.placements_of("w", (10, 6), layout, tp)
            self.assertEqual(len(got), 3, layout)
            self.assertEqual(morph.layout_from_placements("w", (10, 6), got, hs,
                                                          dp_shard_size=layout.zero_group), layout)
        # The rows DP rank r*S + s holds are torch.chunk's s-th of dim 0 (replicated over r).
        for rows in (1, 5, 7):
            for replicas, s_size in ((2, 2), (3, 2), (2, 3)):
                cfg = morph.ParallelConfig()
                cfg.dp = replicas * s_size
                chunks = torch.arange(rows * 3).reshape(rows, 3).chunk(s_size)
                for d in range(cfg.dp):
                    sh = morph.shard_of("w", [rows, 3], "f32", L.layer(0).chunk_dp(s_size), cfg, d)
                    got = (list(range(sh[0][0] * 3 + sh[2], sh[0][0] * 3 + sh[3]))
                           if sh[3] > sh[2] else [])
                    s = d % s_size
                    want = chunks[s].flatten().tolist() if s < len(chunks) else []
                    self.assertEqual(got, want, (rows, replicas, s_size, d))

    def test_hsdp_refused(self):
        hs = ["dp_replicate", "dp_shard", "tp"]
        for placements, names, size, want in [
                ([Shard(0), Replicate(), Replicate()], hs, 2, "replicates across 'dp_replicate'"),
                ([Replicate(), Shard(0), Replicate()], hs, None, "give dp_shard_size"),
                ([Replicate(), Shard(1), Replicate()], hs, 2, "not dimension 1"),
                ([Replicate(), Shard(0), Shard(0)], hs, 2, "both 'dp_shard' and 'tp'"),
                ([Shard(0), Shard(0), Replicate()], ["dp", "dp_shard", "tp"], 2, "not both")]:
            with self.assertRaises(morph.InvalidArgumentError, msg=want) as cm:
                morph.layout_from_placements("layers.1.w", (4, 6), placements, names,
                                             dp_shard_size=size)
            self.assertIn("tensor 'layers.1.w'", str(cm.exception))
            self.assertIn(want, str(cm.exception))

    def test_placements_round_trip(self):
        L = morph.Layout
        for layout, tp, want in [
                (L.layer(0), 1, [Replicate(), Replicate()]),
                (L.layer(0).chunk_tp(1), 2, [Replicate(), Shard(1)]),
                (L.layer(0).chunk_dp(), 1, [Shard(0), Replicate()]),
                (L.layer(0).chunk_tp(1).chunk_dp(), 2, [Shard(0), Shard(1)]),
                (L.layer(0).chunk_tp(0).chunk_dp(), 2, [_StridedShard(0, split_factor=2),
                                                        Shard(0)])]:
            got = morph.placements_of("w", (10, 6), layout, tp)
            self.assertEqual(got, want, layout)
            self.assertEqual(morph.layout_from_placements("w", (10, 6), got), layout)

    def test_fsdp2_rows_equal_torch_chunk(self):
        """morph's ChunkDP rows (shard_of) are exactly torch.chunk's of dim 0, uneven included."""
        for rows in (1, 5, 7, 10):
            for dp in (1, 2, 3, 4):
                chunks = torch.arange(rows * 3).reshape(rows, 3).chunk(dp)
                for d in range(dp):
                    want = chunks[d].flatten().tolist() if d < len(chunks) else []
                    self.assertEqual(_held(rows, dp, d), want, (rows, dp, d))

    def test_torch_chunk_of_1d_equals_zero_ranges(self):
        for n in (0, 1, 5, 37, 64):
            for dp in (1, 2, 3, 4, 7):
                chunks = torch.arange(n).chunk(dp) if n else ()
                for d in range(dp):
                    b, e = morph.zero_range(n, dp, d)
                    got = list(range(b, e))
                    want = chunks[d].tolist() if d < len(chunks) else []
                    self.assertEqual(got, want, (n, dp, d))

    def test_refused_with_tensor_and_placement(self):
        cases = [
            ((4, 6), [Shard(1), Replicate()], "Shard(1) on mesh dimension 'dp'"),
            ((4, 6), [Partial(), Replicate()], "Partial()"),
            ((4, 6), [_StridedShard(0, split_factor=2), Replicate()], "_StridedShard"),
            ((4, 6), [Shard(0), Shard(0)], "both 'dp' and 'tp'"),
            ((4, 6), [Replicate(), Shard(2)], "dimension 2 of a 2-D tensor"),
            ((4, 6), [Shard(1)], "placements for mesh dimensions"),
            ((8,), [Shard(0), Shard(0)], "both 'dp' and 'tp'"),
            ((4, 6), [Shard(0)], "'pp'"),
        ]
        for shape, placements, want in cases:
            names = ["pp"] if want == "'pp'" else ["dp", "tp"]
            with self.assertRaises(morph.InvalidArgumentError, msg=want) as cm:
                morph.layout_from_placements("layers.0.w", shape, placements, names)
            self.assertIn("tensor 'layers.0.w'", str(cm.exception))
            self.assertIn(want, str(cm.exception))

    def test_dtypes(self):
        self.assertEqual(morph.morph_dtype(torch.bfloat16), "bf16")
        self.assertEqual(morph.torch_dtype("bf16"), torch.bfloat16)
        with self.assertRaises(morph.InvalidArgumentError) as cm:
            morph.morph_dtype(torch.complex64, "z")
        self.assertIn("tensor 'z': dtype torch.complex64", str(cm.exception))


class MeshCacheTest(unittest.TestCase):
    """DTensor caches sharding decisions by DeviceMesh equality: a generation's mesh equal to an
    earlier one's, where this process held another rank, got the earlier mesh object (its
    coordinates) back, and FSDP2's shards and DCP's offsets were another rank's (found by
    standard_test: ranks 2 and 3 of dp2 tp2 read their embedding rows at offset 0). forget_meshes,
    called at every generation's groups, empties those caches."""

    def _local_mesh_coordinate(self, rank):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        try:
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
            x = DTensor.from_local(torch.zeros(3, 2), mesh, [Shard(0)], run_check=False,
                                   shape=torch.Size([5, 2]), stride=(2, 1))
            return torch.empty_like(x).device_mesh.get_coordinate()
        finally:
            dist.destroy_process_group()

    def test_an_equal_mesh_of_a_later_generation_has_its_own_coordinates(self):
        from morph import distributed
        self.assertEqual(tuple(self._local_mesh_coordinate(0)), (0,))
        distributed.forget_meshes()
        self.assertEqual(tuple(self._local_mesh_coordinate(1)), (1,))
        distributed.forget_meshes()


class RuntimeTest(unittest.TestCase):
    """One worker hosting its own coordinator (no launcher variables)."""

    def test_job(self):
        for k in list(os.environ):
            if k.startswith(("MORPH_", "OMPI_", "SLURM_")):
                del os.environ[k]
        w0 = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7
        refused = {}

        def attempt(key, fn):
            try:
                fn()
            except morph.MorphError as e:
                refused[key] = e

        def declare(s):
            s.add_tensor("w", w0, morph.Layout.layer(0).split_tp(1))
            attempt("twice", lambda: s.add_tensor("w", shape=(4, 6)))
            attempt("dtype", lambda: s.add_tensor("c", torch.zeros(3, dtype=torch.complex64)))
            attempt("disagree", lambda: s.add_tensor("d", torch.zeros(3), dtype=torch.float16))
            attempt("placement", lambda: s.add_tensor("p", shape=(4, 6),
                                                      placements=[Shard(1), Replicate()]))
            attempt("layout", lambda: s.add_tensor("q", shape=(4, 6),
                                                   layout=morph.Layout.layer(0).split_tp(7)))
            s.add_tensor("m", shape=(37,), dtype=torch.float64,
                         placements=[Shard(0), Replicate()])
            s.add_tensor("bf", torch.ones(5, dtype=torch.bfloat16))
            s.add_scalar("count", 8)

        rt = morph.start(declare, global_batch=2, dataset_samples=100)
        self.assertTrue(rt.fresh_start)
        self.assertIsInstance(refused["twice"], morph.InvalidArgumentError)
        self.assertIn("tensor 'w' is registered twice", str(refused["twice"]))
        self.assertIn("tensor 'c': dtype torch.complex64", str(refused["dtype"]))
        self.assertIn("tensor 'd': dtype torch.float16 given, the tensor's is torch.float32",
                      str(refused["disagree"]))
        self.assertIn("tensor 'p': placement Shard(1) on mesh dimension 'dp'",
                      str(refused["placement"]))
        self.assertIn("'q'", str(refused["layout"]))  # split_tp(7) of a 2-D tensor
        self.assertEqual(rt.state.names(), ["w", "m", "bf"])  # the job is unharmed

        w = rt.state["w"]
        self.assertTrue(torch.equal(w, w0))  # a given tensor initializes a fresh start
        self.assertEqual(rt.state["m"].dtype, torch.float64)
        self.assertEqual(rt.state["m"].shape, (37,))
        self.assertTrue(torch.equal(rt.state["bf"], torch.ones(5, dtype=torch.bfloat16)))
        # Shared, not copied: a write through one view is seen through another.
        self.assertEqual(w.data_ptr(), rt.state["w"].data_ptr())
        w.add_(1)
        self.assertTrue(torch.equal(rt.state["w"], w0 + 1))
        with self.assertRaises(morph.FailedPreconditionError):
            rt.state.add_tensor("late", shape=(2,))
        with self.assertRaises(morph.NotFoundError):
            rt.state.tensor("nope")

        seen = []
        for _ in range(10):
            with rt.step() as step:
                if step.done or step.index >= 3:
                    break
                self.assertEqual(dist.get_world_size(), 1)
                x = torch.ones(3)
                dist.all_reduce(x, group=step.groups.dp)
                self.assertEqual(step.mesh.mesh_dim_names, ("pp", "dp", "tp"))
                dt = rt.dtensor("w")
                self.assertEqual(tuple(dt.shape), (4, 6))
                self.assertEqual(dt.to_local().data_ptr(), rt.state["w"].data_ptr())
                rt.commit_update()
                rt.state["w"].mul_(2)
                count = int.from_bytes(rt.state.scalar("count"), "little") + 1
                rt.state.set_scalar("count", count.to_bytes(8, "little"))
                seen.append(step.index)
        self.assertEqual(seen, [0, 1, 2])
        self.assertTrue(torch.equal(rt.state["w"], (w0 + 1) * 8))
        self.assertEqual(int.from_bytes(rt.state.scalar("count"), "little"), 3)
        with self.assertRaises(morph.InvalidArgumentError):
            rt.state.set_scalar("count", b"123")
        rt.finish()
        rt.close()


class DeclareErrorTest(unittest.TestCase):
    """What declare raises comes out of start unchanged (run in its own process: ctest
    torch_api_declare_error_test)."""

    def test_declare_error_propagates(self):
        for k in list(os.environ):
            if k.startswith(("MORPH_", "OMPI_", "SLURM_")):
                del os.environ[k]

        class Boom(Exception):
            pass

        def declare(s):
            s.add_tensor("w", shape=(2, 2))
            raise Boom("declare failed on purpose")

        with self.assertRaises(Boom) as cm:
            morph.start(declare)
        self.assertIn("on purpose", str(cm.exception))

    def test_unknown_torch_backend_refused_before_joining(self):
        def declare(s):
            raise AssertionError("declare ran: the job was joined")

        with self.assertRaises(morph.InvalidArgumentError) as cm:
            morph.start(declare, torch_backend="mpi")
        self.assertIn("torch backend 'mpi'", str(cm.exception))


class StubTest(unittest.TestCase):
    """morph/_morph.pyi is generated from the built extension (python/CMakeLists.txt): it names
    every public function and class of morph._morph and every public member of each class."""

    def test_stub_covers_the_extension(self):
        import ast

        from morph import _morph

        path = os.path.join(os.path.dirname(_morph.__file__), "_morph.pyi")
        tree = ast.parse(open(path).read(), path)
        top = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        public = [n for n in dir(_morph) if not n.startswith("_")]
        self.assertGreater(len(public), 10)
        for name in public:
            self.assertIn(name, top, f"_morph.pyi lacks {name}")
            obj = getattr(_morph, name)
            if not isinstance(obj, type):
                continue
            members = {m.name for m in top[name].body
                       if isinstance(m, (ast.FunctionDef, ast.ClassDef))}
            for m in vars(obj):
                if not m.startswith("_"):
                    self.assertIn(m, members, f"_morph.pyi lacks {name}.{m}")


if __name__ == "__main__":
    unittest.main(verbosity=2)
