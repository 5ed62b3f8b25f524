"""Benchmark: training-step time with vs without ``MemoryPlanCallback`` (default settings), same run.

A small GPT (the zoo's GPT-2 layout, 4 layers, h=128, V=8192) trains on CPU with one thread in ONE fit.
The callback is attached through a gate that passes its per-step hooks on only in "with" blocks:
blocks of ``--block`` steps alternate without/with, and each pair's order alternates too (A B, B A,
A B, ...), so load from other processes and slow drift hit both arms alike and a linear drift cancels
within two pairs. Fit-level hooks (setup, epoch start/end) always pass, so the callback initialises,
calibrates and reports as usual; it sees only the "with" steps, so its tracked steps (the first, the
first steady one and every ``measure_every_n_steps``-th it sees) keep their cadence.

A timer callback placed first in the callback list records the time between consecutive
``on_train_batch_start`` calls (the whole step: data, forward, backward, optimizer, every hook).

Reported (ratios, house style 14):

- ordinary-step ratio: for each pair, median "with" step / median "without" step (tracked steps
  excluded); the median over pairs and its spread (25th-75th percentile, min-max);
- tracked-step factor k: each tracked step / the median of its pair's "without" steps;
- **end-to-end ratio** = ordinary-step ratio + (k - 1) / measure_every_n_steps: the cost per step
  over a run at default settings, the number the <= 1 % promise is about (one line, printed last);
- composed overhead (as before): time inside the callback's hooks + (k - 1) / measure_every_n_steps;
- block-sum ratio (all "with" time / all "without" time, tracked steps included: noisier);
- the one-time cost in the callback's first step (spec inference, calibration, first tracked step).

The fit stops at the first pair boundary after ``--max-seconds`` (150 s), so a loaded machine gets
fewer pairs rather than a longer run (about 100 s for all 120 pairs at ~215 ms per step). Short blocks follow the load's changes:
8-step blocks gave a pair-ratio IQR of 0.93-1.23 at a load average of 12-20 on 2 cores.

Usage::

    python benchmarks/bench_callback_overhead.py               # 120 pairs x 2 steps per arm, writes results/
    python benchmarks/bench_callback_overhead.py --no-write    # same, print only (<= ~3.5 min: --max-seconds)
    python benchmarks/bench_callback_overhead.py --pairs 6 --block 4 --no-write   # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset  # noqa: E402

from lightning_memplan.callbacks import MemoryPlanCallback  # noqa: E402
from lightning_memplan.testing.zoo import GPT, gpt2_style  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

#: Hooks of MemoryPlanCallback that run inside every step (gated; their own run time is summed).
_STEP_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
)
#: Hooks that always pass through the gate (set-up, epoch boundaries, errors, checkpoints).
_FIT_HOOKS = ("setup", "on_train_epoch_start", "on_train_epoch_end", "on_exception", "teardown")


class _Tokens(IterableDataset):
    def __init__(self, vocab: int, b: int, s: int, n: int) -> None:
        self.vocab, self.b, self.s, self.n = vocab, b, s, n

    def __iter__(self):
        gen = torch.Generator().manual_seed(0)
        for _ in range(self.n):
            t = torch.randint(0, self.vocab, (self.b, self.s + 1), generator=gen)
            yield t[:, :-1], t[:, 1:]


class _LitGPT(L.LightningModule):
    def __init__(self, config) -> None:
        super().__init__()
        self.model = GPT(config)

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self.model.logits(self.model(idx))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def arm_of(step: int, block: int) -> bool:
    """Whether ``step`` (0-based, of the fit) runs with the callback: pair p = steps [2pb, 2(p+1)b) is
    without-then-with for even p and with-then-without for odd p."""
    pair, pos = divmod(step, 2 * block)
    first_half = pos < block
    return first_half if pair % 2 else not first_half


class _Gate(L.Callback):
    """Passes the wrapped callback's per-step hooks on only in "with" steps (``arm_of``), and its
    fit-level hooks always; adds the time spent inside the step hooks to ``hook_clock``."""

    def __init__(self, callback: L.Callback, block: int, max_seconds: float) -> None:
        self.callback, self.block, self.max_seconds = callback, block, max_seconds
        self.started = time.perf_counter()
        self.step = -1
        self.on = False
        self.hook_clock = 0.0
        self.hook_time: list[float] = []  # per fit step: seconds inside the callback's step hooks
        self.tracked_steps: list[int] = []  # fit steps the callback tracked

    def state_dict(self):
        return self.callback.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.callback.load_state_dict(state_dict)


def _gated(name: str):
    def hook(self, *args, **kwargs):
        if name == "on_train_batch_start":
            self.step += 1
            self.on = arm_of(self.step, self.block)
            self.hook_time.append(0.0)
        if name == "on_train_batch_end" and (self.step + 1) % (2 * self.block) == 0:
            if time.perf_counter() - self.started > self.max_seconds:
                args[0].should_stop = True  # the time budget: stop at this pair's end
        if not self.on:
            return None
        t0 = time.perf_counter()
        try:
            return getattr(self.callback, name)(*args, **kwargs)
        finally:
            spent = time.perf_counter() - t0
            self.hook_time[-1] += spent
            if name == "on_train_batch_start" and getattr(self.callback, "_session", None) is not None:
                current = getattr(self.callback._session.fit, "current", None) or {}
                if current.get("tracked"):
                    self.tracked_steps.append(self.step)

    hook.__name__ = name
    return hook


def _passed(name: str):
    def hook(self, *args, **kwargs):
        return getattr(self.callback, name)(*args, **kwargs)

    hook.__name__ = name
    return hook


for _name in _STEP_HOOKS:
    setattr(_Gate, _name, _gated(_name))
for _name in _FIT_HOOKS:
    setattr(_Gate, _name, _passed(_name))


class _StepTimer(L.Callback):
    """Time between consecutive batch starts (first in the callback list: brackets everything else)."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        self.starts.append(time.perf_counter())

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def run(args: argparse.Namespace, root: Path) -> dict:
    torch.manual_seed(0)
    config = gpt2_style(
        n_layers=args.layers, hidden=args.hidden, n_heads=4, vocab_size=args.vocab, max_positions=args.seq_len
    )
    n_steps = 2 * args.block * args.pairs
    timer = _StepTimer()
    callback = MemoryPlanCallback(print_report=False)
    gate = _Gate(callback, args.block, args.max_seconds)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=L.pytorch.loggers.CSVLogger(str(root)),
        callbacks=[timer, gate],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_train_batches=n_steps,
    )
    t0 = time.perf_counter()
    trainer.fit(
        _LitGPT(config), DataLoader(_Tokens(args.vocab, args.micro_batch, args.seq_len, n_steps), batch_size=None)
    )
    wall = time.perf_counter() - t0
    times = timer.step_times()
    n_pairs = len(times) // (2 * args.block)  # complete pairs (the time budget may stop the fit early)
    if n_pairs <= args.skip_pairs:
        raise SystemExit(f"only {n_pairs} pairs ran in --max-seconds={args.max_seconds}; raise it or lower --block")
    every = callback.measure_every_n_steps
    tracked = set(gate.tracked_steps)
    first_tracked = min(tracked) if tracked else None  # the callback's first step: set-up and warm-up
    pairs = []
    tracked_factors = []
    first_with = next(i for i in range(n_steps) if arm_of(i, args.block))
    setup_cost = times[first_with] - statistics.median(
        t for i, t in enumerate(times[: 2 * args.block]) if not arm_of(i, args.block)
    )
    for p in range(n_pairs):
        steps = range(2 * args.block * p, 2 * args.block * (p + 1))
        without = [times[i] for i in steps if not arm_of(i, args.block)]
        with_ = [times[i] for i in steps if arm_of(i, args.block) and i not in tracked]
        ref = statistics.median(without)
        if p >= args.skip_pairs:
            pairs.append(statistics.median(with_) / ref)
        # every tracked step but the callback's first counts towards k, in whichever pair it falls
        tracked_factors += [times[i] / ref for i in steps if i in tracked and i != first_tracked]
    measured = range(2 * args.block * args.skip_pairs, 2 * args.block * n_pairs)
    sum_with = sum(times[i] for i in measured if arm_of(i, args.block))
    sum_without = sum(times[i] for i in measured if not arm_of(i, args.block))
    ordinary = statistics.median(pairs)
    k = statistics.median(tracked_factors) if tracked_factors else float("nan")
    step_without = statistics.median(times[i] for i in measured if not arm_of(i, args.block))
    hooks = [gate.hook_time[i] for i in measured if arm_of(i, args.block) and i not in tracked]
    hook_frac = statistics.median(hooks) / step_without
    return {
        "pairs": pairs,
        "n_pairs": n_pairs,
        "ordinary": ordinary,
        "k": k,
        "n_tracked": len(tracked_factors),
        "every": every,
        "end_to_end": ordinary + (k - 1.0) / every,
        "composed": hook_frac + (k - 1.0) / every,
        "hook_frac": hook_frac,
        "hook_ms": statistics.median(hooks) * 1e3,
        "block_sum": sum_with / sum_without,
        "step_ms": step_without * 1e3,
        "setup_s": setup_cost,
        "wall_s": wall,
        "source": str(callback.report.run.get("estimate_source")),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=120, help="block pairs (one without, one with)")
    parser.add_argument("--block", type=int, default=2, help="steps per block")
    parser.add_argument("--skip-pairs", type=int, default=4, help="first pairs dropped (warm-up, set-up)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--max-seconds", type=float, default=150.0, help="stop the fit at the first pair boundary after this"
    )
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.pairs <= args.skip_pairs:
        parser.error(f"--pairs={args.pairs} must exceed --skip-pairs={args.skip_pairs}")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import logging
    import tempfile

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    with tempfile.TemporaryDirectory() as tmp:
        r = run(args, Path(tmp))
    load_after = os.getloadavg() if hasattr(os, "getloadavg") else None
    pairs = r["pairs"]
    load = (
        f"load average (1/5/15 min) before {', '.join(f'{x:.2f}' for x in load_before)}, after "
        f"{', '.join(f'{x:.2f}' for x in load_after)} on {os.cpu_count()} CPUs"
        if load_before and load_after else "load average unknown"
    )
    lines = [
        f"# MemoryPlanCallback overhead ({platform.node()}, {datetime.date.today()}, torch {torch.__version__}, "
        f"{args.threads} thread)",
        "",
        f"Model: zoo GPT-2 layout, L={args.layers}, h={args.hidden}, V={args.vocab}; batch {args.micro_batch} x "
        f"{args.seq_len}; one fit of {r['n_pairs'] * 2 * args.block} steps: {r['n_pairs']} pairs of {args.block}-step "
        f"blocks without/with the callback (order alternating per pair; first {args.skip_pairs} pairs dropped); "
        f"callback at default settings; {load}; fit wall time {r['wall_s']:.0f} s.",
        "",
        "| statistic | value |",
        "| --- | --- |",
        f"| median step without the callback (ms) | {r['step_ms']:.2f} |",
        f"| ordinary-step ratio with/without, median of {len(pairs)} pairs | {r['ordinary']:.4f} |",
        f"| its spread: 25th-75th percentile | {_quantile(pairs, 0.25):.4f} - {_quantile(pairs, 0.75):.4f} |",
        f"| its spread: min - max | {min(pairs):.4f} - {max(pairs):.4f} |",
        f"| tracked step / its pair's median step without (median of {r['n_tracked']}; the first one, "
        f"with the set-up, left out) | {r['k']:.3f} |",
        f"| time inside the callback's step hooks (median per ordinary step) | {r['hook_ms']:.3f} ms = "
        f"{r['hook_frac']:.3%} |",
        f"| block-sum ratio (all with / all without, tracked steps included) | {r['block_sum']:.4f} |",
        f"| composed overhead: hooks + (k - 1) / {r['every']} | {r['composed']:.3%} |",
        f"| one-time cost in the callback's first step (inference, calibration, first tracked step) | "
        f"{r['setup_s']:.2f} s |",
        "",
        f"Estimate source: {r['source']}. The pair ratios cancel load shared by both arms; the hook time is the "
        "callback's own cost measured directly; both give the per-step overhead, the first including "
        "effects outside the hooks (allocator, cache).",
        "",
        f"**End-to-end step-time ratio with/without: {r['end_to_end']:.4f} ({r['end_to_end'] - 1:+.2%})** "
        f"= ordinary {r['ordinary']:.4f} (pairs IQR {_quantile(pairs, 0.25):.4f}-{_quantile(pairs, 0.75):.4f}) "
        f"+ tracked ({r['k']:.2f} - 1) / {r['every']}",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / f"{platform.node() or 'machine'}_{datetime.date.today()}_callback.md"
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
