"""recompute="selective_op": torchtitan's op-level policy, by hand, against a traced step, and in the planner."""

from __future__ import annotations

import pytest
import torch

from lightning_memplan.live.layouts import find_layout
from lightning_memplan.model import checkpointing as ck
from lightning_memplan.model import terms
from lightning_memplan.model.estimate import estimate_memory
from lightning_memplan.model.sizes import kernels_of
from lightning_memplan.model.specs import RECOMPUTE_MODES, TrainSpec
from lightning_memplan.parallel.fsdp import apply_activation_checkpointing
from lightning_memplan.testing.zoo import GPT, causal_lm_loss, gpt2_style, llama_style
from lightning_memplan.tracking.trace import trace_memory

B, S = 2, 128


def _lm_loss(model, idx):
    return causal_lm_loss(model, idx, idx)


def _llama():
    return llama_style(vocab_size=1000, n_layers=2, hidden=128, n_heads=4, max_positions=256)


def test_policy_keeps_every_other_matmul_of_a_llama_block():
    spec = GPT(_llama()).spec()
    order = [name for name, _ in ck.block_matmul_widths(spec)]
    assert order == ["q", "k", "v", "o", "gate", "up", "down"]
    assert [name for name, _ in ck.selective_op_saved_matmuls(spec)] == ["q", "v", "gate", "down"]
    assert "selective_op" in RECOMPUTE_MODES


def test_selective_op_block_bytes_worked_by_hand():
    # zoo Llama: h=128, a=4, k=2, d_h=32, f=512; b*s=256 tokens; fp32 on CPU
    spec = GPT(_llama()).spec()
    assert (spec.kv_heads, spec.dim_head, spec.ffn) == (2, 32, 512)
    train = TrainSpec(micro_batch=B, seq_len=S, precision="32-true", device="cpu", recompute="selective_op")
    n = B * S
    block_input = n * 128 * 4
    matmuls = n * (128 + 64 + 512 + 128) * 4  # q, v, gate, down
    sdpa = n * 128 * 4 + n * 4 * 4  # output + fp32 log-sum-exp per (token, head)
    assert ck.selective_op_layer_bytes(spec, kernels_of(train), B, S) == block_input + matmuls + sdpa == 1_118_208
    # bf16-mixed: matmul outputs and the attention output in bf16, the block input (residual) fp32
    mixed = train.replace(precision="bf16-mixed")
    assert ck.selective_op_layer_bytes(spec, kernels_of(mixed), B, S) == block_input + matmuls // 2 + n * 128 * 2 + n * 4 * 4
    # the estimate: per block, the kept set replaces the full saved set
    none = estimate_memory(spec, train.replace(recompute="none")).by_phase["forward"]["activations"]
    sel = estimate_memory(spec, train).by_phase["forward"]["activations"]
    full_layer = terms.layer_activation_bytes(spec, kernels_of(train), B, S)
    assert none - sel == 2 * (full_layer - 1_118_208)
    # the recompute rebuilds the rest of one block: what the kept set does not already hold
    shared = block_input + n * 128 * 4 + n * 4 * 4 + n * 64 * 4 + n * 512 * 4  # input, sdpa out+lse, v, gate
    assert ck.selective_op_rebuild_bytes(spec, kernels_of(train), B, S) == full_layer - shared


def test_selective_op_sits_between_selective_and_full():
    spec = GPT(_llama()).spec()
    train = TrainSpec(micro_batch=4, seq_len=512, device="cuda")
    totals = {rc: estimate_memory(spec, train.replace(recompute=rc)).by_phase["forward"]["activations"]
              for rc in ("none", "selective", "selective_op", "full")}
    assert totals["full"] < totals["selective_op"] < totals["selective"] == totals["none"]


@pytest.mark.parametrize(
    ("make", "precision", "attention"),
    [
        (_llama, "32-true", "sdpa"),
        (_llama, "bf16-mixed", "sdpa"),
        (lambda: gpt2_style(vocab_size=1000, n_layers=2, hidden=128, n_heads=4, max_positions=256), "32-true", "eager"),
    ],
    ids=["llama-fp32", "llama-bf16mixed", "gpt2-eager-fp32"],
)
def test_traced_step_with_the_policy_applied_matches_the_estimate(make, precision, attention):
    """A fake-tensor trace of the module with torchtitan's policy applied (the same wrapper memplan_auto
    uses) against the analytic estimate for recompute='selective_op'."""
    config = make().replace(attention=attention)
    model = GPT(config)
    spec = model.spec()
    layout = find_layout(model)
    assert layout is not None
    note = apply_activation_checkpointing(layout, "selective_op")
    assert "selective-op" in note
    traced = trace_memory(model, batch_shape=(B, S), loss_fn=_lm_loss, precision=precision)
    plain = trace_memory(GPT(config), batch_shape=(B, S), loss_fn=_lm_loss, precision=precision)
    train = TrainSpec(micro_batch=B, seq_len=S, precision=precision, device="cpu", attention=attention,
                      recompute="selective_op")
    est = estimate_memory(spec, train)
    assert traced.total < plain.total  # the policy really drops activations
    assert est.total == pytest.approx(traced.total, rel=0.02)
    assert est.phase_total("forward") == pytest.approx(traced.phase_total("forward"), rel=0.02)
    assert est.phase_total("backward") == pytest.approx(traced.phase_total("backward"), rel=0.07)


def test_policy_recomputes_to_the_same_gradients():
    torch.manual_seed(0)
    config = _llama()
    ref, sac = GPT(config), GPT(config)
    sac.load_state_dict(ref.state_dict())
    layout = find_layout(sac)
    assert layout is not None
    apply_activation_checkpointing(layout, "selective_op")
    idx = torch.randint(0, 1000, (B, 32))
    for m in (ref, sac):
        causal_lm_loss(m, idx, idx).backward()
    for (name, p), q in zip(ref.named_parameters(), sac.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
