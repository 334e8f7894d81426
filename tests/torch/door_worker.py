"""A worker of torch_door_multi_test (door_multi_test.sh: 3 workers under morphrun; issue 33):
the job's listeners and torch's store refuse a process without the job token; a Work dropped
before its op completed; all_to_all's splits; sizes, dtypes and kinds that differ across ranks;
a group used from a second thread; get_future() without blocking; and, after a change (rank 2
leaves), a communicator, a process group and a tensor view of the earlier generation. Writes
<out>/rank-<worker id>.json with {"checks": [[name, ok, detail]...]}.

  door_worker.py --out DIR
"""
import argparse
import datetime
import gc
import json
import os
import socket
import struct
import threading
import time

import torch
import torch.distributed as dist

import morph

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
a = p.parse_args()


def declare(s):
    # 12 MiB, ZeRO-sharded over dp: rank 0's shard grows from 4 to 6 MiB when dp goes 3 -> 2,
    # its old pages moved into the new shard (both start at element 0).
    s.add_tensor("z", shape=(3 << 20,), layout=morph.Layout.layer(0).zero_shard())


# Generous torch timeouts: rank 0 probes while the others wait in a collective.
rt = morph.start(declare, global_batch=6, dataset_samples=1000,
                 pg_timeout=datetime.timedelta(seconds=60))
report = {"worker": rt.worker_id, "checks": []}


def check(name, ok, detail=""):
    report["checks"].append([name, bool(ok), str(detail)[:400]])


