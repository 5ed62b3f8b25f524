"""What each picture of the report shows, as plain numbers: one function per picture, shared by the HTML
page's inline SVG (:mod:`~lightning_memplan.report.html`) and the PNG for loggers
(:mod:`~lightning_memplan.report.plot`), so both are drawn from the same data, the saved JSON.

- :func:`timeline_view`: one tracked step, live bytes per component over its operator calls (measured)
  and the estimate's per-phase peaks as steps over the same phase spans.
- :func:`run_view`: one rank's per-step estimated / measured peak and reserved bytes over all epochs,
  with the epoch starts, sequence-length changes, warnings and incidents where they happened.
- :func:`rank_view`: every rank's components at the peak, estimated next to measured, with its
  pipeline stage and the imbalance across ranks.
- :func:`plan_view`: every layout the planner evaluated (``PlanDecision.to_dict()``): predicted peak
  against predicted step time, chosen / fitting / rejected, and the well-known layouts labelled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_memplan.model.result import COMPONENTS, PHASES
from lightning_memplan.report.records import (
    EpochReport,
    MemoryReport,
    RankSummary,
    Spread,
    StepRecord,
    representative_ranks,
)

__all__ = [
    "BAR_RANKS",
    "CHART_RANKS",
    "COMPONENT_COLORS",
    "PlanPoint",
    "PlanView",
    "RankBar",
    "RunView",
    "TimelineView",
    "chart_ranks",
    "plan_view",
    "rank_view",
    "run_view",
    "timeline_record",
    "timeline_view",
]

#: One colour per component (matplotlib's "tab10" palette, in :data:`COMPONENTS` order; the weight-averaging
#: copy, an eleventh, takes the first of "tab20b").
COMPONENT_COLORS: dict[str, str] = dict(
    zip(
        COMPONENTS,
        ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
         "#393b79"),
        strict=True,
    )
)


# ------------------------------------------------------------------------------------ step timeline
@dataclass(frozen=True, kw_only=True)
class TimelineView:
    """Attributes:
    record: the step drawn. ops: x of each sample (operator-call index). stacks: ``{component:
    [bytes per sample]}`` (measured). spans: ``(phase, first op, last op)``. estimate: ``(phase, x0, x1,
    {component: bytes})`` blocks. peak: ``(op, bytes)`` of the measured peak. estimated_peak: bytes.
    capacity: the step's device memory / budget, bytes (``None`` if unknown)."""

    record: StepRecord
    ops: list[int]
    stacks: dict[str, list[int]]
    spans: list[tuple[str, int, int]]
    estimate: list[tuple[str, int, int, dict[str, int]]]
    peak: tuple[int, int] | None
    estimated_peak: int | None
    capacity: int | None


def timeline_record(summary: RankSummary) -> StepRecord | None:
    """The tracked step of ``summary`` to draw: the steady-state one with the largest measurement, else
    any tracked step with a timeline (warm-up steps have no optimizer states yet)."""
    with_tl = [r for r in summary.tracked if r.timeline is not None and r.timeline.ops]
    if not with_tl:
        return None
    steady = [r for r in with_tl if not r.warmup] or with_tl
    return max(steady, key=lambda r: r.measured_peak or 0)


def timeline_view(record: StepRecord) -> TimelineView | None:
    """The step-timeline picture of ``record`` (``None`` without a timeline)."""
    tl = record.timeline
    if tl is None or not tl.ops:
        return None
    stacks = {c: list(tl.components[c]) for c in COMPONENTS if c in tl.components}
    spans = tl.phase_spans()
    # One block per phase, spanning that phase's samples (each phase once: the first span of it through
    # its last), at the estimate's per-phase peak; the estimate has no time axis of its own.
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for phase, x0, x1 in spans:
        first.setdefault(phase, x0)
        last[phase] = x1
    estimate = []
    by_phase = record.estimated_by_phase or {}
    ordered = [p for p in PHASES if p in first]
    for i, phase in enumerate(ordered):
        x1 = first[ordered[i + 1]] if i + 1 < len(ordered) else max(last[phase], tl.n_ops)
        comps = by_phase.get(phase)
        if comps:
            estimate.append((phase, first[phase], x1, {c: int(comps.get(c, 0)) for c in COMPONENTS if comps.get(c)}))
    totals = tl.totals()
    peak = None
    if totals:
        i = max(range(len(totals)), key=totals.__getitem__)
        peak = (tl.ops[i], totals[i])
    return TimelineView(
        record=record, ops=list(tl.ops), stacks=stacks, spans=spans, estimate=estimate, peak=peak,
        estimated_peak=record.estimated_peak, capacity=record.device_memory,
    )


