"""Issue 33: FITS is a promise. litgpt's ``GPT`` (2 layers, 4 heads, 2 key/value groups, SwiGLU ``LLaMAMLP``,
RMSNorm; the setup of ``test_strategy_litgpt_budget.py``) under ``MemplanAutoStrategy(memory_budget=...)`` on 2
gloo processes: before the plan is said to fit, its calibrated estimate (the module's meta copy traced under
fake tensors, ``parallel/calibrated.py``) is checked against the budget less the 5 % estimate margin, and the
explanation shows the analytic and the calibrated peak side by side. Whenever ``[FITS]`` is printed, every
rank's measured steady-step peak (the project's tensor tracker, smallest of the steady steps as in
``test_strategy_budget.py``) is under the budget; a budget nothing fits is refused at setup.

Measured here (b=4 per rank, s=64, fp32, AdamW; the analytic / calibrated / measured peak of rank 0):
2.5 and 3 MiB: dp=1 tp=2 + selective_op 2,292,480 / 2,244,614 / 2,342,980 B; 3.5 MiB: dp=2 zero=2 +
selective_op 3,150,080 / 3,150,080 / 3,182,032 B; 4 MiB: dp=2 + selective_op 3,840,768 / 3,840,768 /
3,642,192 B; 1.5 MiB: refused.

The repeat test: forced tp=2 five times, measured by ``MemoryPlanCallback`` (the memory report names the
late-released part: ``StepRecord.released_late``, the line "N B of the measured peak were collective buffers
gloo's thread released late"). Identical runs measured different peaks on rank 1 before (issue 33:
4,950,060 B and 5,736,492 B): gloo's worker thread holds a finished collective's buffers (its ``Work``) after
``wait()`` returned until the scheduler lets it take the GIL to drop them, so on a loaded machine a step's
peak can include, e.g., the all-gathered logits the step had already let go (+262,144 B, one
``[4, 64, 256]`` fp32 tensor; +786,432 B for three). The tracker now applies such frees on its own thread
and reports them (``TrackerReport.released_late``: the peak minus the step's peak with each such storage
counted only up to its last use by the step). Measured in five runs here: every step without a late release
3,264,580 B on both ranks (the calibrated estimate 3,306,180 B, +1.3 %); one step of twenty on rank 0
measured 3,526,724 B with 378,100 B named as released late. Through the memory report (w33b), two runs of five
on the loaded 2-core machine: 18 of 20 steady steps of rank 0 and 20 of 20 of rank 1 at 3,264,580 B, two of
rank 0 at 3,541,840 B and 3,526,732 B with 393,216 B and 378,108 B named; the other run all 3,264,580 B.
"""

from __future__ import annotations

import pytest
import torch
from test_strategy_budget import SteadyStepMeter  # noqa: I001
from test_strategy_litgpt_tp import BATCH, SEQ, VOCAB, LitGPTLM
from test_strategy_parity import make_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_memplan.testing import run_distributed

pytest.importorskip("litgpt", reason="litgpt builds the GPT under test")

MiB = 2**20
#: The issue's budgets, and one nothing fits (refused at setup).
BUDGETS = (int(2.5 * MiB), 3 * MiB, int(3.5 * MiB), 4 * MiB)
REFUSED = int(1.5 * MiB)
STEPS = 4
RTOL = 0.05
REPEATS = 5


