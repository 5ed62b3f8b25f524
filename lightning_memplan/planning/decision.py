"""What the planner returns: :class:`PlanDecision` with its ranked :class:`Candidate` s, every
:class:`Rejection` with its reason, and, when nothing fits, :class:`Suggestion` s. JSON round-trip via
``to_dict``/``from_dict``; rendering in :mod:`lightning_memplan.planning.explain`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_memplan.hardware.spec import HardwareSpec
from lightning_memplan.model.reserved import ReservedEstimate
from lightning_memplan.model.result import MemoryEstimate, readable_bytes
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.planning.budget import Budget, need_text
from lightning_memplan.planning.timing import StepTime
from lightning_memplan.validation import check_int

__all__ = ["Candidate", "CheckedCandidate", "PlanDecision", "PlanDoesNotFitError", "Rejection", "Suggestion",
           "train_changes"]

GiB = 2**30


class PlanDoesNotFitError(ValueError):
    """Raised by :meth:`PlanDecision.require_fit` when no plan fits; carries the decision."""

    def __init__(self, message: str, decision: PlanDecision) -> None:
        super().__init__(message)
        self.decision = decision


def train_changes(base: TrainSpec, chosen: TrainSpec) -> list[str]:
    """What the planner changed in the user's TrainSpec, as ``field: old -> new`` strings."""
    out = []
    for name in ("micro_batch", "grad_accumulation", "recompute", "loss", "loss_chunk_size", "offload",
                 "offload_activations"):
        old, new = getattr(base, name), getattr(chosen, name)
        if old != new:
            out.append(f"{name}: {old!r} -> {new!r}")
    return out


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A plan that fits (or, for the closest plan when nothing fits, the one that misses least).

    Attributes:
        plan: the layout. train: the TrainSpec it runs with (micro-batch, accumulation, recompute and
        loss as chosen). estimate: the worst rank's :class:`MemoryEstimate` (allocated bytes). need: that
        rank's :class:`~lightning_memplan.model.reserved.ReservedEstimate`, what the device must hold
        (the modelled reserved bytes on CUDA, the allocated ones on CPU; ``planning.budget.device_need``),
        compared with ``budget``; ``None`` (a decision saved without it) reads as the allocated bytes.
        budget: the budget derivation for this plan. step: the predicted :class:`StepTime`. change_cost: how far it is
        from plain data parallelism with the user's settings (see ``planning.planner.CHANGE_COST``).
        score: seconds per token x ``ranking_factor`` (change cost and the simplicity margin per
        parallel dimension, ``planning.search``), the ranking key. notes: remarks
        such as "tp=16 crosses nodes".
    """

    plan: ParallelPlan
    train: TrainSpec
    estimate: MemoryEstimate
    budget: Budget
    step: StepTime
    change_cost: float = 0.0
    score: float = 0.0
    notes: tuple[str, ...] = ()
    need: ReservedEstimate | None = None

    @property
    def peak_bytes(self) -> int:
        """Predicted peak allocated tensor bytes of the worst rank."""
        return self.estimate.total

    @property
    def reserved_bytes(self) -> int:
        """Predicted peak reserved bytes of the worst rank (== ``peak_bytes`` on CPU): what must fit."""
        return self.estimate.total if self.need is None else self.need.reserved

    @property
    def fits(self) -> bool:
        return self.reserved_bytes <= self.budget.budget

    def need_text(self) -> str:
        """``"81.4 GiB reserved (68.0 GiB allocated)"`` (just the allocated bytes where they are equal)."""
        return need_text(self.need) if self.need is not None else readable_bytes(self.estimate.total)

    @property
    def step_time_s(self) -> float:
        return self.step.total_s

    @property
    def tokens_per_s(self) -> float:
        return self.step.tokens_per_s

    @property
    def mfu(self) -> float:
        return self.step.mfu

    def describe(self) -> str:
        """``dp=8 zero=3 tp=2 | b=2 x4, recompute=selective, loss=chunked``."""
        t = self.train
        extra = [f"b={t.micro_batch} x{self.plan.microbatches if self.plan.pp > 1 else t.grad_accumulation}"]
        if t.recompute != "none":
            extra.append(f"recompute={t.recompute}")
        extra.append(f"loss={t.loss}")
        if t.offload != "none" or t.offload_activations:
            offloaded = [name for name, on in (("params", t.offload == "params"), ("activations", t.offload_activations)) if on]
            extra.append(f"offload={'+'.join(offloaded) or t.offload}")
        return f"{self.plan.describe()} | {', '.join(extra)}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan.to_dict(),
            "train": self.train.to_dict(),
            "estimate": self.estimate.to_dict(),
            "budget": self.budget.to_dict(),
            "step": self.step.to_dict(),
            "change_cost": self.change_cost,
            "score": self.score,
            "notes": list(self.notes),
            "peak_bytes": self.peak_bytes,
            "reserved_bytes": self.reserved_bytes,
            "need": None if self.need is None else asdict(self.need),
            "fits": self.fits,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Candidate:
        return cls(
            plan=ParallelPlan.from_dict(data["plan"]),
            train=TrainSpec.from_dict(data["train"]),
            estimate=MemoryEstimate.from_dict(data["estimate"]),
            budget=Budget.from_dict(data["budget"]),
            step=StepTime.from_dict(data["step"]),
            change_cost=float(data.get("change_cost", 0.0)),
            score=float(data.get("score", 0.0)),
            notes=tuple(data.get("notes", ())),
            need=_need_from_dict(data.get("need")),
        )


def _need_from_dict(data: Mapping[str, Any] | None) -> ReservedEstimate | None:
    return None if data is None else ReservedEstimate(**dict(data))


@dataclass(frozen=True, kw_only=True)
class Rejection:
    """A layout or candidate the planner ruled out, and why, in words.

    Attributes:
        layout: what was rejected (``"dp=4 tp=16 pp=1 cp=1"`` or a candidate description).
        kind: ``"divisibility"`` (shape rule), ``"batch"`` (global batch), ``"allow"``, ``"memory"``
            (predicted peak reserved bytes over the budget) or ``"slower"`` (not memory-checked: its best possible
            step time ranks below the kept candidates).
        reason: e.g. ``"stage 0 needs 93.1 GiB reserved (81.0 GiB allocated) > 71.2 GiB budget"``,
            ``"n_heads=40 not divisible by tp=16"``.
        peak_bytes, reserved_bytes, budget_bytes: for memory rejections (allocated and reserved peak:
            equal on CPU; ``reserved_bytes`` is what exceeded ``budget_bytes``).
    """

    layout: str
    kind: str
    reason: str
    peak_bytes: int | None = None
    budget_bytes: int | None = None
    reserved_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _REJECTION_FIELDS}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Rejection:
        fields: dict[str, Any] = {k: data.get(k) for k in _REJECTION_FIELDS}
        return cls(**fields)


_REJECTION_FIELDS = ("layout", "kind", "reason", "peak_bytes", "reserved_bytes", "budget_bytes")


@dataclass(frozen=True, kw_only=True)
class Suggestion:
    """A change that would make the closest plan fit (or shrink its shortfall), cheapest first.

    Attributes:
        change: the change in words (``"loss='chunked'"``, ``"2x the GPUs (64)"``, ``"seq_len <= 16384"``).
        kind: ``"train"``, ``"sequence"``, ``"hardware"`` or ``"cluster"``.
        fits: whether the planner predicts it fits. peak_bytes, reserved_bytes, budget_bytes: the
        prediction (allocated and reserved peak, the latter compared with the budget).
        detail: the numbers in words.
    """

    change: str
    kind: str
    fits: bool
    detail: str = ""
    peak_bytes: int | None = None
    budget_bytes: int | None = None
    reserved_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _SUGGESTION_FIELDS}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Suggestion:
        fields: dict[str, Any] = {k: data.get(k) for k in _SUGGESTION_FIELDS}
        return cls(**fields)


_SUGGESTION_FIELDS = ("change", "kind", "fits", "detail", "peak_bytes", "reserved_bytes", "budget_bytes")


@dataclass(frozen=True, kw_only=True)
class CheckedCandidate:
    """A ranked candidate checked against the calibrated estimate of the module itself before the choice
    is called fitting (``lightning_memplan.parallel.verify``: memplan_auto traces the user's module; the
    planner alone has no module and checks nothing).

    Attributes:
        layout: the plan and training as applied (``"dp=1 tp=2 | b=4 x1, recompute=full, loss=naive"``).
        analytic_bytes: the analytic estimate's peak of the worst rank.
        calibrated_bytes: the calibrated one (``None``: the module could not be traced for it; ``note`` says why).
        need_bytes: what was compared with the budget: the device need of the estimate that decided
            (allocated bytes on CPU, the modelled reserved bytes on CUDA).
        budget_bytes: the budget it was compared with.
        fits: ``need_bytes <= budget_bytes``.
        decided_by: ``"calibrated"`` or ``"analytic"`` (no calibrated estimate).
        note: why the analytic estimate decided, or ``""``.
    """

    layout: str
    analytic_bytes: int
    calibrated_bytes: int | None
    need_bytes: int
    budget_bytes: int
    fits: bool
    decided_by: str
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _CHECKED_FIELDS}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CheckedCandidate:
        calibrated = data.get("calibrated_bytes")
        return cls(
            layout=str(data["layout"]), analytic_bytes=int(data["analytic_bytes"]),
            calibrated_bytes=None if calibrated is None else int(calibrated), need_bytes=int(data["need_bytes"]),
            budget_bytes=int(data["budget_bytes"]), fits=bool(data["fits"]), decided_by=str(data["decided_by"]),
            note=str(data.get("note", "")),
        )


_CHECKED_FIELDS = ("layout", "analytic_bytes", "calibrated_bytes", "need_bytes", "budget_bytes", "fits", "decided_by",
                   "note")


@dataclass(frozen=True, kw_only=True)
class PlanDecision:
    """The planner's answer.

    Attributes:
        plan: the chosen :class:`ParallelPlan` (the closest one when ``fits`` is False).
        train: the :class:`TrainSpec` actually chosen (micro-batch, grad accumulation, recompute, loss).
        estimate: the worst rank's :class:`MemoryEstimate` for (plan, train) (allocated bytes).
        need: that rank's :class:`~lightning_memplan.model.reserved.ReservedEstimate`: the modelled
        reserved bytes on CUDA (== allocated on CPU), what is compared with ``budget``.
        step: the predicted :class:`StepTime`.
        candidates: ranked fitting candidates, best first (``candidates[0]`` is the choice when it fits).
        rejected: every rejected layout/candidate with its reason.
        fits: whether the chosen plan is predicted to fit its budget.
        budget: the chosen plan's budget derivation.
        shortfall_bytes: predicted peak reserved bytes minus budget when it does not fit, else 0.
        suggestions: when nothing fits, the cheapest changes that would make it fit.
        model, base_train, hardware: the inputs. global_batch: sequences per optimizer step (``None``:
        per-replica batch fixed to ``micro_batch * grad_accumulation``). headroom, expandable_segments:
        as given.
        stats: search statistics (layouts, memory evaluations, seconds).
        notes: assumptions (fallback hardware values, ...) and, when the plan offloads, which offload and
        why, its host bytes against the host budget.
        host_budget_bytes: host bytes one rank may hold (``planning/offload.py``) when the chosen plan
        offloads, else ``None``.
        checked: the candidates checked against the calibrated estimate of the module, in rank order, the
        last one the choice when it fits (:class:`CheckedCandidate`; empty when nothing was checked, as
        from :func:`~lightning_memplan.planning.plan` alone).
    """

    plan: ParallelPlan
    train: TrainSpec
    estimate: MemoryEstimate
    step: StepTime
    candidates: tuple[Candidate, ...]
    rejected: tuple[Rejection, ...]
    fits: bool
    budget: Budget
    shortfall_bytes: int
    suggestions: tuple[Suggestion, ...]
    model: ModelSpec
    base_train: TrainSpec
    hardware: HardwareSpec
    global_batch: int | None = None
    headroom: float = 0.1
    stats: Mapping[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    expandable_segments: bool = False
    host_budget_bytes: int | None = None
    checked: tuple[CheckedCandidate, ...] = ()

    # ------------------------------------------------------------------------------------------
    @property
    def chosen(self) -> Candidate:
        """The chosen candidate (plan, train, estimate, need, step together)."""
        return Candidate(plan=self.plan, train=self.train, estimate=self.estimate, budget=self.budget, step=self.step,
                         need=self.reserved)

    @property
    def reserved(self) -> ReservedEstimate:
        """The chosen plan's predicted peak *reserved* bytes next to the allocated ``estimate`` (a
        :class:`~lightning_memplan.model.reserved.ReservedEstimate`: ``.reserved``, ``.allocated`` and
        its terms: FSDP2 stream pools, the loss's extra segment, block rounding; on CPU every term is 0
        and reserved == allocated). This is what the planner compared with ``budget``."""
        from lightning_memplan.planning.budget import device_need

        return device_need(self.model, self.train, self.plan, self.estimate, self.hardware,
                           expandable_segments=self.expandable_segments)

    def train_changes(self) -> list[str]:
        """What the planner changed in the user's TrainSpec (``"recompute: 'none' -> 'full'"``)."""
        return train_changes(self.base_train, self.train)

    def require_fit(self) -> PlanDecision:
        """Return ``self`` when the plan fits, else raise :class:`PlanDoesNotFitError` (a
        ``ValueError``) naming the shortfall and the cheapest changes that would fit."""
        if self.fits:
            return self
        hints = "; ".join(s.change for s in self.suggestions if s.fits)[:600] or "no single change found; see decision.explain()"
        raise PlanDoesNotFitError(
            f"no parallel plan fits {self.model.name or 'the model'} on {self.hardware.world_size} x "
            f"{self.hardware.name}: the closest, {self.plan.describe()}, needs "
            f"{need_text(self.reserved)} > {readable_bytes(self.budget.budget)} budget (short by "
            f"{readable_bytes(self.shortfall_bytes)}); changes that fit: {hints}",
            self,
        )

    def explain(self, format: str = "text", *, top: int = 5, max_rejected: int = 12) -> str:
        """Render the decision: ``"text"``, ``"markdown"`` or ``"rich"`` (a rich table rendered to text).

        Args:
            top: alternatives listed. max_rejected: rejection reasons listed per kind (ints >= 0).

        Raises:
            TypeError / ValueError: ``top`` or ``max_rejected`` not an int >= 0; an unknown ``format``.
        """
        from lightning_memplan.planning.explain import render

        top = check_int("top", top, minimum=0, hint="alternatives listed, e.g. top=5")
        max_rejected = check_int("max_rejected", max_rejected, minimum=0,
                                 hint="rejection reasons listed per kind, e.g. max_rejected=12")
        return render(self, format=format, top=top, max_rejected=max_rejected)

    def __rich__(self) -> Any:
        from lightning_memplan.planning.explain import rich_renderable

        return rich_renderable(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan.to_dict(),
            "train": self.train.to_dict(),
            "estimate": self.estimate.to_dict(),
            "step": self.step.to_dict(),
            "candidates": [c.to_dict() for c in self.candidates],
            "rejected": [r.to_dict() for r in self.rejected],
            "fits": self.fits,
            "budget": self.budget.to_dict(),
            "shortfall_bytes": self.shortfall_bytes,
            "suggestions": [s.to_dict() for s in self.suggestions],
            "model": self.model.to_dict(),
            "base_train": self.base_train.to_dict(),
            "hardware": self.hardware.to_dict(),
            "global_batch": self.global_batch,
            "headroom": self.headroom,
            "expandable_segments": self.expandable_segments,
            "host_budget_bytes": self.host_budget_bytes,
            "reserved_bytes": self.reserved.reserved,
            "stats": dict(self.stats),
            "notes": list(self.notes),
            # only when a module's calibrated estimate was checked (memplan_auto), so a plan() answer reads as before
            **({"checked": [c.to_dict() for c in self.checked]} if self.checked else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanDecision:
        return cls(
            plan=ParallelPlan.from_dict(data["plan"]),
            train=TrainSpec.from_dict(data["train"]),
            estimate=MemoryEstimate.from_dict(data["estimate"]),
            step=StepTime.from_dict(data["step"]),
            candidates=tuple(Candidate.from_dict(c) for c in data.get("candidates", ())),
            rejected=tuple(Rejection.from_dict(r) for r in data.get("rejected", ())),
            fits=bool(data["fits"]),
            budget=Budget.from_dict(data["budget"]),
            shortfall_bytes=int(data.get("shortfall_bytes", 0)),
            suggestions=tuple(Suggestion.from_dict(s) for s in data.get("suggestions", ())),
            model=ModelSpec.from_dict(data["model"]),
            base_train=TrainSpec.from_dict(data["base_train"]),
            hardware=HardwareSpec.from_dict(data["hardware"]),
            global_batch=data.get("global_batch"),
            headroom=float(data.get("headroom", 0.1)),
            stats=dict(data.get("stats", {})),
            notes=tuple(data.get("notes", ())),
            expandable_segments=bool(data.get("expandable_segments", False)),
            host_budget_bytes=None if data.get("host_budget_bytes") is None else int(data["host_budget_bytes"]),
            checked=tuple(CheckedCandidate.from_dict(c) for c in data.get("checked", ())),
        )
