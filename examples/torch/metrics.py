"""What train.py and train_plain.py report: a line per step on world rank 0 (printed; with --out
DIR also appended to DIR/metrics.tsv: step, loss, world, dp, tp, pp, generation, ms, tokens/s,
unix time), one line per reconfiguration of a morph job (not its start) in DIR/events.tsv (step,
generations, worlds, configs, recovery, steps lost, communicators, plan, transfer, resume and
stall ms, bytes received: examples/gpt's columns, which scripts/elastic_checks.sh reads), and
DIR/pids/<pid>, touched at every step this process trains (the tests pick their victims there).
"""
from __future__ import annotations

import os
import time

import torch.distributed as dist


def config_text(dp: int, tp: int, pp: int) -> str:
    return f"dp{dp}tp{tp}pp{pp}"


class Metrics:
    def __init__(self, out: str = "", quiet: bool = False, tokens_per_step: int = 0,
                 runtime=None):
        """`runtime`: a morph runtime (`job.runtime`) whose reconfigurations go to events.tsv."""
        self.out, self.quiet, self.tokens, self.runtime = out, quiet, tokens_per_step, runtime
        self.pid_file, self.last, self.seen = "", time.time(), None
        if out:
            os.makedirs(os.path.join(out, "pids"), exist_ok=True)
            self.pid_file = os.path.join(out, "pids", str(os.getpid()))
            open(self.pid_file, "w").close()

    def step(self, index: int, loss: float, mesh) -> None:
        """After step `index` on `mesh` (a DeviceMesh with dimensions among "pp", "dp", "tp");
        `loss`: the global batch's mean loss."""
        if self.pid_file:
            os.utime(self.pid_file)
        now = time.time()
        secs, self.last = now - self.last, now
        size = {n: mesh.size(i) for i, n in enumerate(mesh.mesh_dim_names)}
        dp, tp, pp = size.get("dp", 1), size.get("tp", 1), size.get("pp", 1)
        r = self.runtime.last_reconfiguration if self.runtime is not None else None
        generation = r.generation if r is not None else 0
        if dist.get_rank() != 0:
            return
        if self.out and r is not None and r.from_generation > 0 and r.generation != self.seen:
            self.seen = r.generation
            ms = [round(x * 1e3, 2) for x in (r.communicators_seconds, r.plan_seconds,
                                              r.transfer_seconds, r.resume_seconds,
                                              r.stall_seconds)]
            old, new = r.old_config, r.config
            self._append("events.tsv", [r.step, r.from_generation, r.generation, old.world,
                                        new.world, config_text(old.dp, old.tp, old.pp),
                                        config_text(new.dp, new.tp, new.pp), int(r.recovery),
                                        r.lost_steps, *ms, r.bytes_received, 0])
        if self.out:
            self._append("metrics.tsv", [index, f"{loss:.9f}", dp * tp * pp, dp, tp, pp,
                                         generation, f"{secs * 1e3:.2f}",
                                         f"{self.tokens / secs:.0f}", f"{now:.3f}"])
        if not self.quiet:
            print(f"step {index:4d}  loss {loss:.4f}  generation {generation}  "
                  f"{config_text(dp, tp, pp)}  {secs:.2f} s", flush=True)

    def _append(self, name: str, fields: list) -> None:
        with open(os.path.join(self.out, name), "a") as f:
            f.write("\t".join(str(x) for x in fields) + "\n")
