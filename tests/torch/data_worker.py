"""A worker of torch_data_elastic_test (data_elastic_test.sh): trains a small linear model on a
dataset whose items are their own ids through morph.data.ElasticDataLoader (2 worker processes,
prefetch), and after every step that ended appends what it trained to <out>/trained.jsonl: the
step, generation, DP coordinate and the ids the loader served (and the step's own samples).

The test drives it with files in <out>: "kill-now" makes the last rank SIGKILL itself inside a
step halfway between two buddy snapshots (its loader has prefetched by then, its peers wait in
the step's all_reduce); "release"
ends the run at the next epoch boundary (the step to stop at is a registered scalar, so joiners
and a recovery agree on it).

  data_worker.py --out DIR [--step-sleep S]
"""
import argparse
import json
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.utils.data as tud

import morph

N, B, MB, SEED = 120, 10, 2, 7  # 12 steps per epoch; dp 4 and 3 cut uneven slices
EPOCH = N // B
LR = 0.05
# The kill falls between two buddy snapshots of its generation (a snapshot of an earlier layout
# is no use), so that the recovery rolls back EVERY // 2 steps.
EVERY = max(int(os.environ.get("MORPH_SNAPSHOT_EVERY", "1")), 1)

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--step-sleep", type=float, default=0.1)
a = p.parse_args()
pid = os.getpid()


def note_pid(path_pid):
    open(os.path.join(a.out, "pids", str(path_pid)), "w").close()


note_pid(pid)


def log(name, **kv):
    kv.update(pid=pid, t=time.time())
    with open(os.path.join(a.out, name), "a") as f:
        f.write(json.dumps(kv) + "\n")


class Ids(tud.Dataset):
    def __getitem__(self, i):
        return torch.tensor(i)

    def __len__(self):
        return N


def features(ids):
    x = ids.to(torch.float64) / N
    return torch.stack([torch.ones_like(x), x, torch.sin(7 * x), x * x], 1), 3 * x - 1


def declare(s):
    s.add_tensor("w", torch.zeros(4, dtype=torch.float64))
    # ZeRO-1: each DP rank holds its range once, so a dead rank's range survives only in the
    # buddy snapshots (MORPH_SNAPSHOT_EVERY): the recovery rolls back and replays steps.
    s.add_tensor("m", torch.zeros(12, dtype=torch.float64),
                 layout=morph.Layout.layer(0).zero_shard())
    s.add_scalar("stop", 8)  # the step the run ends at (0: not decided yet)


rt = morph.start(declare, global_batch=B, dataset_samples=N, micro_batch=MB, dataset_seed=SEED,
                 zero_stage=1)
loader = morph.ElasticDataLoader(rt, Ids(), num_workers=2, prefetch_factor=2,
                                 worker_init_fn=lambda w: note_pid(os.getpid()))

while True:
    record = None
    with rt.step() as step:
        stop = int.from_bytes(rt.state.scalar("stop"), "little")
        if step.done or (stop and step.index >= stop):
            break
        if step.reconfigured:
            rc = rt.last_reconfiguration
            log("events.jsonl", event="reconfigured", step=step.index, gen=step.generation,
                world=step.world_size, dp=step.config.dp, recovery=rc.recovery,
                lost_steps=rc.lost_steps)
        w = rt.state["w"]
        grad = torch.zeros(4, dtype=torch.float64)
        ids = []
        for batch in loader.micro_batches(step):  # gradient accumulation over micro-batches
            ids += batch.tolist()
            x, y = features(batch)
            grad += 2 * ((x @ w - y)[:, None] * x).sum(0)
        if os.path.exists(os.path.join(a.out, "kill-now")) and \
                step.rank == step.world_size - 1 and step.index % EVERY == EVERY // 2 and \
                step.index >= rt.last_reconfiguration.step + EVERY and \
                not os.path.exists(os.path.join(a.out, "kill.json")):
            time.sleep(0.3)  # the peers are in the all_reduce below by now
            children = []
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    children += [int(c) for c in f.read().split()]
            with open(os.path.join(a.out, "kill.json"), "w") as f:
                json.dump({"t": time.time(), "pid": pid, "step": step.index,
                           "gen": step.generation, "loader_workers": children}, f)
            os.kill(pid, signal.SIGKILL)
        release = torch.tensor([float(os.path.exists(os.path.join(a.out, "release")))])
        dist.all_reduce(grad, group=step.groups.dp)  # sum: the global batch's gradient
        dist.all_reduce(release, op=dist.ReduceOp.MAX)
        if a.step_sleep:
            time.sleep(a.step_sleep)
        rt.commit_update()
        w.sub_(LR * grad / step.global_batch)  # scaled by B whatever dp is
        sh = rt.state.shard("m")
        rt.state["m"].mul_(0.9).add_(grad.repeat(3)[sh.flat_begin:sh.flat_end])
        if release.item() and not stop:
            stop = (step.index // EPOCH + 1) * EPOCH
            rt.state.set_scalar("stop", stop.to_bytes(8, "little"))
        record = dict(step=step.index, gen=step.generation, rank=step.rank, dp=step.config.dp,
                      d=step.coords[1], ids=ids, want=step.samples, restarts=loader.restarts,
                      dropped=loader.dropped)
    if record is not None:  # the step ended (a failed one was aborted: nothing recorded)
        log("trained.jsonl", **record)

if not rt.finished and rt.rank >= 0:
    sh = rt.state.shard("m")
    log("events.jsonl", event="final", rank=rt.rank, w=rt.state["w"].tolist(),
        m=[sh.flat_begin, sh.flat_end, rt.state["m"].tolist()],
        stop=int.from_bytes(rt.state.scalar("stop"), "little"))
loader.close()
rt.finish()
rt.close()
