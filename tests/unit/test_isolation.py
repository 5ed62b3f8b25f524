"""``preserved_run_state``: what a monitoring feature runs beside the user's training leaves the random
states, flags and tensors of the run as they were (issue 32); and the tracer uses it on every path."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from lightning_memplan.testing.model_kinds import run_state_snapshot, snapshot_differences
from lightning_memplan.tracking.isolation import preserved_run_state
from lightning_memplan.tracking.trace import calibrate, trace_memory


def _draw() -> tuple:
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def test_every_random_stream_is_put_back_also_after_an_error() -> None:
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    expected = _draw()
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    with preserved_run_state():
        _draw(), _draw()
    assert _draw() == expected
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    with pytest.raises(RuntimeError, match="inside"), preserved_run_state():
        _draw()
        raise RuntimeError("inside")
    assert _draw() == expected


def test_flags_and_gradients_put_back_and_in_place_changes_named() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.1))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    grad = model[0].weight.grad
    before = run_state_snapshot(model, [optimizer])
    with preserved_run_state(model, [optimizer]) as guard:
        model.eval()
        model[0].bias.requires_grad_(False)
        model[0].weight.grad = None
        torch.set_grad_enabled(False)
        torch.set_default_dtype(torch.float64)
    assert model.training and model[2].training and model[0].bias.requires_grad
    assert model[0].weight.grad is grad and torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32
    assert not guard.moved and "training flag of <root>" in guard.restored and "gradient of 0.weight" in guard.restored
    assert snapshot_differences(before, run_state_snapshot(model, [optimizer])) == []
    with preserved_run_state(model, [optimizer]) as guard:
        with torch.no_grad():
            model[0].weight.add_(1.0)
        model[1].running_mean.add_(1.0)
        next(iter(optimizer.state.values()))["exp_avg"].mul_(2.0)
    assert guard.moved == ["parameter 0.weight", "buffer 1.running_mean", "optimizer 0 state 0.exp_avg"]
    moved = snapshot_differences(before, run_state_snapshot(model, [optimizer]))
    assert moved == ["params 0.weight", "buffers 1.running_mean", "optimizers[0] state"]


def test_cuda_is_never_initialised_by_it() -> None:
    initialised = torch.cuda.is_initialized()
    with preserved_run_state():
        pass
    assert torch.cuda.is_initialized() == initialised


class _DropoutLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.drop, self.head = nn.Embedding(32, 8), nn.Dropout(0.5), nn.Linear(8, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.emb(x)))


@pytest.mark.parametrize("fake", [True, False])
def test_traces_draw_nothing_from_the_runs_streams(fake: bool) -> None:
    """A real fallback step runs dropout and draws its synthetic batch: before, on the global generator."""
    model = _DropoutLM()
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    expected = _draw()
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    trace_memory(model, batch_shape=(2, 8), fake=fake)
    calibrate(model, [(1, 8), (2, 8)], fake=fake)
    assert _draw() == expected
