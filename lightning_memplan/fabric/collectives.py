"""Move small JSON-able objects between ranks with Fabric's own tensor collectives.

``fabric.broadcast`` and ``torch.distributed.all_gather_object`` pickle what they move (and unpickle
what arrives); the monitor's per-rank summaries are plain JSON, so each rank encodes its object as UTF-8
JSON bytes in a ``uint8`` tensor, the lengths are gathered first, every rank pads to the longest, and
``fabric.all_gather`` moves the bytes. Nothing is unpickled. Tensors live on ``fabric.device`` (NCCL
needs CUDA tensors; gloo takes CPU ones).
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import torch

__all__ = ["broadcast_json", "gather_json"]


def gather_json(fabric: Any, obj: Any) -> list[Any]:
    """``[obj_rank0, obj_rank1, ...]`` (a collective: every rank calls it); JSON round-tripped, so tuples
    come back as lists. ``[obj]`` on one process."""
    if int(fabric.world_size) == 1:
        return [obj]
    with warnings.catch_warnings():
        # Fabric's all_gather goes through torch.distributed.nn.functional.all_gather, which warns that it
        # is deprecated on every call; the collective itself is what Fabric provides, so say nothing.
        warnings.filterwarnings("ignore", message=r".*all_gather is deprecated.*")
        return _gather(fabric, obj)


def _gather(fabric: Any, obj: Any) -> list[Any]:
    data = torch.frombuffer(bytearray(json.dumps(obj).encode("utf-8")), dtype=torch.uint8)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=fabric.device)
    lengths = fabric.all_gather(length).reshape(-1).tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=fabric.device)
    padded[: data.numel()] = data.to(fabric.device)
    rows = fabric.all_gather(padded).reshape(len(lengths), -1).cpu()
    return [json.loads(bytes(rows[i, :n].tolist()).decode("utf-8")) for i, n in enumerate(lengths)]


def broadcast_json(fabric: Any, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (a collective)."""
    return gather_json(fabric, obj)[0]
