"""Parameter counts of a :class:`~lightning_memplan.model.specs.ModelSpec`'s shape (one formula each).

Its own module so that ``ModelSpec.num_params`` and the memory terms (``model/terms.py``) both read
the counts from here: it imports nothing from the model package at run time, so ``specs`` depends on
nothing above it and ``terms`` -> ``specs`` is one-way (it was ``specs`` -> ``terms`` -> ``specs``).

Symbols as in docs/concepts.md: h hidden, a query heads, k key/value heads, d_h head width, f MLP
width, V vocabulary, P learned positions, L blocks; for mixture-of-experts stacks (``model/experts.py``)
E routed experts of width f_e, k_e of them per token, S shared experts of width f_s; for multi-head
latent attention r_q/r_kv the query/key-value ranks, d_n/d_r/d_v the no-rope/rope/value head widths.

A stack whose blocks differ (DeepSeek-V3's three dense blocks, Llama-4-Maverick's alternating MoE
blocks) is counted block kind by block kind: :func:`blocks_param_count`. The per-block functions
(:func:`layer_param_count`, :func:`layer_matmul_param_count`) give the *largest* block, the MoE one:
what one FSDP unit all-gathers at most. Shapes are those of transformers 5.3 (``models/mixtral/
modeling_mixtral.py`` ``MixtralExperts``: ``gate_up_proj [E, 2 f_e, h]``, ``down_proj [E, h, f_e]``,
router ``gate [E, h]``; ``models/qwen2_moe/modeling_qwen2_moe.py``: a shared expert and a
``shared_expert_gate [1, h]``; ``models/deepseek_v3/modeling_deepseek_v3.py``: MLA with
``q_a_layernorm``/``kv_a_layernorm``, ``shared_experts`` of width ``n_shared_experts * f_e``, the
router's ``e_score_correction_bias`` a buffer, not a parameter; ``models/llama4/modeling_llama4.py``:
dense blocks of width ``intermediate_size_mlp``, a shared expert, L2 q/k norms without weights;
``models/gpt_oss/modeling_gpt_oss.py``: biases on every attention projection, the router and the
experts, one attention sink per head).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_memplan.model.experts import is_moe, moe_layer_count

if TYPE_CHECKING:  # annotations only: no run-time import of specs
    from lightning_memplan.model.specs import ModelSpec

__all__ = [
    "active_layer_matmul_param_count",
    "attention_matmul_param_count",
    "blocks_param_count",
    "dense_layer_param_count",
    "embedding_param_count",
    "head_param_count",
    "routed_expert_param_count",
    "layer_bias_count",
    "layer_matmul_param_count",
    "layer_param_count",
    "layer_params_after_scores",
    "moe_layer_param_count",
    "norm_param_count",
    "param_count",
]


def norm_param_count(model: ModelSpec) -> int:
    """Parameters of one norm layer: ``2h`` for LayerNorm (weight and bias), ``h`` for RMSNorm."""
    return 2 * model.hidden if model.norm == "layernorm" else model.hidden


def attention_matmul_param_count(model: ModelSpec) -> int:
    """Weights of one block's attention projections.

    Standard (MHA/GQA/MQA): q ``h*a*d_h``, k and v ``h*k*d_h`` each, output ``a*d_h*h``.
    Multi-head latent attention (``kv_lora_rank`` set; DeepSeek-V3, ``modeling_deepseek_v3.py``
    ``DeepseekV3Attention``): q ``h*r_q + r_q*a*(d_n+d_r)`` (``q_a_proj``, ``q_b_proj``; without
    ``q_lora_rank`` one ``h*a*(d_n+d_r)``), ``kv_a_proj_with_mqa`` ``h*(r_kv+d_r)``, ``kv_b_proj``
    ``r_kv*a*(d_n+d_v)``, output ``a*d_v*h``.
    """
    h, dh, a, k = model.hidden, model.dim_head, model.n_heads, model.kv_heads
    if model.kv_lora_rank is None:
        return h * a * dh + 2 * h * k * dh + a * dh * h
    rkv, dn, dr, dv = model.kv_lora_rank, model.qk_nope_head_dim or 0, model.qk_rope_head_dim or 0, model.v_head_dim or 0
    q = h * a * (dn + dr) if model.q_lora_rank is None else h * model.q_lora_rank + model.q_lora_rank * a * (dn + dr)
    return q + h * (rkv + dr) + rkv * a * (dn + dv) + a * dv * h


def _mlp_matmul(model: ModelSpec, width: int) -> int:
    """One MLP of inner width ``width``: ``2*h*w`` for gelu/relu (up, down), ``3*h*w`` for swiglu."""
    return (3 if model.ffn_kind == "swiglu" else 2) * model.hidden * width


def _mlp_bias(model: ModelSpec, width: int) -> int:
    """One MLP's biases: ``w + h`` (swiglu ``2w + h``)."""
    return (2 * width if model.ffn_kind == "swiglu" else width) + model.hidden


