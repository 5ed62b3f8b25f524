"""Every term of the memory model as its own function.

Each docstring states the formula in the symbols of docs/concepts.md (b micro-batch, s sequence, h
hidden, a heads, k key/value heads, d_h head width, f ffn width, V vocabulary, L layers, t/p/d/c the
tensor-, pipeline-, data- and context-parallel sizes), its assumptions and its source. All results are
integer bytes (or element counts where the name says so).

A term takes numbers and the already-resolved records of ``model/sizes.py`` (:class:`~lightning_memplan.
model.sizes.PrecisionBytes`, :class:`~lightning_memplan.model.sizes.Kernels`,
:class:`~lightning_memplan.model.sizes.OptimizerBytes`), never a ``TrainSpec``: the precision rules are
worked out once, in ``model/sizes.py``.

Sources cited below:
  [K22]  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
         arXiv 2205.05198 (Table 2: activation bytes per layer; section 4.2.3: pipeline in-flight).
  [N21]  Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
         Megatron-LM", arXiv 2104.04473 (section 2.2: 1F1B and interleaved schedules).
  [R20]  Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
         Models", arXiv 1910.02054 (section 3: model states 2N + 2N + 12N).
  [D8]   Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861: Adam's
         two states in 1 byte each.
  [HF]   Hugging Face transformers 5.3 ``models/llama/modeling_llama.py`` ``LlamaForCausalLM.forward``:
         the [b, s, V] logits, upcast with ``logits.float()`` inside ``self.loss_function``.
  [PT]   PyTorch 2.13 sources: what autograd saves for backward (aten/src/ATen/native, derivatives.yaml),
         torch/optim/adam.py (``_multi_tensor_adam``), torch/amp/autocast_mode.py (the weight-cast cache).
  [PL]   Lightning 2.6 ``loops/optimization/automatic.py``: ``zero_grad`` runs after ``training_step``
         and before ``backward``, so the previous step's gradients are alive during the forward.
"""

from __future__ import annotations

import math

from lightning_memplan.model.experts import is_moe, uses_mla
from lightning_memplan.model.param_counts import (
    active_layer_matmul_param_count,
    blocks_param_count,
    embedding_param_count,
    head_param_count,
    layer_matmul_param_count,
    layer_param_count,
    norm_param_count,
    param_count,
)
from lightning_memplan.model.sizes import (
    ADAM_STATE_COUNT,
    BATCH_ID_TENSORS,
    BF16_BYTES,
    FP32_BYTES,
    INT8_BYTES,
    LAYERNORM_STAT_COUNT,
    MASK_BYTES,
    RMSNORM_STAT_COUNT,
    SDPA_LSE_BYTES,
    TOKEN_ID_BYTES,
    Kernels,
    OptimizerBytes,
    PrecisionBytes,
)
from lightning_memplan.model.specs import ModelSpec

__all__ = [
    "fsdp1_padded_numel",
    "fsdp1_rank_flat_numel",
    "fsdp1_shard_numel",
    "ADAM_STATE_COUNT",
    "BATCH_ID_TENSORS",
    "BF16_BYTES",
    "FP32_BYTES",
    "INT8_BYTES",
    "MASK_BYTES",
    "Kernels",
    "OptimizerBytes",
    "PrecisionBytes",
    "SDPA_LSE_BYTES",
    "AUTO_CHUNK_BUDGET_BYTES",
    "AUTO_CHUNK_GRAD_FRACTION",
    "AUTO_MIN_CHUNKS",
    "VOCAB_SHARDED_LOSSES",
    "CHUNK_ROW_MULTIPLE",
    "active_layer_matmul_param_count",
    "auto_loss_chunk_tokens",
    "blocks_param_count",
    "autocast_copy_bytes",
    "batch_input_bytes",
    "loss_chunk_row_bytes",
    "loss_gemm_bytes",
    "planned_loss_chunk_tokens",
    "ddp_bucket_bytes",
    "embedding_param_count",
    "eager_attention_bytes",
    "eager_softmax_backward_bytes",
    "eager_softmax_backward_freed_bytes",
    "eager_softmax_backward_grad_bytes",
    "eager_softmax_output_bytes",
    "fsdp_root_post_backward_bytes",
    "full_recompute_layer_bytes",
    "head_param_count",
    "korthikanti_layer_activation_bytes",
    "layer_activation_bytes",
    "layer_activation_split_bytes",
    "layer_matmul_param_count",
    "layer_param_count",
    "norm_param_count",
    "norm_saved_bytes",
    "norm_saves_its_input",
    "logits_bytes",
    "model_state_bytes",
    "optimizer_workspace_bytes",
    "param_count",
    "pipeline_head_inflight_microbatches",
    "position_ids_bytes",
    "pipeline_inflight_microbatches",
    "TOKEN_ID_BYTES",
]

# Element sizes (``FP32_BYTES``, ..., ``SDPA_LSE_BYTES``, ``TOKEN_ID_BYTES``) and the records the terms take
# (``PrecisionBytes``, ``Kernels``, ``OptimizerBytes``) are defined once in model/sizes.py and re-exported.
# Parameter counts: one formula each in model/param_counts.py (ModelSpec.num_params reads them too);
# imported above and re-exported here.


# ---------------------------------------------------------------------------------------------
# Model states
# ---------------------------------------------------------------------------------------------


def model_state_bytes(n_params: int, sizes: PrecisionBytes, optimizer_per_param: float) -> dict[str, int]:
    """Unsharded model states ``{params, grads, optimizer, master}`` for N parameters, with the element
    sizes ``sizes`` and ``optimizer_per_param`` state bytes per parameter
    (:attr:`~lightning_memplan.model.sizes.OptimizerBytes.per_param`).

    The textbook case (``bf16-true`` + ``master_weights=True`` + Adam) gives 2N + 2N + 8N + 4N = 16N
    [R20 section 3.1]; Lightning's ``bf16-mixed`` gives 4N + 4N + 8N (fp32 params and grads, no separate
    master), plus the autocast copies counted by :func:`autocast_copy_bytes`.
    """
    return {
        "params": n_params * sizes.param,
        "grads": n_params * sizes.grad,
        "optimizer": round(n_params * optimizer_per_param),
        "master": n_params * sizes.master,
    }


