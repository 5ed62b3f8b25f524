"""Read a :class:`~lightning_memplan.model.specs.ModelSpec`'s fields from a live module or a Hugging Face config.

The readers return field dicts (``ModelSpec(**fields)``), not specs, so that ``specs.py`` can call them
from ``ModelSpec.from_hf_config``/``from_module`` without this module importing ``specs`` (the public
``spec_from_*`` functions are in ``model/introspect.py``). No ``transformers`` import: a Hugging Face config is read by its field names (a ``PretrainedConfig``
through ``to_dict()``, or the ``config.json`` dict), and module trees are recognised by attribute names
and weight shapes:

- this project's zoo ``GPT`` (``tok_emb``, ``blocks[i].attn.q_proj`` ...),
- Llama / Mistral / Qwen2 / Gemma trees (``embed_tokens``, ``layers[i].self_attn.q_proj``,
  ``mlp.gate_proj``), GPT-2 (``wte``, ``wpe``, ``h[i].attn.c_attn`` Conv1D), GPT-NeoX
  (``embed_in``, ``layers[i].attention.query_key_value``).

A module that carries a Hugging Face ``config`` attribute is read from that config (with the exact
parameter count of the module). Anything else gets a :class:`ModelSpec` with the exact ``n_params`` and
a best-effort shape whose guesses are listed in its ``name``; use :func:`~lightning_memplan.tracking.trace.trace_memory`
for the activation side of such models.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_memplan.model.hf_build import canonical_config_json, non_uniform_reason
from lightning_memplan.model.hf_experts import MOE_FAMILIES, TEXT_DEFAULTS, first_value, hf_expert_fields
from lightning_memplan.model.litgpt_spec import litgpt_fields
from lightning_memplan.validation import check_bool, check_int, check_number

__all__ = ["ConfigReading", "ModuleReading", "hf_config_fields", "module_fields", "norm_impl_of", "recompute_of"]

_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
_HIDDEN = ("hidden_size", "n_embd", "d_model")
_HEADS = ("num_attention_heads", "n_head", "num_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
_FFN = ("intermediate_size", "n_inner", "ffn_dim", "d_ff")
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx")
# Families whose MLP has three matrices (gate, up, down): SwiGLU (Llama, Mistral, Qwen2) and
# GeGLU (Gemma) have the same shapes and memory, so both map to ffn_kind="swiglu".
_GATED = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo", "olmo2",
          "qwen2_moe", "qwen3_moe", "deepseek_v3", "llama4_text", "llama4", "gpt_oss")
_LAYERNORM = ("gpt2", "gpt_neox", "gptj", "opt", "phi", "bloom", "falcon", "gpt_bigcode", "starcoder2")
_LEARNED_POS = ("gpt2", "opt", "gpt_bigcode")
_TIED_BY_DEFAULT = ("gpt2", "gemma", "gemma2", "gemma3_text", "opt", "gpt_bigcode", "bloom")


# Bounds on a config.json's sizes, checked before anything is built from them (a ValueError naming the
# field; the CLI adds the file path). Each is over ten times the largest published value (Llama 3 405B:
# hidden 16,384, ffn 53,248, 126 layers, 128 heads; Gemma 3: vocab 262,144; Llama 4 Scout: 10M positions).
CONFIG_MAX_SIZE = 2**20  # hidden, ffn, head_dim
CONFIG_MAX_HEADS = 2**16
CONFIG_MAX_LAYERS = 2**16
CONFIG_MAX_VOCAB = 2**24
CONFIG_MAX_POSITIONS = 2**31 - 1  # int32 position ids


def _as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if callable(getattr(config, "to_dict", None)):
        return dict(config.to_dict())
    if hasattr(config, "__dict__"):
        return {k: v for k, v in vars(config).items() if not k.startswith("_")}
    raise TypeError(
        f"config={config!r} must be a Hugging Face PretrainedConfig, a config.json dict or an object with "
        "attributes such as num_hidden_layers, hidden_size, num_attention_heads, vocab_size"
    )


_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _analytic_gap(cfg: Mapping[str, Any], vision: bool) -> str | None:
    """Why the hand-written decoder terms cannot describe this architecture (``None``: they can).

    Mixture-of-experts of a family :mod:`~lightning_memplan.model.hf_experts` does not read (expert
    parameters and routed activations; Mixtral, Qwen2/3-MoE, DeepSeek-V3, Llama-4 and GPT-OSS are read),
    encoder-decoder (T5's decoder and
    cross-attention) and vision (patches, no vocabulary) configs would come out silently wrong from the
    analytic terms, so ``ModelSpec.from_hf_config`` raises for them unless a coefficient source traces
    the real class.
    """
    experts = first_value(cfg, _EXPERT_KEYS)
    known = str(cfg.get("model_type") or "").lower() in MOE_FAMILIES  # read by model/hf_experts.py
    if isinstance(experts, int) and experts > 1 and not known:
        return f"a mixture-of-experts model ({experts} experts)"
    if cfg.get("is_encoder_decoder"):
        return "an encoder-decoder model"
    if vision:
        return "a vision model (image patches, no vocabulary)"
    if _is_state_space(cfg):
        return "a state-space (Mamba) model: its mixer layers have no attention terms"
    return None


#: Model types whose blocks are (or include) selective state-space mixers (transformers' configuration_mamba,
#: configuration_mamba2, configuration_falcon_mamba, configuration_jamba, configuration_bamba,
#: configuration_zamba/zamba2, configuration_falcon_h1, configuration_nemotron_h).
_STATE_SPACE_TYPES = frozenset(
    {"mamba", "mamba2", "falcon_mamba", "jamba", "bamba", "zamba", "zamba2", "falcon_h1", "nemotron_h"}
)


def _is_state_space(cfg: Mapping[str, Any]) -> bool:
    """A Mamba-style config: a known state-space family, or the SSM state width Mamba configs carry."""
    if str(cfg.get("model_type") or "").lower() in _STATE_SPACE_TYPES:
        return True
    return any(cfg.get(key) is not None for key in ("state_size", "mamba_d_state", "ssm_state_size"))


@dataclass(frozen=True, kw_only=True)
class ConfigReading:
    """What :func:`hf_config_fields` read from a Hugging Face config.

    Attributes:
        fields: ``ModelSpec`` keyword arguments (``hf_config`` included: the canonical config JSON).
        model_type: the config's ``model_type`` (lower case; ``""`` when absent).
        analytic_gap: why the analytic terms cannot model it (mixture-of-experts, encoder-decoder,
            vision), or ``None``; such a spec needs a traced coefficient source.
        mixed_stack: why a depth-1/depth-2 trace cannot be scaled to this config's depth (its blocks
            differ, e.g. DeepSeek-V3's first dense blocks), or ``None``
            (:func:`~lightning_memplan.model.hf_build.non_uniform_reason`).
    """

    fields: dict[str, Any]
    model_type: str
    analytic_gap: str | None
    mixed_stack: str | None = None


# Families whose q/k/v projections carry biases but o_proj and the MLP do not (transformers
# models/qwen2/modeling_qwen2.py Qwen2Attention: q_proj/k_proj/v_proj bias=True, o_proj bias=False).
_QKV_BIAS = ("qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl")
# Four norms per block (input, post-attention, pre- and post-feedforward) instead of two
# (modeling_gemma2.py / modeling_gemma3.py Gemma2DecoderLayer).
_FOUR_NORMS = ("gemma2", "gemma3_text", "gemma3")
# RMSNorm over each head's d_h on q and on k (modeling_qwen3.py / modeling_gemma3.py q_norm, k_norm).
_HEAD_QK_NORM = ("qwen3", "qwen3_moe", "gemma3_text", "gemma3")
# RMSNorm over all of q (a*d_h) and all of k (k*d_h) (modeling_olmo2.py Olmo2Attention q_norm, k_norm).
_FULL_QK_NORM = ("olmo2",)


def _extra_layer_params(model_type: str, hidden: int, n_heads: int, kv_heads: int, head_dim: int) -> int:
    """Per-block parameters beyond the linears and two norms: extra norms and q/k norms (RMSNorm weights),
    and GPT-OSS's attention sinks, one learned logit per head (``modeling_gpt_oss.py``
    ``GptOssAttention.sinks``). Llama-4's q/k norms are L2 norms without weights (``Llama4TextL2Norm``)."""
    extra = 2 * hidden if model_type in _FOUR_NORMS else 0
    if model_type == "gpt_oss":
        extra += n_heads
    if model_type in _HEAD_QK_NORM:
        extra += 2 * head_dim
    elif model_type in _FULL_QK_NORM:
        extra += (n_heads + kv_heads) * head_dim
    return extra


