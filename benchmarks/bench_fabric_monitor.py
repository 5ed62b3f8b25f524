"""Benchmark: Fabric training-step time with vs without ``MemoryMonitor``, same loop, same process.

The zoo's GPT-2 layout (4 layers, h=128, V=8192, batch 8 x 128) trains on CPU with one thread. Blocks
of ``--block`` steps alternate without / with the monitor (``with monitor.step(batch):`` around the
step), each pair's order alternating (A B, B A, ...) so that load from other processes and drift hit
both arms alike, as ``bench_callback_overhead.py`` does for the callback. The monitor sees only its own
steps, so its tracked steps (the first, the first steady one, every ``measure_every_n_steps``-th) keep
their cadence.

Reported (ratios measured in the same run):

- ordinary-step ratio: median over pairs of (median untracked "with" step / median "without" step);
- tracked-step factor k: each tracked step / the median "without" step of its pair;
- end-to-end ratio = ordinary-step ratio + (k - 1) / measure_every_n_steps (the cost per step of a run).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/bench_fabric_monitor.py --pairs 8 --measure-every-n-steps 10
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from lightning.fabric import Fabric

from lightning_memplan import LinearCrossEntropy
from lightning_memplan.fabric import MemoryMonitor
from lightning_memplan.testing.zoo import GPT, gpt2_style


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--block", type=int, default=6)
    p.add_argument("--measure-every-n-steps", type=int, default=100)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    config = gpt2_style(vocab_size=8192, n_layers=4, hidden=128)
    module = GPT(config)
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-3))
    chunked = LinearCrossEntropy(shift=True)

    def loss_fn(module, batch):
        return chunked(module(batch), module.lm_head.weight, batch)

    monitor = MemoryMonitor(fabric, model, optimizer, loss_fn=loss_fn, print_report=False, write_files=False,
                            measure_every_n_steps=args.measure_every_n_steps)

    def step(batch: torch.Tensor) -> None:
        loss = loss_fn(model, batch)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    def run(watched: bool, n: int) -> list[tuple[float, bool]]:
        times = []
        for _ in range(n):
            batch = torch.randint(0, config.vocab_size, (8, 128))
            tracked = False
            t = time.perf_counter()
            if watched:
                with monitor.step(batch):
                    tracked = monitor._session.fit.tracker is not None  # the tensor tracker runs this step
                    step(batch)
            else:
                step(batch)
            elapsed = time.perf_counter() - t
            times.append((elapsed, tracked))
        return times

    run(False, 2)  # warm-up: optimizer states exist, allocator warm
    ratios, factors = [], []
    for pair in range(args.pairs):
        arms = {}
        for watched in ((False, True) if pair % 2 == 0 else (True, False)):
            arms[watched] = run(watched, args.block)
        base = statistics.median(t for t, _ in arms[False])
        ordinary = [t for t, tracked in arms[True] if not tracked]
        ratios.append(statistics.median(ordinary) / base)
        factors += [t / base for t, tracked in arms[True] if tracked]
    ordinary_ratio = statistics.median(ratios)
    # the first tracked step also infers the specs and calibrates (a one-time cost): not part of k
    k = statistics.median(factors[1:]) if len(factors) > 1 else float("nan")
    print(f"ordinary-step ratio {ordinary_ratio:.4f} (pairs {min(ratios):.3f}-{max(ratios):.3f})")
    print(f"tracked-step factor k {k:.2f} over {len(factors) - 1} tracked steps (first, calibrating: {factors[0]:.1f}x)")
    print(f"end-to-end ratio at measure_every_n_steps={args.measure_every_n_steps}: "
          f"{ordinary_ratio + (k - 1) / args.measure_every_n_steps:.4f}")


if __name__ == "__main__":
    main()
