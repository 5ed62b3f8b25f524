"""Train a small GPT on real text with all three parts of lightning_memplan.

- ``MemoryPlanCallback()`` estimates and measures memory every step and prints the memory report at the
  end of each epoch (files in the run's log dir: memory_report.json / .md / .png);
- ``strategy="memplan_auto"`` plans the layout for the devices you give it and applies it;
- ``LinearCrossEntropy`` computes the loss in chunks, so the [B, S, V] logits never exist.

The text is the docstrings of Python's standard library and of the installed packages (real English,
on every machine, no download); the tokenizer is built from it on the spot with a 16K vocabulary, large
enough that the logits matter.

    python examples/gpt/train.py                       # CPU, about two minutes
    python examples/gpt/train.py --accelerator gpu --devices 8 --hidden 2048 --layers 24 \\
        --heads 16 --seq-len 4096 --batch-size 4 --vocab-size 32768 --precision bf16-mixed
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

import lightning_memplan  # noqa: F401  (registers strategy="memplan_auto")
from lightning_memplan import LinearCrossEntropy, MemoryPlanCallback
from lightning_memplan.testing.text import TokenWindows, WordTokenizer, offline_corpus
from lightning_memplan.testing.zoo import GPT, GPTConfig


class GPTLanguageModel(L.LightningModule):
    """A GPT whose loss never builds the logits: hidden states go straight into LinearCrossEntropy."""

    def __init__(self, config: GPTConfig, lr: float = 3e-3, loss_chunk_size: int | str = "auto") -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["config"])
        self.config = config
        self.model = GPT(config)
        # shift=True: position t predicts token t+1, so the batch is both input and target.
        self.loss_fn = LinearCrossEntropy(shift=True, chunk_size=loss_chunk_size)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        hidden = self.model(batch)
        loss = self.loss_fn(hidden, self.model.lm_head.weight, batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/ppl", torch.exp(loss.detach()), prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps-per-epoch", type=int, default=150, help="limit_train_batches (0 = whole corpus)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=16384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--corpus-chars", type=int, default=3_000_000)
    p.add_argument("--loss-chunk-size", default="auto", help="tokens per loss chunk, or 'auto'")
    p.add_argument("--measure-every-n-steps", type=int, default=50)
    p.add_argument("--memory-budget-gib", type=float, default=None, help="plan for a device of this size")
    p.add_argument("--out-dir", default="lightning_logs_gpt")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    L.seed_everything(args.seed, verbose=False)
    t0 = time.perf_counter()
    text = offline_corpus(args.corpus_chars)
    tokenizer = WordTokenizer.train(text, args.vocab_size)
    tokens = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    print(
        f"corpus: {len(text):,} characters of Python docstrings -> {tokens.numel():,} tokens, "
        f"vocabulary {tokenizer.vocab_size:,} ({time.perf_counter() - t0:.1f} s)"
    )
    config = GPTConfig(
        tokenizer.vocab_size, args.layers, args.hidden, args.heads,
        position_embedding="learned", max_positions=max(args.seq_len, 128),
    )
    chunk = args.loss_chunk_size if args.loss_chunk_size == "auto" else int(args.loss_chunk_size)
    module = GPTLanguageModel(config, lr=args.lr, loss_chunk_size=chunk)
    loader = DataLoader(TokenWindows(tokens, args.seq_len), batch_size=args.batch_size, shuffle=True, drop_last=True)

    strategy: object = "memplan_auto"
    if args.memory_budget_gib is not None:
        strategy = lightning_memplan.MemplanAutoStrategy(memory_budget=int(args.memory_budget_gib * 2**30))
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=strategy,
        precision=args.precision,
        max_epochs=args.epochs,
        limit_train_batches=args.steps_per_epoch or 1.0,
        log_every_n_steps=5,
        logger=CSVLogger(args.out_dir, name="gpt"),
        callbacks=[RichProgressBar(), MemoryPlanCallback(measure_every_n_steps=args.measure_every_n_steps, units="MiB")],
        enable_checkpointing=False,
    )
    n_params = sum(p.numel() for p in module.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, logits per step would be "
          f"{args.batch_size * args.seq_len * tokenizer.vocab_size * 4 / 2**20:.0f} MiB in fp32")
    trainer.fit(module, loader)
    log_dir = trainer.log_dir or args.out_dir  # a collective (broadcast from rank 0): every rank calls it
    if trainer.is_global_zero:
        loss = trainer.callback_metrics.get("train/loss")
        if loss is not None:
            print(f"final train loss {float(loss):.3f} (perplexity {math.exp(float(loss)):.1f}); "
                  f"uniform guess would be {math.log(tokenizer.vocab_size):.3f}")
        print(f"memory report files: {os.path.join(log_dir, 'memory_report.*')}")
        print(f"total wall time {time.perf_counter() - t0:.0f} s")
    if torch.distributed.is_initialized():
        # Multi-process runs: close the process group before the interpreter exits, or gloo's threads
        # can still be joinable at shutdown ("terminate called without an active exception", SIGABRT).
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
