"""Where quantized base weights, float8 linears and paged optimizer states enter ``estimate_memory``.

The formulas are in ``model/quantized.py`` and ``model/float8.py`` (each a function of numbers); this
module reads the specs and hands them their numbers, so that ``model/estimate.py``, ``model/terms.py``
and ``model/reserved.py`` each call it at one marked place (``# low precision:``). With
``TrainSpec(base_weights=None, float8=None)`` and an optimizer that is not paged every function here
returns the unchanged value, so those estimates stay byte for byte what they were.

Symbols as in docs/DESIGN.md; Q the quantized (or float8) block-linear values of a stage,
``Q = L_stage * sum(in * out)`` over :func:`~lightning_memplan.model.quantized.block_linear_shapes`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from lightning_memplan.model import float8, quantized

if TYPE_CHECKING:  # annotations only: specs imports quantized and float8, not this module
    from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec

__all__ = [
    "add_transient_points",
    "check_plan",
    "fp8_gather_saving",
    "paged_optimizer_split",
    "stage_param_bytes",
    "uncopied_matmul",
]


def check_plan(model: ModelSpec, train: TrainSpec, plan: ParallelPlan) -> None:
    """Raise ``ValueError`` for the layouts these terms do not model (names the rule and the fix)."""
    if train.base_weights is not None:
        quantized.block_linear_shapes(model)  # dense models only (raises with the reason)
        if model.n_trainable_params is None:
            raise ValueError(
                f"base_weights={train.base_weights!r} describes frozen base weights, but the spec trains every "
                "parameter (n_trainable_params=None); add the adapter: ModelSpec.with_lora(rank=..., targets=...) "
                "or ModelSpec(..., n_trainable_params=N)"
            )
        if plan.tp > 1 or plan.zero >= 2:
            raise ValueError(
                f"base_weights={train.base_weights!r} is modelled without tensor parallelism or FSDP sharding (got "
                f"tp={plan.tp}, zero={plan.zero}): bitsandbytes' packed weights are split by neither here; use "
                "tp=1 and zero<=1 (data parallelism), or base_weights=None"
            )
    if train.float8 is not None:
        quantized.block_linear_shapes(model)
        if plan.tp > 1:
            raise ValueError(
                f"float8={train.float8!r} is modelled without tensor parallelism (got tp={plan.tp}): torchao's "
                "float8 tensor-parallel styles all-gather float8 inputs, which is not modelled; use tp=1 or float8=None"
            )


def _low_precision_numel(model: ModelSpec, train: TrainSpec, n_layers: int) -> int:
    """Q: the block-linear values of ``n_layers`` blocks that are quantized or float8 (0 for neither)."""
    if train.base_weights is None and train.float8 is None:
        return 0
    return n_layers * quantized.quantized_block_numel(model)


def stage_param_bytes(model: ModelSpec, train: TrainSpec, n_layers: int, local: int, param_bytes: int) -> int | None:
    """A stage's parameter bytes with quantized base weights, ``None`` without them:
    ``base_weight_bytes(Q) + (N_local - Q + A) * param_bytes``, where A is the LoRA adapter's values when
    the spec does not count them in N (:meth:`ModelSpec.with_lora` leaves them out; a spec read from a
    live module counts them in ``n_params``)."""
    if train.base_weights is None:
        return None
    shapes = quantized.block_linear_shapes(model)
    q = n_layers * quantized.quantized_block_numel(model)
    adapter = model.n_trainable_params if (model.n_params is None and model.lora_rank is not None) else 0
    rest = max(local - q, 0) + (adapter or 0)
    return quantized.base_weight_bytes(shapes, train.base_weights, layers=n_layers) + rest * param_bytes


def uncopied_matmul(model: ModelSpec, train: TrainSpec, n_layers: int) -> int:
    """Matmul values autocast does not cast and keep: the quantized linears (bitsandbytes rebuilds the
    weight inside its op and keeps only the packed one) and the float8 linears (torchao's autograd function
    takes the weight as it is and casts it to float8 itself) [``model/quantized.py``, ``model/float8.py``].
    Under full or op-level recompute the blocks' copies are already gone (``estimate._per_micro_batch``)."""
    if train.recompute in ("full", "selective_op"):
        return 0
    return _low_precision_numel(model, train, n_layers)


