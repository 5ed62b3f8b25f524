"""``preserved_run_state`` on a real CUDA device (skipped without one): every device's generator is put
back, and a CUDA step traced or run beside the user's fit leaves its dropout masks as they were."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_memplan.tracking.isolation import preserved_run_state
from lightning_memplan.tracking.trace import trace_memory

pytestmark = pytest.mark.gpu


def test_cuda_generators_are_put_back() -> None:
    torch.cuda.init()
    torch.manual_seed(3)
    expected = torch.rand(4, device="cuda").tolist()
    torch.manual_seed(3)
    with preserved_run_state():
        torch.rand(1000, device="cuda")
        nn.functional.dropout(torch.ones(64, device="cuda"), 0.5)
    assert torch.rand(4, device="cuda").tolist() == expected


def test_a_traced_cuda_step_draws_nothing_from_the_runs_streams() -> None:
    model = nn.Sequential(nn.Embedding(32, 16), nn.Dropout(0.5), nn.Linear(16, 32)).cuda()
    batch = torch.randint(0, 32, (2, 8), device="cuda")
    torch.manual_seed(5)
    expected = (torch.rand(3).tolist(), torch.rand(3, device="cuda").tolist())
    torch.manual_seed(5)
    trace_memory(model, batch, device="cuda")
    trace_memory(model, batch, fake=False)  # the real step runs on a CPU copy
    assert (torch.rand(3).tolist(), torch.rand(3, device="cuda").tolist()) == expected