def hf_config_fields(config: Any) -> ConfigReading:
    """``ModelSpec`` fields from a Hugging Face config (Llama, Mistral, Qwen2, Gemma, GPT-2, GPT-NeoX, ...).

    Field names read: layers ``num_hidden_layers``/``n_layer``; width ``hidden_size``/``n_embd``; heads
    ``num_attention_heads``/``n_head``; ``vocab_size``; kv-heads ``num_key_value_heads`` (absent: MHA);
    ``head_dim``; ffn ``intermediate_size``/``n_inner`` (absent: 4h); positions
    ``max_position_embeddings``/``n_positions``; ``tie_word_embeddings``; ``model_type`` decides gated
    MLP (Llama-like) vs GELU, RMSNorm vs LayerNorm, RoPE vs learned positions.

    Raises:
        TypeError: ``config`` is not a mapping or config object.
        ValueError: a required field is missing, naming the field names looked for.
    """
    cfg = _as_dict(config)
    top_level = dict(cfg)
    cfg, vision = _text_config(cfg)
    values = _required(cfg)
    model_type = str(cfg.get("model_type") or "").lower()
    gated = model_type in _GATED or (
        model_type not in _LAYERNORM and str(cfg.get("hidden_act", "")).lower() in ("silu", "swiglu")
    )
    rms = model_type in _GATED or ("rms_norm_eps" in cfg and model_type not in _LAYERNORM)
    kv = first_value(cfg, _KV_HEADS)
    if cfg.get("multi_query") and not cfg.get("new_decoder_architecture"):
        kv = 1  # Falcon-7B style multi-query attention: one k/v head whatever num_kv_heads says
    tied = cfg.get("tie_word_embeddings")
    if tied is None:
        tied = model_type in _TIED_BY_DEFAULT
    positions = first_value(cfg, _POSITIONS)
    dropout = _dropout(cfg)
    whole = functools.partial(_whole, cfg)
    bias = model_type in ("gpt2", "gpt_neox", "opt", "bloom", "gpt_bigcode") or bool(
        cfg.get("attention_bias") or cfg.get("mlp_bias") or cfg.get("use_bias")
    )
    hidden = whole(_HIDDEN, values["hidden"])
    n_heads = whole(_HEADS, values["n_heads"], CONFIG_MAX_HEADS)
    n_kv = whole(_KV_HEADS, kv, CONFIG_MAX_HEADS) if kv is not None else None
    head_dim = whole(("head_dim",), cfg["head_dim"]) if cfg.get("head_dim") else None
    fields = dict(
        n_layers=whole(_LAYERS, values["n_layers"], CONFIG_MAX_LAYERS),
        hidden=hidden,
        n_heads=n_heads,
        vocab_size=whole(("vocab_size",), values["vocab_size"], CONFIG_MAX_VOCAB),
        n_kv_heads=n_kv,
        head_dim=head_dim,
        ffn_hidden=whole(_FFN, first_value(cfg, _FFN)) if first_value(cfg, _FFN) else None if gated else 4 * hidden,
        ffn_kind="swiglu" if gated else "gelu",
        norm="rmsnorm" if rms else "layernorm",
        bias=bias,
        qkv_bias=model_type in _QKV_BIAS and not bias,
        extra_layer_params=_extra_layer_params(model_type, hidden, n_heads, n_kv or n_heads, head_dim or hidden // n_heads),
        tied_embeddings=check_bool("config['tie_word_embeddings']", tied),
        position_embedding="learned" if model_type in _LEARNED_POS else "rope",
        max_positions=whole(_POSITIONS, positions, CONFIG_MAX_POSITIONS) if positions else None,
        dropout=dropout,
        name=model_type or cfg.get("_name_or_path") or None,
        # the traced path builds the real class from it (tracking/hf_trace.py); not for a nested text_config
        hf_config=canonical_config_json(top_level) if first_value(top_level, _LAYERS) is not None else None,
    )
    n_layers = fields["n_layers"]
    assert isinstance(n_layers, int)  # checked by whole() above
    fields.update(hf_expert_fields(cfg, model_type, whole, n_layers))  # MoE / MLA families; {} for the others
    return ConfigReading(fields=fields, model_type=model_type, analytic_gap=_analytic_gap(cfg, vision),
                         mixed_stack=non_uniform_reason(cfg))


def _text_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """``(the decoder's fields, whether it is a vision config)``: a multimodal config's ``text_config``
    (when the top level names no layers), the class's defaults a published config may leave out
    (Gemma-3's ``text_config`` has no ``vocab_size``), and for a ViT-style config (no vocabulary) its
    classifier's labels as V."""
    if isinstance(cfg.get("text_config"), Mapping) and first_value(cfg, _LAYERS) is None:
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg.get("model_type"))}
    cfg = {**TEXT_DEFAULTS.get(str(cfg.get("model_type") or "").lower(), {}), **cfg}
    vision = cfg.get("vocab_size") is None and cfg.get("image_size") is not None and cfg.get("patch_size") is not None
    if vision:
        # ViT-style: no vocabulary; the classifier's labels stand in for V, the patches for positions
        labels = cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2
        cfg = {**cfg, "vocab_size": check_int("config['num_labels']", labels, maximum=CONFIG_MAX_VOCAB,
                                              hint="the classifier's labels (a vision config's vocabulary)")}
    return cfg, vision


