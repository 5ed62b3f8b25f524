"""MemoryPlanBatchSizeFinder in a Trainer on one CPU device: the batch size is set before the first step,
no training step runs before it (no trial step), it equals ``max_micro_batch`` of the same specs, and every
measured step (steady-state training steps and validation steps, live tensor bytes by the project's
TensorTracker) stays within the budget."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_memplan import MemoryPlanBatchSizeFinder, ModelSpec, TrainSpec, max_micro_batch
from lightning_memplan.live import calibration_shapes
from lightning_memplan.testing.zoo import GPT, causal_lm_loss, gpt2_style
from lightning_memplan.tracking.trace import calibrate

SEQ, VOCAB = 64, 512
BUDGET = 8 * 2**20  # bytes: params + grads + AdamW states ~2.4 MB, each sequence ~0.6 MB at s=64


class CountingLM(L.LightningModule):
    """A zoo GPT whose dataloaders read ``self.batch_size``; counts training steps and forwards."""

    def __init__(self, batch_size: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(gpt2_style(max_positions=SEQ))
        self.batch_size = batch_size
        self.training_steps = 0
        self.forwards = 0  # every forward of the model, training or not
        self.trained_batch_sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        self.training_steps += 1
        self.trained_batch_sizes.append(int(batch[0].shape[0]))
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        return self._loss(batch)

    def _loss(self, batch):
        self.forwards += 1
        return causal_lm_loss(self.model, *batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def _loader(self) -> DataLoader:
        tokens = torch.randint(0, VOCAB, (4 * self.batch_size, SEQ + 1), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=self.batch_size)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        return self._loader()


class PeakMeter(L.Callback):
    """Live tensor bytes of each steady-state training step (from step 1) and each validation step."""

    def __init__(self) -> None:
        self.tracker = None
        self.peaks: dict[str, list[int]] = {"train": [], "val": []}

    def _start(self, trainer, pl_module, batch) -> None:
        from lightning_memplan.tracking import TensorTracker

        self.tracker = TensorTracker(pl_module, trainer.optimizers, seq_len=SEQ, vocab_size=VOCAB)
        self.tracker.start()
        self.tracker.track(batch, "other")

    def _stop(self, kind: str) -> None:
        if self.tracker is not None:
            self.tracker.stop()
            self.peaks[kind].append(self.tracker.report().total)
            self.tracker = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= 1:
            self._start(trainer, pl_module, batch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._stop("train")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._start(trainer, pl_module, batch)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self._stop("val")


def test_finder_sets_the_largest_fit_before_the_first_step(tmp_path, caplog) -> None:
    module = CountingLM()
    finder = MemoryPlanBatchSizeFinder(memory_budget=BUDGET)
    meter = PeakMeter()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, limit_val_batches=2, num_sanity_val_steps=0,
                        val_check_interval=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[finder, meter], default_root_dir=tmp_path)
    with caplog.at_level(logging.INFO):
        trainer.fit(module)
    spec = ModelSpec.from_module(module.model)
    train = TrainSpec(micro_batch=1, seq_len=SEQ, precision="32-true", optimizer="adamw", optimizer_impl="for_loop",
                      device="cpu")
    # the search ran on the module's calibrated estimate (issue 33): its trace at the first batch's shape
    calibration = calibrate(CountingLM(), calibration_shapes(1, SEQ, spec.dim_head),
                            input_fn=lambda b, s: tuple(torch.randint(0, VOCAB, (b, s)) for _ in range(2)),
                            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
    expected = max_micro_batch(spec, train, memory_budget=BUDGET, calibration=calibration)
    analytic = max_micro_batch(spec, train, memory_budget=BUDGET)  # the pure function, no module
    print(f"calibrated {expected}, analytic {analytic}")
    assert finder.calibration_note == "calibrated"
    assert 4 <= expected <= 20 and abs(analytic - expected) <= 2
    assert finder.optimal_batch_size == expected == module.batch_size
    # no trial step: exactly max_steps training steps and the 2 validation batches ran, all at the size set
    assert module.training_steps == 3 and module.forwards == 3 + 2
    assert module.trained_batch_sizes == [expected] * 3
    assert finder.fit_result is not None and finder.fit_result.binding_phase in ("forward", "backward", "optimizer")
    assert "MemoryPlanBatchSizeFinder: batch_size=" in caplog.text and "peak needs" in caplog.text
    assert meter.peaks["train"] and meter.peaks["val"]
    assert max(meter.peaks["train"] + meter.peaks["val"]) <= BUDGET, meter.peaks


def test_finder_sets_a_datamodule_attribute(tmp_path) -> None:
    class Data(L.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = 1

        def train_dataloader(self):
            tokens = torch.randint(0, VOCAB, (2 * self.batch_size, SEQ + 1))
            return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=self.batch_size)

    class Plain(CountingLM):
        train_dataloader = None  # type: ignore[assignment]
        val_dataloader = None  # type: ignore[assignment]

    data = Data()
    finder = MemoryPlanBatchSizeFinder(memory_budget=BUDGET, seq_len=SEQ)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[finder],
                        default_root_dir=tmp_path)
    module = Plain()
    del module.batch_size  # only the DataModule holds it
    trainer.fit(module, datamodule=data)
    assert data.batch_size == finder.optimal_batch_size >= 4


def test_finder_names_a_missing_attribute_and_bad_arguments(tmp_path) -> None:
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[MemoryPlanBatchSizeFinder(memory_budget=BUDGET, batch_arg_name="bs")])
    with pytest.raises(MisconfigurationException, match="batch_arg_name='bs'"):
        trainer.fit(CountingLM())
    for kwargs, error, match in (
        ({"memory_budget": 0}, ValueError, "memory_budget"),
        ({"memory_budget": "8GiB"}, TypeError, "memory_budget"),
        ({"headroom": 1.0}, ValueError, "headroom"),
        ({"headroom": True}, TypeError, "headroom"),
        ({"batch_arg_name": 3}, TypeError, "batch_arg_name"),
        ({"batch_arg_name": ""}, ValueError, "batch_arg_name"),
        ({"seq_len": 0}, ValueError, "seq_len"),
        ({"seq_len": 2.5}, TypeError, "seq_len"),
        ({"max_batch_size": True}, TypeError, "max_batch_size"),
        ({"plan": "ddp"}, TypeError, "plan"),
    ):
        with pytest.raises(error, match=match):
            MemoryPlanBatchSizeFinder(**kwargs)
    import numpy as np

    finder = MemoryPlanBatchSizeFinder(memory_budget=np.int64(BUDGET), headroom=np.float32(0.2), seq_len=np.int32(8))
    assert type(finder.memory_budget) is int and type(finder.seq_len) is int and type(finder.headroom) is float


def test_finder_says_when_nothing_fits(tmp_path) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        callbacks=[MemoryPlanBatchSizeFinder(memory_budget=2**20)])
    module = CountingLM()
    with pytest.raises(ValueError, match="not even a batch of 1 fits"):
        trainer.fit(module)
    assert module.training_steps == 0


# ------------------------------------------------------------------------------ the reserved margin (issue 26)
CUDA_TRAIN = TrainSpec(micro_batch=1, seq_len=SEQ, precision="32-true", optimizer="adamw", optimizer_impl="for_loop",
                       device="cuda")  # the step compared as a CUDA one: the margin applies (no CUDA here)


def _cuda_report():
    """A report as MemoryPlanCallback keeps it after a CUDA run at batch 4: allocated peak 5 MiB, reserved 6.5 MiB."""
    from lightning_memplan.report import EpochReport, MemoryReport, StepRecord, summarize_rank

    records = [StepRecord(step=i, epoch=0, rank=0, micro_batch=4, seq_len=SEQ, measured_peak=5 * 2**20 - i,
                          reserved=6 * 2**20 + 2**19, backend="cuda", measurement="cuda_allocator") for i in range(3)]
    epoch = EpochReport(epoch=0, ranks=(summarize_rank(records, rank=0, epoch=0, backend="cuda"),))
    return MemoryReport(run={"expandable_segments": False}, epochs=(epoch,))


def _trainer(tmp_path, callbacks, **kw):
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=tmp_path, callbacks=callbacks,
                     **{"max_steps": 1, "enable_checkpointing": False, **kw})


def _expected(module, margin):
    from lightning_memplan.planning.fit import largest_fit

    spec = ModelSpec.from_module(module.model)
    return largest_fit(spec, CUDA_TRAIN, memory_budget=BUDGET, reserved_margin=margin)


def test_finder_uses_the_margin_a_resumed_memory_plan_callback_measured(tmp_path, caplog) -> None:
    from lightning_memplan import MemoryPlanCallback
    from lightning_memplan.report import measured_reserved_margin

    # a checkpoint whose MemoryPlanCallback state holds the CUDA run's report (a CPU fit writes it, the
    # report is swapped for the CUDA one: the state a CUDA run's checkpoint carries)
    path = tmp_path / "cuda_run.ckpt"
    checkpoint = torch.load(_save(CountingLM(batch_size=2), tmp_path, path), weights_only=False)
    key = next(k for k in checkpoint["callbacks"] if "MemoryPlanCallback" in k)
    checkpoint["callbacks"][key] = {**checkpoint["callbacks"][key], "report": _cuda_report().to_dict(),
                                    "accumulator": None}
    torch.save(checkpoint, path)

    module = CountingLM()
    monitor = MemoryPlanCallback(calibrate=False, print_report=False, write_files=False)
    finder = MemoryPlanBatchSizeFinder(memory_budget=BUDGET, train_spec=CUDA_TRAIN)
    with caplog.at_level(logging.INFO):
        _trainer(tmp_path, [finder, monitor], max_steps=2).fit(module, ckpt_path=str(path))
    measured = measured_reserved_margin(_cuda_report())
    assert measured is not None and measured.overhead == 3 * 2**19 and (measured.micro_batch, measured.seq_len) == (4, SEQ)
    expected = _expected(module, measured)
    assert finder.fit_result is not None and finder.fit_result.reserved_margin == measured
    assert finder.optimal_batch_size == expected.value == module.batch_size
    # the margin binds: a smaller one lets more fit, and the modelled CUDA margin (2 MiB per block tensor
    # rounding) leaves nothing in an 8 MiB budget
    assert 1 <= expected.value < _expected(module, 0).value and _expected(module, None).value == 0
    assert finder.margin_source.startswith("measured in the restored run")
    assert "reserved margin: measured in the restored run, 1.5 MiB" in caplog.text


def _save(module, tmp_path, path):
    """``path`` after a one-step fit of ``module`` with a MemoryPlanCallback saved a checkpoint there."""
    from lightning_memplan import MemoryPlanCallback

    trainer = _trainer(tmp_path, [MemoryPlanCallback(calibrate=False, print_report=False, write_files=False)])
    trainer.fit(module)
    trainer.save_checkpoint(path)
    return path


def test_finder_says_which_margin_it_used(tmp_path, caplog) -> None:
    from lightning_memplan import MemoryPlanCallback
    from lightning_memplan.report import measured_reserved_margin

    # a state dict loaded into the callback before the fit (an earlier fit's, no checkpoint): measured
    monitor = MemoryPlanCallback(calibrate=False, print_report=False, write_files=False)
    monitor.load_state_dict({"report": _cuda_report().to_dict()})
    finder = MemoryPlanBatchSizeFinder(memory_budget=BUDGET, train_spec=CUDA_TRAIN)
    module = CountingLM()
    with caplog.at_level(logging.INFO):
        _trainer(tmp_path, [finder, monitor]).fit(module)
    assert finder.margin_source.startswith("measured in an earlier fit")
    assert module.batch_size == _expected(module, measured_reserved_margin(_cuda_report())).value
    # given: wins over the callback's
    caplog.clear()
    finder = MemoryPlanBatchSizeFinder(memory_budget=BUDGET, train_spec=CUDA_TRAIN, reserved_margin=2**20)
    assert finder.reserved_margin == 2**20 and type(finder.reserved_margin) is int
    module = CountingLM()
    with caplog.at_level(logging.INFO):
        _trainer(tmp_path, [finder, MemoryPlanCallback(calibrate=False, print_report=False, write_files=False)]).fit(module)
    assert module.batch_size == _expected(module, 2**20).value and "reserved margin: given, 1.0 MiB" in caplog.text
    # no measured margin: modelled (here nothing fits an 8 MiB budget with it, so a larger one, capped)
    finder = MemoryPlanBatchSizeFinder(memory_budget=2**30, train_spec=CUDA_TRAIN, max_batch_size=2)
    _trainer(tmp_path, [finder]).fit(CountingLM())
    assert finder.margin_source == "modelled" and finder.fit_result.reserved_margin is None
    # a CPU step has no caching allocator: none is used, and the log says so
    finder = MemoryPlanBatchSizeFinder(memory_budget=BUDGET, reserved_margin=2**20)
    _trainer(tmp_path, [finder]).fit(CountingLM())
    assert finder.margin_source.startswith("none (a cpu step") and finder.fit_result.reserved_margin is None
    # bad values are refused at construction, naming the argument
    for value, error in (("1GiB", TypeError), (-1, ValueError), (0.5, TypeError)):
        with pytest.raises(error, match="reserved_margin="):
            MemoryPlanBatchSizeFinder(reserved_margin=value)
