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

__all__ = ["MAX_LISTED_BACKWARDS", "BackwardMoment", "StageMoment", "backward_moments", "stage_moments"]


class BackwardMoment(NamedTuple):
    """One backward of a rank's step, just before it runs."""

    held: tuple[int, ...]
    """Per local chunk: micro-batches whose forward ran and whose backward has not (this one included)."""
    chunk: int
    """The local chunk this backward runs (0 .. v-1; v-1 holds the loss on the last rank)."""
    done: tuple[bool, ...]
    """Per local chunk: whether its gradients exist already (an earlier backward of the step ran it)."""


#: Most backwards :func:`backward_moments` lists (``m * v``): it returns one entry per backward, so its size is
#: the user's micro-batch count. The estimate never needs the list: :func:`stage_moments` replays a bounded
#: part of the step (see :func:`_replay`) for any ``m``.
MAX_LISTED_BACKWARDS = 2**16


def _forwards_before(n: int, chunk: int, per_round: int, chunks: int) -> int:
    """Forwards of local ``chunk`` among the first ``n`` of an interleaved rank (forward j runs chunk
    ``(j // r) mod v``): ``r`` per full round of ``r v`` forwards, then the part of the last round."""
    period = per_round * chunks
    return per_round * (n // period) + min(per_round, max(0, n % period - chunk * per_round))


def _replay(stage: int, p: int, m: int, schedule: str, v: int, *, bounded: bool) -> list[BackwardMoment]:
    """The rank's backwards in order; with ``bounded``, only enough of them for their undominated set.

    The warm-up forwards are counted in closed form (:func:`_forwards_before`). ``bounded`` skips two kinds
    of backward, so its cost is ``O(p v)`` whatever ``m`` (the proof is the docstring of
    :func:`stage_moments`; ``tests/unit/test_bounded_time.py`` checks it against the full replay):

    - steady phase (a forward before each backward): the held counts at backward ``k`` are
      ``F_c(k + warmup) - B_c(k)`` (forwards and backwards of chunk c so far), and both counts grow by
      exactly ``r`` per chunk every ``r v`` backwards (one chunk: every backward), so from the second full
      period on (every chunk's gradients exist) the states repeat with period ``r v``. Whole periods are
      skipped once one has been replayed.
    - cool-down (no forward left) once every chunk's gradients exist: each backward only frees, so a later
      backward of a chunk holds no more of anything than an earlier one of the same chunk. The replay stops
      once every chunk has had one such backward.
    """
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
    if interleaved:
        held = [_forwards_before(warmup, c, per_round, chunks) for c in range(chunks)]
    else:
        held = [warmup]
    period = per_round * chunks if interleaved else 1
    steady_end = total - warmup  # backwards 0 .. steady_end - 1 each follow a forward
    done = [False] * chunks
    done_now = tuple(done)
    moments: list[BackwardMoment] = []
    cooled: set[int] = set()  # chunks with a cool-down backward after every chunk's gradients exist
    forwards = warmup
    k = 0
    while k < total:
        if k < steady_end:
            if bounded and k >= 2 * period:  # states from here repeat those of the last period
                skip = (steady_end - k) // period * period
                if skip:
                    k += skip
                    forwards += skip
                    continue
            held[(forwards // per_round) % chunks if interleaved else 0] += 1
            forwards += 1
        chunk = chunks - 1 - (k // per_round) % chunks if interleaved else 0
        moments.append(BackwardMoment(tuple(held), chunk, done_now))
        if bounded and k >= steady_end and all(done):
            cooled.add(chunk)
            if len(cooled) == chunks:
                break
        held[chunk] -= 1
        if not done[chunk]:
            done[chunk] = True
            done_now = tuple(done)
        k += 1
    return moments


@functools.lru_cache(maxsize=1024)
def backward_moments(stage: int, p: int, m: int, schedule: str, v: int = 1) -> tuple[BackwardMoment, ...]:
    """Every backward of rank ``stage`` in one step of ``schedule`` with ``p`` ranks, ``m``
    micro-batches and ``v`` local chunks (``v`` counts only for ``"interleaved"``).

    Raises:
        ValueError: more than :data:`MAX_LISTED_BACKWARDS` backwards (``m * v``) to list.
    """
    listed = m * (v if schedule == "interleaved" else 1)
    if listed > MAX_LISTED_BACKWARDS:
        raise ValueError(
            f"m={m!r} micro-batches (x v={v!r} chunks) is more than the {MAX_LISTED_BACKWARDS} backwards "
            "backward_moments lists (one entry each); use stage_moments, which answers for any m"
        )
    return tuple(_replay(stage, p, m, schedule, v, bounded=False))


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
    gradients (``acts_share``, ``grads_share``: one entry per local chunk, each summing to 1, none
    negative), without the moments another one dominates (no more of anything than it, so never the
    larger).

    Bounded time for any ``m``: the backwards are replayed by ``_replay(..., bounded=True)``, a subset of
    them that holds every undominated one, so the result is the same as over all of them. The subset
    leaves out (a) steady-phase backwards whose (held, chunk, done) state is one already replayed (the
    states repeat with period ``r v`` once every chunk's gradients exist), so their moments are in the set
    already; (b) cool-down backwards, once every chunk's gradients exist, of a chunk that had an earlier
    such backward ``j``. Between ``j`` and a later ``k`` only backwards run, so ``held_k <= held_j`` per
    chunk, hence ``inflight`` (a sum of non-negative terms, float addition being monotone) and
    ``inflight_head`` are no larger; ``inflight_after = inflight - share[chunk]`` with the same chunk is no
    larger; ``loss_backward`` is the same (same chunk); and both gradient fractions are equal (every chunk
    done). So ``k``'s moment is covered by ``j``'s or equal to it: the undominated set does not change.
    """
    chunks = len(acts_share)
    if len(grads_share) != chunks:
        raise ValueError(f"acts_share={acts_share!r} and grads_share={grads_share!r} must have one entry per local chunk")
    out: set[StageMoment] = set()
    before_of: dict[tuple[bool, ...], float] = {}  # gradients alive, per set of done chunks (at most v + 1)
    # (a steady 1F1B phase repeats one backward state m - p times: each distinct state is weighted once)
    for held_n, chunk, done in set(_replay(stage, p, m, schedule, v if chunks > 1 else 1, bounded=True)):
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
