"""Vocab-parallel and sequence-parallel plumbing: which rank owns which vocabulary rows and tokens.

The lm_head weight arrives either as a DTensor sharded on the vocab dim over a tensor-parallel mesh
(what ``ColwiseParallel`` produces on an ``nn.Linear``: ``Shard(0)`` of the [V, h] weight) or as a
plain local slice with ``process_group=``. Each rank then runs the chunked loss on its [V_r, h] rows;
the per-token statistics are merged with all-reduces inside
:class:`~lightning_memplan.loss.chunked.ChunkedLinearCrossEntropyFunction`, so no rank ever holds
[N, V] logits (Megatron's VocabParallelCrossEntropy holds the local [N, V/t] logits, and averages
label smoothing per partition, Megatron-LM issue 737; here smoothing uses the global V).

Hidden states sharded on the sequence dim (sequence parallelism) are all-gathered to [N, h] — h
values per token, never V — before the loss; the backward of that gather is a plain slice because
the loss function already returns the full, all-reduced input gradient on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "VocabShard",
    "gather_sequence",
    "is_dtensor",
    "resolve_dtensor_weight",
    "shard_from_process_group",
    "split_sizes",
]


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor`` (without importing it eagerly)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(value, DTensor)


@dataclass(frozen=True, kw_only=True)
class VocabShard:
    """Where this rank's vocabulary rows sit in the global vocabulary."""

    group: Any
    """Process group over which the vocabulary is split (the tensor-parallel group)."""
    offset: Any
    """Global id of the first local row: int (DTensor) or 0-dim int64 tensor (process_group)."""
    vocab: Any
    """Global V: int (DTensor) or 0-dim int64 tensor (process_group; no host sync)."""
    mesh_dim: int | None = None
    """Mesh dim of the vocab shard when the weight is a DTensor."""


def split_sizes(total: int, parts: int) -> list[int]:
    """Sizes of ``torch.chunk``-style shards (DTensor's ``Shard`` split): ceil-sized, last may be short."""
    step = -(-total // parts) if parts else 0
    return [max(0, min(step, total - i * step)) for i in range(parts)]


def resolve_dtensor_weight(
    weight: Any, bias: Any
) -> tuple[torch.Tensor, torch.Tensor | None, VocabShard | None]:
    """Local weight/bias of a DTensor lm_head weight and its :class:`VocabShard` (None if replicated).

    Raises:
        ValueError: naming the placements when the weight is sharded on a dim other than the vocab
            dim 0 (e.g. ``RowwiseParallel`` shards the [V, h] weight on h), is ``Partial``, or is
            vocab-sharded over more than one mesh dim.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = tuple(weight.placements)
    vocab_dims = []
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard) and placement.dim == 0:
            vocab_dims.append(mesh_dim)
        elif not isinstance(placement, Replicate):
            raise ValueError(
                f"weight is a DTensor with placements {placements} (shape {tuple(weight.shape)}); the "
                "vocab-parallel loss needs Shard(0) on the vocab dim of the [V, h] weight (what "
                "ColwiseParallel does to lm_head) and Replicate() elsewhere, not "
                f"{placement!r} on mesh dim {mesh_dim}; use ColwiseParallel for the lm_head"
            )
    if len(vocab_dims) > 1:
        raise ValueError(
            f"weight is vocab-sharded over mesh dims {vocab_dims} (placements {placements}); shard it over "
            "one tensor-parallel mesh dim only"
        )
    local_bias = None
    if bias is not None:
        if is_dtensor(bias):
            if tuple(bias.placements) != placements:
                raise ValueError(
                    f"bias placements {tuple(bias.placements)} must equal weight placements {placements}"
                )
            local_bias = bias.to_local()
        else:
            local_bias = bias
    local_weight = weight.to_local()
    if not vocab_dims:
        return local_weight, local_bias, None
    mesh = weight.device_mesh
    _, global_offset = compute_local_shape_and_global_offset(weight.shape, mesh, placements)
    shard = VocabShard(
        group=mesh.get_group(vocab_dims[0]),
        offset=int(global_offset[0]),
        vocab=int(weight.shape[0]),
        mesh_dim=vocab_dims[0],
    )
    return local_weight, local_bias, shard


def shard_from_process_group(local_weight: torch.Tensor, group: Any) -> VocabShard:
    """:class:`VocabShard` of a plain local [V_r, h] slice: one all-gather of the V_r (uneven allowed).

    Ranks hold consecutive slices in rank order. The offset and global V stay device tensors, so no
    host synchronisation happens.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    mine = torch.tensor([local_weight.shape[0]], dtype=torch.int64, device=local_weight.device)
    sizes = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(sizes, mine, group=group)
    stacked = torch.cat(sizes)
    return VocabShard(group=group, offset=stacked[:rank].sum(), vocab=stacked.sum())


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` with per-rank ``sizes``; backward slices this rank's part.

    The slice is the exact gradient here because the consumer (the loss) returns the full input
    gradient, identical on every rank (see the module docstring). Uneven sizes are padded to the
    largest for the collective and trimmed afterwards.
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any, sizes: list[int], dim: int) -> torch.Tensor:  # type: ignore[override]
        rank = dist.get_rank(group)
        ctx.dim, ctx.start, ctx.size = dim, sum(sizes[:rank]), sizes[rank]
        biggest = max(sizes)
        padded = local
        if local.shape[dim] < biggest:
            pad_shape = list(local.shape)
            pad_shape[dim] = biggest - local.shape[dim]
            padded = torch.cat([local, local.new_zeros(pad_shape)], dim=dim)
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes, strict=True)], dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad.narrow(ctx.dim, ctx.start, ctx.size).contiguous(), None, None, None


def gather_sequence(local: torch.Tensor, group: Any, sizes: list[int], dim: int) -> torch.Tensor:
    """Gather sequence shards of ``local`` (hidden states or targets) into the full sequence."""
    if local.is_floating_point():
        return _GatherSequence.apply(local, group, sizes, dim)
    with torch.no_grad():
        return _GatherSequence.apply(local, group, sizes, dim)