def raises(fn):
    """The exception fn raised (type name: message), or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


# ---- item 1: every listener of the job refuses a process without the token ----
def listening_sockets(pids):
    """(pid, ip, port) of every TCP socket those processes listen on (IPv4 and IPv6)."""
    inodes = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes[link[8:-1]] = pid
        except OSError:
            pass
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            hexip, hexport = f[1].split(":")
            if v6:
                ip = socket.inet_ntop(socket.AF_INET6, bytes.fromhex(hexip))
            else:
                ip = socket.inet_ntoa(bytes.fromhex(hexip)[::-1])
            found.append((inodes[f[9]], ip, int(hexport, 16)))
    return found


def torch_store_answers(ip, port):
    """True when a torch TCPStore serves ip:port to anyone: torch's own client handshake
    (QueryType::VALIDATE with its magic number, then PING with a nonce the server echoes),
    with no token. Short timeouts: a listener of another protocol just does not answer."""
    try:
        with socket.create_connection((ip, port), timeout=0.5) as s:
            s.settimeout(0.5)
            s.sendall(struct.pack("<BI", 0, 0x3C85F7CE) + struct.pack("<BI", 13, 4242))
            data = s.recv(4)
            return len(data) == 4 and struct.unpack("<I", data)[0] == 4242
    except OSError:
        return False


def probe_listeners(step):
    pids = [None] * step.world_size
    dist.all_gather_object(pids, os.getpid())
    # A group of torch's own Gloo (not one of morph's): its listeners count too.
    extra = dist.new_group(list(range(step.world_size)))
    dist.barrier(group=extra)
    if step.rank == 0:
        control = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        check("the probe finds an open torch store", torch_store_answers("127.0.0.1", control.port))
        del control
        socks = listening_sockets(pids + [os.getppid()])
        check("listeners found", len(socks) >= 3, socks)
        for pid, ip, port in socks:
            check(f"listener {ip}:{port} (pid {pid}) on loopback",
                  ip.startswith("127.") or ip == "::1", ip)
            check(f"listener {ip}:{port} (pid {pid}) is no open torch store",
                  not torch_store_answers("127.0.0.1" if ip in ("0.0.0.0", "::") else ip, port))
    dist.barrier()
    dist.destroy_process_group(extra)


# ---- item 3: a Work dropped before its op completed ----
def dropped_works(step):
    r, n = step.rank, step.world_size
    g = step.groups.world
    outs = [torch.empty(1 << 20) for _ in range(n)]
    for i in range(6):
        dist.all_gather(outs, torch.full((1 << 20,), float(10 * i + r)), group=g, async_op=True)
        out = torch.empty(1 << 19)
        dist.reduce_scatter(out, [torch.full((1 << 19,), float(q)) for q in range(n)], group=g,
                            async_op=True)
        junk = [torch.randn(1 << 18) for _ in range(8)]  # reuse what was freed
        del junk
        gc.collect()
    x = torch.ones(3)
    dist.all_reduce(x, group=g)  # after the dropped ones, in order
    check("dropped works: the group goes on", x.tolist() == [float(n)] * 3, x)
    check("dropped works: the last all_gather's outputs arrived",
          all(torch.equal(o, torch.full((1 << 20,), float(50 + q))) for q, o in enumerate(outs)))


# ---- item 5: all_to_all with a split list shorter than the world ----
def short_splits(step):
    g = step.groups.world
    n = step.world_size
    err = raises(lambda: dist.all_to_all_single(torch.empty(2), torch.ones(2), [2], [2], group=g))
    check("all_to_all short splits refused", err and "split" in err, err)
    err = raises(lambda: dist.all_to_all_single(torch.empty(n), torch.ones(n), [1] * (n + 1),
                                                [1] * (n + 1), group=g))
    check("all_to_all long splits refused", err and "split" in err, err)
    err = raises(lambda: dist.all_to_all_single(torch.empty(n), torch.ones(n), [-1] + [1] * n,
                                                [1] * n, group=g))
    check("all_to_all negative split refused", err is not None, err)


# ---- item 7: sizes, dtypes, kinds that differ across ranks ----
def mismatches(step):
    r, n = step.rank, step.world_size
    g = step.groups.world
    cases = {
        "all_reduce size": lambda: dist.all_reduce(torch.ones(4 if r == 0 else 8), group=g),
        "all_reduce dtype": lambda: dist.all_reduce(
            torch.ones(4, dtype=torch.float32 if r == 0 else torch.float64), group=g),
        "all_reduce large": lambda: dist.all_reduce(torch.ones((1 << 18) if r == 0 else (1 << 22)),
                                                    group=g),
        "broadcast size": lambda: dist.broadcast(torch.ones(3 + r), src=0, group=g),
        "all_gather size": lambda: dist.all_gather_into_tensor(
            torch.empty(n * (2 + r)), torch.ones(2 + r), group=g),
        "reduce op": lambda: dist.all_reduce(
            torch.ones(4), op=dist.ReduceOp.SUM if r == 0 else dist.ReduceOp.MAX, group=g),
        "kind": lambda: (dist.all_reduce(torch.ones(4), group=g) if r == 0
                         else dist.broadcast(torch.ones(4), src=0, group=g)),
    }
    for name, fn in cases.items():
        err = raises(fn)
        check(f"mismatch {name} raised here", err is not None and "differ" in err, err)
    x = torch.full((2,), float(r))
    dist.all_reduce(x, group=g)
    check("mismatches: the group goes on", x.tolist() == [float(sum(range(n)))] * 2, x)


# ---- item 8: one group, two threads ----
def two_threads(step):
    r, n = step.rank, step.world_size
    g = step.groups.world
    errors = []

    def other():
        errors.append(raises(lambda: dist.all_reduce(torch.ones(2), group=g)))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    check("a second thread refused", errors[0] and "thread" in errors[0], errors[0])
    good = []
    for i in range(40):
        x = torch.full((4,), float(i * n + r))
        dist.all_reduce(x, group=g)
        good.append(x[0].item() == sum(i * n + q for q in range(n)))
    check("the owning thread's results", all(good))


# ---- item 15: get_future() does not block ----
def future(step):
    r = step.rank
    g = step.groups.world
    if r == 1:
        time.sleep(1.5)
    x = torch.full((2,), float(r))
    w = dist.all_reduce(x, group=g, async_op=True)
    t = time.monotonic()
    fut = w.get_future()
    took = time.monotonic() - t
    if r == 0:
        check("get_future returns at once", took < 0.5, f"{took:.2f} s")
    res = fut.wait()
    check("future's value", res[0].tolist() == [float(sum(range(step.world_size)))] * 2, res)


# ---- items 4, 6: handles of an earlier generation after a change ----
old = {}


def before_change(step):
    old["comm"] = step.communicator("world")
    old["group"] = step.groups.world
    old["z"] = rt.state["z"]
    old["z"].fill_(float(step.rank + 1))
    old["z_values"] = old["z"].clone()
    old["generation"] = step.generation


def after_change(step):
    err = raises(lambda: old["comm"].barrier(1000))
    check("old communicator refused", err and "FailedPrecondition" in err, err)
    err = raises(lambda: dist.all_reduce(torch.ones(1), group=old["group"]))
    check("old process group refused", err is not None, err)
    # Reading the old view neither faults nor changes the new state; writing it neither.
    new = rt.state["z"]
    before = new.clone()
    s = old["z"].sum().item()
    old["z"].add_(1000)
    check("old view readable", s == s, s)
    check("old view writes do not reach the state", torch.equal(new, before))
    # A traceback names this generation's rank once (torch's hook stacked "[rank1]: [rank2]:").
    import io
    import sys
    err, sys.stderr = sys.stderr, io.StringIO()
    try:
        try:
            raise ValueError("for the traceback")
        except ValueError:
            sys.excepthook(*sys.exc_info())
    finally:
        text, sys.stderr = sys.stderr.getvalue(), err
    lines = [line for line in text.split("\n") if line]
    check("traceback lines carry one prefix, this rank's",
          lines and all(line.startswith(f"[rank{step.rank}]: ") and
                        not line[len(f"[rank{step.rank}]: "):].startswith("[rank")
                        for line in lines), lines[:2])
    if step.rank == 0:  # its shard grew over its old one (both start at element 0)
        addr = old["z"].data_ptr()
        moved = False
        with open("/proc/self/maps") as f:
            for line in f:
                span, perms = line.split()[:2]
                lo, hi = (int(x, 16) for x in span.split("-"))
                if lo <= addr < hi:
                    moved = perms.endswith("p") and "morph-host-tensors" in line
        check("rank 0's old pages moved into its new shard (no copy)", moved)
        check("the moved elements read the values they had",
              torch.equal(old["z_values"][:64], new[:64]))


while True:
    with rt.step() as step:
        if step.done or step.index >= 400:
            break
        if step.generation == 1 and step.index == 0:
            probe_listeners(step)
            dropped_works(step)
            short_splits(step)
            mismatches(step)
            two_threads(step)
            future(step)
            before_change(step)
            if step.rank == 2:
                rt.leave("door test")
        if step.reconfigured and old:
            after_change(step)
            report["new_world"] = step.world_size
            rt.commit_update()
            break
        rt.commit_update()
        time.sleep(0.02)
report["left"] = bool(rt.finished)
with open(os.path.join(a.out, f"rank-{rt.worker_id}.json"), "w") as f:
    json.dump(report, f)
rt.finish()
rt.close()
