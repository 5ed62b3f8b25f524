"""FITS is a promise: before memplan_auto calls a plan fitting, its per-rank estimate is the calibrated
one of the user's own module (``parallel/calibrated.py``), not only the analytic one the planner ranked
with.

The planner (``planning/``, pure: no module, no tracer) ranks the candidates that fit by the analytic
estimate; :func:`check_candidates` walks them in rank order and asks, for each, the calibrated estimate
of the plan as it will be applied. The first whose calibrated need fits the same budget is the choice;
when the module cannot be traced for a candidate, its analytic estimate decides and the note says why.
When none of the candidates checked fits, :func:`refusal` is the error, with the calibrated figures.
Every check is recorded (:class:`~lightning_memplan.planning.decision.CheckedCandidate`) for the
explanation table: analytic and calibrated peaks side by side, and which one decided.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_memplan.model.result import MemoryEstimate, readable_bytes
from lightning_memplan.model.specs import ParallelPlan, TrainSpec
from lightning_memplan.parallel.calibrated import CalibrationUnavailable
from lightning_memplan.planning.decision import CheckedCandidate

__all__ = ["MAX_CHECKED", "Verdict", "check_candidates", "refusal"]

#: Most ranked candidates checked against the calibrated estimate before memplan_auto refuses: each new
#: recompute mode or pipeline shape is a trace, and candidates past the first few rarely differ in what
#: decides their memory.
MAX_CHECKED = 16


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """What :func:`check_candidates` found.

    Attributes:
        index: the position in the ranked list of the first candidate that fits (``None``: none did).
        checked: every candidate checked, in rank order (the last one the choice when ``index`` is set).
        plan, train, estimate: the choice as applied and its deciding estimate (``None`` when none fits).
    """

    index: int | None
    checked: tuple[CheckedCandidate, ...]
    plan: ParallelPlan | None = None
    train: TrainSpec | None = None
    estimate: MemoryEstimate | None = None


def check_candidates(
    ranked: Sequence[Any],
    *,
    applied: Callable[[Any], tuple[ParallelPlan, TrainSpec]],
    analytic: Callable[[ParallelPlan, TrainSpec], MemoryEstimate],
    calibrated: Callable[[ParallelPlan, TrainSpec], MemoryEstimate],
    need: Callable[[ParallelPlan, TrainSpec, MemoryEstimate], int],
    limit: int = MAX_CHECKED,
) -> Verdict:
    """The first of ``ranked`` whose calibrated need fits its budget.

    Args:
        ranked: the planner's candidates (``planning.Candidate``: ``plan``, ``train``, ``budget``), best first.
        applied: a candidate's plan and TrainSpec as memplan_auto applies them (FSDP2 units, the pipeline's
            micro-batch count).
        analytic, calibrated: the worst rank's estimate of an applied plan; ``calibrated`` raises
            :class:`~lightning_memplan.parallel.calibrated.CalibrationUnavailable` when it cannot answer.
        need: the bytes compared with the budget for an estimate (``planning.budget.device_need``).
        limit: most candidates checked.
    """
    checked: list[CheckedCandidate] = []
    for index, candidate in enumerate(ranked[:limit]):
        plan, train = applied(candidate)
        plain = analytic(plan, train)
        calibrated_bytes: int | None = None
        note = ""
        try:
            estimate = calibrated(plan, train)
            calibrated_bytes = estimate.total
        except CalibrationUnavailable as exc:
            estimate, note = plain, f"not calibrated: {exc}"
        needed, budget = need(plan, train, estimate), int(candidate.budget.budget)
        layout = dataclasses.replace(candidate, plan=plan, train=train).describe()
        checked.append(CheckedCandidate(
            layout=layout, analytic_bytes=plain.total, calibrated_bytes=calibrated_bytes, need_bytes=needed,
            budget_bytes=budget, fits=needed <= budget, decided_by="analytic" if calibrated_bytes is None else "calibrated",
            note=note,
        ))
        if needed <= budget:
            return Verdict(index=index, checked=tuple(checked), plan=plan, train=train, estimate=estimate)
    return Verdict(index=None, checked=tuple(checked))


def refusal(decision: Any, checked: Sequence[CheckedCandidate], *, untried: int) -> str:
    """The error when no candidate fits by the calibrated estimate: the closest one's figures (calibrated
    and analytic), the budget and the shortfall, as the planner's own refusal says them."""
    closest = min(checked, key=lambda c: c.need_bytes - c.budget_bytes)
    model = getattr(decision.model, "name", None) or "the model"
    hw = decision.hardware
    more = f"; {untried} lower-ranked candidate(s) were not checked" if untried else ""
    figures = (f"{closest.calibrated_bytes:,} B calibrated (analytic {closest.analytic_bytes:,} B)"
               if closest.calibrated_bytes is not None else f"{closest.analytic_bytes:,} B analytic ({closest.note})")
    return (
        f"no parallel plan fits {model} on {hw.world_size} x {hw.name} by the calibrated estimate of the module: "
        f"{len(checked)} candidate(s) that fit by the analytic estimate were traced and all miss{more}; the closest, "
        f"{closest.layout}, needs {figures} > {closest.budget_bytes:,} B budget (short by "
        f"{readable_bytes(closest.need_bytes - closest.budget_bytes)}); raise memory_budget, use more devices, or "
        "shrink the micro-batch or sequence"
    )
