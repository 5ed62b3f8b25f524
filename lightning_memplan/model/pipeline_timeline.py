"""What one pipeline rank holds at each of its backwards in a step: the schedule's op order, replayed.

The closed form :func:`lightning_memplan.model.terms.pipeline_inflight_microbatches` gives the most
micro-batches a rank holds. Which gradients exist next to them depends on the order of the
backwards. Each local chunk's gradients appear at that chunk's first backward of the step (the
previous step's were dropped before the schedule ran). So this module replays the rank's op order, as
PyTorch's schedules issue it, and gives for every backward the forwards still held per local chunk,
the chunk being backpropagated, and which chunks already have gradients.

Orders (torch 2.13 ``torch/distributed/pipelining/schedules.py``):

- GPipe (``ScheduleGPipe``): all ``m`` forwards, then all ``m`` backwards.
- 1F1B (``Schedule1F1B``): ``min(m, p - i)`` warm-up forwards on rank i, then backward / forward
  pairs ("1B1F") while forwards remain, then the remaining backwards.
- Interleaved 1F1B (``ScheduleInterleaved1F1B._calculate_single_rank_operations`` with
  ``_get_warmup_ops`` and ``_get_1f1b_rank_ops``): ``min(m v, (v-1) r + 2 (p-1-i))`` warm-up forwards
  (r micro-batches per round, ``m // max(1, m // p)``), then forward / backward pairs, then the
  remaining backwards; forward k runs local chunk ``(k // r) mod v``, backward k local chunk
  ``v - 1 - (k // r) mod v`` [N21 section 2.2.2].

Written here rather than read from torch: the schedule classes need a process group and stages to
build their op lists; the estimate must run anywhere, for any p, m and v.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

__all__ = ["BackwardMoment", "StageMoment", "backward_moments", "stage_moments"]


class BackwardMoment(NamedTuple):
    """One backward of a rank's step, just before it runs."""

    held: tuple[int, ...]
    """Per local chunk: micro-batches whose forward ran and whose backward has not (this one included)."""
    chunk: int
    """The local chunk this backward runs (0 .. v-1; v-1 holds the loss on the last rank)."""
    done: tuple[bool, ...]
    """Per local chunk: whether its gradients exist already (an earlier backward of the step ran it)."""


@functools.lru_cache(maxsize=1024)
def backward_moments(stage: int, p: int, m: int, schedule: str, v: int = 1) -> tuple[BackwardMoment, ...]:
    """Every backward of rank ``stage`` in one step of ``schedule`` with ``p`` ranks, ``m``
    micro-batches and ``v`` local chunks (``v`` counts only for ``"interleaved"``)."""
    chunks = v if schedule == "interleaved" else 1
    total = m * chunks
    if schedule == "gpipe":
        warmup, fwd_chunk, bwd_chunk = total, (lambda k: 0), (lambda k: 0)
    elif schedule == "interleaved":
        per_round = m // max(1, m // p)
        warmup = min(total, (chunks - 1) * per_round + 2 * (p - 1 - stage))

        def fwd_chunk(k: int) -> int:
            return (k // per_round) % chunks

        def bwd_chunk(k: int) -> int:
            return chunks - 1 - (k // per_round) % chunks
    else:  # 1f1b: warm-up forwards, then "1B1F"; the same held counts as forward/backward pairs
        warmup, fwd_chunk, bwd_chunk = min(m, p - stage), (lambda k: 0), (lambda k: 0)
        warmup -= 1 if warmup < total else 0  # the pair loop's forward is the last warm-up one
    held = [0] * chunks
    done = [False] * chunks
    moments: list[BackwardMoment] = []
    forwards = 0

    def forward() -> None:
        nonlocal forwards
        held[fwd_chunk(forwards)] += 1
        forwards += 1

    def backward(k: int) -> None:
        chunk = bwd_chunk(k)
        moments.append(BackwardMoment(held=tuple(held), chunk=chunk, done=tuple(done)))
        held[chunk] -= 1
        done[chunk] = True

    for _ in range(warmup):
        forward()
    for k in range(total):
        if forwards < total:
            forward()
        backward(k)
    return tuple(moments)


class StageMoment(NamedTuple):
    """A backward of a rank's step in the memory model's units: micro-batches of the whole stage's
    activations, and fractions of the stage's gradients."""

    inflight: float
    """Stage activations held when the backward starts, in micro-batches (Σ_c held_c · w_c)."""
    inflight_after: float
    """The same once it has run (its chunk's micro-batch freed)."""
    inflight_head: float
    """Micro-batches the loss side (final norm, lm_head input, logits) is held for, on the last rank."""
    loss_backward: bool
    """Whether this backward runs the loss's (the last local chunk's, on the last rank)."""
    grads_before: float
    """Fraction of the stage's gradients that exist when it starts."""
    grads_after: float
    """Fraction that exist once it has run."""


@functools.lru_cache(maxsize=4096)
def stage_moments(
    stage: int,
    p: int,
    m: int,
    schedule: str,
    v: int,
    acts_share: tuple[float, ...],
    grads_share: tuple[float, ...],
    has_head: bool,
) -> tuple[StageMoment, ...]:
    """:func:`backward_moments` weighted by each local chunk's share of the stage's activations and
    gradients (``acts_share``, ``grads_share``: one entry per local chunk, each summing to 1), without
    the moments another one dominates (no more of anything than it, so never the larger)."""
    chunks = len(acts_share)
    out: set[StageMoment] = set()
    for mom in backward_moments(stage, p, m, schedule, v if chunks > 1 else 1):
        before = sum((share for share, done in zip(grads_share, mom.done, strict=True) if done), 0.0)
        after = before + (0.0 if mom.done[mom.chunk] else grads_share[mom.chunk])
        held = sum(n * share for n, share in zip(mom.held, acts_share, strict=True))
        head = mom.chunk == chunks - 1
        out.add(
            StageMoment(
                inflight=held,
                inflight_after=held - acts_share[mom.chunk],
                inflight_head=float(mom.held[-1]) if has_head else 0.0,
                loss_backward=has_head and head,
                grads_before=before,
                grads_after=min(after, 1.0),
            )
        )

    def covers(a: StageMoment, b: StageMoment) -> bool:
        return a != b and all(x >= y for x, y in zip(a, b, strict=True))

    kept = [mom for mom in out if not any(covers(other, mom) for other in out)]
    return tuple(sorted(kept))
