"""``plan()``: the cheapest-to-run layout whose worst rank fits the memory budget.

"Fits": the worst rank's modelled peak *reserved* bytes (on CUDA: the caching allocator's segments,
FSDP2's side-stream pools and block rounding on top of the allocated tensors; on CPU the allocated
bytes) are at most ``memory * (1 - headroom) - CUDA context - NCCL`` (``planning.budget``).

Search (analytic, no profiling):

1. :func:`~lightning_memplan.planning.space.enumerate_layouts` lists every ``dp x tp x pp x cp = world``
   layout with its micro-batch and schedule, rejecting shape-invalid ones with a reason.
2. :class:`~lightning_memplan.planning.timing.StepTimeModel` prices each layout; every inner option
   (zero, sp, recompute, loss) gets ``score = step_time * (1 + CHANGE_PENALTY * change_cost) *
   (1 + SIMPLICITY_MARGIN) ** axes`` (axes: how many of tp, pp, cp it uses; the margin only where the
   step is modelled): a parallel dimension must be predicted to buy > 5 %, the time model's error band.
3. Best-first: layouts are visited in order of a lower bound of their score, their options in score
   order; the memory model (:func:`~lightning_memplan.model.estimate.estimate_memory`) is called only
   for what is visited. The first option of a layout that fits becomes a candidate; the search stops
   with ``top_k`` candidates. What was never visited is reported as "slower" with its bound.

Pruning that keeps it fast and exact:
- the worst rank is stage 0 or the last stage (stage 0 holds the most in-flight micro-batches, the
  most blocks and the embedding; the last holds the lm_head and the logits), so two ranks are
  estimated per candidate, not p;
- on first visit a layout is checked with its most memory-saving options; if even that misses the
  budget the whole layout is rejected with one reason, and so is every larger micro-batch of the same
  (dp, tp, pp, cp) (activations grow with b; GPipe and interleaving hold more in flight than 1F1B).
  The chunked and vocab-parallel losses are each checked (neither bounds the other); with at most 2
  blocks per stage no such miss is a bound (full recompute's rebuilt block may exceed less); and since
  only FSDP (zero >= 2) reserves FSDP2's side-stream pools, an FSDP miss bounds ZeRO-0/1 only when it
  misses without them, else the highest ZeRO below 2 is checked as well.

Nothing in the ranking knows rules such as "TP inside a node": they follow from the time model (a
cross-node TP all-reduce is priced at network bandwidth) and the memory model (more DP at fixed
micro-batch shards nothing without ZeRO).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from lightning_memplan.hardware.presets import CHIP_TABLE
from lightning_memplan.hardware.spec import HardwareSpec
from lightning_memplan.model.result import Calibration
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.planning.budget import need_text
from lightning_memplan.planning.decision import Candidate, PlanDecision, Suggestion
from lightning_memplan.planning.search import (
    CHANGE_COST,
    CHANGE_PENALTY,
    DEFAULT_TOP_K,
    SIMPLICITY_MARGIN,
    _Search,
)
from lightning_memplan.planning.space import Allow
from lightning_memplan.validation import check_bool, check_int, check_number, check_optional_int

__all__ = ["CHANGE_COST", "CHANGE_PENALTY", "DEFAULT_TOP_K", "SIMPLICITY_MARGIN", "plan"]

GiB = 2**30


def _check_inputs(
    model: Any, train: Any, hardware: Any, global_batch: Any, memory_budget: Any, headroom: Any
) -> tuple[int | None, float | None, float]:
    """The specs' types; ``global_batch``, ``memory_budget``, ``headroom`` as plain Python numbers."""
    for name, value, cls in (("model", model, ModelSpec), ("train", train, TrainSpec), ("hardware", hardware, HardwareSpec)):
        if not isinstance(value, cls):
            hint = " (HardwareSpec.preset('h100-80gb', gpus_per_node=8))" if cls is HardwareSpec else ""
            raise TypeError(f"{name}={value!r:.200} must be a {cls.__name__}{hint}")
    batch = check_optional_int("global_batch", global_batch, hint="sequences per optimizer step, or None")
    budget = None
    if memory_budget is not None:
        budget = check_number(
            "memory_budget", memory_budget, minimum=1.0,
            hint="a finite number of bytes per device (e.g. 70 * 2**30); pass None to derive it from the device "
            "memory, headroom and overheads",
        )
    room = check_number("headroom", headroom, minimum=0.0, maximum=1.0, max_inclusive=False,
                        hint="a fraction, e.g. 0.1 for 10 % of device memory")
    return batch, budget, room


