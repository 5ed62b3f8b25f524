"""Hand-worked numbers for every term of the memory model (each expected value worked in the test)."""

import pytest

from lightning_memplan.model import ModelSpec, TrainSpec, terms
from lightning_memplan.model.sizes import kernels_of, optimizer_bytes, precision_bytes

GB = 10**9
GiB = 2**30


def test_param_count_matches_published_sizes():
    # GPT-2 small: wte 50257*768 + wpe 1024*768 + 12 blocks + ln_f; HF reports 124,439,808.
    assert ModelSpec.preset("gpt2").num_params == 124_439_808
    # Llama-2-7B: 6,738,415,616 parameters (HF model card / safetensors index).
    assert ModelSpec.preset("llama-7b").num_params == 6_738_415_616
    # Llama-3-8B: 8,030,261,248 (HF safetensors index).
    assert ModelSpec.preset("llama3-8b").num_params == 8_030_261_248


def test_layer_param_count_term_by_term():
    m = ModelSpec(2, 64, 4, 100, n_kv_heads=2, ffn_hidden=96, ffn_kind="swiglu", norm="rmsnorm", bias=False)
    dh = 64 // 4
    attn = 64 * 4 * dh + 2 * 64 * 2 * dh + 4 * dh * 64  # q, k, v (GQA: 2 kv heads), o
    mlp = 3 * 64 * 96  # gate, up, down
    norms = 2 * 64  # two RMSNorm weights
    assert terms.layer_param_count(m) == attn + mlp + norms
    assert terms.param_count(m) == 100 * 64 + 2 * (attn + mlp + norms) + 64 + 100 * 64


def test_sixteen_n_rule_seed_004():
    # Seed 004 section 9.1.2: 2N params + 2N grads + 8N Adam (m, v) + 4N fp32 master = 16N; 7B -> 112 GB.
    train = TrainSpec(micro_batch=1, seq_len=1, precision="bf16-true", master_weights=True)
    states = terms.model_state_bytes(7 * 10**9, precision_bytes(train), optimizer_bytes(train).per_param)
    assert states == {"params": 14 * GB, "grads": 14 * GB, "optimizer": 56 * GB, "master": 28 * GB}
    assert sum(states.values()) == 112 * GB


def test_ten_n_with_eight_bit_adam_seed_004():
    # (2 + 2 + 1 + 1 + 4) N = 10N = 70 GB for 7B.
    train = TrainSpec(micro_batch=1, seq_len=1, precision="bf16-true", master_weights=True, optimizer="adamw8bit")
    assert sum(terms.model_state_bytes(7 * 10**9, precision_bytes(train), optimizer_bytes(train).per_param).values()) == 70 * GB


def test_lightning_bf16_mixed_is_not_16n():
    # Lightning's bf16-mixed: fp32 params (4N) + fp32 grads (4N) + fp32 Adam (8N), no separate master,
    # plus autocast's bf16 copies of the matmul weights (2N) during forward/backward.
    train = TrainSpec(micro_batch=1, seq_len=1, precision="bf16-mixed")
    n = 1000
    assert terms.model_state_bytes(n, precision_bytes(train), optimizer_bytes(train).per_param) == {"params": 4000, "grads": 4000, "optimizer": 8000, "master": 0}
    assert terms.autocast_copy_bytes(n, precision_bytes(train)) == 2000
    assert terms.autocast_copy_bytes(n, precision_bytes(train.replace(precision="32-true"))) == 0


