"""torchtitan's Llama 3 debug model and its own parallelize function, as a morph.elastic build.

torchtitan's Trainer cannot run on CPU (README.md "Why not the Trainer"), so this is its model
code alone: `torchtitan.models.llama3.model_registry("debugmodel")`'s config (made smaller through
that config for CPU: fewer layers, a shorter RoPE table), built on `meta`, parallelized by
`parallelize_llama` (torchtitan's TP through `Module.parallelize` and its FSDP2 wrapping,
`apply_fsdp_to_decoder`) on the generation's mesh, `to_empty`, `init_states`, AdamW and
torchtitan's LR scheduler builder (a torch LambdaLR). Attention is torchtitan's ScaledDotProductAttention module
(its FlexAttention has no backward on CPU); the data are random tokens, a function of
the sample index only.
"""
import dataclasses
import functools

import torch
import torch.nn as nn

from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry, parallelize_llama
from torchtitan.models.llama3.sharding import set_llama3_sharding_config

LAYERS, SEQ, BATCH = 2, 32, 12  # 12 samples a step: dp 1, 2, 3 and 4 divide it


def model_config():
    """The debug model's config (dim 256, 16 heads, vocab 2048) with LAYERS of its 6 layers and
    RoPE tables of SEQ positions (the Trainer sets max_seq_len to training.seq_len the same way);
    sharding declared as the Trainer declares it (update_from_config: no sequence parallelism)."""
    cfg = model_registry("debugmodel", attn_backend="flex").model
    cfg.layers = cfg.layers[:LAYERS]
    for layer in cfg.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=SEQ)
        # FlexAttention has no backward on CPU (README.md); torchtitan's SDPA module, causal,
        # is the same attention for samples that are one document each
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(cfg, enable_sp=False)
    return cfg


CONFIG = model_config()
VOCAB = CONFIG.vocab_size


@dataclasses.dataclass
class MeshParallelDims(ParallelDims):
    """torchtitan's ParallelDims over a mesh it is given (morph's generation mesh, dims pp, dp,
    tp) instead of one it builds with init_device_mesh: FSDP on "dp", TP on "tp", no
    replicate/cp/ep axes (their size-1 meshes are the mesh's "pp", also of size 1)."""
    mesh: object = None

    def build_mesh(self):
        m = self.mesh
        one = m["pp"]
        assert one.size() == 1, "pipeline stages are not wired into this example"
        self._world_mesh = m
        self._global_meshes = {"dense": m}
        self._single_axis_meshes = {"pp": one, "batch": m["dp"], "loss": m["dp"],
                                    "dp_replicate": one, "fsdp": m["dp"], "cp": one,
                                    "tp": m["tp"], "ep": one, "efsdp": m["dp"]}
        return m


def parallel_dims_of(mesh):
    dp, tp = mesh["dp"].size(), mesh["tp"].size()
    return MeshParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1,
                            world_size=dp * tp, spmd_backend="partial_dtensor", mesh=mesh)


def build(ctx):
    """One generation's objects: torchtitan's model parallelized by torchtitan on ctx.mesh."""
    dist_utils.set_spmd_backend("partial_dtensor")
    with torch.device("meta"):
        model = CONFIG.build()
    pd = parallel_dims_of(ctx.mesh)
    parallelize_llama(
        model, parallel_dims=pd,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor",
                                      data_parallel_shard_degree=pd.dp_shard,
                                      tensor_parallel_degree=pd.tp),
        compile_config=CompileConfig(enable=False), ac_config=None, dump_folder="")
    model.to_empty(device=ctx.device)
    if ctx.device.type != "meta":  # every generation: the RoPE cache, a buffer morph does not keep
        with torch.no_grad():
            model.init_states(buffer_device=ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            eps=1e-8)
    # torchtitan's scheduler builder: linear warmup, linear decay; one torch LambdaLR per optimizer
    sched = LRSchedulersContainer.Config(warmup_steps=4, total_steps=40).build(
        optimizers=[opt], training_steps=40).schedulers[0]
    return model, opt, sched


@functools.lru_cache(maxsize=1)
def whole_weights():
    """torchtitan's initialization (init_states) of the whole model on CPU, seeded: DTensor's
    random ops draw differently for each layout, so a job's first values come from here."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        with torch.device("cpu"):
            model = CONFIG.build()
        model.init_states(buffer_device=torch.device("cpu"))
    return {n: p.detach() for n, p in model.named_parameters()}


def init(fqn):
    """morph.elastic's `init`: parameter `fqn`'s whole tensor, the same in every layout."""
    return whole_weights()[fqn]


def sample(i):
    """Sample i: SEQ + 1 tokens, a function of i only."""
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, VOCAB, (SEQ + 1,), generator=g)


def batch_of(ids):
    ids = [int(i) for i in ids]
    return torch.stack([sample(i) for i in ids]) if ids else \
        torch.zeros((0, SEQ + 1), dtype=torch.int64)


def loss_of(model, batch):
    """The summed token loss of `batch` over the global batch's tokens (as torchtitan's Trainer
    scales by the global token count): summed over DP ranks it is the global batch's mean."""
    inputs = batch[:, :-1]
    logits = model(inputs)
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(),
                                       batch[:, 1:].reshape(-1),
                                       reduction="sum") / (BATCH * SEQ)
