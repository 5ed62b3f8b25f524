"""Metric names and logger output of :class:`~lightning_memplan.callbacks.MemoryPlanCallback`.

Metrics go to ``trainer.loggers`` with ``log_metrics`` (integers stay exact bytes; ``LightningModule.log``
would turn them into float32 tensors, which round byte counts above 16 MiB), so every logger takes the
scalars. TensorBoard also gets the rendered report as text (``add_text``); the report files and images
go to each logger through its own API in :mod:`~lightning_memplan.monitoring.artifacts`.
"""

from __future__ import annotations

from typing import Any

from lightning_memplan.model.result import COMPONENTS, PHASES
from lightning_memplan.report.records import EpochReport, StepRecord
from lightning_memplan.report.render import UNITS, epoch_markdown

__all__ = [
    "PREFIX",
    "accumulating",
    "epoch_metrics",
    "lightning_step",
    "log_metrics",
    "log_report_text",
    "merge_window",
    "phase_prefix",
    "step_metrics",
    "unit_key",
]

#: Prefix of every metric key.
PREFIX = "memplan"


def unit_key(key: str, units: str) -> str | None:
    """Key of the ``units`` view of a byte metric (``memplan/measured_peak`` -> ``..._gib``); ``None``
    for ``units="B"`` (the bytes key is the view)."""
    if units == "B":
        return None
    return f"{key}_{units.lower()}"


def _put(metrics: dict[str, float], key: str, value: int | None, units: str) -> None:
    if value is None:
        return
    metrics[key] = int(value)
    view = unit_key(key, units)
    if view is not None:
        metrics[view] = value / UNITS[units]


def phase_prefix(phase: str) -> str:
    """``memplan`` for training steps, ``memplan/val`` (``/test``, ``/predict``) for evaluation steps."""
    return PREFIX if phase == "train" else f"{PREFIX}/{phase}"


def step_metrics(record: StepRecord, units: str) -> dict[str, float]:
    """The per-step metrics of one :class:`StepRecord` (keys documented on the callback); an evaluation
    step's keys sit under its phase (``memplan/val/estimated_peak``, ...)."""
    m: dict[str, float] = {}
    p = phase_prefix(record.phase)
    _put(m, f"{p}/estimated_peak", record.estimated_peak, units)
    _put(m, f"{p}/measured_peak", record.measured_peak, units)
    _put(m, f"{p}/reserved", record.reserved, units)
    _put(m, f"{p}/headroom", record.headroom, units)
    if record.ratio is not None and not record.warmup:  # warm-up steps are not compared (no optimizer states)
        m[f"{p}/measured_to_estimated"] = record.ratio
    if record.micro_batch is not None:
        m[f"{p}/micro_batch"] = record.micro_batch
    if record.seq_len is not None:
        m[f"{p}/seq_len"] = record.seq_len
    for phase in PHASES:
        _put(m, f"{p}/{phase}/estimated_peak", (record.estimated_phase_peaks or {}).get(phase), units)
        _put(m, f"{p}/{phase}/measured_peak", (record.measured_phase_peaks or {}).get(phase), units)
    if record.released_late:  # the part of the measured peak gloo's thread released late (varies run to run)
        _put(m, f"{p}/released_late", record.released_late, units)
    if record.tracked:
        for comp in COMPONENTS:
            _put(m, f"{p}/{comp}/estimated", (record.estimated_components or {}).get(comp), units)
            _put(m, f"{p}/{comp}/measured", (record.measured_components or {}).get(comp), units)
    return m


def epoch_metrics(epoch: EpochReport, units: str) -> dict[str, float]:
    """Across-rank metrics of one epoch: min / max / imbalance of the peaks, the smallest headroom."""
    m: dict[str, float] = {}
    p = f"{PREFIX}/epoch"
    for name in ("estimated_peak", "measured_peak", "reserved"):
        spread = epoch.spread(name)
        if spread is not None:
            _put(m, f"{p}/{name}_max", spread.max, units)
            _put(m, f"{p}/{name}_min", spread.min, units)
            m[f"{p}/{name}_imbalance"] = spread.imbalance
    spread = epoch.spread("headroom")
    if spread is not None:
        _put(m, f"{p}/headroom_min", spread.min, units)
    m[f"{p}/ranks"] = len(epoch.ranks)
    return m


def lightning_step(trainer: Any, *, epoch_end: bool = False) -> int:
    """The step ``LightningModule.log`` writes at now: the fit loop's count of batches that stepped the
    optimizer before this one (``_batches_that_stepped``, read by Lightning's logger connector after
    ``on_train_batch_end``, before it is incremented); at epoch end one less, as Lightning logs epoch
    metrics (``_FitLoop.on_advance_end`` decrements it around ``update_train_epoch_metrics``).
    ``trainer.global_step`` is one ahead of it in ``on_train_batch_end``."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    step = getattr(loop, "_batches_that_stepped", None)
    if not isinstance(step, int):
        return int(trainer.global_step)
    return max(0, step - 1) if epoch_end else step


def accumulating(trainer: Any, pl_module: Any) -> bool:
    """Whether this batch only accumulates gradients (no optimizer step after it): Lightning logs
    ``self.log`` values only after a batch that steps (automatic optimization), and so does the callback."""
    if not getattr(pl_module, "automatic_optimization", True):
        return False
    should = getattr(getattr(trainer, "fit_loop", None), "_should_accumulate", None)
    return bool(should()) if callable(should) else False


def merge_window(window: list[StepRecord], units: str) -> dict[str, float]:
    """One set of step metrics for the micro-batches of one optimizer step (gradient accumulation): the
    largest value of each byte and shape metric, the smallest headroom, and the ratio of the compared
    (non-warm-up) micro-batch with the largest measurement."""
    merged: dict[str, float] = {}
    for record in window:
        for key, value in step_metrics(record, units).items():
            if key.endswith("measured_to_estimated"):
                continue
            low = "/headroom" in key
            old = merged.get(key)
            merged[key] = value if old is None else (min(old, value) if low else max(old, value))
    compared = [r for r in window if r.ratio is not None and not r.warmup]
    if compared:
        best = max(compared, key=lambda r: r.measured_peak or 0)
        merged[f"{phase_prefix(best.phase)}/measured_to_estimated"] = best.ratio  # type: ignore[assignment]
    return merged


def log_metrics(trainer: Any, metrics: dict[str, float], step: int) -> None:
    """Send ``metrics`` to every logger of the trainer (loggers write on rank 0 only)."""
    if not metrics:
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def log_report_text(trainer: Any, epoch: EpochReport, units: str, step: int) -> None:
    """Give the rendered epoch report to TensorBoard (``add_text``); MLflow and W&B get the report
    files, W&B a numeric table (:func:`~lightning_memplan.monitoring.artifacts.log_report_files`)."""
    from lightning.fabric.loggers import TensorBoardLogger  # the Trainer's TensorBoardLogger subclasses it

    text = epoch_markdown(epoch, units)
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text(f"{PREFIX}/report", text, global_step=step)
