"""Collect every rank's figures onto every rank at the end of an epoch.

Lightning's ``strategy.all_gather`` moves tensors only; a rank's summary is a nested dict, so this uses
``torch.distributed.all_gather_object`` on the default process group (the world group of DDP, FSDP and
ModelParallelStrategy alike). Without an initialised process group there is one rank and nothing to
gather.
"""

from __future__ import annotations

from typing import Any

from lightning_memplan.report.records import RankSummary

__all__ = ["gather_objects", "gather_summaries"]


def gather_objects(obj: Any) -> list[Any]:
    """``[obj_rank0, obj_rank1, ...]``: every rank's picklable ``obj`` (a collective: call it on all
    ranks); ``[obj]`` without an initialised process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def gather_summaries(summary: RankSummary) -> tuple[RankSummary, ...]:
    """Every rank's ``summary``, sorted by rank (a collective: call it on all ranks)."""
    summaries = [RankSummary.from_dict(d) for d in gather_objects(summary.to_dict())]
    return tuple(sorted(summaries, key=lambda s: s.rank))
