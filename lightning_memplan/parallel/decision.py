"""Choosing the plan on rank 0: the planner, a forced plan or a checkpoint's plan, then what can be applied.

:func:`decide` is pure given its inputs (no collectives): the strategy runs it on rank 0 and broadcasts
the :class:`Resolution`. It never silently changes a plan: every change (a dimension the model cannot
be split along, context parallelism that is not applied) is recorded in :attr:`Resolution.notes`, which
the strategy shows as a warning.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from torch import nn

from lightning_memplan.live.layouts import TransformerLayout
from lightning_memplan.model.result import MemoryEstimate
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.parallel.fsdp import own_units
from lightning_memplan.parallel.mesh import MeshLayout
from lightning_memplan.parallel.pipeline import pipeline_blocker
from lightning_memplan.parallel.tensor_parallel import (
    find_linear_cross_entropy,
    sequence_parallel_blocker,
    tensor_parallel_blocker,
)
from lightning_memplan.planning.decision import PlanDecision

__all__ = [
    "ForcedDecision",
    "Resolution",
    "ResolvedStrategy",
    "applicability",
    "decide",
    "fold_blocked",
    "module_blockers",
    "runnable_forced_schedule",
]


@dataclass(frozen=True, kw_only=True)
class ForcedDecision:
    """The decision record when the plan was given (``plan=``) or restored from a checkpoint.

    Mirrors the parts of :class:`~lightning_memplan.planning.PlanDecision` that the strategy and
    :class:`~lightning_memplan.callbacks.MemoryPlanCallback` read: ``plan``, ``train``, ``estimate``,
    ``explain()``, ``to_dict()``.

    Args:
        plan: the applied plan.
        train: the TrainSpec it was estimated with.
        model: the ModelSpec it was estimated with.
        estimate: the applied plan's estimate: the calibrated one of the module when it could be traced
            (``estimate.source == "calibrated"``), else ``estimate_memory(model, train, plan)``; ``None``
            when no estimate is available.
        source: ``"forced"`` (``plan=``) or ``"checkpoint"`` (restored from a resumed checkpoint).
        analytic: the analytic estimate beside a calibrated one (``None``: not computed).
        note: why the estimate is not calibrated, or ``""``.
    """

    plan: ParallelPlan
    train: TrainSpec
    model: ModelSpec
    estimate: Any = None
    source: str = "forced"
    analytic: Any = None
    note: str = ""

    def explain(self) -> str:
        lines = [f"memplan_auto: plan {self.plan.describe()} ({self.source}, not searched)"]
        if self.estimate is not None:
            kind = "calibrated" if self.estimate.source == "calibrated" else "analytic"
            line = f"  predicted peak per rank: {self.estimate.total / 2**30:.3f} GiB ({self.estimate.total:,} B, {kind}"
            if kind == "calibrated" and self.analytic is not None:
                line += f"; analytic {self.analytic.total:,} B"
            lines.append(line + ")")
        if self.note:
            lines.append(f"  {self.note}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "plan": self.plan.to_dict(),
            "train": self.train.to_dict(),
            "model": self.model.to_dict(),
            "estimate_total_bytes": None if self.estimate is None else int(self.estimate.total),
            "estimate_source": None if self.estimate is None else self.estimate.source,
            "analytic_total_bytes": None if self.analytic is None else int(self.analytic.total),
        }


@dataclass(frozen=True, kw_only=True)
class Resolution:
    """What rank 0 decided, broadcast to every rank.

    Args:
        decision: the planner's ``PlanDecision`` or a :class:`ForcedDecision`.
        plan: the plan that will be applied (``decision.plan`` unless folded, see ``notes``).
        mesh: mesh sizes for ``plan``.
        recompute: activation checkpointing to apply (``"none"``, ``"selective"``, ``"full"``).
        loss: the loss mode the plan assumes.
        notes: every deviation from what was asked, in words.
        offload: ``"params"``: every FSDP2 unit gets ``CPUOffloadPolicy()`` (the decision's
            ``TrainSpec.offload`` under ``framework="torch"``); ``"none"`` otherwise.
        offload_activations: every block runs under ``save_on_cpu`` (torch's ``offload_wrapper``).
    """

    decision: Any
    plan: ParallelPlan
    mesh: MeshLayout
    recompute: str = "none"
    loss: str = "naive"
    notes: tuple[str, ...] = field(default=())
    offload: str = "none"
    offload_activations: bool = False

    def fingerprint(self) -> str:
        """A string every rank must agree on (compared with an all-gather)."""
        return json.dumps(
            {"plan": self.plan.to_dict(), "mesh": list(self.mesh.shape), "recompute": self.recompute,
             "offload": self.offload, "offload_activations": self.offload_activations}, sort_keys=True
        )


class ResolvedStrategy:
    """What both memplan_auto strategies (Trainer and Fabric) expose about their :class:`Resolution`.

    A mixin in front of Lightning's ``ModelParallelStrategy`` (``class MemplanAutoStrategy(ResolvedStrategy,
    ModelParallelStrategy)``); the strategy sets :attr:`resolution` once rank 0's plan has been received.

    Attributes:
        resolution: plan, mesh sizes, recompute, loss mode and notes (``None`` before planning).
        plain_module: the module before the strategy sharded it, on the meta device (``Applied.plain``;
            ``None`` before it applied the plan, or when nothing was sharded in place): the monitoring core
            traces it to calibrate its estimate (``monitoring/calibration.py``).
    """

    resolution: Resolution | None = None
    plain_module: nn.Module | None = None

    @property
    def decision(self) -> Any:
        """The planner's ``PlanDecision`` (or a :class:`ForcedDecision`); ``None`` before planning."""
        return None if self.resolution is None else self.resolution.decision

    @property
    def applied_plan(self) -> ParallelPlan | None:
        """The :class:`ParallelPlan` applied (``decision.plan`` unless a dimension had to be folded)."""
        return None if self.resolution is None else self.resolution.plan


