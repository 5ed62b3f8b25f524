"""Mixture-of-experts and multi-head latent attention fields of a :class:`~lightning_memplan.model.specs.ModelSpec`.

One concept: which blocks of a stack are MoE blocks, what one MoE block holds, and the checks of the
fields that say so (``ModelSpec.__post_init__`` calls :func:`check_expert_fields`). The counts are in
``model/param_counts.py``, the activation terms in ``model/moe_terms.py``.

An MoE block replaces the block's MLP by a router (a ``[E, h]`` linear, the "gate"), E routed experts
of width ``f_e`` (each a SwiGLU or GELU MLP like the dense one) of which each token goes through k
(``experts_per_token``), and ``n_shared_experts`` experts of width ``f_s`` every token goes through.
Which blocks are MoE, as the Hugging Face configs say it:

- ``first_dense_layers``: the first blocks are dense (DeepSeek-V3 ``first_k_dense_replace``;
  transformers ``models/deepseek_v3/modeling_deepseek_v3.py`` ``DeepseekV3DecoderLayer``:
  ``layer_idx >= config.first_k_dense_replace``);
- ``moe_layer_step``: block i is MoE when ``(i + 1) % step == 0`` (Qwen2/3-MoE ``decoder_sparse_step``,
  ``modeling_qwen2_moe.py`` ``Qwen2MoeDecoderLayer``; Llama-4 ``interleave_moe_layer_step``,
  ``configuration_llama4.py``: ``moe_layers = list(range(step - 1, L, step))``, the same blocks);
- ``dense_layers``: an explicit list of dense blocks (Qwen ``mlp_only_layers``).

Dense blocks use ``ffn_hidden``. Symbols as in docs/concepts.md, plus E experts, k experts per token,
``f_e`` expert width, ``f_s`` shared-expert width.

Parallelism: tensor parallelism splits every expert's width by t, as it splits a dense MLP (all E
experts on every TP rank, Megatron's ``moe_extended_tp`` / DTensor TP on the grouped weights); expert
parallelism (experts spread over ranks, ``ParallelPlan(ep=...)``) is not modelled yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_memplan.validation import check_bool, check_int

if TYPE_CHECKING:  # annotations only: specs imports this module
    from lightning_memplan.model.specs import ModelSpec

__all__ = [
    "EXPERT_FIELDS",
    "MLA_FIELDS",
    "check_expert_fields",
    "is_moe",
    "is_moe_layer",
    "moe_layer_count",
    "uses_mla",
]

#: ``ModelSpec`` fields that describe the experts (all at their defaults: a dense model).
EXPERT_FIELDS = ("n_experts", "experts_per_token", "expert_ffn_hidden", "n_shared_experts",
                 "shared_expert_ffn_hidden", "shared_expert_gate", "first_dense_layers", "moe_layer_step",
                 "dense_layers")
#: ``ModelSpec`` fields of multi-head latent attention (DeepSeek-V2/V3).
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")

_DENSE_DEFAULTS: dict[str, Any] = {"n_experts": 0, "experts_per_token": None, "expert_ffn_hidden": None,
                                   "n_shared_experts": 0, "shared_expert_ffn_hidden": None,
                                   "shared_expert_gate": False, "first_dense_layers": 0, "moe_layer_step": 1,
                                   "dense_layers": ()}


def is_moe(model: ModelSpec) -> bool:
    """Whether the spec has routed experts (``n_experts > 0``) in at least one block."""
    return model.n_experts > 0 and moe_layer_count(model) > 0


def uses_mla(model: ModelSpec) -> bool:
    """Whether attention is multi-head latent attention (``kv_lora_rank`` set)."""
    return model.kv_lora_rank is not None


def is_moe_layer(model: ModelSpec, index: int) -> bool:
    """Whether block ``index`` (0-based) is an MoE block (see the module docstring for the rules)."""
    return (
        model.n_experts > 0
        and index >= model.first_dense_layers
        and (index + 1) % model.moe_layer_step == 0
        and index not in model.dense_layers
    )


def moe_layer_count(model: ModelSpec) -> int:
    """How many of the L blocks are MoE blocks (bounded: L <= 2**16 is checked by the config reader;
    counted arithmetically, not by a loop over L)."""
    if model.n_experts == 0:
        return 0
    step, first, n = model.moe_layer_step, model.first_dense_layers, model.n_layers
    # blocks i in [first, n) with (i + 1) % step == 0: multiples of step in [first + 1, n]
    count = max(0, n // step - first // step)
    return count - sum(1 for i in model.dense_layers if is_moe_layer_ignoring_list(model, i))


def is_moe_layer_ignoring_list(model: ModelSpec, index: int) -> bool:
    """:func:`is_moe_layer` without ``dense_layers`` (what the explicit list removes)."""
    return model.n_experts > 0 and index >= model.first_dense_layers and (index + 1) % model.moe_layer_step == 0


def check_expert_fields(model: ModelSpec) -> dict[str, Any]:
    """The checked, plain values of the expert and MLA fields of ``model`` (what ``__post_init__`` stores).

    Raises:
        TypeError: a field has the wrong type (``n_experts=8.0``, ``dense_layers="0,1"``).
        ValueError: a field is out of range, or one is set that needs another (``experts_per_token``
            without ``n_experts``; ``qk_rope_head_dim`` without ``kv_lora_rank``), naming the fix.
    """
    out: dict[str, Any] = {}
    if isinstance(model.dense_layers, list) and not model.dense_layers:
        out["dense_layers"] = ()  # what to_dict() writes (a JSON list) comes back as the default
    dense = all(getattr(model, name) == value for name, value in _DENSE_DEFAULTS.items() if name != "dense_layers")
    if not dense or out.get("dense_layers", model.dense_layers) != ():
        out.update(_check_experts(model))
    if any(getattr(model, name) is not None for name in MLA_FIELDS):
        out.update(_check_mla(model))
    return out


def _check_experts(model: ModelSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    n_experts = check_int("n_experts", model.n_experts, minimum=0,
                          hint="routed experts per MoE block (Mixtral 8, DeepSeek-V3 256); 0 for a dense model")
    out["n_experts"] = n_experts
    if n_experts == 0:
        extra = [name for name, value in _DENSE_DEFAULTS.items() if name != "n_experts" and getattr(model, name) != value]
        raise ValueError(
            f"{extra[0]}={getattr(model, extra[0])!r} needs n_experts > 0 (got n_experts=0, a dense model); pass "
            f"n_experts= (e.g. 8 for Mixtral) or leave {', '.join(extra)} at the default"
        )
    if model.experts_per_token is None:
        raise ValueError(
            f"experts_per_token=None but n_experts={n_experts}: pass the router's top-k, e.g. experts_per_token=2 "
            "(Mixtral's num_experts_per_tok)"
        )
    out["experts_per_token"] = check_int(
        "experts_per_token", model.experts_per_token, maximum=n_experts,
        hint=f"the router's top-k, at most n_experts={n_experts} (Mixtral 2, DeepSeek-V3 8)")
    if model.expert_ffn_hidden is not None:
        out["expert_ffn_hidden"] = check_int("expert_ffn_hidden", model.expert_ffn_hidden,
                                             hint="inner width of one routed expert (moe_intermediate_size)")
    out["n_shared_experts"] = check_int("n_shared_experts", model.n_shared_experts, minimum=0,
                                        hint="experts every token goes through (DeepSeek-V3 1, Mixtral 0)")
    if model.shared_expert_ffn_hidden is not None:
        out["shared_expert_ffn_hidden"] = check_int(
            "shared_expert_ffn_hidden", model.shared_expert_ffn_hidden,
            hint="inner width of one shared expert (Qwen2-MoE shared_expert_intermediate_size)")
    out["shared_expert_gate"] = check_bool("shared_expert_gate", model.shared_expert_gate,
                                           hint="True for Qwen2-MoE's sigmoid gate on the shared expert")
    if out["n_shared_experts"] == 0 and (model.shared_expert_ffn_hidden is not None or out["shared_expert_gate"]):
        raise ValueError(
            "shared_expert_ffn_hidden/shared_expert_gate need n_shared_experts >= 1 (got n_shared_experts=0); "
            "pass n_shared_experts=1 or leave them unset"
        )
    out["first_dense_layers"] = check_int(
        "first_dense_layers", model.first_dense_layers, minimum=0, maximum=model.n_layers,
        hint=f"dense blocks before the first MoE block, at most n_layers={model.n_layers} (DeepSeek-V3 3)")
    out["moe_layer_step"] = check_int(
        "moe_layer_step", model.moe_layer_step, maximum=max(model.n_layers, 1),
        hint="every step-th block is MoE (1: all; Llama-4-Maverick 2)")
    out["dense_layers"] = _check_layer_list(model.dense_layers, model.n_layers)
    return out


def _check_layer_list(value: Any, n_layers: int) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list, set, frozenset)):
        raise TypeError(
            f"dense_layers={value!r:.80} must be a tuple of block indices (Qwen's mlp_only_layers), e.g. (0, 5)"
        )
    if len(value) > n_layers:
        raise ValueError(f"dense_layers has {len(value)} entries but the model has n_layers={n_layers} blocks")
    indices = {check_int("dense_layers[i]", i, minimum=0, maximum=n_layers - 1,
                         hint=f"a block index in [0, {n_layers - 1}]") for i in value}
    return tuple(sorted(indices))


def _check_mla(model: ModelSpec) -> dict[str, Any]:
    if model.kv_lora_rank is None:
        given = next(name for name in MLA_FIELDS if getattr(model, name) is not None)
        raise ValueError(
            f"{given}={getattr(model, given)!r} is a multi-head latent attention field and needs kv_lora_rank "
            "(got kv_lora_rank=None); pass kv_lora_rank= (DeepSeek-V3 512) or leave the MLA fields unset"
        )
    out: dict[str, Any] = {"kv_lora_rank": check_int("kv_lora_rank", model.kv_lora_rank,
                                                     hint="the compressed key/value width (DeepSeek-V3 512)")}
    if model.q_lora_rank is not None:
        out["q_lora_rank"] = check_int("q_lora_rank", model.q_lora_rank,
                                       hint="the compressed query width (DeepSeek-V3 1536), or None for a full q_proj")
    for name, hint in (("qk_nope_head_dim", "128 for DeepSeek-V3"), ("qk_rope_head_dim", "64 for DeepSeek-V3"),
                       ("v_head_dim", "128 for DeepSeek-V3")):
        value = getattr(model, name)
        if value is None:
            raise ValueError(f"{name}=None but kv_lora_rank={model.kv_lora_rank!r} (MLA) needs it; pass {name}= ({hint})")
        out[name] = check_int(name, value, minimum=0 if name == "qk_nope_head_dim" else 1, hint=hint)
    qk = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    if model.head_dim is not None and model.head_dim != qk:
        raise ValueError(
            f"head_dim={model.head_dim!r} must be qk_nope_head_dim + qk_rope_head_dim = {qk} under MLA (the query/"
            f"key head width); pass head_dim={qk} or None"
        )
    return out
