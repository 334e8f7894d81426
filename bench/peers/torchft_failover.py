#!/usr/bin/env python3
"""TorchFT as the peer of morph's failure benchmark (issue 10): a replica killed with SIGKILL.

Two replica groups of one process each on Gloo (torchft.ProcessGroupGloo), a TorchFT Manager per
group and the Rust lighthouse (`torchft_lighthouse`, from the torchft 0.2.0 wheel) in its own
process. The model is a list of f32 parameters with Adam (state = parameters + two moments =
--bytes). A step is: OptimizerWrapper.zero_grad (start_quorum), --compute-ms of emulated
forward/backward (sleep), deterministic gradients, `manager.allreduce` per gradient (TorchFT's
DistributedDataParallel wrapper crashes the survivor when the other replica dies, so the
gradients go through the manager directly, as its docs allow), should_commit, Adam step.

Each job (a state size and a lighthouse heartbeat timeout) runs --trials cycles of:
  1. both replicas commit --warm-steps steps together;
  2. after a seeded random delay within a step, replica 1 is killed with SIGKILL;
  3. stall: the survivor's longest interval between committed steps, from its last commit
     before the kill through its third after (a step already past its allreduce may commit just
     after the kill; the stall then comes one step later); it includes one ordinary step
     (`step_seconds`, the median interval before the kill);
  4. replica 1 is relaunched (a fresh interpreter): heal = process spawn -> its first
     committed step (it joins the quorum and fetches the survivor's state over TorchFT's HTTP
     checkpoint transport); `seconds_excl_import` leaves out `import torch, torchft` and
     torch._dynamo, which the first torch.optim optimizer imports;
  5. verified: the joiner's parameter fingerprint equals the survivor's at the same step.

Default jobs: --stall-bytes at heartbeat 5000 ms (the lighthouse default) and 1000 ms, then
--heal-bytes (256 MiB) at 5000 ms. One JSON line per job and measure:

  {"name": "torchft/stall/16MiB/hb5000ms", "bytes": ..., "seconds": <median stall>, ...}
  {"name": "torchft/heal/256MiB/hb5000ms", "bytes": ..., "seconds": <median heal>, ...}

  build/peers-venv/bin/python bench/peers/torchft_failover.py --trials 3

Run under the venv that bench/peers/setup_torchft.sh makes (the lighthouse is
<venv>/bin/torchft_lighthouse). Every wait is bounded by --timeout seconds; children die with
this process (PR_SET_PDEATHSIG). Logs: --dir/<job>-*.log.
"""
import argparse
import ctypes
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

MIB = 1 << 20


def parse_bytes(text):
    units = {"kib": 1 << 10, "mib": MIB, "gib": 1 << 30, "b": 1}
    t = text.strip().lower()
    for u, m in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * m)
    return int(t)


def bytes_label(n):
    return f"{n // MIB}MiB" if n % MIB == 0 else f"{n}B"


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def emit(**fields):
    print(json.dumps(fields), flush=True)


# ---- a replica (imports torch) ----

def gloo_group_class(torch, ft_gloo):
    """torchft 0.2.0's ProcessGroupGloo, or where torch lacks two debugging options, a copy.

    torchft 0.2.0 declares torch>=2.7, but its ProcessGroupGloo._create_pg sets
    `options.global_ranks_in_group` and `options.group_name`, which torch 2.7.1's Gloo options do
    not have (AttributeError at every quorum: nothing ever commits). They only name the group for
    logs and the flight recorder; this subclass builds the same Gloo backend without them.
    """
    from torch.distributed import ProcessGroup as BaseProcessGroup
    from torch.distributed import ProcessGroupGloo as BaseGloo
    if hasattr(BaseGloo.Options, "global_ranks_in_group"):
        return ft_gloo

    class Gloo(ft_gloo):
        def _create_pg(self, store, rank, world_size):
            pg = BaseProcessGroup(store, rank, world_size)
            pg._set_default_backend(BaseProcessGroup.BackendType.GLOO)
            backend = BaseGloo(store, rank, world_size, self._timeout)
            backend._set_sequence_number_for_group()
            pg._register_backend(torch.device("cpu"), BaseProcessGroup.BackendType.GLOO, backend)
            return pg

    return Gloo