def autocast_copy_bytes(matmul_params: int, sizes: PrecisionBytes) -> int:
    """16-bit weight copies cached by autocast: ``2 * N_matmul`` under mixed precision, else 0.

    Autocast casts each matmul weight once per forward and the matmul saves the copy for backward,
    so all of them are alive at the end of the forward [PT torch/amp/autocast_mode.py]. Embedding
    lookups and norms are not autocast to 16 bit, so only linear weights count.
    """
    return matmul_params * sizes.autocast_copy


# ---------------------------------------------------------------------------------------------
# The batch
# ---------------------------------------------------------------------------------------------


def batch_input_bytes(tokens: int) -> int:
    """The dataloader's batch of a language model for ``tokens`` = b*s tokens: token ids and targets, two
    ``[b, s]`` int64 tensors, ``2 * 8 = 16`` bytes per token (:data:`BATCH_ID_TENSORS` x
    :data:`TOKEN_ID_BYTES`).

    Alive for the whole step: the training loop holds the batch from before ``training_step`` until
    after the optimizer step (Lightning 2.6 ``loops/training_epoch_loop.py``, ``advance``: ``batch`` stays
    referenced in ``kwargs`` while ``self.automatic_optimization.run(...)`` calls
    ``optimizer.step(closure)``) [PL], and an evaluation step's batch while its step runs. Per rank: a
    tensor-parallel rank holds the whole batch; a pipeline rank the step's m micro-batches (every rank
    receives the dataloader batch, ``parallel/pipeline.py`` ``PipelineRunner.step``); a context-parallel
    rank its whole ``[b, s]`` storage (torch 2.13 ``context_parallel`` shards the buffers in place with
    ``buffer.resize_(shard.shape)``, which never shrinks a storage,
    ``torch/distributed/tensor/experimental/_context_parallel/_attention.py``). Counted as ``other``, where
    the tensor tracker puts storages created before it started (``tracking/trace.py`` tracks the traced
    batch as ``other``). Assumes an ids-and-targets batch:
    a batch with an attention mask or other per-token tensors holds more (a traced or calibrated estimate
    measures the real batch).
    """
    return BATCH_ID_TENSORS * TOKEN_ID_BYTES * tokens


def position_ids_bytes(model: ModelSpec, s: int) -> int:
    """The position ids ``arange(s)`` (int64, ``8 s`` bytes) a learned position table looks up in each
    forward, per micro-batch; 0 with RoPE or without positions (``ModelSpec.position_embedding``).

    The lookup saves its indices for the embedding's backward (``embedding_backward`` takes ``indices``,
    torch 2.13 ``tools/autograd/derivatives.yaml``) [PT], so they live with the micro-batch's activations
    until the first stage's backward; under ``no_grad`` they are freed at once. GPT-2 builds them the same
    way (transformers 5.3 ``models/gpt2/modeling_gpt2.py``, ``GPT2Model.forward``: ``position_ids =
    cache_position.unsqueeze(0)``, ``cache_position = torch.arange(...)``).
    """
    return TOKEN_ID_BYTES * s if model.position_embedding == "learned" else 0


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------


def korthikanti_layer_activation_bytes(
    s: int, b: int, h: int, a: int, *, t: int = 1, sp: bool = False, recompute: str = "none"
) -> float:
    """Activation bytes of one transformer layer as tabulated by [K22 Table 2] (16-bit activations,
    1-byte dropout masks, GELU MLP with f = 4h, eager attention):

    - no parallelism:                  ``s*b*h*(34 + 5*a*s/h)``
    - tensor parallel:                 ``s*b*h*(10 + 24/t + 5*a*s/(h*t))``
    - tensor + sequence parallel:      ``s*b*h/t*(34 + 5*a*s/h)``
    - selective recompute (TP):        ``s*b*h*(10 + 24/t)``; with SP ``s*b*h*34/t``
    - full recompute:                  ``2*s*b*h`` (the layer input only); with SP ``2*s*b*h/t``

    This is the textbook reference the tests check; :func:`layer_activation_bytes` is the
    framework-level accounting the estimate uses.
    """
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    if recompute == "selective":
        return sbh * 34 / t if sp else sbh * (10 + 24 / t)
    if sp:
        return sbh / t * (34 + 5 * a * s / h)
    if t > 1:
        return sbh * (10 + 24 / t + 5 * a * s / (h * t))
    return sbh * (34 + 5 * a * s / h)


