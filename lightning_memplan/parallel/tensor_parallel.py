"""Tensor parallelism with DTensor ``parallelize_module`` (Megatron-style column/row splits).

Per block, q/k/v and the MLP up/gate projections are split on their output features
(``ColwiseParallel``) and the attention output and MLP down projection on their input features
(``RowwiseParallel``), so each block needs one all-reduce in forward and one in backward per sub-layer
(Shoeybi et al. 2019, arXiv 1909.08053, section 3, Fig. 3). The token embedding is split on the vocab rows
(``RowwiseParallel`` on ``nn.Embedding``), the lm_head on the vocab columns (``ColwiseParallel``): its
weight is a vocab-sharded DTensor, which :class:`~lightning_memplan.loss.LinearCrossEntropy` consumes
directly (vocab-parallel loss); a plain ``self.lm_head(hidden)`` call gets the gathered logits back so
ordinary training steps keep working.

litgpt's fused ``attn.qkv`` ([Q | K | V] rows) is split per head: its rows are permuted so each rank's
Q heads, K and V groups are one contiguous chunk, then column-parallel (:func:`shard_litgpt_attention`;
``state_dict`` keeps litgpt's own row order, and :func:`resume_blocker` refuses optimizer states written
at another tp).

A module whose layout is not recognised may provide ``tp_plan``: a dict from (wildcard) submodule paths to a ``ParallelStyle``
or one of the strings ``"colwise"``, ``"rowwise"``, ``"colwise_rep"`` (= Hugging Face's
``"colwise_gather_output"``), ``"rowwise_rep"``, ``"embedding_rowwise"``. Recognised layouts use the
plans here and ignore a ``tp_plan`` attribute (Hugging Face models carry a partial one of their own).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_memplan.live.layouts import TransformerLayout, get_submodule_or_none

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "apply_tensor_parallel",
    "find_linear_cross_entropy",
    "litgpt_attention_blocker",
    "litgpt_qkv_rows",
    "module_tp_plan",
    "resume_blocker",
    "sequence_parallel_blocker",
    "shard_litgpt_attention",
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


def _litgpt_heads(layout: TransformerLayout) -> list[tuple[str, int]]:
    config = getattr(layout.root, "config", None)
    return [(name, int(getattr(config, name))) for name in ("n_head", "n_query_groups") if hasattr(config, name)]


def litgpt_attention_blocker(layout: TransformerLayout) -> str | None:
    """Why litgpt's attention cannot be split per head (``None`` when it can): the plan handles
    ``CausalSelfAttention`` with a fused ``qkv`` ``nn.Linear`` and no query/key norms sized by the whole
    projection (``norm_qk_type="olmo2"``)."""
    attn = get_submodule_or_none(layout.block_list[0], layout.attn)
    if type(attn).__name__ != "CausalSelfAttention" or not isinstance(getattr(attn, "qkv", None), nn.Linear):
        return f"litgpt attention {type(attn).__name__} has no fused qkv nn.Linear (latent attention is not split)"
    config: Any = getattr(attn, "config", None)
    if getattr(config, "norm_qk", False) and getattr(config, "norm_qk_type", "default") != "default":
        return f"litgpt norm_qk_type={config.norm_qk_type!r} norms the whole q/k projection; tensor parallel needs per-head norms"
    return None


def tensor_parallel_blocker(layout: TransformerLayout | None, module: nn.Module, tp: int) -> str | None:
    """Why ``module`` cannot be split ``tp`` ways (``None`` when it can).

    A recognised layout must have whole heads and projection widths divisible by ``tp``; anything else
    needs a module-provided ``tp_plan`` (accepted as given).
    """
    if tp == 1:
        return None
    quantized = _quantized_blocks(layout, module)
    if quantized is not None:
        return quantized
    if layout is None or layout.tp_blocker is not None:
        owner = layout.root if layout is not None else module
        if module_tp_plan(owner) is not None or module_tp_plan(module) is not None:
            return None
        if layout is None:
            return f"{type(module).__name__} has no list of repeated blocks and no `tp_plan`"
        return layout.tp_blocker
    if layout.family == "litgpt":
        reason = litgpt_attention_blocker(layout)
        if reason is not None:
            return reason
    heads = {"zoo-gpt": _attention_heads, "litgpt": _litgpt_heads}.get(layout.family, _hf_heads)(layout)
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


def _quantized_blocks(layout: TransformerLayout | None, module: nn.Module) -> str | None:
    """Why quantized weights block tensor parallelism (``None`` without them): bitsandbytes' packed 4-bit
    and int8 weights, with their per-block constants, are not DTensors, so no row or column split applies
    (the blocks' format, :func:`~lightning_memplan.live.low_precision.base_weights_of`)."""
    from lightning_memplan.live.low_precision import base_weights_of

    blocks = layout.block_list[:1] if layout is not None and layout.block_list else [module]
    fmt = base_weights_of(nn.ModuleList(blocks))
    if fmt is None:
        return None
    return (f"the blocks' linears hold {fmt} quantized weights (bitsandbytes), which are not DTensors: tensor "
            "parallelism cannot split them; data parallelism (DDP or FSDP2) can")


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
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    notes: list[str] = []
    if layout is None or layout.tp_blocker is not None:
        # Not a recognised layout: the module's own plan (checked by tensor_parallel_blocker).
        target = layout.root if layout is not None and module_tp_plan(layout.root) is not None else module
        custom = module_tp_plan(target) or {}
        parallelize_module(target, tp_mesh, {path: _style(style) for path, style in custom.items()})
        notes.append(f"tensor parallel from {type(target).__name__}.tp_plan ({len(custom)} entries)")
        return notes
    emb_path = _shard_top_level(layout, tp_mesh, sequence_parallel)
    # Under SP the whole sequence enters the model's first block, which keeps this rank's slice; later
    # blocks (and the first block of a later pipeline stage, which receives the previous stage's
    # sequence-sharded output) take the slice as it comes. The model's first block is the first one held
    # by the rank that holds the embedding (stage 0 keeps blocks 0..k, in order).
    _shard_blocks(layout, tp_mesh, sequence_parallel, enters_whole=emb_path is not None or not layout.embeddings)
    if layout.tp_note:
        notes.append(layout.tp_note)
    if sequence_parallel:
        notes.append(f"sequence parallel: norms and the residual stream hold 1/{tp} of the sequence per rank")
    lces = find_linear_cross_entropy(module)
    if lces:
        notes.append(
            f"{len(lces)} LinearCrossEntropy module(s) see the vocab-sharded lm_head weight and compute the "
            "loss vocab-parallel"
        )
    return notes


def _shard_top_level(layout: TransformerLayout, tp_mesh: DeviceMesh, sp: bool) -> str | None:
    """Shard the embedding (vocab rows), the final norm (SP) and the lm_head (vocab columns) that the stage
    holds; returns the embedding's path (``None`` on a stage without it).

    After a pipeline split a stage holds only some of the top-level parts (the embedding on the first
    stage, final norm and head on the last; the others are None): each style is applied to the parts
    present, as torchtitan's ``parallelize_fn`` runs on every pipeline model part (torchtitan/train.py:
    "for m in model_parts: ... parallelize_fn(m, ...)"; its Llama plan names tok_embeddings/norm/output,
    which the split set to None on the other stages)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    root = layout.root
    emb_path = next((p for p in layout.embeddings[:1] if _present(root, p)), None)
    head = layout.head if _present(root, layout.head) else None
    norm = layout.norm if _present(root, layout.norm) else None
    tied = (
        head is not None
        and emb_path is not None
        and root.get_submodule(head).weight is root.get_submodule(emb_path).weight
    )
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
    return emb_path


def _block_plan(layout: TransformerLayout, sp: bool) -> dict[str, Any]:
    """Every block's styles: column- and row-parallel projections; under SP the norms sequence-sharded and
    the attention and MLP inputs gathered (other attention arguments, rope and masks, pass through)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {
        **{p: ColwiseParallel() for p in layout.colwise},
        **{p: RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()) for p in layout.rowwise},
    }
    if not sp:
        return plan
    plan.update({p: SequenceParallel() for p in layout.norms})
    if layout.attn is not None:
        if layout.attn_kwarg is not None:
            plan[layout.attn] = PrepareModuleInput(
                input_kwarg_layouts={layout.attn_kwarg: Shard(1)},
                desired_input_kwarg_layouts={layout.attn_kwarg: Replicate()},
            )
        else:
            plan[layout.attn] = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
    if layout.mlp is not None:
        plan[layout.mlp] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def _shard_blocks(layout: TransformerLayout, tp_mesh: DeviceMesh, sp: bool, *, enters_whole: bool) -> None:
    """Shard every block the stage holds with :func:`_block_plan`; under SP the first block of a stage the
    whole sequence enters keeps this rank's slice (no communication); attention head counts divided by tp."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

    tp = tp_mesh.size()
    block_plan = _block_plan(layout, sp)
    for i, block in enumerate(layout.block_list):
        if layout.family == "litgpt":
            shard_litgpt_attention(block.get_submodule(layout.attn or "attn"), tp_mesh)
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


def litgpt_qkv_rows(n_head: int, n_query_groups: int, head_size: int, tp: int) -> Any:
    """Row order of litgpt's fused ``qkv`` weight that puts each rank's heads in one contiguous chunk.

    litgpt 0.5 stores ``qkv.weight`` as ``[Q | K | V]`` rows (``n_head * head_size``, then
    ``n_query_groups * head_size`` for K and for V) and splits its output with
    ``qkv.split((n_head * hs, n_query_groups * hs, n_query_groups * hs), dim=-1)`` (litgpt/model.py,
    ``CausalSelfAttention.forward``). Rank ``r`` of ``tp`` needs query heads ``r*n_head/tp ..`` and the
    key/value groups they attend with (``repeat_interleave`` maps head ``h`` to group
    ``h // (n_head / n_query_groups)``, so the same contiguous ``1/tp`` of the groups):
    ``[Q_0 K_0 V_0 | Q_1 K_1 V_1 | ...]``. Returns the permutation (a ``LongTensor`` of row indices).
    """
    import torch

    q, kv = n_head * head_size, n_query_groups * head_size
    parts = [torch.arange(q), torch.arange(q, q + kv), torch.arange(q + kv, q + 2 * kv)]
    return torch.cat([chunk for r in range(tp) for chunk in (p.chunk(tp)[r] for p in parts)])


def shard_litgpt_attention(attn: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split one litgpt ``CausalSelfAttention`` per head over ``tp_mesh`` (the caller shards ``proj``).

    The fused ``qkv`` rows are permuted so each rank's Q heads, K groups and V groups are one contiguous
    chunk (:func:`litgpt_qkv_rows`), then column-parallel; the attention gets its own copy of the config
    with per-rank ``n_head`` and ``n_query_groups`` (its forward reshapes with them). The permutation
    lives only in the sharded parameter: ``state_dict()`` returns ``qkv.weight``/``qkv.bias`` as the
    unsharded model's global tensors (rows in litgpt's order) and ``load_state_dict`` accepts them, so
    model checkpoints stay valid across tp sizes.
    """
    import copy

    import torch
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    tp = tp_mesh.size()
    config: Any = copy.copy(attn.config)
    rows = litgpt_qkv_rows(config.n_head, config.n_query_groups, config.head_size, tp)
    inverse = torch.argsort(rows)
    qkv = attn.get_submodule("qkv")
    with torch.no_grad():
        for name in ("weight", "bias"):
            param = getattr(qkv, name, None)
            if param is not None:
                param.copy_(param[rows.to(param.device)])
    parallelize_module(attn, tp_mesh, {"qkv": ColwiseParallel()})
    config.n_head //= tp
    config.n_query_groups //= tp
    attn.config = config
    qkv.register_state_dict_post_hook(_qkv_global_rows(inverse))
    qkv.register_load_state_dict_pre_hook(_qkv_sharded_rows(rows))


def resume_blocker(layout: TransformerLayout | None, stored_tp: int, tp: int) -> str | None:
    """Why a checkpoint written at ``stored_tp`` cannot resume training at ``tp`` (``None`` when it can).

    litgpt's split attention keeps its optimizer states (e.g. Adam's moments of ``attn.qkv``) in the
    sharded parameter's row order (:func:`litgpt_qkv_rows`, which depends on ``tp``); the model's
    ``state_dict`` is restored to litgpt's order but an optimizer's is not, so another tp would pair
    moments with the wrong rows.
    """
    if layout is None or layout.family != "litgpt" or stored_tp == tp:
        return None
    return (
        f"the checkpoint was written at tp={stored_tp} and this run has tp={tp}: litgpt's fused attn.qkv keeps "
        "its optimizer states in a tp-dependent row order, so they would not match the rows of this layout; "
        f"resume with plan=ParallelPlan(tp={stored_tp}, ...) (or set trainer.ckpt_path before fit), or load "
        "only the model weights (model.load_state_dict: its state_dict is in litgpt's own order at any tp)"
    )


def _qkv_global_rows(inverse: Any) -> Any:
    """``state_dict`` post-hook: the sharded, permuted qkv tensors as the unsharded model's tensors."""
    from torch.distributed.tensor import DTensor

    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for name in ("weight", "bias"):
            value = state_dict.get(prefix + name)
            if isinstance(value, DTensor):
                full: Any = value.full_tensor().detach()
                state_dict[prefix + name] = full[inverse.to(full.device)]

    return hook


def _qkv_sharded_rows(rows: Any) -> Any:
    """``load_state_dict`` pre-hook: an unsharded model's qkv tensor, permuted and sliced like the parameter."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for name in ("weight", "bias"):
            value, param = state_dict.get(prefix + name), getattr(module, name, None)
            if value is None or not isinstance(param, DTensor) or tuple(value.shape) != tuple(param.shape):
                continue  # missing or mis-shaped: load_state_dict reports it
            full: Any = value.full_tensor() if isinstance(value, DTensor) else value
            permuted = full.detach()[rows.to(full.device)].to(param.device)
            state_dict[prefix + name] = distribute_tensor(
                permuted, param.device_mesh, param.placements, src_data_rank=None
            )

    return hook


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
