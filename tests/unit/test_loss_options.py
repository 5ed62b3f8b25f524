"""Options, validation errors, ``chunk_size="auto"`` and the module's configure hook."""

from __future__ import annotations

import pytest
import torch

from lightning_memplan.loss import (
    AUTO_CHUNK_BUDGET_BYTES,
    LinearCrossEntropy,
    LossOptions,
    auto_chunk_size,
    chunk_row_bytes,
    linear_cross_entropy,
)


def _inputs(b=2, s=5, h=8, v=13):
    torch.manual_seed(0)
    return (
        torch.randn(b, s, h, requires_grad=True),
        torch.randn(v, h, requires_grad=True),
        torch.randint(0, v, (b, s)),
    )


@pytest.mark.parametrize(
    "kwargs,exc,words",
    [
        ({"chunk_size": 0}, ValueError, ["chunk_size=0", "> 0"]),
        ({"chunk_size": -4}, ValueError, ["chunk_size=-4"]),
        ({"chunk_size": "big"}, ValueError, ["chunk_size='big'"]),
        ({"chunk_size": 2.5}, TypeError, ["chunk_size=2.5"]),
        ({"label_smoothing": 1.0}, ValueError, ["label_smoothing=1.0", "[0, 1)"]),
        ({"label_smoothing": -0.1}, ValueError, ["label_smoothing=-0.1"]),
        ({"softcap": 0.0}, ValueError, ["softcap=0.0", "> 0"]),
        ({"softcap": -3.0}, ValueError, ["softcap=-3.0"]),
        ({"z_loss": -1e-4}, ValueError, ["z_loss=-0.0001"]),
        ({"reduction": "avg"}, ValueError, ["reduction='avg'", "mean"]),
        ({"mode": "fast"}, ValueError, ["mode='fast'"]),
        ({"backend": "cuda"}, ValueError, ["backend='cuda'"]),
        ({"ignore_index": 1.5}, TypeError, ["ignore_index=1.5"]),
    ],
)
def test_bad_options_name_argument_and_value(kwargs, exc, words):
    hidden, weight, target = _inputs()
    with pytest.raises(exc) as info:
        linear_cross_entropy(hidden, weight, target, **kwargs)
    for word in words:
        assert word in str(info.value)
    with pytest.raises(exc):
        LinearCrossEntropy(**kwargs)


def test_hidden_weight_mismatch_names_both_shapes():
    hidden, _, target = _inputs()
    with pytest.raises(ValueError) as info:
        linear_cross_entropy(hidden, torch.randn(13, 9), target)
    msg = str(info.value)
    assert "(2, 5, 8)" in msg and "(13, 9)" in msg and "hidden" in msg and "weight" in msg


def test_target_shape_mismatch_names_shapes():
    hidden, weight, _ = _inputs()
    with pytest.raises(ValueError) as info:
        linear_cross_entropy(hidden, weight, torch.zeros(2, 4, dtype=torch.long))
    assert "target.shape=(2, 4)" in str(info.value) and "(2, 5)" in str(info.value)


def test_bias_shape_and_float_target_and_non_tensor():
    hidden, weight, target = _inputs()
    with pytest.raises(ValueError, match=r"bias.shape=\(12,\)"):
        linear_cross_entropy(hidden, weight, target, bias=torch.zeros(12))
    with pytest.raises(TypeError, match="target.dtype"):
        linear_cross_entropy(hidden, weight, target.float())
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        linear_cross_entropy(hidden, weight.tolist(), target)
    with pytest.raises(ValueError, match="shift=True"):
        linear_cross_entropy(hidden[0], weight, target[0], shift=True)


def test_validate_targets_reports_out_of_range_ids():
    hidden, weight, target = _inputs()
    target[0, 0] = 13
    target[1, 1] = -5
    with pytest.raises(ValueError) as info:
        linear_cross_entropy(hidden, weight, target, validate_targets=True)
    assert "[-5, 13]" in str(info.value) and "[0, 13)" in str(info.value)
    # ignore_index is not an error in validation mode
    target[0, 0] = target[1, 1] = -100
    linear_cross_entropy(hidden, weight, target, validate_targets=True)


def test_vocab_parallel_mode_without_group_is_rejected():
    hidden, weight, target = _inputs()
    with pytest.raises(ValueError, match="mode='vocab_parallel'"):
        linear_cross_entropy(hidden, weight, target, mode="vocab_parallel")
    with pytest.raises(ValueError, match="sequence_parallel=True"):
        linear_cross_entropy(hidden, weight, target, sequence_parallel=True)


def test_torch_backend_rejects_unsupported_options():
    hidden, weight, target = _inputs()
    with pytest.raises(ValueError, match="label_smoothing"):
        linear_cross_entropy(hidden, weight, target, backend="torch", label_smoothing=0.1)


