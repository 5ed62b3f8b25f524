"""Trainable parameters of a LoRA adapter on a :class:`~lightning_memplan.model.specs.ModelSpec`, without peft.

peft's ``LoraLayer`` adds ``lora_A`` (``r x in``) and ``lora_B`` (``out x r``) to every targeted linear
(peft ``tuners/lora/layer.py`` ``LoraLayer.update_layer``; ``bias="none"``, the default, trains no
base bias), so one adapted linear trains ``r * (in + out)`` parameters and the base weights are frozen.
``target_modules`` matches a module by the last part of its name, as peft's string list does, so a
name shared by two linears of a block (GPT-2's ``c_proj`` in attention and MLP) adapts both.

The in/out widths of each named linear follow the Hugging Face module names of the families the config
reader knows (Llama/Mistral/Qwen2/Gemma, Phi-3's fused ``qkv_proj``/``gate_up_proj``, GPT-2's Conv1D,
GPT-NeoX), from the spec's h, a, k, d_h and f.

What a LoRA step saves for backward differs from full fine-tuning's, and the config-only estimate
traces it rather than writing it down (``tracking/hf_calibrate.py`` wraps the depth-1/2 copies with
peft's own LoRA layers, :func:`lora_adapter`), because the differences depend on the module:

- a frozen linear whose weight does not require grad saves no input: autograd keeps ``x`` of ``x W^T``
  only to form the weight gradient (PyTorch ``tools/autograd/derivatives.yaml``, ``mm``/``addmm``: ``self``
  is needed for ``mat2``'s gradient alone; the generated code saves it only when that gradient is
  computed: under ``torch.autograd.graph.saved_tensors_hooks`` a frozen ``nn.Linear`` packs ``W^T`` only,
  torch 2.13). So the frozen q/k/v/o and MLP projections of a LoRA step keep much less than full
  fine-tuning's;
- peft's ``Linear.forward`` (``tuners/lora/layer.py``) computes ``base_layer(x) + lora_B(lora_A(
  dropout(x))) * scaling``: ``lora_A`` saves its input (with ``lora_dropout=0``, ``nn.Identity``, the same
  storage the base layer read: counted once), ``lora_B`` saves ``A``'s ``[b*s, r]`` output, the scaling
  (a Python float) saves nothing; with ``lora_dropout > 0`` each adapted module keeps its own dropped copy
  of ``x`` and its mask;
- GPT-2's ``Conv1D`` is wrapped with ``fan_in_fan_out=True`` (peft sets it and warns): the frozen
  ``addmm(bias, x, W)`` saves no input either, and the adapter path is the same two ``nn.Linear``.

The analytic terms (``model/terms.py``) keep full fine-tuning's activations for a spec without a traced
source: :meth:`~lightning_memplan.model.specs.ModelSpec.with_lora` records the adapter so that a spec
from :meth:`~lightning_memplan.model.specs.ModelSpec.from_hf_config` is traced with it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from lightning_memplan.validation import check_int, check_number

if TYPE_CHECKING:  # annotations only: specs imports this module
    from lightning_memplan.model.specs import ModelSpec

__all__ = ["LORA_TARGETS", "block_linears", "check_lora_fields", "lora_adapter", "lora_trainable_params"]

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


def check_lora_fields(model: ModelSpec) -> dict[str, Any]:
    """The checked LoRA fields of ``model`` (``lora_rank``, ``lora_targets`` as a tuple, ``lora_dropout``),
    to be stored back by ``ModelSpec.__post_init__``; ``{}`` for a spec without an adapter.

    Raises:
        ValueError: targets or a dropout without a rank, a rank without targets, a dropout outside [0, 1).
        TypeError: a non-integer rank, targets that are a single string or hold non-strings.
    """
    if model.lora_rank is None:
        if model.lora_targets or model.lora_dropout:
            raise ValueError(
                f"lora_targets={model.lora_targets!r} / lora_dropout={model.lora_dropout!r} describe a LoRA adapter "
                "but lora_rank=None; use ModelSpec.with_lora(rank=r, targets=...) to set all three"
            )
        return {} if type(model.lora_targets) is tuple else {"lora_targets": ()}  # from_dict's [] back to ()
    rank = check_int("lora_rank", model.lora_rank, hint="the LoRA rank r, e.g. 8 or 16")
    targets = model.lora_targets
    if isinstance(targets, str) or not all(isinstance(t, str) for t in targets):
        raise TypeError(f"lora_targets={targets!r} must be a tuple of module names such as ('q_proj', 'v_proj')")
    if not targets:
        raise ValueError(f"lora_rank={rank!r} needs lora_targets, the adapted module names, e.g. ('q_proj', 'v_proj')")
    dropout = check_number("lora_dropout", model.lora_dropout, minimum=0.0, maximum=1.0, max_inclusive=False,
                           hint="peft's lora_dropout, a probability in [0, 1), e.g. 0.05")
    return {"lora_rank": rank, "lora_targets": tuple(dict.fromkeys(targets)), "lora_dropout": dropout}


def lora_adapter(model: ModelSpec) -> dict[str, Any] | None:
    """The ``peft.LoraConfig`` keywords of the spec's adapter (``r``, ``target_modules``, ``lora_dropout``),
    JSON-ready; ``None`` without one. ``lora_alpha`` (the scaling) changes no tensor a step keeps."""
    if model.lora_rank is None:
        return None
    return {"r": model.lora_rank, "target_modules": list(model.lora_targets), "lora_dropout": model.lora_dropout}
