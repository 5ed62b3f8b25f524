"""Tensor parallelism with DTensor ``parallelize_module`` (Megatron-style column/row splits).

Per block, q/k/v and the MLP up/gate projections are split on their output features
(``ColwiseParallel``) and the attention output and MLP down projection on their input features
(``RowwiseParallel``), so each block needs one all-reduce in forward and one in backward per sub-layer
(Shoeybi et al. 2019, arXiv 1909.08053, section 3, Fig. 3). The token embedding is split on the vocab rows
(``RowwiseParallel`` on ``nn.Embedding``), the lm_head on the vocab columns (``ColwiseParallel``): its
weight is a vocab-sharded DTensor, which :class:`~lightning_memplan.loss.LinearCrossEntropy` consumes
directly (vocab-parallel loss); a plain ``self.lm_head(hidden)`` call gets the gathered logits back so
ordinary training steps keep working.

A module whose layout is not recognised may provide ``tp_plan``: a dict from (wildcard) submodule paths to a ``ParallelStyle``
or one of the strings ``"colwise"``, ``"rowwise"``, ``"colwise_rep"`` (= Hugging Face's
``"colwise_gather_output"``), ``"rowwise_rep"``, ``"embedding_rowwise"``. Recognised layouts use the
plans here and ignore a ``tp_plan`` attribute (Hugging Face models carry a partial one of their own).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_memplan.strategies.layouts import TransformerLayout, get_submodule_or_none

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "apply_tensor_parallel",
    "find_linear_cross_entropy",
    "module_tp_plan",
    "sequence_parallel_blocker",
    "tensor_parallel_blocker",
]


def module_tp_plan(module: nn.Module) -> dict[str, Any] | None:
    """The ``tp_plan`` a module provides for itself (attribute or zero-argument method), if any."""
    plan = getattr(module, "tp_plan", None)
    if callable(plan):
        plan = plan()
    if plan is None:
        return None
    if not isinstance(plan, dict):
        raise TypeError(
            f"{type(module).__name__}.tp_plan={plan!r} must be a dict from submodule path to a "
            "ParallelStyle or 'colwise'/'rowwise'"
        )
    return plan or None  # an empty plan (Hugging Face models without TP support) is no plan


def _attention_heads(layout: TransformerLayout) -> list[tuple[str, int]]:
    if layout.attn is None or not layout.head_count_attrs:
        return []
    attn = get_submodule_or_none(layout.block_list[0], layout.attn)
    return [(name, int(getattr(attn, name))) for name in layout.head_count_attrs if hasattr(attn, name)]


def _hf_heads(layout: TransformerLayout) -> list[tuple[str, int]]:
    config = getattr(layout.root, "config", None)
    out = []
    for attr, label in (("num_attention_heads", "n_heads"), ("num_key_value_heads", "kv_heads")):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            out.append((label, value))
    return out


def tensor_parallel_blocker(layout: TransformerLayout | None, module: nn.Module, tp: int) -> str | None:
    """Why ``module`` cannot be split ``tp`` ways (``None`` when it can).

    A recognised layout must have whole heads and projection widths divisible by ``tp``; anything else
    needs a module-provided ``tp_plan`` (accepted as given).
    """
    if tp == 1:
        return None
    if layout is None or layout.tp_blocker is not None:
        owner = layout.root if layout is not None else module
        if module_tp_plan(owner) is not None or module_tp_plan(module) is not None:
            return None
        if layout is None:
            return f"{type(module).__name__} has no list of repeated blocks and no `tp_plan`"
        return layout.tp_blocker
    heads = _attention_heads(layout) if layout.family == "zoo-gpt" else _hf_heads(layout)
    if layout.tp_note is not None:
        heads = []  # attention is not split
    for name, count in heads:
        if count % tp:
            good = [d for d in range(1, count + 1) if count % d == 0]
            return f"tp={tp} does not divide {name}={count}; use tp in {good}"
    block = layout.block_list[0]
    for path in (*layout.colwise, *layout.rowwise):
        linear = block.get_submodule(path)
        if not isinstance(linear, nn.Linear):
            return f"{path} is a {type(linear).__name__}, not nn.Linear"
        width = linear.out_features if path in layout.colwise else linear.in_features
        if width % tp:
            return f"tp={tp} does not divide the width {width} of {path}"
    return None


def _style(value: Any) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

    if isinstance(value, ParallelStyle):
        return value
    table = {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    if value not in table:
        raise ValueError(f"tp_plan style {value!r} is not a ParallelStyle; use one of {sorted(table)}")
    return table[value]()


def find_linear_cross_entropy(module: nn.Module) -> list[nn.Module]:
    """Every ``LinearCrossEntropy`` inside ``module`` (matched by class name, so no import is needed)."""
    return [m for m in module.modules() if type(m).__name__ == "LinearCrossEntropy"]


def sequence_parallel_blocker(layout: TransformerLayout | None, tp: int, pp: int) -> str | None:
    """Why sequence parallelism cannot be applied on top of ``tp``-way TP (``None`` when it can)."""
    if layout is None:
        return "no recognised transformer layout"
    if layout.sp_blocker is not None:
        return layout.sp_blocker
    # pp > 1 is fine: a stage boundary passes the sequence-sharded residual stream ([b, s/tp, h] local
    # tensors, torchtitan's layout too) and only the model's first block slices the whole sequence.
    if tp == 1:
        return "sequence parallelism splits over the tensor-parallel group, and tp=1"
    return None


def apply_tensor_parallel(
    module: nn.Module, layout: TransformerLayout | None, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False
) -> list[str]:
    """Shard ``module`` over ``tp_mesh`` in place; returns notes about what stayed replicated.

    The caller has checked :func:`tensor_parallel_blocker` (and :func:`sequence_parallel_blocker` for
    ``sequence_parallel``). Parameters are distributed from rank 0 (``src_data_rank=0``), so every TP
    rank starts from the same weights.

    ``sequence_parallel``: Korthikanti et al. 2022 (arXiv 2205.05198, section 4.2.2) with PyTorch's
    styles, after torchtitan's Llama plan: the residual stream, the norms and dropouts hold a ``1/tp``
    slice of the sequence (``SequenceParallel``); the attention and MLP inputs are all-gathered
    (``PrepareModuleInput`` Shard(1) -> Replicate) and their row-parallel outputs reduce-scattered
    back (``RowwiseParallel(output_layouts=Shard(1))``). Unlike torchtitan, the embedding output stays
    whole and the first block takes its slice (Replicate -> Shard(1), no communication): models that
    derive positions, masks or learned position embeddings from the embedding output's length (Hugging
    Face Llama, GPT-2-style tables) then see the whole sequence. The final norm returns a
    sequence-sharded DTensor: ``LinearCrossEntropy`` consumes it as is, an ``lm_head`` call gathers it.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    notes: list[str] = []
    if layout is None or layout.tp_blocker is not None:
        # Not a recognised layout: the module's own plan (checked by tensor_parallel_blocker).
        target = layout.root if layout is not None and module_tp_plan(layout.root) is not None else module
        custom = module_tp_plan(target) or {}
        parallelize_module(target, tp_mesh, {path: _style(style) for path, style in custom.items()})
        notes.append(f"tensor parallel from {type(target).__name__}.tp_plan ({len(custom)} entries)")
        return notes
    assert layout is not None  # guaranteed by tensor_parallel_blocker

    root = layout.root
    # After a pipeline split a stage holds only some of the top-level parts (the embedding on the first
    # stage, final norm and head on the last; the others are None): each style is applied to the parts
    # present, as torchtitan's ``parallelize_fn`` runs on every pipeline model part (torchtitan/train.py:
    # "for m in model_parts: ... parallelize_fn(m, ...)"; its Llama plan names tok_embeddings/norm/output,
    # which the split set to None on the other stages).
    emb_path = next((p for p in layout.embeddings[:1] if _present(root, p)), None)
    head = layout.head if _present(root, layout.head) else None
    norm = layout.norm if _present(root, layout.norm) else None
    tied = (
        head is not None
        and emb_path is not None
        and root.get_submodule(head).weight is root.get_submodule(emb_path).weight
    )
    sp = sequence_parallel
    top: dict[str, Any] = {}
    if emb_path is not None:
        # nn.Embedding + RowwiseParallel shards the vocab rows; masked lookups are summed by all-reduce.
        top[emb_path] = RowwiseParallel(input_layouts=Replicate())
    if sp and norm is not None:
        top[norm] = SequenceParallel()
    if head is not None:
        # Vocab-sharded weight; gathered logits for plain callers (LinearCrossEntropy reads the weight).
        top[head] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate())
    if top:
        parallelize_module(root, tp_mesh, top)
    if tied and head is not None and emb_path is not None:
        # Both styles shard the shared [V, h] matrix on dim 0, so one DTensor serves both modules again.
        root.get_submodule(head).weight = root.get_submodule(emb_path).weight
    block_plan: dict[str, Any] = {
        **{p: ColwiseParallel() for p in layout.colwise},
        **{p: RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()) for p in layout.rowwise},
    }
    if sp:
        block_plan.update({p: SequenceParallel() for p in layout.norms})
        if layout.attn is not None:  # gather the hidden states; other arguments (rope, masks) pass through
            if layout.attn_kwarg is not None:
                block_plan[layout.attn] = PrepareModuleInput(
                    input_kwarg_layouts={layout.attn_kwarg: Shard(1)},
                    desired_input_kwarg_layouts={layout.attn_kwarg: Replicate()},
                )
            else:
                block_plan[layout.attn] = PrepareModuleInput(
                    input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                )
        if layout.mlp is not None:
            block_plan[layout.mlp] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    # Under SP the whole sequence enters the model's first block, which keeps this rank's slice; later
    # blocks (and the first block of a later pipeline stage, which receives the previous stage's
    # sequence-sharded output) take the slice as it comes. The model's first block is the first one held
    # by the rank that holds the embedding (stage 0 keeps blocks 0..k, in order).
    enters_whole = emb_path is not None or not layout.embeddings
    for i, block in enumerate(layout.block_list):
        parallelize_module(block, tp_mesh, block_plan)
        if sp and i == 0 and enters_whole:  # keep this rank's slice of the whole sequence (local, no comm)
            rest = (None,) * (layout.block_args - 1)
            parallelize_module(block, tp_mesh, PrepareModuleInput(
                input_layouts=(Replicate(), *rest), desired_input_layouts=(Shard(1), *rest), use_local_output=True
            ))
            # Runs first: a batch whose length tp does not divide would give ranks unequal slices, and
            # gloo/NCCL then abort the process on a size mismatch instead of raising.
            block.register_forward_pre_hook(_sequence_divisible_by(tp), prepend=True)
        if layout.attn is not None:
            attn = block.get_submodule(layout.attn)
            for name in layout.head_count_attrs:
                if hasattr(attn, name):
                    setattr(attn, name, getattr(attn, name) // tp)
    if layout.tp_note:
        notes.append(layout.tp_note)
    if sp:
        notes.append(f"sequence parallel: norms and the residual stream hold 1/{tp} of the sequence per rank")
    lces = find_linear_cross_entropy(module)
    if lces:
        notes.append(
            f"{len(lces)} LinearCrossEntropy module(s) see the vocab-sharded lm_head weight and compute the "
            "loss vocab-parallel"
        )
    return notes


def _present(root: nn.Module, path: str | None) -> bool:
    """Whether ``path`` names a real part of ``root`` (not missing, ``None`` or ``nn.Identity`` after a
    pipeline split)."""
    part = get_submodule_or_none(root, path)
    return part is not None and not isinstance(part, nn.Identity)


def _sequence_divisible_by(tp: int) -> Any:
    """A forward pre-hook raising ``ValueError`` when the hidden states' sequence length (dim 1) is not
    a multiple of ``tp``. Every TP rank sees the same batch, so every rank raises."""

    def check(module: nn.Module, args: tuple[Any, ...]) -> None:
        hidden: Any = args[0] if args else None
        if getattr(hidden, "ndim", 0) >= 2 and hidden.shape[1] % tp:
            raise ValueError(
                f"sequence parallelism over tp={tp} needs a sequence length divisible by {tp}, but this batch "
                f"has {hidden.shape[1]} (hidden states {tuple(hidden.shape)}); pad sequences to a multiple of "
                f"{tp} (e.g. pad_to_multiple_of={tp} in the collator) or plan with sp=False"
            )

    return check
