"""torch collectives on the generation's process groups: the "morph" backend (torch groups over
morph's communicators) next to torch's own Gloo, same job shape (`make bench-torch`).

Run under `morphrun -n 2` once per backend (MORPH_TORCH_BACKEND=morph, =gloo); rank 0 prints one
JSON line: the backend and, per size, the median over 5 blocks of the per-call time of a blocking
`dist.all_reduce` (sum, float32) on the world group. run_torch_bench.sh puts the two side by
side (gloo / morph: how many times faster the morph backend is).
"""
import json
import statistics
import time

import torch
import torch.distributed as dist

import morph

SIZES = (("8B", 2, 2000), ("64KiB", 16384, 500), ("1MiB", 1 << 18, 100), ("16MiB", 4 << 20, 20))


def main() -> None:
    rt = morph.start(lambda s: s.add_tensor("w", torch.zeros(4)), global_batch=2,
                     dataset_samples=100)
    out = {}
    with rt.step() as step:
        g = step.groups.world
        for name, n, iters in SIZES:
            x = torch.ones(n)
            for _ in range(10):
                dist.all_reduce(x, group=g)
            blocks = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(x, group=g)
                blocks.append((time.perf_counter() - t0) / iters)
            out[name] = round(statistics.median(blocks) * 1e6, 1)
        rt.commit_update()
        rank, backend = step.rank, dist.get_backend(g)
    if rank == 0:
        print(json.dumps({"name": "torch_collectives", "backend": backend, "world": 2,
                          "allreduce_us": out}), flush=True)
    rt.finish()
    rt.close()


if __name__ == "__main__":
    main()
