"""The :class:`~lightning_memplan.model.specs.ModelSpec` fields of a litgpt ``GPT``, read from its ``Config``
(a field dict: ``model/readers.py`` and ``ModelSpec.from_module`` build the spec; this module imports no
spec, so ``specs`` -> ``readers`` -> ``litgpt_spec`` stays one-way).

litgpt (Lightning AI, Apache-2.0) keeps the architecture in a dataclass ``litgpt.Config`` on the model
(``GPT.config``), not in a Hugging Face config, and its block tree (``transformer.h[i].attn.qkv`` fused,
``mlp.fc_1/fc_2/proj``) does not look like the q/k/v projections the tree recogniser reads. Fields used
(``litgpt/config.py``, 0.5.x): ``n_layer``, ``n_embd``, ``n_head``, ``n_query_groups`` (GQA's key/value
heads), ``head_size``, ``intermediate_size``, ``padded_vocab_size``, ``block_size``, ``bias``,
``norm_class_name``, ``mlp_class_name``, ``rotary_percentage``. litgpt always applies RoPE to the first
``rotary_percentage`` of each head (``CausalSelfAttention.forward``: ``apply_rope(q[..., :rope_n_elem])``),
and its attention computes q, k and v with one fused ``qkv`` linear.

``GPT.__init__`` sets ``max_seq_length = config.block_size``, which registers the RoPE tables ``cos`` and
``sin`` as (non-persistent) buffers of ``[block_size, rope_n_elem]`` (``GPT.rope_cache``); ``forward``
slices ``self.cos[:T]``, so the whole tables stay on the device whatever the batch's length (litgpt's
default ``block_size`` is 4096). They are read as ``buffer_bytes`` from the module itself.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LITGPT_MLP_KINDS", "buffer_bytes", "litgpt_config", "litgpt_fields"]

#: litgpt MLP class -> ModelSpec.ffn_kind. ``LLaMAMLP`` is SwiGLU (``silu(fc_1(x)) * fc_2(x)``, then
#: ``proj``); ``GemmaMLP`` is the same three-matrix gated MLP with GELU (memory as SwiGLU);
#: ``GptNeoxMLP`` is ``proj(gelu(fc(x)))``. Mixture-of-experts MLPs have no entry (not modelled).
LITGPT_MLP_KINDS = {"LLaMAMLP": "swiglu", "GemmaMLP": "swiglu", "GptNeoxMLP": "gelu"}
_NORMS = {"RMSNorm": "rmsnorm", "LayerNorm": "layernorm"}


def litgpt_config(module: Any) -> Any:
    """The ``litgpt.Config`` of the first litgpt model inside ``module`` (a LightningModule too), or ``None``."""
    for sub in module.modules():
        cfg = getattr(sub, "config", None)
        if type(sub).__module__.startswith("litgpt") and type(cfg).__module__.startswith("litgpt"):
            return cfg
    return None


def buffer_bytes(module: Any) -> int:
    """Bytes of every buffer of ``module`` (a buffer two submodules share counted once), at the dtype and
    global shape it has now: a buffer is never sharded by tensor parallelism or FSDP, so this is what each
    rank holds (litgpt's RoPE ``cos``/``sin`` tables; a planner reading the module before Lightning
    converts it for a ``"*-true"`` precision counts them at the construction dtype, an upper bound)."""
    return sum(int(b.numel()) * int(b.element_size()) for b in module.buffers())


def litgpt_fields(module: Any) -> dict[str, Any] | None:
    """The ``ModelSpec`` fields of the litgpt ``GPT`` inside ``module``; ``None`` when there is none or its
    MLP/norm kind has no ModelSpec form (then the generic recognisers decide)."""
    cfg = litgpt_config(module)
    if cfg is None:
        return None
    ffn_kind = LITGPT_MLP_KINDS.get(str(getattr(cfg, "mlp_class_name", "")))
    norm = _NORMS.get(str(getattr(cfg, "norm_class_name", "")))
    if ffn_kind is None or norm is None:
        return None
    rotary = float(getattr(cfg, "rotary_percentage", 1.0) or 0.0)
    return dict(
        n_layers=int(cfg.n_layer),
        hidden=int(cfg.n_embd),
        n_heads=int(cfg.n_head),
        vocab_size=int(cfg.padded_vocab_size),
        n_kv_heads=int(cfg.n_query_groups),
        head_dim=int(cfg.head_size),
        ffn_hidden=int(cfg.intermediate_size),
        ffn_kind=ffn_kind,
        norm=norm,
        bias=bool(cfg.bias),
        tied_embeddings=False,  # litgpt's lm_head is its own Linear
        position_embedding="rope" if rotary > 0 else "none",
        max_positions=int(cfg.block_size),
        qkv_fused=True,
        buffer_bytes=buffer_bytes(module),
        name=f"litgpt {getattr(cfg, 'name', '') or 'GPT'}".strip(),
    )