def test_second_backward_raises_unless_allowed():
    hidden, weight, target = _inputs()
    loss = linear_cross_entropy(hidden, weight, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="allow_retain_graph=True"):
        loss.backward()
    hidden.grad = weight.grad = None
    loss = linear_cross_entropy(hidden, weight, target, allow_retain_graph=True)
    loss.backward(retain_graph=True)
    first = weight.grad.clone()
    loss.backward()
    torch.testing.assert_close(weight.grad, 2 * first)


def test_auto_chunk_size_on_cpu_counts_the_fp32_gemm_buffer_only():
    # On CPU a bf16 call runs fp32 GEMMs (no [chunk, V] bf16 copy): the row is the fp32 buffer, V * 4.
    v = 65536
    assert chunk_row_bytes(v, torch.bfloat16, device="cpu") == v * 4
    assert chunk_row_bytes(v, torch.bfloat16, device=torch.device("cpu")) == v * 4
    assert chunk_row_bytes(v, torch.float16, device="cpu", softcap=True) == v * 8
    # issue 12's bf16 shape: 0.5 * (4096 + 65536) * 1024 * 2 / (4 V) = 272 rows, at most N / 16 = 256;
    # on CUDA the 6-byte row gives 181 -> 128 (multiple of 64)
    assert auto_chunk_size(4096, 1024, v, torch.bfloat16, device="cpu") == 256
    assert auto_chunk_size(4096, 1024, v, torch.bfloat16) == 128
    with pytest.raises(ValueError, match="device='gpu0' is not a torch device"):
        auto_chunk_size(4096, 1024, v, torch.bfloat16, device="gpu0")
    with pytest.raises(TypeError, match="device=0 must be a device type string"):
        chunk_row_bytes(v, torch.bfloat16, device=0)


def test_auto_chunk_size_rule():
    v, h = 128256, 1024
    row = chunk_row_bytes(v, torch.bfloat16)
    assert row == v * 6
    assert chunk_row_bytes(v, torch.float32) == v * 4
    assert chunk_row_bytes(v, torch.float32, softcap=True) == v * 8
    # gradient-limited: the working set within 50 % of dh + dW, (N + V) * h * 2 bytes:
    # 0.5 * (131072 + 128256) * 1024 * 2 / (6 V) = 345 rows -> 320 (multiple of 64)
    assert auto_chunk_size(131072, h, v, torch.bfloat16) == 320
    assert 320 * row <= 0.5 * (131072 + v) * h * 2 < 384 * row
    # issue 12's fp32 shape: 0.5 * (8192 + 32000) * 512 * 4 / (4 * 32000) = 321 rows -> 320
    assert auto_chunk_size(8192, 512, 32000, torch.float32) == 320
    # budget-limited: 512 MiB / (6 V) = 697 rows -> 640 when the gradients are large (h = 4096)
    assert auto_chunk_size(262144, 4096, v, torch.bfloat16) == 640
    assert AUTO_CHUNK_BUDGET_BYTES // row == 697
    # token-limited: at most N/16 rows (0.5 * (2048 + 32000) * 1024 * 4 / (4 * 32000) = 544 > 128)
    assert auto_chunk_size(2048, h, 32000, torch.float32) == 128
    # 0.5 * (8192 + V) * 1024 * 2 / (6 V) = 181 rows -> 128
    assert auto_chunk_size(8192, h, v, torch.bfloat16) == 128
    # at least 64 rows, even where half the gradients is less than that (h = 128: 22 rows)
    assert auto_chunk_size(4096, 128, v, torch.bfloat16) == 64
    # small N relative to h: no chunking
    assert auto_chunk_size(1000, h, v) == 1000
    assert auto_chunk_size(7, 16, 41) == 7
    # deterministic and never above N
    assert auto_chunk_size(5000, 64, 50000) == auto_chunk_size(5000, 64, 50000) <= 5000


def test_loss_options_is_frozen_and_module_configure():
    opts = LossOptions(z_loss=1e-4)
    with pytest.raises(AttributeError):
        opts.z_loss = 0.0  # type: ignore[misc]
    module = LinearCrossEntropy(shift=True)
    assert "shift=True" in repr(module) and "mode='auto'" in repr(module)
    assert module.configure(mode="chunked", chunk_size=64, process_group=None) is module
    assert module.mode == "chunked" and module.chunk_size == 64 and module.process_group is None
    module.chunk_size = 128
    assert module.options.chunk_size == 128 and "chunk_size=128" in repr(module)
    with pytest.raises(ValueError, match="chunk_size=0"):
        module.chunk_size = 0
    with pytest.raises(ValueError, match="mode='bogus'"):
        module.configure(mode="bogus")
    with pytest.raises(TypeError, match="unknown options"):
        LinearCrossEntropy(chunksize=3)
    with pytest.raises(TypeError, match="unknown options"):
        module.configure(chunksize=3)
    assert module.chunk_size == 128  # failed updates leave the options unchanged