def replica_main(args):
    t_start = time.monotonic()
    import datetime
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper
    import torch._dynamo  # noqa: F401  torch.optim's first optimizer imports it (~10 s here)
    t_import = time.monotonic()
    torch.set_num_threads(1)  # deterministic and fair: both replicas share the host's cores
    pg_class = gloo_group_class(torch, ProcessGroupGloo)

    n_param = args.bytes // 3 // 4  # parameters + Adam m and v, f32
    per_tensor = max(1, args.tensor_bytes // 4)
    params = []
    left, k = n_param, 0
    while left > 0:
        n = min(per_tensor, left)
        p = torch.nn.Parameter(torch.full((n,), 0.01 * (k + 1), dtype=torch.float32))
        p.grad = torch.zeros_like(p)
        params.append(p)
        left -= n
        k += 1
    adam = torch.optim.Adam(params, lr=1e-3, foreach=True)

    def state_dict():
        return {"params": [p.data for p in params], "optim": adam.state_dict()}

    def load_state_dict(sd):
        with torch.no_grad():
            for p, src in zip(params, sd["params"]):
                p.copy_(src)
        adam.load_state_dict(sd["optim"])

    t_state = time.monotonic()  # model and Adam built (torch imports more on first use)
    # A replica group of one process: it hosts its own TCPStore (torchrun would).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=pg_class(timeout=datetime.timedelta(seconds=args.pg_timeout)),
        load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=1,
        replica_id=f"ftbench_{args.replica}", store_addr="127.0.0.1", store_port=store.port,
        rank=0, world_size=1, lighthouse_addr=args.lighthouse, hostname="127.0.0.1",
        timeout=datetime.timedelta(seconds=args.op_timeout),
        quorum_timeout=datetime.timedelta(seconds=args.op_timeout),
        connect_timeout=datetime.timedelta(seconds=args.op_timeout))
    optimizer = OptimizerWrapper(manager, adam)
    emit(ev="ready", t_start=t_start, t_import=t_import, t_state=t_state,
         t_manager=time.monotonic(),
         torch=torch.__version__, tensors=len(params), param_bytes=n_param * 4)

    compute_s = args.compute_ms / 1000.0
    while True:
        optimizer.zero_grad(set_to_none=False)  # start_quorum (asynchronous) + zero the grads
        time.sleep(compute_s)  # forward/backward
        step = manager.current_step()
        g = 1e-3 * (1 + args.replica) * (1 + step % 5)
        for p in params:
            p.grad.fill_(g)
        works = [manager.allreduce(p.grad) for p in params]
        for w in works:
            w.wait()
        if manager.should_commit():
            adam.step()
            fp = 0.0
            if args.fingerprint:
                with torch.no_grad():
                    fp = float(sum(p.detach()[::1021].double().sum() for p in params))
            emit(ev="commit", step=manager.current_step(), t=time.monotonic(), fp=fp)
        else:
            emit(ev="fail", step=step, t=time.monotonic())


# ---- the orchestrator ----

def die_with_parent():
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Replica:
    """A replica process and the events it printed (read by a thread)."""

    def __init__(self, cmd, log_path, env):
        self.events = []
        self.cond = threading.Condition()
        self.t_spawn = time.monotonic()
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, env=env,
                                     text=True, preexec_fn=die_with_parent)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            with self.cond:
                self.events.append(ev)
                self.cond.notify_all()
        with self.cond:
            self.events.append({"ev": "exit"})
            self.cond.notify_all()

    def wait_for(self, pred, deadline, what):
        with self.cond:
            while True:
                got = pred(self.events)
                if got is not None:
                    return got
                if self.events and self.events[-1].get("ev") == "exit":
                    raise RuntimeError(f"{what}: replica exited (rc {self.proc.poll()}), "
                                       f"see {self.log.name}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{what}: no progress within the timeout, see {self.log.name}")
                self.cond.wait(min(left, 1.0))

    def commits(self):
        with self.cond:
            return [e for e in self.events if e.get("ev") == "commit"]

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.log.close()


def commits_since(t0, n):
    def pred(events):
        c = [e for e in events if e.get("ev") == "commit" and e["t"] > t0]
        return c if len(c) >= n else None
    return pred


