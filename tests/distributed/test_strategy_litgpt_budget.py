"""litgpt's ``GPT`` under memplan_auto with ``memory_budget=3 MiB`` on 2 gloo ranks (issue 11, item 9: the
plan printed ``[FITS]`` at 2.7 MiB and the run measured 3.275 MiB, above the budget). Now the planner
searches against the budget less its 5 % estimate margin (``planner_bridge.planning_budget``), picks a
layout that splits the per-rank state, and every rank's measured steady-step peak stays under the budget.

Three litgpt layouts from small configs (no download): LLaMA-style (``LLaMAMLP``, RMSNorm, grouped-query
attention), litgpt's default ``Config`` (``GptNeoxMLP``, LayerNorm, multi-head attention), and LLaMA-style
as litgpt ships its Llama configs, RoPE over the whole head at litgpt's default ``block_size=4096`` (its
``cos``/``sin`` tables, 512 KiB of buffers on every rank; issue 27: such a run printed ``[FITS]`` and
measured over its budget). Measured with the project's tensor tracker over the steady steps
(``SteadyStepMeter``: smallest step peak).

Measured here (n_layer=2, n_embd=64, n_head=4, V=256, s=64, b=4 per rank, fp32, AdamW):
budget 3,145,728 B: LLaMA-style dp=1 tp=2 + selective_op: estimate 2,292,480 B, measured 2,342,980 B
(-2.2 %); default ``Config`` dp=1 tp=2: estimate 2,456,576 B, measured 2,557,040 B (-3.9 %).
budget 2,621,440 B, RoPE tables: dp=1 tp=2 + full recompute: estimate 2,487,296 B, measured 2,402,372 B
(+3.5 %). Without the tables in the estimate (before) the planner chose dp=1 tp=2 + selective_op at an
estimate of 2,290,432 B, printed ``[FITS]``, and the run measured 2,865,220 B, 9.3 % over the budget.
"""

from __future__ import annotations

import pytest
import torch
from test_strategy_budget import ESTIMATE_RTOL, SteadyStepMeter  # noqa: I001
from test_strategy_litgpt_tp import BATCH, SEQ, STEPS, VOCAB, LitGPTLM
from test_strategy_parity import make_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_memplan.testing import run_distributed

litgpt = pytest.importorskip("litgpt", reason="litgpt builds the GPT under test")

BUDGET = 3 * 2**20  # 3 MiB per rank
LLAMA = dict(n_query_groups=2, mlp_class_name="LLaMAMLP", intermediate_size=128, bias=False, norm_class_name="RMSNorm")
#: litgpt Config keyword arguments beyond the shared small size, and the memory budget, per case.
CONFIGS = {
    "llama": (LLAMA, BUDGET),
    "default": ({}, BUDGET),  # litgpt's own defaults: GptNeoxMLP (GELU, 4h), LayerNorm, n_query_groups = n_head
    # litgpt's Llama configs rotate the whole head; block_size left at litgpt's default (4096)
    "llama-rope": ({**LLAMA, "rotary_percentage": 1.0, "block_size": None}, 5 * 2**19),  # 2.5 MiB
}


def budget_worker(rank: int, world: int) -> dict:
    from lightning_memplan.strategies import MemplanAutoStrategy

    out = {}
    tokens = torch.randint(0, VOCAB, (BATCH * world * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    for name, (extra, budget) in CONFIGS.items():
        module = LitGPTLM()
        torch.manual_seed(0)
        config = {**dict(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, padded_vocab_size=VOCAB, block_size=SEQ),
                  **extra}
        module.model = litgpt.GPT(litgpt.Config(**{k: v for k, v in config.items() if v is not None}))
        meter = SteadyStepMeter(SEQ, VOCAB)
        strategy = MemplanAutoStrategy(memory_budget=budget)
        loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)
        make_trainer(strategy, steps=STEPS, callbacks=[meter]).fit(module, loader)
        out[name] = {"plan": strategy.applied_plan, "estimate": strategy.decision.estimate.total,
                     "measured": meter.report.total, "explain": strategy.decision.explain(), "budget": budget}
    return out


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_litgpt_budget_that_says_fits_holds_when_measured():
    results = run_distributed(budget_worker, 2, timeout_s=60)
    for rank, cases in enumerate(results):
        assert cases.keys() == CONFIGS.keys()
        for name, r in cases.items():
            plan, budget = r["plan"], r["budget"]
            print(f"rank {rank} {name} {plan.describe()}: estimate {r['estimate']:,} B, measured {r['measured']:,} B "
                  f"({(r['estimate'] - r['measured']) / r['measured']:+.1%}), budget {budget:,} B")
            assert f"chosen: {plan.describe()}  [FITS]" in r["explain"], r["explain"]
            assert plan.world_size == 2
            assert plan.zero >= 2 or plan.tp > 1 or plan.pp > 1, plan  # the per-rank state is split
            assert r["estimate"] <= budget * 0.95  # searched against the budget less the estimate margin
            assert r["measured"] <= budget, (rank, name, r["measured"])  # what [FITS] promised
            assert abs(r["measured"] - r["estimate"]) <= ESTIMATE_RTOL * r["measured"], (rank, name, r)
