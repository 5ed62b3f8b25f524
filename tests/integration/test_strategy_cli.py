"""memplan_auto under LightningCLI with an ordinary DataModule (its data built in ``setup``).

Before: planning ran in ``setup_environment``, before the DataModule's ``setup``, so ``fit`` failed with
``BatchShapeUnknown``; and a ``train:`` block in the config replaced every other TrainSpec field by its
default (the plan said bf16-mixed on a 32-true run). Now the plan is made after the setup hooks, the batch
shape is read from the DataModule's first batch, and precision, accumulation and optimizer come from the
Trainer and ``configure_optimizers`` unless the ``train:`` block sets them.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_memplan.testing.zoo import GPT, GPTConfig, causal_lm_loss

pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse")

VOCAB, SEQ, BATCH = 64, 16, 4


class TokenData(L.LightningDataModule):
    """Datasets exist only after ``setup`` (the usual DataModule pattern)."""

    def __init__(self, batch_size: int = BATCH, seq_len: int = SEQ) -> None:
        super().__init__()
        self.batch_size, self.seq_len = batch_size, seq_len
        self.train_set: TensorDataset | None = None

    def setup(self, stage: str) -> None:
        tokens = torch.randint(0, VOCAB, (8 * self.batch_size, self.seq_len + 1), generator=torch.Generator().manual_seed(0))
        self.train_set = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "setup() has not run"
        return DataLoader(self.train_set, batch_size=self.batch_size)


class SGDLM(L.LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.model = GPT(GPTConfig(VOCAB, 2, 32, 4, max_positions=SEQ))

    def training_step(self, batch, batch_idx):
        return causal_lm_loss(self.model, *batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _cli(tmp_path, *extra: str):
    from lightning.pytorch.cli import LightningCLI

    import lightning_memplan  # noqa: F401  (registers "memplan_auto")

    args = [
        "fit", "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.max_steps=2",
        "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={tmp_path}", *extra,
    ]
    return LightningCLI(SGDLM, TokenData, args=args, save_config_kwargs={"overwrite": True})


def test_cli_plans_after_the_datamodule_setup(tmp_path):
    cli = _cli(tmp_path, "--trainer.strategy=memplan_auto", "--trainer.precision=32-true")
    train = cli.trainer.strategy.decision.train
    assert (train.micro_batch, train.seq_len) == (BATCH, SEQ)  # read from the DataModule's first batch
    assert train.precision == "32-true"
    assert train.optimizer == "sgd"  # from configure_optimizers, not the AdamW default
    assert cli.trainer.global_step == 2


def test_cli_train_block_overrides_only_the_fields_it_sets(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  strategy:\n"
        "    class_path: lightning_memplan.MemplanAutoStrategy\n"
        "    init_args:\n"
        "      train:\n"
        "        micro_batch: 4\n"
        "        seq_len: 16\n"
    )
    cli = _cli(tmp_path, f"--config={config}", "--trainer.precision=32-true", "--trainer.accumulate_grad_batches=2")
    strategy = cli.trainer.strategy
    train = strategy.decision.train
    assert train.seq_len == 16  # what the block set
    # the planner may trade micro-batch for accumulation steps; the block's 4 x the Trainer's 2 is kept
    assert train.micro_batch * train.grad_accumulation == 4 * 2
    assert train.precision == "32-true"  # TrainSpec's default is bf16-mixed: taken from the Trainer
    assert train.optimizer == "sgd"
    assert train.device == "cpu" and train.optimizer_impl == "for_loop"