def fp8_gather_saving(model: ModelSpec, train: TrainSpec, plan: ParallelPlan, gathered: int, n_layers: int = 1) -> int:
    """Bytes ``n_layers`` gathered FSDP units save when FSDP2 all-gathers their float8 weights
    (tensorwise, :func:`float8.fp8_all_gather`): ``Q * (gathered - 1)``; 0 otherwise."""
    if train.float8 is None or not float8.fp8_all_gather(train.float8, plan.zero >= 2 and plan.dp * plan.cp > 1):
        return 0
    return float8.float8_all_gather_saving_bytes(_low_precision_numel(model, train, n_layers), gathered)


def paged_optimizer_split(train: TrainSpec, optimizer_bytes: int) -> tuple[int, int]:
    """``(device bytes, host bytes)`` of the optimizer states: a paged optimizer's live in CUDA unified
    memory, outside the caching allocator (:data:`quantized.PAGED_OPTIMIZERS`), counted as host memory."""
    if train.optimizer in quantized.PAGED_OPTIMIZERS:
        return 0, optimizer_bytes
    return optimizer_bytes, 0


def _transients(model: ModelSpec, train: TrainSpec, plan: ParallelPlan, compute: int, param: int) -> tuple[int, int]:
    """``(forward, backward)`` bytes of the largest linear's rebuilt weight (quantized) or float8 copies."""
    shapes = quantized.block_linear_shapes(model)
    if train.base_weights is not None:
        fmt = train.base_weights
        fwd = max(quantized.dequant_transient_bytes(o, i, fmt, compute_bytes=compute, stored_bytes=param,
                                                    phase="forward") for i, o in shapes)
        bwd = max(quantized.dequant_transient_bytes(o, i, fmt, compute_bytes=compute, stored_bytes=param,
                                                    phase="backward") for i, o in shapes)
        return fwd, bwd
    assert train.float8 is not None
    tokens = train.micro_batch * (train.seq_len // plan.cp)
    gathered_fp8 = float8.fp8_all_gather(train.float8, plan.zero >= 2 and plan.dp * plan.cp > 1)
    rowwise = train.float8 == "rowwise"
    return (float8.float8_largest_cast_bytes(tokens, shapes, weight_in_fp8=gathered_fp8, rowwise=rowwise,
                                             phase="forward"),
            float8.float8_largest_cast_bytes(tokens, shapes, weight_in_fp8=gathered_fp8, rowwise=rowwise,
                                             phase="backward"))


def add_transient_points(points: dict[str, dict[str, int]], model: ModelSpec, train: TrainSpec,
                         plan: ParallelPlan, n_layers: int, compute: int, param: int) -> dict[str, int]:
    """Add the low-precision transients to the step's points (in place); returns the details to report.

    Forward: a point of its own inside the last block (its largest linear running), the forward's
    point without the loss's logits (``"forward_low_precision"``). Backward: the last block's backward
    (``"backward_layer"``; under a pipeline the rank's backward peak ``"backward"``) holds the largest
    linear's backward transient in ``workspace``. Float8's persistent scales (:func:`float8.float8_scale_bytes`)
    are ``other`` in every point."""
    if (train.base_weights is None and train.float8 is None) or not n_layers:
        return {}
    fwd, bwd = _transients(model, train, plan, compute, param)
    scales = 0
    if train.float8 is not None:
        gathered_fp8 = float8.fp8_all_gather(train.float8, plan.zero >= 2 and plan.dp * plan.cp > 1)
        scales = float8.float8_scale_bytes(n_layers * len(quantized.block_linear_shapes(model)), gathered_fp8)
    forward = dict(points["forward"])
    forward.update(logits=0, workspace=forward.get("workspace", 0) + fwd)
    points["forward_low_precision"] = forward
    for key in ("backward_layer", "backward"):
        if key in points:
            points[key] = {**points[key], "workspace": points[key].get("workspace", 0) + bwd}
    if scales:
        for key, point in points.items():
            points[key] = {**point, "other": point.get("other", 0) + scales}
    return {"low_precision_forward_transient": fwd, "low_precision_backward_transient": bwd,
            "float8_scale_bytes": scales}


def quantized_param_detail(model: ModelSpec, train: TrainSpec, n_layers: int) -> dict[str, int]:
    """The quantized values and their bytes on a stage, for ``MemoryEstimate.details``."""
    if train.base_weights is None or not n_layers:
        return {}
    shapes = quantized.block_linear_shapes(model)
    return {"quantized_params": n_layers * quantized.quantized_block_numel(model),
            "quantized_param_bytes": quantized.base_weight_bytes(shapes, train.base_weights, layers=n_layers),
            "quantized_bits_x1000": math.floor(
                8000 * quantized.base_weight_bytes(shapes, train.base_weights, layers=n_layers)
                / max(n_layers * quantized.quantized_block_numel(model), 1))}
