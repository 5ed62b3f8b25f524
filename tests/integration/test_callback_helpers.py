"""Shared tiny LightningModules, datasets and a Trainer factory for the MemoryPlanCallback tests.

Kept in a module of its own (no tests here) so the single-device, DDP and docs tests use the same
models; the DDP test's worker imports it in the spawned processes.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, IterableDataset

from lightning_memplan.testing.zoo import GPT, GPTConfig, gpt2_style

__all__ = ["LitGPT", "VariableLengthBatches", "make_trainer", "read_metrics", "token_loader"]


class LitGPT(L.LightningModule):
    """The zoo GPT trained with next-token cross-entropy; ``fail_at=(epoch, batch_idx)`` raises a
    simulated out-of-memory error inside that step's forward."""

    def __init__(
        self, config: GPTConfig | None = None, *, fail_at: tuple[int, int] | None = None, lr: float = 1e-3
    ):
        super().__init__()
        self.model = GPT(config or gpt2_style())
        self.fail_at = fail_at
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        hidden = self.model(idx)
        if self.fail_at == (self.current_epoch, batch_idx):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
        return torch.nn.functional.cross_entropy(self.model.logits(hidden).flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class VariableLengthBatches(IterableDataset):
    """Ready-made ``(idx, targets)`` batches cycling through ``seq_lens``; no ``__len__`` (an iterable
    dataset of unknown length)."""

    def __init__(self, vocab_size: int, micro_batch: int, seq_lens: Sequence[int], n_batches: int):
        self.vocab_size, self.micro_batch, self.seq_lens, self.n_batches = (
            vocab_size,
            micro_batch,
            list(seq_lens),
            n_batches,
        )

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(1234)
        for i in range(self.n_batches):
            s = self.seq_lens[i % len(self.seq_lens)]
            tokens = torch.randint(0, self.vocab_size, (self.micro_batch, s + 1), generator=gen)
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def token_loader(
    config: GPTConfig, micro_batch: int, seq_lens: Sequence[int], n_batches: int, **kw: Any
) -> DataLoader:
    return DataLoader(
        VariableLengthBatches(config.vocab_size, micro_batch, seq_lens, n_batches, **kw), batch_size=None
    )


def make_trainer(
    root: Path | str, callbacks: list, *, max_epochs: int = 1, limit_train_batches: int = 4, **kw: Any
) -> L.Trainer:
    """A quiet CPU Trainer logging to CSV in ``root`` every step."""
    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=max_epochs,
        limit_train_batches=limit_train_batches,
        logger=CSVLogger(str(root), name="run"),
        callbacks=callbacks,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    options.update(kw)
    return L.Trainer(**options)


def read_metrics(log_dir: str | Path) -> list[dict[str, str]]:
    """Rows of the CSVLogger's ``metrics.csv``."""
    with open(Path(log_dir) / "metrics.csv", newline="") as fh:
        return list(csv.DictReader(fh))
