"""memplan_auto's calibrated check (issue 33) on one process: the ranked candidates are walked until one fits by
the calibrated estimate (``parallel/verify.py``), a refusal carries the calibrated figures, the explanation
shows analytic and calibrated peaks side by side, ``PlanDecision.to_dict`` only gains keys, the pipeline
replay runs PyTorch's op order, and the calibrated estimate of a module equals a real step's measurement.

The multi-process checks (FITS measured under the budget, per-stage estimates within 5 %) are in
``tests/distributed/test_memplan_auto_calibrated_*.py``.
"""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch

from lightning_memplan.live.layouts import find_layout
from lightning_memplan.model.pipeline_timeline import backward_moments
from lightning_memplan.model.result import MemoryEstimate
from lightning_memplan.model.specs import ParallelPlan, TrainSpec
from lightning_memplan.parallel.calibrated import CalibratedEstimator, CalibrationUnavailable
from lightning_memplan.parallel.decision import decide
from lightning_memplan.parallel.inputs import model_spec_for
from lightning_memplan.parallel.pipeline_replay import rank_actions
from lightning_memplan.parallel.planner_bridge import run_planner
from lightning_memplan.parallel.verify import check_candidates
from lightning_memplan.planning import CheckedCandidate, PlanDecision, PlanDoesNotFitError
from lightning_memplan.testing.zoo import GPT, causal_lm_loss, llama_style
from lightning_memplan.tracking.fake_fidelity import readable_scalars

SEQ, VOCAB, BATCH = 32, 128, 4
TRAIN = TrainSpec(micro_batch=BATCH, seq_len=SEQ, precision="32-true", optimizer="adamw", optimizer_impl="for_loop",
                  device="cpu", loss="naive")


