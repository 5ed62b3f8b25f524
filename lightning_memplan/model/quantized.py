"""Quantized frozen base weights (QLoRA) and low-bit optimizer states, as the libraries lay them out.

Each term takes numbers (shapes, byte sizes), not a spec; :func:`block_linear_shapes` is the one reader
of a :class:`~lightning_memplan.model.specs.ModelSpec`. Sources (released packages, their files):

  [BNB]  bitsandbytes 0.50.2: ``bitsandbytes/functional.py`` (``quantize_4bit``: the packed storage
         ``[(n + 1) // 2, 1]`` uint8 and one fp32 absmax per block of 64 from ``bitsandbytes/_ops.py``;
         with ``compress_statistics`` the absmaxes minus their mean (``offset``, a 0-d fp32 tensor)
         quantized by ``quantize_blockwise(..., blocksize=256)``: one uint8 per absmax and one fp32 absmax
         per 256 of them, with its own copy of the 256-entry fp32 dynamic map, ``code.to(A.device,
         copy=True)``; ``get_4bit_type``:
         a new 16-entry fp32 code per ``QuantState``), ``bitsandbytes/nn/modules.py`` (``Params4bit``,
         ``Int8Params``: int8 ``CB`` and fp32 row scales ``SCB``), ``bitsandbytes/autograd/_functions.py``
         (``MatMul4Bit`` keeps only the packed weight for backward and dequantizes it again there;
         ``MatMul8bitLt``/``MatMul8bitFp`` rebuild the weight in the input dtype for the input gradient),
         ``bitsandbytes/backends/default/ops.py`` (``_gemm_4bit_default_impl``: the forward dequantizes
         the weight in the input dtype), ``bitsandbytes/optim/optimizer.py`` (``Optimizer2State.init_state``:
         8-bit states with one fp32 absmax per 256 values, fp32 states for tensors under 4096 values,
         ``is_paged``: states in CUDA unified memory).
  [AO]   torchao 0.18.0: ``torchao/optim/adam.py`` (``_AdamBase._new_buffer``: "follow bitsandbytes, only
         quantize tensors >= 4096 values" and a multiple of the block size, else ``zeros_like``; block
         sizes ``AdamW8bit`` 256, ``AdamW4bit`` 128, ``AdamWFp8`` 256; a 0-d fp32 ``step`` per parameter),
         ``torchao/optim/subclass_8bit.py``, ``subclass_4bit.py``, ``subclass_fp8.py`` (``OptimState*.zeros``:
         codes, one fp32 scale per block, a per-state fp32 ``qmap`` of 256 / 16 entries; none for fp8).
  [PEFT] transformers 5.3 ``integrations/bitsandbytes.py`` (``replace_with_bnb_linear``) and
         ``utils/quantization_config.py`` (``BitsAndBytesConfig.llm_int8_skip_modules``) with
         ``quantizers/base.py`` (``get_keys_to_not_convert``: the output embedding, tied weights): the
         block linears are quantized, embeddings, norms and the lm_head are not.

The bytes were checked against the libraries on CPU (``tests/unit/test_quantized.py``: every
``QuantState`` tensor of a quantized ``Linear4bit``, every state tensor of the optimizers after a step).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: specs imports this module's constants
    from lightning_memplan.model.specs import ModelSpec

__all__ = [
    "BASE_WEIGHT_FORMATS",
    "BNB_4BIT_BLOCK",
    "BNB_NESTED_BLOCK",
    "BNB_STATE_BLOCK",
    "LOW_BIT_OPTIMIZERS",
    "MIN_QUANTIZED_STATE_NUMEL",
    "PAGED_OPTIMIZERS",
    "base_weight_bytes",
    "block_linear_shapes",
    "dequant_transient_bytes",
    "int8_cuda_forward_bytes",
    "int8_kept_inputs_bytes",
    "int8_outlier_bound_bytes",
    "optimizer_state_bytes",
    "optimizer_state_rate",
    "packed_weight_bytes",
    "quantized_block_numel",
    "quantized_weight_bytes",
]

#: ``TrainSpec.base_weights`` values: Lightning's ``BitsandbytesPrecision`` modes (``"int8"`` is its
#: frozen-int8 ``Linear8bitLt(has_fp16_weights=False)``; ``"int8-training"`` keeps 16-bit weights).
BASE_WEIGHT_FORMATS = ("nf4", "nf4-dq", "fp4", "fp4-dq", "int8")
#: Values per absmax of a 4-bit weight (``quantize_4bit``'s default ``blocksize``) [BNB].
BNB_4BIT_BLOCK = 64
#: Absmaxes per fp32 second-level absmax under double quantisation [BNB].
BNB_NESTED_BLOCK = 256
#: Entries of the fp32 code each ``QuantState`` holds (NF4 / FP4 levels) [BNB].
BNB_4BIT_CODE_ENTRIES = 16
#: Entries of bitsandbytes' fp32 dynamic map (``create_dynamic_map``); ``quantize_blockwise`` gives every
#: ``QuantState`` its own copy (``code.to(A.device, copy=True)``), so each double-quantised weight holds one [BNB].
BNB_DYNAMIC_MAP_ENTRIES = 256
#: Values per fp32 absmax of bitsandbytes' blockwise 8-bit optimizer states [BNB].
BNB_STATE_BLOCK = 256
#: Smallest tensor whose optimizer states bitsandbytes and torchao quantize (smaller: fp32 / dtype) [BNB, AO].
MIN_QUANTIZED_STATE_NUMEL = 4096
_FP32 = 4
_BF16 = 2

#: Optimizers with quantized or 16-bit states: ``name -> (bits per state value, values per fp32 scale,
#: fp32 map entries per state tensor, library)``. ``adamw8bit`` keeps the textbook 2 bytes per parameter
#: (``model/terms.py``); its exact bitsandbytes layout is :func:`optimizer_state_bytes`'s ``"adamw8bit"``.
LOW_BIT_OPTIMIZERS: dict[str, tuple[int, int, int, str]] = {
    "adamw4bit": (4, 128, 16, "torchao.optim.AdamW4bit"),
    "adamw_fp8": (8, 256, 0, "torchao.optim.AdamWFp8"),
    "adamw_bf16": (16, 0, 0, "torchao.optim._AdamW(bf16_stochastic_round=True) on bf16 parameters"),
    "paged_adamw8bit": (8, BNB_STATE_BLOCK, 0, "bitsandbytes.optim.PagedAdamW8bit"),
    "paged_adamw": (32, 0, 0, "bitsandbytes.optim.PagedAdamW"),
}
#: Optimizers whose states live in CUDA unified memory (``cudaMallocManaged``), outside PyTorch's caching
#: allocator: resident on the device while it has room, paged to host memory under pressure [BNB].
PAGED_OPTIMIZERS = ("paged_adamw8bit", "paged_adamw")
_ADAM_STATES = 2


def _check_format(fmt: str) -> None:
    if fmt not in BASE_WEIGHT_FORMATS:
        raise ValueError(f"base_weights={fmt!r} must be one of {BASE_WEIGHT_FORMATS}")


def quantized_weight_bytes(out_features: int, in_features: int, fmt: str) -> int:
    """Bytes of one frozen ``[out, in]`` weight stored in ``fmt``, with its own constants [BNB]:

    - ``"nf4"``/``"fp4"``: ``ceil(n / 2)`` packed bytes + ``4 ceil(n / 64)`` fp32 absmaxes + a 16-entry
      fp32 code (64 B), ``n = out * in``;
    - ``"nf4-dq"``/``"fp4-dq"``: the absmaxes as uint8 (``ceil(n / 64)`` B) + ``4 ceil(ceil(n / 64) / 256)``
      fp32 second-level absmaxes + the fp32 ``offset`` (4 B) + the code (64 B) + the second level's own
      256-entry fp32 dynamic map (1 KiB);
    - ``"int8"``: ``n`` int8 bytes (``CB``) + ``4 out`` fp32 row scales (``SCB``).
    """
    _check_format(fmt)
    n = out_features * in_features
    if fmt == "int8":
        return n + _FP32 * out_features
    blocks = math.ceil(n / BNB_4BIT_BLOCK)
    packed = (n + 1) // 2
    code = BNB_4BIT_CODE_ENTRIES * _FP32
    if fmt.endswith("-dq"):
        nested = _FP32 * math.ceil(blocks / BNB_NESTED_BLOCK) + _FP32 + BNB_DYNAMIC_MAP_ENTRIES * _FP32
        return packed + blocks + nested + code
    return packed + _FP32 * blocks + code


def packed_weight_bytes(out_features: int, in_features: int, fmt: str) -> int:
    """The packed values of one ``[out, in]`` weight in ``fmt``, without its constants: ``ceil(n / 2)`` for
    4-bit (``Params4bit``'s data; with a wider ``quant_storage`` the same bytes in
    ``(n + 1) // (2 * itemsize)`` elements [BNB ``_ops.py`` ``quantize_4bit``]), ``n`` for int8 (``CB``).
    What FSDP shards and all-gathers of a quantized weight (``model/low_precision.py``)."""
    _check_format(fmt)
    n = out_features * in_features
    return n if fmt == "int8" else (n + 1) // 2


def base_weight_bytes(shapes: Iterable[tuple[int, int]], fmt: str, *, layers: int = 1) -> int:
    """``layers * sum over (in, out) of quantized_weight_bytes(out, in, fmt)``: the quantized linears of
    ``layers`` identical blocks, ``shapes`` as :func:`block_linear_shapes` gives them."""
    return layers * sum(quantized_weight_bytes(out, inp, fmt) for inp, out in shapes)


def dequant_transient_bytes(out_features: int, in_features: int, fmt: str, *, compute_bytes: int,
                            stored_bytes: int, phase: str) -> int:
    """The weight a quantized linear rebuilds while it runs (freed with the op) [BNB]:

    - forward, 4-bit: ``n * compute_bytes`` (the dequantized weight in the input dtype), + ``4 ceil(n/64)``
      fp32 absmaxes rebuilt under double quantisation; int8 (``MatMul8bitFp``, CPU) rebuilds it in the
      input dtype too (on CUDA ``MatMul8bitLt`` multiplies in int8 instead and holds the input's int8
      copy, a per-token term not counted here);
    - backward, 4-bit: ``n * stored_bytes`` (``dequantize_4bit`` returns the dtype the weight was
      quantized from) + ``n * compute_bytes`` when that differs from the gradient's dtype (``.to``),
      + the rebuilt absmaxes; int8: ``n * compute_bytes`` (``CB.to(dtype_A, copy=True)``).

    The rebuilt absmaxes are freed before the matmul runs, so adding them bounds the transient from above
    by ``4 ceil(n / 64)`` bytes (under 1/16 of the weight term in fp32). On the CPU the forward's
    rebuild happens inside bitsandbytes' ``gemm_4bit`` custom op, where dispatch-mode trackers
    (MemTracker, ``TensorTracker``) do not see it; on CUDA the caching allocator does.
    """
    _check_format(fmt)
    if phase not in ("forward", "backward"):
        raise ValueError(f"phase={phase!r} must be 'forward' or 'backward'")
    n = out_features * in_features
    if fmt == "int8":
        return n * compute_bytes
    absmax = _FP32 * math.ceil(n / BNB_4BIT_BLOCK) if fmt.endswith("-dq") else 0
    if phase == "forward":
        return n * compute_bytes + absmax
    return n * stored_bytes + (n * compute_bytes if stored_bytes != compute_bytes else 0) + absmax


def int8_cuda_forward_bytes(tokens: int, in_features: int, out_features: int, *, input_fp16: bool) -> int:
    """Per-token buffers one frozen ``Linear8bitLt`` makes in a CUDA forward (``MatMul8bitLt``, freed with
    the op) [BNB ``autograd/_functions.py``, ``backends/cuda/ops.py``, ``backends/default/ops.py``]: the
    input cast to fp16 (``A.to(torch.float16)``, ``2 T in`` unless it is fp16), its row-wise int8 copy
    ``CA`` (``T in``) and fp32 row scales (``4 T``, ``int8_vectorwise_quant``), and the int32 product
    ``4 T out`` (``int8_linear_matmul``) before ``int8_mm_dequant`` writes the output. ``T`` tokens."""
    cast = 0 if input_fp16 else 2 * tokens * in_features
    return cast + tokens * in_features + _FP32 * tokens + _FP32 * tokens * out_features


#: LoRA target names of each of a block's four linear inputs (the names ``model/lora.py`` knows): the
#: attention input (q, k, v), the attention output, the MLP input, the MLP's inner activation.
_INPUT_GROUP_TARGETS = (
    ("q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn", "query_key_value"),
    ("o_proj", "dense", "c_proj"),
    ("gate_proj", "up_proj", "gate_up_proj", "c_fc", "dense_h_to_4h"),
    ("down_proj", "dense_4h_to_h", "c_proj"),
)


def int8_kept_inputs_bytes(model: ModelSpec, tokens: int, input_bytes: int, *, targets: Iterable[str],
                           sdpa: bool) -> int:
    """Bytes one block's frozen int8 linears keep for backward beyond a LoRA step with frozen linears that
    keep nothing (``model/lora.py``): ``MatMul8bitLt`` keeps its input ``A`` whether it needs it or not
    (``ctx.tensors = (CAt, subA, A)``; on the CPU ``MatMul8bitFp`` sets ``ctx.A = A``) [BNB
    ``autograd/_functions.py``]. Counted per distinct input storage (q, k and v read one tensor; so do
    gate and up): the attention input ``T h`` and the MLP input ``T h`` unless a LoRA adapter on one of
    their linears already keeps them (``lora_A`` saves the input it shares with the base layer), the MLP's
    inner activation ``T f`` (the product or activation feeding the down projection, which no other op
    saves) unless adapted, and the attention output ``T a d_h`` only with eager attention (a fused SDPA
    kernel saves its output, whose transposed view the output projection reads) unless adapted."""
    names = set(targets)
    h, q, f = model.hidden, model.n_heads * model.dim_head, model.ffn
    widths = (h, 0 if sdpa else q, h, f)
    kept = sum(w for w, group in zip(widths, _INPUT_GROUP_TARGETS, strict=True) if not names & set(group))
    return tokens * kept * input_bytes


def int8_outlier_bound_bytes(tokens: int, shapes: Iterable[tuple[int, int]], input_bytes: int) -> int:
    """Upper bound of the outlier columns one block's int8 linears keep on CUDA (LLM.int8()'s mixed
    decomposition, ``threshold > 0``: transformers' ``llm_int8_threshold`` and Lightning's int8 layers
    default to 6.0): ``subA = A[:, outlier_cols].contiguous()``, a copy per linear of the input columns
    holding a value of magnitude >= threshold, saved for backward [BNB ``backends/default/ops.py``
    ``int8_mixed_scaled_mm``]. How many columns that is depends on the data (Dettmers et al. 2022,
    arXiv 2208.07339, section 4: a few feature dimensions); the bound is every column,
    ``sum of T in input_bytes``."""
    return sum(tokens * inp * input_bytes for inp, _ in shapes)


def block_linear_shapes(model: ModelSpec) -> tuple[tuple[int, int], ...]:
    """``(in, out)`` of one block's linears (what bitsandbytes replaces): q, k, v (one fused ``qkv`` when
    ``qkv_fused``), the output projection, and the MLP (gate, up, down for swiglu; up, down otherwise).
    Their element count is ``param_counts.layer_matmul_param_count`` for a dense block.

    Raises:
        ValueError: a mixture-of-experts or multi-head-latent-attention spec (their experts are not
            ``nn.Linear`` modules in transformers, so which of them bitsandbytes replaces is not modelled).
    """
    if model.n_experts or model.kv_lora_rank is not None:
        raise ValueError(
            f"base_weights needs a dense model with standard attention (got n_experts={model.n_experts!r}, "
            f"kv_lora_rank={model.kv_lora_rank!r}): which expert tensors bitsandbytes replaces is not modelled; "
            "use base_weights=None, or estimate the live quantized module (ModelSpec.from_module + trace_memory)"
        )
    h, q, kv, f = model.hidden, model.n_heads * model.dim_head, model.kv_heads * model.dim_head, model.ffn
    attn = ((h, q + 2 * kv),) if model.qkv_fused else ((h, q), (h, kv), (h, kv))
    mlp = ((h, f), (h, f), (f, h)) if model.ffn_kind == "swiglu" else ((h, f), (f, h))
    return (*attn, (q, h), *mlp)


def quantized_block_numel(model: ModelSpec) -> int:
    """Elements of one block's quantized weights: ``sum of in * out`` over :func:`block_linear_shapes`."""
    return sum(inp * out for inp, out in block_linear_shapes(model))


