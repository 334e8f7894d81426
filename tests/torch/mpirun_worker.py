"""A PyTorch program launched by mpirun (tests/torch/mpirun_test.sh): rank 0 hosts the
coordinator (its address and a fresh token travel by MPI, as for a C++ program), every rank
trains 6 steps on the generation's torch process groups and a replicated tensor, and reports one
JSON line with what it saw: to <dir>/rank-<rank>.json with `--out dir`, else to stdout in one
write (mpirun merges the ranks' output; print's text and newline are two writes when stdout is
unbuffered, PYTHONUNBUFFERED, so two ranks' lines could interleave)."""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

import morph

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="")
a = ap.parse_args()
rt = morph.start(lambda s: s.add_tensor("w", torch.arange(12.0).reshape(3, 4)), global_batch=4)
steps = 0
while True:
    with rt.step() as step:
        if step.done or step.index >= 6:
            break
        x = torch.ones(1)
        dist.all_reduce(x, group=step.groups.world)
        assert x.item() == step.world_size, (x.item(), step.world_size)
        rt.commit_update()
        rt.state["w"].add_(1)
        steps += 1
w = rt.state["w"]
line = json.dumps({"rank": rt.rank, "world": rt.config.world, "steps": steps,
                   "w_equal": bool(torch.equal(w, torch.arange(12.0).reshape(3, 4) + 6)),
                   "torch_rank": os.environ.get("RANK"),
                   "torch_world": os.environ.get("WORLD_SIZE")}) + "\n"
if a.out:
    with open(os.path.join(a.out, f"rank-{rt.rank}.json"), "w") as f:
        f.write(line)
else:
    sys.stdout.flush()
    os.write(1, line.encode())
rt.finish()
rt.close()
