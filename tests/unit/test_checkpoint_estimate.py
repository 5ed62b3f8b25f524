"""``estimate_checkpoint_memory`` by hand, the checkpoint record in the report, and the save wrapper."""

from __future__ import annotations

import pytest

from lightning_memplan.model.checkpoint_estimate import (
    ATOMIC_SAVE_BUFFERS,
    DCP_PLAN_BYTES_PER_ITEM,
    estimate_checkpoint_memory,
)
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.report.records import EpochReport, MemoryReport, RankSummary
from lightning_memplan.report.render import render_markdown

# one block of 2 tensors is beside the point: an explicit parameter count makes the numbers exact
MODEL = ModelSpec(n_layers=2, hidden=64, n_heads=4, vocab_size=128, n_params=100_000)
TRAIN = TrainSpec(micro_batch=2, seq_len=16, precision="32-true", optimizer="adamw")


def test_plain_save_references_the_live_tensors():
    est = estimate_checkpoint_memory(MODEL, TRAIN, ParallelPlan(dp=2), full_state_dict=False, cpu_offload=False,
                                     rank=0, device="cpu")
    n = 100_000
    assert est.mode == "plain" and est.device == 0 and est.host == 0
    assert est.resident == n * 4 + n * 4 + n * 8  # params, grads, AdamW states (fp32)
    assert est.serialization == ATOMIC_SAVE_BUFFERS * (n * 4 + n * 8)  # BytesIO + getvalue() on rank 0
    other = estimate_checkpoint_memory(MODEL, TRAIN, ParallelPlan(dp=2), full_state_dict=False, cpu_offload=False,
                                       rank=1, device="cpu")
    assert other.serialization == 0 and other.device_peak == est.device_peak


def test_full_state_dict_gathers_to_rank_zero():
    plan = ParallelPlan(dp=2, zero=3)
    r0 = estimate_checkpoint_memory(MODEL, TRAIN, plan, full_state_dict=True, cpu_offload=True, rank=0)
    r1 = estimate_checkpoint_memory(MODEL, TRAIN, plan, full_state_dict=True, cpu_offload=True, rank=1)
    assert r0.mode == "full" and r0.full_state_bytes == pytest.approx(100_000 * 12, rel=1e-3)
    # on a GPU: one gathered tensor in flight on the device, the full copy on rank 0's host
    assert r0.device == r1.device == r0.largest_tensor > 0
    assert r0.host == r0.full_state_bytes and r1.host == 0
    assert r0.serialization == ATOMIC_SAVE_BUFFERS * r0.full_state_bytes
    # on the CPU the host copy is the gathered tensor itself
    cpu0 = estimate_checkpoint_memory(MODEL, TRAIN, plan, full_state_dict=True, cpu_offload=True, rank=0, device="cpu")
    assert cpu0.device == cpu0.full_state_bytes and cpu0.host == 0
    # without cpu_offload every rank keeps the full state dict on the device
    no_off = estimate_checkpoint_memory(MODEL, TRAIN, plan, full_state_dict=True, cpu_offload=False, rank=1)
    assert no_off.device == no_off.full_state_bytes


def test_sharded_save_copies_local_shards_and_exchanges_plans():
    plan = ParallelPlan(dp=2, zero=3)
    est = estimate_checkpoint_memory(MODEL, TRAIN, plan, full_state_dict=False, cpu_offload=True, rank=1,
                                     param_tensors=10)
    assert est.mode == "sharded"
    assert est.state_tensors == 10 * 4  # parameter, exp_avg, exp_avg_sq, step
    assert est.device == DCP_PLAN_BYTES_PER_ITEM * 40 * 2
    assert est.host == pytest.approx(100_000 * 12 / 2, rel=1e-3)  # the rank's shards, offloaded


def test_missing_optimizer_states_are_created_by_a_dcp_save():
    plan = ParallelPlan(dp=2, zero=3)
    kw = dict(full_state_dict=False, cpu_offload=True, rank=0, device="cpu", grads_alive=False)
    fresh = estimate_checkpoint_memory(MODEL, TRAIN, plan, optimizer_states=False, **kw)
    stepped = estimate_checkpoint_memory(MODEL, TRAIN, plan, optimizer_states=True, **kw)
    assert fresh.resident == stepped.resident  # _init_optim_state runs a zero-lr step


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"full_state_dict": "yes"}, TypeError, "full_state_dict"),
        ({"rank": 4}, ValueError, "rank"),
        ({"device": "tpu"}, ValueError, "device"),
        ({"param_tensors": 0}, ValueError, "param_tensors"),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, match):
    args = {"full_state_dict": True, "cpu_offload": True, **kwargs}
    with pytest.raises(error, match=match):
        estimate_checkpoint_memory(MODEL, TRAIN, ParallelPlan(dp=2, zero=3), **args)


def test_record_round_trips_and_renders():
    from lightning_memplan.report.checkpoints import CheckpointRecord

    rec = CheckpointRecord(rank=0, epoch=0, step=3, mode="full", full_state_dict=True, cpu_offload=True,
                           estimated_peak=2**20, measured_peak=2**20 + 10, measurement="tensor_tracker")
    epoch = EpochReport(epoch=0, ranks=(RankSummary(rank=0, epoch=0),), checkpoints=(rec,))
    again = EpochReport.from_dict(epoch.to_dict())
    assert again.checkpoints == (rec,)
    assert "step 3" in render_markdown(MemoryReport(epochs=(again,)), units="MiB")
    assert "checkpoints" not in EpochReport(epoch=0, ranks=()).to_dict()  # old reports keep their shape


def test_wrapper_returns_the_result_and_restores():
    from lightning_memplan.monitoring.checkpoint import CheckpointSaves, measured_save, restore_save
    from lightning_memplan.monitoring.options import MonitorOptions
    from lightning_memplan.monitoring.session import MemorySession

    class Owner:
        def save(self, path, *, flag=False):
            if path == "bad":
                raise OSError("disk full")
            return (path, flag)

    owner = Owner()
    session = MemorySession(MonitorOptions(write_files=False, print_report=False))
    saves = CheckpointSaves(session, lambda obj: [obj])

    def context():
        raise RuntimeError("no run yet")  # a failing context must not stop the save

    measured_save(owner, "save", saves, context)
    assert owner.save("x", flag=True) == ("x", True)
    with pytest.raises(OSError, match="disk full"):
        owner.save("bad")
    restore_save(owner, "save")
    assert "save" not in owner.__dict__ and owner.save("y") == ("y", False)
