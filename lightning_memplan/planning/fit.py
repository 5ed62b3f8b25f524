"""The largest fit: the largest micro-batch b, or sequence length s, whose worst rank fits the budget
over every phase of the run, with the planner's own fit test and no trial step.

Fits: the rule :func:`~lightning_memplan.planning.plan` applies to each candidate
(``planning.search._Search.fits``), from the same two functions: the worst rank's
:func:`~lightning_memplan.planning.budget.device_need` (on CUDA the caching allocator's modelled peak
*reserved* bytes, ``model.reserved``; elsewhere the allocated bytes, the estimate's ``total``) at most
:func:`~lightning_memplan.planning.budget.memory_budget` (``memory * (1 - headroom) - CUDA context -
NCCL``, or ``memory_budget=`` as given).

Measured margin (``reserved_margin=``, CUDA only): the need is the estimate's allocated bytes plus the
caching allocator's margin a run measured (:class:`~lightning_memplan.model.reserved.ReservedMargin`, from
:func:`lightning_memplan.report.margin.measured_reserved_margin`) instead of the modelled reserved bytes:
``need = total + overhead * max(1, D / D_ref)``, ``D`` the candidate's batch-dependent bytes and ``D_ref``
those at the shape the margin was measured at, both estimated here from the same specs (one estimate more).
It is non-decreasing in b and s as the rest, so the search stays exact. Where no caching allocator applies
(a CPU step) it is ignored, as the modelled terms are.

Every phase: the estimate's ``total`` is the largest of its per-phase peaks (``by_phase``: forward,
backward, optimizer), so a fit holds in each; :attr:`LargestFit.binding_phase` names the phase whose peak
misses first. A validation, test or predict step at the same (b, s) runs under ``no_grad``: it holds the
parameters, the optimizer states and the last step's gradients (Lightning does not free them between
training and validation), one block's transient activations and the logits (with their loss buffers),
a subset of what the training forward holds at its peak, so it never binds at the training shape; the
memory model has no separate eval-step estimate, and a larger eval batch is the user's to check.

Search: doubling (1, 2, 4, ... until a miss or the bound), then bisection between the last fit and the
first miss: ``O(log bound)`` estimates, at most ``2 * log2(bound) + 2`` (41 for b up to 2**20).
Bisection is exact because the need is non-decreasing in b and in s: every batch-dependent term of
``estimate_memory`` is a non-negative coefficient times ``b*s`` or ``b*s^2`` or a per-micro-batch count
(activations, attention scores, logits, workspace; a chunked loss's chunk is ``min(tokens, chunk)``),
the states do not depend on the batch, the worst rank is a maximum of non-decreasing functions, and the
reserved model rounds each segment up (a non-decreasing map). A traced calibration is clamped at 0 per
component; where its fitted curve is not monotone the answer still fits (it was estimated), it may
then not be the largest.

Valid values (what is searched):

- b: any ``1 <= b <= MAX_MICRO_BATCH``. Under pipeline parallelism ``TrainSpec.micro_batch`` is one
  micro-batch and the dataloader batch is ``b * plan.microbatches``, always divisible by the
  micro-batch count, so the schedule (:func:`~lightning_memplan.model.runnable.pipeline_schedule_blocker`)
  constrains ``plan.microbatches``, never b.
- s: multiples of :func:`seq_len_unit` (context parallelism's load-balanced causal split needs
  ``2c | s``, sequence parallelism ``t | s / c``: the planner's shape rules, ``planning.space``), up to
  the model's ``max_positions`` (a learned position table has no more rows; a RoPE model's trained
  context) or :data:`MAX_SEQ_LEN` without one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_memplan.hardware.spec import HardwareSpec
from lightning_memplan.model.estimate import estimate_memory
from lightning_memplan.model.reserved import ReservedEstimate, ReservedMargin, batch_dependent_bytes
from lightning_memplan.model.result import Calibration, MemoryEstimate, readable_bytes
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.planning import budget as rule
from lightning_memplan.planning.budget import Budget, need_text
from lightning_memplan.validation import check_bool, check_choice, check_int, check_number

__all__ = ["AXES", "MAX_MICRO_BATCH", "MAX_SEQ_LEN", "LargestFit", "check_reserved_margin", "largest_fit",
           "largest_true", "max_micro_batch", "max_seq_len", "seq_len_unit"]

#: Largest micro-batch searched (a bound that keeps the search to at most 41 estimates for any input).
MAX_MICRO_BATCH = 2**20
#: Largest sequence length searched when the model has no ``max_positions`` (16 Mi tokens).
MAX_SEQ_LEN = 2**24
#: What :func:`largest_fit` can search.
AXES = ("micro_batch", "seq_len")


@dataclass(frozen=True, kw_only=True)
class LargestFit:
    """The answer of :func:`largest_fit` and what binds it.

    Attributes:
        axis: ``"micro_batch"`` or ``"seq_len"``.
        value: the largest fitting value (0 when even the smallest valid one misses).
        unit: values searched are multiples of it (1 for b; :func:`seq_len_unit` for s).
        bound: the largest value searched (:data:`MAX_MICRO_BATCH`, ``max_positions`` or
            :data:`MAX_SEQ_LEN`, rounded down to ``unit``); ``value == bound`` means the bound binds.
        budget: the budget compared with (:class:`~lightning_memplan.planning.budget.Budget`).
        estimate, need: the worst rank's estimate and device need at ``value`` (``None`` when 0).
        miss_estimate, miss_need: at ``value + unit``, the first value that misses (``None`` when
            the bound binds).
        evaluations: memory estimates made (the search's, plus the reference shape's with a measured
            margin).
        reserved_margin: the measured margin the need was built from (``None``: the modelled reserved
            bytes, or allocated bytes off CUDA).
    """

    axis: str
    value: int
    unit: int
    bound: int
    budget: Budget
    estimate: MemoryEstimate | None
    need: ReservedEstimate | None
    miss_estimate: MemoryEstimate | None
    miss_need: ReservedEstimate | None
    evaluations: int
    reserved_margin: ReservedMargin | None = None

    @property
    def bound_binds(self) -> bool:
        """Whether the search bound, not memory, stopped it."""
        return self.miss_estimate is None

    @property
    def binding_phase(self) -> str:
        """The phase whose peak misses first (``"forward"``, ``"backward"``, ``"optimizer"``), or
        ``"bound"`` when the search bound binds."""
        return "bound" if self.miss_estimate is None else self.miss_estimate.peak_phase

    @property
    def binding_component(self) -> str:
        """The largest component at the first miss's peak (as the planner's rejections name it), or
        ``"bound"``."""
        return "bound" if self.miss_estimate is None else self.miss_estimate.largest_component()

    def describe(self) -> str:
        """One line: the value and what binds it."""
        name = "micro-batch" if self.axis == "micro_batch" else "sequence length"
        if self.miss_estimate is None or self.miss_need is None:
            return f"largest {name}: {self.value} (the search bound {self.bound}; memory does not bind)"
        shown = self.value + self.unit
        margin = ""
        if self.reserved_margin is not None:
            margin = f" with a reserved margin of {readable_bytes(self.miss_need.measured_margin)}"
        return (
            f"largest {name}: {self.value}; at {shown} the {self.binding_phase} peak needs "
            f"{need_text(self.miss_need)}{margin} > {readable_bytes(self.budget.budget)} budget (largest: "
            f"{self.binding_component} {readable_bytes(getattr(self.miss_estimate, self.binding_component))})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "axis": self.axis, "value": self.value, "unit": self.unit, "bound": self.bound,
            "binding_phase": self.binding_phase, "binding_component": self.binding_component,
            "budget": self.budget.to_dict(),
            "need_bytes": None if self.need is None else self.need.reserved,
            "allocated_bytes": None if self.estimate is None else self.estimate.total,
            "miss_need_bytes": None if self.miss_need is None else self.miss_need.reserved,
            "miss_allocated_bytes": None if self.miss_estimate is None else self.miss_estimate.total,
            "evaluations": self.evaluations,
            **({"reserved_margin": self.reserved_margin.to_dict()} if self.reserved_margin is not None else {}),
        }


def seq_len_unit(plan: ParallelPlan) -> int:
    """The step of valid sequence lengths: ``2c`` with context parallelism (load-balanced causal split),
    a multiple of ``c t`` with sequence parallelism (``t | s / c``), their least common multiple."""
    unit = 2 * plan.cp if plan.cp > 1 else 1
    if plan.sp and plan.tp > 1:
        unit = math.lcm(unit, plan.cp * plan.tp)
    return unit


def _check(model: Any, train: Any, plan: Any, memory_budget_: Any, hardware: Any, headroom: Any,
           expandable_segments: Any, calibration: Any) -> tuple[ParallelPlan, int | None, float, bool]:
    for name, value, cls in (("model", model, ModelSpec), ("train", train, TrainSpec)):
        if not isinstance(value, cls):
            raise TypeError(f"{name}={value!r:.200} must be a {cls.__name__}")
    if plan is None:
        plan = ParallelPlan()
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"plan={plan!r:.200} must be a ParallelPlan (or None for one device)")
    if hardware is not None and not isinstance(hardware, HardwareSpec):
        raise TypeError(f"hardware={hardware!r:.200} must be a HardwareSpec (e.g. HardwareSpec.preset('h100-80gb')) "
                        "or None")
    if calibration is not None and not isinstance(calibration, Calibration):
        raise TypeError(f"calibration={calibration!r:.200} must be a Calibration from trace.calibrate() or None")
    budget = None
    if memory_budget_ is not None:
        budget = int(check_number("memory_budget", memory_budget_, minimum=1.0,
                                  hint="a finite number of bytes per device (e.g. 70 * 2**30), or None to derive "
                                  "it from hardware= and headroom="))
    elif hardware is None:
        raise ValueError("memory_budget=None and hardware=None: pass memory_budget= (bytes per device) or "
                         "hardware= (e.g. HardwareSpec.preset('h100-80gb') or HardwareSpec.detect())")
    room = check_number("headroom", headroom, minimum=0.0, maximum=1.0, max_inclusive=False,
                        hint="a fraction, e.g. 0.1 for 10 % of device memory")
    expandable = check_bool("expandable_segments", expandable_segments,
                            hint="True when the run sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    return plan, budget, room, expandable


def check_reserved_margin(value: Any, *, expandable_segments: bool | None = None,
                          name: str = "reserved_margin") -> ReservedMargin | None:
    """``reserved_margin=`` at the door: ``None``; a :class:`ReservedMargin`; or an int of bytes (a NumPy
    integer or a 0-d integer tensor too), a fixed margin at every shape. A margin that records the
    measured run's ``expandable_segments`` must match ``expandable_segments`` (when given): the two
    allocator settings reserve differently, so one's margin does not describe the other.

    Raises:
        TypeError: neither (a float, a bool, a string, a dict). ValueError: a negative or >= 2**63 byte
        count; a margin measured under the other ``expandable_segments`` setting.
    """
    if value is None:
        return None
    if isinstance(value, ReservedMargin):
        margin = value
    else:
        try:
            overhead = check_int(name, value, minimum=0, maximum=2**63 - 1)
        except TypeError:
            raise TypeError(
                f"{name}={value!r:.120} must be a ReservedMargin (measured_reserved_margin(report), "
                "MemoryPlanCallback.reserved_margin), an int of bytes (reserved - allocated, e.g. 2 * 2**30) or None "
                "for the modelled reserved bytes"
            ) from None
        except ValueError:
            raise ValueError(f"{name}={value!r:.120} must be a byte count in [0, 2**63), e.g. 2 * 2**30, or None "
                             "for the modelled reserved bytes") from None
        margin = ReservedMargin(overhead=overhead)
    if (expandable_segments is not None and margin.expandable_segments is not None
            and margin.expandable_segments != expandable_segments):
        raise ValueError(
            f"{name}={margin!r:.300} was measured with expandable_segments={margin.expandable_segments} but "
            f"expandable_segments={expandable_segments}: the allocator reserves differently under the two settings; "
            "measure a run with the setting you plan for, or pass reserved_margin=None for the modelled margin"
        )
    return margin


def largest_fit(
    model: ModelSpec,
    train: TrainSpec,
    plan: ParallelPlan | None = None,
    *,
    axis: str = "micro_batch",
    memory_budget: float | None = None,
    hardware: HardwareSpec | None = None,
    headroom: float = 0.1,
    expandable_segments: bool = False,
    calibration: Calibration | None = None,
    reserved_margin: ReservedMargin | int | None = None,
) -> LargestFit:
    """The largest ``axis`` value (``train``'s other batch dimension kept) whose worst rank fits, with what
    binds it (module docstring: the rule, the search, the valid values).

    Args:
        model, train, plan: as for :func:`~lightning_memplan.model.estimate.estimate_memory`
            (``plan=None``: one device); ``train.micro_batch`` (or ``seq_len``) is what is replaced.
        axis: ``"micro_batch"`` or ``"seq_len"``.
        memory_budget: bytes per device the need must fit under; replaces the derived budget (as
            ``plan(memory_budget=)`` does). Needed when ``hardware`` is ``None``.
        hardware: the device (its memory, and whether it is a CPU host); ``None`` with
            ``memory_budget``: the caching allocator's reserved bytes are compared when
            ``train.device == "cuda"``, the allocated ones otherwise.
        headroom: fraction of device memory kept free (with ``hardware`` and no ``memory_budget``).
        expandable_segments: the run sets ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.
        calibration: traced coefficients for this model (passed to ``estimate_memory``).
        reserved_margin: on CUDA, the caching allocator's margin a run measured
            (:class:`~lightning_memplan.model.reserved.ReservedMargin`, e.g.
            ``measured_reserved_margin(report)``), or an int of bytes added at every shape: the need is
            the allocated bytes plus it (module docstring) instead of the modelled reserved bytes.
            ``None``: the modelled ones. Ignored off CUDA.

    Raises:
        TypeError: wrong argument types. ValueError: neither ``memory_budget`` nor ``hardware``, a
        budget < 1 byte, ``headroom`` outside [0, 1), an unknown ``axis``, a plan that cannot split this
        model (tp not dividing the heads, pp > L), a negative ``reserved_margin`` or one measured under
        the other ``expandable_segments`` setting.
    """
    plan, explicit, room, expandable = _check(model, train, plan, memory_budget, hardware, headroom,
                                              expandable_segments, calibration)
    cuda = rule.caching_allocator_applies(hardware, train)
    margin = check_reserved_margin(reserved_margin, expandable_segments=expandable if cuda else None)
    if not cuda:
        margin = None  # no caching allocator: the allocated bytes are the need
    axis = check_choice("axis", axis, AXES)
    budget = rule.memory_budget(hardware, plan, headroom=room, explicit=explicit)
    if axis == "micro_batch":
        unit, bound = 1, MAX_MICRO_BATCH
    else:
        unit = seq_len_unit(plan)
        cap = model.max_positions if model.max_positions is not None else MAX_SEQ_LEN
        bound = cap // unit * unit
    seen: dict[int, tuple[MemoryEstimate, ReservedEstimate, bool]] = {}
    reference = _reference_dynamic(model, train, plan, margin, calibration)

    def probe(k: int) -> bool:
        value = k * unit
        shaped = train.replace(**{axis: value})
        est = estimate_memory(model, shaped, plan, calibration=calibration)  # the worst rank
        if margin is not None:
            need = margin.need(est, reference, expandable_segments=expandable)
        else:
            need = rule.device_need(model, shaped, plan, est, hardware, expandable_segments=expandable)
        fits = need.reserved <= budget.budget  # planning.search._Search.fits
        seen[k] = (est, need, fits)
        return fits

    k = largest_true(probe, bound // unit) if bound >= unit else 0
    hit, miss = seen.get(k), seen.get(k + 1)
    return LargestFit(
        axis=axis, value=k * unit, unit=unit, bound=bound, budget=budget,
        estimate=hit[0] if hit and k else None, need=hit[1] if hit and k else None,
        miss_estimate=miss[0] if miss else None, miss_need=miss[1] if miss else None,
        evaluations=len(seen) + (reference is not None), reserved_margin=margin,
    )


def _reference_dynamic(model: ModelSpec, train: TrainSpec, plan: ParallelPlan, margin: ReservedMargin | None,
                       calibration: Calibration | None) -> int | None:
    """The batch-dependent bytes of the estimate at the shape ``margin`` was measured at (``None`` for
    no margin or a fixed one)."""
    if margin is None or margin.micro_batch is None or margin.seq_len is None:
        return None
    try:
        shaped = train.replace(micro_batch=margin.micro_batch, seq_len=margin.seq_len)
        return batch_dependent_bytes(estimate_memory(model, shaped, plan, calibration=calibration))
    except ValueError as exc:
        raise ValueError(
            f"reserved_margin was measured at {margin.micro_batch} x {margin.seq_len}, a shape this plan cannot "
            f"estimate ({exc}); pass the margin of a run of this plan, an int of bytes, or None"
        ) from None


def largest_true(fits: Callable[[int], bool], limit: int) -> int:
    """The largest ``k`` in ``[0, limit]`` with ``fits(k)`` for a non-increasing predicate (``fits(0)``
    holds by convention); ``fits(k + 1)`` has been called unless ``k == limit``, so the caller knows
    the first miss. Doubling, then bisection: at most ``2 * ceil(log2(limit + 1)) + 1`` calls."""
    lo, hi, k = 0, None, 1
    while k <= limit:
        if not fits(k):
            hi = k
            break
        lo, k = k, 2 * k
    if hi is None:  # every power of two up to the limit fits
        if lo == limit or fits(limit):
            return limit
        hi = limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def max_micro_batch(
    model: ModelSpec,
    train: TrainSpec,
    plan: ParallelPlan | None = None,
    *,
    memory_budget: float | None = None,
    hardware: HardwareSpec | None = None,
    headroom: float = 0.1,
    expandable_segments: bool = False,
    calibration: Calibration | None = None,
    reserved_margin: ReservedMargin | int | None = None,
) -> int:
    """The largest micro-batch b (at ``train.seq_len``) whose worst rank fits over every phase of the
    step; 0 when even b = 1 misses. Searched up to :data:`MAX_MICRO_BATCH`.

    The fit test is the planner's (reserved bytes on CUDA, modelled or with a measured
    ``reserved_margin``; allocated elsewhere; see :func:`largest_fit` for every argument and
    ``planning/fit.py`` for the search).

    ``train.seq_len`` is the size axis the memory grows with: the tokens of a text model, 1 for a model of
    fixed-size images or clips (with a ``calibration`` of it, as docs/callback.md shows for a CNN).

    Example::

        from lightning_memplan import HardwareSpec, ModelSpec, ParallelPlan, TrainSpec, max_micro_batch
        b = max_micro_batch(ModelSpec.preset("llama3-8b"), TrainSpec(micro_batch=1, seq_len=8192),
                            ParallelPlan(dp=8, zero=3), hardware=HardwareSpec.preset("h100-80gb"))
    """
    return largest_fit(model, train, plan, axis="micro_batch", memory_budget=memory_budget, hardware=hardware,
                       headroom=headroom, expandable_segments=expandable_segments, calibration=calibration,
                       reserved_margin=reserved_margin).value


def max_seq_len(
    model: ModelSpec,
    train: TrainSpec,
    plan: ParallelPlan | None = None,
    *,
    memory_budget: float | None = None,
    hardware: HardwareSpec | None = None,
    headroom: float = 0.1,
    expandable_segments: bool = False,
    calibration: Calibration | None = None,
    reserved_margin: ReservedMargin | int | None = None,
) -> int:
    """The largest sequence length s (at ``train.micro_batch``) whose worst rank fits over every phase of
    the step; 0 when even the smallest valid s misses. Valid: multiples of :func:`seq_len_unit` (``2c``
    with context parallelism, ``c t`` with sequence parallelism), up to the model's ``max_positions``
    (else :data:`MAX_SEQ_LEN`). Arguments and the fit test as :func:`largest_fit`."""
    return largest_fit(model, train, plan, axis="seq_len", memory_budget=memory_budget, hardware=hardware,
                       headroom=headroom, expandable_segments=expandable_segments, calibration=calibration,
                       reserved_margin=reserved_margin).value