def _loader(world: int) -> DataLoader:
    tokens = torch.randint(0, VOCAB, (BATCH * world * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)


def budget_worker(rank: int, world: int) -> list[dict]:
    from lightning_memplan.strategies import MemplanAutoStrategy

    out = []
    for budget in (*BUDGETS, REFUSED):
        strategy = MemplanAutoStrategy(memory_budget=budget)
        meter = SteadyStepMeter(SEQ, VOCAB)
        try:
            make_trainer(strategy, steps=STEPS, callbacks=[meter]).fit(LitGPTLM(), _loader(world))
        except ValueError as exc:  # rank 0's PlanDoesNotFitError, raised on every rank
            out.append({"budget": budget, "refused": str(exc)})
            continue
        decision = strategy.decision
        out.append({
            "budget": budget, "plan": strategy.applied_plan.describe(), "explain": decision.explain(),
            "estimate": decision.estimate.total, "source": decision.estimate.source,
            "checked": [c.to_dict() for c in decision.checked], "measured": meter.report.total,
        })
    return out


#: bytes of a late-released step's excess its report may leave unnamed (a collective's few-byte scalars)
UNNAMED_SLACK = 64


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_litgpt_fits_only_what_its_calibrated_estimate_fits():
    results = run_distributed(budget_worker, 2, timeout_s=300)
    for rank, cases in enumerate(results):
        for r in cases:
            if r["budget"] == REFUSED:
                assert "refused" in r and "no parallel plan fits" in r["refused"], r
                continue
            checked = r["checked"]
            print(f"rank {rank} budget {r['budget']:,} B: {r['plan']}: analytic {checked[-1]['analytic_bytes']:,} B, "
                  f"calibrated {r['estimate']:,} B, measured {r['measured']:,} B")
            assert "[FITS]" in r["explain"] and "checked against the calibrated estimate" in r["explain"], r["explain"]
            assert r["source"] == "calibrated" and checked[-1]["decided_by"] == "calibrated", r
            assert checked[-1]["fits"] and checked[-1]["calibrated_bytes"] == r["estimate"], checked
            assert r["estimate"] <= r["budget"] * 0.95  # checked against the budget less the estimate margin
            assert r["measured"] <= r["budget"], (rank, r)  # what [FITS] promised


def repeat_worker(rank: int, world: int) -> dict:
    """One forced tp=2 run measured by ``MemoryPlanCallback`` on every step; rank 0 returns the gathered
    memory report (every rank's tracked steps) and its Markdown and HTML renderings."""
    from lightning_memplan.callbacks import MemoryPlanCallback
    from lightning_memplan.model.specs import ParallelPlan
    from lightning_memplan.report.html import render_html
    from lightning_memplan.report.render import render_markdown
    from lightning_memplan.strategies import MemplanAutoStrategy

    strategy = MemplanAutoStrategy(plan=ParallelPlan(tp=world))
    callback = MemoryPlanCallback(print_report=False, write_files=False, measure_every_n_steps=1, units="B")
    make_trainer(strategy, steps=STEPS + 1, callbacks=[callback]).fit(LitGPTLM(), _loader(world))
    report = callback.report
    return {"strategy": strategy.decision.estimate.total, "report": report.to_dict(),
            "markdown": render_markdown(report, units="B") if rank == 0 else "",
            "html": render_html(report, units="B") if rank == 0 else ""}


LATE = "B of the measured peak were collective buffers gloo's thread released late"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_identical_tp_runs_measure_the_same_peak_or_name_what_varies():
    """Five identical forced tp=2 runs, measured by ``MemoryPlanCallback`` (the memory report itself):
    every steady step without a late release measures the same peak on every rank in every run, within 5 %
    of the report's estimate; a step with one measures that peak or more, and then all of the difference is
    the bytes the report names as released late (``measured - released_late <= peak < measured``: the
    late-release view counts each such storage only up to its last use by the step, so it can only over-name,
    but for a few bytes, ``UNNAMED_SLACK``), and the rendered
    report says so for every rank whose measured peak holds some."""
    from lightning_memplan.report.escape import html_text
    from lightning_memplan.report.records import MemoryReport

    runs = [run_distributed(repeat_worker, 2, timeout_s=300)[0] for _ in range(REPEATS)]
    reports = [MemoryReport.from_dict(run["report"]) for run in runs]
    for rank in range(2):
        summaries = [next(r for r in rep.epochs[-1].ranks if r.rank == rank) for rep in reports]
        steps = [(t.measured_peak, t.released_late) for s in summaries for t in s.tracked if not t.warmup]
        quiet = {total for total, late in steps if not late}
        late = [(total, late) for total, late in steps if late]
        estimates = {t.estimated_peak for s in summaries for t in s.tracked}
        print(f"rank {rank}: peak without late releases {sorted(quiet)} in {len(steps) - len(late)} of {len(steps)} "
              f"steady steps; with late releases (peak, released late): {late}; report estimate {sorted(estimates)}; "
              f"strategy estimate {runs[0]['strategy']:,} B")
        assert len(steps) >= REPEATS * (STEPS - 1) and len(quiet) == 1, (rank, steps)  # identical runs, identical peaks
        (peak,) = quiet
        # a step with a late release measures the quiet peak (its late buffers sat below it: one run of the
        # fresh suite, 3,264,580 B with 115,956 B named) or more, and the named part explains the excess but for
        # at most UNNAMED_SLACK bytes (one run measured 3,526,732 B with 262,144 B named: 8 B unnamed)
        assert all(total == peak or peak < total <= peak + released + UNNAMED_SLACK for total, released in late), (
            rank, peak, late)
        assert len(estimates) == 1 and abs(peak - estimates.pop()) <= RTOL * peak, (rank, peak, estimates)
        for run, summary in zip(runs, summaries, strict=True):
            named = f"rank {rank}: {summary.released_late:,d} {LATE}"
            assert (named in run["markdown"]) == bool(summary.released_late), (rank, summary.released_late)
            assert (html_text(LATE) in run["html"]) == any(s.released_late for s in run_summaries(run))


def run_summaries(run: dict) -> list:
    from lightning_memplan.report.records import MemoryReport

    return list(MemoryReport.from_dict(run["report"]).epochs[-1].ranks)
