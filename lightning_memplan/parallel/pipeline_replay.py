"""One pipeline rank's step, traced: its own stages (blocks, and the embedding / head where it holds them)
run in the order PyTorch's schedule runs them, under fake tensors, and measured per component.

The analytic pipeline model (``model/estimate.py`` with ``model/pipeline_timeline.py``) composes one
micro-batch's terms with the schedule's in-flight counts; what a real stage holds also depends on
details it does not see (each stage of a Hugging Face Llama rebuilds its rotary table and causal mask,
which tensors a stage's forward saves, when each gradient appears). This module measures them instead:
the module's meta copy (``tracking/meta_copy.py``) is pruned to the rank's stages exactly as
:class:`~lightning_memplan.parallel.pipeline.PipelineRunner` prunes the live module
(:func:`~lightning_memplan.parallel.pipeline.prune_to_stages`), with the plan's activation
checkpointing, and :func:`~lightning_memplan.tracking.trace.trace_memory` runs its step: every forward
and backward of the rank's op order (:func:`rank_actions`), a received activation or gradient made
where the schedule would receive it, then the optimizer step. Two steps, the second measured (the
optimizer states exist).

Op orders (torch 2.13 ``torch/distributed/pipelining/schedules.py``): ``ScheduleGPipe`` runs all
forwards, then all backwards; ``Schedule1F1B`` runs ``min(m, p - i)`` warm-up forwards on rank i, then a
backward and a forward while forwards remain, then the remaining backwards;
``ScheduleInterleaved1F1B._calculate_single_rank_operations`` (with ``_get_warmup_ops`` and
``_get_1f1b_rank_ops``) runs ``min(m v, (v - 1) r + 2 (p - 1 - i))`` warm-up forwards (``r = m //
max(1, m // p)`` micro-batches per round), then forward / backward pairs, then the remaining backwards;
forward k runs local chunk ``(k // r) mod v`` and the k-th backward after the warm-up local chunk
``v - 1 - (k // r) mod v`` (Narayanan et al. 2021, arXiv 2104.04473, section 2.2.2). Written here, not
read from torch: the schedule classes need a process group and built stages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_memplan.live.layouts import find_layout
from lightning_memplan.model.result import MemoryEstimate
from lightning_memplan.parallel.pipeline import (
    StageModule,
    _default_batch,
    _default_loss,
    prune_to_stages,
    stage_indices,
)

__all__ = ["MAX_REPLAYED_ACTIONS", "rank_actions", "trace_pipeline_rank"]

#: Most forwards plus backwards one traced rank step replays (``2 m v``); a longer schedule is not traced
#: (the analytic pipeline model answers for it).
MAX_REPLAYED_ACTIONS = 256


def rank_actions(pp_rank: int, pp: int, microbatches: int, schedule: str, virtual_stages: int = 1) -> list[tuple[str, int, int]]:
    """``[("F" | "B", local_chunk, micro_batch), ...]``: the computations of pipeline rank ``pp_rank`` in
    one step, in the schedule's order (module docstring)."""
    m = microbatches
    if schedule == "interleaved":
        return _interleaved_actions(pp_rank, pp, m, virtual_stages)
    warmup = m if schedule == "gpipe" else min(m, pp - pp_rank)
    out = [("F", 0, k) for k in range(warmup)]
    forwards = warmup
    for k in range(m):
        out.append(("B", 0, k))
        if forwards < m:
            out.append(("F", 0, forwards))
            forwards += 1
    return out


