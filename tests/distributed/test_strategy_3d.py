"""3-D layouts on two simulated nodes: forced dp x tp, dp x pp, tp x pp (and dp x tp x pp on 2 x 4
processes) under memplan_auto with ``MemoryPlanCallback`` attached, launched as Lightning's multi-node
environment on localhost: ``Trainer(devices=2, num_nodes=2)`` in processes that carry ``NODE_RANK`` /
``LOCAL_RANK`` (``run_distributed(..., num_nodes=2)``), gloo.

Each case must:

* run to the end;
* place tensor-parallel groups inside a node and pipeline groups across nodes -- read from the device
  mesh's process groups (``get_process_group_ranks``) and each rank's ``trainer.node_rank``, not from the
  log (the mesh is ``pp x dp_replicate x dp_shard x tp``, tp fastest: torchtitan's ``ParallelDims``);
* reproduce a single-process run's losses within ``LOSS_ATOL`` (the reference of
  ``test_strategy_parity``: same GPT and seed, the same samples in Lightning's sampler order, one plain
  PyTorch loop over the whole global batch);
* give every rank the callback's estimate for *its* stage and shard within ``ESTIMATE_RTOL`` of the
  measured peak (the tensor tracker's live bytes; the smallest steady-step peak, see
  ``test_strategy_budget``'s docstring on gloo buffer release timing).
"""

from __future__ import annotations

import os

import pytest
from test_strategy_parity import GLOBAL_BATCH, STEPS, LossRecorder, TinyLM, reference_run, token_data  # noqa: I001
from torch.utils.data import DataLoader, TensorDataset

from lightning_memplan.model.specs import ParallelPlan
from lightning_memplan.testing import run_distributed

LOSS_ATOL = 2e-5
ESTIMATE_RTOL = 0.05
NODES = 2


def node_of_ranks(trainer) -> list[int]:
    import torch.distributed as dist

    nodes: list = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, int(trainer.node_rank))
    return nodes


def fit_3d(plan: ParallelPlan, model_kwargs: dict, root: str) -> dict:
    """Inside a worker: fit the forced plan on ``NODES`` simulated nodes with the callback attached."""
    import lightning as L
    import torch.distributed as dist

    from lightning_memplan.callbacks import MemoryPlanCallback
    from lightning_memplan.parallel.mesh import MeshAxis
    from lightning_memplan.strategies import MemplanAutoStrategy

    world = dist.get_world_size()
    ref_losses, _ = reference_run(model_kwargs)
    x, y = token_data()
    loader = DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // plan.dp)
    recorder = LossRecorder()
    callback = MemoryPlanCallback(calibrate=False, print_report=False, measure_every_n_steps=1, write_files=False)
    strategy = MemplanAutoStrategy(plan=plan)
    trainer = L.Trainer(
        accelerator="cpu", devices=world // NODES, num_nodes=NODES, strategy=strategy, max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[recorder, callback], default_root_dir=os.path.join(root, plan.describe().replace(" ", "_")),
    )
    trainer.fit(TinyLM(**model_kwargs), loader)
    mesh = strategy.device_mesh
    rank = trainer.global_rank
    summary = next(r for r in callback.report.epochs[-1].ranks if r.rank == rank)
    steady = [r for r in summary.tracked if not r.warmup and r.measured_peak]
    best = min(steady, key=lambda r: r.measured_peak)
    return {
        "rank": rank,
        "nodes": node_of_ranks(trainer),
        "tp_group": dist.get_process_group_ranks(mesh[str(MeshAxis.TP)].get_group()),
        "pp_group": dist.get_process_group_ranks(mesh[str(MeshAxis.PP)].get_group()),
        "dp_rank": mesh["data_parallel"].get_local_rank(),
        "applied": strategy.applied_plan,
        "losses": recorder.losses,
        "ref_losses": ref_losses,
        "estimated": best.estimated_peak,
        "measured": best.measured_peak,
        "notes": callback.report.notes,
    }


