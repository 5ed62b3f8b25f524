"""The replayed pipeline order against torch's own interleaved schedule and the closed forms."""

from __future__ import annotations

import pytest
import torch

from lightning_memplan.model import terms
from lightning_memplan.model.pipeline_timeline import backward_moments, stage_moments

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


class _FakeStage:
    """What ``ScheduleInterleaved1F1B`` reads from its stages to build the per-rank op lists."""

    def __init__(self, index: int, n_stages: int, rank: int, size: int) -> None:
        self.stage_index, self.num_stages, self.group_rank, self.group_size = index, n_stages, rank, size
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.submod = torch.nn.Linear(1, 1)
        self.has_backward = True
        self.stage_index_to_group_rank = {i: i % size for i in range(n_stages)}


def _torch_moments(p: int, m: int, v: int, rank: int) -> list[tuple[tuple[int, ...], int, tuple[bool, ...]]]:
    """Replay torch's own op list for ``rank``: (held per local chunk, chunk, done) at each backward."""
    stages = [_FakeStage(rank + c * p, p * v, rank, p) for c in range(v)]
    order = [a for a in schedules.ScheduleInterleaved1F1B(stages, n_microbatches=m).pipeline_order[rank] if a]
    held, done, out = [0] * v, [False] * v, []
    for action in order:
        chunk = action.stage_index // p
        if action.computation_type == schedules._ComputationType.FORWARD:
            held[chunk] += 1
        else:
            out.append((tuple(held), chunk, tuple(done)))
            held[chunk] -= 1
            done[chunk] = True
    return out


@pytest.mark.parametrize(("p", "m", "v"), [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (3, 6, 2), (2, 6, 3)])
def test_interleaved_order_is_torchs(p, m, v):
    for rank in range(p):
        ours = [(mom.held, mom.chunk, mom.done) for mom in backward_moments(rank, p, m, "interleaved", v)]
        assert ours == _torch_moments(p, m, v, rank), (p, m, v, rank)


@pytest.mark.parametrize(("p", "m", "v"), [(2, 2, 2), (4, 8, 2), (4, 16, 2), (8, 16, 4)])
def test_interleaved_peak_matches_the_closed_form(p, m, v):
    for rank in range(p):
        most = max(sum(mom.held) for mom in backward_moments(rank, p, m, "interleaved", v))
        assert most / v == pytest.approx(terms.pipeline_inflight_microbatches(rank, p, m, "interleaved", v))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("p", "m"), [(2, 1), (2, 2), (4, 2), (4, 8), (8, 32)])
def test_single_chunk_schedules(schedule, p, m):
    for rank in range(p):
        moms = backward_moments(rank, p, m, schedule)
        assert len(moms) == m
        assert max(mom.held[0] for mom in moms) == terms.pipeline_inflight_microbatches(rank, p, m, schedule)
        assert [mom.done[0] for mom in moms] == [False] + [True] * (m - 1)  # gradients from the first backward on
        assert moms[-1].held == (1,)


def test_weighted_moments_keep_the_latest_full_and_the_tail():
    # last rank of p=2, v=2, m=2: [c1 c1 c3 | B c3 | c3 | B c3 | B c1 | B c1]
    moms = stage_moments(1, 2, 2, "interleaved", 2, (0.5, 0.5), (0.25, 0.75), True)
    full = max(moms, key=lambda mom: mom.inflight)
    assert full.inflight == 1.5 and full.grads_before == 0.75 and full.loss_backward  # c3's gradients only
    assert any(mom.grads_before == 1.0 for mom in moms)  # the last backward, every gradient alive
    for a in moms:  # none dominated by another
        assert not any(b != a and all(x >= y for x, y in zip(b, a, strict=True)) for b in moms)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_moments_are_exactly_the_undominated_backwards(schedule):
    """stage_moments keeps every backward state no other covers and nothing else: the pairwise filter
    over all of :func:`backward_moments`, weighted, is the reference (stage_moments checks each state
    against the kept ones only, in descending order)."""
    from lightning_memplan.model.pipeline_timeline import StageMoment

    for p, m in ((2, 3), (4, 8), (4, 16), (8, 32)):
        for v in ((2, 3) if schedule == "interleaved" else (1,)):
            chunks = v if schedule == "interleaved" else 1
            acts = tuple((c + 1) / sum(range(1, chunks + 1)) for c in range(chunks))  # unequal chunks
            grads = acts[::-1]
            for stage in range(p):
                has_head = stage == p - 1
                weighted = set()
                for mom in backward_moments(stage, p, m, schedule, v):
                    before = sum((g for g, done in zip(grads, mom.done, strict=True) if done), 0.0)
                    after = before + (0.0 if mom.done[mom.chunk] else grads[mom.chunk])
                    held = sum(n * a for n, a in zip(mom.held, acts, strict=True))
                    weighted.add(StageMoment(held, held - acts[mom.chunk], float(mom.held[-1]) if has_head else 0.0,
                                             has_head and mom.chunk == chunks - 1, before, min(after, 1.0)))
                ref = sorted(a for a in weighted
                             if not any(b != a and all(x >= y for x, y in zip(b, a, strict=True)) for b in weighted))
                assert list(stage_moments(stage, p, m, schedule, v, acts, grads, has_head)) == ref
