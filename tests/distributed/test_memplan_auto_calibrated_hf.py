"""Issue 33: FITS is a promise, for a Hugging Face ``LlamaForCausalLM`` from a tiny config (no download) under
``MemplanAutoStrategy(memory_budget=...)``, and per pipeline stage.

Budgets: four per world size, each forcing another layout (read off the planner for this model: 2 layers on
2 gloo processes, 4 layers on 4). Before ``[FITS]`` is printed the choice's calibrated estimate is checked
(``parallel/verify.py``): without a pipeline the module's meta copy traced under fake tensors and scaled to
the plan (``estimate_memory(calibration=...)``); under a pipeline each rank's own step traced, its stages
run in the schedule's order (``parallel/pipeline_replay.py``). Every rank's measured steady-step peak (the
project's tensor tracker, smallest steady step) must be under the budget, and the calibrated estimate (the
worst rank's) within 5 % of the worst rank's measurement.

Measured here (b=4 per rank, s=32, fp32, AdamW; calibrated / measured of the worst rank):
2 processes: 1.5 MiB: dp=1 pp=2 1f1b m=4, selective_op: 1,319,784 / 1,344,360 B (the analytic 1,158,596 B
was 14 % under); 2.5 MiB: dp=1 tp=2: 2,238,800 / 2,304,660 B; 3 MiB: dp=2 zero=2, selective_op: 2,509,414 /
2,449,184 B; 4.5 MiB: dp=2: 3,647,876 / 3,648,444 B. 4 processes: 1.125 MiB: dp=1 tp=2 pp=2, full recompute:
1,070,676 / 1,115,532 B; 1.5 MiB: dp=1 pp=4, full recompute: 1,281,128 / 1,298,048 B; 3.1 MiB: dp=4 zero=3:
2,855,936 / 2,743,976 B; 8 MiB: dp=4: 6,402,436 / 6,403,076 B.

Per stage (forced plans, each stage's calibrated estimate against its own rank's measurement): 2 stages
1F1B (2 layers, m=2): 1,582,696 / 1,582,696 B and 1,632,116 / 1,632,120 B (the analytic model +8.8 % and
-2.1 %); 2 stages interleaved (4 layers, v=2, m=2): +1.2 %, +1.2 %; 4 stages 1F1B (4 layers, m=4): -0.5 %,
+0.6 %, -1.4 %, 0.0 % (the config-only traced estimate was +124 % .. +32 %; since w33b within 5 %,
tests/unit/test_pipeline_stage_estimates.py); 4 stages interleaved (8 layers, v=2, m=4): +0.6 %, +1.9 %,
+1.3 %, +0.6 %.
"""

from __future__ import annotations

import pytest
import torch
from test_strategy_budget import SteadyStepMeter  # noqa: I001
from test_strategy_parity import make_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_memplan.testing import run_distributed

transformers = pytest.importorskip("transformers.masking_utils", reason="the HF pipeline forward needs transformers >= 4.53")

pytestmark = pytest.mark.hf

VOCAB, SEQ, BATCH, STEPS = 256, 32, 4, 3
MiB = 2**20
RTOL = 0.05
#: world size -> (layers, {budget: the layout kind it forces})
BUDGETS = {
    2: (2, {int(1.5 * MiB): "pp", int(2.5 * MiB): "tp", 3 * MiB: "fsdp", int(4.5 * MiB): "ddp"}),
    4: (4, {int(1.125 * MiB): "tp", int(1.5 * MiB): "pp", int(3.1 * MiB): "fsdp", 8 * MiB: "ddp"}),
}
#: name -> (world size, layers, forced plan keywords)
PIPELINES = {
    "2 stages 1F1B": (2, 2, dict(pp=2, microbatches=2)),
    "2 stages interleaved": (2, 4, dict(pp=2, microbatches=2, schedule="interleaved", virtual_stages=2)),
    "4 stages 1F1B": (4, 4, dict(pp=4, microbatches=4)),
    "4 stages interleaved": (4, 8, dict(pp=4, microbatches=4, schedule="interleaved", virtual_stages=2)),
}


def llama_lm(n_layers: int):
    from lightning_memplan.testing.hf_architectures import pipeline_llama

    return pipeline_llama(n_layers, vocab=VOCAB, seq=SEQ)


def _loader(world: int) -> DataLoader:
    tokens = torch.randint(0, VOCAB, (BATCH * world * STEPS, SEQ), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(tokens), batch_size=BATCH)


def _kind(plan) -> str:
    if plan.pp > 1:
        return "tp" if plan.tp > 1 else "pp"
    if plan.tp > 1:
        return "tp"
    return "fsdp" if plan.zero >= 2 else "ddp"


