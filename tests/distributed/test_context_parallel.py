"""Context parallelism stays planner-only under memplan_auto, and this test says why on the machine at hand.

PyTorch's ``context_parallel`` (``torch.distributed.tensor.experimental``) is tried on 2 gloo processes
with a causal SDPA call: its ring attention has no sharding rule for the CPU kernel, so it raises
``NotImplementedError`` naming ``aten._scaled_dot_product_flash_attention_for_cpu``. The plan's note
(``mesh.CP_NOT_APPLIED``) says exactly that. If a future PyTorch runs it on CPU, this test fails: then
apply it (shard the sequence buffers in ``training_step``) instead of folding cp into dp.
"""

from __future__ import annotations

import pytest
import torch

from lightning_memplan.model.specs import ParallelPlan
from lightning_memplan.parallel.mesh import CP_NOT_APPLIED, MeshLayout
from lightning_memplan.testing import run_distributed

CPU_KERNEL = "aten._scaled_dot_product_flash_attention_for_cpu"


def try_context_parallel(rank: int, world: int) -> str:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=gen) for _ in range(3))  # [b, heads, s, d]
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
            F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).sum().backward()
    except NotImplementedError as exc:
        return f"NotImplementedError: {exc}"
    return "ran"


@pytest.mark.distributed
def test_context_parallel_does_not_run_on_cpu_so_cp_stays_planner_only():
    results = run_distributed(try_context_parallel, 2, timeout_s=180)
    for outcome in results:
        assert outcome.startswith("NotImplementedError") and CPU_KERNEL in outcome, outcome
    layout = MeshLayout.from_plan(ParallelPlan(dp=1, cp=2))
    assert (layout.dp, layout.world_size) == (2, 2)  # cp ranks become data-parallel ranks
    (note,) = layout.notes
    assert note.startswith("cp=2 is planner-only") and CP_NOT_APPLIED in note and CPU_KERNEL in note
