"""Data parallelism with FSDP2 ``fully_shard``: DDP, ZeRO-2/3 and HSDP from one API.

Each repeated block becomes one FSDP unit (one all-gather / reduce-scatter per block, as torchtitan's
``apply_fsdp``), untied embedding and output head get their own units, and the LightningModule itself is
the root unit that takes the rest, with its step methods registered as forward methods: whatever a
``training_step`` calls (``self.model(...)``, ``self.model.model(...)`` of a Hugging Face ``*ForCausalLM``,
``lm_head.weight`` read by a loss) finds the root's parameters gathered. FSDP2 only all-gathers a unit
in the pre-forward hook of the module it was applied to (``fully_shard`` docs: "the root ... is the
module whose forward runs first"), so a root placed on an inner transformer misses every call that
bypasses that transformer's ``forward``. The data-parallel mesh decides the semantics:

* ``(dp_replicate=d, dp_shard=1)``: every rank holds full parameters and gradients are all-reduced over
  the replicate dim -- DDP semantics (FSDP2's HSDP with a shard group of one);
* ``(dp_replicate=1, dp_shard=d)``: parameters, gradients and optimizer states are sharded
  (ZeRO-3 when ``reshard_after_forward``, ZeRO-2 otherwise; Rajbhandari et al. 2020, arXiv 1910.02054).

Lightning's precision plugin keeps doing autocast, so no ``MixedPrecisionPolicy`` is set here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_memplan.live.layouts import TransformerLayout
from lightning_memplan.parallel.mesh import MeshAxis, MeshLayout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "STEP_METHODS",
    "apply_activation_checkpointing",
    "apply_activation_offload",
    "apply_data_parallel",
    "data_parallel_mesh",
    "offloads_to_cpu",
    "own_units",
    "selective_op_context_fn",
]

#: LightningModule methods Lightning calls instead of ``forward``; each all-gathers the root unit.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def data_parallel_mesh(mesh: DeviceMesh, layout: MeshLayout) -> DeviceMesh:
    """The submesh FSDP2 shards/replicates over: 2-D (replicate, shard) for HSDP/DDP, else 1-D shard."""
    if layout.dp_replicate > 1:
        return mesh[(str(MeshAxis.DP_REPLICATE), str(MeshAxis.DP_SHARD))]
    return mesh[str(MeshAxis.DP_SHARD)]


def own_units(transformer: TransformerLayout | None, *, separate_head: bool = True) -> tuple[str, ...]:
    """The parts besides the blocks that :func:`apply_data_parallel` gives FSDP2 units of their own
    (``ParallelPlan.own_units``): the untied embedding (``"embedding"``) and lm_head (``"head"``), each
    when it has a trainable parameter (a frozen part, as peft LoRA's base, stays in the root unit: it has
    no gradient to reduce); ``()`` without a recognised layout, for a tied pair, or when
    ``separate_head`` is off (a loss that reads ``lm_head.weight`` outside the module's forward needs it
    gathered in the root unit)."""
    if transformer is None or not separate_head:
        return ()
    head = transformer.get(transformer.head)
    emb = transformer.get(transformer.embeddings[0]) if transformer.embeddings else None
    if head is not None and emb is not None and head.weight is emb.weight:
        return ()
    return tuple(
        name for name, part in (("embedding", emb), ("head", head))
        if part is not None and any(p.requires_grad for p in part.parameters())
    )


def apply_data_parallel(
    module: nn.Module,
    transformer: TransformerLayout | None,
    dp_mesh: DeviceMesh,
    *,
    reshard_after_forward: bool | int,
    roots: tuple[nn.Module, ...] | None = None,
    units: tuple[str, ...] = ("embedding", "head"),
    forward_methods: tuple[str, ...] = ("logits",),
    cpu_offload: bool = False,
) -> None:
    """``fully_shard`` per block, per untied embedding/head, then the root(s), in place.

    Args:
        module: the LightningModule; any parameter left outside the units is sharded with it as a last unit.
        transformer: the recognised layout inside it, or ``None`` to shard ``module`` as one unit.
        dp_mesh: from :func:`data_parallel_mesh`.
        reshard_after_forward: ZeRO-3 (``True``), ZeRO-2 (``False``) or an int ``n`` (reshard to ``n``
            ranks after forward; FSDP2 ``fully_shard``) for the per-block units.
        roots: the modules whose ``forward`` runs the model (default: ``module``, the LightningModule,
            with its :data:`STEP_METHODS` registered as forward methods); pipeline stages pass their
            :class:`~lightning_memplan.parallel.pipeline.StageModule` objects.
        units: which of the untied embedding and lm_head get units of their own (``ParallelPlan.own_units``,
            as :func:`own_units` finds them; a part absent from this stage, tied or frozen gets none). ``()``
            keeps them in the root unit, whose parameters stay gathered from forward to backward, so that
            a loss that reads ``lm_head.weight`` in ``training_step`` (``LinearCrossEntropy``) sees the
            full weight.
        forward_methods: root methods other than ``forward`` that read root parameters (the zoo GPT's
            ``logits``); registered with ``register_fsdp_forward_method`` so they all-gather too. The
            LightningModule root also gets :data:`STEP_METHODS`.
        cpu_offload: every unit (blocks, embedding/head, roots, leftovers) gets
            ``offload_policy=CPUOffloadPolicy()``: its sharded parameters (pinned on an accelerator mesh), their
            gradients and the
            optimizer states in host memory, the optimizer step on the CPU (``TrainSpec(offload="params")``;
            ``lightning_memplan.model.offload`` counts it). The module must then stay on the CPU until the
            first forward (torch's ``_validate_cpu_offload_params``): the strategies skip their
            ``model_to_device``.
    """
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    policy = _offload_policy(cpu_offload, dp_mesh.device_type)
    kwargs: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward, **policy}
    if roots is None:
        roots = (module,)
    if transformer is not None:
        for block in transformer.block_list:
            fully_shard(block, **kwargs)
        parts = {"embedding": transformer.embeddings[0] if transformer.embeddings else None, "head": transformer.head}
        for name in own_units(transformer):
            part = transformer.get(parts[name])
            if name in units and part is not None:
                fully_shard(part, **kwargs)
    for root in roots:
        # The root keeps its parameters gathered between forward and backward (FSDP2's own default).
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=False, **policy)
        for name in (*forward_methods, *(STEP_METHODS if root is module else ())):
            if callable(getattr(root, name, None)):
                register_fsdp_forward_method(root, name)
    if module not in roots:
        _shard_leftovers(module, dp_mesh, policy)


def _offload_policy(cpu_offload: bool, device_type: str) -> dict[str, Any]:
    """``{"offload_policy": CPUOffloadPolicy(...)}`` or ``{}``: pinned host buffers (FSDP2's default) on an
    accelerator; on a CPU mesh ``pin_memory=False`` (host and device memory are one, and ``pin_memory()``
    raises without an accelerator)."""
    if not cpu_offload:
        return {}
    from torch.distributed.fsdp import CPUOffloadPolicy

    return {"offload_policy": CPUOffloadPolicy(pin_memory=device_type != "cpu")}


def offloads_to_cpu(module: nn.Module) -> bool:
    """Whether any FSDP2 unit of ``module`` keeps its parameters on the CPU (``CPUOffloadPolicy``): such a
    module must not be moved to the device after ``fully_shard`` (torch's ``_validate_cpu_offload_params``
    refuses sharded parameters off the CPU at the first forward)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            state = sub._get_fsdp_state()
            for group in state._fsdp_param_groups:
                if isinstance(group.offload_policy, CPUOffloadPolicy):
                    return True
    return False


def _shard_leftovers(module: nn.Module, dp_mesh: DeviceMesh, policy: dict[str, Any] | None = None) -> None:
    """Give every parameter outside the transformer (e.g. an extra head of the LightningModule) an FSDP
    unit of its own, at the smallest submodule whose ``forward`` is what uses it."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    direct = [name for name, p in module.named_parameters(recurse=False) if not _is_dtensor(p)]
    if direct:
        raise ValueError(
            f"parameters {direct} sit directly on {type(module).__name__}, outside any submodule, so no "
            "FSDP unit can gather them in a forward; move them into an nn.Module attribute"
        )
    for child in module.children():
        if isinstance(child, FSDPModule) or all(_is_dtensor(p) for p in child.parameters()):
            continue
        if any(_is_dtensor(p) for p in child.parameters()):
            _shard_leftovers(child, dp_mesh, policy)
        else:
            fully_shard(child, mesh=dp_mesh, reshard_after_forward=False, **(policy or {}))


def _is_dtensor(tensor: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _resolve_op(name: str) -> Any:
    """``"aten.mm.default"`` -> ``torch.ops.aten.mm.default`` (``None`` when this build lacks it)."""
    import torch

    obj: Any = torch.ops
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def selective_op_context_fn() -> Callable[[], Any]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` applying
    torchtitan's op-level policy (:mod:`lightning_memplan.model.checkpointing`, which cites the source):
    ``MUST_SAVE`` for the outputs of :data:`SAC_SAVE_OPS` except every second matmul (counted per block,
    separately for the forward and the recompute), ``PREFER_RECOMPUTE`` for everything else, through
    ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` (PyTorch's own mechanism)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from lightning_memplan.model.checkpointing import SAC_MATMUL_OPS, SAC_SAVE_OPS

    save = {op for op in map(_resolve_op, SAC_SAVE_OPS) if op is not None}
    matmuls = {op for op in map(_resolve_op, SAC_MATMUL_OPS) if op is not None}

    def context_fn() -> Any:
        counts = {"forward": 0, "recompute": 0}

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            key = "recompute" if ctx.is_recompute else "forward"
            if func in matmuls:
                counts[key] += 1
                if counts[key] % 2 == 0:
                    return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def apply_activation_offload(transformer: TransformerLayout) -> str:
    """Wrap every block with torch's ``offload_wrapper`` (``save_on_cpu(pin_memory=True)`` around its
    forward: what the block saves for backward lives in pinned host memory until its backward;
    ``TrainSpec(offload_activations=True)``, counted by ``lightning_memplan.model.offload``); returns a note.
    Applied where activation checkpointing would be, before FSDP2 (the wrapper is a plain module, so the
    block's FSDP2 unit takes the wrapper)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import offload_wrapper

    blocks = transformer.block_items()
    for key, block in blocks:
        transformer.set_block(key, offload_wrapper(block))
    return f"activation offloading (save_on_cpu, pinned): every block ({len(blocks)})"


def apply_activation_checkpointing(transformer: TransformerLayout, recompute: str) -> str:
    """Wrap blocks with ``checkpoint_wrapper`` (non-reentrant ``torch.utils.checkpoint``); returns a note.

    ``"full"`` checkpoints each block (only its input is stored; Chen et al. 2016, arXiv 1604.06174).
    ``"selective"`` checkpoints each block's attention module: its input is stored, projections and the
    attention core are recomputed -- a superset of Korthikanti et al. 2022 (arXiv 2205.05198, section 5),
    which recomputes only the core, so it saves at least the planned memory.
    ``"selective_op"`` checkpoints each block with torchtitan's op-level policy
    (:func:`selective_op_context_fn`): every second matmul output, the attention kernel's outputs and
    collectives are kept, the rest is recomputed.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    if recompute not in ("full", "selective", "selective_op"):
        return ""
    cache = _disable_kv_cache(transformer)
    blocks = transformer.block_items()
    attn = transformer.attn
    note = _checkpointed(transformer, recompute, blocks, attn, checkpoint_wrapper)
    return note + cache


def _disable_kv_cache(transformer: TransformerLayout) -> str:
    """A Hugging Face model with ``config.use_cache`` appends each forward's keys and values to a cache, so
    a block's recomputed forward sees the cache grown by its own first pass (the checkpoint's shape check
    fails, ``[b, kv, s]`` against ``[b, kv, 2 s]``) and the cache keeps them alive past the checkpoint.
    ``use_cache`` is turned off, as transformers' own ``gradient_checkpointing_enable`` does in training."""
    config: Any = getattr(transformer.root, "config", None)
    if not getattr(config, "use_cache", False):
        return ""
    config.use_cache = False
    return "; config.use_cache set to False (a key/value cache cannot be recomputed)"


def _checkpointed(transformer: TransformerLayout, recompute: str, blocks: list[tuple[str, nn.Module]], attn: str | None,
                  checkpoint_wrapper: Any) -> str:
    if recompute == "selective_op":
        context_fn = selective_op_context_fn()
        for key, block in blocks:
            transformer.set_block(key, checkpoint_wrapper(block, context_fn=context_fn))
        return f"selective-op activation checkpointing (torchtitan's policy): every block ({len(blocks)})"
    if recompute == "full" or (recompute == "selective" and attn is None):
        for key, block in blocks:
            transformer.set_block(key, checkpoint_wrapper(block))
        if recompute == "selective":
            return "selective recompute: no attention module found, whole blocks checkpointed instead"
        return f"activation checkpointing: every block ({len(blocks)})"
    if recompute == "selective" and attn is not None:  # attn is None was handled above
        for _, block in blocks:
            parent_path, _, name = attn.rpartition(".")
            parent = block.get_submodule(parent_path) if parent_path else block
            setattr(parent, name, checkpoint_wrapper(getattr(parent, name)))
        return f"selective recompute: attention of every block ({len(blocks)}) checkpointed"
    return ""
