"""``estimate_memory``: predicted peak tensor bytes per rank, per component, per phase.

The step is modelled as the timeline a Lightning training step really follows (steady state, i.e. from the
second optimizer step on, when optimizer states exist), in a short pipeline of named stages, each a module
taking the previous stages' records (``docs/architecture.md``, "The estimate's stages"):

1. resolve (``model/resolve.py``, with ``model/sizes.py`` and ``model/stage_layout.py``): element sizes per
   tensor kind, kernel choices, the optimizer's bytes, the stage's blocks and parameters, tokens per
   micro-batch, the micro-batches in flight: a :class:`~lightning_memplan.model.resolve.ResolvedStage`;
2. states (``model/states.py``): parameters, gradients, optimizer states and master copies by framework
   (DDP, ZeRO-1, FSDP2, FSDP1, FSDP inside a pipeline, DeepSpeed), a
   :class:`~lightning_memplan.model.states.StageStates`;
3. communication buffers (``model/comm_buffers.py``): :class:`~lightning_memplan.model.comm_buffers.
   CommBuffers`;
4. the activation timeline (``model/activations.py``): forward, backward and optimizer points of the
   batch-dependent bytes;
5. assemble (``model/assemble.py``): every point's components, the offloads, the peak: a
   :class:`~lightning_memplan.model.result.MemoryEstimate`.

:func:`estimate_stage` runs the stages for one pipeline stage; :func:`estimate_memory` checks its
arguments, asks a traced coefficient source when the spec carries one (``model/traced.py``) and returns
the asked or the worst rank.
"""

from __future__ import annotations

import math
import warnings

from lightning_memplan.model import frameworks, low_precision, offload
from lightning_memplan.model.assemble import assemble_stage
from lightning_memplan.model.comm_buffers import comm_buffers
from lightning_memplan.model.positions import warn_learned_positions
from lightning_memplan.model.resolve import resolve_stage
from lightning_memplan.model.result import Calibration, MemoryEstimate
from lightning_memplan.model.runnable import pipeline_schedule_blocker
from lightning_memplan.model.sizes import low_precision_of
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.model.stage_layout import StageLayout, stage_layout
from lightning_memplan.model.states import stage_states
from lightning_memplan.model.traced import traced_estimate
from lightning_memplan.validation import check_optional_int, divisor_list

__all__ = ["StageLayout", "check_compatible", "estimate_memory", "estimate_stage", "stage_layout"]


