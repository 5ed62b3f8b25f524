"""The measured reserved margin (issue 26): what a run's CUDA steps reserved beyond their allocated peak
(``report/margin.py``), the rule that carries it to another shape (``model.reserved.ReservedMargin``), and
``largest_fit(reserved_margin=)`` against a brute-force search written here from the rule's words.

A CUDA run cannot be faked on a CPU machine, so the reports are built from step records by hand, as the
callback's accumulator folds them (``StepRecord(backend="cuda", measured_peak=..., reserved=...)``)."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from lightning_memplan import ModelSpec, ParallelPlan, TrainSpec, max_micro_batch, max_seq_len
from lightning_memplan.callbacks import MemoryPlanCallback
from lightning_memplan.model.estimate import estimate_memory
from lightning_memplan.model.reserved import ReservedMargin
from lightning_memplan.planning.fit import largest_fit
from lightning_memplan.report import EpochReport, MemoryReport, StepRecord, render_markdown, summarize_rank
from lightning_memplan.report.margin import measured_reserved_margin

MIB, GIB = 2**20, 2**30


def _rec(step, *, alloc, reserved, b=4, s=64, rank=0, epoch=0, backend="cuda", warmup=False):
    return StepRecord(step=step, epoch=epoch, rank=rank, micro_batch=b, seq_len=s, estimated_peak=alloc,
                      measured_peak=alloc, reserved=reserved, backend=backend, warmup=warmup,
                      measurement="cuda_allocator" if backend == "cuda" else "rss")


def _summary(records, *, rank=0, epoch=0, backend="cuda"):
    return summarize_rank(records, rank=rank, epoch=epoch, backend=backend)


def _report(*epochs, run=None):
    return MemoryReport(run=run or {}, epochs=tuple(epochs))


def test_the_margin_is_the_worst_cuda_ranks_reserved_minus_allocated_peak():
    # rank 0: allocated peak 100 MiB (step 1), reserved grows to 130 MiB -> 30 MiB; rank 1: 110 -> 150: 40 MiB
    r0 = _summary([_rec(0, alloc=60 * MIB, reserved=80 * MIB, warmup=True), _rec(1, alloc=100 * MIB, reserved=120 * MIB),
                   _rec(2, alloc=90 * MIB, reserved=130 * MIB, b=2)])
    r1 = _summary([_rec(0, alloc=110 * MIB, reserved=150 * MIB, rank=1)], rank=1)
    evals = {"val": (_summary([_rec(0, alloc=10 * MIB, reserved=150 * MIB)]),)}  # no_grad: never counted
    margin = measured_reserved_margin(_report(EpochReport(epoch=0, ranks=(r0, r1), phases=evals),
                                              run={"expandable_segments": False}))
    assert margin == ReservedMargin(overhead=40 * MIB, micro_batch=4, seq_len=64, allocated=110 * MIB,
                                    reserved=150 * MIB, expandable_segments=False, run=0, epoch=0, rank=1)
    assert margin.ratio == pytest.approx(150 / 110)
    # rank 0 alone: the largest reserved less the largest allocated, at the largest shape it ran (4 x 64)
    alone = measured_reserved_margin(_report(EpochReport(epoch=0, ranks=(r0,))))
    assert (alone.overhead, alone.micro_batch, alone.seq_len, alone.expandable_segments) == (30 * MIB, 4, 64, None)


def test_cpu_and_mps_records_give_no_margin_and_the_latest_run_wins():
    cpu = _summary([_rec(0, alloc=10 * MIB, reserved=900 * MIB, backend="cpu")], backend="cpu")  # RSS, not comparable
    mps = _summary([_rec(0, alloc=10 * MIB, reserved=20 * MIB, backend="mps")], backend="mps")
    assert measured_reserved_margin(MemoryReport()) is None
    assert measured_reserved_margin(_report(EpochReport(epoch=0, ranks=(cpu, mps)))) is None
    old = EpochReport(epoch=0, ranks=(_summary([_rec(0, alloc=10 * MIB, reserved=90 * MIB)]),), run=0)
    new = EpochReport(epoch=0, ranks=(_summary([_rec(0, alloc=10 * MIB, reserved=15 * MIB, b=8)]),), run=1)
    margin = measured_reserved_margin(_report(old, new))
    assert (margin.overhead, margin.run, margin.micro_batch) == (5 * MIB, 1, 8)
    # an epoch under way (a mid-epoch checkpoint's accumulator) belongs to the current run
    partial = _summary([_rec(5, alloc=20 * MIB, reserved=32 * MIB, epoch=1)], epoch=1)
    current = MemoryReport(epochs=(old, new), current_run=1)
    assert measured_reserved_margin(current, in_progress=partial).overhead == 12 * MIB
    # under a pipeline the dataloader batch of 8 is 4 micro-batches of 2: the margin counts one micro-batch
    piped = _report(new, run={"plan": ParallelPlan(pp=2, microbatches=4).to_dict()})
    assert measured_reserved_margin(piped).micro_batch == 2
    with pytest.raises(TypeError, match="report="):
        measured_reserved_margin({"epochs": []})
    with pytest.raises(TypeError, match="in_progress="):
        measured_reserved_margin(MemoryReport(), in_progress="rank 0")


def test_the_rule_carries_bytes_by_the_batch_dependent_bytes():
    m = ReservedMargin(overhead=1000, micro_batch=2, seq_len=16)
    assert m.bytes_at(50, 100) == 1000  # a smaller shape keeps the measured bytes
    assert m.bytes_at(100, 100) == 1000
    assert m.bytes_at(301, 100) == 3010  # larger: in proportion, rounded up to a byte
    assert m.bytes_at(101, 300) == 1000
    assert ReservedMargin(overhead=1000).bytes_at(10**9, 100) == 1000  # a fixed margin is not scaled
    assert ReservedMargin.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    for kwargs, error, match in (
        ({"overhead": -1}, ValueError, "overhead"),
        ({"overhead": 1.5}, TypeError, "overhead"),
        ({"overhead": 1, "micro_batch": 2}, ValueError, "both"),
        ({"overhead": 1, "micro_batch": 0, "seq_len": 8}, ValueError, "micro_batch"),
        ({"overhead": 1, "expandable_segments": "yes"}, TypeError, "expandable_segments"),
    ):
        with pytest.raises(error, match=match):
            ReservedMargin(**kwargs)


def _gpt2(device="cuda"):
    return ModelSpec.preset("gpt2"), TrainSpec(micro_batch=1, seq_len=1024, device=device)


def _brute_force(spec, train, plan, budget, overhead, ref_shape, limit=64):
    """The largest b whose allocated estimate plus the margin fits, the margin computed from the rule's
    words: ``overhead * max(1, D / D_ref)`` rounded up, D = activations + attention + logits + workspace + other."""

    def dynamic(est):
        return est.activations + est.attention + est.logits + est.workspace + est.other

    ref = None
    if ref_shape is not None:
        ref = dynamic(estimate_memory(spec, train.replace(micro_batch=ref_shape[0], seq_len=ref_shape[1]), plan))
    best = 0
    for b in range(1, limit + 1):
        est = estimate_memory(spec, train.replace(micro_batch=b), plan)
        margin = overhead if ref is None else math.ceil(overhead * max(Fraction(1), Fraction(dynamic(est), ref)))
        if est.total + margin <= budget:
            best = b
        else:
            break
    return best


def test_largest_fit_with_a_margin_is_the_brute_force_answer():
    spec, train = _gpt2()
    plan, budget = ParallelPlan(), 12 * GIB
    modelled = largest_fit(spec, train, plan, memory_budget=budget)
    allocated_only = largest_fit(spec, train.replace(device="cpu"), plan, memory_budget=budget).value
    assert modelled.reserved_margin is None and modelled.value < allocated_only
    cases = [
        (0, None),  # nothing over the allocated bytes: the CPU rule's answer, larger than the modelled one
        (512 * MIB, None),  # a fixed int margin
        (256 * MIB, (2, 1024)),  # measured at b=2, scaled up at every larger b
        (3 * GIB, (4, 1024)),  # larger than the model says: a smaller answer
    ]
    answers = []
    for overhead, ref in cases:
        margin = overhead if ref is None else ReservedMargin(overhead=overhead, micro_batch=ref[0], seq_len=ref[1])
        found = largest_fit(spec, train, plan, memory_budget=budget, reserved_margin=margin)
        expected = _brute_force(spec, train, plan, budget, overhead, ref)
        assert found.value == expected > 0, (overhead, ref)
        assert found.need.reserved <= budget < found.miss_need.reserved
        assert found.need.allocated == found.estimate.total and found.need.measured_margin >= overhead
        assert found.reserved_margin == (margin if isinstance(margin, ReservedMargin) else ReservedMargin(overhead=margin))
        assert found.evaluations == found.to_dict()["evaluations"] and "reserved margin of" in found.describe()
        answers.append(found.value)
    assert answers[0] == allocated_only
    assert answers[3] < modelled.value < answers[0]
    assert answers[2] < answers[0] and answers[1] < answers[0]
    # the shortcuts pass it on; on a CPU step (no caching allocator) it is ignored
    assert max_micro_batch(spec, train, plan, memory_budget=budget, reserved_margin=3 * GIB) == \
        _brute_force(spec, train, plan, budget, 3 * GIB, None)
    eight = TrainSpec(micro_batch=8, seq_len=128)
    lengths = [max_seq_len(spec, eight, plan, memory_budget=6 * GIB, reserved_margin=m) for m in (GIB, None, 0)]
    assert 0 < lengths[0] < lengths[1] < lengths[2] < spec.max_positions  # 1 GiB > the model's margin > 0
    cpu = train.replace(device="cpu")
    assert largest_fit(spec, cpu, plan, memory_budget=budget, reserved_margin=5 * GIB).value == allocated_only


def test_reserved_margin_bad_input_is_named():
    spec, train = _gpt2()
    for value, error, match in (
        ("1GiB", TypeError, "reserved_margin='1GiB' must be a ReservedMargin"),
        (1.5 * GIB, TypeError, "reserved_margin="),
        (True, TypeError, "reserved_margin=True"),
        ({"overhead": 1}, TypeError, "reserved_margin="),
        (-1, ValueError, r"reserved_margin=-1 must be a byte count in \[0, 2\*\*63\)"),
        (2**80, ValueError, "reserved_margin="),
        (float("nan"), TypeError, "reserved_margin=nan"),
    ):
        for fn in (max_micro_batch, max_seq_len):
            with pytest.raises(error, match=match):
                fn(spec, train, memory_budget=GIB, reserved_margin=value)
    # measured under the other allocator setting: refused on CUDA, naming both
    other = ReservedMargin(overhead=MIB, micro_batch=1, seq_len=64, expandable_segments=True)
    with pytest.raises(ValueError, match="expandable_segments=True but expandable_segments=False"):
        largest_fit(spec, train, memory_budget=GIB, reserved_margin=other)
    assert largest_fit(spec, train, memory_budget=GIB, reserved_margin=other, expandable_segments=True).value >= 0
    # a reference shape this plan cannot estimate (context parallelism splits s in 2c pieces)
    odd = ReservedMargin(overhead=MIB, micro_batch=1, seq_len=3)
    with pytest.raises(ValueError, match="reserved_margin was measured at 1 x 3"):
        largest_fit(spec, train.replace(seq_len=1024), ParallelPlan(cp=2), memory_budget=GIB, reserved_margin=odd)
    # a NumPy integer and a 0-d tensor are plain byte counts
    plain = largest_fit(spec, train, memory_budget=12 * GIB, reserved_margin=GIB).value
    assert largest_fit(spec, train, memory_budget=12 * GIB, reserved_margin=np.int64(GIB)).value == plain
    assert largest_fit(spec, train, memory_budget=12 * GIB, reserved_margin=torch.tensor(GIB)).value == plain


def test_the_callback_and_the_epoch_report_show_the_measured_margin():
    r0 = _summary([_rec(0, alloc=100 * MIB, reserved=125 * MIB)])
    report = _report(EpochReport(epoch=0, ranks=(r0,)), run={"expandable_segments": False})
    text = render_markdown(report, units="MiB")
    assert "CUDA caching allocator, reserved - allocated: 25.000 MiB (rank 0, 25.0% of its allocated peak)" in text
    cpu = _summary([_rec(0, alloc=100 * MIB, reserved=900 * MIB, backend="cpu")], backend="cpu")
    assert "reserved - allocated" not in render_markdown(_report(EpochReport(epoch=0, ranks=(cpu,))))
    cb = MemoryPlanCallback(print_report=False, write_files=False)
    assert cb.reserved_margin is None
    cb.load_state_dict({"report": report.to_dict()})  # what a checkpoint restores
    assert cb.reserved_margin == measured_reserved_margin(report)
    assert cb.reserved_margin.overhead == 25 * MIB
