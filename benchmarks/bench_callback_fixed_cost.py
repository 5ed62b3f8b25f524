"""Benchmark: the fixed cost of ``MemoryPlanCallback``: a whole short fit with vs without it, same process.

``bench_callback_overhead.py`` measures the per-step cost (the <= 1 % promise); this one measures what a
short fit pays once: spec inference and calibration at the first step, the report at each epoch end
and at the end of the fit. A ``Trainer.fit`` of ``--steps`` training steps (200) of a small GPT (the zoo's
GPT-2 layout) on the CPU with one thread runs with ``MemoryPlanCallback()`` at its defaults (every report
file written: JSON and Markdown at each epoch end, HTML and PNG at the end of the fit) and without it,
the two arms alternating in one process (A B, B A, ...) for ``--pairs`` pairs, so a load change from other
processes hits both alike. Reported: each pair's ``with / without`` wall-time ratio of ``trainer.fit``, their
median (the number the <= 1.10 goal is about), and where the callback's time went (its own hooks, timed
in the fits with it: the first step, the epoch ends, the end of the fit).

Models (``--model``): ``tiny`` (L=2, h=64, V=512, batch 4 x 32: about 6 ms a step on an idle core) and
``small`` (L=4, h=128, V=2048, batch 8 x 64: about 25 ms). Both run with ``--epochs`` epochs (1 and 4 in
the results: 4 epochs of 50 steps pay four epoch ends).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/bench_callback_fixed_cost.py                  # small, 1 and 4 epochs
    OMP_NUM_THREADS=1 python benchmarks/bench_callback_fixed_cost.py --model tiny --pairs 5 --no-write
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_memplan.callbacks import MemoryPlanCallback  # noqa: E402
from lightning_memplan.testing.zoo import GPT, gpt2_style  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
#: (layers, hidden, vocab, micro-batch, sequence length) of each model.
MODELS = {"tiny": (2, 64, 512, 4, 32), "small": (4, 128, 2048, 8, 64)}
#: The callback's hooks whose time is reported (each wraps its own call).
_TIMED = ("setup", "on_train_batch_start", "on_train_batch_end", "on_train_epoch_end", "on_fit_end", "teardown")


class _LM(L.LightningModule):
    def __init__(self, model: str) -> None:
        super().__init__()
        layers, hidden, vocab, _, _ = MODELS[model]
        self.model = GPT(gpt2_style(vocab_size=vocab, n_layers=layers, hidden=hidden, n_heads=4, max_positions=128))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        return torch.nn.functional.cross_entropy(self.model.logits(self.model(idx)).flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _loader(model: str, steps: int) -> DataLoader:
    _, _, vocab, b, s = MODELS[model]
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab, (steps * b, s + 1), generator=gen)
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=b)


class _Timed(MemoryPlanCallback):
    """The callback at its defaults, each hook of :data:`_TIMED` timed (``times[hook]``, seconds per call)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: dict[str, list[float]] = defaultdict(list)
        for name in _TIMED:
            setattr(self, name, self._timed(name, getattr(self, name)))

    def _timed(self, name: str, hook: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                self.times[name].append(time.perf_counter() - start)

        return timed


def fit_once(model: str, steps: int, epochs: int, with_callback: bool) -> tuple[float, dict[str, list[float]]]:
    """One seeded fit; ``(wall seconds of trainer.fit, the callback's hook times)``."""
    torch.manual_seed(0)
    callback = _Timed() if with_callback else None
    with tempfile.TemporaryDirectory(prefix="memplan_fixed_") as root:
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_epochs=epochs, limit_train_batches=steps // epochs,
            default_root_dir=root, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, callbacks=[callback] if callback else [],
        )
        module, loader = _LM(model), _loader(model, steps // epochs)
        start = time.perf_counter()
        trainer.fit(module, loader)
        wall = time.perf_counter() - start
        if callback is not None:
            files = sorted(p.name for p in Path(root).iterdir() if p.name.startswith("memory_report."))
            assert files == ["memory_report.html", "memory_report.json", "memory_report.md", "memory_report.png"], files
    return wall, dict(callback.times) if callback else {}


def run(model: str, steps: int, epochs: int, pairs: int) -> dict[str, Any]:
    fit_once(model, 20, 1, False)  # warm-up: imports, allocator, first-call costs of both arms
    fit_once(model, 20, 1, True)
    ratios, walls, hooks = [], {True: [], False: []}, defaultdict(list)
    for i in range(pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        wall: dict[bool, float] = {}
        for arm in order:
            wall[arm], times = fit_once(model, steps, epochs, arm)
            walls[arm].append(wall[arm])
            for name, values in times.items():
                hooks[name].append(values)
        ratios.append(wall[True] / wall[False])
        print(f"  pair {i}: without {wall[False]:.2f} s, with {wall[True]:.2f} s, ratio {ratios[-1]:.3f}", flush=True)
    return {"ratios": ratios, "walls": walls, "hooks": hooks}


def _hook_lines(hooks: dict[str, list[list[float]]]) -> list[str]:
    """Median per fit of: the first step's hook, the other steps' hooks, the epoch ends, the end of the fit."""
    def med(values: list[float]) -> float:
        return statistics.median(values) if values else 0.0

    first = med([v[0] for v in hooks.get("on_train_batch_start", []) if v])
    rest = med([sum(v[1:]) for v in hooks.get("on_train_batch_start", [])]) + med([sum(v) for v in hooks.get("on_train_batch_end", [])])
    epochs = med([sum(v) for v in hooks.get("on_train_epoch_end", [])])
    end = med([sum(v) for v in hooks.get("on_fit_end", [])]) + med([sum(v) for v in hooks.get("teardown", [])])
    return [
        f"| first step (spec inference, calibration, first tracked step) | {first:.3f} |",
        f"| every other step's hooks, summed | {rest:.3f} |",
        f"| epoch ends (JSON, Markdown, table, metrics), summed | {epochs:.3f} |",
        f"| end of the fit (HTML, PNG; writer joined) | {end:.3f} |",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    sections = []
    for epochs in args.epochs:
        load = os.getloadavg() if hasattr(os, "getloadavg") else None
        print(f"{args.model}: {args.steps} steps in {epochs} epoch(s), {args.pairs} pairs; load {load}", flush=True)
        result = run(args.model, args.steps, epochs, args.pairs)
        load_after = os.getloadavg() if hasattr(os, "getloadavg") else None
        ratios = sorted(result["ratios"])
        median = statistics.median(ratios)
        without, with_ = statistics.median(result["walls"][False]), statistics.median(result["walls"][True])
        print(f"  median ratio {median:.3f} (min {ratios[0]:.3f}, max {ratios[-1]:.3f})", flush=True)
        sections.append("\n".join([
            f"## {args.steps} steps in {epochs} epoch(s)",
            "",
            f"Load average (1, 5, 15 min) before {load}, after {load_after}, on {os.cpu_count()} CPUs.",
            "",
            "| arm | median wall time of trainer.fit (s) |",
            "| --- | --- |",
            f"| without the callback | {without:.3f} |",
            f"| with MemoryPlanCallback() | {with_:.3f} |",
            "",
            f"Pair ratios (with / without): {', '.join(f'{r:.3f}' for r in result['ratios'])}; "
            f"**median {median:.3f}** (min {ratios[0]:.3f}, max {ratios[-1]:.3f}).",
            "",
            "| where the callback's time went (median per fit) | seconds |",
            "| --- | --- |",
            *_hook_lines(result["hooks"]),
            "",
        ]))
    if not args.no_write:
        layers, hidden, vocab, b, s = MODELS[args.model]
        header = (f"# MemoryPlanCallback fixed cost ({platform.node() or 'machine'}, {datetime.date.today()}, torch "
                  f"{torch.__version__}, 1 thread)\n\nModel `{args.model}`: zoo GPT-2 layout, L={layers}, h={hidden}, "
                  f"V={vocab}; batch {b} x {s}; {args.pairs} pairs, arms alternating in one process.\n\n")
        RESULTS.mkdir(parents=True, exist_ok=True)
        path = RESULTS / f"{platform.node() or 'machine'}_{datetime.date.today()}_callback_fixed_cost_{args.model}.md"
        path.write_text(header + "\n".join(sections))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
