"""Whether a pipeline schedule can run a dataloader batch: the one rule the planner's search and
memplan_auto's setup both apply, and ``estimate_memory``'s plan check (pure: sizes in, a reason or
``None`` out). It lives in the model layer so that the estimate and the planner above it read one rule.

A Trainer's dataloader fixes the per-rank batch B. Under pipeline parallelism the schedule splits it
into ``m`` micro-batches along the batch dimension (``torch.distributed.pipelining``'s
``TensorChunkSpec(0)``), so B must be a multiple of m, and torch's schedules add their own rules
(``torch/distributed/pipelining/schedules.py``, torch 2.13):

* ``Schedule1F1B.__init__`` raises unless ``m >= pp`` ("Number of microbatches (m) must be greater than
  or equal to the number of stages (pp)");
* ``ScheduleInterleaved1F1B`` runs ``max(1, m // pp)`` rounds and raises unless m is a multiple of the
  round count; the planner asks more, Megatron-LM's ``m % pp == 0`` (Narayanan et al. 2021, arXiv
  2104.04473, section 2.2), which satisfies torch's rule;
* ``ScheduleGPipe`` runs any ``m >= 1``.
"""

from __future__ import annotations

__all__ = ["pipeline_schedule_blocker", "runnable_microbatches"]


def pipeline_schedule_blocker(*, pp: int, schedule: str, microbatches: int, batch: int | None) -> str | None:
    """Why ``schedule`` with ``microbatches`` micro-batches cannot run a per-rank batch of ``batch``
    sequences over ``pp`` stages (``None`` when it can; ``batch=None``: the batch is not known yet).

    >>> pipeline_schedule_blocker(pp=2, schedule="1f1b", microbatches=1, batch=4)
    '1f1b needs microbatches >= pp (torch Schedule1F1B): microbatches=1 < pp=2'
    """
    if pp == 1:
        return None
    if microbatches < 1:
        return f"microbatches={microbatches} must be >= 1"
    if batch is not None and batch % microbatches:
        return f"the per-rank batch {batch} is not divisible by microbatches={microbatches}"
    if schedule == "1f1b" and microbatches < pp:
        return f"1f1b needs microbatches >= pp (torch Schedule1F1B): microbatches={microbatches} < pp={pp}"
    if schedule == "interleaved" and microbatches % pp:
        return (
            f"the interleaved schedule needs microbatches to be a multiple of pp (Megatron-LM): "
            f"microbatches={microbatches}, pp={pp}"
        )
    return None


def runnable_microbatches(*, pp: int, schedule: str, batch: int) -> int | None:
    """The smallest micro-batch count that :func:`pipeline_schedule_blocker` accepts for ``batch``
    (``None`` when no divisor of ``batch`` does); the fewest micro-batches keep each one largest."""
    for m in range(1, batch + 1):
        if batch % m == 0 and pipeline_schedule_blocker(pp=pp, schedule=schedule, microbatches=m, batch=batch) is None:
            return m
    return None
