"""Metric names and logger output of :class:`~lightning_memplan.callbacks.MemoryPlanCallback`.

Metrics go to ``trainer.loggers`` with ``log_metrics`` (integers stay exact bytes; ``LightningModule.log``
would turn them into float32 tensors, which round byte counts above 16 MiB), so every logger takes the
scalars. Loggers that can show text also get the rendered report: TensorBoard (``add_text``), Weights &
Biases (``log_text``, a table) and MLflow (``log_text``, a Markdown artifact).
"""

from __future__ import annotations

from typing import Any

from lightning_memplan.model.result import COMPONENTS, PHASES
from lightning_memplan.report.records import EpochReport, StepRecord
from lightning_memplan.report.render import UNITS, epoch_markdown, format_bytes

__all__ = ["PREFIX", "epoch_metrics", "log_metrics", "log_report_text", "step_metrics", "unit_key"]

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


def step_metrics(record: StepRecord, units: str) -> dict[str, float]:
    """The per-step metrics of one :class:`StepRecord` (keys documented on the callback)."""
    m: dict[str, float] = {}
    p = PREFIX
    _put(m, f"{p}/estimated_peak", record.estimated_peak, units)
    _put(m, f"{p}/measured_peak", record.measured_peak, units)
    _put(m, f"{p}/reserved", record.reserved, units)
    _put(m, f"{p}/headroom", record.headroom, units)
    if record.ratio is not None:
        m[f"{p}/measured_to_estimated"] = record.ratio
    if record.micro_batch is not None:
        m[f"{p}/micro_batch"] = record.micro_batch
    if record.seq_len is not None:
        m[f"{p}/seq_len"] = record.seq_len
    for phase in PHASES:
        _put(m, f"{p}/{phase}/estimated_peak", (record.estimated_phase_peaks or {}).get(phase), units)
        _put(m, f"{p}/{phase}/measured_peak", (record.measured_phase_peaks or {}).get(phase), units)
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


def log_metrics(trainer: Any, metrics: dict[str, float], step: int) -> None:
    """Send ``metrics`` to every logger of the trainer (loggers write on rank 0 only)."""
    if not metrics:
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def log_report_text(trainer: Any, epoch: EpochReport, units: str, step: int) -> None:
    """Give the rendered epoch report to the loggers that display text (TensorBoard, W&B, MLflow)."""
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger

    text = epoch_markdown(epoch, units)
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text(f"{PREFIX}/report", text, global_step=step)
        elif isinstance(logger, WandbLogger):
            columns = ["rank", "estimated_peak", "measured_peak", "reserved", "headroom"]
            data = [
                [
                    str(r.rank),
                    format_bytes(r.estimated_peak, units),
                    format_bytes(r.measured_peak, units),
                    format_bytes(r.reserved, units),
                    format_bytes(r.headroom, units),
                ]
                for r in epoch.ranks
            ]
            logger.log_text(key=f"{PREFIX}/report", columns=columns, data=data, step=step)
        elif isinstance(logger, MLFlowLogger):
            logger.experiment.log_text(logger.run_id, text, f"memory_report_epoch{epoch.epoch}.md")
