"""The model zoo: layouts, parameter counts worked by hand, attention kinds agree, RoPE, specs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_memplan.model.specs import ModelSpec
from lightning_memplan.testing.zoo import (
    GPT,
    ConvNet,
    GPTConfig,
    MLPNet,
    apply_rope,
    causal_lm_loss,
    gpt2_style,
    llama_style,
    random_tokens,
    rope_cache,
    tied_style,
)

V, H, L, P, F_GELU = 512, 64, 2, 256, 256


def _gpt2_params() -> int:
    # tok_emb V*h + pos_emb P*h
    emb = V * H + P * H
    # per block: 2 LayerNorms (2h each), q/k/v/o (h*h + h), fc_in (h*f + f), fc_out (f*h + h)
    block = 2 * 2 * H + 4 * (H * H + H) + (H * F_GELU + F_GELU) + (F_GELU * H + H)
    # norm_f 2h + untied lm_head V*h
    return emb + L * block + 2 * H + V * H


def _llama_params() -> int:
    hd, kv, f = H // 4, 2, 256  # head_dim 16, 2 kv-heads, Llama rule 256*ceil(int(8*64/3)/256) = 256
    block = 2 * H + (H * H) + 2 * (H * kv * hd) + (H * H) + 3 * H * f  # 2 RMSNorms, q, k+v, o, gate/up/down
    return V * H + L * block + H + V * H


@pytest.mark.parametrize(
    ("config", "expected"),
    [(gpt2_style(), _gpt2_params()), (llama_style(), _llama_params()), (tied_style(), _gpt2_params() - V * H)],
    ids=["gpt2", "llama", "tied"],
)
def test_param_counts_worked_by_hand(config: GPTConfig, expected: int) -> None:
    model = GPT(config)
    assert model.num_params() == expected
    assert model.spec().num_params == expected


def test_layout_attribute_names() -> None:
    llama = GPT(llama_style())
    block = llama.blocks[0]
    assert llama.pos_emb is None and isinstance(llama.tok_emb, torch.nn.Embedding)
    assert block.attn.k_proj.out_features == 2 * 16 and block.attn.q_proj.out_features == 64
    assert {n for n, _ in block.mlp.named_children()} == {"gate_proj", "up_proj", "down_proj"}
    assert isinstance(block.norm1, torch.nn.RMSNorm) and block.attn.q_proj.bias is None
    gpt2 = GPT(gpt2_style())
    assert {n for n, _ in gpt2.blocks[0].mlp.named_children()} == {"fc_in", "fc_out"}
    assert isinstance(gpt2.norm_f, torch.nn.LayerNorm) and gpt2.pos_emb.num_embeddings == 256
    tied = GPT(tied_style())
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert not any(isinstance(m, torch.nn.Dropout) for m in gpt2.modules())
    assert sum(isinstance(m, torch.nn.Dropout) for m in GPT(gpt2_style(dropout=0.1)).modules()) == 1 + 3 * L


@pytest.mark.parametrize("make", [gpt2_style, llama_style], ids=["gpt2", "llama-gqa"])
def test_sdpa_and_eager_agree_forward_and_backward(make) -> None:
    torch.manual_seed(0)
    sdpa = GPT(make(attention="sdpa"))
    eager = GPT(make(attention="eager"))
    eager.load_state_dict(sdpa.state_dict())
    idx, tgt = random_tokens(sdpa.config, 2, 24)
    loss_s = causal_lm_loss(sdpa, idx, tgt)
    loss_e = causal_lm_loss(eager, idx, tgt)
    loss_s.backward()
    loss_e.backward()
    torch.testing.assert_close(loss_s, loss_e, atol=1e-5, rtol=1e-5)
    for (name, ps), pe in zip(sdpa.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(ps.grad, pe.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_causal_future_tokens_do_not_leak(attention: str) -> None:
    model = GPT(llama_style(attention=attention)).eval()
    idx, _ = random_tokens(model.config, 1, 16)
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % V
    torch.testing.assert_close(model(idx)[:, :10], model(changed)[:, :10])
    assert not torch.allclose(model(idx)[:, 10:], model(changed)[:, 10:])


def test_rope_matches_complex_rotation_reference() -> None:
    # Reference: RoFormer as complex multiplication of (x_i + i*x_{i+d/2}) by exp(i * pos * theta_i).
    d, s = 8, 5
    x = torch.randn(2, 3, s, d)
    cos, sin = rope_cache(16, d)
    theta = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double())
    rotated = z * torch.polar(torch.ones(s, d // 2, dtype=torch.float64), torch.arange(s)[:, None] * theta)
    expected = torch.cat((rotated.real, rotated.imag), dim=-1).float()
    torch.testing.assert_close(apply_rope(x, cos, sin), expected, atol=1e-5, rtol=1e-5)


def test_causal_lm_loss_modes_match_reference() -> None:
    model = GPT(gpt2_style())
    idx, tgt = random_tokens(model.config, 2, 8)
    logits = model.lm_head(model(idx))
    expected = F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))
    torch.testing.assert_close(causal_lm_loss(model, idx, tgt), expected)
    torch.testing.assert_close(causal_lm_loss(model, idx, tgt, loss="fp32_upcast"), expected)
    assert math.isclose(expected.item(), math.log(V), rel_tol=0.05)  # N(0, 0.02) init: near-uniform logits
    with pytest.raises(ValueError, match="loss='chunky'"):
        causal_lm_loss(model, idx, tgt, loss="chunky")


def test_spec_maps_config() -> None:
    model = GPT(llama_style(n_layers=3))
    spec = model.spec()
    assert isinstance(spec, ModelSpec)
    assert (spec.n_layers, spec.hidden, spec.n_heads, spec.kv_heads, spec.vocab_size) == (3, 64, 4, 2, 512)
    assert (spec.ffn_kind, spec.norm, spec.position_embedding, spec.bias) == ("swiglu", "rmsnorm", "rope", False)
    assert spec.ffn == model.config.ffn == 256 and spec.dim_head == 16
    assert GPT(tied_style()).spec().tied_embeddings


@pytest.mark.parametrize("config", [gpt2_style(), llama_style(), tied_style()], ids=["gpt2", "llama", "tied"])
def test_lead_param_count_formula_matches_zoo(config: GPTConfig) -> None:
    terms = pytest.importorskip("lightning_memplan.model.terms")
    from dataclasses import replace

    model = GPT(config)
    assert terms.param_count(replace(model.spec(), n_params=None)) == model.num_params()


def test_config_validation_names_the_argument() -> None:
    with pytest.raises(ValueError, match="n_kv_heads=3"):
        GPTConfig(512, 2, 64, 4, n_kv_heads=3)
    with pytest.raises(ValueError, match="attention='flash'"):
        gpt2_style(attention="flash")
    with pytest.raises(ValueError, match="hidden=0"):
        GPTConfig(512, 2, 0, 4)
    with pytest.raises(ValueError, match="max_positions=8"):
        GPT(gpt2_style(max_positions=8))(torch.zeros(1, 9, dtype=torch.long))


def test_non_transformer_models() -> None:
    mlp = MLPNet(in_features=16, hidden=32, n_layers=2, n_classes=5)
    x, y = mlp.example_batch(4)
    assert mlp(x).shape == (4, 5) and y.shape == (4,)
    assert sum(p.numel() for p in mlp.parameters()) == (16 * 32 + 32) + (32 * 32 + 32) + (32 * 5 + 5)
    conv = ConvNet(channels=(4, 8), n_classes=3, image_size=8)
    x, y = conv.example_batch(2)
    assert conv(x).shape == (2, 3)
    # conv weights 3*4*9 + 4*8*9 (no bias), BatchNorm 2*(4+8), head 8*3+3
    assert sum(p.numel() for p in conv.parameters()) == 3 * 4 * 9 + 4 * 8 * 9 + 2 * (4 + 8) + 8 * 3 + 3
