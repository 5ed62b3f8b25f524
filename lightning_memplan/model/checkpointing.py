"""Op-level selective activation checkpointing (``recompute="selective_op"``): which tensors a block
keeps under torchtitan's policy, and what its recompute rebuilds.

Source [TT]: torchtitan, ``torchtitan/distributed/activation_checkpoint.py`` at commit
``8a6c9fe6e49d68b0ed053e1ecf8e8c196ac3db49`` (``_save_list`` and ``_get_custom_policy``; the same list
as ``torchtitan/parallelisms/parallelize_llama.py`` at ``9dec370ad26b5f8e9a7333a0e36165018262644b``,
the commit of the published Llama 3.1 benchmarks ``benchmarks/llama3_h100_202412_torchtitan.md``).
Each block runs under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
context_fn=create_selective_checkpoint_contexts(policy))`` [PT torch/utils/checkpoint.py]; the policy
says ``MUST_SAVE`` for the outputs of the ops in :data:`SAC_SAVE_OPS` except every second matmul of the
block's forward (a counter per block and per pass), and ``PREFER_RECOMPUTE`` for everything else.

This differs from ``recompute="selective"``, Korthikanti et al.'s attention-core recompute (arXiv
2205.05198 section 5), which keeps every tensor but the [b, a, s, s] scores: under SDPA it saves
nothing, under selective-op about two thirds of a block's activations are dropped.

Bytes are integers; the symbols are docs/concepts.md's (b, s, h, a, k, f, t).
"""

from __future__ import annotations

import dataclasses

from lightning_memplan.model import terms
from lightning_memplan.model.sizes import SDPA_LSE_BYTES, Kernels
from lightning_memplan.model.specs import ModelSpec

__all__ = [
    "SAC_MATMUL_OPS",
    "SAC_SAVE_OPS",
    "TORCHTITAN_SAC_COMMIT",
    "block_matmul_widths",
    "selective_op_layer_bytes",
    "selective_op_rebuild_bytes",
    "selective_op_saved_matmuls",
]

#: The torchtitan commit whose policy is reproduced (see the module docstring).
TORCHTITAN_SAC_COMMIT = "8a6c9fe6e49d68b0ed053e1ecf8e8c196ac3db49"

#: Matmul ops the "every second one is recomputed" counter runs over. torchtitan counts
#: ``aten.mm`` (its models have no biases); a biased ``nn.Linear`` on a contiguous 3-d input dispatches
#: to ``aten.addmm`` instead, counted the same way here so that biased models get the same policy.
SAC_MATMUL_OPS = ("aten.mm.default", "aten.addmm.default")

#: Ops whose outputs the policy saves [TT ``_save_list``]: the matmuls (minus every second one), the
#: fused attention kernels (output and fp32 log-sum-exp), the sequence-parallel reduce-scatter and
#: ``max`` (float8 scaling). ``_scaled_dot_product_flash_attention_for_cpu`` (the CPU kernel) and
#: ``_scaled_dot_product_cudnn_attention`` are the same fused attention on other backends, added so
#: the policy means the same on CPU and on cuDNN; ``abs`` is in the 2024 list (float8), kept.
SAC_SAVE_OPS = (
    *SAC_MATMUL_OPS,
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "aten.abs.default",
    "aten.max.default",
)


def block_matmul_widths(model: ModelSpec, *, t: int = 1) -> list[tuple[str, int]]:
    """The matmuls of one block in forward order, ``(name, output features per token on one rank)``.

    Attention: ``q`` ``a*d_h/t``, ``k`` and ``v`` ``k*d_h/t`` (one ``qkv`` of ``(a+2k)*d_h/t`` when
    fused), ``o`` ``h`` (row-parallel under TP: a partial sum of full width). MLP: swiglu ``gate`` ``f/t``,
    ``up`` ``f/t``, ``down`` ``h`` (``down(silu(gate(x)) * up(x))`` evaluates gate before up); gelu/relu
    ``up`` ``f/t`` and ``down`` ``h``. Eager attention's ``q @ k^T`` and ``p @ v`` are batched matmuls
    (``aten.bmm``), not in the list.
    """
    h, dh, a, k, f = model.hidden, model.dim_head, model.n_heads // t, model.kv_heads // t, model.ffn // t
    attn = [("qkv", (a + 2 * k) * dh)] if model.qkv_fused else [("q", a * dh), ("k", k * dh), ("v", k * dh)]
    attn.append(("o", h))
    mlp = [("gate", f), ("up", f), ("down", h)] if model.ffn_kind == "swiglu" else [("up", f), ("down", h)]
    return attn + mlp


