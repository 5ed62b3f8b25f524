"""Stack facts (``TrainSpec.framework``) and the pipeline terms they feed, each checked against an
independent reference: torch's own interleaved schedule, Korthikanti et al.'s Table 2, Llama 3's and
torchtitan's stage split, and this project's pipeline strategy."""

from __future__ import annotations

import pytest

from lightning_memplan.model import frameworks, terms
from lightning_memplan.model.estimate import estimate_memory
from lightning_memplan.model.sizes import kernels_of
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec


def _torch_interleaved_peak(p: int, m: int, v: int, rank: int) -> float:
    """Peak chunk forwards held by ``rank`` in torch's own ``ScheduleInterleaved1F1B`` order (the schedule
    memplan_auto runs), in micro-batches of all its v chunks."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    sched = object.__new__(ScheduleInterleaved1F1B)  # the order is pure arithmetic: no process group needed
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches, sched.rank = p, v, m, rank
    sched.number_of_rounds = max(1, m // p)
    sched.microbatches_per_round = m // sched.number_of_rounds
    held = peak = 0
    for action in sched._calculate_single_rank_operations(rank):
        if action is None:
            continue
        if action.computation_type == _ComputationType.FORWARD:
            held += 1
            peak = max(peak, held)
        elif action.computation_type in (_ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_INPUT):
            held -= 1
    return peak / v


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 4, 3), (16, 16, 8), (16, 32, 8)])
def test_interleaved_inflight_matches_torchs_schedule(p, m, v):
    for rank in range(p):
        assert terms.pipeline_inflight_microbatches(rank, p, m, "interleaved", v) == pytest.approx(
            _torch_interleaved_peak(p, m, v, rank)), rank


def test_stage_split_torch_is_the_strategys():
    from lightning_memplan.parallel.pipeline import split_blocks

    for n, k in [(126, 16), (126, 112), (8, 3), (32, 8)]:
        assert frameworks.stage_block_counts(n, k) == [len(r) for r in split_blocks(n, k)]


def test_stage_split_llama3():
    # Llama 3 405B (arXiv 2407.21783 section 3.3.2): 126 blocks on 16 ranks x 8 chunks, the first chunk only
    # the embedding, the last only the output layer; ranks 0 and 15 one block lighter.
    counts = frameworks.stage_block_counts(126, 128, "llama3")
    assert counts[0] == counts[-1] == 0 and set(counts[1:-1]) == {1}
    assert frameworks.rank_block_counts(126, 16, 8, "llama3") == [7] + [8] * 14 + [7]
    assert frameworks.rank_block_counts(126, 16, 1, "llama3") == [7] + [8] * 14 + [7]
    # torchtitan generate_llm_fqn_per_model_part(8, 32, input_weight=1, output_weight=1): 34 units, 4 per
    # stage, the first two stages one more; then the embedding and the head each take one unit
    assert frameworks.stage_block_counts(32, 8, "llama3") == [4, 5, 4, 4, 4, 4, 4, 3]
    assert sum(frameworks.stage_block_counts(126, 16, "llama3")) == 126


def test_megatron_sequence_parallel_reproduces_korthikanti_table2():
    """GPT block (LayerNorm, GELU 4h, MHA, dropout, eager softmax, 16-bit): Megatron's SP saves
    ``34 s b h / t + 5 a s^2 b / t`` [K22 Table 2]; the only extra is LayerNorm's fp32 mean and rstd."""
    model = ModelSpec(4, 1024, 16, 1000, ffn_kind="gelu", norm="layernorm", bias=True, dropout=0.1)
    train = TrainSpec(micro_batch=2, seq_len=512, precision="bf16-true", attention="eager", framework="megatron")
    b, s, t = 2, 512, 8
    got = terms.layer_activation_bytes(model, kernels_of(train), b, s, t=t, sp=True) + terms.eager_attention_bytes(model, kernels_of(train), b, s, t=t)
    k22 = terms.korthikanti_layer_activation_bytes(s, b, model.hidden, model.n_heads, t=t, sp=True)
    stats = 2 * b * s * terms.LAYERNORM_STAT_COUNT * terms.FP32_BYTES // t
    assert got == k22 + stats
    # DTensor SP (the default stack) keeps the gathered inputs of the two column-parallel matmuls whole
    torch_sp = terms.layer_activation_bytes(model, kernels_of(train.replace(framework="torch")), b, s, t=t, sp=True)
    assert torch_sp - terms.layer_activation_bytes(model, kernels_of(train), b, s, t=t, sp=True) == 2 * b * s * model.hidden * 2 * (t - 1) // t


def test_llama3_grads_sharded_per_microbatch():
    """Llama 3's FSDP reduce-scatters each micro-batch's gradients (sharded accumulator); torch's pipeline
    schedule accumulates unsharded gradients until the end of the step."""
    model = ModelSpec(8, 256, 4, 1000, ffn_kind="swiglu", norm="rmsnorm")
    plan = ParallelPlan(4, 1, 2, zero=2, microbatches=4)
    base = TrainSpec(micro_batch=1, seq_len=128)
    torch_est = estimate_memory(model, base, plan, rank=0)
    llama = estimate_memory(model, base.replace(framework="llama3"), plan, rank=0)
    assert torch_est.by_phase["backward"]["grads"] == torch_est.details["local_params"] * 4
    assert llama.by_phase["backward"]["grads"] <= -(-llama.details["local_params"] * 4 // 4)


def test_framework_is_validated():
    with pytest.raises(ValueError, match="framework"):
        TrainSpec(micro_batch=1, seq_len=8, framework="colossalai")  # "deepspeed" is known since issue 27


def test_llama3_context_parallel_all_gather_is_exposed():
    """Llama 3's CP all-gathers K and V, "exposed in the critical path" (arXiv 2407.21783 3.3.2); torch's
    ring overlaps the same volume with the blockwise attention."""
    from lightning_memplan.hardware import HardwareSpec
    from lightning_memplan.planning import predict_step_time

    model, hw = ModelSpec.preset("llama3-8b"), HardwareSpec.preset("h100-sxm", gpus_per_node=8, num_nodes=2)
    train, plan = TrainSpec(micro_batch=1, seq_len=32768), ParallelPlan(1, 8, 1, 2)
    ring = predict_step_time(model, train, hw, plan)
    gather = predict_step_time(model, train.replace(framework="llama3"), hw, plan)
    assert "cp" not in gather.overlapped_s and ring.overlapped_s.get("cp", 0) > 0
    assert gather.exposed_s["cp"] == pytest.approx(ring.exposed_s.get("cp", 0.0) + ring.overlapped_s["cp"])
