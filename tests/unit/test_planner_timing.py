"""Pure parts of the planner, hand-checked: FLOP counts, collectives, bubble, step time, budget,
search-space rules and the ``allow`` forms."""

from __future__ import annotations

import pytest

from lightning_memplan.hardware import HardwareSpec
from lightning_memplan.model import terms
from lightning_memplan.model.sizes import kernels_of
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.planning import (
    CUDA_CONTEXT_BYTES,
    NCCL_BYTES_PER_GROUP,
    Allow,
    bubble_fraction,
    bubble_overhead,
    memory_budget,
    predict_step_time,
)
from lightning_memplan.planning import flops as F
from lightning_memplan.planning.comm import (
    COLLECTIVE_BW_EFFICIENCY,
    INTER_NODE_BW_EFFICIENCY,
    INTER_NODE_LATENCY_S,
    INTRA_NODE_LATENCY_S,
    all_reduce_time,
    group_link,
    reduce_scatter_time,
)
from lightning_memplan.planning.space import divisors, enumerate_layouts, micro_batch_options

GiB = 2**30


def _gpt(L=24, h=2304, a=24, V=51200):
    # Megatron's GPT shape: no biases counted, gelu 4h MLP, multi-head attention -> P_layer = 12 h^2.
    return ModelSpec(L, h, a, V, ffn_kind="gelu", bias=False)


def test_flops_match_narayanan_eq3():
    """[N21] eq. (3): F = 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) without recomputation and
    96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with full recomputation, per iteration of B sequences."""
    m, s, B = _gpt(), 2048, 512
    n_l, h, V = m.n_layers, m.hidden, m.vocab_size
    no_rc = 72 * B * s * n_l * h**2 * (1 + s / (6 * h) + V / (12 * n_l * h))
    full = 96 * B * s * n_l * h**2 * (1 + s / (6 * h) + V / (16 * n_l * h))
    per_tok = F.model_flops_per_token(m, s)
    assert per_tok * B * s == pytest.approx(no_rc, rel=1e-12)
    assert (per_tok + F.recompute_flops_per_token(m, s, "full")) * B * s == pytest.approx(full, rel=1e-12)


def test_flops_palm_form_and_selective():
    m, s = _gpt(L=2, h=64, a=4, V=100), 32
    # PaLM: 6N + 12 L h s with N = matmul weights (2 blocks of 12 h^2 plus the V x h head)
    n = 2 * 12 * 64**2 + 100 * 64
    assert F.model_flops_per_token(m, s) == 6 * n + 12 * 2 * 64 * 32
    assert F.recompute_flops_per_token(m, s, "selective") == 2 * 4 * s * 64  # attention core forward
    assert F.recompute_flops_per_token(m, s, "none") == 0
    with pytest.raises(ValueError, match="recompute"):
        F.recompute_flops_per_token(m, s, "some")


def test_bubble_forms():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)  # (p-1)/(m+p-1)
    assert bubble_overhead(4, 8) == pytest.approx(3 / 8)  # (p-1)/m of the ideal time
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)  # interleaved: (p-1)/(v m + p - 1)
    assert bubble_overhead(4, 8, 2) == pytest.approx(3 / 16)  # (p-1)/(v m)
    assert bubble_fraction(1, 8) == 0.0


def test_collectives_and_links():
    hw = HardwareSpec.preset("a100-80gb", gpus_per_node=8, num_nodes=2)
    inside, across = group_link(hw, 1, 8), group_link(hw, 1, 16)
    assert not inside.inter_node and inside.bw == 300e9
    assert across.inter_node and across.bw == 25e9
    assert group_link(hw, 8, 2).inter_node  # a dp group of 2 with tp=8 below it spans both nodes
    nbytes = 1e9
    expect = 2 * 7 / 8 * nbytes / (COLLECTIVE_BW_EFFICIENCY * 300e9) + 2 * 7 * INTRA_NODE_LATENCY_S
    assert all_reduce_time(nbytes, 8, inside) == pytest.approx(expect)
    expect = 15 / 16 * nbytes / (INTER_NODE_BW_EFFICIENCY * 25e9) + 15 * INTER_NODE_LATENCY_S
    assert reduce_scatter_time(nbytes, 16, across) == pytest.approx(expect)
    assert all_reduce_time(nbytes, 1, inside) == 0.0


