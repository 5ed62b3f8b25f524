"""A resumed run never dies in the package (issue 36): ``trainer.fit(ckpt_path=...)`` from a checkpoint whose
MemoryPlanCallback state was tampered with, comes from another run or from another version finishes, with
one warning naming the field dropped; a ``warned`` record pasted from another run does not silence this
run's headroom warning. The Fabric monitor, the batch-size finder and memplan_auto's stored plan follow the
same rule."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from test_callback_helpers import LitGPT, make_trainer, token_loader

from lightning_memplan.callbacks import MemoryPlanBatchSizeFinder, MemoryPlanCallback
from lightning_memplan.report.io import load_report
from lightning_memplan.report.records import RankAccumulator
from lightning_memplan.testing.zoo import gpt2_style

CONFIG = gpt2_style()


def _fit(root: Path, *, ckpt_path: str | None = None, max_epochs: int = 1, **options: Any) -> tuple[Any, list[str]]:
    torch.manual_seed(0)
    cb = MemoryPlanCallback(calibrate=False, print_report=False, **options)
    ckpt = ModelCheckpoint(dirpath=root / "ckpt", save_last=True)
    trainer = make_trainer(root, [cb, ckpt], max_epochs=max_epochs, limit_train_batches=2, enable_checkpointing=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(LitGPT(CONFIG), token_loader(CONFIG, 2, [16], 2), ckpt_path=ckpt_path)
    return trainer, [str(w.message) for w in caught]


def _tamper(path: Path, change: Any) -> None:
    checkpoint = torch.load(path, weights_only=False)
    key = next(k for k in checkpoint["callbacks"] if k.startswith("MemoryPlanCallback"))
    change(checkpoint["callbacks"][key])
    torch.save(checkpoint, path)


def _no_rank(state: dict[str, Any]) -> None:
    acc = RankAccumulator(rank=0, epoch=1, backend="cpu").to_dict()
    del acc["rank"]
    state["accumulator"] = acc


TAMPERED = {
    "batches_seen=-5": (lambda s: s.update(batches_seen=-5), "'batches_seen'"),
    "batches_seen-string": (lambda s: s.update(batches_seen="12"), "'batches_seen'"),
    "warned-int": (lambda s: s.update(warned=5), "'warned'"),
    "accumulator-missing-key": (_no_rank, "'accumulator' (missing key 'rank')"),
    "report-newer-format": (lambda s: s["report"].update(format_version=99), "'report'"),
    "not-a-dict": (lambda s: (s.clear(), s.update(report=[1, 2])), "'report'"),
}


@pytest.mark.parametrize("case", list(TAMPERED))
def test_a_tampered_callback_state_is_dropped_with_one_warning_and_the_run_goes_on(tmp_path, case):
    change, field = TAMPERED[case]
    _fit(tmp_path)
    last = tmp_path / "ckpt" / "last.ckpt"
    _tamper(last, change)
    trainer, messages = _fit(tmp_path, ckpt_path=str(last), max_epochs=2)
    dropped = [m for m in messages if "load_state_dict" in m]
    assert len(dropped) == 1 and field in dropped[0] and "the run goes on" in dropped[0], messages
    resumed = load_report(trainer.log_dir)  # the run finished and wrote a readable report
    assert resumed.epochs[-1].epoch == 1 and all(e.ranks[0].worst_step >= 0 for e in resumed.epochs)


def test_a_warned_record_from_another_run_does_not_silence_the_headroom_warning(tmp_path):
    _fit(tmp_path / "a", min_headroom=0.999)  # run A warned about headroom
    state_a = torch.load(tmp_path / "a" / "ckpt" / "last.ckpt", weights_only=False)["callbacks"]
    warned_a = next(v for k, v in state_a.items() if k.startswith("MemoryPlanCallback"))["warned"]
    _fit(tmp_path / "b", min_headroom=0.0)  # run B never did
    last = tmp_path / "b" / "ckpt" / "last.ckpt"
    _tamper(last, lambda s: s.update(warned=warned_a))
    _, messages = _fit(tmp_path / "b", ckpt_path=str(last), max_epochs=2, min_headroom=0.999)
    assert any("is below min_headroom=" in m for m in messages), messages
    assert any("'warned'" in m and "another run" in m for m in messages), messages


def test_the_fabric_monitor_restores_only_valid_counters():
    from lightning.fabric import Fabric

    from lightning_memplan.fabric import MemoryMonitor
    from lightning_memplan.testing.zoo import GPT

    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = fabric.setup(model, optimizer)
    monitor = MemoryMonitor(fabric, model, optimizer, loss_fn=lambda m, b: m(b).sum(), print_report=False,
                            write_files=False)
    state = {**monitor.state_dict(), "epoch": "3", "optimizer_steps": -1}
    with pytest.warns(UserWarning, match=r"'epoch'.*'optimizer_steps'") as caught:
        monitor.load_state_dict(state)
    assert len([w for w in caught if "load_state_dict" in str(w.message)]) == 1
    assert monitor.state_dict()["epoch"] == 0 and monitor.state_dict()["optimizer_steps"] == 0
    monitor.load_state_dict({**monitor.state_dict(), "epoch": 3})  # a valid one is restored, silently
    assert monitor.state_dict()["epoch"] == 3


@pytest.mark.parametrize("value", ["big", -1, 2.5, True, [4]])
def test_the_finder_drops_a_batch_size_that_is_not_one(value):
    finder = MemoryPlanBatchSizeFinder(memory_budget=2**30)
    with pytest.warns(UserWarning, match="optimal_batch_size"):
        finder.load_state_dict({"optimal_batch_size": value})
    assert finder.optimal_batch_size is None
    finder.load_state_dict({"optimal_batch_size": 8})
    assert finder.optimal_batch_size == 8


@pytest.mark.parametrize(
    "entry",
    [{"plan": {"dp": "two"}}, {"plan": [1, 2]}, "a string", {"plan": {"dp": 2, "bogus": 1}}],
    ids=["bad-dp", "plan-list", "entry-string", "unknown-key"],
)
def test_a_stored_plan_memplan_auto_cannot_use_is_a_warning_and_none(tmp_path, entry):
    from lightning_memplan.parallel.record import CHECKPOINT_KEY, stored_plan

    path = tmp_path / "tampered.ckpt"
    torch.save({"state_dict": {}, CHECKPOINT_KEY: entry}, path)
    with pytest.warns(UserWarning, match="stored plan this run cannot use"):
        assert stored_plan(path) is None


def test_a_stored_plan_for_another_world_size_is_not_forced():
    from lightning_memplan.model.specs import ParallelPlan
    from lightning_memplan.parallel.record import checkpoint_plan

    entry = {"plan": ParallelPlan(dp=8).to_dict()}
    assert checkpoint_plan(entry, "x", world_size=8) == ParallelPlan(dp=8)
    with pytest.warns(UserWarning, match="needs 8 processes, this run has 2"):
        assert checkpoint_plan(entry, "x", world_size=2) is None