# ------------------------------------------------------------------------------------ across the run
@dataclass(frozen=True, kw_only=True)
class RunView:
    """Attributes:
    rank: the rank drawn. steps, estimated, measured, reserved, seq_len: one entry per point (all
    epochs in order). epoch_starts: ``(step, epoch)``. seq_changes: ``(step, new seq_len)``.
    warnings: ``(step, text)``, where they were first raised (the epoch's start in version 1 reports).
    incidents: ``(step,
    "kind: error")`` on this rank."""

    rank: int
    steps: list[int] = field(default_factory=list)
    estimated: list[int | None] = field(default_factory=list)
    measured: list[int | None] = field(default_factory=list)
    reserved: list[int | None] = field(default_factory=list)
    seq_len: list[int | None] = field(default_factory=list)
    epoch_starts: list[tuple[int, int]] = field(default_factory=list)
    seq_changes: list[tuple[int, int]] = field(default_factory=list)
    warnings: list[tuple[int, str]] = field(default_factory=list)
    incidents: list[tuple[int, str]] = field(default_factory=list)


def _summary_points(r: RankSummary) -> list[tuple[int, int | None, int | None, int | None, int | None]]:
    s = r.series
    if s is not None and s.steps:
        return list(zip(s.steps, s.estimated_peak, s.measured_peak, s.reserved, s.seq_len, strict=True))
    # Format version 1 (no series): the epoch's worst figures at its worst step.
    step = r.worst_step if r.worst_step is not None else 0
    return [(step, r.estimated_peak, r.measured_peak, r.reserved, r.max_seq_len)]


def run_view(report: MemoryReport, rank: int = 0) -> RunView:
    """Per-step figures of ``rank`` over every epoch of ``report`` (and its incidents)."""
    view = RunView(rank=rank)
    last_seq: int | None = None

    def add(step: int, est: int | None, meas: int | None, res: int | None, seq: int | None) -> None:
        nonlocal last_seq
        view.steps.append(step)
        view.estimated.append(est)
        view.measured.append(meas)
        view.reserved.append(res)
        view.seq_len.append(seq)
        if seq is not None and seq != last_seq:
            if last_seq is not None:
                view.seq_changes.append((step, seq))
            last_seq = seq

    for epoch in report.epochs:
        summary = next((r for r in epoch.ranks if r.rank == rank), None)
        if summary is None:
            continue
        points = _summary_points(summary)
        view.epoch_starts.append((points[0][0], epoch.epoch))
        for i, text in enumerate(epoch.warnings):
            at = epoch.warning_steps[i] if i < len(epoch.warning_steps) else points[0][0]
            view.warnings.append((at, text))
        for point in points:
            add(*point)
    for inc in report.incidents:
        if inc.rank != rank:
            continue
        view.incidents.append((inc.step, f"{inc.kind}: {inc.error}"))
        rec = inc.step_record
        if rec is not None and not (view.steps and view.steps[-1] >= inc.step):
            add(inc.step, rec.estimated_peak, rec.measured_peak, rec.reserved, rec.seq_len)
    return view


def report_ranks(report: MemoryReport) -> list[int]:
    """Every rank that appears in an epoch or an incident, in order."""
    ranks = {r.rank for e in report.epochs for r in e.ranks} | {i.rank for i in report.incidents}
    return sorted(ranks)


#: Most ranks drawn one by one (the run chart's lines and switcher, the step timelines, the rank bars).
CHART_RANKS = 16
BAR_RANKS = 64