def budget_worker(rank: int, world: int) -> list[dict]:
    from lightning_memplan.strategies import MemplanAutoStrategy

    n_layers, budgets = BUDGETS[world]
    out = []
    for budget in budgets:
        strategy = MemplanAutoStrategy(memory_budget=budget)
        meter = SteadyStepMeter(SEQ, VOCAB)
        make_trainer(strategy, steps=STEPS, callbacks=[meter]).fit(llama_lm(n_layers), _loader(world))
        decision = strategy.decision
        out.append({"budget": budget, "plan": strategy.applied_plan, "explain": decision.explain(),
                    "estimate": decision.estimate.total, "source": decision.estimate.source,
                    "checked": [c.to_dict() for c in decision.checked], "measured": meter.report.total})
    return out


def _check_budgets(world: int) -> None:
    results = run_distributed(budget_worker, world, timeout_s=400)
    for i, (budget, kind) in enumerate(BUDGETS[world][1].items()):
        cases = [r[i] for r in results]
        worst = max(c["measured"] for c in cases)
        r = cases[0]
        print(f"{world} ranks, budget {budget:,} B: {r['plan'].describe()}: analytic {r['checked'][-1]['analytic_bytes']:,} B, "
              f"calibrated {r['estimate']:,} B, measured {[c['measured'] for c in cases]}")
        assert _kind(r["plan"]) == kind, (budget, r["plan"])
        assert "[FITS]" in r["explain"] and r["source"] == "calibrated", r["explain"]
        assert r["checked"][-1]["decided_by"] == "calibrated" and r["checked"][-1]["fits"], r["checked"]
        assert all(c["measured"] <= budget for c in cases), (budget, cases)  # what [FITS] promised
        assert abs(r["estimate"] - worst) <= RTOL * worst, (budget, r["estimate"], worst)


@pytest.mark.distributed
@pytest.mark.timeout(480)
def test_budgets_force_pp_tp_fsdp_ddp_and_fits_holds_on_two_ranks():
    _check_budgets(2)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_budgets_force_pp_tp_fsdp_ddp_and_fits_holds_on_four_ranks():
    _check_budgets(4)


def stage_worker(rank: int, world: int, n_layers: int, plan_kwargs: dict) -> dict:
    from lightning_memplan.live.layouts import find_layout
    from lightning_memplan.model.specs import ParallelPlan, TrainSpec
    from lightning_memplan.parallel.calibrated import CalibratedEstimator
    from lightning_memplan.parallel.inputs import model_spec_for
    from lightning_memplan.strategies import MemplanAutoStrategy

    plan = ParallelPlan(**plan_kwargs)
    loader = _loader(world)
    module = llama_lm(n_layers)
    estimator = CalibratedEstimator(module, model_spec_for(module, find_layout(module)), lambda: next(iter(loader)))
    train = TrainSpec(micro_batch=BATCH // plan.microbatches, seq_len=SEQ, precision="32-true", optimizer="adamw",
                      optimizer_impl="for_loop", device="cpu")
    stages = [e.total for e in estimator.stages(plan, train)]
    strategy = MemplanAutoStrategy(plan=plan)
    meter = SteadyStepMeter(SEQ, VOCAB)
    make_trainer(strategy, steps=STEPS, callbacks=[meter]).fit(module, loader)
    return {"stages": stages, "measured": meter.report.total, "recorded": strategy.decision.estimate.total,
            "source": strategy.decision.estimate.source}


def _check_stages(name: str) -> None:
    world, n_layers, plan_kwargs = PIPELINES[name]
    results = run_distributed(stage_worker, world, n_layers, plan_kwargs, timeout_s=400)
    stages = results[0]["stages"]
    for rank, r in enumerate(results):
        print(f"{name}, stage {rank}: calibrated {stages[rank]:,} B, measured {r['measured']:,} B "
              f"({stages[rank] / r['measured'] - 1:+.1%})")
        assert r["stages"] == stages  # every rank computes the same estimates
        assert abs(stages[rank] - r["measured"]) <= RTOL * r["measured"], (name, rank, stages[rank], r["measured"])
        assert r["recorded"] == max(stages) and r["source"] == "calibrated"  # the forced plan records the worst stage


@pytest.mark.distributed
@pytest.mark.timeout(420)
@pytest.mark.parametrize("name", ["2 stages 1F1B", "2 stages interleaved"])
def test_each_stage_estimate_is_within_5_percent_on_two_stages(name):
    _check_stages(name)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["4 stages 1F1B", "4 stages interleaved"])
def test_each_stage_estimate_is_within_5_percent_on_four_stages(name):
    _check_stages(name)
