"""Autograd contract of the chunked loss: gradcheck, memory bound, no host sync, grad_output scaling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_memplan.loss import linear_cross_entropy
from lightning_memplan.model.sizes import kernels_of


@pytest.mark.parametrize(
    "opts",
    [
        {},
        {"label_smoothing": 0.1, "z_loss": 1e-2, "softcap": 2.0},
        {"reduction": "sum", "shift": True},
        {"reduction": "none", "label_smoothing": 0.2, "softcap": 1.5},
    ],
    ids=["plain", "all-options", "sum-shift", "none"],
)
def test_gradcheck_fp64(opts):
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 6, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 11, (2, 5))
    target[1, 2] = -100

    def fn(h, w, b):
        return linear_cross_entropy(h, w, target, bias=b, chunk_size=3, allow_retain_graph=True, **opts)

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor (in elements) produced by any op, and host syncs."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            self.syncs.append(str(func))
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize(
    "opts", [{}, {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 5.0}, {"reduction": "none"}]
)
def test_only_chunk_sized_logits_exist_and_no_host_sync(opts):
    n, h, v, chunk = 256, 16, 1000, 32
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    target = torch.randint(0, v, (n,))
    with _LargestTensor() as mode:
        loss, metrics = linear_cross_entropy(
            hidden, weight, target, chunk_size=chunk, return_metrics=True, **opts
        )
        loss.sum().backward()
    assert mode.syncs == []
    # the biggest tensors are the [chunk, V] buffer and the [V, h] weight gradient, never [N, V]
    assert mode.largest <= max(chunk * v, v * h)
    with _LargestTensor() as naive:
        F.cross_entropy(F.linear(hidden, weight).float(), target).backward()
    assert naive.largest == n * v


def test_peak_memory_is_a_fraction_of_naive():
    """MemTracker (torch.distributed._tools) peak over fwd+bwd: ours ≤ 0.1× the naive loss here."""
    torch.manual_seed(0)
    n, h, v = 1024, 32, 4000
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    target = torch.randint(0, v, (n,))

    def peak(fn):
        tracker = MemTracker()
        with tracker:
            fn().backward()
        hidden.grad = weight.grad = None
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    naive = peak(lambda: F.cross_entropy(F.linear(hidden, weight).float(), target))
    ours = peak(lambda: linear_cross_entropy(hidden, weight, target))  # chunk_size="auto" -> N/16 rows
    assert naive >= 3 * n * v * 4  # logits, log-softmax and its gradient
    assert ours <= 0.1 * naive


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
@pytest.mark.parametrize("shape", [(2048, 256, 16000), (1024, 512, 32000)], ids=["N>h", "h>N/4"])
def test_forward_peak_matches_the_estimate_on_cpu(precision, shape):
    """PyTorch's MemTracker on a real CPU forward (the chunked loss computes its gradients there):
    the extra peak above the inputs equals :func:`terms.logits_bytes`'s ``"forward"`` on
    ``device="cpu"`` within 2 % (16-bit compute runs fp32 GEMMs on CPU: fp32 copies of W and x)."""
    from lightning_memplan.model import ModelSpec, TrainSpec, terms

    n, h, v = shape
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    torch.manual_seed(0)
    tracker = MemTracker()
    with tracker:  # inputs created inside, so that the tracker knows them from their allocation
        hidden = torch.randn(n, h, dtype=dtype, requires_grad=True)
        weight = torch.randn(v, h, dtype=dtype, requires_grad=True)
        target = torch.randint(0, v, (n,))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            linear_cross_entropy(hidden, weight, target)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    extra = peak - (n + v) * h * dtype.itemsize - n * 8
    train = TrainSpec(micro_batch=1, seq_len=n, precision=precision, loss="chunked", device="cpu")
    estimate = terms.logits_bytes(ModelSpec(1, h, 1, v), kernels_of(train), n)["forward"]
    assert estimate == pytest.approx(extra, rel=0.02)


def test_cpu_bf16_gemms_are_fp32_products_of_the_bf16_operands():
    """On CPU a bf16 call computes x·Wᵀ in fp32 on the bf16 values (what a bf16 GEMM with fp32
    accumulation computes, without rounding the logits to bf16): the loss equals fp32 cross-entropy
    of the upcast operands to fp32 precision, and the gradients its gradients rounded to bf16."""
    torch.manual_seed(0)
    n, h, v = 300, 64, 1000
    hidden = torch.randn(n, h).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, h) * 0.3).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, v, (n,))
    loss = linear_cross_entropy(hidden, weight, target, chunk_size=64)
    loss.backward()
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    ref = F.cross_entropy(h32 @ w32.t(), target)
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    # within one bf16 rounding step (2**-7 relative): the chunks sum in another order than one GEMM
    torch.testing.assert_close(weight.grad, w32.grad.to(torch.bfloat16), atol=1e-6, rtol=2**-7)
    torch.testing.assert_close(hidden.grad, h32.grad.to(torch.bfloat16), atol=1e-6, rtol=2**-7)


def test_gradient_accumulation_scaling_matches_reference():
    """Two micro-batches with loss/2 each (what Lightning's accumulate_grad_batches does)."""
    torch.manual_seed(0)
    weight = torch.randn(29, 8, requires_grad=True)
    ref_weight = weight.detach().clone().requires_grad_()
    for _ in range(2):
        hidden = torch.randn(3, 4, 8)
        target = torch.randint(0, 29, (3, 4))
        (linear_cross_entropy(hidden, weight, target, chunk_size=5) / 2).backward()
        (F.cross_entropy(F.linear(hidden, ref_weight).reshape(-1, 29), target.reshape(-1)) / 2).backward()
    torch.testing.assert_close(weight.grad, ref_weight.grad, atol=1e-6, rtol=1e-5)


def test_weight_gradient_accumulates_in_fp32_for_bf16():
    """Many chunks of bf16 products summed in fp32 track the fp64 gradient closely; a bf16 running
    sum (Liger issue 512) would lose the small late contributions."""
    torch.manual_seed(0)
    n, h, v = 512, 16, 50
    hidden64 = torch.randn(n, h, dtype=torch.float64)
    weight64 = torch.randn(v, h, dtype=torch.float64) * 0.3
    target = torch.randint(0, v, (n,))
    w64 = weight64.clone().requires_grad_()
    F.cross_entropy(F.linear(hidden64, w64), target, reduction="sum").backward()
    w16 = weight64.to(torch.bfloat16).requires_grad_()
    linear_cross_entropy(hidden64.to(torch.bfloat16), w16, target, chunk_size=8, reduction="sum").backward()
    rel = (w16.grad.double() - w64.grad).norm() / w64.grad.norm()
    assert w16.grad.dtype == torch.bfloat16
    assert rel < 2e-2
