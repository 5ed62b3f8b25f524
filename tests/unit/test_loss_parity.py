"""Parity of the chunked linear cross-entropy with ``F.cross_entropy`` on full logits (fwd + bwd)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_memplan.loss import LinearCrossEntropy, linear_cross_entropy

# (dtype, atol, rtol) for loss and gradients; for gradients atol is relative to the largest reference
# entry (max(1, max|ref|)). fp32: reassociation over chunks only. bf16: both paths round the logits
# GEMM to bf16 and upcast, and round ∂loss/∂logits to bf16 before the backward GEMMs; the weight
# gradient additionally rounds each chunk's bf16 GEMM output before the fp32 sum over chunks (CPU has
# no bf16-in/fp32-out GEMM), which costs up to ~2 bf16 ulps (2**-7 relative) of the largest entry.
TOLERANCES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 2e-2)]


def reference(
    hidden,
    weight,
    target,
    *,
    bias=None,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
    shift=False,
):
    """Independent reference: full logits, fp32 upcast (fp64 kept), F.cross_entropy, explicit z-loss."""
    if shift:
        hidden, target = hidden[:, :-1], target[:, 1:]
    logits = F.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 upcast; fp64 stays fp64
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    flat = logits.reshape(-1, logits.shape[-1])
    y = target.reshape(-1)
    per_token = F.cross_entropy(
        flat, y, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    valid = y != ignore_index
    if z_loss:
        per_token = per_token + torch.where(valid, z_loss * torch.logsumexp(flat, -1) ** 2, 0.0)
    if reduction == "none":
        return per_token.reshape(target.shape)
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / valid.sum().clamp(min=1)


def make(b, s, h, v, dtype, *, bias=False, ignore_frac=0.2, seed=0, ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, s, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * h**-0.5 * 3).to(dtype).requires_grad_()
    b_ = (torch.randn(v, generator=g) * 0.5).to(dtype).requires_grad_() if bias else None
    target = torch.randint(0, v, (b, s), generator=g)
    target[torch.rand(b, s, generator=g) < ignore_frac] = ignore_index
    return hidden, weight, b_, target


def grads(loss, grad_out, inputs):
    return torch.autograd.grad((loss.float() * grad_out).sum(), [t for t in inputs if t is not None])


OPTION_CASES = [
    {},
    {"label_smoothing": 0.1},
    {"z_loss": 1e-3},
    {"softcap": 5.0},
    {"shift": True},
    {"reduction": "sum"},
    {"reduction": "none"},
    {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 3.0, "shift": True},
    {"ignore_index": 0},
]


@pytest.mark.parametrize("dtype,atol,rtol", TOLERANCES)
@pytest.mark.parametrize(
    "opts", OPTION_CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain"
)
@pytest.mark.parametrize("bias", [False, True])
def test_parity_odd_shapes(dtype, atol, rtol, opts, bias):
    hidden, weight, b, target = make(
        3, 7, 16, 41, dtype, bias=bias, ignore_index=opts.get("ignore_index", -100)
    )
    ref = reference(hidden, weight, target, bias=b, **opts)
    out = linear_cross_entropy(hidden, weight, target, bias=b, chunk_size=4, **opts)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    # a non-trivial incoming gradient (gradient accumulation / GradScaler style scaling)
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(ref.shape, generator=gen) if opts.get("reduction") == "none" else torch.tensor(0.37)
    for got, want in zip(grads(out, g, (hidden, weight, b)), grads(ref, g, (hidden, weight, b)), strict=True):
        assert got.dtype == want.dtype
        scale = max(1.0, float(want.float().abs().max()))
        torch.testing.assert_close(got.float(), want.float(), atol=atol * scale, rtol=rtol)


@pytest.mark.parametrize("chunk", [1, 5, 21, 1000, "auto"])
def test_chunk_size_does_not_change_result(chunk):
    hidden, weight, b, target = make(3, 7, 16, 41, torch.float32, bias=True)
    ref = reference(hidden, weight, target, bias=b, z_loss=1e-3)
    out = linear_cross_entropy(hidden, weight, target, bias=b, z_loss=1e-3, chunk_size=chunk)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(
        grads(out, 1.0, (hidden, weight, b)), grads(ref, 1.0, (hidden, weight, b)), strict=True
    ):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_ignored_gives_zero_loss_and_zero_grads(reduction):
    hidden, weight, b, _ = make(2, 5, 8, 13, torch.float32, bias=True)
    target = torch.full((2, 5), -100)
    out = linear_cross_entropy(
        hidden, weight, target, bias=b, reduction=reduction, label_smoothing=0.1, z_loss=1e-3, chunk_size=3
    )
    assert torch.isfinite(out).all() and (out == 0).all()
    gh, gw, gb = torch.autograd.grad(out.sum(), (hidden, weight, b))
    for g in (gh, gw, gb):
        assert torch.isfinite(g).all() and (g == 0).all()
    # F.cross_entropy itself returns NaN for a mean over zero tokens; our documented convention is 0
    assert torch.isnan(F.cross_entropy(torch.zeros(3, 4), torch.full((3,), -100)))


def test_shift_shapes_and_reference_equivalence():
    hidden, weight, _, target = make(2, 6, 8, 11, torch.float32, ignore_frac=0.0)
    out = linear_cross_entropy(hidden, weight, target, shift=True, reduction="none", chunk_size=4)
    assert out.shape == (2, 5)
    manual = linear_cross_entropy(hidden[:, :-1], weight, target[:, 1:], reduction="none")
    torch.testing.assert_close(out, manual)


def test_flat_inputs_and_int32_targets():
    hidden, weight, _, target = make(1, 9, 8, 11, torch.float32)
    out = linear_cross_entropy(hidden[0], weight, target[0].int(), chunk_size=2)
    torch.testing.assert_close(out, reference(hidden[0], weight, target[0]), atol=1e-6, rtol=1e-6)


def test_tied_weight_gets_embedding_and_head_gradients():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(17, 8)
    idx = torch.randint(0, 17, (2, 6))
    h = torch.tanh(emb(idx))
    loss = linear_cross_entropy(h, emb.weight, idx, shift=True, chunk_size=3)
    loss.backward()
    ours = emb.weight.grad.clone()
    emb.weight.grad = None
    reference(torch.tanh(emb(idx)), emb.weight, idx, shift=True).backward()
    torch.testing.assert_close(ours, emb.weight.grad, atol=1e-6, rtol=1e-5)


def test_autocast_bf16_matches_autocast_reference_and_keeps_fp32_grads():
    hidden, weight, b, target = make(3, 7, 32, 41, torch.float32, bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_cross_entropy(hidden, weight, target, bias=b, chunk_size=5)
        ref = F.cross_entropy(F.linear(hidden, weight, b).float().reshape(-1, 41), target.reshape(-1))
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    got = torch.autograd.grad(out, (hidden, weight, b))
    want = torch.autograd.grad(ref, (hidden, weight, b))
    for g1, g2 in zip(got, want, strict=True):
        assert g1.dtype == torch.float32
        torch.testing.assert_close(g1, g2, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("mode", ["fp32_upcast", "naive", "chunked"])
def test_modes_agree(mode):
    hidden, weight, b, target = make(2, 5, 8, 13, torch.float32, bias=True)
    opts = dict(label_smoothing=0.1, z_loss=1e-3, softcap=4.0)
    out = linear_cross_entropy(hidden, weight, target, bias=b, mode=mode, **opts)
    torch.testing.assert_close(out, reference(hidden, weight, target, bias=b, **opts), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_torch_backend_parity(reduction):
    hidden, weight, b, target = make(3, 7, 16, 41, torch.float32, bias=True)
    out = linear_cross_entropy(
        hidden, weight, target, bias=b, backend="torch", reduction=reduction, chunk_size=4
    )
    ref = reference(hidden, weight, target, bias=b, reduction=reduction)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.ones(ref.shape)
    for got, want in zip(grads(out, g, (hidden, weight, b)), grads(ref, g, (hidden, weight, b)), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    all_ignored = linear_cross_entropy(hidden, weight, torch.full_like(target, -100), backend="torch")
    assert all_ignored.item() == 0.0


def test_module_matches_functional_and_no_grad_path():
    hidden, weight, b, target = make(2, 5, 8, 13, torch.float32, bias=True)
    module = LinearCrossEntropy(z_loss=1e-3, chunk_size=3)
    torch.testing.assert_close(
        module(hidden, weight, target, b), linear_cross_entropy(hidden, weight, target, bias=b, z_loss=1e-3)
    )
    with torch.no_grad():
        out = module(hidden, weight, target, b)
    assert out.grad_fn is None
    torch.testing.assert_close(out, reference(hidden, weight, target, bias=b, z_loss=1e-3))


# -- property: any shape, option mix and chunk size equals the full-logits reference (fp64) ----------

_hyp = pytest.importorskip("hypothesis")
_st = _hyp.strategies


@_hyp.settings(max_examples=60 * int(__import__("os").environ.get("MEMPLAN_HYPOTHESIS_SCALE", "1")))
@_hyp.given(
    b=_st.integers(1, 3), s=_st.integers(1, 9), h=_st.integers(1, 12), v=_st.integers(2, 50),
    chunk=_st.one_of(_st.just("auto"), _st.integers(1, 40)), bias=_st.booleans(),
    ignore_frac=_st.sampled_from([0.0, 0.3, 1.0]), smoothing=_st.sampled_from([0.0, 0.1, 0.5]),
    z=_st.sampled_from([0.0, 1e-2]), softcap=_st.sampled_from([None, 2.0]), shift=_st.booleans(),
    reduction=_st.sampled_from(["mean", "sum", "none"]), seed=_st.integers(0, 2**16),
)
def test_random_shapes_and_options_match_the_reference_in_fp64(
    b, s, h, v, chunk, bias, ignore_frac, smoothing, z, softcap, shift, reduction, seed
):
    hidden, weight, bias_t, target = make(b, s, h, v, torch.float64, bias=bias, ignore_frac=ignore_frac, seed=seed)
    opts = dict(reduction=reduction, label_smoothing=smoothing, z_loss=z, softcap=softcap, shift=shift)
    ours = linear_cross_entropy(hidden, weight, target, bias=bias_t, chunk_size=chunk, **opts)
    ref = reference(hidden, weight, target, bias=bias_t, **opts)
    assert ours.dtype == ref.dtype == torch.float64 and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-12, rtol=1e-10)
    g = torch.Generator().manual_seed(seed + 1)
    grad_out = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    inputs = [hidden, weight, bias_t]
    for got, want in zip(grads(ours, grad_out, inputs), grads(ref, grad_out, inputs), strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
