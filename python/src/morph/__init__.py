"""morph: elastic training for PyTorch programs (docs/torch.md).

    import morph, torch

    def declare(state):
        state.add_tensor("w", torch.randn(1024, 1024), morph.Layout.layer(0).split_tp(1))
        state.add_tensor("w.exp_avg", shape=(1024 * 1024,), layout=morph.Layout.layer(0).zero_shard())

    rt = morph.start(declare, global_batch=64)
    rt.on_reconfigure(lambda r: rebuild(rt.state.tensors()))   # new local tensors after a change
    while True:
        with rt.step() as step:                    # a committed change applies here
            if step.done or step.index >= steps:
                break
            loss = train(step, rt.state, step.groups)   # torch process groups: world/dp/tp/pp
            rt.commit_update()                     # the step's commit vote
            optimizer.step()                       # local writes only
    rt.finish()

Status codes are exception classes (morph.AbortedError, morph.UnavailableError, ...,
all morph.MorphError) carrying the failed peers.
"""
# Before anything loads morph._torch_backend: under another torch major.minor than the one it
# was built for, an ImportError naming both (docs/torch.md "Building").
from ._torch_abi import check_imported_torch as _check_imported_torch

_check_imported_torch()
from . import _morph  # noqa: E402
from ._errors import *  # noqa: F401,F403
from ._errors import MorphError, __all__ as _error_names
from ._placements import (layout_from_placements, morph_dtype, placements_of,  # noqa: F401
                          torch_dtype)
from ._runtime import (Layout, Options, ParallelConfig, Reconfiguration, Runtime, Shard,  # noqa
                       State, Step, start)
from . import distributed  # noqa: F401
from . import data  # noqa: F401
from .data import DatasetCursor, ElasticDataLoader  # noqa: F401
from ._elastic import BuildContext, Built, ElasticJob, elastic  # noqa: F401
from .distributed import ProcessGroups  # noqa: F401

ModelShape = _morph.ModelShape
zero_range = _morph.zero_range
shard_of = _morph.shard_of

__version__ = "0.1.0"
__all__ = ["start", "Runtime", "State", "Step", "Shard", "Layout", "Options", "ModelShape",
           "ParallelConfig", "Reconfiguration", "ProcessGroups", "layout_from_placements",
           "placements_of", "morph_dtype", "torch_dtype", "zero_range", "shard_of",
           "distributed", "data", "DatasetCursor", "ElasticDataLoader", "elastic", "ElasticJob",
           "BuildContext", "Built"] + list(_error_names)
