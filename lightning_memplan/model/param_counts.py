"""Parameter counts of a :class:`~lightning_memplan.model.specs.ModelSpec`'s shape (one formula each).

Its own module so that ``ModelSpec.num_params`` and the memory terms (``model/terms.py``) both read
the counts from here: it imports nothing from the model package at run time, so ``specs`` depends on
nothing above it and ``terms`` -> ``specs`` is one-way (it was ``specs`` -> ``terms`` -> ``specs``).

Symbols as in docs/DESIGN.md: h hidden, a query heads, k key/value heads, d_h head width, f MLP
width, V vocabulary, P learned positions, L blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: no run-time import of specs
    from lightning_memplan.model.specs import ModelSpec

__all__ = [
    "embedding_param_count",
    "head_param_count",
    "layer_bias_count",
    "layer_matmul_param_count",
    "layer_param_count",
    "norm_param_count",
    "param_count",
]


def norm_param_count(model: ModelSpec) -> int:
    """Parameters of one norm layer: ``2h`` for LayerNorm (weight and bias), ``h`` for RMSNorm."""
    return 2 * model.hidden if model.norm == "layernorm" else model.hidden


def layer_matmul_param_count(model: ModelSpec) -> int:
    """Weights of the linear layers of one block (what autocast copies and TP splits).

    Attention: q ``h*a*d_h``, k and v ``h*k*d_h`` each, output ``a*d_h*h``.
    MLP: ``2*h*f`` for gelu/relu (up, down), ``3*h*f`` for swiglu (gate, up, down).
    """
    h, dh, a, k, f = model.hidden, model.dim_head, model.n_heads, model.kv_heads, model.ffn
    attn = h * a * dh + 2 * h * k * dh + a * dh * h
    mlp = (3 if model.ffn_kind == "swiglu" else 2) * h * f
    return attn + mlp


def layer_bias_count(model: ModelSpec) -> int:
    """Biases of one block.

    ``bias=True`` (GPT-2, GPT-NeoX): every linear, q ``a*d_h``, k and v ``k*d_h`` each, output ``h``,
    MLP ``f + h`` (swiglu: ``2f + h``). ``qkv_bias=True`` alone (Qwen2: ``q_proj``/``k_proj``/``v_proj``
    carry biases, ``o_proj`` and the MLP do not; transformers ``models/qwen2/modeling_qwen2.py``
    ``Qwen2Attention``): ``a*d_h + 2*k*d_h``.
    """
    h, dh, a, k, f = model.hidden, model.dim_head, model.n_heads, model.kv_heads, model.ffn
    qkv = a * dh + 2 * k * dh
    if not model.bias:
        return qkv if model.qkv_bias else 0
    mlp_bias = (2 * f if model.ffn_kind == "swiglu" else f) + h
    return qkv + h + mlp_bias


def layer_param_count(model: ModelSpec) -> int:
    """Parameters of one transformer block: matmul weights + biases + two norms + ``extra_layer_params``
    (more norms per block, e.g. Gemma-2's four, or q/k norms: what the config reader counts)."""
    return (
        layer_matmul_param_count(model) + layer_bias_count(model) + 2 * norm_param_count(model)
        + model.extra_layer_params
    )


def embedding_param_count(model: ModelSpec) -> int:
    """Token embedding ``V*h`` plus a learned position table ``P*h`` (stage 0 holds them)."""
    pos = (model.max_positions or 0) * model.hidden if model.position_embedding == "learned" else 0
    return model.vocab_size * model.hidden + pos


def head_param_count(model: ModelSpec) -> int:
    """Final norm plus an untied lm_head ``V*h`` (tied: the head reuses the embedding)."""
    head = 0 if model.tied_embeddings else model.vocab_size * model.hidden
    return norm_param_count(model) + head


def param_count(model: ModelSpec) -> int:
    """N = embeddings + L * block + final norm + untied head."""
    return embedding_param_count(model) + model.n_layers * layer_param_count(model) + head_param_count(model)