def check_compatible(model: ModelSpec, train: TrainSpec, plan: ParallelPlan) -> None:
    """Raise ``ValueError`` when the plan cannot split this model/batch (names the rule and the fix)."""
    if model.n_heads % plan.tp:
        # t must divide both head counts: the divisors of their gcd (bounded-time, validation.divisors)
        ok = divisor_list(math.gcd(model.n_heads, model.kv_heads), keep=12)
        raise ValueError(
            f"tp={plan.tp} does not divide n_heads={model.n_heads}; tensor parallelism splits whole "
            f"heads, use tp in {ok}"
        )
    if model.kv_heads % plan.tp:
        ok = divisor_list(model.kv_heads, keep=12)
        raise ValueError(
            f"tp={plan.tp} does not divide n_kv_heads={model.kv_heads}; each rank needs whole key/value "
            f"heads, use tp in {ok}"
        )
    if plan.pp > model.n_layers:
        raise ValueError(
            f"pp={plan.pp} exceeds n_layers={model.n_layers}; every pipeline stage needs at least one "
            f"block, use pp <= {model.n_layers}"
        )
    warn_learned_positions(model, train.seq_len)  # past a learned position table (model/positions.py)
    _check_schedule_runs(plan)
    if plan.schedule == "interleaved" and plan.pp > 1:
        chunks = plan.pp * plan.virtual_stages
        units = frameworks.pipeline_units(model.n_layers, train.framework)  # L (+ embedding and head)
        if units < chunks:  # uneven chunks are fine (the first L mod (p v) take one more)
            raise ValueError(
                f"virtual_stages={plan.virtual_stages} x pp={plan.pp} = {chunks} stages exceed "
                f"n_layers={model.n_layers}; every stage needs a block, use virtual_stages <= "
                f"{units // plan.pp}"
            )
    if train.framework == "deepspeed":
        _check_deepspeed(train, plan)
    # quantized base weights, float8 linears: the layouts they are modelled for
    low_precision.check_plan(model, low_precision_of(train), plan)
    blocker = offload.offload_blocker(train, plan)
    if blocker is not None:
        raise ValueError(f"plan={plan.describe()} cannot run this TrainSpec: {blocker}")
    if train.framework == "fsdp1" and (plan.pp > 1 or plan.cp > 1 or plan.tp > 1 or plan.zero == 1):
        raise ValueError(
            f"framework='fsdp1' models FSDP1 over data parallelism (zero 0, 2 or 3; got zero={plan.zero}, "
            f"tp={plan.tp}, pp={plan.pp}, cp={plan.cp}): Lightning's FSDPStrategy shards over data-parallel "
            "ranks only; use ParallelPlan(dp=..., zero=3|2|0), or framework='torch' for FSDP2 layouts"
        )
    if train.seq_len % plan.cp:
        raise ValueError(
            f"cp={plan.cp} does not divide seq_len={train.seq_len}; context parallelism splits the "
            f"sequence evenly, use a seq_len that is a multiple of {plan.cp}"
        )
    if plan.cp > 1 and train.attention == "eager":
        # Ring attention exchanges key/value blocks inside the fused kernel: PyTorch's context_parallel
        # replaces F.scaled_dot_product_attention (torch.distributed.tensor.experimental.context_parallel).
        raise ValueError(
            f"cp={plan.cp} needs attention='sdpa' (got attention='eager'): context parallelism splits the "
            "fused attention kernel over ranks; use attention='sdpa' or cp=1"
        )
    if plan.sp and (train.seq_len // plan.cp) % plan.tp:
        raise ValueError(
            f"sp=True splits the sequence over tp={plan.tp}, but seq_len={train.seq_len} (per cp rank "
            f"{train.seq_len // plan.cp}) is not divisible by it; pad seq_len or set sp=False"
        )


def _check_deepspeed(train: TrainSpec, plan: ParallelPlan) -> None:
    """The layouts ``framework="deepspeed"`` models: ZeRO over data parallelism (with tensor parallelism
    beside it), no pipeline or context parallelism; offload needs the ZeRO stages DeepSpeed accepts it
    with (``docs/_pages/config-json.md``: ``offload_optimizer`` "Valid for ZeRO stage 1, 2, 3",
    ``offload_param`` "Valid only with stage 3")."""
    if plan.pp > 1 or plan.cp > 1:
        raise ValueError(
            f"framework='deepspeed' models ZeRO over data parallelism (got pp={plan.pp}, cp={plan.cp}): DeepSpeed's "
            "pipeline engine and sequence parallelism are not modelled; use pp=1 and cp=1, or framework='torch'"
        )
    if train.offload == "params" and plan.zero < 3:
        raise ValueError(
            f"offload='params' needs zero=3 (got zero={plan.zero}): DeepSpeed offloads parameters only under "
            "ZeRO stage 3 (offload_param); use ParallelPlan(..., zero=3), or offload='optimizer' for stages 1-2"
        )
    if train.offload == "optimizer" and plan.zero < 1:
        raise ValueError(
            "offload='optimizer' needs zero>=1 (got zero=0): DeepSpeed's offload_optimizer is part of ZeRO "
            "stages 1, 2 and 3; use ParallelPlan(..., zero=1) or higher, or offload='none'"
        )


def _check_schedule_runs(plan: ParallelPlan) -> None:
    """Refuse a pipeline schedule that cannot run its micro-batches (1F1B with ``microbatches < pp``):
    the rule the planner's search and memplan_auto's setup apply,
    :func:`~lightning_memplan.model.runnable.pipeline_schedule_blocker` (the dataloader batch is not
    known here; ``train.micro_batch`` is one micro-batch)."""
    reason = pipeline_schedule_blocker(pp=plan.pp, schedule=plan.schedule, microbatches=plan.microbatches, batch=None)
    if reason is None:
        return
    fix = f"use microbatches>={plan.pp}, e.g. ParallelPlan(..., pp={plan.pp}, microbatches={plan.pp})"
    if pipeline_schedule_blocker(pp=plan.pp, schedule="gpipe", microbatches=plan.microbatches, batch=None) is None:
        fix += f", or schedule='gpipe' (it runs microbatches={plan.microbatches})"
    raise ValueError(f"plan={plan.describe()} cannot run: {reason}; {fix}")


def estimate_stage(
    model: ModelSpec,
    train: TrainSpec,
    plan: ParallelPlan,
    stage: int,
    rank: int,
    calibration: Calibration | None = None,
) -> MemoryEstimate:
    """The analytic estimate of global rank ``rank`` on pipeline ``stage`` of ``plan``: the five stages of
    the module docstring, run in order. No argument checks (:func:`estimate_memory` makes them) and no
    traced coefficients: what ``model/traced.py`` scales a trace by, and what the tracer
    (``tracking/hf_trace.py``) hands to it as its ``stage_estimate``.

    ``calibration`` replaces the analytic activation terms; it was fitted on one device without
    activation offloading, so the same step resolved that way scales it to this plan."""
    r = resolve_stage(model, train, plan, stage)
    reference = None
    if calibration is not None and not (plan.tp == plan.pp == plan.cp == 1 and not train.offload_activations):
        ref_train = train.replace(offload_activations=False) if train.offload_activations else train
        reference = resolve_stage(model, ref_train, ParallelPlan(), 0)
    states = stage_states(model, r, plan)
    comm = comm_buffers(model, r, plan, states)
    return assemble_stage(model, r, plan, states, comm, rank=rank, calibration=calibration, reference=reference)


def estimate_memory(
    model: ModelSpec,
    train: TrainSpec,
    plan: ParallelPlan | None = None,
    *,
    rank: int | None = None,
    calibration: Calibration | None = None,
) -> MemoryEstimate:
    """Predicted peak allocated-tensor bytes of one rank, per component.

    Args:
        model: the architecture (:class:`ModelSpec`).
        train: batch shape, precision, optimizer, recompute, attention and loss (:class:`TrainSpec`).
        plan: the parallel layout (:class:`ParallelPlan`); ``None`` means one device.
        rank: a global rank (mesh order pp, dp, cp, tp with tp fastest); ``None`` returns the worst
            rank. Ranks differ only by pipeline stage.
        calibration: coefficients fitted by :func:`lightning_memplan.tracking.trace.calibrate` for this
            model; replaces the analytic activation/attention/logits/workspace/other terms.

    Returns:
        :class:`MemoryEstimate` in integer bytes; steady state (optimizer states exist, the previous
        step's gradients are alive during the forward as in Lightning's loop).

    Raises:
        ValueError: the plan cannot split this model or batch (see :func:`check_compatible`).
        TypeError: an argument is not the expected spec type.
    """
    for name, value, cls in (("model", model, ModelSpec), ("train", train, TrainSpec)):
        if not isinstance(value, cls):
            raise TypeError(f"{name}={value!r} must be a {cls.__name__}")
    plan = plan if plan is not None else ParallelPlan()
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"plan={plan!r} must be a ParallelPlan (or None for one device)")
    if calibration is not None and not isinstance(calibration, Calibration):
        raise TypeError(f"calibration={calibration!r} must be a Calibration from trace.calibrate()")
    rank = check_optional_int("rank", rank, minimum=0, maximum=plan.world_size - 1,
                              hint=f"a global rank of this plan's {plan.world_size} ranks, or None for the worst one")
    check_compatible(model, train, plan)
    return _warn_unknown(_estimate(model, train, plan, rank, calibration))