def plan(
    model: ModelSpec,
    train: TrainSpec,
    hardware: HardwareSpec,
    *,
    global_batch: int | None = None,
    memory_budget: float | None = None,
    headroom: float = 0.1,
    allow: Any = None,
    calibration: Calibration | None = None,
    top_k: int = DEFAULT_TOP_K,
    expandable_segments: bool = False,
    host_memory_budget: float | None = None,
) -> PlanDecision:
    """Choose dp / ZeRO / tp (+sp) / pp (schedule, micro-batches) / cp, recompute, loss mode and
    micro-batch so the worst rank fits and the predicted step is fastest.

    Args:
        model: the architecture.
        train: the user's training settings; micro-batch, grad accumulation, recompute and loss mode may
            change in the chosen :attr:`PlanDecision.train` (precision and optimizer never do).
        hardware: the cluster (``world = gpus_per_node * num_nodes``; every GPU is used).
        global_batch: sequences per optimizer step; ``dp * micro_batch * m`` must equal it. ``None``
            keeps the per-replica batch ``train.micro_batch * train.grad_accumulation``.
        memory_budget: bytes per device the predicted peak reserved bytes (the allocated ones on CPU)
            must fit under; replaces the derived budget ``memory * (1 - headroom) - CUDA context - NCCL``
            (see ``planning.budget``).
        headroom: fraction of device memory kept free (default 10 %).
        allow: restrict the search (see :class:`~lightning_memplan.planning.space.Allow`): a sequence of
            names such as ``("dp", "fsdp", "tp", "pp")``, a dict such as ``{"tp": [1, 2], "recompute":
            ["none"]}``, or an ``Allow``.
        calibration: traced coefficients for this model (passed to ``estimate_memory``).
        top_k: ranked candidates to keep.
        expandable_segments: whether the run sets ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
            (no block rounding, no extra loss segment in the reserved bytes; ``model.reserved``).
        host_memory_budget: host bytes per node the offloads may use; replaces ``hardware.host_memory_bytes
            * (1 - headroom)``. Only when no layout fits on the devices does the planner offload (FSDP2's
            CPUOffloadPolicy, activation offloading: ``planning/offload.py``), within this budget shared by
            the node's ranks, and the explanation says so; ``allow={"offload": ["none"]}`` never offloads.

    Returns:
        :class:`PlanDecision`; when nothing fits, ``fits=False`` with the closest plan, its shortfall
        and :attr:`~PlanDecision.suggestions` (call :meth:`~PlanDecision.require_fit` to raise instead).

    Raises:
        ValueError: world size no layout divides, ``memory_budget <= 0``, a global batch no ``dp x
            micro-batch`` divides, an unknown ``allow`` name.
        TypeError: wrong argument types.
    """
    t0 = time.perf_counter()
    global_batch, memory_budget, headroom = _check_inputs(model, train, hardware, global_batch, memory_budget, headroom)
    top_k, expandable_segments, host_budget = _check_options(top_k, expandable_segments, host_memory_budget)
    explicit = None if memory_budget is None else int(memory_budget)

    def make_search(search_train: TrainSpec, search_allow: Allow, per_rank: int | None = None) -> _Search:
        return _Search(model, search_train, hardware, search_allow, global_batch, float(headroom), explicit,
                       calibration, top_k, expandable_segments=expandable_segments, host_budget=per_rank)

    search = make_search(train, Allow.parse(allow))
    found = search.run()
    candidates, notes, host_budget_used = _with_offload(search, found, hardware, host_budget, make_search)
    chosen, fits, shortfall, suggestions = _choose(search, found, candidates, allow)
    notes += _baseline_note(search, chosen)
    from lightning_memplan.planning.known import known_layout_notes

    notes += known_layout_notes(search, chosen, fits)
    stats = dict(found["stats"])
    stats["memory_evaluations"] = search.evaluations
    stats["seconds"] = time.perf_counter() - t0
    return PlanDecision(
        plan=chosen.plan, train=chosen.train, estimate=chosen.estimate, step=chosen.step,
        candidates=tuple(candidates), rejected=tuple(found["rejected"]), fits=fits, budget=chosen.budget,
        shortfall_bytes=max(0, shortfall), suggestions=suggestions, model=model, base_train=train,
        hardware=hardware, global_batch=global_batch, headroom=float(headroom), stats=stats, notes=tuple(notes),
        expandable_segments=expandable_segments, host_budget_bytes=host_budget_used if chosen.estimate.host else None,
    )