def applicability(
    plan: ParallelPlan,
    layout: TransformerLayout | None,
    module: nn.Module,
    *,
    self_parallel: bool,
    seq_len: int | None = None,
) -> dict[str, str]:
    """Why each of the plan's dimensions cannot be applied to ``module``: ``{"tp": reason, ...}``.

    ``seq_len``: the planned sequence length; sequence parallelism needs it divisible by tp."""
    out: dict[str, str] = {}
    if self_parallel:
        if plan.pp > 1:
            out["pp"] = "the module overrides configure_model (it parallelises itself), and memplan_auto only sets mesh sizes for it"
        if plan.sp:
            out["sp"] = "the module overrides configure_model (it parallelises itself), so it decides on sequence parallelism"
        return out
    reason = tensor_parallel_blocker(layout, module, plan.tp)
    if reason:
        out["tp"] = reason
    reason = pipeline_blocker(layout, plan.pp, plan.virtual_stages, module=module)
    if reason:
        out["pp"] = reason
    if plan.sp and "tp" not in out:
        reason = sequence_parallel_blocker(layout, plan.tp, 1 if "pp" in out else plan.pp)
        if reason is None and seq_len is not None and seq_len % plan.tp:
            reason = (
                f"seq_len={seq_len} is not divisible by tp={plan.tp} (SP splits the sequence in equal slices); "
                f"pad sequences to a multiple of {plan.tp}"
            )
        if reason:
            out["sp"] = reason
    return out


def module_blockers(
    layout: TransformerLayout | None, module: nn.Module, world_size: int, *, self_parallel: bool
) -> dict[str, str]:
    """The sizes the planner must not search for this module, from the same blockers
    :func:`applicability` applies at setup (one rule for both).

    ``{"tp": why}`` / ``{"pp": why}`` when no size above 1 can be applied, else ``{"tp=4": why, ...}``
    per size that cannot (e.g. tp=4 with 2 key/value heads, pp=8 with 4 blocks);
    :func:`~lightning_memplan.parallel.planner_bridge.narrow_allow` pins or drops them.
    """
    if self_parallel:  # the module's configure_model decides; memplan_auto never plans its pp/sp
        return {}
    out: dict[str, str] = {}
    sizes = [d for d in range(2, world_size + 1) if world_size % d == 0]
    for dim, blocker in (
        ("tp", lambda d: tensor_parallel_blocker(layout, module, d)),
        ("pp", lambda d: pipeline_blocker(layout, d, 1, module=module)),
    ):
        reasons = {d: why for d in sizes if (why := blocker(d))}
        if sizes and len(reasons) == len(sizes):
            out[dim] = reasons[sizes[0]]
        else:
            out.update({f"{dim}={d}": why for d, why in reasons.items()})
    return out