def _moe_mlp_matmul(model: ModelSpec) -> int:
    """An MoE block's MLP weights: ``E * mlp(f_e) + S * mlp(f_s) + E*h`` (router) ``+ h`` (Qwen2-MoE's
    shared-expert gate)."""
    h = model.hidden
    return (model.n_experts * _mlp_matmul(model, model.expert_ffn)
            + model.n_shared_experts * _mlp_matmul(model, model.shared_expert_ffn)
            + model.n_experts * h + (h if model.shared_expert_gate else 0))


def routed_expert_param_count(model: ModelSpec) -> int:
    """The routed experts' weights of one MoE block, ``E * mlp(f_e)`` (0 for a dense block): the part of
    :func:`layer_matmul_param_count` that autocast never copies, since transformers' default expert
    kernel (``grouped_mm``) is not autocast-enabled and runs in the weights' own dtype
    (``transformers/integrations/moe.py`` ``_grouped_mm``)."""
    return model.n_experts * _mlp_matmul(model, model.expert_ffn) if is_moe(model) else 0


def layer_matmul_param_count(model: ModelSpec, *, moe: bool | None = None) -> int:
    """Weights of the linear layers of one block (what autocast copies and TP splits).

    Attention: :func:`attention_matmul_param_count`. MLP: ``2*h*f`` for gelu/relu (up, down),
    ``3*h*f`` for swiglu (gate, up, down); an MoE block's router, experts and shared experts instead
    (``moe=True``; default: the largest block of the stack, the MoE one when there is one).
    """
    moe = is_moe(model) if moe is None else moe
    mlp = _moe_mlp_matmul(model) if moe else _mlp_matmul(model, model.ffn)
    return attention_matmul_param_count(model) + mlp


def active_layer_matmul_param_count(model: ModelSpec) -> float:
    """Weights one token multiplies with in an average block (the FLOPs side): attention, and for an
    MoE block the router, its k_e routed experts and the shared ones instead of all E; the mean over
    the stack's blocks. Equal to :func:`layer_matmul_param_count` for a dense model."""
    if not is_moe(model):
        return layer_matmul_param_count(model)
    h, n_moe = model.hidden, moe_layer_count(model)
    active_moe = (attention_matmul_param_count(model) + (model.experts_per_token or 0) * _mlp_matmul(model, model.expert_ffn)
                  + model.n_shared_experts * _mlp_matmul(model, model.shared_expert_ffn)
                  + model.n_experts * h + (h if model.shared_expert_gate else 0))
    dense = layer_matmul_param_count(model, moe=False)
    return (n_moe * active_moe + (model.n_layers - n_moe) * dense) / model.n_layers


def layer_bias_count(model: ModelSpec, *, moe: bool | None = None) -> int:
    """Biases of one block.

    ``bias=True`` (GPT-2, GPT-NeoX): every linear, q ``a*d_h``, k and v ``k*d_h`` each, output ``h``,
    MLP ``f + h`` (swiglu: ``2f + h``). ``qkv_bias=True`` alone (Qwen2: ``q_proj``/``k_proj``/``v_proj``
    carry biases, ``o_proj`` and the MLP do not; transformers ``models/qwen2/modeling_qwen2.py``
    ``Qwen2Attention``): ``a*d_h + 2*k*d_h``.
    An MoE block (``moe``, default as :func:`layer_matmul_param_count`) with ``bias=True`` (GPT-OSS):
    each routed and shared expert's MLP biases, and the router's ``E``.
    """
    h, dh, a, k = model.hidden, model.dim_head, model.n_heads, model.kv_heads
    qkv = a * dh + 2 * k * dh
    if not model.bias:
        return qkv if model.qkv_bias else 0
    moe = is_moe(model) if moe is None else moe
    if moe:
        mlp_bias = (model.n_experts * _mlp_bias(model, model.expert_ffn) + model.n_experts
                    + model.n_shared_experts * _mlp_bias(model, model.shared_expert_ffn))
    else:
        mlp_bias = _mlp_bias(model, model.ffn)
    return qkv + h + mlp_bias


