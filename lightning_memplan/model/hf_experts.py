"""Expert, latent-attention and per-family fields of a Hugging Face config (the MoE part of
:func:`~lightning_memplan.model.readers.hf_config_fields`).

The families below are read field by field from their ``config.json`` names, with the layer layout and
parameter shapes of transformers 5.3 (files named per family); any other config naming experts keeps
the reader's "mixture-of-experts" gap (the traced estimate, or a refusal). No transformers import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["MOE_FAMILIES", "TEXT_DEFAULTS", "first_value", "hf_expert_fields"]

#: ``model_type`` -> what its MoE blocks look like (transformers 5.3 ``models/<family>/modeling_*.py``).
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "llama4_text", "llama4", "gpt_oss")

#: Fields a published config leaves to its class's defaults (transformers 5.3
#: ``models/gemma3/configuration_gemma3.py`` ``Gemma3TextConfig``: ``vocab_size=262_208``; Gemma-3's
#: published ``config.json`` files omit it from ``text_config``).
TEXT_DEFAULTS: dict[str, dict[str, Any]] = {"gemma3_text": {"vocab_size": 262_208}}

Whole = Callable[[tuple[str, ...], Any], int]


def hf_expert_fields(cfg: Mapping[str, Any], model_type: str, whole: Whole, n_layers: int) -> dict[str, Any]:
    """``ModelSpec`` keyword arguments for the experts and MLA of ``cfg`` (empty for a dense family).

    - Mixtral (``modeling_mixtral.py``): ``num_local_experts`` experts of width ``intermediate_size``,
      top ``num_experts_per_tok``, every block.
    - Qwen2-MoE / Qwen3-MoE (``modeling_qwen2_moe.py``, ``modeling_qwen3_moe.py``, ``Qwen2MoeDecoderLayer``:
      MoE when ``layer_idx not in mlp_only_layers and (layer_idx + 1) % decoder_sparse_step == 0``):
      ``num_experts`` of ``moe_intermediate_size``; Qwen2-MoE adds one shared expert of
      ``shared_expert_intermediate_size`` with its ``[1, h]`` sigmoid gate; dense blocks ``intermediate_size``.
    - DeepSeek-V3 (``modeling_deepseek_v3.py``: MoE when ``layer_idx >= first_k_dense_replace``):
      ``n_routed_experts`` of ``moe_intermediate_size``, ``n_shared_experts`` of the same width (one
      ``DeepseekV3MLP`` of ``n_shared_experts * moe_intermediate_size``: the same parameters), dense
      blocks ``intermediate_size``; MLA ranks and head widths.
    - Llama-4 (``configuration_llama4.py``: ``moe_layers``, else every ``interleave_moe_layer_step``-th
      block; ``modeling_llama4.py`` ``Llama4TextMoe``): ``num_local_experts`` of ``intermediate_size``
      and one shared expert of ``intermediate_size``; dense blocks ``intermediate_size_mlp``.
    - GPT-OSS (``modeling_gpt_oss.py``): ``num_local_experts`` of ``intermediate_size``, top
      ``num_experts_per_tok`` (``experts_per_token`` in OpenAI's own config); biases everywhere
      (``attention_bias``) and one attention sink per head.
    """
    if model_type not in MOE_FAMILIES:
        return {}
    out: dict[str, Any] = {}
    experts = first_value(cfg, ("num_local_experts", "num_experts", "n_routed_experts"))
    if not experts:
        return _mla_fields(cfg, whole) if model_type == "deepseek_v3" else {}
    out["n_experts"] = whole(("num_local_experts", "num_experts", "n_routed_experts"), experts)
    out["experts_per_token"] = whole(("num_experts_per_tok", "experts_per_token"),
                                     first_value(cfg, ("num_experts_per_tok", "experts_per_token")) or 1)
    moe_width = first_value(cfg, ("moe_intermediate_size",))
    if moe_width:
        out["expert_ffn_hidden"] = whole(("moe_intermediate_size",), moe_width)
    if model_type == "qwen2_moe" and cfg.get("shared_expert_intermediate_size"):
        out.update(n_shared_experts=1, shared_expert_gate=True,
                   shared_expert_ffn_hidden=whole(("shared_expert_intermediate_size",),
                                                  cfg["shared_expert_intermediate_size"]))
    if model_type in ("qwen2_moe", "qwen3_moe"):
        out["moe_layer_step"] = whole(("decoder_sparse_step",), cfg.get("decoder_sparse_step") or 1)
        out["dense_layers"] = tuple(cfg.get("mlp_only_layers") or ())
    if model_type == "deepseek_v3":
        out["n_shared_experts"] = whole(("n_shared_experts",), cfg.get("n_shared_experts") or 0) if cfg.get(
            "n_shared_experts") else 0
        out["first_dense_layers"] = min(whole(("first_k_dense_replace",), cfg.get("first_k_dense_replace") or 0)
                                        if cfg.get("first_k_dense_replace") else 0, n_layers)
        out.update(_mla_fields(cfg, whole))
    if model_type in ("llama4_text", "llama4"):
        out["expert_ffn_hidden"] = whole(("intermediate_size",), cfg.get("intermediate_size"))
        out["n_shared_experts"] = 1
        if cfg.get("intermediate_size_mlp"):
            out["ffn_hidden"] = whole(("intermediate_size_mlp",), cfg["intermediate_size_mlp"])
        if cfg.get("moe_layers") is not None:
            moe = set(cfg["moe_layers"])
            out["dense_layers"] = tuple(i for i in range(n_layers) if i not in moe)
        else:
            out["moe_layer_step"] = whole(("interleave_moe_layer_step",), cfg.get("interleave_moe_layer_step") or 1)
    return out


def _mla_fields(cfg: Mapping[str, Any], whole: Whole) -> dict[str, Any]:
    """DeepSeek-V3's multi-head latent attention: ranks and head widths (``modeling_deepseek_v3.py``
    ``DeepseekV3Attention``); ``head_dim`` is the query/key head width ``d_nope + d_rope``."""
    if not cfg.get("kv_lora_rank"):
        return {}
    out: dict[str, Any] = {name: whole((name,), cfg[name]) for name in
                           ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    if cfg.get("q_lora_rank"):
        out["q_lora_rank"] = whole(("q_lora_rank",), cfg["q_lora_rank"])
    out["head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    return out


def first_value(cfg: Mapping[str, Any], names: tuple[str, ...]) -> Any:
    """The value of the first of ``names`` that ``cfg`` holds and is not ``None`` (a config's alternative
    field names: ``("num_hidden_layers", "n_layer", ...)``); ``None`` when none is set."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return None