def fold_blocked(plan: ParallelPlan, blocked: dict[str, str]) -> tuple[ParallelPlan, list[str]]:
    """Turn blocked tp/pp ranks into data-parallel ranks (same world size) and drop blocked sequence
    parallelism; returns the plan and notes."""
    notes = []
    changes: dict[str, Any] = {}
    dp = plan.dp
    if "tp" in blocked:
        dp *= plan.tp
        changes.update(tp=1, sp=False)
        notes.append(f"tp={plan.tp} not applied: {blocked['tp']}; its ranks became data-parallel ranks")
    if "pp" in blocked:
        dp *= plan.pp
        changes.update(pp=1, microbatches=1, schedule="1f1b", virtual_stages=1)
        notes.append(f"pp={plan.pp} not applied: {blocked['pp']}; its ranks became data-parallel ranks")
    if "sp" in blocked and plan.sp and "tp" not in blocked:
        changes["sp"] = False
        notes.append(f"sp not applied: {blocked['sp']}; tensor parallelism runs without it")
    if not changes:
        return plan, notes
    return dataclasses.replace(plan, dp=dp, **changes), notes


def runnable_forced_schedule(plan: ParallelPlan, batch: int | None) -> tuple[ParallelPlan, list[str]]:
    """A forced plan's pipeline schedule checked against the per-rank batch (``None``: unknown) with
    :func:`~lightning_memplan.model.runnable.pipeline_schedule_blocker`, the rule the planner's
    search uses too.

    ``microbatches=1`` with ``pp > 1`` is ``ParallelPlan``'s default, not a choice: when it cannot run
    it is replaced by the smallest count that can (:func:`runnable_microbatches`), with a note. Any
    other count that cannot run is refused here, at setup, instead of failing inside the first step.

    Raises:
        ValueError: naming the plan, the rule and the ``microbatches=`` (or schedule) that would run.
    """
    from lightning_memplan.model.runnable import pipeline_schedule_blocker, runnable_microbatches

    if plan.pp == 1:
        return plan, []
    reason = pipeline_schedule_blocker(
        pp=plan.pp, schedule=plan.schedule, microbatches=plan.microbatches, batch=batch
    )
    if reason is None:
        return plan, []
    ok = runnable_microbatches(pp=plan.pp, schedule=plan.schedule, batch=batch if batch is not None else plan.pp)
    if plan.microbatches == 1 and ok is not None:
        note = (
            f"microbatches=1 (ParallelPlan's default) cannot run pp={plan.pp} {plan.schedule}: {reason}; "
            f"applied microbatches={ok} instead (force microbatches= to choose)"
        )
        return dataclasses.replace(plan, microbatches=ok), [note]
    where = f"the per-rank batch of {batch}" if batch is not None else "an unknown batch"
    fix = (
        f"force microbatches={ok} (or another count it allows)" if ok is not None
        else f"make the per-rank batch a multiple of {plan.pp}, or use schedule='gpipe'"
    )
    raise ValueError(
        f"plan={plan.describe()} cannot run {where}: {reason}; {fix}, e.g. "
        f"ParallelPlan(..., pp={plan.pp}, microbatches={ok or plan.pp})"
    )


