"""The memplan_auto mesh on 2 gloo processes: the Lightning-compatible flattened aliases are reached
without PyTorch's deprecated "Slicing a flattened dim from root mesh" path (``DeviceMesh.__getitem__``
warns on every run that slices ``mesh["data_parallel"]``), and they are the meshes the plan asks for."""

from __future__ import annotations

import warnings

import pytest
from test_strategy_parity import TinyLM, make_trainer, token_data  # noqa: I001
from torch.utils.data import DataLoader, TensorDataset

from lightning_memplan.model.specs import ParallelPlan
from lightning_memplan.testing import run_distributed

DEPRECATION = "Slicing a flattened dim"


def fit_and_record_warnings(rank: int, world: int, plan: ParallelPlan) -> dict:
    from lightning_memplan.parallel.mesh import LIGHTNING_DP_ALIAS, LIGHTNING_TP_ALIAS, alias_mesh
    from lightning_memplan.strategies import MemplanAutoStrategy

    strategy = MemplanAutoStrategy(plan=plan)
    x, y = token_data(16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(strategy, steps=2).fit(TinyLM(n_layers=2), DataLoader(TensorDataset(x, y), batch_size=4))
        dp, tp = alias_mesh(strategy.device_mesh, LIGHTNING_DP_ALIAS), alias_mesh(strategy.device_mesh, LIGHTNING_TP_ALIAS)
    return {
        "messages": [str(w.message) for w in caught],
        "dp": (dp.size(), dp.mesh_dim_names),
        "tp": (tp.size(), tp.mesh_dim_names),
        "sampler": strategy.distributed_sampler_kwargs,
    }


@pytest.mark.distributed
def test_mesh_aliases_without_the_deprecated_flattened_slicing():
    dp, tp = 2, 1
    results = run_distributed(fit_and_record_warnings, 2, ParallelPlan(dp=dp), timeout_s=240)
    for rank, result in enumerate(results):
        assert not [m for m in result["messages"] if DEPRECATION in m], result["messages"]
        assert result["dp"] == (dp, ("data_parallel",))
        assert result["tp"] == (tp, ("tensor_parallel",))
        assert result["sampler"] == {"num_replicas": dp, "rank": rank}