def eager_attention_bytes(model: ModelSpec, kernels: Kernels, b: int, s: int, t: int = 1) -> int:
    """Materialised attention probabilities of one layer, ``b*(a/t)*s^2`` elements each:

    - the softmax output, kept for softmax's backward: fp32 under CUDA autocast (softmax is on its
      fp32 list), else the compute dtype (CPU autocast leaves softmax in bf16);
    - under CUDA autocast, the 16-bit copy of it that the P@V matmul saves;
    - with dropout: the 1-byte mask and the dropped probabilities (saved by P@V instead).

    Zero for ``attention="sdpa"`` and for ``recompute`` other than ``"none"`` (selective recompute
    recomputes exactly this part [K22 section 5]). Corresponds to the ``5*a*s/h`` term of [K22].
    """
    if not kernels.eager:
        return 0
    elems = b * (model.n_heads // t) * s * s
    total = elems * kernels.softmax
    if model.dropout > 0:
        total += elems * (MASK_BYTES + kernels.sizes.compute)
    elif kernels.fp32_softmax:
        total += elems * kernels.sizes.compute
    return total


def eager_softmax_output_bytes(model: ModelSpec, kernels: Kernels, b: int, s: int, t: int = 1) -> int:
    """The softmax output of one layer, ``b*(a/t)*s^2`` elements of ``kernels.softmax`` bytes (fp32 under
    CUDA autocast, where softmax is on autocast's fp32 list and the 16-bit gradient of the P@V product is
    cast back to fp32 by the cast's backward; else the compute dtype: CPU autocast leaves softmax in bf16,
    ``_softmax_backward_data`` returns its input's dtype [PT]): the part of
    :func:`eager_attention_bytes` that the softmax saves for its own backward (the P@V product's 16-bit
    copy under CUDA autocast, and dropout's mask and dropped probabilities, are saved by the nodes after
    it). Zero where :func:`eager_attention_bytes` is."""
    if not kernels.eager:
        return 0
    return b * (model.n_heads // t) * s * s * kernels.softmax


def eager_checkpointed_forward_bytes(model: ModelSpec, kernels: Kernels, b: int, s: int, t: int = 1) -> int:
    """The ``[b, a/t, s, s]`` tensors alive while a checkpointed block (``recompute="full"``) runs its
    eager attention forward: the softmax's input (the masked scores, compute dtype) and its output
    (``kernels.softmax`` bytes), ``b*(a/t)*s^2`` elements each. The non-reentrant ``checkpoint`` saves
    nothing of them, so they are freed when the block returns [PT torch/utils/checkpoint.py], but the
    block's own forward holds both (measured with the tracker on the zoo's eager llama, 32-true,
    b=2, s=256: the forward's peak is the last block's ``probs @ v``, 17.6 % over the loss's point).
    Zero for ``attention="sdpa"`` and for ``recompute`` other than ``"full"``."""
    if kernels.attention != "eager" or kernels.recompute != "full":
        return 0
    elems = b * (model.n_heads // t) * s * s
    return elems * (kernels.sizes.compute + kernels.softmax)


def eager_softmax_backward_bytes(model: ModelSpec, kernels: Kernels, b: int, s: int, t: int = 1) -> int:
    """The two ``[b, a/t, s, s]`` tensors of one layer's eager softmax backward, ``2*b*(a/t)*s^2``
    elements of ``kernels.softmax`` bytes: the gradient of the probabilities (``grad_y @ V^T`` from the P@V
    backward; under CUDA autocast its fp32 cast, the 16-bit product freed by then) and the gradient of
    the scores that ``_softmax_backward_data`` allocates while the first is alive [PT softmax_backward].
    Zero where :func:`eager_attention_bytes` is."""
    if not kernels.eager:
        return 0
    return 2 * b * (model.n_heads // t) * s * s * kernels.softmax


def eager_softmax_backward_grad_bytes(
    model: ModelSpec, kernels: Kernels, b: int, s: int, *, t: int = 1, sp: bool = False
) -> int:
    """Activation gradients alive next to :func:`eager_softmax_backward_bytes` while one block's softmax
    backward runs (zero where that is):

    - the residual stream's gradient ``[b, s, h]`` in the residual dtype (``1/t`` of the sequence under
      sequence parallelism): the block's output gradient plus the MLP branch's input gradient,
      accumulated into one buffer at the attention's residual add, alive until the attention branch's
      input gradient is added to it;
    - the value gradient ``P^T @ grad_y``, ``[b, a/t, s, d_v]`` in the compute dtype (eager attention
      expands grouped key/value heads to ``a``): autograd runs the graph's nodes in reverse order of
      creation, and the value path (``v_proj``, its view, ``repeat_interleave``) was created before the
      scores, so its backward comes after the softmax's [PT torch/csrc/autograd/engine.cpp,
      ``ReadyQueue`` ordered by sequence number].

    The output projection's input gradient is gone by then: the P@V backward consumed it.
    """
    if not kernels.eager:
        return 0
    pb = kernels.sizes
    tokens = b * s
    dv = (model.v_head_dim or model.dim_head) if model.kv_lora_rank is not None else model.dim_head
    residual = tokens * model.hidden * pb.residual // (t if sp else 1)
    return residual + tokens * (model.n_heads // t) * dv * pb.compute


def eager_softmax_backward_freed_bytes(
    model: ModelSpec, kernels: Kernels, b: int, s: int, *, t: int = 1, sp: bool = False
) -> dict[str, int]:
    """What one block no longer holds when its eager softmax backward starts, as
    ``{"activations": ..., "attention": ...}`` (zero where :func:`eager_attention_bytes` is).

    Autograd releases a node's saved tensors as soon as that node's backward has run (the engine calls
    ``Node::release_variables()`` after each function unless ``retain_graph``; each generated node's
    ``release_variables`` resets its ``SavedVariable`` members) [PT torch/csrc/autograd/engine.cpp
    ``call_function``, torch/csrc/autograd/generated/Functions.h]. Every node of the block after the
    scores' softmax has run its backward by then, so what only those nodes saved is freed:

    - activations: the second part of :func:`layer_activation_split_bytes` (the value tensor as P@V
      received it, the output projection's input, the second norm, the MLP, the residual dropout masks);
    - attention: :func:`eager_attention_bytes` less the softmax's own output
      (:func:`eager_softmax_output_bytes`): the 16-bit copy P@V saved under CUDA autocast, the dropout
      mask and the dropped probabilities.
    """
    if not kernels.eager:
        return {"activations": 0, "attention": 0}
    _, after = layer_activation_split_bytes(model, kernels, b, s, t=t, sp=sp)
    attention = eager_attention_bytes(model, kernels, b, s, t=t) - eager_softmax_output_bytes(model, kernels, b, s, t=t)
    return {"activations": after, "attention": attention}


def norm_saved_bytes(model: ModelSpec, kernels: Kernels, tokens: int, *, split: int = 1) -> int:
    """Bytes one norm layer saves for ``tokens`` tokens, per token (``x`` = the residual dtype's bytes):

    - LayerNorm (``native_layer_norm``): its input and fp32 mean and rstd: ``h*x + 8`` [PT];
    - RMSNorm, ``norm_impl="native"`` on CUDA (``_fused_rms_norm``): its input and an fp32 rstd:
      ``h*x + 4`` [PT]; this assumes the weight's dtype is the input's (otherwise ``F.rms_norm`` warns
      "Mismatch dtype between input and weight ... Cannot dispatch to fused implementation" and runs
      the composite, ``"composite_fp32"``'s bytes);
    - RMSNorm, ``"native"`` on CPU (the composite ATen ``rms_norm``), and ``"composite_fp32"`` (a Python
      RMSNorm that multiplies by the weight in fp32: huggingface/transformers@c4cdd1a
      ``src/transformers/models/gemma/modeling_gemma.py`` ``GemmaRMSNorm``: ``out = _norm(x.float()) *
      (1 + weight.float())``; OLMo-2's ``(weight * hs).to(input_dtype)``): an fp32 copy of its input (the
      input itself when it is fp32), the fp32 rstd and the fp32 normalised tensor that the weight
      multiply saves: ``8h + 4``;
    - RMSNorm, ``"composite"`` (huggingface/transformers@0022728
      ``src/transformers/models/llama/modeling_llama.py`` ``LlamaRMSNorm``, unchanged in v5.3.0:
      ``hs = x.to(float32); hs = hs * rsqrt(hs.pow(2).mean(-1) + eps); return weight * hs.to(x.dtype)``;
      pytorch/torchtune@1b0918f ``torchtune/modules/rms_norm.py`` ``RMSNorm`` the same with
      ``type_as``): ``pow`` and the first ``mul`` save the fp32 input copy, ``rsqrt`` its fp32 output,
      and the weight multiply the normalised tensor cast back to the input dtype: ``4h + 4 + h*x``.
      Measured with ``MemTracker`` (tests/unit/test_impl_variants.py): each variant 1.000 of the estimate.

    The fp32 variants matter on CUDA: under bf16-mixed (fp32 residual) a composite RMSNorm saves
    ``8h + 4`` bytes per token where the fused kernel saves ``4h + 4``; under bf16-true ``6h + 4``
    (``8h + 4`` for ``"composite_fp32"``) against ``2h + 4``. ``split`` divides by the
    sequence-parallel width.
    """
    h = model.hidden
    pb = kernels.sizes
    if model.norm == "layernorm":
        per_token = h * pb.residual + LAYERNORM_STAT_COUNT * FP32_BYTES
    elif kernels.norm_impl == "composite":
        per_token = h * FP32_BYTES + RMSNORM_STAT_COUNT * FP32_BYTES + h * pb.residual
    elif kernels.fused_rms_norm:
        per_token = h * pb.residual + RMSNORM_STAT_COUNT * FP32_BYTES
    else:
        per_token = 2 * h * FP32_BYTES + RMSNORM_STAT_COUNT * FP32_BYTES
    return tokens * per_token // split


def norm_saves_its_input(model: ModelSpec, kernels: Kernels) -> bool:
    """Whether a block's first norm saves its input tensor itself rather than an fp32 copy of it
    (:func:`norm_saved_bytes`): LayerNorm and CUDA's fused RMSNorm always; any composite RMSNorm
    (CPU's ATen one, ``"composite"``, ``"composite_fp32"``) only when the input is already fp32, since
    ``x.to(float32)`` of an fp32 tensor returns it [PT]."""
    if model.norm == "layernorm" or kernels.fused_rms_norm:
        return True
    return kernels.sizes.residual == FP32_BYTES


def layer_activation_bytes(
    model: ModelSpec, kernels: Kernels, b: int, s: int, *, t: int = 1, sp: bool = False
) -> int:
    """Bytes one block saves for backward (attention probabilities excluded), no recompute.

    What PyTorch autograd saves per block [PT], in elements (``x`` = residual dtype, ``c`` = compute):

    - two norms: :func:`norm_saved_bytes` each;
    - the attention input (norm output) as the projections receive it: ``s*b*h`` in c, once when
      nothing is cast (or q/k/v are one fused projection), but three times under autocast with
      separate q/k/v projections (autocast caches casts of weights, not of activations, so each linear
      saves its own 16-bit copy of the input);
    - q, k, v as the attention kernel receives them: q ``s*b*a*d_h``; k and v ``s*b*k*d_h`` for
      sdpa (``enable_gqa=True`` keeps the k key/value heads) but ``s*b*a*d_h`` for eager attention,
      which expands them to a heads before the matmuls (``repeat_interleave``, as Hugging Face's
      ``repeat_kv`` does); without rotary embeddings q/k/v are views of the projections;
    - the attention output ``s*b*a*d_h``, saved by the output projection (and by sdpa, which
      allocates it as [b, s, a, d_h] so the reshape before the projection is a view: one storage),
      plus sdpa's fp32 log-sum-exp per (token, head); eager probabilities are counted by
      :func:`eager_attention_bytes`;
    - the MLP input ``s*b*h`` (twice under autocast for swiglu's separate gate and up projections);
      gelu/relu: ``2*s*b*f`` (activation input, second matmul input); swiglu: ``4*s*b*f`` (gate out,
      silu out, up out, product);
    - dropout > 0: two 1-byte residual masks ``2*s*b*h``.

    Tensor parallelism divides the head and ffn dimensions by t; without sequence parallelism the
    norm inputs and the matmul inputs stay whole on every rank [K22 section 4.2.2]. With PyTorch's
    DTensor sequence parallelism the norm inputs are split by t but the all-gathered matmul inputs are
    saved whole (the ``ColwiseParallel`` input redistribution keeps the gathered tensor).

    A framework other than ``"torch"`` (``kernels.sp_saves_shard``, ``kernels.fused_swiglu``:
    ``lightning_memplan.model.frameworks``): Megatron-LM's
    sequence-parallel linears save their 1/t input shard and gather it again in backward, so the matmul
    inputs are divided by t too [K22 section 4.2.2, Table 2 ``34sbh/t``], and its fused SwiGLU saves
    only its input, the fc1 output ``2*s*b*f``, and fc2 its input ``s*b*f`` (``3*s*b*f``, not 4).
    """
    pb = kernels.sizes
    h, dh, a, f = model.hidden, model.dim_head, model.n_heads // t, model.ffn // t
    tokens = b * s
    norm_split = t if sp else 1
    norms = 2 * norm_saved_bytes(model, kernels, tokens, split=norm_split)
    cast = bool(pb.autocast_copy)
    attn_in_copies = 3 if (cast and not model.qkv_fused) else 1
    mlp_in_copies = 2 if (cast and model.ffn_kind == "swiglu") else 1
    matmul_inputs = (attn_in_copies + mlp_in_copies) * tokens * h * pb.compute
    if sp and kernels.sp_saves_shard:
        matmul_inputs //= t
    kv_heads = model.kv_heads // t if kernels.attention == "sdpa" else a
    qkv = (a + 2 * kv_heads) * tokens * dh * pb.compute
    # The output projection's input. The fused kernels allocate their output as [b, s, a, d_h], so
    # the usual ``transpose(1, 2).reshape(b, s, h)`` is a view of the output sdpa saves: one storage.
    attn_out = tokens * a * dh * pb.compute
    if kernels.attention == "sdpa":
        attn_out += tokens * a * SDPA_LSE_BYTES
    swiglu_saved = 3 if kernels.fused_swiglu else 4
    mlp = (swiglu_saved if model.ffn_kind == "swiglu" else 2) * tokens * f * pb.compute
    masks = 2 * tokens * h * MASK_BYTES // norm_split if model.dropout > 0 else 0
    if is_moe(model) or uses_mla(model):
        return norms + masks + _moe_mla_layer_bytes(model, kernels, tokens, t, attn_in_copies, mlp_in_copies, mlp,
                                                    qkv + attn_out, swiglu_saved, kernels.sp_saves_shard and sp)
    return norms + matmul_inputs + qkv + attn_out + mlp + masks


def _moe_mla_layer_bytes(model: ModelSpec, kernels: Kernels, tokens: int, t: int, attn_in_copies: int,
                         mlp_in_copies: int, dense_mlp: int, attention: int, swiglu_saved: int, shard_inputs: bool) -> int:
    """The matmul-input, attention and MLP part of :func:`layer_activation_bytes` for a stack with
    mixture-of-experts blocks (``model/moe_terms.py``: each token through its k routed experts and the
    shared ones; the mean over the stack's dense and MoE blocks) or multi-head latent attention (its
    latents and head widths)."""
    from lightning_memplan.model import moe_terms

    pb = kernels.sizes
    h, c = model.hidden, pb.compute
    split = t if shard_inputs else 1
    mla = moe_terms.mla_attention_saved_bytes(model, tokens, c, t=t)
    if mla is not None:  # two input projections (q_a_proj, kv_a_proj_with_mqa), not three
        attention = mla + (tokens * (model.n_heads // t) * SDPA_LSE_BYTES if kernels.attention == "sdpa" else 0)
        attn_in_copies = min(attn_in_copies, 2)
    attn_inputs = attn_in_copies * tokens * h * c // split
    dense = mlp_in_copies * tokens * h * c // split + dense_mlp
    moe = moe_terms.moe_mlp_saved_bytes(model, tokens, c, t=t, cast=bool(pb.autocast_copy),
                                        swiglu_saved=swiglu_saved, expert_bytes=pb.param) if is_moe(model) else dense
    return attn_inputs + attention + moe_terms.mean_mlp_saved_bytes(model, dense, moe)


def layer_activation_split_bytes(
    model: ModelSpec, kernels: Kernels, b: int, s: int, *, t: int = 1, sp: bool = False
) -> tuple[int, int]:
    """:func:`layer_activation_bytes` split at the attention scores: ``(through the scores, after them)``,
    the two adding up to it.

    Through the scores: what the block saved up to the ``q k^T`` product, in the same accounting as
    :func:`layer_activation_bytes`: the first norm (:func:`norm_saved_bytes`), the attention input
    copies its projections save, and q and k as the scores' product receives them (``a`` and, under
    eager attention, ``a`` expanded key heads; sdpa's kernel ``k/t``); under MLA the latents twice and q
    and k at ``a*(d_n + d_r)``. After them: the rest, the value tensor, the attention output, the second
    norm, the MLP (an MoE stack's mean MLP) and the residual dropout masks, the tensors the block's
    backward has released by the time it reaches an eager softmax
    (:func:`eager_softmax_backward_freed_bytes`).
    """
    pb = kernels.sizes
    c, h = pb.compute, model.hidden
    tokens = b * s
    total = layer_activation_bytes(model, kernels, b, s, t=t, sp=sp)
    attn_in_copies = 3 if (pb.autocast_copy and not model.qkv_fused) else 1
    norm = norm_saved_bytes(model, kernels, tokens, split=t if sp else 1)
    a = model.n_heads // t
    mla = uses_mla(model)
    if mla:
        attn_in_copies = min(attn_in_copies, 2)
        qk = (model.qk_nope_head_dim or 0) + (model.qk_rope_head_dim or 0)
        scores = (2 * tokens * ((model.q_lora_rank or 0) + (model.kv_lora_rank or 0)) + tokens * a * 2 * qk) * c
    else:
        kv_heads = model.kv_heads // t if kernels.attention == "sdpa" else a
        scores = (a + kv_heads) * tokens * model.dim_head * c
    attn_inputs = attn_in_copies * tokens * h * c
    if sp and kernels.sp_saves_shard:
        attn_inputs //= t
    through = min(total, norm + attn_inputs + scores)
    return through, total - through


def full_recompute_layer_bytes(model: ModelSpec, residual_bytes: int, b: int, s: int, *, t: int = 1, sp: bool = False) -> int:
    """Full recompute keeps only each block's input, ``s*b*h`` in the residual dtype (``residual_bytes``,
    /t with SP) [K22 Table 2 "full"]; one block's activations are rebuilt transiently during its backward."""
    return b * s * model.hidden * residual_bytes // (t if sp else 1)


# ---------------------------------------------------------------------------------------------
# Logits and the loss
# ---------------------------------------------------------------------------------------------


#: ``LinearCrossEntropy`` computes a low-precision weight-gradient product in vocab blocks of at most
#: this many bytes before adding it to its fp32 accumulator (lightning_memplan/loss/chunked.py).
LOSS_WEIGHT_GRAD_BLOCK_BYTES = 16 * 2**20


def _chunked_loss_bytes(model: ModelSpec, kernels: Kernels, tokens: int, vocab: int) -> dict[str, int]:
    """Memory of ``LinearCrossEntropy`` in chunked mode (reduction mean/sum) for N = ``tokens``.

    The gradients are computed during the forward, chunk by chunk, and kept until backward scales
    them by ``grad_output``: the hidden states' gradient ``N*h`` (hidden dtype: the residual dtype,
    fp32 under autocast) and the fp32 weight gradient ``V*h*4``. The forward's peak adds the last
    chunk's working set ``chunk * V * (4 + g)`` (:func:`loss_chunk_row_bytes`) and the GEMM operands'
    copies: when the GEMMs run in 16 bit (CUDA), the casts of the weight and hidden states to it and one
    weight-gradient block; when a 16-bit compute dtype runs fp32 GEMMs (CPU, :func:`loss_gemm_bytes`),
    fp32 copies of the weight and hidden states. The hidden states' gradient is filled chunk by chunk in
    their dtype, through a [chunk, h] product when that is not the GEMM dtype.
    ``chunk`` is ``loss_chunk_size`` or the ``"auto"`` rule (:func:`auto_loss_chunk_tokens`).
    """
    pb = kernels.sizes
    h, e = model.hidden, pb.compute
    gemm = loss_gemm_bytes(e, kernels.device)
    chunk = min(tokens, kernels.loss_chunk_size or planned_loss_chunk_tokens(model, kernels, tokens, vocab))
    stored = tokens * h * pb.residual + vocab * h * FP32_BYTES
    # One transient at a time inside the loop: the chunk's input-gradient product, when the hidden
    # states (whose dtype their gradient is filled in) are not in the GEMM dtype, or a weight-gradient block.
    product = chunk * h * gemm if pb.residual != gemm else 0
    if gemm != e:
        casts = (vocab + tokens) * h * gemm + product
    elif e != FP32_BYTES:
        casts = max(min(vocab * h * e, LOSS_WEIGHT_GRAD_BLOCK_BYTES), product)
        if pb.param != e:
            casts += vocab * h * e
        if pb.residual != e:
            casts += tokens * h * e
    else:
        casts = product
    forward = chunk * loss_chunk_row_bytes(vocab, e, device=kernels.device) + stored + casts
    backward = stored + (vocab * h * pb.grad if pb.grad != FP32_BYTES else 0)
    return {"forward": forward, "held": stored, "backward": backward}


def logits_bytes(model: ModelSpec, kernels: Kernels, tokens: int, *, vocab_shard: int = 1) -> dict[str, int]:
    """The logits family around the loss for ``tokens`` = b*s tokens of one micro-batch (the loss mode
    ``kernels.loss``; the [b, s, V] logits and their fp32 copies [HF]).

    Returns ``{"forward": ..., "held": ..., "backward": ...}``: the transient peak while the loss is
    computed, what stays alive from the end of the loss until its backward, and the peak of the
    loss's backward. ``E = tokens * V / vocab_shard`` elements; ``e`` the logits dtype bytes.

    - ``naive`` (``F.cross_entropy(logits)``): forward ``e*E`` logits + (under autocast or 32-bit:
      the fp32 input of log_softmax ``4E`` when it is a copy) + the fp32/e log-probabilities; held: the
      log-probabilities; backward: log-probabilities + their gradient + the logits' gradient.
    - ``fp32_upcast`` (``logits = logits.float()`` before the loss, as Hugging Face models do):
      forward ``4E + max(e, 4)E`` (the rebinding frees the e-byte logits), backward ``12E``.
    - ``chunked``: this project's ``LinearCrossEntropy`` (:func:`_chunked_loss_bytes`): one chunk's
      working set plus the gradients it computes during the forward.
    - ``vocab_parallel``: naive with V/t columns per rank (``vocab_shard`` = t).
    - ``loss_parallel``: PyTorch's ``loss_parallel()`` on DTensor logits sharded ``Shard(-1)`` over t
      (torchtitan's TP recipe), V/t columns per rank (:func:`_loss_parallel_bytes`).
    """
    pb = kernels.sizes
    vocab = math.ceil(model.vocab_size / vocab_shard)
    e = pb.logits
    if kernels.loss == "chunked":
        return _chunked_loss_bytes(model, kernels, tokens, vocab)
    elems = tokens * vocab
    if kernels.loss == "loss_parallel":
        return _loss_parallel_bytes(elems, e)
    if kernels.loss == "fp32_upcast":
        # ``logits = logits.float()`` rebinds the name: the e-byte logits die once the copy exists,
        # so the peak is max(logits + copy, copy + log-probs); nothing of the copy outlives the loss.
        forward = elems * (FP32_BYTES + max(e, FP32_BYTES)) if e != FP32_BYTES else 2 * elems * FP32_BYTES
        held = elems * FP32_BYTES
        return {"forward": forward, "held": held, "backward": 3 * elems * FP32_BYTES}
    # Autocast upcasts cross_entropy's input to fp32 (a copy alive during log_softmax); the caller's
    # e-byte logits stay referenced while the loss runs.
    upcast_copy = FP32_BYTES if (e != FP32_BYTES and pb.autocast_copy) else 0
    lp = FP32_BYTES if (upcast_copy or e == FP32_BYTES) else e  # log-probabilities dtype
    forward = elems * (e + upcast_copy + lp)
    held = elems * lp
    return {"forward": forward, "held": held, "backward": 3 * elems * lp}


#: Loss modes whose logits hold V/t columns per tensor-parallel rank.
VOCAB_SHARDED_LOSSES = ("vocab_parallel", "loss_parallel")


def _loss_parallel_bytes(elems: int, e: int) -> dict[str, int]:
    """PyTorch's ``loss_parallel()`` (``torch/distributed/tensor/parallel/loss.py``) for
    ``F.cross_entropy(logits.float(), target)`` on E = ``elems`` local elements of e-byte logits.

    - forward (``_log_softmax``, the decomposition with all-reduces inserted): the caller's e-byte
      logits, their fp32 copy (none when e = 4), ``shifted = x - x_max`` and ``exp(shifted)`` (freed
      by the sum; the result takes its place): ``(e + 4 [copy] + 8) E``;
    - held: the fp32 log-probabilities that ``nll_loss`` saves, ``4E``;
    - backward (``_nll_loss_and_log_softmax_backward``, both backwards fused): the log-probabilities,
      ``zeros_like`` of them, ``exp(x)`` and ``grad_input + exp(x)`` before the product replaces the
      exp: ``16E`` (three more fp32 [N, V/t] buffers than the fused log_softmax backward's 12E).

    Measured with ``TensorTracker`` on 2 gloo ranks (N = 2048, V = 4096, bf16 and fp32 logits,
    tests/distributed/test_loss_parallel_memory.py): 14.0E / 16.0E (bf16), 12.0E / 16.0E (fp32).
    """
    copy = FP32_BYTES if e != FP32_BYTES else 0
    return {"forward": elems * (e + copy + 2 * FP32_BYTES), "held": elems * FP32_BYTES,
            "backward": 4 * elems * FP32_BYTES}


#: Byte budget of the per-chunk working set of ``LinearCrossEntropy(chunk_size="auto")``.
AUTO_CHUNK_BUDGET_BYTES = 512 * 2**20
#: ``chunk_size="auto"`` uses at most N / 16 rows per chunk, so the working set is at most 1/16 of the
#: [N, V] logits it replaces whatever the budget.
AUTO_MIN_CHUNKS = 16
#: ``chunk_size="auto"`` rounds down to a multiple of this many rows (GEMM-friendly, deterministic).
CHUNK_ROW_MULTIPLE = 64
#: ``chunk_size="auto"`` keeps the per-chunk working set within this fraction of the gradients the loss
#: returns, ``(N*h + V*h) * e`` (dh and dW); 64 rows at least. Half, not a quarter: on the reference CPU
#: (fp32, N=8192, h=512, V=32000, one core, ``benchmarks/bench_loss.py --issue12 --issue12-full
#: --issue12-dtype float32 --chunks 256 512``) 128-row chunks (a quarter) ran 0.997x the time of torch's
#: ``F.linear_cross_entropy``, 256 rows 0.876x, 512 rows 0.795x: each chunk streams the whole [V, h]
#: weight through three GEMMs, so smaller chunks lose the speed. torch's own chunked kernel holds
#: 157 MiB above its inputs there (allocator events), twice the 78.5 MiB of gradients.
AUTO_CHUNK_GRAD_FRACTION = 0.5


def loss_gemm_bytes(compute_bytes: int, device: str) -> int:
    """Element size of the chunked loss's GEMM operands for a compute dtype of ``compute_bytes`` on
    ``device``: the compute dtype's, except on CPU, where a 16-bit compute dtype runs its GEMMs in fp32
    on operands rounded to 16 bit (torch's CPU bf16 GEMM is 3-7x slower than fp32 without native bf16
    instructions; the measurements are in lightning_memplan/loss/chunked.py)."""
    if device == "cpu" and compute_bytes < FP32_BYTES:
        return FP32_BYTES
    return compute_bytes


def loss_chunk_row_bytes(vocab: int, compute_bytes: int, *, softcap: bool = False, device: str = "cuda") -> int:
    """Chunked-loss working set per token row: ``V*(4 + g [+ 4])``: one fp32 [chunk, V] buffer holds
    logits -> exp -> gradient in place, a [chunk, V] copy in the GEMM dtype (g bytes, when not fp32:
    :func:`loss_gemm_bytes`) feeds the matmuls, and a softcap keeps one more fp32 buffer for its
    derivative."""
    gemm = loss_gemm_bytes(compute_bytes, device)
    per_elem = FP32_BYTES + (gemm if gemm != FP32_BYTES else 0)
    if softcap:
        per_elem += FP32_BYTES
    return vocab * per_elem


def planned_loss_chunk_tokens(model: ModelSpec, kernels: Kernels, tokens: int, vocab: int | None = None) -> int:
    """Tokens per chunk the loss's ``chunk_size="auto"`` picks for ``tokens`` = b*s tokens of a run
    (:func:`auto_loss_chunk_tokens` at its compute dtype and device; ``vocab`` the local vocabulary,
    the model's by default): the one place the estimate and the planner's time model call the rule."""
    v = model.vocab_size if vocab is None else vocab
    return auto_loss_chunk_tokens(tokens, model.hidden, v, kernels.sizes.compute, device=kernels.device)


def auto_loss_chunk_tokens(
    n_tokens: int,
    hidden: int,
    vocab: int,
    compute_bytes: int = FP32_BYTES,
    *,
    budget_bytes: int = AUTO_CHUNK_BUDGET_BYTES,
    softcap: bool = False,
    grad_fraction: float = AUTO_CHUNK_GRAD_FRACTION,
    device: str = "cuda",
) -> int:
    """Tokens per chunk of ``chunk_size="auto"`` (the rule the loss, the planner and the estimate
    share): ``rows = min(budget, grad_fraction * (N*h + V*h) * e) // row_bytes``, at most N / 16,
    rounded down to a multiple of 64 (at least 64); no chunking (one chunk of N rows) when
    ``N <= max(h, 64)``, where the [N, V] logits are no larger than the [V, h] weight and its fp32
    gradient that exist anyway (the break-even torch's ``LinearCrossEntropyOptions`` documents).
    ``row_bytes`` is :func:`loss_chunk_row_bytes` on ``device``. The gradient cap keeps the working
    set within half the gradients' bytes (dh + dW) (:data:`AUTO_CHUNK_GRAD_FRACTION`)."""
    if n_tokens <= max(hidden, CHUNK_ROW_MULTIPLE):
        return max(n_tokens, 1)
    grads = (n_tokens + vocab) * hidden * compute_bytes
    budget = min(budget_bytes, int(grad_fraction * grads))
    rows = budget // max(loss_chunk_row_bytes(vocab, compute_bytes, softcap=softcap, device=device), 1)
    rows = min(rows, n_tokens // AUTO_MIN_CHUNKS)
    rows = max(CHUNK_ROW_MULTIPLE, rows - rows % CHUNK_ROW_MULTIPLE)
    return min(rows, n_tokens)


# ---------------------------------------------------------------------------------------------
# Pipelines, communication, optimizer temporaries
# ---------------------------------------------------------------------------------------------


def pipeline_inflight_microbatches(stage: int, p: int, m: int, schedule: str, v: int = 1) -> float:
    """Micro-batches whose activations a pipeline stage holds at its peak [N21 section 2.2, K22 4.2.3].

    - GPipe: all m forwards run before any backward: ``m``.
    - 1F1B: stage i runs ``p - i`` warm-up forwards: ``min(p - i, m)``.
    - interleaved (v chunks per rank, m a multiple of p): rank i runs ``(v-1) p + 2 (p-1-i)`` warm-up
      chunk forwards, capped at all ``m v`` of them, and one more forward before its first backward
      (torch 2.13 ``torch/distributed/pipelining/schedules.py`` ``_get_warmup_ops`` with
      ``microbatches_per_round = p``; Megatron-LM ``schedules.py``
      ``forward_backward_pipelining_with_interleaving``, ``num_warmup_microbatches``); in micro-batches
      of all its chunks that is ``min(m, ((v-1) p + 2 (p-1-i) + 1) / v)``. Stage 0 gets
      ``p (1 + (p-1)/(p v))`` [K22 4.2.3]; the last stage still ``p - (p-1)/v``, not ``1 + ...``: the
      ``(v-1) p`` warm-up of the earlier chunks is the same on every rank.
    """
    if p == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved" and v > 1:
        per_round = p if m >= p else m  # torch: n_microbatches // max(1, n_microbatches // p)
        held = min(m * v, (v - 1) * per_round + 2 * (p - 1 - stage)) + 1
        return min(float(m), held / v)
    inflight = float(min(p - stage, m))
    if schedule == "interleaved":
        inflight = min(float(m), inflight * (1 + (p - 1) / (p * v)))
    return inflight


def pipeline_head_inflight_microbatches(p: int, m: int, schedule: str) -> float:
    """Micro-batches whose loss-side tensors (final norm, lm_head input, logits) the last stage holds:
    the last chunk's forward is followed by its own backward under 1F1B and interleaved 1F1B (the last
    rank runs no warm-up of its last chunk: torch ``_get_warmup_ops`` counts only the earlier chunks'
    ``(v-1) p``) [N21 section 2.2], so ``1``; GPipe runs all m forwards first: ``m``."""
    if p == 1:
        return 1.0
    return float(m) if schedule == "gpipe" else 1.0


def ddp_bucket_bytes(grad_bytes: int) -> int:
    """DDP's gradient buckets: a second, flat copy of all gradients allocated at wrap time
    (``gradient_as_bucket_view=False``, the default in PyTorch and in Lightning's DDPStrategy) [PT
    torch/nn/parallel/distributed.py, Reducer]. Equals the gradient bytes."""
    return grad_bytes


def fsdp_root_post_backward_bytes(root_params: int, unsharded_grad_bytes: int, reduce_bytes: int) -> int:
    """The communication bytes of FSDP2's root unit at the end of the backward, ``root_params * (g + r)``:
    the root (the module ``fully_shard`` was applied to last, holding the embedding, final norm and
    lm_head when they are not wrapped per block) has no forward input that requires grad, so its
    post-backward runs in the backward's final callback (``FSDPState._root_post_backward_final_callback``);
    until then each of its parameters keeps its *unsharded* gradient (g bytes, the all-gather dtype:
    ``param_dtype`` under ``MixedPrecisionPolicy``). ``FSDPParamGroup.post_backward`` collects them,
    reshards (frees the gathered parameters), then ``foreach_reduce`` copies them into one flat
    reduce-scatter input in ``reduce_dtype`` (r bytes) before it frees them
    (``foreach_reduce_scatter_copy_in`` then ``unsharded_grads.clear()``) [PT
    torch/distributed/fsdp/_fully_shard/_fsdp_state.py, _fsdp_param_group.py, _fsdp_collectives.py].
    For Llama 3 8B (2 x 128256 x 4096 root parameters, bf16 grads, fp32 reduce) that is 6.3 GB."""
    return root_params * (unsharded_grad_bytes + reduce_bytes)


def fsdp_post_forward_shard_bytes(unit_bytes: int, units: int, reshard_to: int, shard: int) -> int:
    """Bytes the ZeRO-3 block units hold between their forward and backward, ``units * ceil(U / n)``
    for ``fully_shard(reshard_after_forward=n)`` with ``1 < n < d`` (U the bytes of one block's gathered
    parameters, d the shard group): after its forward each block clones its ``1/n`` slice of the
    all-gather output (``FSDPParam.to_sharded_post_forward``, ``narrow(...).clone()``) and frees the rest;
    the slice lives until that block's pre-backward all-gather over the ``n`` ranks copies it in
    (``FSDPParam.to_unsharded`` drops it) [PT torch/distributed/fsdp/_fully_shard/_fsdp_param.py,
    ``fully_shard`` docstring]. ``n = d`` is ``True`` (ZeRO-3: the slice is the rank's own shard,
    nothing extra: 0); ``n = 1`` would be ``False`` (ZeRO-2: the whole unit, counted as gathered
    parameters instead). So the int case lies between: ``0 < units * U / n < units * U``."""
    if reshard_to >= shard or reshard_to <= 1:
        return 0
    return units * math.ceil(unit_bytes / reshard_to)


def fsdp1_padded_numel(numel: int, shard: int) -> int:
    """Elements of one FSDP1 unit's unsharded ``FlatParameter``, ``ceil(n / d) * d``: the unit's parameters
    padded to a multiple of the d ranks it is sharded over, "to avoid a copy for the post-backward
    reduce-scatter" [PT torch/distributed/fsdp/_flat_param.py, ``FlatParamHandle.
    _init_flat_param_and_metadata``; ``_get_padded_unsharded_numel``]. Under ``use_orig_params`` each
    original parameter is first aligned to 16 bytes (``_get_aligned_numel``); a ``ModelSpec`` does not list
    parameter sizes, so that alignment (under 4 elements per fp32 parameter) is not counted."""
    return math.ceil(numel / shard) * shard if shard > 1 else numel


def fsdp1_shard_numel(numel: int, shard: int) -> int:
    """Elements of one FSDP1 unit each rank keeps, ``ceil(n / d)``: its chunk of the padded flat parameter
    (the last rank's chunk ends in the padding) [PT _flat_param.py, ``FlatParamHandle._get_shard``]. Its
    sharded gradient has the same size (``_reduce_grad``'s reduce-scatter output)."""
    return fsdp1_padded_numel(numel, shard) // shard if shard > 1 else numel


def fsdp1_rank_flat_numel(unit_numels: list[int], shard: int) -> int:
    """Elements of all of a rank's FSDP1 flat shards, ``sum_u ceil(n_u / d)`` over its units (the L blocks
    and the root): what its sharded parameters and gradients hold, padding included."""
    return sum(fsdp1_shard_numel(n, shard) for n in unit_numels)


def optimizer_workspace_bytes(optimizer: OptimizerBytes, local_params: int, largest_param: int) -> int:
    """Temporaries of ``optimizer.step()`` [PT torch/optim/adam.py]:

    - ``foreach`` Adam/AdamW: ``torch._foreach_sqrt(exp_avg_sqs)`` makes one state-sized temporary
      for every local parameter: ``N_local * state_bytes``;
    - ``for_loop``: ``exp_avg_sq.sqrt()`` then ``/ bias_correction2_sqrt`` for one parameter at a
      time: ``2 * largest_param * state_bytes``;
    - ``fused`` and stateless SGD: 0. Momentum SGD and Lion update in place: 0 (foreach Lion: one
      state-sized temporary for the sign update).
    """
    state = optimizer.state
    if optimizer.impl == "fused" or optimizer.name in ("sgd", "sgd_momentum", "adafactor"):
        return 0
    if optimizer.low_bit:  # one fused (bitsandbytes) or compiled (torchao) kernel per tensor (model/quantized.py)
        return 0
    if optimizer.name == "lion":
        return local_params * state if optimizer.impl == "foreach" else largest_param * state
    if optimizer.impl == "foreach":
        return local_params * state
    return 2 * largest_param * state