def decide(
    *,
    model_spec: ModelSpec,
    train: TrainSpec,
    world_size: int,
    layout: TransformerLayout | None,
    module: nn.Module,
    self_parallel: bool,
    forced: ParallelPlan | None,
    forced_source: str,
    planner: Any,
    batch_known: bool = True,
    runner: str = "the Trainer",
    head_in_root: bool | None = None,
    calibrated: Callable[[ParallelPlan, TrainSpec], MemoryEstimate] | None = None,
) -> Resolution:
    """Pick and check the plan (runs on rank 0 only).

    Args:
        planner: ``callable(exclude: dict[str, str]) -> PlanDecision``; called again with the blocked
            dimensions excluded when the first choice cannot be applied to this module.
        batch_known: whether ``train.micro_batch`` is the real per-rank dataloader batch (the pipeline
            schedule rule is checked against it).
        runner: who starts the processes, for the world-size message (``"the Trainer"``, ``"Fabric"``).
        head_in_root: keep the untied embedding and lm_head in the FSDP2 root unit (gathered from forward
            to backward), so that a loss outside the module's forward can read ``lm_head.weight`` whole.
            ``None``: when the module holds a ``LinearCrossEntropy`` (a LightningModule's ``training_step``
            loss); a Fabric loop's loss is outside the module, so the Fabric strategy passes ``True``.
            Pipeline stages always give them units of their own. The choice is the applied plan's
            ``own_units`` (:func:`~lightning_memplan.parallel.fsdp.own_units`), which the estimate counts.
        calibrated: ``(applied plan, applied TrainSpec) -> MemoryEstimate``, the calibrated estimate of the
            module (:class:`~lightning_memplan.parallel.calibrated.CalibratedEstimator`); it raises
            ``CalibrationUnavailable`` when it cannot answer. Given, a searched plan is said to fit only when
            its calibrated estimate fits (:func:`~lightning_memplan.parallel.verify.check_candidates`), and a
            forced plan records it. ``None``: the analytic estimate alone.
    Raises:
        ValueError: a forced plan whose world size differs from the run's, or whose pipeline schedule
            cannot run the batch (:func:`runnable_forced_schedule`); ``PlanDoesNotFitError`` when nothing
            fits (by the calibrated estimate when it is given).
    """
    units = _UnitRule(layout=layout, module=module, self_parallel=self_parallel, head_in_root=head_in_root)
    if forced is not None:
        _check_world(forced, world_size, runner)
        choice = _forced_choice(forced, model_spec, train, layout, module, self_parallel=self_parallel,
                                source=forced_source, batch_known=batch_known)
    else:
        choice = _searched_choice(planner, train, layout, module, world_size, self_parallel=self_parallel)
        if calibrated is not None and isinstance(choice.decision, PlanDecision):
            choice = _verified_choice(choice, train, model_spec, layout, module, units, calibrated,
                                      self_parallel=self_parallel)
    return _resolution(choice, model_spec, train, units, calibrated, self_parallel=self_parallel,
                       forced=forced is not None)


@dataclass(frozen=True, kw_only=True)
class _Choice:
    """A decision and the plan chosen from it, before the applied form (FSDP2 units) is made."""

    decision: Any
    plan: ParallelPlan
    recompute: str
    loss: str
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class _UnitRule:
    """Which untied embedding / lm_head get FSDP2 units of their own in the applied plan."""

    layout: TransformerLayout | None
    module: nn.Module
    self_parallel: bool
    head_in_root: bool | None

    def applied(self, plan: ParallelPlan) -> ParallelPlan:
        """``plan`` as applied: FSDP2's replicate mesh reduces in place (no DDP bucket copy: the estimate's
        ``grad_buckets``); the untied embedding / lm_head with units of their own (none when the module
        applies its own FSDP2 in configure_model, or without data parallelism: the estimate's root unit
        leaves them out)."""
        in_root = bool(find_linear_cross_entropy(self.module)) if self.head_in_root is None else self.head_in_root
        units = () if self.self_parallel or MeshLayout.from_plan(plan).dp == 1 else own_units(
            self.layout, separate_head=plan.pp > 1 or not in_root)
        return dataclasses.replace(plan, grad_buckets=False, own_units=units)


def _check_world(forced: ParallelPlan, world_size: int, runner: str) -> None:
    if forced.world_size != world_size:
        raise ValueError(
            f"plan={forced!r} needs {forced.world_size} processes (dp*tp*pp*cp) but {runner} runs "
            f"{world_size} (devices x num_nodes); change the plan or {runner.removeprefix('the ')}(devices=..., "
            "num_nodes=...)"
        )


def _forced_choice(
    forced: ParallelPlan, model_spec: ModelSpec, train: TrainSpec, layout: TransformerLayout | None, module: nn.Module,
    *, self_parallel: bool, source: str, batch_known: bool,
) -> _Choice:
    """A given plan, with what the module cannot take folded into data parallelism and its schedule checked."""
    blocked = applicability(forced, layout, module, self_parallel=self_parallel, seq_len=train.seq_len)
    plan, fold_notes = fold_blocked(forced, blocked)
    plan, schedule_notes = runnable_forced_schedule(plan, train.micro_batch if batch_known else None)
    estimate = _estimate_or_none(model_spec, train, dataclasses.replace(plan, grad_buckets=False))
    decision = ForcedDecision(plan=plan, train=train, model=model_spec, estimate=estimate, source=source)
    return _Choice(decision=decision, plan=plan, recompute=train.recompute, loss=train.loss,
                   notes=(*fold_notes, *schedule_notes))


