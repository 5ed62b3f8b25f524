"""Recognise where a module keeps its transformer parts, by attribute names.

torchtitan's ``parallelize_llama`` hard-codes one model's attribute names; here each supported family is
one :class:`TransformerLayout` entry naming its embedding, block list, final norm, output head and the
per-block projections, so FSDP wrapping, tensor-parallel plans, activation checkpointing and pipeline
splitting all read the same description.

Recognised (first match wins, searched from the LightningModule down):

* this project's zoo :class:`~lightning_memplan.testing.zoo.GPT`: ``tok_emb, pos_emb, blocks, norm_f,
  lm_head``; block ``attn.{q,k,v,o}_proj``, ``mlp.{fc_in,fc_out}`` or ``mlp.{gate,up,down}_proj``;
* Hugging Face Llama / Mistral / Qwen2 (``*ForCausalLM``): ``model.embed_tokens, model.layers,
  model.norm, lm_head``; block ``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``;
* Hugging Face GPT-2: ``transformer.wte, transformer.wpe, transformer.h, transformer.ln_f, lm_head``
  (fused ``Conv1D`` projections: no tensor-parallel plan, see :attr:`TransformerLayout.tp_blocker`);
* litgpt ``GPT``: ``transformer.wte, transformer.h, transformer.ln_f, lm_head``; block ``attn.qkv``
  (fused [Q | K | V], split per head by the TP plan), ``attn.proj``, ``mlp.fc_1/fc_2/proj`` (LLaMAMLP) or
  ``mlp.fc/proj`` (GPT-NeoX MLP).

Anything else with one ``nn.ModuleList`` of identical blocks is a "generic" layout: FSDP and activation
checkpointing per block work, tensor parallelism needs a module-provided ``tp_plan``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

__all__ = ["TransformerLayout", "find_layout", "get_submodule_or_none"]


_SP_BLOCKER = (
    "sequence parallelism is applied to the zoo GPT and Hugging Face Llama/Mistral/Qwen2 layouts only "
    "(it needs per-block norms, attention and MLP entry points it can re-layout)"
)


@dataclass(frozen=True, kw_only=True)
class TransformerLayout:
    """Where the parts of one transformer live, relative to :attr:`root`.

    Args:
        family: ``"zoo-gpt"``, ``"hf-llama"``, ``"hf-gpt2"``, ``"litgpt"`` or ``"generic"``.
        root: the transformer module (e.g. the ``GPT`` or ``LlamaForCausalLM``).
        root_path: its dotted path inside the LightningModule (``""`` for the LightningModule itself).
        blocks: dotted path of the ``nn.ModuleList`` of repeated blocks.
        embeddings: paths of the input embedding tables (token first).
        norm: path of the final norm, or ``None``.
        head: path of the output projection (``lm_head``), or ``None``.
        attn: path of the attention module inside a block.
        colwise: block-relative paths of projections split on their output features (Megatron's
            column-parallel: q, k, v, MLP up/gate).
        rowwise: block-relative paths split on their input features (attention out, MLP down).
        norms: block-relative paths of the block's norms (split on the sequence under SP).
        mlp: block-relative path of the MLP module.
        block_args: positional arguments a block is called with (the hidden states first).
        attn_kwarg: the keyword the block passes the hidden states to its attention with, or ``None``
            when it passes them positionally.
        head_count_attrs: attention attributes holding head counts that must become per-rank counts
            under TP (the zoo reshapes with ``view(b, s, self.n_heads, d)``).
        tp_blocker: why no tensor-parallel plan exists for this layout, or ``None``.
        tp_note: what the tensor-parallel plan leaves replicated, or ``None``.
        sp_blocker: why sequence parallelism (norms and the residual stream split on the sequence
            over the TP group) cannot be applied to this layout, or ``None``.
    """

    family: str
    root: nn.Module
    root_path: str
    blocks: str
    embeddings: tuple[str, ...] = ()
    norm: str | None = None
    head: str | None = None
    attn: str | None = None
    colwise: tuple[str, ...] = ()
    rowwise: tuple[str, ...] = ()
    head_count_attrs: tuple[str, ...] = ()
    norms: tuple[str, ...] = ()
    mlp: str | None = None
    block_args: int = 1
    attn_kwarg: str | None = None
    tp_blocker: str | None = None
    tp_note: str | None = field(default=None)
    sp_blocker: str | None = field(default=_SP_BLOCKER)

    @property
    def block_list(self) -> list[nn.Module]:
        """The blocks in order (a pipeline stage keeps only its own, in an ``nn.ModuleDict``)."""
        return [module for _, module in self.block_items()]

    def block_items(self) -> list[tuple[str, nn.Module]]:
        """``(key, block)`` pairs of the block container, ``nn.ModuleList`` or ``nn.ModuleDict``."""
        container = self.root.get_submodule(self.blocks)
        return list(container.named_children())

    def set_block(self, key: str, block: nn.Module) -> None:
        """Replace one block (e.g. by its activation-checkpoint wrapper) keeping its key."""
        container = self.root.get_submodule(self.blocks)
        setattr(container, key, block)

    def get(self, path: str | None) -> nn.Module | None:
        return get_submodule_or_none(self.root, path)


def get_submodule_or_none(module: nn.Module, path: str | None) -> nn.Module | None:
    """``module.get_submodule(path)`` that returns ``None`` for a missing or ``None``-valued path."""
    if path is None:
        return None
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _has(module: nn.Module, *paths: str) -> bool:
    return all(get_submodule_or_none(module, p) is not None for p in paths)


def _first_block(module: nn.Module, path: str) -> nn.Module | None:
    blocks = get_submodule_or_none(module, path)
    if isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
        return blocks[0]
    return None


def _zoo_gpt(module: nn.Module, path: str) -> TransformerLayout | None:
    if not (_has(module, "tok_emb", "blocks", "norm_f", "lm_head")):
        return None
    block = _first_block(module, "blocks")
    if block is None or not _has(block, "attn.q_proj", "attn.o_proj", "mlp"):
        return None
    swiglu = _has(block, "mlp.gate_proj")
    mlp_col = ("mlp.gate_proj", "mlp.up_proj") if swiglu else ("mlp.fc_in",)
    mlp_row = ("mlp.down_proj",) if swiglu else ("mlp.fc_out",)
    embeddings = ("tok_emb", "pos_emb") if getattr(module, "pos_emb", None) is not None else ("tok_emb",)
    return TransformerLayout(
        family="zoo-gpt",
        root=module,
        root_path=path,
        blocks="blocks",
        embeddings=embeddings,
        norm="norm_f",
        head="lm_head",
        attn="attn",
        colwise=("attn.q_proj", "attn.k_proj", "attn.v_proj", *mlp_col),
        rowwise=("attn.o_proj", *mlp_row),
        head_count_attrs=("n_heads", "kv_heads"),
        norms=("norm1", "norm2"),
        mlp="mlp",
        block_args=2,  # block(x, rope)
        sp_blocker=None,
    )


def _hf_llama(module: nn.Module, path: str) -> TransformerLayout | None:
    # LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM share this layout; their attention
    # reshapes with ``view(*shape, -1, head_dim)`` so per-rank head counts need no patching.
    if not _has(module, "model.embed_tokens", "model.layers", "model.norm"):
        return None
    block = _first_block(module, "model.layers")
    if block is None or not _has(block, "self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
        return None
    return TransformerLayout(
        family="hf-llama",
        root=module,
        root_path=path,
        blocks="model.layers",
        embeddings=("model.embed_tokens",),
        norm="model.norm",
        head="lm_head" if _has(module, "lm_head") else None,
        attn="self_attn",
        colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
        rowwise=("self_attn.o_proj", "mlp.down_proj"),
        norms=("input_layernorm", "post_attention_layernorm"),
        mlp="mlp",
        attn_kwarg="hidden_states",  # self.self_attn(hidden_states=..., position_embeddings=..., ...)
        sp_blocker=None,
    )


def _hf_gpt2(module: nn.Module, path: str) -> TransformerLayout | None:
    if not _has(module, "transformer.wte", "transformer.h", "transformer.ln_f"):
        return None
    block = _first_block(module, "transformer.h")
    if block is None or not _has(block, "attn.c_attn"):
        return None
    return TransformerLayout(
        family="hf-gpt2",
        root=module,
        root_path=path,
        blocks="transformer.h",
        embeddings=("transformer.wte", "transformer.wpe"),
        norm="transformer.ln_f",
        head="lm_head" if _has(module, "lm_head") else None,
        attn="attn",
        tp_blocker=(
            "Hugging Face GPT-2 stores its projections as fused Conv1D modules ([in, out] weights, q|k|v "
            "in one matrix); DTensor's ColwiseParallel/RowwiseParallel shard nn.Linear only"
        ),
    )


def _litgpt(module: nn.Module, path: str) -> TransformerLayout | None:
    if not _has(module, "transformer.wte", "transformer.h", "transformer.ln_f", "lm_head"):
        return None
    block = _first_block(module, "transformer.h")
    if block is None or not _has(block, "attn", "mlp"):
        return None
    col: tuple[str, ...]
    row: tuple[str, ...]
    if _has(block, "mlp.fc_1", "mlp.fc_2", "mlp.proj"):
        col, row = ("mlp.fc_1", "mlp.fc_2"), ("mlp.proj",)
    elif _has(block, "mlp.fc", "mlp.proj"):
        col, row = ("mlp.fc",), ("mlp.proj",)
    else:
        return None
    return TransformerLayout(
        family="litgpt",
        root=module,
        root_path=path,
        blocks="transformer.h",
        embeddings=("transformer.wte",),
        norm="transformer.ln_f",
        head="lm_head",
        attn="attn",
        colwise=col,  # attn.qkv is fused [Q | K | V]: tensor_parallel.shard_litgpt_attention splits it per head
        rowwise=("attn.proj", *row),
    )


def _generic(module: nn.Module, path: str) -> TransformerLayout | None:
    lists = [
        (name, child)
        for name, child in module.named_modules()
        if isinstance(child, nn.ModuleList) and len(child) > 1 and len({type(m) for m in child}) == 1
    ]
    if not lists:
        return None
    name, _ = max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    return TransformerLayout(
        family="generic",
        root=module,
        root_path=path,
        blocks=name,
        tp_blocker=(
            f"{type(module).__name__} is not a recognised layout (zoo GPT, Hugging Face Llama/Mistral/Qwen2/"
            "GPT-2, litgpt GPT) and provides no `tp_plan` attribute"
        ),
    )


_RECOGNISERS = (_zoo_gpt, _hf_llama, _hf_gpt2, _litgpt)


def find_layout(module: nn.Module) -> TransformerLayout | None:
    """The first recognised transformer inside ``module`` (breadth-first), else a generic block layout.

    Returns ``None`` when the module has no list of repeated blocks at all.
    """
    queue: list[tuple[str, nn.Module]] = [("", module)]
    while queue:
        path, current = queue.pop(0)
        for recognise in _RECOGNISERS:
            layout = recognise(current, path)
            if layout is not None:
                return layout
        queue.extend((f"{path}.{name}" if path else name, child) for name, child in current.named_children())
    return _generic(module, "")
