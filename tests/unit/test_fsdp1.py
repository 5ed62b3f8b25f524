"""FSDP1 (Lightning's ``FSDPStrategy``): the plan read from each sharding strategy, the flat-parameter terms
against a hand computation, and what ``TrainSpec(framework="fsdp1")`` changes in the estimate."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lightning_memplan.live import fsdp1_notes, infer_plan, infer_train_spec, is_fsdp1
from lightning_memplan.model import terms
from lightning_memplan.model.estimate import estimate_memory
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec

IDS = torch.zeros(2, 8, dtype=torch.long)


def _trainer(strategy, world):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    return SimpleNamespace(strategy=strategy, world_size=world, precision="32-true", accumulate_grad_batches=1,
                           optimizers=[opt])


@pytest.mark.parametrize(
    ("kwargs", "plan", "described"),
    [
        ({}, ParallelPlan(dp=8, zero=3), "FULL_SHARD"),
        ({"sharding_strategy": "SHARD_GRAD_OP"}, ParallelPlan(dp=8, zero=2), "SHARD_GRAD_OP"),
        ({"sharding_strategy": "NO_SHARD"}, ParallelPlan(dp=8, grad_buckets=False), "NO_SHARD"),
        # HYBRID: sharded within the (replicate, shard) mesh's shard dimension, replicated across it
        ({"sharding_strategy": "HYBRID_SHARD", "device_mesh": (2, 4)}, ParallelPlan(dp=4, zero=3), "replicated x2"),
        ({"sharding_strategy": "_HYBRID_SHARD_ZERO2", "device_mesh": (4, 2)}, ParallelPlan(dp=2, zero=2),
         "replicated x4"),
    ],
)
def test_plan_from_each_sharding_strategy(kwargs, plan, described):
    from lightning.pytorch.strategies import FSDPStrategy

    got, how = infer_plan(_trainer(FSDPStrategy(**kwargs), world=8))
    assert got == plan and described in how, (got, how)


def test_subclass_and_train_spec_are_fsdp1():
    from lightning.pytorch.strategies import FSDPStrategy

    class MyFSDP(FSDPStrategy):  # a subclass (e.g. one that runs FSDP1 on the CPU) is still FSDP1
        pass

    assert is_fsdp1(MyFSDP()) and not is_fsdp1(SimpleNamespace())
    assert infer_plan(_trainer(MyFSDP(sharding_strategy="SHARD_GRAD_OP"), world=2))[0] == ParallelPlan(dp=2, zero=2)
    assert infer_plan(_trainer(MyFSDP(), world=1))[0] == ParallelPlan()
    running = MyFSDP(parallel_devices=[torch.device("cpu")] * 2)
    assert infer_train_spec(_trainer(running, world=2), IDS).framework == "fsdp1"


def test_flat_param_terms_by_hand():
    # a unit of 10 elements over 4 ranks: padded to 12, each rank keeps 3 (the last one 1 + 2 padding)
    assert terms.fsdp1_padded_numel(10, 4) == 12
    assert terms.fsdp1_shard_numel(10, 4) == 3
    assert terms.fsdp1_padded_numel(12, 4) == 12 and terms.fsdp1_shard_numel(12, 4) == 3
    assert terms.fsdp1_padded_numel(10, 1) == 10 and terms.fsdp1_shard_numel(10, 1) == 10
    # units of 10, 10 and 7 elements over 4 ranks: 3 + 3 + 2
    assert terms.fsdp1_rank_flat_numel([10, 10, 7], 4) == 8


SPEC = ModelSpec(n_layers=3, hidden=20, n_heads=4, vocab_size=51, max_positions=16)  # odd unit sizes
TRAIN = TrainSpec(micro_batch=2, seq_len=16, precision="32-true", optimizer="adamw", device="cpu")


def test_estimate_shards_padded_flat_params_per_unit():
    d = 3
    fsdp1 = estimate_memory(SPEC, TRAIN.replace(framework="fsdp1"), ParallelPlan(dp=d, zero=3), rank=0)
    local = terms.param_count(SPEC)
    unit = terms.layer_param_count(SPEC)
    root = local - SPEC.n_layers * unit
    assert unit % d and root % d  # padding is exercised
    kept = SPEC.n_layers * math.ceil(unit / d) + math.ceil(root / d)
    assert fsdp1.params == kept * terms.FP32_BYTES  # every unit padded separately, not ceil(N / d)
    assert fsdp1.by_phase["backward"]["grads"] <= fsdp1.params
    fsdp2 = estimate_memory(SPEC, TRAIN, ParallelPlan(dp=d, zero=3), rank=0)
    assert fsdp2.params == math.ceil(local * terms.FP32_BYTES / d) < fsdp1.params


def test_estimate_shard_grad_op_and_no_shard():
    d = 2
    unit_bytes = terms.layer_param_count(SPEC) * terms.FP32_BYTES
    local_bytes = terms.param_count(SPEC) * terms.FP32_BYTES
    zero2 = {fw: estimate_memory(SPEC, TRAIN.replace(framework=fw), ParallelPlan(dp=d, zero=2), rank=0)
             for fw in ("torch", "fsdp1")}
    # FSDP1 keeps every unit's unsharded flat parameter from forward to backward and nothing else;
    # FSDP2 also keeps the last unit's all-gather output
    assert zero2["fsdp1"].by_phase["forward"]["comm"] == local_bytes
    assert zero2["torch"].by_phase["forward"]["comm"] == local_bytes + unit_bytes
    # NO_SHARD: computes on the flat parameter, all-reduces its gradient in place: no buffer
    no_shard = estimate_memory(SPEC, TRAIN.replace(framework="fsdp1"), ParallelPlan(dp=d, grad_buckets=False))
    assert all(no_shard.by_phase[p]["comm"] == 0 for p in no_shard.by_phase)
    assert no_shard.params == local_bytes
    # FSDP1 has no DDP buckets whatever grad_buckets says (the CLI's --framework fsdp1 --zero 0)
    bucketed = estimate_memory(SPEC, TRAIN.replace(framework="fsdp1"), ParallelPlan(dp=d))
    assert bucketed.total == no_shard.total
    # FULL_SHARD matches FSDP2's unit accounting when nothing needs padding
    even = ModelSpec(n_layers=2, hidden=32, n_heads=4, vocab_size=64, max_positions=16)
    a, b = (estimate_memory(even, TRAIN.replace(framework=fw), ParallelPlan(dp=2, zero=3)) for fw in ("torch", "fsdp1"))
    assert a.total == b.total


def test_fsdp1_layouts_it_cannot_run_are_refused():
    with pytest.raises(ValueError, match=r"framework='fsdp1'.*tp=2"):
        estimate_memory(SPEC, TRAIN.replace(framework="fsdp1"), ParallelPlan(dp=2, tp=2, zero=3))


def test_notes_name_what_is_approximated():
    class FSDPStrategy:  # recognised by name, as Lightning's (Trainer's or Fabric's)
        sharding_strategy = "HYBRID_SHARD"
        cpu_offload = SimpleNamespace(offload_params=True)
        model = None

    notes = fsdp1_notes(FSDPStrategy(), torch.nn.Linear(2, 2))
    assert any("cpu_offload" in n and "host memory" in n for n in notes), notes
    assert any("HYBRID_SHARD" in n and "replicates" in n for n in notes), notes
    assert fsdp1_notes(SimpleNamespace(), None) == []