def _searched_choice(
    planner: Any, train: TrainSpec, layout: TransformerLayout | None, module: nn.Module, world_size: int,
    *, self_parallel: bool,
) -> _Choice:
    """The planner's choice among what this module can take, re-planned (or folded) when it cannot."""
    # The search sees only the sizes this module can take (module_blockers); the check after it
    # is the same rule again, for the options the search cannot express (virtual stages, SP).
    searched = module_blockers(layout, module, world_size, self_parallel=self_parallel)
    decision = planner(searched)
    notes: list[str] = []
    blocked = applicability(decision.plan, layout, module, self_parallel=self_parallel, seq_len=train.seq_len)
    plan = decision.plan
    if blocked:
        notes += [f"planner chose {decision.plan.describe()}, but {dim}: {why}" for dim, why in blocked.items()]
        decision = planner({**searched, **blocked})
        notes.append(f"re-planned without {', '.join(sorted(blocked))}: {decision.plan.describe()}")
        still = applicability(decision.plan, layout, module, self_parallel=self_parallel, seq_len=train.seq_len)
        plan, fold_notes = fold_blocked(decision.plan, still)  # the planner ignored the exclusion: fold, not fail
        notes += fold_notes
    chosen_train = getattr(decision, "train", None) or train
    return _Choice(decision=decision, plan=plan, recompute=chosen_train.recompute, loss=chosen_train.loss,
                   notes=tuple(notes))