def optimizer_state_rate(name: str, param_bytes: int) -> float:
    """Optimizer state bytes per parameter of a large tensor (``>= 4096`` values, a multiple of the block):

    ``2 * (bits / 8 + 4 / block)`` for the block-quantized states (``adamw4bit`` 2 x (0.5 + 4/128) = 1.0625,
    ``adamw_fp8`` and ``paged_adamw8bit`` 2 x (1 + 4/256) = 2.03125), ``2 * 2`` for ``adamw_bf16``, ``2 * 4``
    for ``paged_adamw`` (bitsandbytes' 32-bit states are fp32 whatever the parameter dtype).
    ``param_bytes`` is unused by these (kept for the per-tensor rule below) [BNB, AO].
    """
    del param_bytes
    bits, block, _, _ = LOW_BIT_OPTIMIZERS[name]
    scale = _FP32 / block if block else 0.0
    return _ADAM_STATES * (bits / 8 + scale)


def optimizer_state_bytes(name: str, numel: int, param_bytes: int) -> int:
    """Exact state bytes of one parameter tensor of ``numel`` values (``param_bytes`` its element size),
    without the per-tensor 0-d ``step`` (torchao: 4 B) and bitsandbytes' two shared 256-entry maps
    (``qmap1``/``qmap2``, 2 KiB per optimizer) [BNB, AO]:

    - ``"adamw8bit"``/``"paged_adamw8bit"`` (bitsandbytes): ``2 (n + 4 ceil(n / 256))``, fp32 ``2 * 4n``
      under 4096 values;
    - ``"adamw4bit"`` (torchao): ``2 (n / 2 + 4 n / 128 + 64)`` (a 16-entry fp32 map per state);
      ``"adamw_fp8"`` (torchao): ``2 (n + 4 n / 256)``; both ``2 n param_bytes`` (``zeros_like``) under
      4096 values or off the block;
    - ``"adamw_bf16"``: ``2 * 2n``; ``"paged_adamw"``: ``2 * 4n``.
    """
    if name in ("adamw8bit", "paged_adamw8bit"):
        if numel < MIN_QUANTIZED_STATE_NUMEL:
            return _ADAM_STATES * _FP32 * numel
        return _ADAM_STATES * (numel + _FP32 * math.ceil(numel / BNB_STATE_BLOCK))
    bits, block, map_entries, _ = LOW_BIT_OPTIMIZERS[name]
    if bits == 16:
        return _ADAM_STATES * _BF16 * numel
    if bits == 32:
        return _ADAM_STATES * _FP32 * numel
    if numel < MIN_QUANTIZED_STATE_NUMEL or numel % block:
        return _ADAM_STATES * param_bytes * numel
    return _ADAM_STATES * (numel * bits // 8 + _FP32 * (numel // block) + _FP32 * map_entries)
