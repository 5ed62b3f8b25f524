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
import operator
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
    interleaved = schedule == "interleaved"
    chunks = v if interleaved else 1
    total = m * chunks
    per_round = m // max(1, m // p)  # interleaved: micro-batches per round before the chunk changes
    if schedule == "gpipe":
        warmup = total
    elif interleaved:
        warmup = min(total, (chunks - 1) * per_round + 2 * (p - 1 - stage))
    else:  # 1f1b: warm-up forwards, then "1B1F"; the same held counts as forward/backward pairs
        warmup = min(m, p - stage)
        warmup -= 1 if warmup < total else 0  # the pair loop's forward is the last warm-up one
    # forward k runs local chunk (k // r) mod v, backward k chunk v - 1 - (k // r) mod v (one chunk unless
    # interleaved); written as one loop, the planner replays many schedules
    held = [0] * chunks
    done = [False] * chunks
    done_now = tuple(done)
    moments: list[BackwardMoment] = []
    forwards = 0
    for k in range(-warmup, total):
        if forwards < total:  # the warm-up forwards (k < 0), then one before each backward while any remain
            held[(forwards // per_round) % chunks if interleaved else 0] += 1
            forwards += 1
        if k < 0:
            continue
        chunk = chunks - 1 - (k // per_round) % chunks if interleaved else 0
        moments.append(BackwardMoment(tuple(held), chunk, done_now))
        held[chunk] -= 1
        if not done[chunk]:
            done[chunk] = True
            done_now = tuple(done)
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
    if len(grads_share) != chunks:
        raise ValueError(f"acts_share={acts_share!r} and grads_share={grads_share!r} must have one entry per local chunk")
    out: set[StageMoment] = set()
    before_of: dict[tuple[bool, ...], float] = {}  # gradients alive, per set of done chunks (at most v + 1)
    # (a steady 1F1B phase repeats one backward state m - p times: each distinct state is weighted once)
    for held_n, chunk, done in set(backward_moments(stage, p, m, schedule, v if chunks > 1 else 1)):
        before = before_of.get(done)
        if before is None:
            before = before_of[done] = sum((share for share, d in zip(grads_share, done, strict=True) if d), 0.0)
        after = before if done[chunk] else before + grads_share[chunk]
        held = sum(map(operator.mul, held_n, acts_share))  # sum_c held_c * share_c, in chunk order
        out.add(StageMoment(  # inflight, inflight_after, inflight_head, loss_backward, grads_before, grads_after
            held, held - acts_share[chunk], float(held_n[-1]) if has_head else 0.0,
            has_head and chunk == chunks - 1, before, min(after, 1.0),
        ))

    # The moments no other covers (>= in every field, not equal). A cover is larger in the lexicographic
    # order too, so in descending order each moment is checked against the kept ones before it only: a
    # cover that was dropped is itself covered by a kept one (transitivity), which then covers this one.
    kept: list[StageMoment] = []
    for cand in sorted(out, reverse=True):
        if not any(all(x >= y for x, y in zip(k, cand, strict=True)) for k in kept):
            kept.append(cand)
    return tuple(sorted(kept))
