"""Data parallelism with FSDP2 ``fully_shard``: DDP, ZeRO-2/3 and HSDP from one API.

Each repeated block becomes one FSDP unit (one all-gather / reduce-scatter per block, as torchtitan's
``apply_fsdp``), untied embedding and output head get their own units, and the transformer root takes
the rest. The data-parallel mesh decides the semantics:

* ``(dp_replicate=d, dp_shard=1)``: every rank holds full parameters and gradients are all-reduced over
  the replicate dim -- DDP semantics (FSDP2's HSDP with a shard group of one);
* ``(dp_replicate=1, dp_shard=d)``: parameters, gradients and optimizer states are sharded
  (ZeRO-3 when ``reshard_after_forward``, ZeRO-2 otherwise; Rajbhandari et al. 2020, arXiv 1910.02054).

Lightning's precision plugin keeps doing autocast, so no ``MixedPrecisionPolicy`` is set here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from lightning_memplan.strategies.layouts import TransformerLayout
from lightning_memplan.strategies.mesh import MeshAxis, MeshLayout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["apply_activation_checkpointing", "apply_data_parallel", "data_parallel_mesh"]


def data_parallel_mesh(mesh: DeviceMesh, layout: MeshLayout) -> DeviceMesh:
    """The submesh FSDP2 shards/replicates over: 2-D (replicate, shard) for HSDP/DDP, else 1-D shard."""
    if layout.dp_replicate > 1:
        return mesh[(str(MeshAxis.DP_REPLICATE), str(MeshAxis.DP_SHARD))]
    return mesh[str(MeshAxis.DP_SHARD)]


def apply_data_parallel(
    module: nn.Module,
    transformer: TransformerLayout | None,
    dp_mesh: DeviceMesh,
    *,
    reshard_after_forward: bool,
    roots: tuple[nn.Module, ...] | None = None,
    separate_head: bool = True,
    forward_methods: tuple[str, ...] = ("logits",),
) -> None:
    """``fully_shard`` per block, per untied embedding/head, then the root(s), in place.

    Args:
        module: the LightningModule; any parameter left outside the units is sharded with it as a last unit.
        transformer: the recognised layout inside it, or ``None`` to shard ``module`` as one unit.
        dp_mesh: from :func:`data_parallel_mesh`.
        reshard_after_forward: ZeRO-3 (``True``) or ZeRO-2 (``False``) for the per-block units.
        roots: the modules whose ``forward`` runs the model (default: the transformer); pipeline stages
            pass their :class:`~lightning_memplan.strategies.pipeline.StageModule` objects.
        separate_head: give the untied embedding and lm_head units of their own. ``False`` keeps them in
            the root unit, whose parameters stay gathered from forward to backward, so that a loss that
            reads ``lm_head.weight`` in ``training_step`` (``LinearCrossEntropy``) sees the full weight.
        forward_methods: root methods other than ``forward`` that read root parameters (the zoo GPT's
            ``logits``); registered with ``register_fsdp_forward_method`` so they all-gather too.
    """
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    kwargs: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward}
    if roots is None:
        roots = (transformer.root,) if transformer is not None else (module,)
    if transformer is not None:
        for block in transformer.block_list:
            fully_shard(block, **kwargs)
        head = transformer.get(transformer.head)
        emb = transformer.get(transformer.embeddings[0]) if transformer.embeddings else None
        tied = head is not None and emb is not None and head.weight is emb.weight
        if not tied and separate_head:
            for part in (emb, head):
                if part is not None and any(p.requires_grad for p in part.parameters()):
                    fully_shard(part, **kwargs)
    for root in roots:
        # The root keeps its parameters gathered between forward and backward (FSDP2's own default).
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=False)
        for name in forward_methods:
            if callable(getattr(root, name, None)):
                register_fsdp_forward_method(root, name)
    if module not in roots:
        _shard_leftovers(module, dp_mesh)


def _shard_leftovers(module: nn.Module, dp_mesh: DeviceMesh) -> None:
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
            _shard_leftovers(child, dp_mesh)
        else:
            fully_shard(child, mesh=dp_mesh, reshard_after_forward=False)


def _is_dtensor(tensor: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def apply_activation_checkpointing(transformer: TransformerLayout, recompute: str) -> str:
    """Wrap blocks with ``checkpoint_wrapper`` (non-reentrant ``torch.utils.checkpoint``); returns a note.

    ``"full"`` checkpoints each block (only its input is stored; Chen et al. 2016, arXiv 1604.06174).
    ``"selective"`` checkpoints each block's attention module: its input is stored, projections and the
    attention core are recomputed -- a superset of Korthikanti et al. 2022 (arXiv 2205.05198, section 5),
    which recomputes only the core, so it saves at least the planned memory.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = transformer.block_items()
    attn = transformer.attn
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
