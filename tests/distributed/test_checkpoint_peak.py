"""The checkpoint-save peak on 2 gloo ranks: estimated (``estimate_checkpoint_memory``) next to measured
(the package's tensor tracker, ``lightning_memplan.tracking.tracker.TensorTracker``, run by
``MemoryPlanCallback`` around ``trainer.save_checkpoint``), within 10%.

Cases, one fit of one step each with AdamW (so optimizer states exist), then ``trainer.save_checkpoint``:
``memplan_auto`` with FSDP2 (``dp=2, zero=3``) saving a full state dict (``save_distributed_checkpoint=
False``: rank 0 gathers every parameter and state) and a sharded one (DCP); and DDP, whose checkpoint must
be the same with and without the callback (the monitoring never changes the run).
"""

from __future__ import annotations

import os

import pytest
import torch
from test_strategy_parity import TinyLM, make_trainer, token_data  # noqa: I001
from torch.utils.data import DataLoader, TensorDataset

from lightning_memplan.testing import run_distributed

TOLERANCE = 0.10


def _fit_and_save(strategy, path: str, callback) -> None:
    x, y = token_data(8)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    trainer = make_trainer(strategy, steps=1, callbacks=[callback] if callback is not None else [])
    trainer.fit(TinyLM(optimizer="adamw", lr=1e-2), loader)
    trainer.save_checkpoint(path)


def _callback():
    from lightning_memplan import MemoryPlanCallback

    return MemoryPlanCallback(calibrate=False, write_files=False, print_report=False)


def checkpoint_worker(rank: int, world: int, root: str) -> dict:
    from lightning_memplan.model.specs import ParallelPlan
    from lightning_memplan.strategies import MemplanAutoStrategy

    out: dict = {}
    for mode, distributed in (("full", False), ("sharded", True)):
        cb = _callback()
        strategy = MemplanAutoStrategy(plan=ParallelPlan(dp=world, zero=3), save_distributed_checkpoint=distributed)
        _fit_and_save(strategy, os.path.join(root, f"{mode}.ckpt"), cb)
        out[mode] = [c.to_dict() for c in cb.report.latest.checkpoints]
    # DDP: the same fit with and without the callback writes the same checkpoint
    for name, cb in (("ddp_plain", None), ("ddp", _callback())):
        _fit_and_save("ddp", os.path.join(root, f"{name}.ckpt"), cb)
        if cb is not None:
            out["ddp"] = [c.to_dict() for c in cb.report.latest.checkpoints]
    return out


@pytest.mark.distributed
def test_checkpoint_save_peak_within_ten_percent(tmp_path):
    results = run_distributed(checkpoint_worker, 2, str(tmp_path), timeout_s=120)
    rank0 = results[0]
    for mode in ("full", "sharded", "ddp"):
        records = rank0[mode]
        assert sorted(r["rank"] for r in records) == [0, 1], (mode, records)
        for r in records:
            assert r["measurement"] == "tensor_tracker"
            assert r["mode"] == ("plain" if mode == "ddp" else mode)
            est, meas = r["estimated_peak"], r["measured_peak"]
            assert abs(est - meas) <= TOLERANCE * meas, (mode, r)
    full = {r["rank"]: r for r in rank0["full"]}
    # rank 0 holds the gathered full state dict (its peak grows by ~ the whole model's parameters and states),
    # rank 1 one gathered tensor at a time
    assert full[0]["measured_peak"] - full[0]["measured_before"] > 4 * (full[1]["measured_peak"] - full[1]["measured_before"])
    # DDP: the state dicts reference the live tensors; nothing is copied
    for r in rank0["ddp"]:
        assert r["measured_peak"] - r["measured_before"] <= 0.01 * r["measured_peak"]
    plain = torch.load(tmp_path / "ddp_plain.ckpt", weights_only=True)
    measured = torch.load(tmp_path / "ddp.ckpt", weights_only=True)
    assert "MemoryPlanCallback" in "".join(measured["callbacks"]) and not plain["callbacks"]
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "epoch", "global_step", "loops"):
        _assert_equal(plain[key], measured[key])


def _assert_equal(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _assert_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_equal(x, y)
    else:
        assert a == b