def chart_ranks(report: MemoryReport) -> list[int]:
    """The ranks the run chart draws: every rank of a small run; of a large one, the latest epoch's
    :func:`~lightning_memplan.report.records.representative_ranks` and the ranks of the first incidents,
    at most :data:`CHART_RANKS` (each rank's view reads every epoch: drawing all of a large run's would be
    quadratic)."""
    ranks = report_ranks(report)
    if len(ranks) <= CHART_RANKS:
        return ranks
    latest = report.latest
    chosen = [r.rank for r in representative_ranks(latest.ranks, CHART_RANKS)] if latest is not None else []
    chosen += [i.rank for i in report.incidents]
    return sorted(dict.fromkeys(chosen))[:CHART_RANKS]


# ------------------------------------------------------------------------------------ across ranks
@dataclass(frozen=True, kw_only=True)
class RankBar:
    """Attributes: rank; stage (pipeline stage, ``None`` without pipelining); estimated and measured
    ``{component: bytes}`` at the peak; measured_total: the measured peak when there is no breakdown."""

    rank: int
    stage: int | None
    estimated: dict[str, int]
    measured: dict[str, int]
    measured_total: int | None


def _stage_of(run: Mapping[str, Any], rank: int) -> int | None:
    plan = run.get("plan")
    if not isinstance(plan, Mapping) or int(plan.get("pp", 1) or 1) <= 1:
        return None
    from lightning_memplan.model.specs import ParallelPlan

    try:
        return ParallelPlan.from_dict(dict(plan)).stage_of_rank(rank)
    except (TypeError, ValueError):
        return None


def rank_view(epoch: EpochReport, run: Mapping[str, Any]) -> tuple[list[RankBar], Spread | None]:
    """Every rank's bars in ``epoch`` (:data:`BAR_RANKS` representative ones of a large run) and the spread
    of the measured (else estimated) peak over every rank."""
    bars = [
        RankBar(
            rank=r.rank,
            stage=_stage_of(run, r.rank),
            estimated=dict(r.estimated_components or {}),
            measured=dict(r.measured_components or {}),
            measured_total=None if r.measured_components else r.measured_peak,
        )
        for r in representative_ranks(epoch.ranks, BAR_RANKS)
    ]
    spread = epoch.spread("measured_peak") or epoch.spread("estimated_peak")
    return bars, spread


# ------------------------------------------------------------------------------------ plan map
@dataclass(frozen=True, kw_only=True)
class PlanPoint:
    """Attributes: label (the layout); peak bytes (reserved, as the planner's fit test); step_s (``None``: not timed, a memory rejection);
    status ``"chosen"``, ``"fits"`` or ``"rejected"``; reason (why rejected, or the candidate's
    figures); family: the well-known layout it is (``"FSDP only"``, ``"FSDP x TP"``, ``"TP x PP x DP"``,
    ...) or ``""``."""

    label: str
    peak: int
    step_s: float | None
    status: str
    reason: str
    family: str = ""


@dataclass(frozen=True, kw_only=True)
class PlanView:
    """Attributes: points; budget bytes (``None`` if unknown); unplotted: ``(layout, kind, reason)`` of
    rejections without a predicted peak (shape rules, the global batch); title; timed: whether the decision's
    step times are modelled (``False`` on a CPU host, where the planner's times are only a ranking aid: every
    point's ``step_s`` is then ``None`` and no view shows a step time, tokens/s or MFU)."""

    points: list[PlanPoint]
    budget: int | None
    unplotted: list[tuple[str, str, str]]
    title: str
    timed: bool = True


def _family(plan: Mapping[str, Any]) -> str:
    dp, tp, pp, cp = (int(plan.get(k, 1) or 1) for k in ("dp", "tp", "pp", "cp"))
    zero = int(plan.get("zero", 0) or 0)
    if cp > 1:
        return ""
    if tp > 1 and pp > 1 and dp > 1:
        return "TP x PP x DP"
    if pp > 1:
        return "PP x DP" if tp == 1 else "TP x PP"
    if tp > 1:
        return "FSDP x TP" if zero >= 3 and dp > 1 else ("TP only" if dp == 1 else "DP x TP")
    if zero >= 3:
        return "FSDP only"
    return "DDP" if zero == 0 else f"ZeRO-{zero}"