def _estimate(model: ModelSpec, train: TrainSpec, plan: ParallelPlan, rank: int | None,
              calibration: Calibration | None) -> MemoryEstimate:
    source = model.calibration_source
    if calibration is None and source is not None and source.available():
        # traced coefficients handed over with the spec (e.g. a Hugging Face config's real class): scaled
        # by the analytic terms (model/traced.py); None when the source has nothing for this spec
        traced = traced_estimate(model, train, plan, rank=rank, source=source, stage_estimate=estimate_stage)
        if traced is not None:
            return traced
    if rank is not None:
        return estimate_stage(model, train, plan, plan.stage_of_rank(rank), rank, calibration)
    ranks_per_stage = plan.dp * plan.cp * plan.tp
    estimates = [
        estimate_stage(model, train, plan, stage, stage * ranks_per_stage, calibration) for stage in range(plan.pp)
    ]
    return max(estimates, key=lambda e: e.total)


def _warn_unknown(estimate: MemoryEstimate) -> MemoryEstimate:
    """Warn about bytes the estimate cannot know and leaves out (their bound is in its details)."""
    if estimate.details.get("int8_outlier_bound"):
        warnings.warn(
            "base_weights='int8' on CUDA: LLM.int8()'s outlier columns (bitsandbytes keeps a copy of each int8 "
            "linear's input columns that hold a value >= its threshold, for backward) depend on the data and are "
            "not in the estimate; MemoryEstimate.details['int8_outlier_bound'] bounds them (every column); "
            "threshold=0 (llm_int8_threshold=0.0) keeps none",
            UserWarning, stacklevel=3,
        )
    return estimate