def test_single_device_step_time_by_hand():
    """One GPU, no parallelism: step = tokens x (GEMM FLOPs / (peak e_gemm) + causal half of the
    attention FLOPs / (peak e_attn) + element-wise bytes / HBM) + lm_head + optimizer step."""
    from lightning_memplan.planning import efficiency as E

    m = _gpt(L=4, h=512, a=8, V=1000)
    t = TrainSpec(micro_batch=2, seq_len=256, precision="bf16-mixed", grad_accumulation=3)
    hw = HardwareSpec.preset("h100-sxm")
    st = predict_step_time(m, t, hw, ParallelPlan())
    tokens, mb = 2 * 256 * 3, 2 * 256
    e = E.GEMM_PEAK_FRACTION["hopper"] / (1 + E.GEMM_TILE / mb + E.GEMM_TILE / 512)  # narrowest width h = 512
    block = (F.layer_matmul_flops_per_token(m) / (989.5e12 * e)
             + 0.5 * F.attention_flops_per_token(m, 256)
             / (989.5e12 * E.ATTENTION_PEAK_FRACTION["hopper"] / (1 + E.ATTENTION_HALF_LENGTH / 256))
             + (375 * 512 + 30 * 2048) / (3.35e12 * 0.8))
    e_head = E.GEMM_PEAK_FRACTION["hopper"] / (1 + E.GEMM_TILE / mb + E.GEMM_TILE / 1000)
    compute = tokens * (4 * block + F.head_flops_per_token(m) / (989.5e12 * e_head))
    n = m.num_params
    optimizer = n * (2 * (4 + 8 + 0) + 4) / (3.35e12 * 0.8)  # fp32 params+grads, two fp32 Adam states
    assert st.tokens == tokens
    assert st.compute_s == pytest.approx(compute)
    assert st.optimizer_s == pytest.approx(optimizer)
    assert st.total_s == pytest.approx(compute + optimizer)
    assert st.bubble_s == 0 and not st.exposed_s
    assert st.mfu == pytest.approx(st.model_flops / (st.total_s * 989.5e12))


def test_tensor_parallel_comm_and_bubble_terms():
    m = _gpt(L=8, h=1024, a=16, V=1000)
    t = TrainSpec(micro_batch=1, seq_len=512)
    hw = HardwareSpec.preset("a100-80gb", gpus_per_node=8)
    plan = ParallelPlan(1, 4, 2, microbatches=8)
    st = predict_step_time(m, t.replace(loss="vocab_parallel"), hw, plan)
    link = group_link(hw, 1, 4)
    per_ar = all_reduce_time(1 * 512 * 1024 * 2, 4, link)  # b s h in bf16
    assert st.exposed_s["tp"] == pytest.approx(8 * 4 * 4 * per_ar)  # m x layers/stage x 4 all-reduces
    slot = st.total_s - st.exposed_s.get("dp", 0) - st.optimizer_s
    assert st.bubble_s == pytest.approx(slot * bubble_fraction(2, 8))


def test_cross_node_tp_is_priced_at_network_bandwidth():
    m = ModelSpec(8, 4096, 32, 32000)
    t = TrainSpec(micro_batch=1, seq_len=2048, loss="vocab_parallel")
    hw = HardwareSpec.preset("h100-sxm", gpus_per_node=8, num_nodes=2)
    inside = predict_step_time(m, t, hw, ParallelPlan(2, 8))
    across = predict_step_time(m, t, hw, ParallelPlan(1, 16))
    ratio = hw.intra_node_bw / hw.inter_node_bw  # 450 / 50
    assert across.exposed_s["tp"] > 0.5 * ratio * inside.exposed_s["tp"]
    assert across.total_s > inside.total_s


def test_chunk_size_mirrors_the_loss_auto_rule():
    torch = pytest.importorskip("torch")
    from lightning_memplan.loss.options import auto_chunk_size

    for V, h, n, prec, dtype in [(128256, 4096, 8192, "bf16-mixed", torch.bfloat16), (50257, 768, 4096, "32-true", torch.float32),
                                 (32000, 4096, 1024, "bf16-true", torch.bfloat16), (128256, 1024, 131072, "bf16-mixed", torch.bfloat16)]:
        m = ModelSpec(2, h, 8, V)
        t = TrainSpec(micro_batch=1, seq_len=n, precision=prec)
        assert terms.planned_loss_chunk_tokens(m, kernels_of(t), n) == auto_chunk_size(n, h, V, dtype)
        cpu = t.replace(device="cpu")
        assert terms.planned_loss_chunk_tokens(m, kernels_of(cpu), n) == auto_chunk_size(n, h, V, dtype, device="cpu")


def test_budget_terms_by_hand():
    hw = HardwareSpec.preset("h100-sxm", gpus_per_node=8, num_nodes=2)
    b = memory_budget(hw, ParallelPlan(2, 8), headroom=0.1)
    device = 80 * GiB
    expect = device - round(0.1 * device) - CUDA_CONTEXT_BYTES - 2 * NCCL_BYTES_PER_GROUP  # no flat fragmentation term
    assert b.budget == expect and b.nccl == 2 * NCCL_BYTES_PER_GROUP
    # dp x cp needs its own gradient group on top of the dp and cp groups
    assert memory_budget(hw, ParallelPlan(2, 1, 1, 8), headroom=0.1).nccl == 3 * NCCL_BYTES_PER_GROUP
    explicit = memory_budget(hw, ParallelPlan(16), headroom=0.1, explicit=50 * GiB)
    assert explicit.budget == 50 * GiB and explicit.explicit and "memory_budget given" in explicit.describe()


