"""A worker of torch_backend_test (backend_test.sh, 3 workers under morphrun): every torch
collective the "morph" backend implements, on the generation's groups, against values computed
here without it; the errors it gives for bad input (a wrongly sized output, a non-contiguous tensor,
a dtype morph does not reduce (int16), a reduce op it has not) while the group stays usable; and, after a
change (rank 2 leaves), a group of the earlier generation refused by name; and FSDP2 over the
DP group against a replay on whole tensors, and DDP (its reductions through get_future()). Writes
<out>/rank-<worker id>.json.

  backend_worker.py --out DIR
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import morph

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
a = p.parse_args()


def declare(s):
    s.add_tensor("w", torch.zeros(6))


rt = morph.start(declare, global_batch=6, dataset_samples=100)
report = {"worker": rt.worker_id, "checks": [], "errors": {}}


def check(name, ok):
    report["checks"].append([name, bool(ok)])


def refused(name, fn):
    """fn must raise; the message is recorded, and the group must still work afterwards."""
    try:
        fn()
        report["errors"][name] = None
    except Exception as e:  # noqa: BLE001
        report["errors"][name] = f"{type(e).__name__}: {e}"[:300]


def collectives(step):
    r, n = step.rank, step.world_size
    g = step.groups.world
    # all_reduce: sum, avg, max, min; f32, f64, bf16, i64, u8
    for dt in (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8):
        x = torch.full((5,), r + 1, dtype=dt)
        dist.all_reduce(x, group=g)
        check(f"all_reduce sum {dt}", torch.equal(x, torch.full((5,), n * (n + 1) // 2, dtype=dt)))
    for op, want in ((dist.ReduceOp.MAX, n), (dist.ReduceOp.MIN, 1)):
        x = torch.tensor([float(r + 1)])
        dist.all_reduce(x, op=op, group=g)
        check(f"all_reduce {op}", x.item() == want)
    x = torch.tensor([float(r + 1)])
    dist.all_reduce(x, op=dist.ReduceOp.AVG, group=g)
    check("all_reduce avg", abs(x.item() - (n + 1) / 2) < 1e-6)
    # async, waited later
    xs = [torch.full((3,), float(r * 10 + i)) for i in range(3)]
    works = [dist.all_reduce(t, group=g, async_op=True) for t in xs]
    for w in works:
        w.wait()
    check("all_reduce async x3", all(torch.equal(t, torch.full((3,), float(sum(q * 10 + i for q in range(n)))))
                                   for i, t in enumerate(xs)))
    # broadcast
    b = torch.arange(4, dtype=torch.float32) * (r + 1)
    dist.broadcast(b, src=1, group=g)
    check("broadcast", torch.equal(b, torch.arange(4, dtype=torch.float32) * 2))
    # all_gather (list and into tensor), reduce_scatter (list and tensor)
    outs = [torch.empty(2) for _ in range(n)]
    dist.all_gather(outs, torch.tensor([r, -r], dtype=torch.float32), group=g)
    check("all_gather", all(torch.equal(o, torch.tensor([q, -q], dtype=torch.float32))
                            for q, o in enumerate(outs)))
    big = torch.empty(2 * n, dtype=torch.int32)
    dist.all_gather_into_tensor(big, torch.tensor([r, r * r], dtype=torch.int32), group=g)
    check("all_gather_into_tensor", big.tolist() == [v for q in range(n) for v in (q, q * q)])
    ins = [torch.full((2,), float(q + r)) for q in range(n)]
    out = torch.empty(2)
    dist.reduce_scatter(out, ins, group=g)
    check("reduce_scatter", torch.equal(out, torch.full((2,), float(sum(r + q for q in range(n))))))
    inp = torch.arange(3 * n, dtype=torch.float64) + r
    out = torch.empty(3, dtype=torch.float64)
    dist.reduce_scatter_tensor(out, inp, group=g)
    want = sum(torch.arange(3 * n, dtype=torch.float64) + q for q in range(n))[3 * r: 3 * r + 3]
    check("reduce_scatter_tensor", torch.equal(out, want))
    # PREMUL_SUM (FSDP2 with a gradient divide factor): the inputs scaled, then summed; the
    # caller's reduce_scatter input untouched. A factor of 1 is bitwise SUM.
    for f in (0.25, 1.0, torch.tensor([0.5], dtype=torch.float64)):
        premul = dist._make_nccl_premul_sum(f)
        fv = float(f) if not isinstance(f, torch.Tensor) else f.item()
        inp = torch.arange(3 * n, dtype=torch.float64) + r
        keep = inp.clone()
        dist.reduce_scatter_tensor(out, inp, op=premul, group=g)
        want = sum((torch.arange(3 * n, dtype=torch.float64) + q) * fv for q in range(n))
        check(f"reduce_scatter_tensor premul {fv}",
              torch.equal(out, want[3 * r: 3 * r + 3]) and torch.equal(inp, keep))
        x = torch.full((4,), float(r + 1), dtype=torch.float64)
        dist.all_reduce(x, op=premul, group=g)
        check(f"all_reduce premul {fv}",
              torch.equal(x, torch.full((4,), sum((q + 1) * fv for q in range(n)),
                                        dtype=torch.float64)))
    # reduce, gather, scatter (root 2), all_to_all (uneven splits), barrier
    x = torch.tensor([float(r + 1)])
    dist.reduce(x, dst=2, group=g)
    check("reduce", x.item() == (n * (n + 1) / 2 if r == 2 else r + 1))
    gl = [torch.empty(2, dtype=torch.int64) for _ in range(n)] if r == 2 else None
    dist.gather(torch.tensor([r, 7]), gl, dst=2, group=g)
    check("gather", r != 2 or all(t.tolist() == [q, 7] for q, t in enumerate(gl)))
    sc = torch.empty(3)
    dist.scatter(sc, [torch.full((3,), float(q)) for q in range(n)] if r == 2 else None, src=2,
                 group=g)
    check("scatter", torch.equal(sc, torch.full((3,), float(r))))
    in_splits = [q + 1 for q in range(n)]           # to rank q: q+1 rows
    out_splits = [r + 1] * n                          # from each: r+1 rows
    src = torch.cat([torch.full((q + 1, 2), float(100 * r + q)) for q in range(n)])
    dst = torch.empty(sum(out_splits), 2)
    dist.all_to_all_single(dst, src, out_splits, in_splits, group=g)
    want = torch.cat([torch.full((r + 1, 2), float(100 * q + r)) for q in range(n)])
    check("all_to_all_single", torch.equal(dst, want))
    dist.barrier(group=g)
    # batch_isend_irecv around a ring: each rank sends to r+1 and receives from r-1
    send = torch.full((4,), float(r))
    recv = torch.empty(4)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, (r + 1) % n, g),
                                   dist.P2POp(dist.irecv, recv, (r - 1) % n, g)])
    for q in reqs:
        q.wait()
    check("batch_isend_irecv ring", torch.equal(recv, torch.full((4,), float((r - 1) % n))))
    # send/recv pairs 0 -> 1
    if r == 0:
        dist.send(torch.tensor([42.0]), dst=1, group=g)
    elif r == 1:
        t = torch.empty(1)
        dist.recv(t, src=0, group=g)
        check("send/recv", t.item() == 42.0)
    # objects (what DCP uses): all_gather_object, broadcast_object_list
    objs = [None] * n
    dist.all_gather_object(objs, {"r": r}, group=g)
    check("all_gather_object", objs == [{"r": q} for q in range(n)])
    # the DP group is morph's too: a sum over it
    d = torch.ones(1)
    dist.all_reduce(d, group=step.groups.dp)
    check("dp all_reduce", d.item() == step.config.dp)
    # FSDP2 over the DP group (its all-gathers and reduce-scatters on the backend) against a
    # replay of data-parallel AdamW on whole tensors, here
    fsdp2(step)
    ddp(step)
    # bad input: a clear error, and the group still works
    refused("non_contiguous", lambda: dist.all_reduce(torch.ones(4, 4).t(), group=g))
    refused("int16", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int16), group=g))
    refused("product", lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.PRODUCT, group=g))
    refused("output_size", lambda: dist.all_gather_into_tensor(torch.empty(5), torch.ones(2), group=g))
    x = torch.ones(1)
    dist.all_reduce(x, group=g)
    check("usable after refusals", x.item() == n)


def fsdp2(step):
    from torch.distributed.fsdp import fully_shard

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                   torch.nn.Linear(32, 8))

    def batch(rank, i):
        return torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * i + rank))

    m = model()
    fully_shard(m, mesh=step.groups.mesh["dp"])
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ref = model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    n = step.config.dp
    for i in range(3):
        m(batch(step.rank, i)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        for q in range(n):  # the mean of every rank's gradient
            (ref(batch(q, i)).square().mean() / n).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got = [p.full_tensor() for p in m.parameters()]
    check("fsdp2 vs replay", all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                                 for a, b in zip(got, ref.parameters())))


def ddp(step):
    """DDP over the DP group with tiny buckets (many reductions, each through get_future(),
    completed by the backend's thread while the backward pass goes on): every rank's gradients
    equal the mean of the ranks' own, as a replay computes them."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

    def batch(rank):
        return torch.randn(8, 16, generator=torch.Generator().manual_seed(7 + rank))

    m = model()
    wrapped = DDP(m, process_group=step.groups.dp, bucket_cap_mb=0.001)  # kept: its hooks reduce
    wrapped(batch(step.rank)).square().mean().backward()
    n = step.config.dp
    ref = model()
    for q in range(n):
        (ref(batch(q)).square().mean() / n).backward()
    check("ddp vs replay", all(torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)
                               for a, b in zip(m.parameters(), ref.parameters())))


old = None
while True:
    with rt.step() as step:
        if step.done or "new_world" in report or step.index >= 500:
            break
        if step.generation == 1 and step.index == 0:
            report["backend"] = dist.get_backend(step.groups.world)
            collectives(step)
            old = step.groups.world
            if step.rank == 2:
                rt.leave("backend test")
        if step.reconfigured and old is not None:
            refused("earlier_generation", lambda: dist.all_reduce(torch.ones(1), group=old))
            x = torch.ones(1)
            dist.all_reduce(x)
            check("new generation's world", x.item() == step.world_size)
            report["new_world"] = step.world_size
        rt.commit_update()
        time.sleep(0.02)
report["left"] = bool(rt.finished)
with open(os.path.join(a.out, f"rank-{rt.worker_id}.json"), "w") as f:
    json.dump(report, f)
rt.finish()
rt.close()
