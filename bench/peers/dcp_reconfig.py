#!/usr/bin/env python3
"""PyTorch Distributed Checkpoint as the peer of morph's end-to-end reconfiguration benchmark.

What users run today to change a job's shape: the old world's processes `dcp.save` their
sharded state (DTensors; DCP's default FileSystemWriter, which fsyncs), every process exits,
a fresh world starts (new interpreters, `import torch`, a Gloo process group, the device
mesh), and `dcp.load` reshards into the new layout. The state is the benchmark's model
(bench/reconfig_cases.h: parameters + Adam m and v, ZeRO-1), placed exactly as morph places it:
the layouts come from `restart_baseline_bench --print-layout=CHANGE` (reshard/layout.h ShardOf),
and each rank checks that its DTensor's local chunk is the box morph gives it. After the load
every new rank compares each element with the value it must have (the same deterministic
pattern as the C++ baseline). Prints one JSON line:

  {"name": "dcp/dp4to2", "change": "dp4to2", "bytes": <unique state>, "bytes_written": ...,
   "bytes_loaded": ..., "save_s": ..., "restart_s": ..., "load_s": ..., "seconds": ...,
   "verified": true, "torch": "2.7.1+cu126"}

Phases (wall clock, one host): save = barrier -> dcp.save -> barrier on the old ranks;
restart = from there until every new rank has its process group, mesh and empty state
(old processes exiting, at once with os._exit, new interpreters starting and importing torch,
rendezvous; `restart_parts` splits it);
load = barrier -> dcp.load -> barrier.

  build/peers-venv/bin/python bench/peers/dcp_reconfig.py --change dp4to2 --bytes 1GiB \
      --layout-bin build/bench/restart_baseline_bench

Run under the venv that bench/peers/setup_torch.sh makes. Workers get OMP_NUM_THREADS=1, as
torchrun sets for several processes per host. Every wait is bounded by --timeout seconds.
"""
import argparse
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import time


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- workers (import torch) ----

def expected(torch, tensor_index, box, cols):
    """The values of `box` of tensor `tensor_index` as int32 (ValueAt in the C++ baseline)."""
    (r0, r1), (c0, c1) = box
    idx = (torch.arange(r0, r1, dtype=torch.int64)[:, None] * cols +
           torch.arange(c0, c1, dtype=torch.int64)[None, :])
    v = (idx * 2654435761 + tensor_index * 40503 + (idx >> 32)) & 0xFFFFFFFF
    v = torch.where(v >= 2**31, v - 2**32, v)
    return v.to(torch.int32)