def selective_op_saved_matmuls(model: ModelSpec, *, t: int = 1) -> list[tuple[str, int]]:
    """The matmuls whose outputs the policy keeps: the 1st, 3rd, 5th, ... of the block [TT: the
    counter is incremented before the test ``mm_count % 2 == 0`` -> recompute]. Llama: q, v, gate, down."""
    return block_matmul_widths(model, t=t)[0::2]


def _block_input_bytes(model: ModelSpec, kernels: Kernels, tokens: int, split: int) -> int:
    return tokens * model.hidden * kernels.sizes.residual // split


def _attention_output_bytes(model: ModelSpec, kernels: Kernels, tokens: int, t: int) -> int:
    """The fused kernel's output ``s*b*a*d_h/t`` in the compute dtype plus its fp32 log-sum-exp
    ``s*b*a/t`` (:data:`~lightning_memplan.model.sizes.SDPA_LSE_BYTES` per token and head); 0 for eager
    attention (its matmuls are ``bmm``, recomputed)."""
    if kernels.attention != "sdpa":
        return 0
    a = model.n_heads // t
    return tokens * a * model.dim_head * kernels.sizes.compute + tokens * a * SDPA_LSE_BYTES


def selective_op_layer_bytes(
    model: ModelSpec, kernels: Kernels, b: int, s: int, *, t: int = 1, sp: bool = False
) -> int:
    """Bytes one block keeps from its forward to its backward under ``recompute="selective_op"``:

    ``input + sum(saved matmul outputs) + attention output (+ lse) [+ reduce-scatter outputs]``

    - the block input ``s*b*h`` (residual dtype, /t with SP), held by ``checkpoint`` for the recompute;
    - every second matmul output (:func:`selective_op_saved_matmuls`) in the compute dtype; Llama:
      ``s*b*(a*d_h + k*d_h + f + h)/t``-ish (the row-parallel ``down`` keeps its full-width partial sum);
    - the fused attention output and its fp32 log-sum-exp (:func:`_attention_output_bytes`);
    - with SP, the two reduce-scatter outputs ``2*s*b*h/t`` (``_c10d_functional.reduce_scatter_tensor``).

    Norms, activations functions, RoPE, residual adds and dropout are recomputed [TT]. Worked example
    (zoo Llama, h=128, a=4, k=2, d_h=32, f=512, b*s=256, fp32): 131072 + 4*256*(128+64+512+128) +
    256*128*4 + 256*4*4 = 1,118,208 bytes, which a traced step reproduces exactly.
    """
    tokens = b * s
    pb_compute = kernels.sizes.compute
    saved = _block_input_bytes(model, kernels, tokens, t if sp else 1)
    saved += sum(width * tokens * pb_compute for _, width in selective_op_saved_matmuls(model, t=t))
    saved += _attention_output_bytes(model, kernels, tokens, t)
    if sp and t > 1:
        saved += 2 * tokens * model.hidden * pb_compute // t
    return saved


def selective_op_rebuild_bytes(
    model: ModelSpec, kernels: Kernels, b: int, s: int, *, t: int = 1, sp: bool = False
) -> int:
    """Extra bytes while one block is recomputed for its backward: the block's full saved set
    (:func:`~lightning_memplan.model.terms.layer_activation_bytes` + its eager probabilities) minus
    what it shares with the kept set (those tensors are the cached ones, not new storage):

    - the block input, when the first norm saves its input itself
      (:func:`~lightning_memplan.model.terms.norm_saves_its_input`);
    - ``q`` (or the fused ``qkv``) when no rotary embedding makes a new tensor of it;
    - ``v`` when the kernel receives it as a view (sdpa, or eager without GQA's ``repeat_interleave``);
    - the first MLP matmul's output (the activation function saves its input);
    - the attention output and lse (the output projection and the kernel save them).
    """
    tokens = b * s
    e = kernels.sizes.compute
    none = dataclasses.replace(kernels, recompute="none")
    full = terms.layer_activation_bytes(model, none, b, s, t=t, sp=sp) + terms.eager_attention_bytes(
        model, none, b, s, t=t
    )
    shared = _attention_output_bytes(model, kernels, tokens, t)
    if terms.norm_saves_its_input(model, kernels):
        shared += _block_input_bytes(model, kernels, tokens, t if sp else 1)
    widths = dict(selective_op_saved_matmuls(model, t=t))
    if "qkv" in widths:  # v is a view of the fused projection: its storage is saved either way
        shared += widths["qkv"] * tokens * e
    if "q" in widths and model.position_embedding != "rope":
        shared += widths["q"] * tokens * e
    if "v" in widths and (kernels.attention == "sdpa" or model.kv_heads == model.n_heads):
        shared += widths["v"] * tokens * e
    first_mlp = "gate" if model.ffn_kind == "swiglu" else "up"
    if first_mlp in widths:
        shared += widths[first_mlp] * tokens * e
    return max(0, full - shared)