def _interleaved_actions(pp_rank: int, pp: int, m: int, v: int) -> list[tuple[str, int, int]]:
    per_round = m // max(1, m // pp)
    total = m * v
    warmup = min(total, (v - 1) * per_round + 2 * (pp - 1 - pp_rank))
    next_mb = {"F": [0] * v, "B": [0] * v}
    out: list[tuple[str, int, int]] = []

    def take(kind: str, chunk: int) -> None:
        out.append((kind, chunk, next_mb[kind][chunk]))
        next_mb[kind][chunk] += 1

    for op in range(total):  # warm-up forwards, then forward / backward pairs
        take("F", (op // per_round) % v)
        if op >= warmup:
            take("B", v - 1 - ((op - warmup) // per_round) % v)
    for op in range(total, total + warmup):  # the remaining backwards
        take("B", v - 1 - ((op - warmup) // per_round) % v)
    return out


class _RankStages(nn.Module):
    """The pruned copy (registered, so the traced step holds exactly the rank's parameters) and its stages."""

    def __init__(self, lightning_module: nn.Module, stages: list[StageModule]) -> None:
        super().__init__()
        self.lightning_module = lightning_module
        self.stages = nn.ModuleList(stages)


def _replay(
    actions: list[tuple[str, int, int]],
    microbatches: int,
    hidden: int,
    split: Callable[[Any], tuple[torch.Tensor, torch.Tensor]],
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Callable[[nn.Module, Any], torch.Tensor]:
    """The traced step's ``loss_fn``: runs every forward and backward of the rank in order (a received
    activation or gradient is made where the schedule receives one) and returns a zero loss whose own
    backward does nothing, so the gradients are the replay's."""

    def run(module: nn.Module, batch: Any) -> torch.Tensor:
        stages: list[Any] = list(getattr(module, "stages"))  # noqa: B009 - nn.Module attributes type as Tensor
        inputs, targets = split(batch)
        xs, ys = inputs.tensor_split(microbatches), targets.tensor_split(microbatches)
        dtype = next(p.dtype for p in module.parameters() if p.is_floating_point())
        held: dict[tuple[int, int], tuple[Any, ...]] = {}
        for kind, chunk, mb in actions:
            stage = stages[chunk]
            if kind == "F":
                x = xs[mb] if stage.is_first else torch.randn(
                    *xs[mb].shape[:2], hidden, dtype=dtype, requires_grad=True)
                out = stage(x)
                # the stage keeps its input and output until the backward (PipelineStage's fwd_cache)
                held[chunk, mb] = (x, out, loss_of(out, ys[mb]) if stage.is_last else None)
                del x, out
                continue
            x, out, loss = held.pop((chunk, mb))
            if loss is not None:
                loss.backward()
            else:
                out.backward(torch.randn_like(out))  # the gradient received from the next stage
            del x, out, loss
        return torch.zeros((), requires_grad=True)

    return run


def trace_pipeline_rank(
    plain: nn.Module,
    *,
    pp_rank: int,
    pp: int,
    microbatches: int,
    schedule: str,
    virtual_stages: int,
    batch_fn: Callable[[int, int], Any],
    batch: int,
    seq_len: int,
    hidden: int,
    vocab_size: int | None,
    optimizer: Any,
    precision: str,
    wrap_loss: Callable[[Callable[[nn.Module, Any], Any]], Callable[[nn.Module, Any], Any]] | None = None,
) -> MemoryEstimate:
    """The traced per-rank peak of pipeline rank ``pp_rank`` (a :class:`MemoryEstimate`, ``source="traced"``).

    Args:
        plain: the module's meta copy (with the plan's activation checkpointing); it is pruned in place.
        pp_rank, pp, microbatches, schedule, virtual_stages: the rank and the plan's pipeline.
        batch_fn: ``(b, s) -> batch`` with the dataloader batch's structure; ``batch``, ``seq_len``: the
            per-rank dataloader batch the schedule splits into ``microbatches``.
        hidden: the width of the activations passed between stages.
        vocab_size: the vocabulary (the tracker's logits rule).
        optimizer, precision: as :func:`~lightning_memplan.tracking.trace.trace_memory` takes them.
        wrap_loss: wraps the replay (the traced step's ``loss_fn``), e.g.
            :func:`~lightning_memplan.tracking.fake_fidelity.readable_scalars`.

    Raises:
        ValueError: more than :data:`MAX_REPLAYED_ACTIONS` computations, no pipeline contract for the
            module, or a trace that fails.
    """
    from lightning_memplan.tracking.trace import trace_memory

    v = virtual_stages if schedule == "interleaved" else 1
    if 2 * microbatches * v > MAX_REPLAYED_ACTIONS:
        raise ValueError(f"{2 * microbatches * v} computations per step is more than the {MAX_REPLAYED_ACTIONS} "
                         "a traced pipeline step replays")
    layout = find_layout(plain)
    if layout is None:
        raise ValueError(f"{type(plain).__name__} has no list of repeated blocks to cut into stages")
    stages = prune_to_stages(layout, stage_indices(pp_rank, pp, v), pp * v)
    module = _RankStages(plain, stages)
    split = getattr(plain, "pipeline_batch", None) or _default_batch
    loss_of = getattr(plain, "pipeline_loss", None) or _default_loss
    replay = _replay(rank_actions(pp_rank, pp, microbatches, schedule, v), microbatches, hidden, split, loss_of)
    result = trace_memory(
        module, batch_shape=(batch, seq_len), input_fn=batch_fn, loss_fn=wrap_loss(replay) if wrap_loss else replay,
        optimizer=optimizer, precision=precision, seq_len=seq_len, vocab_size=vocab_size,
        grads_alive_in_forward=False,
    )
    if result.mode != "fake":
        raise ValueError(f"the fake-tensor step failed ({result.fallback_reason})")
    return result.estimate

