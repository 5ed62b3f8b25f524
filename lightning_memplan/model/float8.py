"""Float8 training (torchao ``Float8Linear``, as torchtitan runs it): what changes against a bf16 step.

Each term takes numbers (token counts, linear shapes, byte sizes), not a spec. Sources:

  [AO8]  torchao 0.18.0 (the float8 training code of the 2024-12 torchtitan benchmarks, torchao ``eab345c``,
         has the same structure): ``torchao/float8/float8_linear.py`` (``matmul_with_hp_or_float8_args``:
         ``ctx.save_for_backward(input_hp, weight_hp_t)``, the *high-precision* input and weight, so the
         saved activations are a bf16 step's; the forward casts input and weight to float8 e4m3 with
         dynamic scales; the backward casts ``grad_output`` (e5m2) once for the input gradient and once
         for the weight gradient, the saved input again and the weight again, unless a tensor already
         arrived in float8), ``torchao/float8/float8_training_tensor.py`` (``Float8TrainingTensor``: one
         byte per value and a fp32 scale, a scalar under tensorwise scaling, one per row under rowwise),
         ``torchao/float8/fsdp_utils.py`` (``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather``:
         under ``enable_fsdp_float8_all_gather`` the sharded weight is cast to float8 *before* FSDP2's
         all-gather, so the gathered weight is one byte per value and arrives already cast;
         ``precompute_float8_dynamic_scale_for_fsdp``: one fp32 scale per weight, ``_precomputed_scale``),
         ``torchao/float8/config.py`` (``Float8LinearConfig.from_recipe_name``: ``"tensorwise"`` and
         ``"rowwise"``; the FSDP float8 all-gather needs tensorwise dynamic scaling). Scaling is dynamic
         (amax of the tensor at cast time): no amax history buffers.
  [TT]   torchtitan ``docs/float8.md`` (the flags ``--float8.enable_fsdp_float8_all_gather
         --float8.precompute_float8_dynamic_scale_for_fsdp`` and ``--training.compile``, "required for
         competitive performance: use torch.compile to fuse the float8 scaling/casting kernels") and its
         float8 converter, which leaves the ``output`` projection (the lm_head) in bf16.

The casts are counted as the compiled kernels make them (one float8 output per cast, the amax reduction
and the scaling fused into it): torchtitan compiles every float8 run. In eager mode each cast also makes
fp32 temporaries (``tensor.to(float32) * scale``, the clamp) several times the float8 output; these terms
do not describe an eager float8 step.

TransformerEngine (Lightning's ``TransformerEnginePrecision``) differs: its ``Linear`` saves the float8
cast of its input for backward (one byte per value instead of two) together with float8 copies of the
weight, and its default ``DelayedScaling`` recipe keeps an ``amax_history_len``-long fp32 history per
float8 tensor. Those are not modelled here (docs/quantized.md).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "FLOAT8_RECIPES",
    "FP8_BYTES",
    "float8_all_gather_saving_bytes",
    "float8_backward_cast_bytes",
    "float8_forward_cast_bytes",
    "float8_largest_cast_bytes",
    "float8_scale_bytes",
    "fp8_all_gather",
]

#: ``TrainSpec.float8`` values: torchao's recipe names [AO8].
FLOAT8_RECIPES = ("tensorwise", "rowwise")
#: float8 e4m3 / e5m2: one byte per value.
FP8_BYTES = 1
_SCALE_BYTES = 4  # fp32 scales


def fp8_all_gather(recipe: str, fsdp: bool) -> bool:
    """Whether FSDP2 all-gathers the float8 linears' weights in float8: torchtitan's
    ``enable_fsdp_float8_all_gather``, which torchao allows with tensorwise scaling only [AO8, TT]."""
    return fsdp and recipe == "tensorwise"


def float8_all_gather_saving_bytes(linear_numel: int, gathered_bytes: int) -> int:
    """Bytes one gathered unit saves with the float8 all-gather: ``n_linear * (gathered_bytes - 1)`` for
    ``n_linear`` weight values of float8 linears (a bf16 gather: one byte per value) [AO8 fsdp_utils.py]."""
    return linear_numel * max(gathered_bytes - FP8_BYTES, 0)


def _scales(rows: int, rowwise: bool) -> int:
    return _SCALE_BYTES * (rows if rowwise else 1)


def float8_forward_cast_bytes(tokens: int, in_features: int, out_features: int, *, weight_in_fp8: bool,
                              rowwise: bool) -> int:
    """Float8 copies one ``Float8Linear`` forward makes (freed after its matmul) [AO8]:
    ``tokens * in`` (the input, e4m3) + ``in * out`` (the weight; 0 when it arrived in float8 from the
    all-gather) + their fp32 scales (per row under rowwise)."""
    weight = 0 if weight_in_fp8 else in_features * out_features + _scales(out_features, rowwise)
    return tokens * in_features + _scales(tokens, rowwise) + weight


def float8_backward_cast_bytes(tokens: int, in_features: int, out_features: int, *, weight_in_fp8: bool,
                               rowwise: bool) -> int:
    """Float8 copies alive at one ``Float8Linear``'s weight-gradient matmul [AO8 ``backward``]:
    ``grad_output`` cast twice (``2 * tokens * out``: for the input gradient and, in the other layout, for
    the weight gradient), the saved input cast again (``tokens * in``), the weight cast for the input
    gradient (``in * out``, 0 when it is the float8 all-gather's), and their fp32 scales."""
    weight = 0 if weight_in_fp8 else in_features * out_features + _scales(in_features, rowwise)
    return (2 * tokens * out_features + 2 * _scales(tokens, rowwise) + tokens * in_features
            + _scales(in_features, rowwise) + weight)


def float8_largest_cast_bytes(tokens: int, shapes: Iterable[tuple[int, int]], *, weight_in_fp8: bool,
                              rowwise: bool, phase: str) -> int:
    """The largest of :func:`float8_forward_cast_bytes` / :func:`float8_backward_cast_bytes` over one
    block's linears (``shapes`` as ``(in, out)``): the casts of one linear at a time are alive."""
    term = float8_forward_cast_bytes if phase == "forward" else float8_backward_cast_bytes
    return max((term(tokens, inp, out, weight_in_fp8=weight_in_fp8, rowwise=rowwise) for inp, out in shapes),
               default=0)


def float8_scale_bytes(n_linears: int, fsdp_fp8_all_gather: bool) -> int:
    """Persistent float8 buffers: one fp32 precomputed scale per float8 weight under the FSDP float8
    all-gather (``precompute_float8_dynamic_scale_for_fsdp``), ``4 * n_linears``; 0 otherwise (dynamic
    scaling keeps no amax history) [AO8]."""
    return _SCALE_BYTES * n_linears if fsdp_fp8_all_gather else 0
