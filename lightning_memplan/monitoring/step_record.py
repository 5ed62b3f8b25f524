"""Turn one step's readings into the report's records: a :class:`StepRecord` from the backend probe
and the tensor tracker, and an :class:`Incident` when the step raised (out of memory or otherwise)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_memplan.model.result import COMPONENTS, PHASES, MemoryEstimate, trim_optional
from lightning_memplan.report.records import Incident, RankAccumulator, StepRecord

__all__ = ["build_incident", "build_step_record", "is_out_of_memory"]


def is_out_of_memory(exc: BaseException) -> bool:
    """``torch.OutOfMemoryError`` (CUDA/MPS/XPU allocators), or a ``RuntimeError`` saying "out of memory"
    (CPU allocations and older PyTorch raise that)."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


def build_step_record(
    current: dict[str, Any],
    reading: Any,
    tracker_report: Any,
    *,
    rank: int,
    default_step: int,
    memory_budget: int | None,
    backend: str,
    measurement: str | None = None,
) -> StepRecord:
    """One step's record.

    ``current`` is what the callback noted at the batch start (step, epoch, shape, estimate, tracked,
    warm-up); ``reading`` the probe's :class:`~lightning_memplan.monitoring.measure.ProbeReading` or
    ``None``; ``tracker_report`` the tensor tracker's report on sampled steps or ``None``. On CPU, where
    no allocator counts bytes, the tracker's total is the measured peak. Headroom is the capacity
    (``memory_budget`` or the device's memory) less what the allocator reserved (or the peak) and,
    against the device, less what other processes and the context hold. ``measurement`` names how the
    peak was taken (:attr:`StepRecord.measurement`). The tracker's ``released_late`` (bytes of its peak that
    gloo's worker thread freed late) is carried as :attr:`StepRecord.released_late`."""
    shape = current.get("shape") or (None, None)
    est: MemoryEstimate | None = current.get("estimate")
    measured_peak = reading.measured_peak if reading is not None else None
    phase_peaks = dict(reading.phase_peaks) if reading is not None and reading.phase_peaks else None
    components = None
    if tracker_report is not None:
        components = trim_optional({c: int(tracker_report.peak.get(c, 0)) for c in COMPONENTS})
        if measured_peak is None:
            measured_peak = tracker_report.total
            phase_peaks = {p: tracker_report.phase_total(p) for p in PHASES if p in tracker_report.by_phase}
    capacity = memory_budget or (reading.device_memory if reading is not None else None)
    headroom = None
    if capacity is not None and reading is not None:
        used = reading.reserved if reading.reserved is not None else measured_peak
        if used is not None:
            headroom = capacity - used - (reading.unavailable if memory_budget is None else 0)
    return StepRecord(
        step=int(current.get("step", default_step)),
        epoch=int(current.get("epoch", 0)),
        rank=rank,
        micro_batch=shape[0],
        seq_len=shape[1],
        estimated_peak=est.total if est is not None else None,
        estimated_components=est.components() if est is not None else None,
        estimated_phase_peaks={p: est.phase_total(p) for p in PHASES if p in est.by_phase} if est is not None else None,
        estimated_peak_phase=est.peak_phase if est is not None else None,
        estimated_host=est.host if est is not None and est.host else None,  # DeepSpeed offload: host bytes
        measured_peak=measured_peak,
        measured_components=components,
        measured_phase_peaks=phase_peaks,
        reserved=reading.reserved if reading is not None else None,
        device_memory=capacity,
        headroom=headroom,
        tracked=bool(current.get("tracked")),
        warmup=bool(current.get("warmup")),
        backend=backend,
        estimated_by_phase={p: dict(c) for p, c in est.by_phase.items()} if est is not None else None,
        timeline=tracker_report.timeline if tracker_report is not None else None,
        measurement=measurement,
        phase=str(current.get("phase", "train")),
        released_late=int(getattr(tracker_report, "released_late", 0) or 0),
    )


def build_incident(
    exception: BaseException,
    record: StepRecord | None,
    allocator: dict[str, Any],
    tracker_report: Any,
    *,
    current: dict[str, Any],
    rank: int,
    accumulator: RankAccumulator | None,
    default_step: int,
) -> Incident:
    """The report's entry for a step that raised: the failing step's record so far, the allocator state
    (plus the tracker's live and peak bytes when the step was tracked) and the epoch's partial summary."""
    allocator = dict(allocator)
    if tracker_report is not None:
        allocator["tracker_live_bytes"] = int(sum(tracker_report.current.values()))
        allocator["tracker_peak_bytes"] = tracker_report.total
    return Incident(
        kind="oom" if is_out_of_memory(exception) else "exception",
        error=f"{type(exception).__name__}: {exception}"[:2000],
        rank=rank,
        epoch=int(current.get("epoch", accumulator.epoch if accumulator else 0)),
        step=int(current.get("step", default_step)),
        step_record=record,
        allocator=allocator,
        partial_epoch=accumulator.summary() if accumulator is not None and accumulator.steps else None,
    )