class ZooLM(L.LightningModule):
    """A zoo Llama-style GPT whose training step logs its loss as a Python float (as many do)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(llama_style(vocab_size=VOCAB, ffn_hidden=128, max_positions=SEQ))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = causal_lm_loss(self.model, *batch)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1], tokens[:, 1:]


# ------------------------------------------------------------------------------------------ pipeline order
@pytest.mark.parametrize("schedule,p,m,v", [("1f1b", 2, 2, 1), ("1f1b", 4, 4, 1), ("1f1b", 2, 5, 1), ("gpipe", 2, 3, 1),
                                            ("interleaved", 2, 2, 2), ("interleaved", 4, 8, 2), ("interleaved", 2, 6, 3)])
def test_rank_actions_hold_what_the_analytic_timeline_holds(schedule, p, m, v):
    """The replay's order, reduced to the micro-batches held at each backward, is the analytic model's
    (``model/pipeline_timeline.py``, written independently from PyTorch's schedules)."""
    for rank in range(p):
        actions = rank_actions(rank, p, m, schedule, v)
        assert sorted(actions) == sorted((k, c, mb) for k in "BF" for c in range(v) for mb in range(m))
        held, done, seen = [0] * v, [False] * v, []
        for kind, chunk, _ in actions:
            if kind == "F":
                held[chunk] += 1
                continue
            seen.append((tuple(held), chunk, tuple(done)))
            held[chunk] -= 1
            done[chunk] = True
        assert seen == [(tuple(b.held), b.chunk, tuple(b.done)) for b in backward_moments(rank, p, m, schedule, v)]


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (4, 4, 2), (2, 4, 2), (4, 8, 2), (2, 6, 3)])
def test_interleaved_rank_actions_are_pytorchs(p, m, v):
    """PyTorch's own op list (``ScheduleInterleaved1F1B._calculate_single_rank_operations``, built without
    stages: it reads only the four sizes set here)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    sched = object.__new__(schedules.ScheduleInterleaved1F1B)
    sched.n_local_stages, sched.pp_group_size, sched._n_microbatches = v, p, m
    sched.number_of_rounds = max(1, m // p)
    sched.microbatches_per_round = m // sched.number_of_rounds
    for rank in range(p):
        ops = [a for a in sched._calculate_single_rank_operations(rank) if a is not None]
        forward = schedules._ComputationType.FORWARD
        theirs = [("F" if a.computation_type == forward else "B", a.stage_index // p, a.microbatch_index) for a in ops]
        assert rank_actions(rank, p, m, "interleaved", v) == theirs


# ------------------------------------------------------------------------------------------ the check
def _decision(module: torch.nn.Module, budget: int) -> PlanDecision:
    spec = model_spec_for(module, find_layout(module))
    return run_planner(spec, TRAIN, hardware=None, devices=2, num_nodes=1, memory_budget=budget, headroom=0.1,
                       allow=("dp", "fsdp", "tp"), exclude=set(), has_lce=False)


def _over(total: int) -> MemoryEstimate:
    return MemoryEstimate(params=total, source="calibrated")


def test_check_walks_the_ranking_until_the_calibrated_estimate_fits():
    decision = _decision(ZooLM(), 64 * 2**20)
    ranked = list(decision.candidates[:3])
    assert len(ranked) == 3
    budget = int(ranked[0].budget.budget)
    answers = iter([_over(budget + 1), CalibrationUnavailable("no batch"), _over(budget)])

    def calibrated(plan: ParallelPlan, train: TrainSpec) -> MemoryEstimate:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def analytic(plan: ParallelPlan, train: TrainSpec) -> MemoryEstimate:
        return _over(budget + 2)  # the analytic estimate of the second misses too

    verdict = check_candidates(ranked, applied=lambda c: (c.plan, c.train), analytic=analytic, calibrated=calibrated,
                               need=lambda plan, train, est: est.total)
    assert verdict.index == 2 and verdict.plan == ranked[2].plan and verdict.estimate.total == budget
    first, second, third = verdict.checked
    assert (first.fits, first.decided_by, first.calibrated_bytes) == (False, "calibrated", budget + 1)
    assert (second.fits, second.decided_by, second.calibrated_bytes) == (False, "analytic", None)
    assert second.note == "not calibrated: no batch"
    assert (third.fits, third.decided_by, third.need_bytes, third.budget_bytes) == (True, "calibrated", budget, budget)


def _decide(module: torch.nn.Module, budget: int, calibrated) -> object:
    spec = model_spec_for(module, find_layout(module))

    def planner(blocked: dict[str, str]) -> PlanDecision:
        return run_planner(spec, TRAIN, hardware=None, devices=2, num_nodes=1, memory_budget=budget, headroom=0.1,
                           allow=("dp", "fsdp", "tp"), exclude=set(blocked), has_lce=False)

    return decide(model_spec=spec, train=TRAIN, world_size=2, layout=find_layout(module), module=module,
                  self_parallel=False, forced=None, forced_source="forced", planner=planner, calibrated=calibrated)


def test_decide_takes_the_next_candidate_when_the_first_misses_by_its_calibrated_estimate():
    module = ZooLM()
    planned = _decision(module, 64 * 2**20)
    first = planned.plan
    budget = int(planned.budget.budget)

    def calibrated(plan: ParallelPlan, train: TrainSpec) -> MemoryEstimate:
        return _over(budget + 1 if dataclasses.replace(plan, own_units=(), grad_buckets=True) == first else budget // 2)

    res = _decide(module, 64 * 2**20, calibrated)
    assert res.decision.plan != first and res.decision.estimate.total == budget // 2
    assert [c.fits for c in res.decision.checked] == [False, True]
    assert any("ranked before it over the budget" in n for n in res.notes), res.notes
    text = res.decision.explain()
    assert "checked against the calibrated estimate of the module" in text and "misses" in text, text
    assert "analytic" in text and "calibrated" in text and ", calibrated)" in text  # the header's peak source
    markdown = res.decision.explain("markdown")
    assert "| # | plan \\| training (as applied) | analytic | calibrated | budget | decided by |" in markdown


def test_decide_refuses_with_the_calibrated_figures_when_no_candidate_fits():
    module = ZooLM()
    with pytest.raises(PlanDoesNotFitError) as info:
        _decide(module, 64 * 2**20, lambda plan, train: _over(2**40))
    message = str(info.value)
    assert "by the calibrated estimate of the module" in message and "1,099,511,627,776 B calibrated" in message
    assert "(analytic " in message and "budget (short by" in message
    closest = info.value.decision
    assert not closest.fits and closest.checked and not any(c.fits for c in closest.checked)


def test_checked_candidates_round_trip_and_old_decisions_load():
    module = ZooLM()
    res = _decide(module, 64 * 2**20, lambda plan, train: _over(1000))
    data = res.decision.to_dict()
    assert data["checked"] == [c.to_dict() for c in res.decision.checked]
    assert PlanDecision.from_dict(data).checked == res.decision.checked
    old = {k: v for k, v in data.items() if k != "checked"}  # a decision written before issue 33
    assert PlanDecision.from_dict(old).checked == ()
    assert CheckedCandidate.from_dict(data["checked"][0]) == res.decision.checked[0]


# ------------------------------------------------------------------------------------------ the estimator
def test_calibrated_estimate_equals_a_real_step_and_reads_logged_scalars(two_threads):
    """The estimator traces the module's meta copy under fake tensors (its training_step reads
    ``float(loss)``, which fake tensors answer with 0 there); the answer for one device is the tracker's
    measurement of a real CPU step of the same module."""
    from lightning_memplan.tracking.trace import default_loss, trace_memory

    module = ZooLM()
    estimator = CalibratedEstimator(module, model_spec_for(module, find_layout(module)), _batch)
    (estimate,) = estimator.stages(ParallelPlan(), TRAIN)
    real = trace_memory(module, example_input=_batch(), fake=False, optimizer="adamw", optimizer_impl="for_loop",
                        loss_fn=readable_scalars(default_loss))
    print(f"calibrated {estimate.total:,} B, real step {real.total:,} B")
    assert estimate.source == "calibrated" and estimator.traces == 2
    assert abs(estimate.total - real.total) <= 0.01 * real.total
    # every fake step reads a logged value as 0 (tracking/fake_fidelity.fake_scalars): the meta copy's trace,
    # which stopped at float(loss) with DataDependentOutputException, is the real step's measurement
    import warnings

    from lightning_memplan.tracking.meta_copy import meta_copy

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to a real step (a meta copy has none)
        traced = trace_memory(meta_copy(module), example_input=_batch(), optimizer="adamw", optimizer_impl="for_loop")
    assert traced.mode == "fake" and abs(traced.total - real.total) <= 0.01 * real.total
    again = estimator.estimate(ParallelPlan(dp=2, zero=3), TRAIN)  # cached: no further trace
    assert estimator.traces == 2 and again.total < estimate.total
    # activation offloading: the fit (traced without it) scaled to the offloaded block point (a KeyError before)
    offloaded = estimator.estimate(ParallelPlan(dp=2, zero=3), TRAIN.replace(offload_activations=True))
    assert offloaded.source == "calibrated" and offloaded.host > 0 and offloaded.total < again.total


def test_calibration_unavailable_says_why():
    module = ZooLM()
    estimator = CalibratedEstimator(module, model_spec_for(module, find_layout(module)), lambda: None)
    with pytest.raises(CalibrationUnavailable, match="no batch of the run to trace"):
        estimator.estimate(ParallelPlan(), TRAIN)


def test_fabric_front_door_checks_the_calibrated_estimate_too():
    """``fabric.setup`` plans with the loader's first batch; the choice carries its calibrated check."""
    import os

    from torch.utils.data import DataLoader, TensorDataset

    from lightning_memplan.fabric import MemplanAutoFabricStrategy

    module = ZooLM().model
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    environ = dict(os.environ)  # fabric.launch() sets MASTER_ADDR/PORT, WORLD_SIZE, ... for its processes
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=MemplanAutoFabricStrategy(memory_budget=64 * 2**20))
    fabric.launch()
    try:
        fabric.setup_dataloaders(DataLoader(TensorDataset(*_batch()), batch_size=BATCH))
        fabric.setup(module, optimizer)
        decision = fabric.strategy.decision
    finally:
        if torch.distributed.is_initialized():  # the strategy's one-rank group: leave none to later tests
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    (checked,) = decision.checked
    assert decision.estimate.source == "calibrated" and checked.decided_by == "calibrated" and checked.fits
    assert checked.calibrated_bytes == decision.estimate.total and checked.analytic_bytes > 0
