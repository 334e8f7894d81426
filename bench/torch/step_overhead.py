"""Per-step cost of morph's Python step loop next to a plain PyTorch loop (`make bench-torch`).

Runs as a one-worker job (`morphrun -n 1 -- python bench/torch/step_overhead.py`). The step is
examples/torch's Llama (forward, backward, torch's AdamW) on one process; its parameters are
registered in morph and the module trains on morph's storage (zero copy). Blocks of K plain
steps (no morph call) and K morph steps (`with rt.step()`, `rt.commit_update()`) alternate R
times (ABBA), so that the machine's drift hits both alike; the median block of each gives the step
time. Also the loop alone: `with rt.step(): rt.commit_update()` with an empty body, per step.

One JSON line: plain_step_s and morph_step_s (medians of the blocks, with min and max),
overhead (morph / plain - 1: the direct comparison, noisy at the 1% level on a shared
machine), empty_step_us (the loop's own cost) and overhead_of_empty_loop (empty_step_us over
the plain step: what the loop adds when nothing else differs), target 0.01.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "examples", "torch"))

import morph  # noqa: E402
from llama import Llama, LlamaArgs, batch, init_weights, load_corpus  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block", type=int, default=10, help="steps per timed block (K)")
    ap.add_argument("--repeats", type=int, default=9, help="blocks of each kind (R)")
    ap.add_argument("--empty-steps", type=int, default=20000)
    a = ap.parse_args()
    torch.manual_seed(0)
    args = LlamaArgs(n_layers=a.layers)
    model = Llama(args)
    init_weights(model, 1)
    corpus = load_corpus()
    params = dict(model.named_parameters())

    def declare(s: morph.State) -> None:
        for name, p in params.items():
            s.add_tensor(name, p.detach(), layout=morph.Layout.layer(0))

    rt = morph.start(declare, num_layers=1, global_batch=a.batch)
    for name, p in params.items():  # the module trains on morph's storage
        p.data = rt.state.tensor(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    samples = range(a.batch)

    def body(i: int) -> None:
        x, y = batch(corpus, args.seq, i, samples, 1)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()

    def update() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    counter = [0]

    def plain_block() -> float:
        t = time.perf_counter()
        for _ in range(a.block):
            body(counter[0])
            update()
            counter[0] += 1
        return (time.perf_counter() - t) / a.block

    def morph_block() -> float:
        t = time.perf_counter()
        for _ in range(a.block):
            with rt.step() as step:
                body(step.index)
                rt.commit_update()
                update()
        return (time.perf_counter() - t) / a.block

    plain_block(), morph_block()  # warm-up
    plain, with_morph = [], []
    for r in range(a.repeats):  # ABBA: neither kind always runs first
        if r % 2 == 0:
            plain.append(plain_block())
            with_morph.append(morph_block())
        else:
            with_morph.append(morph_block())
            plain.append(plain_block())
    t = time.perf_counter()
    for _ in range(a.empty_steps):
        with rt.step():
            rt.commit_update()
    empty = (time.perf_counter() - t) / a.empty_steps
    p, m = statistics.median(plain), statistics.median(with_morph)
    print(json.dumps({
        "name": "torch_step_overhead", "layers": a.layers, "batch": a.batch,
        "block_steps": a.block, "blocks": a.repeats,
        "plain_step_s": round(p, 6), "plain_step_s_range": [round(min(plain), 6), round(max(plain), 6)],
        "morph_step_s": round(m, 6),
        "morph_step_s_range": [round(min(with_morph), 6), round(max(with_morph), 6)],
        "overhead": round(m / p - 1, 4), "empty_step_us": round(empty * 1e6, 2),
        "overhead_of_empty_loop": round(empty / p, 5), "target": 0.01,
        "torch": torch.__version__}), flush=True)
    rt.finish()
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