def test_logits_128k_by_128k_seed_000():
    # Seed 000: B=1, S=128K, V=128K in bf16 is 32 GiB of logits; the .float() copy adds 64 GiB.
    model = ModelSpec(1, 128, 1, 128 * 1024)
    train = TrainSpec(micro_batch=1, seq_len=128 * 1024, precision="bf16-true", loss="fp32_upcast")
    elems = 128 * 1024 * 128 * 1024
    assert elems * 2 == 32 * GiB
    assert elems * 4 == 64 * GiB  # the .float() copy
    out = terms.logits_bytes(model, kernels_of(train), 128 * 1024)
    # forward: bf16 logits (32) + the copy (64) while .float() runs; then the rebinding frees the bf16
    # logits and log_softmax adds fp32 log-probabilities (64): peak max(32 + 64, 64 + 64) = 128 GiB.
    assert out["forward"] == max(32 + 64, 64 + 64) * GiB
    # held until backward: the log-probabilities; backward: log-probs + their grad + the logits' grad.
    assert out["held"] == 64 * GiB
    assert out["backward"] == 3 * 64 * GiB
    # Under autocast the naive loss keeps the caller's bf16 logits while cross_entropy upcasts a copy.
    mixed = terms.logits_bytes(model, kernels_of(train.replace(precision="bf16-mixed", loss="naive")), 128 * 1024)
    assert mixed["forward"] == (32 + 64 + 64) * GiB
    # vocab-parallel over t=8 (local logits, no .float() copy): bf16 logits + bf16 log-probs, / 8.
    vp = terms.logits_bytes(model, kernels_of(train.replace(loss="vocab_parallel")), 128 * 1024, vocab_shard=8)
    assert vp["forward"] == (32 + 32) * GiB // 8
    # chunked (LinearCrossEntropy) with 4096-token chunks: one fp32 [4096, V] buffer and its bf16 copy,
    # the gradients it computes in forward (bf16 hidden grad [S, h], fp32 weight grad [V, h]) and one
    # 16 MiB weight-gradient block: independent of S * V.
    ch = terms.logits_bytes(model, kernels_of(train.replace(loss="chunked", loss_chunk_size=4096)), 128 * 1024)
    v, h, s = 128 * 1024, 128, 128 * 1024
    assert ch["forward"] == 4096 * v * (4 + 2) + s * h * 2 + v * h * 4 + min(v * h * 2, 16 * 2**20)
    assert ch["forward"] < out["forward"] / 20
    # On CPU the 16-bit GEMMs run in fp32 (terms.loss_gemm_bytes): the working set is the fp32 buffer
    # alone, and fp32 copies of W and of the hidden states plus one [chunk, h] fp32 product join it.
    cpu = terms.logits_bytes(model, kernels_of(train.replace(loss="chunked", loss_chunk_size=4096, device="cpu")), s)
    assert cpu["forward"] == 4096 * v * 4 + s * h * 2 + v * h * 4 + (v + s) * h * 4 + 4096 * h * 4
    assert cpu["held"] == ch["held"] == s * h * 2 + v * h * 4


S, B, H, A = 2048, 4, 4096, 32
SBH = S * B * H


@pytest.mark.parametrize(
    ("t", "sp", "recompute", "expected"),
    [
        (1, False, "none", SBH * (34 + 5 * A * S / H)),  # 114 * sbh
        (8, False, "none", SBH * (10 + 24 / 8 + 5 * A * S / (H * 8))),  # 10 + 3 + 10 = 23 sbh
        (8, True, "none", SBH / 8 * (34 + 5 * A * S / H)),  # 114/8 sbh
        (8, False, "selective", SBH * (10 + 24 / 8)),
        (8, True, "selective", SBH * 34 / 8),
        (1, False, "full", 2 * SBH),
        (8, True, "full", 2 * SBH / 8),
    ],
)
def test_korthikanti_table_2(t, sp, recompute, expected):
    got = terms.korthikanti_layer_activation_bytes(S, B, H, A, t=t, sp=sp, recompute=recompute)
    assert got == pytest.approx(expected, rel=1e-12)


def test_korthikanti_seed_004_worked_example():
    # Seed 004: 34 bytes x 8192 tokens x 4096 x 32 layers ~ 3.7e10 bytes (~34 GB) without the attention term.
    per_token_hidden = 34 * (4 * 2048) * 4096 * 32
    assert per_token_hidden == pytest.approx(3.65e10, rel=0.01)


def test_framework_activations_reproduce_table_2_for_its_assumptions():
    # Korthikanti's assumptions: 16-bit activations, eager attention, 1-byte dropout masks, GELU with
    # f = 4h, LayerNorm. Our per-op accounting then gives exactly 34 sbh + 5 a s^2 b, plus the norm
    # statistics (mean and rstd, fp32, two norms = 16 bytes per token) that Table 2 leaves out.
    s, b, h, a = 64, 2, 128, 4
    m = ModelSpec(1, h, a, 1000, ffn_kind="gelu", norm="layernorm", bias=True, dropout=0.1)
    train = TrainSpec(micro_batch=b, seq_len=s, precision="bf16-true", attention="eager")
    acts = terms.layer_activation_bytes(m, kernels_of(train), b, s)
    attn = terms.eager_attention_bytes(m, kernels_of(train), b, s)
    assert acts == 34 * s * b * h + 2 * 2 * 4 * s * b
    assert attn == 5 * a * s * s * b
    assert acts + attn == pytest.approx(terms.korthikanti_layer_activation_bytes(s, b, h, a) + 16 * s * b)


