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


def _fit(strategy, loader, epochs, ckpt_path=None, recorder=None, checkpoint_dir=None, fit_ckpt_path=None):
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = TinyLM(optimizer="adamw", lr=1e-2)
    callbacks = [recorder] if recorder else []
    if checkpoint_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, save_last=True, save_top_k=0))
    trainer = make_trainer(strategy, steps=-1, max_epochs=epochs, callbacks=callbacks, enable_checkpointing=checkpoint_dir is not None)
    if ckpt_path is not None:
        trainer.ckpt_path = ckpt_path
    trainer.fit(module, loader, ckpt_path=fit_ckpt_path)
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
        # TinyLM's untied embedding and lm_head get FSDP2 units of their own wherever data parallelism applies
        units = ("embedding", "head") if plan.dp > 1 else ()
        assert r["resumed_plan"] == dataclasses.replace(plan, grad_buckets=False, own_units=units)
        assert r["resumed_source"] == "checkpoint"
        assert len(r["full"]) == 2 * STEPS_PER_EPOCH and len(r["second"]) == STEPS_PER_EPOCH
        torch.testing.assert_close(r["first"], r["full"][:STEPS_PER_EPOCH], atol=1e-6, rtol=0)
        torch.testing.assert_close(r["second"], r["full"][STEPS_PER_EPOCH:], atol=1e-6, rtol=0)
        assert r["full"][-1] != r["full"][STEPS_PER_EPOCH - 1]


class StateRecorder(LossRecorder):
    """Full parameters and AdamW ``exp_avg`` states (DTensors gathered), at the end of a fit and at the
    start of a resumed one: a resharded load must give back exactly what was saved."""

    def __init__(self, when: str) -> None:
        super().__init__()
        self.when, self.params, self.exp_avg = when, {}, {}

    def _record(self, trainer, pl_module):
        from test_strategy_parity import full_parameters
        from torch.distributed.tensor import DTensor

        self.params = full_parameters(pl_module)
        optimizer = trainer.optimizers[0]
        names = {id(p): n.replace("_checkpoint_wrapped_module.", "") for n, p in pl_module.named_parameters()}
        for p, state in optimizer.state.items():
            avg = state["exp_avg"]
            self.exp_avg[names[id(p)]] = (avg.full_tensor() if isinstance(avg, DTensor) else avg).detach().clone()

    def on_train_start(self, trainer, pl_module):
        if self.when == "start":
            self._record(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        if self.when == "end":
            self._record(trainer, pl_module)


def reshard_worker(rank: int, world: int, root: str, saved: ParallelPlan, resumed_plan: ParallelPlan) -> dict:
    import warnings

    from lightning_memplan.strategies import MemplanAutoStrategy

    ckpt_dir = os.path.join(root, "ckpt")
    before = StateRecorder("end")
    _fit(MemplanAutoStrategy(plan=saved), _loader(saved.dp), 1, recorder=before, checkpoint_dir=ckpt_dir)
    after = StateRecorder("start")
    strategy = MemplanAutoStrategy(memory_budget=2**30)  # plans afresh: fit(ckpt_path=) is not seen before setup
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(strategy, _loader(resumed_plan.dp), 2, ckpt_path=None, recorder=after, fit_ckpt_path=os.path.join(ckpt_dir, "last.ckpt"))
    return {
        "before": (before.params, before.exp_avg),
        "after": (after.params, after.exp_avg),
        "applied": strategy.applied_plan,
        "steps": len(after.losses),
        "epoch": trainer.current_epoch,
        "warnings": [str(w.message) for w in caught],
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_fit_ckpt_path_into_another_layout_reshards_and_warns(tmp_path):
    """``fit(ckpt_path=...)`` of a pp=2 checkpoint under a strategy that plans dp=2: Lightning reveals the
    path only after the layout is applied, so the checkpoint is loaded into the new layout. Before, both
    ranks died with ``CheckpointException: Missing key ... optimizer_0.param_groups.0.lr`` (the pipeline
    writes flattened optimizer keys); now it is resharded by the distributed checkpoint with the keys it
    was written with, with a warning, and every parameter and AdamW state comes back exactly."""
    saved, resumed = ParallelPlan(pp=2, microbatches=2), ParallelPlan(dp=2)
    results = run_distributed(reshard_worker, 2, str(tmp_path), saved, resumed, timeout_s=420)
    before_params = {k: v for r in results for k, v in r["before"][0].items()}
    before_avg = {k: v for r in results for k, v in r["before"][1].items()}
    assert any("was written under plan" in m and "reshard" in m for m in results[0]["warnings"]), results[0]["warnings"]
    for r in results:
        assert r["applied"].dp == 2 and r["applied"].pp == 1
        params, avg = r["after"]
        assert params.keys() == before_params.keys() and avg.keys() == before_avg.keys()
        for name, value in params.items():
            torch.testing.assert_close(value, before_params[name], atol=0, rtol=0, msg=name)
        for name, value in avg.items():
            torch.testing.assert_close(value, before_avg[name], atol=0, rtol=0, msg=name)
        assert r["steps"] == STEPS_PER_EPOCH and r["epoch"] == 2  # resumed at epoch 1, ran one more
