"""Calling the planner with what the strategy can actually apply.

The planner searches a larger space than a running Trainer can change. Before it is called, the
search is narrowed (``Allow``) to what memplan_auto applies:

* context parallelism is not applied (``cp=1``); sequence parallelism only where the layout takes it
  (``exclude`` holds ``"sp"`` otherwise, see ``tensor_parallel.sequence_parallel_blocker``);
* ZeRO-1 has no FSDP2 form (``zero`` in 0, 2, 3);
* the dataloader fixes the per-rank batch B: without PP the micro-batch must be B (Lightning's
  ``accumulate_grad_batches`` stays the user's); with PP the schedule splits B into micro-batches, so
  the micro-batch must divide B;
* the loss mode can change only when the model computes its loss with ``LinearCrossEntropy``, which
  then runs chunked or vocab-parallel;
* dimensions the module cannot be split along (``exclude``) are pinned to 1;
* quantized base weights and float8 linears (``TrainSpec.base_weights`` / ``float8``, read from the
  precision plugin and the module): tensor parallelism is not searched (bitsandbytes' packed weights and
  their constants are not DTensors; torchao's float8 tensor-parallel styles are not applied), nor FSDP
  sharding of int8 weights (their row scales live on the parameter); :func:`low_precision_limits` says
  why, and the decision's notes carry it into the explanation.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from typing import Any

from lightning_memplan.model.specs import ModelSpec, TrainSpec

__all__ = ["ESTIMATE_MARGIN", "expandable_segments_enabled", "hardware_for_run", "low_precision_limits", "narrow_allow",
           "planning_budget", "ranked_candidates", "run_planner"]


def hardware_for_run(hardware: Any, devices: int, num_nodes: int) -> Any:
    """A ``HardwareSpec`` with this run's ``devices`` per node and ``num_nodes``.

    ``hardware`` is ``None`` (detect the local machine), a preset name, or a ``HardwareSpec`` (its
    per-node count and nodes are replaced by the run's, with a warning when they differ).
    """
    from lightning_memplan.hardware import HardwareSpec

    if hardware is None:
        return HardwareSpec.detect(num_nodes=num_nodes).replace(gpus_per_node=devices, num_nodes=num_nodes)
    if isinstance(hardware, str):
        return HardwareSpec.preset(hardware, gpus_per_node=devices, num_nodes=num_nodes)
    if not isinstance(hardware, HardwareSpec):
        raise TypeError(f"hardware={hardware!r} must be None, a preset name such as 'h100-80gb' or a HardwareSpec")
    if (hardware.gpus_per_node, hardware.num_nodes) != (devices, num_nodes):
        warnings.warn(
            f"hardware={hardware.describe()!r} describes {hardware.gpus_per_node} devices x {hardware.num_nodes} "
            f"nodes but the Trainer runs {devices} x {num_nodes}; planning for the Trainer's world",
            UserWarning,
            stacklevel=2,
        )
    return hardware.replace(gpus_per_node=devices, num_nodes=num_nodes)


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def low_precision_limits(train: TrainSpec) -> dict[str, str]:
    """``{dimension: why}`` for what memplan_auto cannot apply with ``train``'s quantized base weights or
    float8 linears: ``"tp"`` (tp pinned to 1) and, for int8 weights, ``"zero"`` (FSDP sharding, zero 2 and
    3); ``{}`` without either. The rules of the estimate (``model/low_precision.check_plan``) as limits of
    the search."""
    out: dict[str, str] = {}
    if train.base_weights is not None:
        out["tp"] = (f"tensor parallelism not searched: base_weights={train.base_weights!r} are bitsandbytes' packed "
                     "weights with per-block constants, which are not DTensors and cannot be split by rows or "
                     "columns (DDP replicates them, FSDP2 shards them whole)")
        if train.base_weights == "int8":
            out["zero"] = ("FSDP sharding (zero=2/3) not searched: base_weights='int8' keeps its row scales (SCB) on "
                           "bitsandbytes' Int8Params, which FSDP drops when it shards the parameter")
    elif train.float8 is not None:
        out["tp"] = (f"tensor parallelism not searched: float8={train.float8!r} linears under tensor parallelism "
                     "need torchao's float8 parallel styles, which memplan_auto does not apply")
    return out


def narrow_allow(
    allow: Any, train: TrainSpec, exclude: set[str], *, has_lce: bool, pipeline: bool, world: int | None = None
) -> Any:
    """The user's ``allow`` intersected with what the strategy can apply (see the module docstring;
    :func:`low_precision_limits` for quantized and float8 weights).

    ``exclude`` names whole dimensions (``"tp"``: tp pinned to 1) or single sizes (``"tp=4"``, from
    :func:`~lightning_memplan.parallel.decision.module_blockers`; dropped from the divisors of
    ``world``)."""
    from lightning_memplan.planning import Allow

    spec = Allow.parse(allow)

    def keep(name: str, values: tuple[Any, ...]) -> tuple[Any, ...]:
        current = getattr(spec, name)
        out = values if current is None else tuple(v for v in current if v in values)
        if not out:
            raise ValueError(
                f"allow restricts {name} to {current!r}, but memplan_auto can only apply {values!r} here; relax allow"
            )
        return out

    low = low_precision_limits(train)
    exclude = exclude | ({"tp"} if "tp" in low else set())
    sp_values = (False,) if {"sp", "tp"} & exclude else (False, True)
    zero = (0,) if "zero" in low else (0, 2, 3)
    changes: dict[str, Any] = {"cp": keep("cp", (1,)), "sp": keep("sp", sp_values), "zero": keep("zero", zero)}
    for dim in ("tp", "pp"):
        if dim in exclude:
            changes[dim] = keep(dim, (1,))
        elif world is not None and any(e.startswith(f"{dim}=") for e in exclude):
            changes[dim] = keep(dim, tuple(d for d in _divisors(world) if f"{dim}={d}" not in exclude))
    b = train.micro_batch
    changes["micro_batch"] = keep("micro_batch", _divisors(b) if pipeline and "pp" not in exclude else (b,))
    # LinearCrossEntropy runs chunked or vocab-parallel under memplan_auto (never full logits);
    # a module without it materialises its logits whatever the plan says.
    changes["loss"] = keep("loss", ("chunked", "vocab_parallel")) if has_lce else (train.loss,)
    return dataclasses.replace(spec, **changes)


def applicable(candidate: Any, train: TrainSpec) -> bool:
    """Whether a planner candidate can run on the dataloader's batch B = ``train.micro_batch``.

    Without PP the micro-batch must be B with the user's accumulation. With PP the schedule splits B
    into m = B / b micro-batches, which must pass
    :func:`~lightning_memplan.model.runnable.pipeline_schedule_blocker` (1F1B: m >= pp;
    interleaved: m a multiple of pp; GPipe: any m).
    """
    from lightning_memplan.model.runnable import pipeline_schedule_blocker

    plan, b, batch = candidate.plan, candidate.train.micro_batch, train.micro_batch
    if plan.pp == 1:
        return b == batch and candidate.train.grad_accumulation == train.grad_accumulation
    if batch % b:
        return False
    # the rule memplan_auto checks a forced plan with (runnable_forced_schedule)
    return pipeline_schedule_blocker(pp=plan.pp, schedule=plan.schedule, microbatches=batch // b, batch=batch) is None


def rank_key(candidate: Any) -> float:
    """Seconds per token times the planner's own ranking factor (change cost and the simplicity margin
    per parallel dimension, :func:`~lightning_memplan.planning.search.ranking_factor`): the key
    ``plan()`` ranks by, so memplan_auto and the planner agree wherever both can apply a plan.

    The planner ranks per token too, which compares layouts fairly under a Trainer, where the
    dataloader fixes the per-rank batch and the global batch grows with dp.
    """
    from lightning_memplan.planning.search import parallel_axes, ranking_factor

    plan = candidate.plan
    factor = ranking_factor(candidate.change_cost, len(parallel_axes(plan.tp, plan.pp, plan.cp)),
                            modelled=candidate.step.modelled)
    return factor / max(candidate.tokens_per_s, 1e-30)


def ranked_candidates(decision: Any, train: TrainSpec) -> list[Any]:
    """The candidates of a :func:`run_planner` decision memplan_auto can apply to the dataloader batch
    (:func:`applicable`), its choice first, then by :func:`rank_key`: the order the calibrated check
    walks (``parallel/verify.py``)."""
    usable = sorted((c for c in decision.candidates if applicable(c, train)), key=rank_key)
    first = [c for c in usable if c.plan == decision.plan and c.train == decision.train][:1]
    return first + [c for c in usable if c not in first]


#: Candidates the planner keeps for re-ranking.
TOP_K = 64

#: Fraction of an explicit ``memory_budget`` held back from the search, so that a plan said to fit is
#: under the budget when measured: the per-rank estimate is within +-5 % of the tensor tracker's
#: measured peak on the layouts memplan_auto applies (tests/distributed/test_strategy_3d.py,
#: test_strategy_budget.py; benchmarks/bench_strategy_memory.py), and one budget case
#: measured 0.2 % over an estimate that just fitted.
ESTIMATE_MARGIN = 0.05


def planning_budget(memory_budget: int | None) -> int | None:
    """The budget the search is run against: ``memory_budget * (1 - ESTIMATE_MARGIN)`` (``None`` stays
    ``None``: the derived device budget has its own headroom, and the fit uses the modelled reserved bytes)."""
    if memory_budget is None:
        return None
    return int(memory_budget * (1.0 - ESTIMATE_MARGIN))


def expandable_segments_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process's CUDA caching allocator is configured with ``expandable_segments:True``
    (``PYTORCH_ALLOC_CONF``, or its older name ``PYTORCH_CUDA_ALLOC_CONF``: comma-separated
    ``key:value`` pairs; PyTorch docs, "CUDA semantics: Optimizing memory usage with
    PYTORCH_CUDA_ALLOC_CONF"), so the planner models the reserved bytes the run will have."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        for item in environ.get(name, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments":
                return value.strip().lower() == "true"
    return False


def run_planner(
    model: ModelSpec,
    train: TrainSpec,
    *,
    hardware: Any,
    devices: int,
    num_nodes: int,
    memory_budget: int | None,
    headroom: float,
    allow: Any,
    exclude: set[str],
    has_lce: bool,
) -> Any:
    """``plan(...)`` over the applicable space, re-ranked per token; raises ``PlanDoesNotFitError``
    (a ``ValueError`` with the shortfall and the cheapest changes) when nothing fits.

    Returns the planner's ``PlanDecision`` with the chosen candidate swapped in (a note says so when
    it differs from the planner's own first choice).
    """
    from lightning_memplan.planning import plan

    hw = hardware_for_run(hardware, devices, num_nodes)
    given_budget, memory_budget = memory_budget, planning_budget(memory_budget)
    expandable = expandable_segments_enabled()
    world = devices * num_nodes
    narrowed = narrow_allow(allow, train, exclude, has_lce=has_lce, pipeline=True, world=world)
    try:
        decision = plan(model, train, hw, memory_budget=memory_budget, headroom=headroom, allow=narrowed, top_k=TOP_K,
                        expandable_segments=expandable)
    except ValueError as exc:
        if "no layout could be evaluated" not in str(exc):
            raise
        raise ValueError(_nothing_evaluated(model, train, hw.world_size, memory_budget, exc)) from exc
    usable = [c for c in decision.candidates if applicable(c, train)] if decision.fits else []
    if not usable:
        narrowed = narrow_allow(allow, train, exclude | {"pp"}, has_lce=has_lce, pipeline=False, world=world)
        decision = plan(model, train, hw, memory_budget=memory_budget, headroom=headroom, allow=narrowed, top_k=TOP_K,
                        expandable_segments=expandable)
        try:
            decision.require_fit()
        except ValueError as exc:
            if given_budget is not None and exc.args:  # say where the smaller budget comes from
                exc.args = (
                    f"{exc.args[0]} (planned against memory_budget={given_budget:,} B minus the "
                    f"{ESTIMATE_MARGIN:.0%} estimate margin: {memory_budget:,} B)",
                    *exc.args[1:],
                )
            raise
        return _with_notes(decision, given_budget, memory_budget, train)
    best = min(usable, key=rank_key)
    if best.plan == decision.plan and best.train == decision.train:
        return _with_notes(decision, given_budget, memory_budget, train)
    note = (
        f"memplan_auto chose {best.describe()} over the planner's first {decision.chosen.describe()}: "
        "ranked per token (the dataloader fixes the per-rank batch) among plans it can apply"
    )
    return _with_notes(dataclasses.replace(
        decision,
        plan=best.plan,
        train=best.train,
        estimate=best.estimate,
        step=best.step,
        budget=best.budget,
        notes=(*decision.notes, note),
    ), given_budget, memory_budget, train)


def _with_notes(decision: Any, given: int | None, planned: int | None, train: TrainSpec | None = None) -> Any:
    """``decision`` with the notes of what the search left out for ``train``'s low precision
    (:func:`low_precision_limits`) and of the estimate margin (when a budget was given)."""
    limits = tuple(low_precision_limits(train).values()) if train is not None else ()
    if limits:
        decision = dataclasses.replace(decision, notes=(*decision.notes, *limits))
    if given is None or planned is None:
        return decision
    from lightning_memplan.model.result import readable_bytes

    note = (
        f"planned against memory_budget={given:,} B minus a {ESTIMATE_MARGIN:.0%} estimate margin: "
        f"{planned:,} B ({readable_bytes(planned)}), so that a plan that fits it stays under the budget measured"
    )
    return dataclasses.replace(decision, notes=(*decision.notes, note))


def _nothing_evaluated(model: ModelSpec, train: TrainSpec, world: int, budget: int | None, exc: Exception) -> str:
    # The planner rejected every layout by its bounds before estimating one, so it has no closest plan;
    # state the most sharded data-parallel layout's need instead of an empty error.
    from lightning_memplan.model.estimate import estimate_memory
    from lightning_memplan.model.specs import ParallelPlan

    sharded = ParallelPlan(dp=world, zero=3 if world > 1 else 0)
    need = estimate_memory(model, train, sharded).total
    from lightning_memplan.model.result import readable_bytes

    where = f"budget {budget:,} B ({readable_bytes(budget)})" if budget is not None else "the device budget"
    return (
        f"no parallel plan fits {world} rank(s) within {where}: the closest data-parallel layout, "
        f"{sharded.describe()}, needs {need:,} B ({readable_bytes(need)}) per rank (short by "
        f"{readable_bytes(need - (budget or 0))}); raise "
        f"memory_budget, use more devices, or shrink the micro-batch ({train.micro_batch}) or sequence "
        f"({train.seq_len}). Planner: {exc}"
    )