def _describe(data: Mapping[str, Any]) -> str:
    plan = data.get("plan", {})
    parts = [f"dp={plan.get('dp', 1)}"]
    if plan.get("zero"):
        parts.append(f"zero={plan['zero']}")
    for key in ("tp", "pp", "cp"):
        if int(plan.get(key, 1) or 1) > 1:
            parts.append(f"{key}={plan[key]}")
    train = data.get("train", {})
    extra = [f"b={train.get('micro_batch', '?')}"]
    if train.get("recompute", "none") != "none":
        extra.append(f"recompute={train['recompute']}")
    if train.get("loss"):
        extra.append(f"loss={train['loss']}")
    return " ".join(parts) + " | " + ", ".join(extra)


def _peak_of(data: Mapping[str, Any]) -> int:
    """The peak the planner compared with the budget: the reserved bytes (allocated where the decision
    predates them, and on CPU, where they are equal)."""
    if data.get("reserved_bytes") is not None:
        return int(data["reserved_bytes"])
    if "peak_bytes" in data and data["peak_bytes"] is not None:
        return int(data["peak_bytes"])
    est = data.get("estimate", {})
    return int(sum(int(est.get(c, 0) or 0) for c in COMPONENTS))


def plan_view(decision: Mapping[str, Any]) -> PlanView:
    """The plan map of a ``PlanDecision.to_dict()``: fitting candidates, the chosen plan and every
    rejection with a predicted peak (greyed, with its reason)."""
    budget = (decision.get("budget") or {}).get("budget")
    points: list[PlanPoint] = []
    chosen_label = _describe(decision)
    seen_chosen = False
    # A CPU host has no time model (planning.timing.time_model_applies): its placeholder times rank the layouts
    # by change cost only, so they are never drawn or printed (the console says the same: TIME_MODEL_OFF).
    steps = [decision.get("step") or {}, *((c.get("step") or {}) for c in decision.get("candidates", ()))]
    timed = all(bool(st.get("modelled", True)) for st in steps)

    def step_s(step: Mapping[str, Any]) -> float | None:
        return float(step.get("total_s", 0.0)) if timed else None

    for cand in decision.get("candidates", ()):
        step = cand.get("step", {})
        label = _describe(cand)
        is_chosen = not seen_chosen and label == chosen_label
        seen_chosen = seen_chosen or is_chosen
        points.append(PlanPoint(
            label=label, peak=_peak_of(cand), step_s=step_s(step),
            status="chosen" if is_chosen else "fits",
            reason=(f"tokens/s {float(step.get('tokens_per_s', 0.0)):,.0f}, MFU {float(step.get('mfu', 0.0)):.1%}"
                    if timed else f"fits; change cost {float(cand.get('change_cost', 0.0) or 0.0):g}"),
            family=_family(cand.get("plan", {})),
        ))
    if not seen_chosen:
        step = decision.get("step", {})
        points.append(PlanPoint(
            label=chosen_label, peak=_peak_of(decision), step_s=step_s(step), status="chosen",
            reason="chosen" if decision.get("fits") else "closest plan (does not fit)",
            family=_family(decision.get("plan", {})),
        ))
    unplotted = []
    for rej in decision.get("rejected", ()):
        if rej.get("peak_bytes") is None:
            unplotted.append((str(rej.get("layout")), str(rej.get("kind")), str(rej.get("reason"))))
            continue
        points.append(PlanPoint(
            label=str(rej.get("layout")), peak=_peak_of(rej), step_s=None, status="rejected",
            reason=f"{rej.get('kind')}: {rej.get('reason')}",
        ))
    model = (decision.get("model") or {}).get("name") or "model"
    hw = decision.get("hardware") or {}
    world = (decision.get("stats") or {}).get("world_size") or int(hw.get("gpus_per_node", 1) or 1) * int(hw.get("num_nodes", 1) or 1)
    title = f"Plan map: {model} on {int(world)} x {hw.get('name', 'device')}"
    return PlanView(points=points, budget=int(budget) if budget is not None else None, unplotted=unplotted, title=title,
                    timed=timed)


def labelled_families(points: list[PlanPoint]) -> dict[int, str]:
    """``{index: family}``: the fastest fitting point of each well-known layout family gets a label."""
    best: dict[str, int] = {}
    for i, p in enumerate(points):
        if p.status == "rejected" or not p.family or p.step_s is None:
            continue
        j = best.get(p.family)
        if j is None or p.step_s < (points[j].step_s or 0.0):
            best[p.family] = i
    return {i: fam for fam, i in best.items()}