def run_job(args, python, lighthouse_bin, state_bytes, hb_ms, rng, env):
    job = f"{bytes_label(state_bytes)}-hb{hb_ms}"
    port = free_port()
    lh_log = open(os.path.join(args.dir, f"{job}-lighthouse.log"), "w")
    lighthouse = subprocess.Popen(
        [lighthouse_bin, "--min_replicas", "1", "--bind", f"127.0.0.1:{port}",
         "--heartbeat_timeout_ms", str(hb_ms)],
        stdout=lh_log, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent)
    base = [python, os.path.abspath(__file__), "--bytes", str(state_bytes),
            "--compute-ms", str(args.compute_ms), "--tensor-bytes", str(args.tensor_bytes),
            "--lighthouse", f"http://127.0.0.1:{port}", "--pg-timeout", str(args.pg_timeout),
            "--op-timeout", str(args.op_timeout), "--fingerprint", "1"]

    def spawn(rid, cycle):
        return Replica(base + ["--replica", str(rid)],
                       os.path.join(args.dir, f"{job}-replica{rid}-{cycle}.log"), env)

    stalls, heals = [], []
    survivor = victim = None
    try:
        survivor, victim = spawn(0, 0), spawn(1, 0)
        for cycle in range(args.trials):
            deadline = time.monotonic() + args.timeout
            joined = victim.wait_for(commits_since(0, args.warm_steps), deadline,
                                     "victim warm-up")
            before = survivor.wait_for(commits_since(joined[-1]["t"], args.warm_steps), deadline,
                                       "survivor warm-up")
            gaps = [b["t"] - a["t"] for a, b in zip(before, before[1:])]
            step_s = statistics.median(gaps)
            time.sleep(rng.uniform(0, step_s))
            t_kill = time.monotonic()
            victim.kill()
            # A step already past its allreduce may still commit just after the kill: the stall
            # is the longest gap from the last commit before the kill through 3 commits after.
            after = survivor.wait_for(commits_since(t_kill, 3), deadline, "survivor after kill")
            last = [e for e in survivor.commits() if e["t"] <= t_kill][-1]
            fails = [e for e in survivor.events if e.get("ev") == "fail" and e["t"] > t_kill]
            window = [last] + after[:3]
            stall = max(b["t"] - a["t"] for a, b in zip(window, window[1:]))
            stalls.append({
                "stall_seconds": round(stall, 4), "step_seconds": round(step_s, 4),
                "stall_excess_seconds": round(stall - step_s, 4),
                "kill_to_resumed_seconds": round(
                    next(b["t"] for a, b in zip(window, window[1:]) if b["t"] - a["t"] == stall)
                    - t_kill, 4),
                "kill_to_first_failed_step_seconds":
                    round(fails[0]["t"] - t_kill, 4) if fails else None,
                "failed_steps": len([f for f in fails if f["t"] < after[2]["t"]]),
                "last_step_before": last["step"], "first_step_after": after[0]["step"]})

            # Relaunch: a fresh interpreter takes replica 1's place and heals from the survivor.
            t_spawn = time.monotonic()
            victim = spawn(1, cycle + 1)
            ready = victim.wait_for(
                lambda ev: next((e for e in ev if e.get("ev") == "ready"), None), deadline,
                "relaunched replica start")
            first = victim.wait_for(commits_since(0, 1), deadline, "relaunched replica heal")[0]
            # The survivor's commit at the joiner's first step: both must hold the same values.
            same = survivor.wait_for(
                lambda ev: next((e for e in ev if e.get("ev") == "commit" and
                                 e["step"] == first["step"]), None), deadline,
                "survivor at the joiner's first step")
            s_commits = [e["t"] for e in survivor.commits()
                         if t_spawn - step_s <= e["t"] <= first["t"] + 2 * step_s]
            s_gap = max((b - a for a, b in zip(s_commits, s_commits[1:])), default=0.0)
            heal = first["t"] - t_spawn
            imp = ready["t_import"] - t_spawn
            heals.append({
                "heal_seconds": round(heal, 4), "import_seconds": round(imp, 4),
                "seconds_excl_import": round(heal - imp, 4),
                "interpreter_start_seconds": round(ready["t_start"] - t_spawn, 4),
                "model_init_seconds": round(ready["t_state"] - ready["t_import"], 4),
                "manager_init_seconds": round(ready["t_manager"] - ready["t_state"], 4),
                "manager_to_first_commit_seconds": round(first["t"] - ready["t_manager"], 4),
                "first_step": first["step"], "verified": same["fp"] == first["fp"],
                "survivor_max_step_gap_seconds": round(s_gap, 4),
                "survivor_stall_on_join_seconds": round(s_gap - step_s, 4)})
    finally:
        for r in (survivor, victim):
            if r is not None:
                r.kill()
        lighthouse.kill()
        lighthouse.wait(timeout=30)
        lh_log.close()

    def med(rows, key):
        return round(statistics.median(r[key] for r in rows), 4)

    common = {"bytes": state_bytes, "heartbeat_timeout_ms": hb_ms,
              "compute_ms": args.compute_ms, "replicas": 2, "backend": "gloo",
              "torchft": args.torchft_version, "trials": len(stalls)}
    emit(name=f"torchft/stall/{bytes_label(state_bytes)}/hb{hb_ms}ms",
         seconds=med(stalls, "stall_seconds"),
         stall_seconds_min=min(r["stall_seconds"] for r in stalls),
         stall_seconds_max=max(r["stall_seconds"] for r in stalls),
         step_seconds=med(stalls, "step_seconds"),
         stall_excess_seconds=med(stalls, "stall_excess_seconds"),
         kill_to_resumed_seconds=med(stalls, "kill_to_resumed_seconds"),
         per_trial=stalls, **common)
    emit(name=f"torchft/heal/{bytes_label(state_bytes)}/hb{hb_ms}ms",
         seconds=med(heals, "heal_seconds"),
         heal_seconds_min=min(r["heal_seconds"] for r in heals),
         heal_seconds_max=max(r["heal_seconds"] for r in heals),
         seconds_excl_import=med(heals, "seconds_excl_import"),
         import_seconds=med(heals, "import_seconds"),
         manager_init_seconds=med(heals, "manager_init_seconds"),
         manager_to_first_commit_seconds=med(heals, "manager_to_first_commit_seconds"),
         survivor_stall_on_join_seconds=med(heals, "survivor_stall_on_join_seconds"),
         verified=all(r["verified"] for r in heals), per_trial=heals, **common)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replica", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--fingerprint", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--stall-bytes", default="16MiB", help="state of the stall jobs")
    ap.add_argument("--heal-bytes", default="256MiB", help="state of the heal job")
    ap.add_argument("--stall-heartbeats-ms", default="5000,1000",
                    help="lighthouse heartbeat timeouts of the stall jobs")
    ap.add_argument("--heal-heartbeat-ms", type=int, default=5000)
    ap.add_argument("--jobs", default="stall,heal", help="stall, heal or both")
    ap.add_argument("--trials", type=int, default=3, help="kill/relaunch cycles per job")
    ap.add_argument("--warm-steps", type=int, default=5)
    ap.add_argument("--compute-ms", type=float, default=100.0, help="emulated fwd/bwd per step")
    ap.add_argument("--tensor-bytes", type=int, default=8 * MIB, help="bytes per parameter")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pg-timeout", type=float, default=30.0, help="Gloo op timeout (s)")
    ap.add_argument("--op-timeout", type=float, default=60.0, help="Manager timeouts (s)")
    ap.add_argument("--timeout", type=float, default=300.0, help="bound on every wait (s)")
    ap.add_argument("--dir", default="/tmp/torchft_failover", help="logs")
    args = ap.parse_args()
    if args.replica is not None:
        return replica_main(args)

    import importlib.metadata
    args.torchft_version = importlib.metadata.version("torchft")
    lighthouse_bin = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    if not os.access(lighthouse_bin, os.X_OK):
        sys.exit(f"torchft_failover: no {lighthouse_bin} (run bench/peers/setup_torchft.sh)")
    os.makedirs(args.dir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    rng = random.Random(args.seed)
    jobs = []
    if "stall" in args.jobs.split(","):
        jobs += [(parse_bytes(args.stall_bytes), int(h))
                 for h in args.stall_heartbeats_ms.split(",")]
    if "heal" in args.jobs.split(","):
        jobs.append((parse_bytes(args.heal_bytes), args.heal_heartbeat_ms))
    for state_bytes, hb in jobs:
        run_job(args, sys.executable, lighthouse_bin, state_bytes, hb, rng, env)


if __name__ == "__main__":
    main()
