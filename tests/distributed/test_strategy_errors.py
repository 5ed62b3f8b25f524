"""Bad input under memplan_auto fails on every rank with an error that names what to change -- never a
hang (each case runs with a 120 s collective timeout and must finish long before it).

Cases, all on two gloo processes: a module whose ``configure_model`` parallelises it in a way that
conflicts with the forced plan (FSDP only, plan wants tp=2: error; plan wants pp=2, which memplan_auto
cannot do to such a module: it applies dp=2 instead and warns why); a
memory budget no layout of this world size fits (the planner's closest plan, its shortfall and the
changes that would fit are in the message); ranks that built different models (the fingerprint
all-gather catches it before any collective of the training step); a sequence-parallel model fed a
sequence length tp does not divide.
"""

from __future__ import annotations

import pytest
from test_strategy_parity import TinyLM, make_trainer, token_data  # noqa: I001
from torch.utils.data import DataLoader, TensorDataset

from lightning_memplan.model.specs import ParallelPlan
from lightning_memplan.testing import run_distributed


class SelfShardedLM(TinyLM):
    """Applies FSDP2 itself in configure_model, the way Lightning's ModelParallelStrategy docs show."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class OddLengthStepLM(TinyLM):
    """Planned from 8-token batches, but its training step drops the last token: 7 tokens reach a
    sequence-parallel model over tp=2."""

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        return super().training_step((idx[:, :-1], targets[:, :-1]), batch_idx)


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects the message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def errors_worker(rank: int, world: int) -> dict:
    from lightning_memplan.strategies import MemplanAutoStrategy

    x, y = token_data()

    def fit(module, strategy):
        make_trainer(strategy, steps=1).fit(module, DataLoader(TensorDataset(x, y), batch_size=4))

    out = {}
    out["self_parallel_tp"] = _error_of(lambda: fit(SelfShardedLM(), MemplanAutoStrategy(plan=ParallelPlan(tp=2))))
    import warnings

    folded = MemplanAutoStrategy(plan=ParallelPlan(pp=2, microbatches=2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["self_parallel_pp"] = _error_of(lambda: fit(SelfShardedLM(), folded))
    out["self_parallel_pp_plan"] = folded.applied_plan
    out["self_parallel_pp_warned"] = any("pp=2 not applied" in str(w.message) for w in caught)
    out["nothing_fits"] = _error_of(lambda: fit(TinyLM(), MemplanAutoStrategy(memory_budget=10_000)))
    out["ranks_disagree"] = _error_of(
        lambda: fit(TinyLM(n_layers=2 + rank), MemplanAutoStrategy(plan=ParallelPlan(dp=2)))
    )
    # Sequence parallelism and a step whose sequence tp does not divide: a ValueError on every rank
    # before any collective (gloo would abort the process on the size mismatch).
    out["sp_odd_length"] = _error_of(
        lambda: fit(OddLengthStepLM(position_embedding="rope"), MemplanAutoStrategy(plan=ParallelPlan(tp=2, sp=True)))
    )
    # The same self-sharding module with a plan it does satisfy trains.
    out["self_parallel_ok"] = _error_of(lambda: fit(SelfShardedLM(), MemplanAutoStrategy(plan=ParallelPlan(dp=2, zero=3))))
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_bad_input_errors_on_every_rank():
    results = run_distributed(errors_worker, 2, timeout_s=120)
    for out in results:
        assert out["self_parallel_tp"].startswith("ValueError")
        assert "tp=2" in out["self_parallel_tp"] and "configure_model" in out["self_parallel_tp"]
        # a forced pp=2 it cannot apply to a self-parallelising module: best applicable plan, and a warning
        assert out["self_parallel_pp"] == "no error"
        assert out["self_parallel_pp_plan"] == ParallelPlan(dp=2, grad_buckets=False)
        msg = out["nothing_fits"]
        assert "ValueError" in msg or "PlanDoesNotFitError" in msg, msg  # PlanDoesNotFitError is a ValueError
        assert "closest" in msg and "budget" in msg and "short by" in msg
        assert out["ranks_disagree"].startswith("RuntimeError") and "disagree" in out["ranks_disagree"]
        assert out["self_parallel_ok"] == "no error"
        assert out["sp_odd_length"].startswith(
            "ValueError: sequence parallelism over tp=2 needs a sequence length divisible by 2, but this batch has 7"
        ), out["sp_odd_length"]
    assert results[0]["ranks_disagree"] == results[1]["ranks_disagree"]
    assert results[0]["self_parallel_pp_warned"]  # rank_zero_warn: rank 0 says what it changed and why
