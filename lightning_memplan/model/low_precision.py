"""Quantized base weights and float8 linears in the estimate's first stage: one stage's numbers.

The formulas are in ``model/quantized.py`` (bitsandbytes' layouts) and ``model/float8.py`` (torchao's
float8 linears), each a function of numbers. This module reads the model spec and the resolved
:class:`~lightning_memplan.model.sizes.LowPrecision` record for one pipeline stage and returns
:class:`LowPrecisionStage`, the numbers the later stages read from the
:class:`~lightning_memplan.model.resolve.ResolvedStage` (``docs/architecture.md``, "The estimate's
stages"): the parameter bytes (``model/states.py``), the gathered FSDP units (``model/comm_buffers.py``),
the autocast copies the quantized linears do not make and the rebuilt weights / float8 casts
(``model/activations.py``). :func:`check_plan` refuses the layouts these terms do not describe.

Symbols as in docs/concepts.md; Q the quantized (or float8) linear values of a stage,
``Q = L_stage * sum(in * out)`` over :func:`~lightning_memplan.model.quantized.block_linear_shapes`, plus
``V h`` for a quantized lm_head on the last stage.

FSDP2 and QLoRA [FSDP-QLoRA]: bitsandbytes keeps a 4-bit weight's packed values in a ``Params4bit`` whose
storage dtype is ``quant_storage`` (``bitsandbytes/nn/modules.py``; transformers'
``BitsAndBytesConfig(bnb_4bit_quant_storage=torch.bfloat16)``, the peft docs page "FSDP + QLoRA", Answer.AI's
FSDP + QLoRA), so FSDP flattens and shards the packed values like any parameter, and all-gathers them
packed; the ``QuantState`` (absmaxes, codes, the nested constants) is a plain attribute of the layer
(``Linear4bit.quant_state``, restored on the gathered weight by ``fix_4bit_weight_quant_state_from_module``
"for example for fsdp"), not a parameter, so every rank keeps all of it. FSDP2 all-gathers a group of
mixed dtypes as bytes (torch 2.13 ``_fsdp_collectives.foreach_all_gather``: a ``uint8`` view).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from lightning_memplan.model import float8, param_counts, quantized
from lightning_memplan.model.sizes import Kernels, LowPrecision
from lightning_memplan.model.specs import ModelSpec, ParallelPlan
from lightning_memplan.model.stage_layout import StageLayout

__all__ = ["LowPrecisionStage", "check_plan", "gather_saving_bytes", "stage_low_precision"]


class LowPrecisionStage(NamedTuple):
    """One stage's quantized or float8 linears on one rank, as numbers (:func:`stage_low_precision`).

    Attributes:
        quantized_bytes: the bytes of the stage's quantized linears with every constant (0 for float8
            runs: their weights are stored in the parameter dtype).
        state_bytes: the part of ``quantized_bytes`` that is the layers' ``QuantState`` constants (kept
            whole on every rank under FSDP; the rest, the packed values, is sharded).
        adapter: LoRA adapter values a :meth:`ModelSpec.with_lora` spec leaves out of N (stored at the
            parameter dtype).
        uncopied_blocks, uncopied_head: matmul values autocast does not cast and keep (quantized or float8
            linears) in the blocks and in the lm_head.
        gather_block, gather_head: bytes one gathered FSDP block unit / the root unit saves against the
            parameter all-gather in the gathered dtype (packed quantized values; the float8 all-gather), less
            the block's share of a :meth:`ModelSpec.with_lora` adapter, gathered beside them.
        block_trainable: parameters of one block unit that get a gradient (the adapter's share; the
            quantized base and the norms are frozen).
        quantized: the values counted out of the stage's parameters (a tied head the stage does not count
            is quantized on top of them). forward, backward: the largest block linear's rebuilt weight
            (quantized) or float8 casts, freed with the op. head_forward, head_backward: the quantized
            lm_head's (its forward beside its ``[b s, V]`` output, ``head_output`` bytes; its backward at
            the loss's backward).
        scales: float8's persistent precomputed scales.
        details: what ``MemoryEstimate.details`` reports of them.
    """

    quantized: int = 0
    quantized_bytes: int = 0
    state_bytes: int = 0
    adapter: int = 0
    uncopied_blocks: int = 0
    uncopied_head: int = 0
    gather_block: int = 0
    gather_head: int = 0
    block_trainable: int = 0
    forward: int = 0
    backward: int = 0
    head_forward: int = 0
    head_backward: int = 0
    head_output: int = 0
    scales: int = 0
    details: tuple[tuple[str, int], ...] = ()


def check_plan(model: ModelSpec, low: LowPrecision, plan: ParallelPlan) -> None:
    """Raise ``ValueError`` for the layouts these terms do not model (names the rule and the fix)."""
    if low.base_weights is not None:
        quantized.block_linear_shapes(model)  # dense models only (raises with the reason)
        if model.n_trainable_params is None:
            raise ValueError(
                f"base_weights={low.base_weights!r} describes frozen base weights, but the spec trains every "
                "parameter (n_trainable_params=None); add the adapter: ModelSpec.with_lora(rank=..., targets=...) "
                "or ModelSpec(..., n_trainable_params=N)"
            )
        if plan.tp > 1:
            raise ValueError(
                f"base_weights={low.base_weights!r} cannot run with tensor parallelism (got tp={plan.tp}): "
                "bitsandbytes' packed weights and their per-block constants are not DTensors, so they cannot be "
                "split by rows or columns; use tp=1 with data parallelism (DDP, or FSDP zero=2/3 with "
                "bnb_4bit_quant_storage set to the parameter dtype), or base_weights=None"
            )
        if low.base_weights == "int8" and plan.zero >= 2:
            raise ValueError(
                f"base_weights='int8' cannot be sharded by FSDP (got zero={plan.zero}): bitsandbytes' Int8Params "
                "keeps its row scales (SCB) on the parameter, which FSDP drops when it flattens it; use zero<=1 "
                "(DDP) or a 4-bit format (nf4, nf4-dq, fp4, fp4-dq)"
            )
    if low.float8 is not None:
        quantized.block_linear_shapes(model)
        if plan.tp > 1:
            raise ValueError(
                f"float8={low.float8!r} is modelled without tensor parallelism (got tp={plan.tp}): torchao's "
                "float8 tensor-parallel styles all-gather float8 inputs, which is not modelled; use tp=1 or float8=None"
            )


def _fsdp_gathers(plan: ParallelPlan) -> bool:
    """FSDP2 shards the units over more than one rank (the float8 all-gather's condition)."""
    return plan.zero >= 2 and plan.dp * plan.cp > 1


def gather_saving_bytes(model: ModelSpec, low: LowPrecision, plan: ParallelPlan, gathered: int) -> tuple[int, int]:
    """``(block, head)``: bytes one gathered FSDP block unit and the root unit save against the all-gather
    of every value in the ``gathered`` dtype: a quantized linear is gathered as its packed values,
    ``n * gathered - ceil(n / 2)`` for 4-bit [FSDP-QLoRA, module docstring]; a float8 linear under the
    tensorwise float8 all-gather, ``n * (gathered - 1)`` (:func:`float8.float8_all_gather_saving_bytes`)."""
    if low.base_weights is not None:
        shapes = quantized.block_linear_shapes(model)
        block = sum(inp * out * gathered - quantized.packed_weight_bytes(out, inp, low.base_weights) for inp, out in shapes)
        head = 0
        if low.quantized_head:
            head = model.vocab_size * model.hidden * gathered - quantized.packed_weight_bytes(
                model.vocab_size, model.hidden, low.base_weights)
        return block, head
    if low.float8 is not None and float8.fp8_all_gather(low.float8, _fsdp_gathers(plan)):
        return float8.float8_all_gather_saving_bytes(quantized.quantized_block_numel(model), gathered), 0
    return 0, 0


def _transients(low: LowPrecision, plan: ParallelPlan, k: Kernels, tokens: int,
                shapes: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """``(forward, backward)`` bytes of the largest of ``shapes``' rebuilt weights (quantized; a CUDA int8
    forward's per-token buffers) or float8 copies (``(0, 0)`` without shapes)."""
    if not shapes:
        return 0, 0
    sizes = k.sizes
    if low.base_weights is not None:
        fmt = low.base_weights

        def rebuilt(phase: str) -> int:
            if fmt == "int8" and phase == "forward" and k.device == "cuda":  # MatMul8bitLt: int8 matmul
                return max(quantized.int8_cuda_forward_bytes(tokens, i, o, input_fp16=low.fp16) for i, o in shapes)
            return max(quantized.dequant_transient_bytes(o, i, fmt, compute_bytes=sizes.compute,
                                                         stored_bytes=sizes.param, phase=phase) for i, o in shapes)
        return rebuilt("forward"), rebuilt("backward")
    assert low.float8 is not None
    in_fp8 = float8.fp8_all_gather(low.float8, _fsdp_gathers(plan))
    rowwise = low.float8 == "rowwise"
    return tuple(float8.float8_largest_cast_bytes(tokens, shapes, weight_in_fp8=in_fp8, rowwise=rowwise, phase=phase)
                 for phase in ("forward", "backward"))  # type: ignore[return-value]


def _int8_details(model: ModelSpec, k: Kernels, n: int, tokens: int, inflight: float) -> tuple[tuple[str, int], ...]:
    """int8's saved inputs beyond a frozen-linear LoRA trace (``model/traced.py`` adds them to a trace
    with a LoRA adapter) and, on CUDA, the bound of LLM.int8()'s outlier copies (not in the total: how
    many columns hold outliers depends on the data), for the in-flight micro-batches of ``n`` blocks."""
    shapes = quantized.block_linear_shapes(model)
    kept = quantized.int8_kept_inputs_bytes(model, tokens, k.sizes.compute, targets=model.lora_targets,
                                            sdpa=k.attention == "sdpa")
    out: tuple[tuple[str, int], ...] = (("int8_kept_inputs", round(inflight * n * kept)),)
    if k.device == "cuda":
        bound = quantized.int8_outlier_bound_bytes(tokens, shapes, k.sizes.compute)
        out += (("int8_outlier_bound", round(inflight * n * bound)),)
    return out


def _float8_stage(model: ModelSpec, low: LowPrecision, plan: ParallelPlan, n: int, forward: int, backward: int,
                  gather_block: int) -> LowPrecisionStage:
    shapes = quantized.block_linear_shapes(model)
    scales = float8.float8_scale_bytes(n * len(shapes), float8.fp8_all_gather(low.float8 or "", _fsdp_gathers(plan)))
    return LowPrecisionStage(uncopied_blocks=n * quantized.quantized_block_numel(model), gather_block=gather_block,
                             forward=forward, backward=backward, scales=scales,
                             details=(("low_precision_forward_transient", forward),
                                      ("low_precision_backward_transient", backward), ("float8_scale_bytes", scales)))


def stage_low_precision(model: ModelSpec, k: Kernels, plan: ParallelPlan, layout: StageLayout, tokens: int,
                        inflight: float = 1.0) -> LowPrecisionStage | None:
    """The :class:`LowPrecisionStage` of ``layout`` (``tokens``: one micro-batch's tokens on the rank;
    ``inflight``: the micro-batches the stage holds), ``None`` without quantized weights or float8
    linears, or on a stage without blocks or a quantized head."""
    low, sizes = k.low_precision, k.sizes
    head = low.quantized_head and layout.has_head
    if not low.active or not (layout.n_layers or head):
        return None
    n, v, h = layout.n_layers, model.vocab_size, model.hidden
    shapes = quantized.block_linear_shapes(model)
    gathered = sizes.compute if sizes.autocast_copy else sizes.param  # FSDP2's all-gather dtype
    gather_block, gather_head = gather_saving_bytes(model, low, plan, gathered)
    forward, backward = _transients(low, plan, k, tokens, shapes if n else ())
    if low.float8 is not None:
        return _float8_stage(model, low, plan, n, forward, backward, gather_block)
    fmt = low.base_weights
    assert fmt is not None
    head_fwd, head_bwd = _transients(low, plan, k, tokens, ((h, v),) if head else ())
    q = n * quantized.quantized_block_numel(model) + (v * h if head else 0)
    q_bytes = quantized.base_weight_bytes(shapes, fmt, layers=n) + (quantized.quantized_weight_bytes(v, h, fmt) if head else 0)
    packed = n * sum(quantized.packed_weight_bytes(o, i, fmt) for i, o in shapes) + (
        quantized.packed_weight_bytes(v, h, fmt) if head else 0)
    # A tied head the stage does not count (ModelSpec.tied_embeddings, one stage) becomes a quantized copy of
    # its own: _convert_layers gives the replacement ``child.weight.data.clone()``.
    tied_head = head and model.tied_embeddings and (plan.pp == 1 or layout.has_embedding)
    # the adapter's share of the stage: its matrices sit in the blocks' linears; a spec read from a live
    # module counts them in n_params already, and its trainable share of a block is the model-wide one
    adapter = adapter_block = 0
    block_trainable = round(param_counts.layer_param_count(model) * model.trainable_fraction)
    if model.n_params is None and model.lora_rank is not None and model.n_trainable_params:
        adapter = round(model.n_trainable_params * n / model.n_layers)
        adapter_block = block_trainable = round(model.n_trainable_params / model.n_layers)
    int8 = _int8_details(model, k, n, tokens, inflight) if fmt == "int8" else ()
    return LowPrecisionStage(
        quantized=q - (v * h if tied_head else 0), quantized_bytes=q_bytes, state_bytes=q_bytes - packed,
        adapter=adapter, uncopied_blocks=n * quantized.quantized_block_numel(model), uncopied_head=v * h if head else 0,
        gather_block=gather_block - adapter_block * gathered, gather_head=gather_head, block_trainable=block_trainable,
        forward=forward, backward=backward, head_forward=head_fwd, head_backward=head_bwd,
        head_output=tokens * v * sizes.logits if head else 0,
        details=(("low_precision_forward_transient", max(forward, head_fwd)),
                 ("low_precision_backward_transient", max(backward, head_bwd)),
                 ("float8_scale_bytes", 0), ("quantized_params", q), ("quantized_param_bytes", q_bytes),
                 ("quantized_bits_x1000", math.floor(8000 * q_bytes / max(q, 1))), *int8),
    )
