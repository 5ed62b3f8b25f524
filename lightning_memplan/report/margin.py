"""The caching allocator's measured margin: what a run's CUDA training steps reserved beyond their allocated
peak, read from a :class:`~lightning_memplan.report.records.MemoryReport`, for
:func:`~lightning_memplan.planning.fit.largest_fit`'s ``reserved_margin=`` (and
:class:`~lightning_memplan.callbacks.MemoryPlanBatchSizeFinder`, which reads it from a resumed
:class:`~lightning_memplan.callbacks.MemoryPlanCallback`).

Which figures. Each :class:`~lightning_memplan.report.records.RankSummary` of a training epoch holds the
rank's largest measured allocated peak (``measured_peak``: the allocator's ``max_memory_allocated``, reset
every step) and its largest ``reserved`` (``max_memory_reserved``). Within a run the allocator gives memory
back to the driver only on ``torch.cuda.empty_cache()`` or an allocation failure, so its reserved bytes
never shrink: the epoch's largest reserved is what it held from its peak step on, and ``reserved -
measured_peak`` is the allocator's overhead at the allocated peak (never below it: at every instant
reserved >= allocated). Only ``backend == "cuda"`` summaries count: on CPU ``reserved`` is the process's
RSS (the interpreter, libraries and the data loader's buffers too) and on MPS the driver's allocation,
neither the caching allocator's. Evaluation phases (``EpochReport.phases``) are left out: their steps run
under ``no_grad`` while the training step's segments stay reserved, so their gap says nothing of a
training step.

Which summary. The latest run of the report (the code and allocator settings the next fit resumes), and
among its epochs and ranks the largest overhead (the worst rank, as the fit test takes the worst rank);
its reference shape is the largest ``b x s`` the rank ran that epoch (the allocated peak's step, the
peak being non-decreasing in the shape), converted to one micro-batch under pipeline parallelism (the
report's plan: the dataloader batch is ``b * microbatches``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning_memplan.model.reserved import ReservedMargin
from lightning_memplan.report.records import MemoryReport, RankSummary

__all__ = ["measured_reserved_margin", "worst_cuda_summary"]


def _usable(summary: RankSummary) -> bool:
    return (summary.backend == "cuda" and summary.measured_peak is not None and summary.measured_peak > 0
            and summary.reserved is not None and bool(summary.shapes))


def worst_cuda_summary(summaries: Iterable[RankSummary]) -> RankSummary | None:
    """The CUDA summary (with a measured allocated peak, a reserved figure and a batch shape) whose
    ``reserved - measured_peak`` is the largest; ``None`` when there is none (CPU or MPS only)."""
    best: RankSummary | None = None
    for summary in summaries:
        if _usable(summary) and (best is None or _overhead(summary) > _overhead(best)):
            best = summary
    return best


def _overhead(summary: RankSummary) -> int:
    assert summary.reserved is not None and summary.measured_peak is not None
    return max(0, summary.reserved - summary.measured_peak)


def _microbatches(run: dict[str, Any]) -> int:
    """The dataloader batch's split into micro-batches in the report's plan (1 without a pipeline)."""
    plan = run.get("plan")
    if not isinstance(plan, dict):
        return 1
    pp, micro = plan.get("pp", 1), plan.get("microbatches", 1)
    if isinstance(pp, int) and isinstance(micro, int) and pp > 1 and micro > 1:
        return micro
    return 1


def measured_reserved_margin(report: MemoryReport, *, in_progress: RankSummary | None = None) -> ReservedMargin | None:
    """The allocator's margin (reserved - allocated bytes) the report's CUDA training steps showed, or
    ``None`` where it holds none (a CPU or MPS run, no finished epoch). Module docstring: which figures and
    which summary; :class:`~lightning_memplan.model.reserved.ReservedMargin`: how the margin is carried to
    another shape.

    Args:
        report: a :class:`MemoryReport` (``MemoryPlanCallback.report``, or ``load_report(path)``).
        in_progress: the summary of an epoch under way (a checkpoint saved mid-epoch restores it); it
            belongs to ``report.current_run``.

    Raises:
        TypeError: ``report`` not a :class:`MemoryReport`, ``in_progress`` not a :class:`RankSummary`.

    Example::

        from lightning_memplan.report import load_report, measured_reserved_margin
        margin = measured_reserved_margin(load_report("lightning_logs/version_0/memory_report.json"))
        finder = MemoryPlanBatchSizeFinder(reserved_margin=margin)
    """
    if not isinstance(report, MemoryReport):
        raise TypeError(f"report={report!r:.120} must be a MemoryReport (e.g. MemoryPlanCallback.report or "
                        "lightning_memplan.report.load_report(path))")
    if in_progress is not None and not isinstance(in_progress, RankSummary):
        raise TypeError(f"in_progress={in_progress!r:.120} must be a RankSummary (RankAccumulator.summary()) or None")
    runs: dict[int, list[RankSummary]] = {}
    for epoch in report.epochs:
        runs.setdefault(epoch.run, []).extend(s for s in epoch.ranks if _usable(s))
    if in_progress is not None and _usable(in_progress):
        runs.setdefault(report.current_run, []).append(in_progress)
    runs = {run: found for run, found in runs.items() if found}
    if not runs:
        return None
    latest = max(runs)
    worst = worst_cuda_summary(runs[latest])
    assert worst is not None and worst.measured_peak is not None and worst.reserved is not None
    b, s = max(worst.shapes, key=lambda shape: (shape[0] * shape[1], shape[1]))
    expandable = report.run.get("expandable_segments")
    return ReservedMargin(
        overhead=_overhead(worst), micro_batch=max(1, b // _microbatches(report.run)), seq_len=s,
        allocated=worst.measured_peak, reserved=worst.reserved,
        expandable_segments=expandable if isinstance(expandable, bool) else None,
        run=latest, epoch=worst.epoch, rank=worst.rank,
    )