def _mla_norm_count(model: ModelSpec) -> int:
    """MLA's RMSNorms on the latents: ``r_q + r_kv`` (``q_a_layernorm``, ``kv_a_layernorm``)."""
    if model.kv_lora_rank is None:
        return 0
    return (model.q_lora_rank or 0) + model.kv_lora_rank


def layer_param_count(model: ModelSpec, *, moe: bool | None = None) -> int:
    """Parameters of one transformer block: matmul weights + biases + two norms + ``extra_layer_params``
    (more norms per block, e.g. Gemma-2's four, or q/k norms, attention sinks: what the config reader
    counts) + MLA's latent norms. ``moe`` as :func:`layer_matmul_param_count` (default: the largest block)."""
    return (
        layer_matmul_param_count(model, moe=moe) + layer_bias_count(model, moe=moe) + 2 * norm_param_count(model)
        + model.extra_layer_params + _mla_norm_count(model)
    )


def layer_params_after_scores(model: ModelSpec, *, moe: bool | None = None) -> tuple[int, int]:
    """``(matmul weights, other parameters)`` of one block that come after its attention scores in the
    forward, so that a backward reaches them before the scores' softmax: the output projection
    (``a*d_h*h``; ``a*d_v*h`` under MLA) and everything behind it, the MLP (or MoE block, ``moe`` as
    :func:`layer_matmul_param_count`), the second norm, the biases of the output projection and the MLP,
    and ``extra_layer_params``. The rest of :func:`layer_param_count` (the first norm, the q/k/v (MLA:
    latent) projections with their biases, MLA's latent norms) is what the block's backward reaches
    after the softmax's. "Other" holds one norm (``norm_param_count``), replicated under tensor
    parallelism, as the caller splits it."""
    h, dh, a, k = model.hidden, model.dim_head, model.n_heads, model.kv_heads
    out_proj = a * ((model.v_head_dim or 0) if model.kv_lora_rank is not None else dh) * h
    matmul = layer_matmul_param_count(model, moe=moe) - attention_matmul_param_count(model) + out_proj
    qkv_bias = a * dh + 2 * k * dh if (model.bias or model.qkv_bias) else 0
    before_other = norm_param_count(model) + qkv_bias + _mla_norm_count(model)
    other = layer_param_count(model, moe=moe) - layer_matmul_param_count(model, moe=moe) - before_other
    return matmul, other


def dense_layer_param_count(model: ModelSpec) -> int:
    """Parameters of one dense block (of a dense model, or the dense blocks of an MoE stack)."""
    return layer_param_count(model, moe=False)


def moe_layer_param_count(model: ModelSpec) -> int:
    """Parameters of one MoE block (0 for a dense model)."""
    return layer_param_count(model, moe=True) if is_moe(model) else 0


def blocks_param_count(model: ModelSpec) -> int:
    """Parameters of all L blocks: ``L_moe * moe block + (L - L_moe) * dense block``."""
    if not is_moe(model):
        return model.n_layers * layer_param_count(model)
    n_moe = moe_layer_count(model)
    return n_moe * moe_layer_param_count(model) + (model.n_layers - n_moe) * dense_layer_param_count(model)


def embedding_param_count(model: ModelSpec) -> int:
    """Token embedding ``V*h`` plus a learned position table ``P*h`` (stage 0 holds them)."""
    pos = (model.max_positions or 0) * model.hidden if model.position_embedding == "learned" else 0
    return model.vocab_size * model.hidden + pos


def head_param_count(model: ModelSpec) -> int:
    """Final norm plus an untied lm_head ``V*h`` (tied: the head reuses the embedding)."""
    head = 0 if model.tied_embeddings else model.vocab_size * model.hidden
    return norm_param_count(model) + head


def param_count(model: ModelSpec) -> int:
    """N = embeddings + the L blocks (:func:`blocks_param_count`) + final norm + untied head."""
    return embedding_param_count(model) + blocks_param_count(model) + head_param_count(model)