def _required(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Layers, width, heads and vocabulary of ``cfg`` (raises ``ValueError`` naming what is missing)."""
    required = {"n_layers": _LAYERS, "hidden": _HIDDEN, "n_heads": _HEADS, "vocab_size": ("vocab_size",)}
    values = {key: first_value(cfg, names) for key, names in required.items()}
    if values["n_heads"] is None and _is_state_space(cfg):
        # an attention-free SSM (Mamba v1) has no heads: one stands in for the spec's shape checks; its
        # memory comes from the traced class (analytic_gap refuses the analytic terms for it)
        values["n_heads"] = 1
    missing = [f"{key} (one of {', '.join(names)})" for key, names in required.items() if values[key] is None]
    if missing:
        raise ValueError(
            f"config is missing {'; '.join(missing)}; got keys {sorted(cfg)[:20]}; pass a decoder config "
            "such as Llama's config.json or build ModelSpec(n_layers, hidden, n_heads, vocab_size) directly"
        )
    return values


def _dropout(cfg: Mapping[str, Any]) -> float:
    """The largest dropout probability the config names (attention, residual, embedding, hidden)."""
    return max(
        check_number(f"config[{name!r}]", cfg.get(name) or 0.0, minimum=0.0, maximum=1.0, max_inclusive=False,
                     hint="a dropout probability in [0, 1)")
        for name in ("attention_dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop", "hidden_dropout")
    )


def _whole(cfg: Mapping[str, Any], names: tuple[str, ...], value: Any, maximum: int = CONFIG_MAX_SIZE) -> int:
    """``value`` (read from the first of ``names`` ``cfg`` sets) as a whole number of at most ``maximum``."""
    key = next((n for n in names if cfg.get(n) is not None), names[0])
    return check_int(f"config[{key!r}]", value, maximum=maximum,
                     hint=f"a whole number in the Hugging Face config, at most {maximum} (far beyond any published "
                     "model; the traced estimate builds the model's tensors from these sizes)")


# ---------------------------------------------------------------------------------------- modules
def _trained_parameters(module: Any) -> list[Any]:
    """``module.parameters()`` without those of an ``AveragedModel`` inside it (a weight-averaging copy is
    not trained: the ``averaged`` component, ``MemoryEstimate.averaged``)."""
    from torch.optim.swa_utils import AveragedModel

    copies = {id(p) for m in module.modules() if isinstance(m, AveragedModel) and m is not module for p in m.parameters()}
    return [p for p in module.parameters() if id(p) not in copies] if copies else list(module.parameters())


def _count_params(module: Any) -> int:
    return sum(_logical_numel(p) for p in _trained_parameters(module))


def _logical_numel(param: Any) -> int:
    """Values a parameter stands for: a bitsandbytes ``Params4bit`` stores two 4-bit values per uint8
    element (``[(n + 1) // 2, 1]``), its ``quant_state.shape`` is the weight's (bitsandbytes 0.50.2
    ``functional.py`` ``quantize_4bit``); every other parameter is its ``numel()``."""
    shape = getattr(getattr(param, "quant_state", None), "shape", None)
    return math.prod(shape) if shape is not None else int(param.numel())


def _frozen_layout(module: Any) -> dict[str, Any]:
    """``frozen_layers``/``frozen_embedding``/``frozen_head`` of a module with frozen parts
    (:func:`~lightning_memplan.model.frozen.frozen_fields`), from its blocks, embeddings and head as the
    transformer reader finds them."""
    import torch.nn as nn

    from lightning_memplan.model.frozen import frozen_fields

    blocks = _blocks(module)
    in_blocks = {id(m) for m in blocks.modules()} if blocks is not None else set()
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding) and id(m) not in in_blocks]
    return frozen_fields(module, blocks, embeddings, _find(module, ("lm_head", "embed_out", "output", "head")))


def _out_features(layer: Any) -> int | None:
    import torch.nn as nn

    layer = getattr(layer, "_fsdp_wrapped_module", layer)  # a Linear wrapped as its own FSDP1 unit
    if isinstance(layer, nn.Linear):
        return layer.out_features
    weight = getattr(layer, "weight", None)
    if type(layer).__name__ == "Conv1D" and weight is not None:  # HF GPT-2 Conv1D: weight [in, out]
        return int(weight.shape[1])
    return None


def _find(module: Any, names: tuple[str, ...]) -> Any:
    for name, sub in module.named_modules():
        if name.rsplit(".", 1)[-1] in names:
            return sub
    return None


def _attr(obj: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    cfg = getattr(obj, "config", None)
    if cfg is not None and not callable(cfg):
        return _attr(cfg, names) if cfg is not obj else None
    return None


def _blocks(module: Any) -> Any:
    import torch.nn as nn

    best = None
    for sub in module.modules():
        if isinstance(sub, nn.ModuleList) and len(sub) and len({type(m) for m in sub}) == 1:
            if any(isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D" for m in sub[0].modules()):
                if best is None or len(sub) > len(best):
                    best = sub
    return best


def _hf_config(module: Any) -> Any:
    for sub in module.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and (callable(getattr(cfg, "to_dict", None)) or isinstance(cfg, Mapping)):
            d = _as_dict(cfg)
            if first_value(d, _LAYERS) is not None and first_value(d, _HEADS) is not None:
                return cfg
    return None


#: Names of token tables (GPT-2 ``wte``, Llama ``embed_tokens``, Meta's ``tok_embeddings``, BERT
#: ``word_embeddings``); a learned position table (``wpe``, ``position_embeddings``) may be larger than the
#: vocabulary, so the largest table is not the token table.
_TOKEN_TABLE_NAMES = ("wte", "embed_tokens", "tok_embeddings", "word_embeddings", "token_embedding", "tok_emb",
                      "embedding", "embed")
_POSITION_TABLE_HINTS = ("wpe", "pos", "position")


def _token_embedding(named: list[tuple[str, Any]], head: Any) -> Any:
    """The token table among a model's ``nn.Embedding``s: the one the output head shares its weight with,
    else the one as wide as the head's output (the vocabulary), else the one named as a token table, else
    the largest that is not named as a position table, else the largest."""
    weight = getattr(head, "weight", None)
    for _, m in named:
        if weight is not None and m.weight is weight:
            return m
    out = _out_features(head) if head is not None else None
    by_size = sorted(named, key=lambda nm: -nm[1].num_embeddings)
    if out is not None:
        matching = [m for _, m in by_size if m.num_embeddings == out]
        if matching:
            return matching[0]
    for _, m in ((n, m) for n, m in by_size if n.rsplit(".", 1)[-1].lower() in _TOKEN_TABLE_NAMES):
        return m
    for name, m in by_size:
        if not any(hint in name.rsplit(".", 1)[-1].lower() for hint in _POSITION_TABLE_HINTS):
            return m
    return by_size[0][1]


def _transformer_fields(module: Any) -> dict[str, Any] | None:
    import torch.nn as nn

    named = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Embedding)]
    blocks = _blocks(module)
    if not named or blocks is None:
        return None
    head = _find(module, ("lm_head", "embed_out", "output", "head"))
    tok = _token_embedding(named, head)
    embeddings = [tok, *(m for _, m in sorted(named, key=lambda nm: -nm[1].num_embeddings) if m is not tok)]
    vocab, hidden = tok.num_embeddings, tok.embedding_dim
    block = blocks[0]
    q, k = _find(block, ("q_proj", "query", "wq")), _find(block, ("k_proj", "key", "wk"))
    fused = _find(block, ("qkv_proj", "query_key_value", "c_attn", "qkv", "Wqkv"))
    attn = _find(block, ("attn", "self_attn", "attention", "self_attention"))
    if (q is None or k is None) and fused is None:
        return None
    n_heads = _attr(attn, ("n_heads", "num_heads", "num_attention_heads", "n_head")) if attn is not None else None
    head_dim = _attr(attn, ("head_dim", "head_size")) if attn is not None else None
    q_out = _out_features(q) if q is not None else None
    k_out = _out_features(k) if k is not None else None
    if q_out is None and fused is not None:
        q_out = hidden  # fused MHA projection: out = 3h
    if q_out is None:
        return None
    guesses: list[str] = []
    if head_dim is None:
        if n_heads:
            head_dim = q_out // n_heads
        else:
            head_dim = 64 if q_out % 64 == 0 else q_out
            guesses.append(f"head_dim={head_dim}")
    n_heads = n_heads or max(1, q_out // head_dim)
    kv = (k_out // head_dim) if k_out else None
    gate, up = _find(block, ("gate_proj", "w1", "gate")), _find(block, ("up_proj", "w3", "fc_in", "c_fc", "fc1",
                                                                        "dense_h_to_4h"))
    ffn = _out_features(up) if up is not None else None
    norms = [type(m).__name__ for m in block.modules() if "norm" in type(m).__name__.lower()]
    rms = any("rms" in n.lower() for n in norms)
    tied = head is not None and getattr(head, "weight", None) is tok.weight
    pos = next((e for e in embeddings[1:] if e.embedding_dim == hidden and e.num_embeddings != vocab), None)
    rope = any(("rotary" in n.lower() or "rope" in n.lower()) for n, _ in module.named_modules()) or any(
        ("rope" in n.lower() or "rotary" in n.lower() or "inv_freq" in n) for n, _ in module.named_buffers()
    )
    linear_bias = (q if q is not None else fused).bias is not None
    dropout = max((m.p for m in module.modules() if isinstance(m, nn.Dropout)), default=0.0)
    if not rms and not norms:
        guesses.append("norm=layernorm")
    return dict(
        n_layers=len(blocks),
        hidden=hidden,
        n_heads=n_heads,
        vocab_size=vocab,
        n_kv_heads=kv if kv and kv != n_heads else None,
        head_dim=head_dim if head_dim * n_heads != hidden else None,
        ffn_hidden=ffn,
        ffn_kind="swiglu" if gate is not None else "gelu",
        norm="rmsnorm" if rms else "layernorm",
        bias=linear_bias,
        tied_embeddings=tied,
        position_embedding="learned" if pos is not None else ("rope" if rope else "none"),
        max_positions=pos.num_embeddings if pos is not None else None,
        dropout=float(dropout),
        n_params=_count_params(module),
        name=type(module).__name__ + (f" (guessed {', '.join(guesses)})" if guesses else ""),
    )


def _generic_fields(module: Any) -> dict[str, Any]:
    import torch.nn as nn

    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    widths = Counter(m.in_features for m in linears)
    hidden = widths.most_common(1)[0][0] if widths else 1
    blocks = _blocks(module)
    vocab = max((e.num_embeddings for e in embeddings), default=linears[-1].out_features if linears else 1)
    n_params = _count_params(module)
    return dict(
        n_layers=len(blocks) if blocks is not None else 1,
        hidden=hidden,
        n_heads=1,
        vocab_size=vocab,
        n_params=max(n_params, 1),
        position_embedding="none",
        name=f"{type(module).__name__} (not a transformer: exact n_params={n_params}; guessed "
        f"n_layers, hidden={hidden} (most common Linear width), n_heads=1, vocab_size={vocab}; "
        "use trace_memory for its activations)",
    )


@dataclass(frozen=True, kw_only=True)
class ModuleReading:
    """What :func:`module_fields` read from a live module.

    Attributes:
        config: the Hugging Face config the module carries (``None``: none); then ``fields`` are the
            overrides on the spec read from it (exact ``n_params``, frozen parameters).
        fields: ``ModelSpec`` keyword arguments (with ``config``: overrides only).
        config_describes_run: with ``config``, whether the config describes what runs: the bare
            transformers model (no adapters, nothing frozen, no checkpointing, the class the config
            names). Only then may a traced estimate build the model from the config.
    """

    config: Any
    fields: dict[str, Any]
    config_describes_run: bool = False


def module_fields(module: Any) -> ModuleReading:
    """``ModelSpec`` fields for a live ``nn.Module`` (a LightningModule's submodules are searched too).

    Parameters with ``requires_grad=False`` (peft LoRA's base weights, frozen embeddings) are left out
    of ``n_trainable_params``: they get no gradients or optimizer states.

    Order: a Hugging Face ``config`` attribute (read by :func:`hf_config_fields`, ``n_params`` exact);
    a litgpt ``GPT`` (its ``Config``); a recognised transformer tree (embedding, repeated blocks with
    q/k/v projections, MLP, norms, head); otherwise a best-effort shape with the exact parameter count
    (its ``name`` lists what was guessed).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: it has no parameters.
    """
    import torch.nn as nn

    if not isinstance(module, nn.Module):
        raise TypeError(f"module={type(module).__name__!r} must be a torch.nn.Module (or a LightningModule)")
    n_params = _count_params(module)
    cfg = _hf_config(module)
    trainable = sum(p.numel() for p in _trained_parameters(module) if p.requires_grad)
    frozen: dict[str, Any] = {"n_trainable_params": trainable} if trainable < n_params else {}
    if frozen:  # which parts are frozen: the saved activations and gradients follow (model/frozen.py)
        frozen.update(_frozen_layout(module))
    if cfg is not None:
        # The config describes what runs only for the bare transformers model (no adapters, nothing
        # frozen, no checkpointing, the class the config names): then the traced path may build it from
        # the config (it checks the parameter count again). Otherwise the live module is what runs.
        bare = not frozen and recompute_of(module) == "none" and _is_config_class(module, cfg)
        layers = first_value(_as_dict(cfg), _LAYERS)
        overrides = _with_frozen({"n_params": max(n_params, 1), "n_layers": layers if isinstance(layers, int) else 0},
                                 frozen)
        del overrides["n_layers"]  # the config's own count, read again by from_hf_config
        return ModuleReading(config=cfg, fields=overrides, config_describes_run=bare)
    litgpt = litgpt_fields(module)  # litgpt keeps its architecture in a dataclass Config
    if litgpt is not None:
        return ModuleReading(config=None, fields=_with_frozen({**litgpt, "n_params": max(n_params, 1)}, frozen))
    fields = _transformer_fields(module)
    if fields is not None:
        return ModuleReading(config=None, fields=_with_frozen(fields, frozen))
    if n_params == 0:
        raise ValueError(
            f"module={type(module).__name__!r} has no parameters, so there is no memory to plan; pass the module "
            "that is trained (built, e.g. after configure_model), or ModelSpec(..., n_params=N) directly"
        )
    return ModuleReading(config=None, fields=_with_frozen(_generic_fields(module), frozen))


def _with_frozen(fields: dict[str, Any], frozen: dict[str, Any]) -> dict[str, Any]:
    """``fields`` plus the frozen parts; the frozen layout only when its blocks are the spec's (a block list
    found elsewhere than the one ``n_layers`` counts is not described by it)."""
    if frozen.get("frozen_layers", 0) > fields.get("n_layers", 0):
        frozen = {k: v for k, v in frozen.items() if k not in ("frozen_layers", "frozen_embedding", "frozen_head")}
    return {**fields, **frozen}


def _is_config_class(module: Any, cfg: Any) -> bool:
    """Whether ``module`` itself is the transformers class the traced path would build from ``cfg``
    (:func:`~lightning_memplan.model.hf_build.model_class`). A LightningModule wrapping it is not: its
    ``training_step`` may do more than the model's own loss."""
    for m in (module,):
        if getattr(m, "config", None) is cfg and type(m).__module__.startswith("transformers."):
            from lightning_memplan.model.hf_build import model_class

            try:
                return model_class(cfg) is type(m)
            except ValueError:
                return False
    return False


def recompute_of(module: Any) -> str:
    """``"full"`` when activation checkpointing is applied to ``module``'s blocks the ways users apply it,
    else ``"none"`` (the ``TrainSpec.recompute`` value that describes the run).

    Recognised: Hugging Face ``model.gradient_checkpointing_enable()`` (``is_gradient_checkpointing`` on
    the model, ``gradient_checkpointing=True`` on its layer stack), ``checkpoint_wrapper`` from
    ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` (a ``CheckpointWrapper`` module) and
    the composable ``torch.distributed._composable.checkpoint(block)``. A ``torch.utils.checkpoint`` call
    written inside a ``forward`` is not visible from the module tree: the calibration trace sees it (blocks
    run again in the backward, ``lightning_memplan.tracking.recompute``) and the session then sets
    ``recompute="full"`` when every block is checkpointed, or notes a partial recompute; without a trace
    the code is scanned for the call (a note, the estimate assumes no recompute).
    """
    import torch.nn as nn

    if not isinstance(module, nn.Module):
        return "none"
    for sub in module.modules():
        if getattr(sub, "is_gradient_checkpointing", False) is True or getattr(sub, "gradient_checkpointing", False) is True:
            return "full"
        if type(sub).__name__ == "CheckpointWrapper":
            return "full"
        state = getattr(sub, "_forward_pre_hooks", {})
        if any("checkpoint" in getattr(hook, "__qualname__", "") for hook in state.values()):
            return "full"
    return "none"


def _probe_rmsnorm(norm: Any) -> str | None:
    """The ``TrainSpec.norm_impl`` one RMSNorm module behaves as, from what autograd saves when its
    ``forward`` runs once on a ``[1, 2, h]`` bf16 probe on the meta device (a shallow copy of the module
    with meta parameters of the same shapes and dtypes: nothing allocated, no device touched, the
    module's own parameters, which may be sharded DTensors or on a GPU, and its hooks left alone): an
    fp32 and a bf16 ``[1, 2, h]`` tensor saved means ``"composite"`` (the normalised tensor cast back to
    the input dtype before the weight), fp32 ones only ``"composite_fp32"``, bf16 ones only ``"native"``
    (a kernel that saves its input). ``None`` when the module has no ``[h]`` weight or cannot run."""
    import copy

    import torch

    weight = next((p for p in norm.parameters(recurse=False) if p.dim() == 1), None)
    if weight is None:
        return None
    h = weight.shape[0]
    clone = copy.copy(norm)
    clone._parameters = {
        name: None if p is None else torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"))
        for name, p in norm._parameters.items()
    }
    clone._buffers = {
        name: None if b is None else torch.empty(b.shape, dtype=b.dtype, device="meta")
        for name, b in norm._buffers.items()
    }
    dtypes: set[torch.dtype] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.numel() == 2 * h:
            dtypes.add(t.dtype)
        return t

    probe = torch.empty(1, 2, h, dtype=torch.bfloat16, device="meta", requires_grad=True)
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            type(norm).forward(clone, probe)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return None
    if torch.float32 in dtypes:
        return "composite" if torch.bfloat16 in dtypes else "composite_fp32"
    return "native" if dtypes else None


def norm_impl_of(module: Any) -> str:
    """The ``TrainSpec.norm_impl`` that describes ``module``'s RMSNorms (``"native"`` when it has none).

    ``torch.nn.RMSNorm`` is ``"native"`` by class. Any other module whose class name ends in
    ``RMSNorm`` (transformers' ~120 ``*RMSNorm`` classes, torchtune's and litgpt's ``RMSNorm``) is
    classified by behaviour, one probe per class (:func:`_probe_rmsnorm`): Hugging Face's
    ``LlamaRMSNorm`` and its copies (Mistral, Qwen2/3, Phi-3 ...) and torchtune's are ``"composite"``;
    Gemma's, OLMo-2's and litgpt's, which multiply by the weight in fp32, are ``"composite_fp32"``.
    With several kinds the most common wins. Known limit: a Python class that calls ``F.rms_norm`` runs
    the probe through ATen's composite ``rms_norm`` (what CPU and the meta device run), so it reads as
    ``"composite_fp32"``, although CUDA would run the fused kernel; pass ``TrainSpec(norm_impl="native")``
    for it.
    """
    import torch.nn as nn

    if not isinstance(module, nn.Module):
        return "native"
    by_class: dict[type, str | None] = {}
    found: Counter[str] = Counter()
    for sub in module.modules():
        cls = type(sub)
        if isinstance(sub, nn.RMSNorm):
            found["native"] += 1
        elif cls.__name__.endswith("RMSNorm"):
            if cls not in by_class:
                by_class[cls] = _probe_rmsnorm(sub)
            impl = by_class[cls]
            if impl is not None:
                found[impl] += 1
    return found.most_common(1)[0][0] if found else "native"