def worker_3d(rank: int, world: int, cases: list, root: str) -> list[dict]:
    return [fit_3d(plan, kwargs, root) for plan, kwargs in cases]


def check_3d(results: list[dict], plan: ParallelPlan) -> list[str]:
    lines = []
    nodes = results[0]["nodes"]
    assert nodes == [r // (len(results) // NODES) for r in range(len(results))]  # Lightning numbered the nodes
    per_dp: dict[int, list[float]] = {}
    for r in results:
        assert r["applied"].describe() == plan.describe(), (r["applied"], plan)
        assert len(r["losses"]) == STEPS  # ran to the end
        assert len(r["tp_group"]) == plan.tp and len(r["pp_group"]) == plan.pp
        assert len({nodes[g] for g in r["tp_group"]}) == 1, r  # a tensor-parallel group stays inside a node
        if plan.pp == NODES:  # the pipeline crosses the nodes, one stage per node
            assert sorted(nodes[g] for g in r["pp_group"]) == list(range(NODES)), r
        per_dp.setdefault(r["dp_rank"], r["losses"])
        assert max(abs(a - b) for a, b in zip(r["losses"], per_dp[r["dp_rank"]], strict=True)) <= 1e-6
        assert r["estimated"] is not None, r["notes"]
        err = r["estimated"] / r["measured"] - 1
        lines.append(f"{plan.describe()} rank {r['rank']}: estimated {r['estimated']:,} B, measured "
                     f"{r['measured']:,} B ({err:+.1%})")
        assert abs(err) <= ESTIMATE_RTOL, lines[-1]
    mean = [sum(v[i] for v in per_dp.values()) / plan.dp for i in range(STEPS)]
    ref = results[0]["ref_losses"]
    assert max(abs(a - b) for a, b in zip(mean, ref, strict=True)) <= LOSS_ATOL, (mean, ref)
    assert ref[-1] != ref[0]
    return lines


#: AdamW: the optimizer people run (its states are part of every rank's peak); lr small enough that the
#: losses of the sharded runs still agree with one process within LOSS_ATOL after STEPS steps.
ADAMW = {"optimizer": "adamw", "lr": 1e-3}

# dp x pp: under ``torch.distributed.pipelining`` every micro-batch's backward runs with gradient sync and
# resharding off and one reduce-scatter ends the step (``_PipelineStageBase.backward_maybe_with_nosync`` /
# ``perform_reduce_grad``, torch 2.13); the estimate models it (model/states.py ``pipelined_fsdp``):
# measured +2.1 % stage 0, +3.0 % stage 1 (AdamW), where per-block unsharding had given +9.9 % / +8.5 %.

WORLD4_CASES = [
    (ParallelPlan(dp=2, tp=2), ADAMW),
    (ParallelPlan(dp=2, pp=2, microbatches=2), ADAMW),
    (ParallelPlan(tp=2, pp=2, microbatches=2), ADAMW),
    # sequence parallelism inside the stages (the stage boundary carries the sequence-sharded stream)
    (ParallelPlan(tp=2, sp=True, pp=2, microbatches=4, schedule="gpipe"),
     {**ADAMW, "ffn_kind": "swiglu", "position_embedding": "rope"}),
    (ParallelPlan(tp=2, sp=True, pp=2, microbatches=2, schedule="interleaved", virtual_stages=2), ADAMW),
    # ZeRO-3 inside pipeline stages: blocks reshard after each forward and are re-gathered in the next
    # backward; the unsharded gradients accumulate as under dp x pp. Measured +2.9 % stage 0, -3.1 %
    # stage 1 (500,096 vs 486,088 B; 472,448 vs 487,448 B).
    (ParallelPlan(dp=2, pp=2, zero=3, microbatches=2), ADAMW),
]


@pytest.mark.distributed
@pytest.mark.slow
def test_3d_layouts_on_two_nodes_match_one_process_with_per_rank_estimates(tmp_path):
    results = run_distributed(worker_3d, 4, WORLD4_CASES, str(tmp_path), num_nodes=NODES, timeout_s=300)
    for i, (plan, _) in enumerate(WORLD4_CASES):
        for line in check_3d([per_rank[i] for per_rank in results], plan):
            print(line)


# ------------------------------------------------------------------------------------ budget case
#: The budget case of issue 17: the zoo GPT of 4 layers, h=64, AdamW, per-rank batch 4 x 16 tokens, on
#: 2 x 2 ranks. Without a margin, 2.5 MB chose dp=2 pp=2 with full recompute, said [FITS] and stage 1
#: measured 4,864 B over; 2 MB chose dp=1 tp=2 pp=2 and crashed at setup (TP inside pipeline stages).
BUDGETS = (2_500_000, 2_000_000)
BUDGET_SEQ, BUDGET_BATCH = 16, 4


def budget_worker(rank: int, world: int, root: str) -> list[dict]:
    import lightning as L
    import torch
    from test_strategy_budget import SteadyStepMeter

    from lightning_memplan.strategies import MemplanAutoStrategy
    from lightning_memplan.testing.zoo import GPT, GPTConfig, causal_lm_loss

    class Budgeted(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT(GPTConfig(64, 4, 64, 4, max_positions=BUDGET_SEQ))

        def training_step(self, batch, batch_idx):
            return causal_lm_loss(self.model, *batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    tokens = torch.randint(0, 64, (64, BUDGET_SEQ + 1), generator=torch.Generator().manual_seed(1))
    out = []
    for budget in BUDGETS:
        meter = SteadyStepMeter(seq_len=BUDGET_SEQ, vocab_size=64)
        strategy = MemplanAutoStrategy(memory_budget=budget)
        trainer = L.Trainer(
            accelerator="cpu", devices=world // NODES, num_nodes=NODES, strategy=strategy, max_steps=4,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[meter], default_root_dir=os.path.join(root, str(budget)),
        )
        loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BUDGET_BATCH)
        trainer.fit(Budgeted(), loader)
        out.append({
            "budget": budget, "plan": strategy.applied_plan.describe(), "fits": strategy.decision.fits,
            "estimate": strategy.decision.estimate.total, "measured": meter.report.total,
            "explain": strategy.decision.explain(),
        })
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_a_budget_that_says_fits_holds_when_measured_on_every_rank(tmp_path):
    results = run_distributed(budget_worker, 4, str(tmp_path), num_nodes=NODES, timeout_s=300)
    for rank, cases in enumerate(results):
        for case in cases:
            print(f"rank {rank} budget {case['budget']:,} B: {case['plan']}, estimate {case['estimate']:,} B, "
                  f"measured {case['measured']:,} B ({case['measured'] / case['budget']:.1%} of the budget)")
            assert case["fits"] and "estimate margin" in case["explain"], case
            assert case["measured"] <= case["budget"], (rank, case)


# ------------------------------------------------------------------------------ dp x tp x pp, 8 ranks
#: dp x tp x pp needs 2 x 2 x 2 = 8 processes (2 nodes of 4). On the 2-core CI machine that run takes
#: several minutes, so it is opt-in (MEMPLAN_DISTRIBUTED_8=1); the world-4 cases above cover every pair.
WORLD8_CASES = [(ParallelPlan(dp=2, tp=2, pp=2, microbatches=2), ADAMW)]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MEMPLAN_DISTRIBUTED_8") != "1", reason="8 processes: set MEMPLAN_DISTRIBUTED_8=1")
def test_dp_tp_pp_on_two_nodes_of_four(tmp_path):
    results = run_distributed(worker_3d, 8, WORLD8_CASES, str(tmp_path), num_nodes=NODES, timeout_s=600)
    for line in check_3d([per_rank[0] for per_rank in results], WORLD8_CASES[0][0]):
        print(line)