def _pipeline_split(plan: ParallelPlan, train: TrainSpec, chosen: TrainSpec) -> tuple[ParallelPlan, list[str]]:
    """A searched pipeline plan's micro-batch count per dataloader batch: the schedule splits each
    dataloader batch (B = ``train.micro_batch``) into B / b micro-batches; Lightning's own gradient
    accumulation stays as the user set it."""
    if plan.pp == 1:
        return plan, []
    m = max(1, train.micro_batch // chosen.micro_batch)
    if m == plan.microbatches:
        return plan, []
    note = (f"pipeline micro-batches per dataloader batch: {m} (micro-batch {chosen.micro_batch} of batch "
            f"{train.micro_batch}; the planner counted {plan.microbatches} per optimizer step)")
    return dataclasses.replace(plan, microbatches=m), [note]


def _verified_choice(
    choice: _Choice, train: TrainSpec, model_spec: ModelSpec, layout: TransformerLayout | None, module: nn.Module,
    units: _UnitRule, calibrated: Callable[[ParallelPlan, TrainSpec], MemoryEstimate], *, self_parallel: bool,
) -> _Choice:
    """The first ranked candidate whose calibrated estimate fits (``parallel/verify.py``), the planner's
    decision swapped to it with the checks recorded; ``PlanDoesNotFitError`` with the calibrated figures
    when none does."""
    from lightning_memplan.parallel.planner_bridge import ranked_candidates
    from lightning_memplan.parallel.verify import check_candidates, refusal
    from lightning_memplan.planning.budget import device_need
    from lightning_memplan.planning.decision import PlanDoesNotFitError

    decision = choice.decision
    ranked = [c for c in ranked_candidates(decision, train)
              if not applicability(c.plan, layout, module, self_parallel=self_parallel, seq_len=train.seq_len)]
    if not ranked:  # every candidate needs a dimension this module cannot take: the folded plan stands
        return dataclasses.replace(choice, notes=(*choice.notes, "no ranked candidate can be applied as planned; "
                                                  "the folded plan was not checked against the calibrated estimate"))

    def applied(candidate: Any) -> tuple[ParallelPlan, TrainSpec]:
        plan, _ = _pipeline_split(candidate.plan, train, candidate.train)
        return units.applied(plan), candidate.train

    def need(plan: ParallelPlan, chosen: TrainSpec, estimate: MemoryEstimate) -> int:
        return device_need(model_spec, chosen, plan, estimate, decision.hardware,
                           expandable_segments=decision.expandable_segments).reserved

    verdict = check_candidates(ranked, applied=applied, analytic=_analytic(model_spec), calibrated=calibrated, need=need)
    if verdict.index is None:
        closest = dataclasses.replace(decision, fits=False, checked=verdict.checked)
        raise PlanDoesNotFitError(refusal(decision, verdict.checked, untried=max(0, len(ranked) - len(verdict.checked))),
                                  closest)
    best = ranked[verdict.index]
    notes = list(choice.notes)
    if verdict.index:
        notes.append(f"memplan_auto chose {best.describe()}: the calibrated estimate of the module puts the "
                     f"{verdict.index} candidate(s) ranked before it over the budget")
    chosen = dataclasses.replace(decision, plan=best.plan, train=best.train, estimate=verdict.estimate, step=best.step,
                                 budget=best.budget, checked=verdict.checked)
    return _Choice(decision=chosen, plan=best.plan, recompute=best.train.recompute, loss=best.train.loss,
                   notes=tuple(notes))


def _analytic(model_spec: ModelSpec) -> Callable[[ParallelPlan, TrainSpec], MemoryEstimate]:
    from lightning_memplan.model.estimate import estimate_memory

    return lambda plan, train: estimate_memory(model_spec, train, plan)


def _resolution(
    choice: _Choice, model_spec: ModelSpec, train: TrainSpec, units: _UnitRule,
    calibrated: Callable[[ParallelPlan, TrainSpec], MemoryEstimate] | None, *, self_parallel: bool, forced: bool,
) -> Resolution:
    """The applied plan, its estimate (the calibrated one when it decided), the mesh and the offloads."""
    decision, notes = choice.decision, list(choice.notes)
    chosen_train = getattr(decision, "train", None) or train
    plan = choice.plan
    if not forced:
        plan, split_notes = _pipeline_split(plan, train, chosen_train)
        notes += split_notes
    plan = units.applied(plan)
    applied_train = chosen_train
    if forced and plan.pp > 1:
        # the schedule splits each dataloader batch into plan.microbatches micro-batches
        applied_train = applied_train.replace(micro_batch=max(1, applied_train.micro_batch // plan.microbatches))
    decision = _recorded_estimate(decision, model_spec, applied_train, plan, calibrated if forced else None)
    mesh = MeshLayout.from_plan(plan)
    notes += list(mesh.notes)
    # FSDP2's offloads the TrainSpec asks for (the planner's choice, or the user's): applied by parallel/apply.py
    offload = applied_train.offload if applied_train.framework == "torch" and not self_parallel else "none"
    if self_parallel and (applied_train.offload == "params" or applied_train.offload_activations):
        notes.append(
            "offload not applied: the module parallelises itself in configure_model; pass "
            "offload_policy=CPUOffloadPolicy() to its fully_shard calls, or wrap its blocks with offload_wrapper"
        )
    return Resolution(decision=decision, plan=plan, mesh=mesh, recompute=choice.recompute, loss=choice.loss,
                      notes=tuple(notes), offload=offload,
                      offload_activations=applied_train.offload_activations and not self_parallel)


def _recorded_estimate(
    decision: Any, model_spec: ModelSpec, applied_train: TrainSpec, plan: ParallelPlan,
    calibrated: Callable[[ParallelPlan, TrainSpec], MemoryEstimate] | None,
) -> Any:
    """The decision with the applied plan's estimate: a verified choice keeps its calibrated one; a forced
    plan records the calibrated one when ``calibrated`` answers (its analytic one beside it), else the
    analytic one."""
    if getattr(getattr(decision, "estimate", None), "source", None) == "calibrated":
        return decision
    refreshed = _estimate_or_none(model_spec, applied_train, plan)
    if isinstance(decision, ForcedDecision) and calibrated is not None:
        from lightning_memplan.parallel.calibrated import CalibrationUnavailable

        try:
            return dataclasses.replace(decision, estimate=calibrated(plan, applied_train), analytic=refreshed)
        except CalibrationUnavailable as exc:
            return dataclasses.replace(decision, estimate=refreshed, analytic=refreshed, note=f"not calibrated: {exc}")
    if refreshed is not None and dataclasses.is_dataclass(decision) and hasattr(decision, "estimate"):
        return dataclasses.replace(cast(Any, decision), estimate=refreshed)
    return decision


def _estimate_or_none(model: ModelSpec, train: TrainSpec, plan: ParallelPlan) -> Any:
    try:
        from lightning_memplan.model.estimate import estimate_memory
    except ImportError:
        return None
    try:
        return estimate_memory(model, train, plan)
    except ValueError:
        return None
