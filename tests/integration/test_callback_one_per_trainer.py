"""MemoryPlanCallback: one per Trainer (a second one is refused, saying why), and where the report goes
without a logger (said in one line; a second run in that folder is added, never in place of the first)."""

from __future__ import annotations

import logging

import pytest
import torch
from test_callback_helpers import LitGPT, make_trainer, token_loader

from lightning_memplan.callbacks import MemoryPlanCallback
from lightning_memplan.report import load_report
from lightning_memplan.testing.zoo import gpt2_style


def _quiet(**kw):
    return MemoryPlanCallback(calibrate=False, print_report=False, measure_every_n_steps=1, **kw)


def test_two_callbacks_of_one_class_stop_at_the_trainer(tmp_path):
    """Lightning itself refuses two stateful callbacks with one state_key; docs/callback.md says why."""
    with pytest.raises(RuntimeError, match="state_key"):
        make_trainer(tmp_path, [_quiet(), _quiet(units="MiB")])


def test_a_second_memory_plan_callback_is_refused_before_the_first_step(tmp_path):
    class MyCallback(MemoryPlanCallback):  # another class: Lightning's state_key check lets it through
        pass

    config = gpt2_style()
    first, second = _quiet(), MyCallback(calibrate=False, print_report=False)
    trainer = make_trainer(tmp_path, [first, second], limit_train_batches=2)
    with pytest.raises(ValueError, match="one MemoryPlanCallback per Trainer") as info:
        trainer.fit(LitGPT(config), token_loader(config, 2, [16], 2))
    assert "MyCallback" in str(info.value) and "memory_report" in str(info.value)
    assert first.report.epochs == () and second.report.epochs == ()  # nothing ran
    assert not list(tmp_path.rglob("memory_report.json"))


def test_without_a_logger_the_folder_is_named_and_a_second_run_is_kept(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)  # no default_root_dir: Lightning's default is the working folder
    config = gpt2_style()
    reports = []
    for seed in (0, 1):  # two Trainers, two callbacks: two separate fits in one folder
        torch.manual_seed(seed)
        cb = _quiet(units="MiB")
        trainer = make_trainer(tmp_path, [cb], limit_train_batches=2, logger=False)
        with caplog.at_level(logging.INFO):
            trainer.fit(LitGPT(config), token_loader(config, 2, [16 + 8 * seed], 2))
        reports.append(cb.report)
    said = [r.getMessage() for r in caplog.records if "default_root_dir" in r.getMessage()]
    assert len(said) == 2 and str(tmp_path) in said[0]  # one line per fit, naming the folder
    on_disk = load_report(tmp_path / "memory_report.json")
    assert [e.key for e in on_disk.epochs] == [(0, 0), (1, 0)]  # the second fit is run 1; run 0 is kept
    ids = [e.run_id for e in on_disk.epochs]
    assert ids[0] != ids[1] and all(ids)
    assert on_disk.epochs[0].ranks[0].shapes == ((2, 16),) and on_disk.epochs[1].ranks[0].shapes == ((2, 24),)
    assert on_disk.epochs[0].to_dict() == reports[0].epochs[0].to_dict()
    assert on_disk.run["units"] == "MiB"
