"""``ParallelPlan.own_units``: the untied embedding and lm_head as FSDP2 units of their own, worked by hand
in the estimate, chosen by ``memplan_auto`` with the same rule it applies, and checked as an input.

The model: L = 2 blocks, h = 64, a = 4, k = 2, f = 172 (SwiGLU), RMSNorm, V = 512, fp32, 2 data-parallel
ranks. One block: q 64*64 + k 64*32 + v 64*32 + o 64*64 + MLP 3*64*172 + two norms 2*64 = 45,440
parameters = 181,760 B. Embedding and lm_head: 512*64 = 32,768 parameters each = 131,072 B; final norm
64 = 256 B. The 2-rank measurement of an HF Llama of this shape is
``tests/distributed/test_hf_estimate_two_ranks.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_memplan.live.layouts import find_layout
from lightning_memplan.model.estimate import estimate_memory
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.parallel.decision import decide
from lightning_memplan.parallel.fsdp import own_units
from lightning_memplan.testing.zoo import GPT, GPTConfig

SPEC = ModelSpec(2, 64, 4, 512, n_kv_heads=2, ffn_hidden=172, ffn_kind="swiglu", norm="rmsnorm")
TRAIN = TrainSpec(micro_batch=2, seq_len=32, precision="32-true")
BLOCK, MATRIX, NORM = 45_440 * 4, 32_768 * 4, 64 * 4
BOTH = ("embedding", "head")


def _comm(plan: ParallelPlan, spec: ModelSpec = SPEC) -> dict[str, int]:
    return {phase: comps["comm"] for phase, comps in estimate_memory(spec, TRAIN, plan).by_phase.items()}


@pytest.mark.parametrize("zero", [0, 3])
def test_the_root_unit_leaves_out_the_parts_with_units_of_their_own(zero: int) -> None:
    # replication (zero=0): FSDP2 over a shard group of one keeps no block's all-gather output in forward;
    # ZeRO-3 keeps the last block's. Backward: root + the current block (+ the prefetched one under ZeRO-3: on a
    # shard group of one FSDP2's unshard copies at wait_for_unshard, so nothing is prefetched) + one block's
    # gradient.
    last_block = BLOCK if zero == 3 else 0
    blocks_in_backward = 3 if zero == 3 else 2
    for units, root in (((), 2 * MATRIX + NORM), (BOTH, NORM), (("head",), MATRIX + NORM)):
        plan = ParallelPlan(dp=2, zero=zero, grad_buckets=False, own_units=units)
        assert _comm(plan) == {"forward": root + last_block, "backward": root + blocks_in_backward * BLOCK,
                               "optimizer": 0}, units
    # a tied matrix is one parameter, which memplan_auto keeps in the root whatever the plan says
    tied = dataclasses.replace(SPEC, tied_embeddings=True)
    assert _comm(ParallelPlan(dp=2, zero=zero, grad_buckets=False, own_units=BOTH), tied)["forward"] == (
        MATRIX + NORM + last_block)


def test_own_units_changes_nothing_without_fsdp2() -> None:
    for plan in (ParallelPlan(dp=2), ParallelPlan(tp=2)):  # DDP buckets; no data parallelism
        units = dataclasses.replace(plan, own_units=BOTH)
        assert estimate_memory(SPEC, TRAIN, units) == estimate_memory(SPEC, TRAIN, plan)


def test_own_units_is_checked_and_kept_in_one_order() -> None:
    assert ParallelPlan(dp=2, own_units=["head", "embedding", "head"]).own_units == BOTH
    plan = ParallelPlan(dp=2, zero=3, own_units=("head",))
    assert ParallelPlan.from_dict(plan.to_dict()) == plan and plan.to_dict()["own_units"] == ["head"]
    with pytest.raises(ValueError, match=r"own_units\[0\]='lm_head' is not supported; use one of 'embedding', 'head'"):
        ParallelPlan(own_units=("lm_head",))
    with pytest.raises(TypeError, match="own_units='head' must be a tuple of part names"):
        ParallelPlan(own_units="head")  # type: ignore[arg-type]


def _gpt(**config: object) -> GPT:
    return GPT(GPTConfig(64, 2, 32, 4, **config))  # type: ignore[arg-type]


def test_memplan_auto_gives_units_to_the_untied_parts_that_train() -> None:
    untied, tied = _gpt(), _gpt(tied_embeddings=True)
    assert own_units(find_layout(untied)) == BOTH
    assert own_units(find_layout(untied), separate_head=False) == ()  # a loss reads lm_head.weight outside
    assert own_units(find_layout(tied)) == ()
    untied.tok_emb.weight.requires_grad_(False)  # frozen (peft LoRA's base): no gradient to reduce, root
    assert own_units(find_layout(untied)) == ("head",)
    assert own_units(None) == ()


def _decide(module: torch.nn.Module, plan: ParallelPlan, **kwargs: object) -> ParallelPlan:
    return decide(
        model_spec=ModelSpec(2, 32, 4, 64), train=TrainSpec(micro_batch=4, seq_len=8), world_size=plan.world_size,
        layout=find_layout(module), module=module, self_parallel=False, forced=plan, forced_source="forced",
        planner=None, **kwargs,  # type: ignore[arg-type]
    ).plan


def test_the_applied_plan_records_the_units_the_strategy_applies() -> None:
    from lightning_memplan.loss import LinearCrossEntropy

    assert _decide(_gpt(), ParallelPlan(dp=2)).own_units == BOTH
    assert _decide(_gpt(), ParallelPlan(dp=2, zero=3)).own_units == BOTH
    assert _decide(_gpt(), ParallelPlan(tp=2)).own_units == ()  # no FSDP2 without data parallelism
    assert _decide(_gpt(), ParallelPlan(dp=2), head_in_root=True).own_units == ()  # Fabric's loop loss
    with_lce = torch.nn.ModuleDict({"model": _gpt(), "loss": LinearCrossEntropy()})
    assert _decide(with_lce, ParallelPlan(dp=2)).own_units == ()  # the loss reads lm_head.weight whole
