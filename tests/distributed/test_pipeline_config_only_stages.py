"""The config-only estimate of each pipeline stage (``ModelSpec.from_hf_config``, the analytic terms scaled by
the class's traced coefficients: what the planner ranks pipelines with) against each rank's measured
steady-step peak (the project's tensor tracker) of a real forced-plan run on 2 gloo processes, for held-out
layouts (neither rule of ``model/traced._pipeline_stage_scaled`` and ``model/assemble._block_backward`` was
made on them; see tests/unit/test_pipeline_stage_estimates.py for the traced-step comparison of these and
the development layouts). Measured here: see the printed lines.
"""

from __future__ import annotations

import pytest
import torch
from test_strategy_budget import SteadyStepMeter  # noqa: I001
from test_strategy_parity import make_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_memplan.testing import run_distributed

pytest.importorskip("transformers.masking_utils", reason="the HF pipeline forward needs transformers >= 4.53")

pytestmark = [pytest.mark.hf, pytest.mark.distributed, pytest.mark.slow]

RTOL = 0.05
STEPS = 3
#: name -> (layers, plan keywords, dataloader batch per rank, sequence length)
HELD_OUT = {
    "2 stages GPipe, 4 layers": (4, dict(pp=2, microbatches=2, schedule="gpipe"), 4, 32),
    "2 stages 1F1B, 3 layers (uneven)": (3, dict(pp=2, microbatches=2), 4, 32),
    "2 stages 1F1B, 6 layers, m=4, s=48": (6, dict(pp=2, microbatches=4), 8, 48),
}


def stage_worker(rank: int, world: int, name: str) -> dict:
    from lightning_memplan.model.estimate import estimate_memory
    from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
    from lightning_memplan.strategies import MemplanAutoStrategy
    from lightning_memplan.testing.hf_architectures import pipeline_llama

    layers, plan_kwargs, batch, seq = HELD_OUT[name]
    plan = ParallelPlan(**plan_kwargs)
    module = pipeline_llama(layers, seq=seq)
    vocab = module.model.config.vocab_size
    tokens = torch.randint(0, vocab, (batch * STEPS, seq), generator=torch.Generator().manual_seed(1))
    train = TrainSpec(micro_batch=batch // plan.microbatches, seq_len=seq, precision="32-true", optimizer="adamw",
                      optimizer_impl="for_loop", device="cpu")
    estimate = estimate_memory(ModelSpec.from_hf_config(module.model.config), train, plan, rank=rank)
    meter = SteadyStepMeter(seq, vocab)
    make_trainer(MemplanAutoStrategy(plan=plan), steps=STEPS, callbacks=[meter]).fit(
        module, DataLoader(TensorDataset(tokens), batch_size=batch))
    return {"estimate": estimate.total, "source": estimate.source, "measured": meter.report.total}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(HELD_OUT))
def test_config_only_stage_estimate_matches_each_rank(name: str) -> None:
    for rank, r in enumerate(run_distributed(stage_worker, 2, name, timeout_s=500)):
        err = r["estimate"] / r["measured"] - 1
        print(f"{name}, stage {rank}: config-only {r['estimate']:,} B, measured {r['measured']:,} B ({err:+.1%})")
        assert r["source"] == "hf_trace" and abs(err) <= RTOL, (name, rank, r)
