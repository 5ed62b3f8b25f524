"""The trace of a manually optimised step (``monitoring/manual.py``): one trace optimizer per real optimizer,
each over the copy's parameters its real one holds, the gradients left alive as Lightning leaves them.

The reference is the real module's own optimizers (their parameter groups by position) and a real step of it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_memplan.live.optimizer import optimizer_factory
from lightning_memplan.monitoring.manual import manual_optimization_trace
from lightning_memplan.tracking.trace import trace_memory


class TwoNets(nn.Module):
    """Two networks stepped by two optimizers in one ``training_step`` (a GAN's shape)."""

    automatic_optimization = False

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
        self.d = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt_g, opt_d = self.optimizers()
        fake = self.g(batch)
        opt_d.zero_grad()
        d_loss = self.d(batch).mean() - self.d(fake.detach()).mean()
        self.manual_backward(d_loss)
        opt_d.step()
        opt_g.zero_grad()
        g_loss = self.d(fake).mean()
        self.manual_backward(g_loss)
        opt_g.step()
        return (d_loss + g_loss).detach()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.Adam(self.g.parameters(), lr=1e-3),
                torch.optim.SGD([{"params": self.d[0].parameters(), "momentum": 0.9},
                                 {"params": self.d[2].parameters()}], lr=1e-2)]


def _factories(module: TwoNets) -> list[Any]:
    own = list(module.parameters())
    return [optimizer_factory(o, module_params=own) for o in module.configure_optimizers()]


def test_each_trace_optimizer_holds_what_its_real_one_holds() -> None:
    module, copy = TwoNets(), TwoNets()
    real = module.configure_optimizers()
    index = {id(p): i for i, p in enumerate(module.parameters())}
    copy_index = {id(p): i for i, p in enumerate(copy.parameters())}
    for r, make in zip(real, _factories(module), strict=True):
        b = make(copy.parameters())
        assert type(r) is type(b)
        assert [[index[id(p)] for p in g["params"]] for g in r.param_groups] == \
            [[copy_index[id(p)] for p in g["params"]] for g in b.param_groups]
        assert [g.get("momentum") for g in r.param_groups] == [g.get("momentum") for g in b.param_groups]
    make_all, _ = manual_optimization_trace(_factories(module))
    assert [type(o) for o in make_all(copy.parameters())] == [torch.optim.Adam, torch.optim.SGD]  # all tracked
    outside = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)  # a parameter the module does not have
    assert optimizer_factory(outside, module_params=list(module.parameters())) is None


def test_a_traced_step_steps_both_optimizers_and_keeps_the_gradients() -> None:
    torch.manual_seed(0)
    module = TwoNets()
    optimizer, loss_fn = manual_optimization_trace(_factories(module))
    result = trace_memory(module, example_input=torch.randn(4, 8), optimizer=optimizer, loss_fn=loss_fn, fake=False,
                          steps=2)
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    peak = result.report.peak
    # Adam's two states of g and SGD's momentum of d's first layer (d's second group has none)
    states = 2 * sum(p.numel() * 4 for p in module.g.parameters()) + sum(p.numel() * 4 for p in module.d[0].parameters())
    assert peak["params"] == weights
    assert states <= result.report.by_phase["optimizer"]["optimizer"] <= states + 64  # + Adam's step counters
    # Lightning calls neither zero_grad nor step after a manual training_step: every gradient of the last
    # step is alive at its end (the trace's own zero_grad would free the first optimizer's)
    assert result.report.current["grads"] == weights


def test_no_optimizer_is_refused() -> None:
    with pytest.raises(ValueError, match="optimizers"):
        manual_optimization_trace([])