def _check_options(top_k: Any, expandable_segments: Any, host_memory_budget: Any) -> tuple[int, bool, int | None]:
    """``plan``'s ``top_k``, ``expandable_segments`` and ``host_memory_budget`` (bytes or ``None``), checked."""
    top_k = check_int("top_k", top_k, hint="ranked candidates to keep, e.g. 5")
    expandable_segments = check_bool(
        "expandable_segments", expandable_segments,
        hint="True when the run sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    if host_memory_budget is None:
        return top_k, expandable_segments, None
    return top_k, expandable_segments, int(check_number(
        "host_memory_budget", host_memory_budget, minimum=1.0,
        hint="host bytes per node the offloads may use (e.g. 1.5 * 2**40); None derives it from "
        "HardwareSpec.host_memory_bytes and headroom"))


def _with_offload(search: _Search, found: dict[str, Any], hardware: HardwareSpec, host_budget: int | None,
                  make_search: Any) -> tuple[list[Candidate], list[str], int | None]:
    """``(candidates, notes, host budget used)``: the search's candidates, or, when nothing fits on the
    devices, the offloading fallback's (``planning/offload.py``) where allowed and possible."""
    candidates: list[Candidate] = found["candidates"]
    notes = _notes(search, hardware)
    if candidates:
        return candidates, notes, None
    from lightning_memplan.planning.offload import offload_fallback

    fallback = offload_fallback(search, host_memory_budget=host_budget, make_search=make_search)
    return list(fallback.candidates), notes + list(fallback.notes), fallback.host_budget


def _choose(search: _Search, found: dict[str, Any], candidates: list[Candidate],
            allow: Any) -> tuple[Candidate, bool, int, tuple[Suggestion, ...]]:
    """``(chosen, fits, shortfall bytes, suggestions)``: the best candidate, or the closest miss with what
    to change."""
    if candidates:
        return candidates[0], True, 0, ()
    chosen = found["closest"]
    if chosen is None:  # every layout was rejected before any memory check
        raise ValueError(_nothing_evaluated(found["rejected"], allow))
    from lightning_memplan.planning.suggest import suggest

    return chosen, False, chosen.reserved_bytes - chosen.budget.budget, tuple(suggest(search, chosen))


def _nothing_evaluated(rejected: Any, allow: Any) -> str:
    """Why no layout reached a memory check: the most common rejection (a rule of the memory model that
    holds for every layout, e.g. a spec it cannot estimate, is named as such), and ``allow=`` only when
    one was given (DeepSeek-V3 once answered "relax allow=" with nothing given)."""
    from collections import Counter

    reasons = Counter(r.reason for r in rejected)
    if not reasons:
        return "no layout could be evaluated (the search space is empty); relax allow=" if allow is not None else (
            "no layout could be evaluated (the search space is empty)")
    reason, count = reasons.most_common(1)[0]
    text = f"no layout could be evaluated: {count} of {len(rejected)} layouts were rejected with: {reason}"
    return text + ("; or relax allow=" if allow is not None else "")


def _notes(search: _Search, hardware: HardwareSpec) -> list[str]:
    from lightning_memplan.planning.timing import time_model_applies

    notes = []
    assumed = hardware.assumed()
    if (assumed or hardware.fallback) and time_model_applies(hardware, search.train):
        notes.append(
            f"hardware figures assumed (fallback values, no datasheet): {', '.join(assumed) or 'all speeds'}; "
            "the time ranking is approximate, the memory check is not affected"
        )
    if hardware.name.lower() not in CHIP_TABLE and not hardware.source:
        notes.append(f"hardware {hardware.name!r} is user-described (no datasheet entry)")
    return notes


def _baseline_note(search: _Search, chosen: Candidate) -> list[str]:
    """Why not plain data parallelism with the user's settings: one line, for the explanation."""
    world, train = search.hardware.world_size, search.train
    per_replica = (search.global_batch // world) if search.global_batch else train.micro_batch * train.grad_accumulation
    if search.global_batch is not None and search.global_batch % world:
        return [f"plain data parallelism (dp={world}) is impossible: global_batch={search.global_batch} is not divisible by {world}"]
    b = train.micro_batch if per_replica % train.micro_batch == 0 else 1
    base_plan = ParallelPlan(world)
    base_train = train.replace(micro_batch=b, grad_accumulation=max(1, per_replica // b))
    if chosen.plan == base_plan and chosen.train == base_train:
        if not chosen.fits:
            return [f"plain data parallelism (dp={world}) with your settings is the closest plan"]
        if not chosen.step.modelled:
            return ["plain data parallelism with your settings fits and needs no changes"]
        return ["plain data parallelism with your settings fits and is the fastest choice"]
    try:
        est = search.worst(base_plan, base_train)
    except ValueError as exc:
        return [f"plain data parallelism (dp={world}) is invalid: {exc}"]
    if not search.fits(base_plan, base_train, est):
        return [f"plain data parallelism (dp={world}, your settings): {search.miss_reason(base_plan, base_train, est)}"]
    need = need_text(search.need(base_plan, base_train, est))
    if not chosen.step.modelled:
        return [f"plain data parallelism (dp={world}, your settings) would fit ({need})"]
    return [f"plain data parallelism (dp={world}, your settings) would fit ({need}) but is "
            "predicted slower than the choice"]


def with_nodes(hardware: HardwareSpec, factor: int) -> HardwareSpec:
    """``hardware`` with ``factor`` x the GPUs (more nodes; or more GPUs per node up to 8 on one node)."""
    if hardware.num_nodes == 1 and hardware.gpus_per_node * factor <= 8:
        return replace(hardware, gpus_per_node=hardware.gpus_per_node * factor)
    return replace(hardware, num_nodes=hardware.num_nodes * factor)
