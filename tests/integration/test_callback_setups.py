"""MemoryPlanCallback in the setups people use besides the plain loop: manual optimization, loggers'
steps with gradient accumulation, messages in the chosen units, a missing matplotlib."""

from __future__ import annotations

from pathlib import Path

import torch
from test_callback_helpers import LitGPT, make_trainer, token_loader

from lightning_memplan.callbacks import MemoryPlanCallback
from lightning_memplan.testing.zoo import gpt2_style


class LitManual(LitGPT):
    """LitGPT optimising by hand, with the Trainer-backed calls such a step makes."""

    def __init__(self, config=None):
        super().__init__(config)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        idx, targets = batch
        loss = torch.nn.functional.cross_entropy(self.model.logits(self.model(idx)).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt.step()
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1)]


def _run(root, module, **cb_kwargs):
    config = gpt2_style(n_layers=1)
    cb = MemoryPlanCallback(measure_every_n_steps=2, print_report=False, write_files=False, **cb_kwargs)
    make_trainer(root, [cb], limit_train_batches=4).fit(module, token_loader(config, 2, [32], 4))
    return cb


def test_manual_optimization_is_calibrated_like_automatic(tmp_path):
    torch.manual_seed(0)
    manual = _run(tmp_path / "manual", LitManual(gpt2_style(n_layers=1)))
    assert manual.report.run["estimate_source"] == "calibrated", manual.report.notes
    assert not any("calibration" in n for n in manual.report.notes)
    torch.manual_seed(0)
    auto = _run(tmp_path / "auto", LitGPT(gpt2_style(n_layers=1)))
    rank_m, rank_a = manual.report.epochs[-1].ranks[0], auto.report.epochs[-1].ranks[0]
    # The same step in memory (forward, backward, AdamW), traced through manual_backward / opt.step.
    assert rank_m.estimated_peak == rank_a.estimated_peak
    assert rank_m.measured_to_estimated is not None and abs(rank_m.measured_to_estimated - 1) < 0.01
    steady = [t for t in rank_m.tracked if not t.warmup]
    assert steady and steady[0].estimated_phase_peaks.keys() == {"forward", "backward", "optimizer"}


class LitLogged(LitGPT):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss)
        return loss


def test_metrics_share_self_logs_steps_one_value_per_optimizer_step(tmp_path):
    """accumulate_grad_batches=2, 6 batches: 3 optimizer steps, logged at self.log's steps 0, 1, 2."""
    from test_callback_helpers import read_metrics

    config = gpt2_style(n_layers=1)
    cb = MemoryPlanCallback(measure_every_n_steps=1, calibrate=False, print_report=False, write_files=False)
    trainer = make_trainer(tmp_path, [cb], limit_train_batches=6, accumulate_grad_batches=2)
    trainer.fit(LitLogged(config), token_loader(config, 2, [16], 6))
    rows = read_metrics(trainer.log_dir)
    loss_steps = [int(r["step"]) for r in rows if r.get("loss")]
    memplan_steps = [int(r["step"]) for r in rows if r.get("memplan/estimated_peak")]
    assert loss_steps == [0, 1, 2]
    assert memplan_steps == loss_steps  # one row per optimizer step, no off-by-one
    ratios = {int(r["step"]): r["memplan/measured_to_estimated"] for r in rows if r.get("memplan/estimated_peak")}
    # step 0 (batches 0 and 1) ran before the first optimizer step finished: warm-up, not compared
    assert ratios[0] == "" and ratios[1] != "" and ratios[2] != ""
    # the logged peak of an optimizer step is the largest of its micro-batches
    tracked = {t.step: t for t in cb.report.epochs[-1].ranks[0].tracked}
    by_step = {int(r["step"]): int(r["memplan/measured_peak"]) for r in rows if r.get("memplan/measured_peak")}
    assert by_step[1] == max(tracked[2].measured_peak, tracked[3].measured_peak)
    epoch_rows = [int(r["step"]) for r in rows if r.get("memplan/epoch/ranks")]
    assert epoch_rows == [2]


def test_warnings_use_the_callbacks_units_and_honest_advice():
    from lightning_memplan.model.specs import ParallelPlan
    from lightning_memplan.monitoring.advice import forecast_message, headroom_message, mismatch_message
    from lightning_memplan.report.records import StepRecord

    mib = 2**20
    record = StepRecord(
        step=3, epoch=0, rank=0, micro_batch=2, seq_len=16, estimated_peak=3 * mib, measured_peak=int(3.4 * mib),
        device_memory=4 * mib, headroom=mib // 10, estimated_components={"activations": 2 * mib, "params": mib},
    )
    text = mismatch_message(record, 0.1, units="MiB", calibration="skipped")
    assert "3.400 MiB" in text and "3.000 MiB" in text and "GiB" not in text
    assert "keep calibrate" not in text and "calibration did not run" in text
    assert "calibrate=True" in mismatch_message(record, 0.1, units="MiB", calibration="off")
    assert "calibrate" not in mismatch_message(record, 0.1, units="MiB", calibration="calibrated")
    text = headroom_message(record, 0.1, ParallelPlan(), None, units="MiB")
    assert "0.100 MiB" in text and "4.000 MiB" in text and "GiB" not in text
    text = forecast_message(64, 5 * mib, 4 * mib, {"activations": 4 * mib}, ParallelPlan(), None, rank=0, units="MiB")
    assert "5.000 MiB" in text and "GiB" not in text


def test_missing_matplotlib_is_said_once_and_the_other_files_written(tmp_path, monkeypatch):
    import sys
    import warnings

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    config = gpt2_style(n_layers=1)
    cb = MemoryPlanCallback(calibrate=False, print_report=False)
    trainer = make_trainer(tmp_path, [cb], max_epochs=2, limit_train_batches=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(LitGPT(config), token_loader(config, 2, [16], 2))
    said = [w for w in caught if "matplotlib cannot be imported" in str(w.message)]
    assert len(said) == 1  # two epochs, said once
    assert any("matplotlib" in n for n in cb.report.notes)
    names = {p.name for p in Path(trainer.log_dir).iterdir()}
    assert "memory_report.json" in names and "memory_report.md" in names and "memory_report.png" not in names
