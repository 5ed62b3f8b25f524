"""One rule for which pipeline schedules run: ``estimate_memory`` refuses a plan whose schedule cannot
run its micro-batches, and the planner's search never yields one.

The independent reference is torch's own schedule constructor (``torch.distributed.pipelining``
``Schedule1F1B.__init__`` raises unless ``n_microbatches >= num_stages``; ``ScheduleGPipe`` runs any
count): the memory model accepts a (pp, schedule, m) exactly when torch does.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from lightning_memplan.hardware import HardwareSpec
from lightning_memplan.model import estimate_memory
from lightning_memplan.model.runnable import pipeline_schedule_blocker
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.planning import plan
from lightning_memplan.planning.space import Allow, enumerate_layouts

MODEL = ModelSpec(6, 64, 4, 128)
TRAIN = TrainSpec(micro_batch=2, seq_len=32)


def _torch_accepts(schedule: str, pp: int, m: int) -> bool:
    """Whether torch's schedule constructor takes ``m`` micro-batches over ``pp`` stages (a stand-in
    stage: the constructors read only its stage count and index before their checks)."""
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe

    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    stage = SimpleNamespace(num_stages=pp, stage_index=0, group_rank=0, group_size=pp, is_first=True, is_last=False)
    try:
        cls(stage, m)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("pp", [2, 3, 4, 6])
def test_estimate_accepts_exactly_the_schedules_torch_runs(pp):
    for schedule in ("1f1b", "gpipe"):
        for m in range(1, pp + 2):
            runs = _torch_accepts(schedule, pp, m)
            plan_ = ParallelPlan(pp=pp, microbatches=m, schedule=schedule)
            if runs:
                assert estimate_memory(MODEL, TRAIN, plan_).total > 0
                continue
            with pytest.raises(ValueError) as exc:
                estimate_memory(MODEL, TRAIN, plan_, rank=0)
            text = str(exc.value)
            # names the plan, the rule and both fixes: more micro-batches, or GPipe (which runs this m)
            assert f"microbatches={m} < pp={pp}" in text and f"microbatches>={pp}" in text
            assert "schedule='gpipe'" in text and _torch_accepts("gpipe", pp, m)


def test_default_microbatches_is_refused_with_pp():
    """``ParallelPlan(pp=4)`` keeps the default ``microbatches=1``: the estimate says so instead of
    modelling a run torch refuses (memplan_auto replaces the default at setup, before estimating)."""
    with pytest.raises(ValueError, match=r"microbatches=1 < pp=4.*microbatches>=4"):
        estimate_memory(MODEL, TRAIN, ParallelPlan(pp=4))


def _assert_runnable(p: ParallelPlan) -> None:
    if p.pp > 1:
        reason = pipeline_schedule_blocker(pp=p.pp, schedule=p.schedule, microbatches=p.microbatches, batch=None)
        assert reason is None, f"{p.describe()}: {reason}"
        if p.schedule in ("1f1b", "gpipe"):
            assert _torch_accepts(p.schedule, p.pp, p.microbatches), p.describe()


def test_search_space_holds_only_runnable_schedules_exhaustive():
    """Every layout of every small world, layer count and per-replica batch, with and without a
    global batch: what the search enumerates runs; what it drops is recorded with the rule."""
    seen_rejected = 0
    for layers in (1, 2, 3, 4, 6, 8):
        model = ModelSpec(layers, 64, 4, 128)
        for world in range(1, 9):
            for b, acc in ((1, 1), (1, 2), (2, 1), (1, 3), (4, 1), (2, 4)):
                train = TrainSpec(micro_batch=b, seq_len=32, grad_accumulation=acc)
                for gb in (None, world, 2 * world):
                    layouts, rejected = enumerate_layouts(model, train, world, Allow(), gb)
                    for lc in layouts:
                        if lc.pp > 1:
                            _assert_runnable(ParallelPlan(lc.dp, lc.tp, lc.pp, lc.cp, microbatches=lc.m,
                                                          schedule=lc.schedule, virtual_stages=lc.v))
                    for r in (r for r in rejected if r[1] == "schedule"):
                        seen_rejected += 1
                        assert "microbatches" in r[2]
    assert seen_rejected > 0  # the small batches do reach the rule


def test_only_1f1b_and_too_few_microbatches_is_refused_with_the_rule():
    hw = HardwareSpec.preset("l4", gpus_per_node=4)
    with pytest.raises(ValueError, match=r"1f1b needs microbatches >= pp.*microbatches=1 < pp=4"):
        plan(MODEL, TrainSpec(micro_batch=1, seq_len=32), hw, allow={"pp": [4], "schedule": ["1f1b"]})
    # GPipe runs one micro-batch over four stages: with it allowed, the planner chooses it
    d = plan(MODEL, TrainSpec(micro_batch=1, seq_len=32), hw, allow={"pp": [4]})
    assert (d.plan.pp, d.plan.schedule, d.plan.microbatches) == (4, "gpipe", 1)
    assert any(r.kind == "schedule" and "1f1b" in r.layout for r in d.rejected)


hyp = pytest.importorskip("hypothesis")
st = hyp.strategies


@hyp.settings(max_examples=30 * int(os.environ.get("MEMPLAN_HYPOTHESIS_SCALE", "1")))
@hyp.given(
    layers=st.integers(1, 8), heads=st.sampled_from([1, 2, 4]), gpn=st.sampled_from([1, 2, 4, 8]),
    nodes=st.integers(1, 2), micro_batch=st.integers(1, 4), acc=st.integers(1, 3),
    per_gpu=st.sampled_from([None, 1, 2, 3]), budget=st.sampled_from([None, 200_000, 2_000_000, 50_000_000]),
    schedule=st.sets(st.sampled_from(["gpipe", "1f1b", "interleaved"]), min_size=1),
)
def test_plan_never_returns_an_unrunnable_schedule(layers, heads, gpn, nodes, micro_batch, acc, per_gpu, budget, schedule):
    model = ModelSpec(layers, 16 * heads, heads, 128)
    hw = HardwareSpec.preset("h100-sxm", gpus_per_node=gpn, num_nodes=nodes)
    train = TrainSpec(micro_batch=micro_batch, seq_len=32, grad_accumulation=acc)
    gb = None if per_gpu is None else per_gpu * hw.world_size
    try:
        d = plan(model, train, hw, global_batch=gb, memory_budget=budget, allow={"schedule": sorted(schedule)})
    except ValueError as exc:  # only "no layout": every message names its rule
        assert "admits no" in str(exc) or "not divisible" in str(exc), exc
        return
    for p, t in ((d.plan, d.train), *((c.plan, c.train) for c in d.candidates)):
        _assert_runnable(p)
        assert estimate_memory(model, t, p).total > 0  # the memory model takes what the planner chose
