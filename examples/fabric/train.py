"""Pretrain a small GPT with a hand-written Lightning Fabric loop, litgpt style, watched by MemoryMonitor.

The loop has the shape of litgpt's ``pretrain.py`` (``fabric.launch``, ``fabric.setup``,
``fabric.setup_dataloaders``, gradient accumulation under ``fabric.no_backward_sync``, ``fabric.backward``)
and ``lightning_memplan.fabric.MemoryMonitor`` wraps each step: the memory estimate calibrated at the
first step, the measured peak per rank, warnings, and the memory report after each epoch
(memory_report.json / .md / .html / .png in the logger's folder).

The text is the docstrings of Python's standard library and of the installed packages (real English,
on every machine, no download), tokenized by a word-level tokenizer built on the spot.

    python examples/fabric/train.py                                # CPU, one process, about a minute
    python examples/fabric/train.py --devices 2                    # two gloo processes (DDP)
    python examples/fabric/train.py --devices 2 --strategy memplan_auto
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.fabric.loggers import CSVLogger
from torch.utils.data import DataLoader

import lightning_memplan  # noqa: F401  (registers Fabric(strategy="memplan_auto"))
from lightning_memplan import LinearCrossEntropy
from lightning_memplan.fabric import MemoryMonitor
from lightning_memplan.testing.text import TokenWindows, WordTokenizer, offline_corpus
from lightning_memplan.testing.zoo import GPT, GPTConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", choices=("auto", "ddp", "memplan_auto"), default="auto",
                   help="auto: one process on one device, DDP on several")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps-per-epoch", type=int, default=25, help="optimizer steps per epoch")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--corpus-chars", type=int, default=1_000_000)
    p.add_argument("--measure-every-n-steps", type=int, default=20)
    p.add_argument("--out-dir", default="fabric_logs")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    fabric = L.Fabric(
        accelerator=args.accelerator, devices=args.devices, strategy=args.strategy, precision=args.precision,
        loggers=CSVLogger(args.out_dir, name="fabric"),
    )
    fabric.launch()
    fabric.seed_everything(args.seed)

    text = offline_corpus(args.corpus_chars)
    tokenizer = WordTokenizer.train(text, args.vocab_size)
    tokens = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    fabric.print(f"corpus: {len(text):,} characters of Python docstrings -> {tokens.numel():,} tokens, "
                 f"vocabulary {tokenizer.vocab_size:,}")

    config = GPTConfig(tokenizer.vocab_size, args.layers, args.hidden, args.heads,
                       position_embedding="learned", max_positions=args.seq_len)
    with fabric.init_module():
        model = GPT(config)
    fabric.print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    # The loader first: strategy="memplan_auto" plans at fabric.setup from its batch shape.
    loader = fabric.setup_dataloaders(
        DataLoader(TokenWindows(tokens, args.seq_len), batch_size=args.micro_batch_size, shuffle=True, drop_last=True)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model, optimizer = fabric.setup(model, optimizer)
    # shift=True: position t predicts token t+1, so the batch is both input and target; the loss runs
    # over chunks of the hidden states, so the [B, S, V] logits never exist whole.
    chunked = LinearCrossEntropy(shift=True)

    def loss_fn(module: Any, batch: torch.Tensor) -> torch.Tensor:
        return chunked(module(batch), module.lm_head.weight, batch)

    # The calibration traces loss_fn on a fake copy of the module: the same step the loop runs.
    monitor = MemoryMonitor(
        fabric, model, optimizer, loss_fn=loss_fn, accumulate_grad_batches=args.grad_accum,
        measure_every_n_steps=args.measure_every_n_steps, units="MiB", log_every_n_steps=5,
    )

    step, loss_value = 0, float("nan")
    for epoch in range(args.epochs):
        for i, batch in enumerate(loader):
            if i >= args.steps_per_epoch * args.grad_accum:
                break
            is_accumulating = (i + 1) % args.grad_accum != 0
            with monitor.step(batch):
                with fabric.no_backward_sync(model, enabled=is_accumulating):
                    loss = loss_fn(model, batch)
                    fabric.backward(loss / args.grad_accum)
                if not is_accumulating:
                    optimizer.step()
                    optimizer.zero_grad()
            if not is_accumulating:
                step += 1
                loss_value = float(fabric.all_reduce(loss.detach(), reduce_op="mean"))
                fabric.log_dict({"train/loss": loss_value}, step=step)
        fabric.print(f"epoch {epoch}: {step} optimizer steps, train loss {loss_value:.3f}")
        report = monitor.end_epoch()
        for r in report.ranks:
            fabric.print(f"  rank {r.rank}: estimated peak {r.estimated_peak / 2**20:.3f} MiB, measured "
                         f"{r.measured_peak / 2**20:.3f} MiB (measured / estimated {r.measured_to_estimated:.3f})")
    fabric.print(f"final train loss {loss_value:.3f} (perplexity {math.exp(loss_value):.1f}); uniform guess "
                 f"would be {math.log(tokenizer.vocab_size):.3f}")
    monitor.close()  # the final report's pictures (memory_report.html, .png), drawn once at the end
    fabric.print(f"estimate source: {monitor.report.run['estimate_source']}; plan: {monitor.report.run['plan_description']}")
    fabric.print(f"memory report files: {os.path.join(monitor.log_dir, 'memory_report.*')}")
    fabric.print(f"total wall time {time.perf_counter() - t0:.0f} s")
    if torch.distributed.is_initialized():
        # Close the process group before the interpreter exits (gloo threads could abort at shutdown).
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