def build_state(torch, layout, role, rank, fill):
    """This rank's state dict of DTensors for `role` ("old"/"new") and its boxes."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    cfg = layout[role]
    dp, tp, pp = cfg["dp"], cfg["tp"], cfg["pp"]
    world = dp * tp * pp
    # rank = (p*dp + d)*tp + t; the mesh's dims are (pp, tp, dp) so that a tensor's TP split
    # comes before its ZeRO split, as in morph's layout (the TP-local piece, then DP ranges).
    ranks = torch.arange(world).reshape(pp, dp, tp).permute(0, 2, 1).contiguous()
    mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("pp", "tp", "dp"))
    sub = mesh["tp", "dp"]
    boxes = {s["tensor"]: s["box"] for s in cfg["ranks"][rank]}
    state = {}
    for k, t in enumerate(layout["tensors"]):
        if k not in boxes:
            continue  # another pipeline stage's tensor
        tp_place = Shard(t["tp_dim"]) if t["tp_dim"] >= 0 else Replicate()
        dp_place = Shard(0) if t["zero"] else Replicate()
        placements = (tp_place, dp_place)
        shape = tuple(t["shape"])
        box = boxes[k]
        local_shape, offset = compute_local_shape_and_global_offset(shape, sub, placements)
        want_shape = tuple(e - b for b, e in box)
        want_offset = tuple(b for b, _ in box)
        if tuple(local_shape) != want_shape or tuple(offset) != want_offset:
            raise RuntimeError(
                f"{t['name']}: DTensor chunk {tuple(local_shape)} at {tuple(offset)} is not "
                f"morph's box {box} on rank {rank} ({role})")
        if fill:
            local = expected(torch, k, box, shape[1]).view(torch.float32)
        else:
            local = torch.empty(want_shape, dtype=torch.float32)
        stride = (shape[1], 1)
        state[t["name"]] = DTensor.from_local(local, sub, placements, run_check=False,
                                              shape=torch.Size(shape), stride=stride)
    return state, boxes


def worker(args):
    t_start = time.time()
    import warnings
    warnings.filterwarnings("ignore")  # torch's deprecation notes, once per process
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    t_import = time.time()

    with open(os.path.join(args.dir, "layout.json")) as f:
        layout = json.load(f)
    role, rank = args.worker, args.rank
    cfg = layout[role]
    world = cfg["dp"] * cfg["tp"] * cfg["pp"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                            world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    t_pg = time.time()
    ckpt = os.path.join(args.dir, "ckpt")
    out = {"rank": rank, "t_start": t_start, "t_import": t_import, "t_pg": t_pg}
    if role == "old":
        state, _ = build_state(torch, layout, "old", rank, fill=True)
        dist.barrier()
        out["t_save0"] = time.time()
        dcp.save(state, checkpoint_id=ckpt)
        dist.barrier()
        out["t_save1"] = time.time()
    else:
        state, boxes = build_state(torch, layout, "new", rank, fill=False)
        dist.barrier()
        out["t_ready"] = time.time()
        dcp.load(state, checkpoint_id=ckpt)
        dist.barrier()
        out["t_loaded"] = time.time()
        wrong = 0
        loaded = 0
        for k, t in enumerate(layout["tensors"]):
            if k not in boxes:
                continue
            local = state[t["name"]].to_local()
            want = expected(torch, k, boxes[k], t["shape"][1])
            wrong += int((local.view(torch.int32) != want).sum())
            loaded += local.numel() * local.element_size()
        out["wrong"] = wrong
        out["bytes_loaded"] = loaded
    out["torch"] = torch.__version__
    with open(os.path.join(args.dir, f"{role}-{rank}.json"), "w") as f:
        json.dump(out, f)
    if role == "old":
        # The checkpoint is durable (fsynced): end at once, without the interpreter's teardown
        # of torch (seconds here), the most favourable reading for DCP.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    dist.destroy_process_group()


# ---- driver (no torch) ----

def run_world(args, role, world):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", role,
                               "--rank", str(r), "--port", str(port), "--dir", args.dir,
                               "--timeout", str(args.timeout)], env=env)
             for r in range(world)]
    deadline = time.time() + args.timeout
    try:
        for p in procs:
            rc = p.wait(timeout=max(1, deadline - time.time()))
            if rc != 0:
                raise RuntimeError(f"a {role} worker exited with {rc}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def driver(args):
    os.makedirs(args.dir, exist_ok=True)
    for name in os.listdir(args.dir):
        path = os.path.join(args.dir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    layout_text = subprocess.run([args.layout_bin, f"--print-layout={args.change}",
                                  f"--bytes={args.bytes}"], check=True, capture_output=True,
                                 text=True, timeout=60).stdout
    layout = json.loads(layout_text)
    with open(os.path.join(args.dir, "layout.json"), "w") as f:
        f.write(layout_text)
    old_world = layout["old"]["dp"] * layout["old"]["tp"] * layout["old"]["pp"]
    new_world = layout["new"]["dp"] * layout["new"]["tp"] * layout["new"]["pp"]
    run_world(args, "old", old_world)
    t_old_gone = time.time()
    ckpt = os.path.join(args.dir, "ckpt")
    written = sum(os.path.getsize(os.path.join(ckpt, n)) for n in os.listdir(ckpt))
    run_world(args, "new", new_world)

    def load(name):
        with open(os.path.join(args.dir, name)) as f:
            return json.load(f)
    old0 = load("old-0.json")
    news = [load(f"new-{r}.json") for r in range(new_world)]
    wrong = sum(n["wrong"] for n in news)
    save_s = old0["t_save1"] - old0["t_save0"]
    restart_s = news[0]["t_ready"] - old0["t_save1"]
    load_s = news[0]["t_loaded"] - news[0]["t_ready"]
    # Where the restart goes (the slowest new rank for each step).
    restart_parts = {
        "old_exit_s": round(t_old_gone - old0["t_save1"], 4),
        "spawn_s": round(max(n["t_start"] for n in news) - t_old_gone, 4),
        "import_torch_s": round(max(n["t_import"] - n["t_start"] for n in news), 4),
        "process_group_s": round(max(n["t_pg"] - n["t_import"] for n in news), 4),
        "mesh_and_state_s": round(news[0]["t_ready"] - max(n["t_pg"] for n in news), 4),
    }
    line = {
        "name": f"dcp/{args.change}", "change": args.change, "bytes": layout["bytes"],
        "bytes_written": written, "bytes_loaded": sum(n["bytes_loaded"] for n in news),
        "old_world": old_world, "new_world": new_world,
        "save_s": round(save_s, 4), "restart_s": round(restart_s, 4),
        "load_s": round(load_s, 4), "seconds": round(save_s + restart_s + load_s, 4),
        "restart_parts": restart_parts,
        # DCP's cost if the new interpreters had torch imported already: a floor, not a run.
        "seconds_excl_import": round(save_s + restart_s + load_s -
                                     restart_parts["import_torch_s"], 4),
        "verified": wrong == 0, "torch": old0["torch"],
    }
    print(json.dumps(line), flush=True)
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)
    if wrong:
        print(f"dcp_reconfig: {wrong} elements loaded wrong", file=sys.stderr)
        return 1
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--change", default="dp4to2", choices=["dp4to2", "dp2to4", "tp2to1", "pp2to1"])
    ap.add_argument("--bytes", default="1GiB", help="unique state, e.g. 1GiB, 48MiB")
    ap.add_argument("--layout-bin", default="build/bench/restart_baseline_bench")
    ap.add_argument("--dir", default="build/bench-tmp/dcp", help="scratch folder (emptied)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds, for every wait")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint folder")
    ap.add_argument("--worker", choices=["old", "new"], help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