def test_tp_activation_split_matches_table_2_without_sp():
    # Without SP, 10 sbh stays whole (norm inputs 4, matmul inputs 4, masks 2) and 24 sbh splits by t.
    s, b, h, a, t = 64, 2, 128, 4, 2
    m = ModelSpec(1, h, a, 1000, ffn_kind="gelu", norm="layernorm", bias=True, dropout=0.1)
    train = TrainSpec(micro_batch=b, seq_len=s, precision="bf16-true", attention="eager")
    acts = terms.layer_activation_bytes(m, kernels_of(train), b, s, t=t)
    assert acts == (10 + 24 / t) * s * b * h + 16 * s * b


def test_eager_attention_under_autocast_keeps_fp32_softmax_and_bf16_copy():
    s, b, a = 32, 3, 4
    m = ModelSpec(1, 64, a, 100)
    train = TrainSpec(micro_batch=b, seq_len=s, precision="bf16-mixed", attention="eager")
    # softmax output in fp32 (autocast fp32 op) + its bf16 copy saved by P@V.
    assert terms.eager_attention_bytes(m, kernels_of(train), b, s) == b * a * s * s * (4 + 2)
    assert terms.eager_attention_bytes(m, kernels_of(train.replace(attention="sdpa")), b, s) == 0
    assert terms.eager_attention_bytes(m, kernels_of(train.replace(recompute="selective")), b, s) == 0


def test_swiglu_and_gqa_activation_terms():
    s, b, h, a, k, f = 16, 2, 64, 8, 2, 96
    m = ModelSpec(1, h, a, 100, n_kv_heads=k, ffn_hidden=f, ffn_kind="swiglu", norm="rmsnorm")
    train = TrainSpec(micro_batch=b, seq_len=s, precision="32-true", attention="sdpa")
    tok = s * b
    expected = (
        2 * (tok * h * 4 + tok * 1 * 4)  # two RMSNorm inputs + rstd
        + 2 * tok * h * 4  # attention input, MLP input
        + tok * h * 4 + 2 * tok * k * (h // a) * 4  # q; k, v at k heads (sdpa enable_gqa)
        + tok * h * 4 + tok * a * 4  # attention output (o_proj input = sdpa output), log-sum-exp
        + 4 * tok * f * 4  # gate out, silu out, up out, product
    )
    assert terms.layer_activation_bytes(m, kernels_of(train), b, s) == expected


def test_pipeline_inflight():
    assert terms.pipeline_inflight_microbatches(0, 4, 8, "gpipe") == 8
    assert terms.pipeline_inflight_microbatches(0, 4, 8, "1f1b") == 4
    assert terms.pipeline_inflight_microbatches(3, 4, 8, "1f1b") == 1
    assert terms.pipeline_inflight_microbatches(0, 4, 2, "1f1b") == 2  # fewer microbatches than stages
    # interleaved, v = 2: first stage pays (1 + (p-1)/(p v)) = 1 + 3/8.
    assert terms.pipeline_inflight_microbatches(0, 4, 16, "interleaved", 2) == pytest.approx(4 * (1 + 3 / 8))


def test_optimizer_workspace():
    train = TrainSpec(micro_batch=1, seq_len=1, precision="32-true")
    assert terms.optimizer_workspace_bytes(optimizer_bytes(train), 1000, 300) == 4000  # foreach: one sqrt per state
    assert terms.optimizer_workspace_bytes(optimizer_bytes(train.replace(optimizer_impl="for_loop")), 1000, 300) == 2 * 300 * 4
    assert terms.optimizer_workspace_bytes(optimizer_bytes(train.replace(optimizer_impl="fused")), 1000, 300) == 0
    assert terms.optimizer_workspace_bytes(optimizer_bytes(train.replace(optimizer="sgd")), 1000, 300) == 0


def test_precision_overrides():
    train = TrainSpec(micro_batch=1, seq_len=1, precision="bf16-true", param_bytes=1, grad_bytes=2,
                      optimizer_bytes_per_param=3)
    assert terms.model_state_bytes(10, precision_bytes(train), optimizer_bytes(train).per_param) == {"params": 10, "grads": 20, "optimizer": 30, "master": 0}
    # An explicit master_bytes declares a master copy of that width (e.g. fp8 params with fp32 master).
    assert terms.model_state_bytes(10, precision_bytes(train.replace(master_bytes=4)), optimizer_bytes(train.replace(master_bytes=4)).per_param)["master"] == 40
    assert terms.model_state_bytes(10, precision_bytes(train.replace(master_weights=True)), optimizer_bytes(train.replace(master_weights=True)).per_param)["master"] == 40
