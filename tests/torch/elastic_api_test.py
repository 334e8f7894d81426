"""morph.elastic's refusals (ctest torch_elastic_api_test): what morph cannot map is an
InvalidArgumentError naming it, raised by the discovery build before the process joins any job;
torch.distributed is left uninitialized and the process can start a right job afterwards (a
one-worker job here, hosting its own coordinator)."""
import os
import sys
import unittest

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from standard_model import BATCH, batch_of, build, init, loss_of  # noqa: E402

import morph  # noqa: E402


def with_optimizer(make):
    def b(ctx):
        model, _, _ = build(ctx)
        return model, make(model.parameters())
    return b


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.out = nn.Linear(4, 5, bias=False)
        self.out.weight = self.emb.weight


class ElasticRefusalTest(unittest.TestCase):
    def refused(self, build_fn, *words):
        with self.assertRaises(morph.InvalidArgumentError) as cm:
            morph.elastic(build_fn, global_batch=4, dataset_samples=100, tp_candidates=[1, 2])
        for w in words:
            self.assertIn(w, str(cm.exception))
        self.assertFalse(dist.is_initialized(), "the discovery's fake world was left behind")
        return str(cm.exception)

    def test_an_optimizer_morph_cannot_map(self):
        self.refused(with_optimizer(lambda ps: torch.optim.Adadelta(ps)), "optimizer Adadelta",
                     "Adam, AdamW, SGD")

    def test_sgd_with_dampening(self):
        self.refused(with_optimizer(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9,
                                                               dampening=0.1)),
                     "SGD", "dampening=0.1")

    def test_a_placement_morph_cannot_map(self):
        def b(ctx):
            with torch.device("meta"):
                model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
            fully_shard(model, mesh=ctx.mesh["dp"], shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else Shard(0))
            model.to_empty(device=ctx.device)
            return model, torch.optim.AdamW(model.parameters())
        self.refused(b, "tensor '0.weight'", "Shard(1)", "'dp'")

    def test_tied_weights(self):
        def b(ctx):
            with torch.device("meta"):
                model = Tied()
            return model, torch.optim.AdamW(model.parameters())
        self.refused(b, "'out.weight'", "'emb.weight'", "tied")

    def test_what_build_returns(self):
        self.refused(lambda ctx: 42, "build returned int")
        self.refused(lambda ctx: (nn.Linear(2, 2), "adam"), "optimizer of type str")

    def test_a_wrong_pipeline(self):
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        def with_stage(index, num_stages, part=True):
            def b(ctx):
                model, opt, sched = build(ctx)
                mod = model if part else nn.Linear(2, 2)
                st = PipelineStage(mod, index(ctx), num_stages(ctx), ctx.device,
                                   group=ctx.pp_group)
                return model, opt, sched, ScheduleGPipe(st, n_microbatches=2)
            return b
        # a stage of another pipeline position or length than ctx.stage of ctx.num_stages
        self.refused(with_stage(lambda c: 0, lambda c: 2), "pipeline stage 0 of 2",
                     "ctx.stage")
        # a stage whose module the build does not return as a model part
        self.refused(with_stage(lambda c: c.stage, lambda c: c.num_stages, part=False),
                     "not one of the build's model parts")
        # pipeline candidates without the model's layer count
        with self.assertRaises(morph.InvalidArgumentError) as cm:
            morph.elastic(build, global_batch=4, dataset_samples=100, pp_candidates=[1, 2])
        self.assertIn("num_layers", str(cm.exception))

    def test_a_right_job_after_the_refusals(self):
        job = morph.elastic(build, init=init, global_batch=BATCH, dataset_samples=100)
        with job.step() as step:
            loss = loss_of(job.model, batch_of(step.samples))
            loss.backward()
            job.optimizer.step()
            self.assertTrue(torch.isfinite(loss))
            for name in ("emb.weight", "state.emb.weight.exp_avg", "state.emb.weight.step"):
                self.assertIn(name, job.state.names())
            self.assertEqual(job.state["state.emb.weight.step"].item(), 1.0)
        job.finish()
        job.close()


if __name__ == "__main__":
    unittest.main()
