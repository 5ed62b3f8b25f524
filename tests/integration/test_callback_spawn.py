"""MemoryPlanCallback under ``strategy="ddp_spawn"`` (2 gloo processes on the CPU): the hooks run in
the children, on copies of the callback, and the parent's ``callback.report`` holds both ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_callback_helpers import LitGPT, make_trainer, token_loader

from lightning_memplan.callbacks import MemoryPlanCallback
from lightning_memplan.monitoring.handoff import handoff_path
from lightning_memplan.testing.zoo import gpt2_style


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_spawn_report_comes_back_to_the_parent(tmp_path):
    torch.manual_seed(0)
    config = gpt2_style(n_layers=1)
    cb = MemoryPlanCallback(calibrate=False, print_report=False, measure_every_n_steps=1)
    trainer = make_trainer(tmp_path, [cb], max_epochs=2, limit_train_batches=2, strategy="ddp_spawn", devices=2)
    trainer.fit(LitGPT(config), token_loader(config, 2, [16], 2))
    report = cb.report
    assert [e.epoch for e in report.epochs] == [0, 1]
    assert [r.rank for r in report.epochs[-1].ranks] == [0, 1]
    assert all(r.steps == 2 and r.measured_peak for r in report.epochs[-1].ranks)
    assert report.run["world_size"] == 2 and report.run["plan"]["dp"] == 2
    # the same report rank 0 wrote to its log folder, and the hand-off file is gone once read
    written = json.loads((Path(tmp_path) / "run" / "version_0" / "memory_report.json").read_text())
    assert written["epochs"] == report.to_dict()["epochs"]
    assert not handoff_path(cb._handoff_token).exists()
