"""MemoryPlanCallback under Lightning's own ``ModelParallelStrategy`` (not memplan_auto): the module
shards itself in ``configure_model`` (tensor parallel over ``device_mesh["tensor_parallel"]``, the zoo
GPT's attention then holds per-rank head counts), and the callback still estimates every rank: the plan
from the device mesh, the spec from the global (DTensor) shapes with whole-model head counts.

Two gloo processes, tp=2; the estimate is compared with the tensor tracker's smallest steady-step peak
(see ``test_strategy_budget``) within ``ESTIMATE_RTOL``.
"""

from __future__ import annotations

import pytest
from test_strategy_parity import GLOBAL_BATCH, STEPS, LossRecorder, TinyLM, token_data  # noqa: I001
from torch.utils.data import DataLoader, TensorDataset

from lightning_memplan.model.specs import ModelSpec, ParallelPlan
from lightning_memplan.testing import run_distributed

ESTIMATE_RTOL = 0.05


class SelfShardingLM(TinyLM):
    def configure_model(self) -> None:
        from lightning_memplan.live.layouts import find_layout
        from lightning_memplan.parallel.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(self, find_layout(self), self.device_mesh["tensor_parallel"])


def model_parallel_worker(rank: int, world: int, root: str) -> dict:
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_memplan.callbacks import MemoryPlanCallback

    x, y = token_data()
    callback = MemoryPlanCallback(calibrate=False, print_report=False, measure_every_n_steps=1, write_files=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[callback, LossRecorder()], default_root_dir=root,
    )
    module = SelfShardingLM(optimizer="adamw", lr=1e-3)
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH))
    summary = next(r for r in callback.report.epochs[-1].ranks if r.rank == rank)
    best = min((r for r in summary.tracked if not r.warmup and r.measured_peak), key=lambda r: r.measured_peak)
    return {
        "plan": callback.report.run["plan"], "spec": callback.report.run["model_spec"],
        "estimated": best.estimated_peak, "measured": best.measured_peak, "notes": callback.report.notes,
        "heads_after": module.model.blocks[0].attn.n_heads,
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_callback_estimates_under_lightning_model_parallel_strategy(tmp_path):
    results = run_distributed(model_parallel_worker, 2, str(tmp_path), timeout_s=240)
    whole = TinyLM().model.spec()
    for rank, r in enumerate(results):
        assert ParallelPlan.from_dict(r["plan"]).describe() == ParallelPlan(tp=2).describe(), r["plan"]
        spec = ModelSpec.from_dict(r["spec"])
        assert (spec.n_layers, spec.hidden, spec.n_heads, spec.kv_heads, spec.vocab_size) == (
            whole.n_layers, whole.hidden, whole.n_heads, whole.kv_heads, whole.vocab_size), r["spec"]
        assert r["heads_after"] == whole.n_heads // 2  # the module's own per-rank counts are left as they were
        err = r["estimated"] / r["measured"] - 1
        print(f"ModelParallelStrategy tp=2 rank {rank}: estimated {r['estimated']:,} B, measured {r['measured']:,} B ({err:+.1%})")
        assert abs(err) <= ESTIMATE_RTOL, (rank, r)