def test_allow_forms():
    a = Allow.parse(("dp", "fsdp", "tp", "pp"))
    assert a.dp is None and a.tp is None and a.pp is None and a.cp == (1,) and a.zero == (0, 2, 3)
    only_tp = Allow.parse(["tp"])
    assert only_tp.dp == (1,) and only_tp.zero == (0,)
    d = Allow.parse({"tp": [1, 2], "recompute": ["none"], "zero": 3, "micro_batch": [1]})
    assert d.tp == (1, 2) and d.recompute == ("none",) and d.zero == (3,) and d.micro_batch == (1,)
    assert Allow.parse("dp,zero1") == Allow(dp=None, tp=(1,), pp=(1,), cp=(1,), zero=(0, 1))
    with pytest.raises(ValueError, match="'megatron'"):
        Allow.parse(("dp", "megatron"))
    with pytest.raises(ValueError, match="unknown keys"):
        Allow.parse({"tensor": [2]})
    with pytest.raises(ValueError, match="recompute"):
        Allow.parse({"recompute": ["sometimes"]})
    with pytest.raises(TypeError):
        Allow.parse(3.5)


def test_enumeration_rules_and_reasons():
    m = ModelSpec(4, 640, 40, 1000, n_kv_heads=8)
    t = TrainSpec(micro_batch=1, seq_len=1000)
    layouts, rejected = enumerate_layouts(m, t, 16, Allow(), global_batch=24)
    reasons = [r for _, _, r in rejected]
    assert "n_heads=40 not divisible by tp=16" in reasons
    assert "n_kv_heads=8 not divisible by tp=5" not in reasons  # 5 does not divide 16: never tried
    assert "pp=8 > n_layers=4: a stage needs a block" in reasons
    assert any("global_batch=24 not divisible by dp=16" == r for r in reasons)
    assert any(r.startswith("seq_len=1000 not divisible by 2*cp=16") for r in reasons)
    for lc in layouts:
        assert lc.dp * lc.tp * lc.pp * lc.cp == 16
        assert 24 % lc.dp == 0 and lc.dp * lc.b * lc.m == 24
        assert 40 % lc.tp == 0 and 8 % lc.tp == 0 and lc.pp <= 4
        if lc.schedule == "interleaved":
            assert 4 % (lc.pp * lc.v) == 0 and lc.m % lc.pp == 0
        if lc.tp == 1:
            assert "vocab_parallel" not in lc.losses and lc.sps == (False,)
        if lc.dp * lc.cp == 1:
            assert lc.zeros == (0,)


def test_micro_batch_options():
    assert micro_batch_options(24, 3, None) == [1, 2, 3, 4, 8]
    assert micro_batch_options(24, 5, None) == [1, 2, 4, 8]
    assert micro_batch_options(24, 1, (3, 5)) == [3]
    assert divisors(12) == [1, 2, 3, 4, 6, 12]


def test_fsdp_inside_a_pipeline_reduces_once_per_step_not_per_micro_batch():
    """torch.distributed.pipelining runs every micro-batch's backward with gradient sync off and reduces once
    after the last (torch 2.13 pipelining/stage.py, backward_maybe_with_nosync / perform_reduce_grad): under
    ZeRO-2 (gathered once, never resharded before that reduce) the exposed data-parallel time of a pipelined
    step does not grow with the micro-batches; without a pipeline, gradient accumulation re-gathers and
    reduce-scatters per micro-batch, so it grows with them."""
    m = ModelSpec(n_layers=8, hidden=1024, n_heads=16, vocab_size=32000)
    t = TrainSpec(micro_batch=1, seq_len=1024, precision="bf16-mixed")
    hw = HardwareSpec.preset("h100-sxm", gpus_per_node=8)
    piped = [predict_step_time(m, t, hw, ParallelPlan(dp=4, pp=2, zero=2, microbatches=k)).exposed_s["dp"]
             for k in (2, 8)]
    assert piped[0] > 0
    assert piped[0] == pytest.approx(piped[1], rel=1e-9)
    flat = [predict_step_time(m, t.replace(grad_accumulation=k), hw, ParallelPlan(dp=4, zero=2)).exposed_s["dp"]
            for k in (1, 4)]
    assert flat[1] > 1.5 * flat[0]
