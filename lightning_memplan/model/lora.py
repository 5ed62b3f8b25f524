"""Trainable parameters of a LoRA adapter on a :class:`~lightning_memplan.model.specs.ModelSpec`, without peft.

peft's ``LoraLayer`` adds ``lora_A`` (``r x in``) and ``lora_B`` (``out x r``) to every targeted linear
(peft ``tuners/lora/layer.py`` ``LoraLayer.update_layer``; ``bias="none"``, the default, trains no
base bias), so one adapted linear trains ``r * (in + out)`` parameters and the base weights are frozen.
``target_modules`` matches a module by the last part of its name, as peft's string list does, so a
name shared by two linears of a block (GPT-2's ``c_proj`` in attention and MLP) adapts both.

The in/out widths of each named linear follow the Hugging Face module names of the families the config
reader knows (Llama/Mistral/Qwen2/Gemma, Phi-3's fused ``qkv_proj``/``gate_up_proj``, GPT-2's Conv1D,
GPT-NeoX), from the spec's h, a, k, d_h and f.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from lightning_memplan.validation import check_int

if TYPE_CHECKING:  # annotations only: specs imports this module
    from lightning_memplan.model.specs import ModelSpec

__all__ = ["LORA_TARGETS", "block_linears", "lora_trainable_params"]

#: The module names :func:`lora_trainable_params` knows.
LORA_TARGETS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj",
    "c_attn", "c_proj", "c_fc", "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h",
)


def block_linears(model: ModelSpec) -> dict[str, list[tuple[int, int]]]:
    """``{module name: [(in, out), ...]}`` of one block's linears under each family's names."""
    h, dh, a, k, f = model.hidden, model.dim_head, model.n_heads, model.kv_heads, model.ffn
    q, kv = a * dh, k * dh
    return {
        # Llama / Mistral / Qwen2 / Gemma (transformers modeling_llama.py LlamaAttention, LlamaMLP)
        "q_proj": [(h, q)], "k_proj": [(h, kv)], "v_proj": [(h, kv)], "o_proj": [(q, h)],
        "gate_proj": [(h, f)], "up_proj": [(h, f)], "down_proj": [(f, h)],
        # Phi-3 (modeling_phi3.py): fused q/k/v and gate/up
        "qkv_proj": [(h, q + 2 * kv)], "gate_up_proj": [(h, 2 * f)],
        # GPT-2 (modeling_gpt2.py, Conv1D): c_proj is both attn.c_proj and mlp.c_proj
        "c_attn": [(h, q + 2 * kv)], "c_proj": [(q, h), (f, h)], "c_fc": [(h, f)],
        # GPT-NeoX (modeling_gpt_neox.py)
        "query_key_value": [(h, q + 2 * kv)], "dense": [(q, h)], "dense_h_to_4h": [(h, f)], "dense_4h_to_h": [(f, h)],
    }


def lora_trainable_params(model: ModelSpec, rank: int, targets: Iterable[str]) -> int:
    """``L * sum over targeted linears of r * (in + out)``: what ``peft.get_peft_model(model,
    LoraConfig(r=rank, target_modules=targets))`` trains (``print_trainable_parameters()``).

    Raises:
        ValueError: a non-positive rank, no targets, or a name this table does not know (lists them).
        TypeError: ``targets`` is a single string (peft's regex form is not supported) or holds non-strings.
    """
    check_int("rank", rank, hint="the LoRA rank r, e.g. 8 or 16")
    if isinstance(targets, str):
        raise TypeError(
            f"targets={targets!r} must be a list of module names such as ('q_proj', 'v_proj'); a single string "
            "(peft's regex form) is not supported"
        )
    names = list(targets)
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"targets={names!r} must be a non-empty list of module names, e.g. ('q_proj', 'v_proj')")
    table = block_linears(model)
    unknown = sorted({n for n in names if n not in table})
    if unknown:
        raise ValueError(
            f"targets={unknown!r} are not linears this table knows ({', '.join(LORA_TARGETS)}); pass the adapter's "
            "trainable count instead: ModelSpec(..., n_trainable_params=N) (peft's print_trainable_parameters())"
        )
    per_block = sum(rank * (i + o) for name in dict.fromkeys(names) for i, o in table[name])
    return model.n_layers * per_block
