"""FLOP counts of one training step, each term its own function with its formula and source.

Symbols (docs/concepts.md): b micro-batch, s sequence length, h hidden, a heads, d_h head width, L layers,
V vocab, N parameters, t/p/c tensor/pipeline/context parallel.

Sources:
  [K20]  Kaplan et al. 2020, "Scaling Laws for Neural Language Models", arXiv 2001.08361, section 2.1:
         a forward pass costs 2N FLOPs per token, forward + backward 6N.
  [N21]  Narayanan et al. 2021, arXiv 2104.04473, section 5.1 eq. (3): per iteration
         96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with full recomputation, i.e. 72 B s l h^2 (...) without;
         the s/(6h) term is the attention score and context matmuls, counted without causal masking.
  [P22]  Chowdhery et al. 2022 (PaLM), arXiv 2204.02311, Appendix B: model FLOPs per token
         6N + 12 L h s, and MFU = achieved model FLOPs / peak (recomputation excluded).
  [K22]  Korthikanti et al. 2022, arXiv 2205.05198, section 5: selective recomputation recomputes only
         the attention core (Q K^T, softmax, dropout, attention over V).
  [TT-AC] torchtitan ``torchtitan/models/llama3/infra/parallelize.py`` (``_apply_ac_to_transformer_block``,
         op-level selective AC): the outputs of matmuls, attention and reductions are saved "except every
         second mm" (counted per block in forward order), so the backward re-runs every second matmul
         and the element-wise ops between them.
"""

from __future__ import annotations

from lightning_memplan.model import terms
from lightning_memplan.model.specs import ModelSpec

__all__ = [
    "attention_flops_per_token",
    "layer_matmul_flops_per_token",
    "head_flops_per_token",
    "model_flops_per_token",
    "param_scale",
    "recompute_flops_per_token",
    "selective_op_recompute_params",
]

#: FLOPs per multiply-accumulate.
FLOPS_PER_MAC = 2
#: Backward costs twice the forward: gradients w.r.t. inputs and w.r.t. weights [K20 2.1].
BACKWARD_TO_FORWARD = 2


def param_scale(model: ModelSpec) -> float:
    """``n_params / param_count(shape)`` when ``n_params`` overrides the shape-derived count, else 1.

    The memory model rescales per-stage parameter counts the same way, so time and memory agree."""
    if model.n_params is None:
        return 1.0
    return model.n_params / terms.param_count(model)


def layer_matmul_flops_per_token(model: ModelSpec) -> float:
    """Forward + backward FLOPs of one block's linear layers per token: ``6 * P_layer`` [K20, N21].

    ``P_layer`` = matmul weights of one block (q, k, v, o, and the 2 or 3 MLP matrices); for a
    mixture-of-experts stack the weights a token goes through (router, its k routed experts, the
    shared ones), averaged over the stack's blocks (``param_counts.active_layer_matmul_param_count``)."""
    fwd = FLOPS_PER_MAC * terms.active_layer_matmul_param_count(model) * param_scale(model)
    return fwd * (1 + BACKWARD_TO_FORWARD)


def attention_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Forward + backward FLOPs of one block's attention core per token: ``12 * s * a * d_h``.

    Forward: Q K^T and (softmax) x V are ``2 * s * a * d_h`` MACs per token = ``4 s a d_h`` FLOPs;
    backward doubles it. Counted over the full s x s square as [N21] eq. (3) and [P22] do (the
    convention behind published MFU figures), although causal kernels skip half of it."""
    fwd = 2 * FLOPS_PER_MAC * seq_len * model.n_heads * model.dim_head
    return fwd * (1 + BACKWARD_TO_FORWARD)


def head_flops_per_token(model: ModelSpec) -> float:
    """Forward + backward FLOPs of the lm_head per token: ``6 * V * h`` (tied or not, it is a matmul)."""
    return FLOPS_PER_MAC * model.vocab_size * model.hidden * (1 + BACKWARD_TO_FORWARD) * param_scale(model)


def model_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Model FLOPs per token, no recomputation: ``L * (6 P_layer + 12 s a d_h) + 6 V h``.

    Equals [P22]'s ``6N + 12 L h s`` with N counting matmul weights only (embedding lookups and norms
    are not matmuls) and [N21] eq. (3) divided by B s for the GPT shape (P_layer = 12 h^2)."""
    per_layer = layer_matmul_flops_per_token(model) + attention_flops_per_token(model, seq_len)
    return model.n_layers * per_layer + head_flops_per_token(model)


def selective_op_recompute_params(model: ModelSpec) -> int:
    """Weights of the matmuls op-level selective AC re-runs in one block: the 2nd, 4th, ... of the
    block's forward matmul order [TT-AC], taken from :func:`~lightning_memplan.model.checkpointing.
    block_matmul_widths` (the order the memory terms use too): k, o and up for SwiGLU
    (``down(silu(gate x) * up x)``), k, o and down for GELU/ReLU; o and up/down with a fused qkv."""
    from lightning_memplan.model.checkpointing import block_matmul_widths

    in_features = {"o": model.n_heads * model.dim_head, "down": model.ffn}
    return sum(in_features.get(name, model.hidden) * out for name, out in block_matmul_widths(model)[1::2])


def recompute_flops_per_token(model: ModelSpec, seq_len: int, mode: str, *, layers: int | None = None) -> float:
    """Extra FLOPs per token that activation recomputation adds (one more forward of what is dropped).

    - ``"none"``: 0.
    - ``"selective"``: the attention core's forward ``4 s a d_h`` per layer [K22 section 5].
    - ``"selective_op"``: every second matmul's forward, ``2 P_op`` per layer with ``P_op`` from
      :func:`selective_op_recompute_params` (attention outputs are saved) [TT-AC].
    - ``"full"``: each block's whole forward ``2 P_layer + 4 s a d_h`` per layer (the 96 vs 72 of
      [N21] eq. (3)); the lm_head is not recomputed.
    """
    n = model.n_layers if layers is None else layers
    attn_fwd = attention_flops_per_token(model, seq_len) / (1 + BACKWARD_TO_FORWARD)
    if mode == "none":
        return 0.0
    if mode == "selective":
        return n * attn_fwd
    if mode == "selective_op":
        return n * FLOPS_PER_MAC * selective_op_recompute_params(model) * param_scale(model)
    if mode == "full":
        return n * (layer_matmul_flops_per_token(model) / (1 + BACKWARD_TO_FORWARD) + attn_fwd)
    raise ValueError(f"recompute={mode!r} must be 'none', 'selective', 'selective_op' or 'full'")
