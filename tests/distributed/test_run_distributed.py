"""The multi-process test harness itself: results per rank, a failing rank's traceback, a taken port."""

from __future__ import annotations

import socket

import pytest

from lightning_memplan.testing import distributed as harness

pytestmark = pytest.mark.distributed


def _rank_and_sum(rank: int, world: int) -> tuple[int, float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, float(t.item())


def _fails_on_rank1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one says no")
    return rank


def test_results_come_back_per_rank_after_a_taken_port_is_retried(monkeypatch):
    busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    taken = busy.getsockname()[1]
    ports = iter([taken])
    picked: list[int] = []
    free_port = harness.find_free_port

    def pick() -> int:
        port = next(ports, None) or free_port()
        picked.append(port)
        return port

    monkeypatch.setattr(harness, "find_free_port", pick)
    try:
        results = harness.run_distributed(_rank_and_sum, 2, timeout_s=60)
    finally:
        busy.close()
    assert results == [(0, 3.0), (1, 3.0)]
    assert picked[0] == taken and len(picked) == 2


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1: ValueError: rank one says no.*_fails_on_rank1"):
        harness.run_distributed(_fails_on_rank1, 2, timeout_s=60)
