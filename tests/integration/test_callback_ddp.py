"""MemoryPlanCallback under ``strategy="ddp"`` on two gloo processes: every rank measured, the report
gathers both ranks, a second epoch appends, and across-rank spread matches the per-rank figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_callback_helpers import LitGPT, make_trainer, read_metrics, token_loader

from lightning_memplan.model.estimate import estimate_memory
from lightning_memplan.model.specs import ParallelPlan, TrainSpec
from lightning_memplan.testing.distributed import run_distributed
from lightning_memplan.testing.zoo import gpt2_style

SEQ = {0: 16, 1: 40}  # each rank its own sequence length, so the ranks' memory differs


def _fit(rank: int, world_size: int, root: str) -> dict:
    import torch

    from lightning_memplan.callbacks import MemoryPlanCallback

    torch.manual_seed(0)
    config = gpt2_style()
    cb = MemoryPlanCallback(calibrate=False, print_report=rank == 0, measure_every_n_steps=1)
    trainer = make_trainer(
        root, [cb], max_epochs=2, limit_train_batches=2, strategy="ddp", devices=world_size
    )
    trainer.fit(LitGPT(config), token_loader(config, 2, [SEQ[rank]], 2))
    return {
        "rank": trainer.global_rank,
        "world": trainer.world_size,
        "log_dir": trainer.log_dir,
        "strategy": type(trainer.strategy).__name__,
        "report": cb.report.to_dict(),
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_two_ranks_report_holds_both_ranks_and_every_epoch(tmp_path):
    results = run_distributed(_fit, 2, str(tmp_path), timeout_s=240)
    assert [r["rank"] for r in results] == [0, 1] and {r["strategy"] for r in results} == {"DDPStrategy"}
    assert results[0]["log_dir"] == results[1]["log_dir"]
    log_dir = Path(results[0]["log_dir"])
    data = json.loads((log_dir / "memory_report.json").read_text())
    assert [e["epoch"] for e in data["epochs"]] == [0, 1]
    # Every rank ends with the same gathered report (so a checkpoint from any rank continues it).
    assert results[0]["report"]["epochs"] == results[1]["report"]["epochs"] == data["epochs"]
    assert data["run"]["plan"]["dp"] == 2 and data["run"]["world_size"] == 2
    spec = LitGPT(gpt2_style()).model.spec()
    for epoch in data["epochs"]:
        ranks = epoch["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        for r in ranks:
            s = SEQ[r["rank"]]
            assert r["shapes"] == [[2, s]] and r["steps"] == 2
            train = TrainSpec(
                micro_batch=2, seq_len=s, precision="32-true", optimizer="adamw", optimizer_impl="for_loop"
            )
            assert (
                r["estimated_peak"] == estimate_memory(spec, train, ParallelPlan(dp=2), rank=r["rank"]).total
            )
            assert r["measured_peak"] > 0 and r["reserved"] > 0
        # Longer sequences on rank 1: more memory, both estimated and measured.
        assert ranks[1]["estimated_peak"] > ranks[0]["estimated_peak"]
        assert ranks[1]["measured_peak"] > ranks[0]["measured_peak"]
        # min / max / imbalance (max / mean - 1) recomputed from the per-rank figures.
        values = [r["measured_peak"] for r in ranks]
        spread = epoch["across_ranks"]["measured_peak"]
        assert (spread["min"], spread["max"]) == (min(values), max(values))
        assert spread["imbalance"] == pytest.approx(max(values) / (sum(values) / 2) - 1)
    # Metrics went to the CSV logger (rank 0's values) under the documented names.
    rows = read_metrics(log_dir)
    epoch_rows = [r for r in rows if r.get("memplan/epoch/ranks")]
    assert len(epoch_rows) == 2 and all(float(r["memplan/epoch/ranks"]) == 2 for r in epoch_rows)
    assert {int(r["memplan/seq_len"]) for r in rows if r.get("memplan/seq_len")} == {SEQ[0]}
    assert (log_dir / "memory_report.md").read_text().count("| 1 |") >= 2
