"""Checkpoint and resume under memplan_auto: the resumed loss sequence equals an uninterrupted run's, and
the resumed run keeps the checkpoint's plan.

Each case trains 2 epochs of 2 steps with AdamW (so optimizer states must be restored too): once
uninterrupted, once stopped after epoch 1, saved by ``ModelCheckpoint(save_last=True)`` at the epoch end
(a distributed checkpoint folder written by ModelParallelStrategy's DCP path, plus the plan in its
metadata) and resumed with ``trainer.ckpt_path = ...``. Cases: FSDP (``dp=2, zero=3``: DTensor parameters) and PP
(``pp=2``: plain parameters, one stage per rank, each saving only its own blocks). The resumed run is
given a *different* strategy configuration (a generous budget that would plan plain DDP) and must
still apply the stored plan. Losses must agree to ``atol=1e-6`` (same arithmetic in both runs).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from test_strategy_parity import LossRecorder, TinyLM, make_trainer, token_data  # noqa: I001
from torch.utils.data import DataLoader, TensorDataset

from lightning_memplan.model.specs import ParallelPlan
from lightning_memplan.testing import run_distributed

PER_RANK_BATCH, STEPS_PER_EPOCH = 4, 2


def _loader(dp: int) -> DataLoader:
    x, y = token_data(PER_RANK_BATCH * dp * STEPS_PER_EPOCH)
    return DataLoader(TensorDataset(x, y), batch_size=PER_RANK_BATCH)


def _fit(strategy, loader, epochs, ckpt_path=None, recorder=None, checkpoint_dir=None):
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = TinyLM(optimizer="adamw", lr=1e-2)
    callbacks = [recorder] if recorder else []
    if checkpoint_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, save_last=True, save_top_k=0))
    trainer = make_trainer(strategy, steps=-1, max_epochs=epochs, callbacks=callbacks, enable_checkpointing=checkpoint_dir is not None)
    if ckpt_path is not None:
        trainer.ckpt_path = ckpt_path
    trainer.fit(module, loader)
    return trainer


def resume_worker(rank: int, world: int, root: str, plans: list[ParallelPlan]) -> list[dict]:
    return [resume_case(os.path.join(root, f"case{i}"), plan) for i, plan in enumerate(plans)]


def resume_case(root: str, plan: ParallelPlan) -> dict:
    from lightning_memplan.strategies import MemplanAutoStrategy

    full = LossRecorder()
    _fit(MemplanAutoStrategy(plan=plan), _loader(plan.dp), 2, recorder=full)

    first = LossRecorder()
    ckpt_dir = os.path.join(root, "ckpt")
    _fit(MemplanAutoStrategy(plan=plan), _loader(plan.dp), 1, recorder=first, checkpoint_dir=ckpt_dir)
    path = os.path.join(ckpt_dir, "last.ckpt")

    second = LossRecorder()
    resumed = MemplanAutoStrategy(memory_budget=2**30)  # would plan plain DDP if it planned afresh
    _fit(resumed, _loader(plan.dp), 2, ckpt_path=path, recorder=second)
    return {
        "full": full.losses,
        "first": first.losses,
        "second": second.losses,
        "resumed_plan": resumed.applied_plan,
        "resumed_source": resumed.decision.source,
        "is_dir": os.path.isdir(path),
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_matches_uninterrupted(tmp_path):
    plans = [ParallelPlan(dp=2, zero=3), ParallelPlan(pp=2, microbatches=2)]
    results = run_distributed(resume_worker, 2, str(tmp_path), plans)
    for r, plan in ((r, plan) for per_rank in results for r, plan in zip(per_rank, plans, strict=True)):
        assert r["is_dir"]  # a distributed checkpoint (one shard per rank), not a gathered file
        assert r["resumed_plan"] == dataclasses.replace(plan, grad_buckets=False) and r["resumed_source"] == "checkpoint"
        assert len(r["full"]) == 2 * STEPS_PER_EPOCH and len(r["second"]) == STEPS_PER_EPOCH
        torch.testing.assert_close(r["first"], r["full"][:STEPS_PER_EPOCH], atol=1e-6, rtol=0)
        torch.testing.assert_close(r["second"], r["full"][STEPS_PER_EPOCH:], atol=1e-6, rtol=0)
        assert r["full"][-1] != r["full"][STEPS_PER_EPOCH - 1]
