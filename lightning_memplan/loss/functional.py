"""``linear_cross_entropy``: the functional form, shaped like ``F.cross_entropy`` (with the module form,
``loss/module.py``, as Liger-Kernel pairs ``transformers/functional.py`` with its modules).

Dispatch, in order: validate options and shapes → resolve vocab/sequence parallelism (DTensor or
``process_group``) → apply ``shift`` by moving the targets, not the hidden states (no [B, S-1, h]
copy) → pick the mode (materialising reference, torch's chunked op, or ours) → reshape the result.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from lightning_memplan.loss.chunked import ChunkedLinearCrossEntropyFunction, ChunkPlan
from lightning_memplan.loss.metrics import LossMetrics, metrics_from_stats
from lightning_memplan.loss.options import (
    AUTO_CHUNK_BUDGET_BYTES,
    LossOptions,
    auto_chunk_size,
    check_inputs,
    check_targets,
)
from lightning_memplan.loss.reference import (
    materialized_linear_cross_entropy,
    torch_backend_supported,
    torch_linear_cross_entropy,
)
from lightning_memplan.loss.vocab_parallel import (
    VocabShard,
    gather_sequence,
    is_dtensor,
    resolve_dtensor_weight,
    shard_from_process_group,
    split_sizes,
)
from lightning_memplan.validation import check_bool

__all__ = ["TORCH_BACKEND_DEVICES", "linear_cross_entropy", "loss_with_options"]

TORCH_BACKEND_DEVICES: frozenset[str] = frozenset()
"""Device types on which ``backend="auto"`` uses torch's ``F.linear_cross_entropy``. Empty: on CPU
(torch 2.13, bf16 and fp32) ours was faster in benchmarks/bench_loss.py, see
benchmarks/results/*loss*.md; on CUDA it is unmeasured here, so ours is used there too."""


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    shift: bool = False,
    chunk_size: int | str = "auto",
    process_group: Any = None,
    return_metrics: bool = False,
    mode: str = "auto",
    backend: str = "auto",
    validate_targets: bool = False,
    sequence_parallel: bool = False,
    chunk_budget_bytes: int = AUTO_CHUNK_BUDGET_BYTES,
    accum_dtype: torch.dtype = torch.float32,
    allow_retain_graph: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, LossMetrics]:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``target`` without [N, V] logits.

    Equals ``F.cross_entropy(F.linear(hidden, weight, bias).float(), target, ...)`` plus the z-loss
    and softcap options, computed over token chunks (and vocab shards) so that at most a
    [chunk, V/t] slice of logits exists, in forward and in backward.

    Args:
        hidden: [B, S, h] or [N, h] final hidden states (DTensor: Replicate, or Shard on the
            sequence dim for sequence parallelism).
        weight: [V, h] lm_head weight (tied embedding weights work). A DTensor sharded ``Shard(0)``
            over a tensor-parallel mesh selects the vocab-parallel path.
        target: [B, S] or [N] int64 class ids.
        bias: optional [V] lm_head bias.
        ignore_index: target id that is skipped (loss 0, not counted).
        reduction: ``"mean"`` over non-ignored tokens (0 if none), ``"sum"`` or ``"none"``.
        label_smoothing: ε in [0, 1), ``F.cross_entropy`` convention, global V.
        z_loss: λ ≥ 0, adds λ·lse² per token (PaLM).
        softcap: c > 0, logits ← c·tanh(logits/c) (Gemma 2).
        shift: predict ``target[:, 1:]`` from ``hidden[:, :-1]``.
        chunk_size: tokens per chunk, or ``"auto"`` (byte budget ``chunk_budget_bytes``).
        process_group: tensor-parallel group when ``weight`` is this rank's plain [V_r, h] slice
            (consecutive slices in rank order; uneven sizes allowed).
        return_metrics: also return :class:`LossMetrics` (accuracy, entropy, z-loss, tokens).
        mode: ``"auto"``, ``"chunked"``, ``"vocab_parallel"``, ``"fp32_upcast"`` or ``"naive"``.
        backend: ``"auto"``, ``"memplan"`` or ``"torch"`` (``F.linear_cross_entropy``).
        validate_targets: raise ``ValueError`` on out-of-range target ids (one host sync).
        sequence_parallel: plain-tensor ``hidden`` is this rank's equal-length sequence slice.
        chunk_budget_bytes: working-set budget of ``chunk_size="auto"``.
        accum_dtype: weight-gradient accumulator dtype across chunks.
        allow_retain_graph: allow a second backward through the graph (one more [V, h] buffer).

    Returns:
        The loss (0-dim fp32 for mean/sum; ``target``-shaped fp32 for ``"none"``, with ``shift``
        the last position dropped), or ``(loss, metrics)`` when ``return_metrics=True``. Under
        vocab parallelism the loss is the global one, identical on every rank.
    """
    # a bool, never a truthy string or number: it decides the return type
    return_metrics = check_bool("return_metrics", return_metrics, hint="True also returns LossMetrics")
    options = LossOptions(
        ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
        softcap=softcap, shift=shift, chunk_size=chunk_size, chunk_budget_bytes=chunk_budget_bytes, mode=mode,
        backend=backend, validate_targets=validate_targets, sequence_parallel=sequence_parallel,
        accum_dtype=accum_dtype, allow_retain_graph=allow_retain_graph,
    )
    loss, metrics = loss_with_options(hidden, weight, target, bias=bias, options=options, process_group=process_group,
                                      return_metrics=return_metrics)
    return (loss, cast(LossMetrics, metrics)) if return_metrics else loss


def _check_tensor(name: str, value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _seq_placement(value: Any, name: str) -> int | None:
    """For a DTensor ``value``: the tensor dim it is sharded on (None if replicated)."""
    from torch.distributed.tensor import Replicate, Shard

    dims = set()
    for placement in value.placements:
        if isinstance(placement, Shard):
            dims.add(placement.dim)
        elif not isinstance(placement, Replicate):
            raise ValueError(
                f"{name} is a DTensor with placements {tuple(value.placements)}; only Replicate() or "
                "Shard(seq_dim) are supported for the loss input"
            )
    if len(dims) > 1:
        raise ValueError(f"{name} is sharded on several dims {sorted(dims)}; shard only the sequence dim")
    return dims.pop() if dims else None


def loss_with_options(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None,
    options: LossOptions,
    process_group: Any = None,
    return_metrics: bool = False,
) -> tuple[torch.Tensor, LossMetrics | None]:
    """Compute the loss for a validated :class:`LossOptions` (used by the function and the module)."""
    _check_arguments(hidden, weight, target, bias, process_group)
    weight, bias, shard = _vocab_shard(weight, bias, process_group, options)
    hidden, target = _whole_sequence(hidden, target, shard, options)
    vocab_global = weight.shape[0] if shard is None else shard.vocab
    check_inputs(
        tuple(hidden.shape),
        tuple(weight.shape),
        tuple(target.shape),
        None if bias is None else tuple(bias.shape),
        target_dtype=target.dtype,
        shift=options.shift,
    )
    target = target.long()
    _check_target_ids(target, int(vocab_global), options)
    out_shape = tuple(target.shape)
    if options.shift:
        # Predicting target[:, 1:] from hidden[:, :-1] == predicting target shifted left by one at
        # every position with the last position ignored: same loss, count and gradients, no copy.
        pad = torch.full_like(target[:, :1], options.ignore_index)
        target = torch.cat([target[:, 1:], pad], dim=1)
        out_shape = (out_shape[0], out_shape[1] - 1)
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    target1d = target.reshape(-1)
    loss, stats = _dispatch(hidden2d, weight, bias, target1d, options, shard, return_metrics)
    if options.reduction == "none":
        loss = loss.reshape(target.shape)
        if options.shift:
            loss = loss[:, :-1]
        loss = loss.reshape(out_shape)
    metrics = metrics_from_stats(stats, options.z_loss) if return_metrics else None
    return loss, metrics


def _check_arguments(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
                     process_group: Any) -> None:
    """Tensors (not on the meta device) and a process group or ``None``."""
    for name, value in (("hidden", hidden), ("weight", weight), ("target", target)):
        _check_tensor(name, value)
    if bias is not None:
        _check_tensor("bias", bias)
    for name, given in (("hidden", hidden), ("weight", weight), ("target", target), ("bias", bias)):
        if given is not None and given.device.type == "meta":
            raise ValueError(
                f"{name} is on the meta device (shape {tuple(given.shape)}, no data): the loss needs real "
                f"values; materialise it first (e.g. module.to_empty(device=...) then load the weights)"
            )
    if process_group is not None and not isinstance(process_group, torch.distributed.ProcessGroup):
        raise TypeError(
            f"process_group={process_group!r:.80} must be a torch.distributed.ProcessGroup (e.g. "
            "device_mesh['tp'].get_group()) or None"
        )


def _vocab_shard(weight: torch.Tensor, bias: torch.Tensor | None, process_group: Any,
                 options: LossOptions) -> tuple[torch.Tensor, torch.Tensor | None, VocabShard | None]:
    """``(local weight, local bias, the vocabulary shard or None)`` from a DTensor weight or a process
    group, checked against ``options.mode``."""
    shard: VocabShard | None = None
    if is_dtensor(weight):
        weight, bias, shard = resolve_dtensor_weight(weight, bias)
        if shard is not None and process_group is not None and process_group is not shard.group:
            raise ValueError(
                "process_group was given but weight is a vocab-sharded DTensor with its own mesh group; "
                "pass one or the other"
            )
    elif is_dtensor(bias):
        raise TypeError("bias is a DTensor but weight is not; pass both as DTensors or both plain")
    elif process_group is not None:
        shard = shard_from_process_group(weight, process_group)
    if options.mode == "vocab_parallel" and shard is None:
        raise ValueError(
            "mode='vocab_parallel' needs a weight DTensor sharded Shard(0) over a tensor-parallel mesh "
            "or process_group=...; got a replicated/plain weight without a process group"
        )
    if options.mode in ("chunked", "naive", "fp32_upcast") and shard is not None:
        raise ValueError(
            f"mode={options.mode!r} runs on one process, but weight is vocab-sharded "
            f"(local shape {tuple(weight.shape)}); use mode='vocab_parallel' or 'auto'"
        )
    return weight, bias, shard


def _whole_sequence(hidden: torch.Tensor, target: torch.Tensor, shard: VocabShard | None,
                    options: LossOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """The local hidden states and targets, all-gathered over the sequence when it is sharded (a
    sequence-sharded DTensor, or ``sequence_parallel=True`` with plain tensors)."""
    seq_dim = hidden.dim() - 2
    sizes: list[int] | None = None
    if is_dtensor(hidden):
        sharded_on = _seq_placement(hidden, "hidden")
        if sharded_on is not None and sharded_on != seq_dim:
            raise ValueError(
                f"hidden is a DTensor sharded on dim {sharded_on} (shape {tuple(hidden.shape)}); only the "
                f"sequence dim {seq_dim} may be sharded"
            )
        if sharded_on is not None:
            if shard is None:
                raise ValueError(
                    "hidden is sequence-sharded but weight is not vocab-sharded and no process_group"
                )
            import torch.distributed as dist

            sizes = split_sizes(int(hidden.shape[seq_dim]), dist.get_world_size(shard.group))
        hidden = cast(Any, hidden).to_local()
    elif options.sequence_parallel:
        if shard is None:
            raise ValueError(
                "sequence_parallel=True needs process_group=... or a vocab-sharded DTensor weight"
            )
        import torch.distributed as dist

        world = dist.get_world_size(shard.group)
        sizes = [int(hidden.shape[seq_dim])] * world
        if options.validate_targets:
            _check_equal_lengths(hidden.shape[seq_dim], shard.group)
    if is_dtensor(target):
        target = cast(Any, target).full_tensor()
    if sizes is not None and shard is not None:
        full_len = sum(sizes)
        local_len = hidden.shape[seq_dim]
        hidden = gather_sequence(hidden, shard.group, sizes, seq_dim)
        if target.dim() == hidden.dim() - 1 and target.shape[seq_dim] == local_len and local_len != full_len:
            target = gather_sequence(target, shard.group, sizes, seq_dim)
    return hidden, target


def _check_target_ids(target: torch.Tensor, vocab: int, options: LossOptions) -> None:
    """Every target id is ``ignore_index`` or in ``[0, V)``: checked on the host with
    ``validate_targets``, else as one device assertion."""
    if options.validate_targets:
        check_targets(target, vocab, options.ignore_index)
        return
    # No host sync: the bound check is one device op (torch._assert_async). On CPU it raises here
    # (then re-checked for the detailed ValueError); on CUDA it is queued and fails as a device-side
    # assertion at the next synchronisation, as F.cross_entropy's own check does.
    bad = (target != options.ignore_index) & ((target < 0) | (target >= vocab))
    try:
        torch._assert_async(~bad.any(), "linear_cross_entropy: target ids outside [0, V) that are not ignore_index")
    except RuntimeError:
        if target.device.type != "cpu":
            raise
        check_targets(target, vocab, options.ignore_index)
        raise


def _check_equal_lengths(length: int, group: Any) -> None:
    import torch.distributed as dist

    lengths: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(lengths, int(length), group=group)
    if len(set(lengths)) != 1:
        raise ValueError(
            f"sequence_parallel=True with plain tensors needs equal local sequence lengths, got {lengths}; "
            "pad the sequence or pass hidden as a DTensor sharded on the sequence dim"
        )


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _dispatch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    options: LossOptions,
    shard: VocabShard | None,
    metrics: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of 2-d ``hidden`` and 1-d ``target`` in the mode and backend ``options`` choose: the
    materialising reference modes, torch's ``F.linear_cross_entropy`` or this package's chunked function."""
    compute_dtype = _compute_dtype(hidden, weight)
    device_type = hidden.device.type
    if options.mode in ("naive", "fp32_upcast"):
        return materialized_linear_cross_entropy(
            hidden, weight, bias, target, ignore_index=options.ignore_index, reduction=options.reduction,
            label_smoothing=options.label_smoothing, z_loss=options.z_loss, softcap=options.softcap,
            upcast=options.mode == "fp32_upcast", metrics=metrics,
        )
    chunk = _chunk_tokens(hidden, weight, options, compute_dtype)
    if _use_torch_backend(options, device_type, metrics, shard):
        cast = (
            hidden.to(compute_dtype),
            weight.to(compute_dtype),
            None if bias is None else bias.to(compute_dtype),
        )
        with torch.autocast(device_type, enabled=False):
            return torch_linear_cross_entropy(
                *cast, target, ignore_index=options.ignore_index, reduction=options.reduction, chunk_size=chunk,
            )
    plan = ChunkPlan(
        ignore_index=options.ignore_index,
        reduction=options.reduction,
        label_smoothing=float(options.label_smoothing),
        z_loss=float(options.z_loss),
        softcap=None if options.softcap is None else float(options.softcap),
        chunk_size=chunk,
        compute_dtype=compute_dtype,
        accum_dtype=options.accum_dtype,
        metrics=metrics,
        allow_retain_graph=options.allow_retain_graph,
        grad_enabled=torch.is_grad_enabled(),
        group=None if shard is None else shard.group,
        vocab_offset=0 if shard is None else shard.offset,
        inv_vocab=(1.0 / weight.shape[0]) if shard is None else _inverse(shard.vocab),
    )
    with torch.autocast(device_type, enabled=False):
        loss, stats = ChunkedLinearCrossEntropyFunction.apply(hidden, weight, bias, target, plan)
    return loss, stats


def _chunk_tokens(hidden: torch.Tensor, weight: torch.Tensor, options: LossOptions, compute_dtype: torch.dtype) -> int:
    """Tokens per chunk: ``options.chunk_size``, or the ``"auto"`` rule (``loss/options.py``)."""
    n_tokens, h = hidden.shape
    if options.chunk_size == "auto":
        return auto_chunk_size(n_tokens, h, weight.shape[0], compute_dtype, budget_bytes=options.chunk_budget_bytes,
                               softcap=options.softcap is not None, device=hidden.device.type)
    return min(int(options.chunk_size), max(n_tokens, 1))


def _use_torch_backend(options: LossOptions, device_type: str, metrics: bool, shard: VocabShard | None) -> bool:
    """Whether torch's ``F.linear_cross_entropy`` computes the loss (``backend="torch"``, or ``"auto"`` on a
    device of :data:`TORCH_BACKEND_DEVICES` when it supports the options); ``backend="torch"`` with options
    it does not support raises ``ValueError``."""
    reason = torch_backend_supported(
        label_smoothing=options.label_smoothing, z_loss=options.z_loss, softcap=options.softcap, metrics=metrics,
        vocab_parallel=shard is not None,
    )
    if options.backend == "torch" and reason is not None:
        raise ValueError(f"backend='torch' cannot be used here: {reason}; use backend='memplan'")
    return options.backend == "torch" or (
        options.backend == "auto" and device_type in TORCH_BACKEND_DEVICES and reason is None
    )


def _inverse(vocab: Any) -> Any:
    if isinstance(vocab, torch.Tensor):
        return 1.0 / vocab.to(torch.float32)
    return 1.0 / int(vocab)
