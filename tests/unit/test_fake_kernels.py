"""Fake kernels sized as the real ones (``tracking/fake_fidelity.py``, issue 32): oneDNN's LSTM workspace
(measured; its fit checked at held-out shapes), MSE's unreduced storage, LayerDrop's 0-d draw, and the
padding answers of transformers' mask functions, each against the real kernel or a real step."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_memplan.tracking import fake_fidelity
from lightning_memplan.tracking.fake_fidelity import (
    mask_padding,
    mkldnn_rnn_workspace_bytes,
    real_kernel_sizes,
)
from lightning_memplan.tracking.trace import trace_memory

# the padding answers are checked against transformers' mask functions (transformers imported where used)
pytestmark = pytest.mark.hf


def _lstm_template(i: int, h: int) -> tuple:
    weights = ((4 * h, i), (4 * h, h), (4 * h,), (4 * h,))
    return ((1, 1, i), torch.float32, weights, h, (False, (), 2, h, 1, True, False, False, True))


@pytest.mark.parametrize("batch_first", [True, False])
def test_a_fake_lstm_step_equals_the_real_one(batch_first: bool) -> None:
    torch.manual_seed(0)
    model = nn.LSTM(12, 24, num_layers=2, batch_first=batch_first, bidirectional=True)
    x = torch.randn(3, 17, 12) if batch_first else torch.randn(17, 3, 12)
    loss = lambda m, batch: m(batch)[0].square().mean()  # noqa: E731
    fake, real = trace_memory(model, x, loss_fn=loss), trace_memory(model, x, loss_fn=loss, fake=False)
    assert fake.mode == "fake" and fake.by_phase == real.by_phase


@pytest.mark.parametrize(("i", "h", "t", "b"), [(64, 256, 300, 16), (40, 96, 500, 20), (128, 192, 200, 24)])
def test_the_workspace_fit_matches_the_real_kernel_at_held_out_shapes(i, h, t, b, monkeypatch) -> None:
    """Fitted from three probes under an 8 MiB budget (a quarter of the default), checked against the real
    kernel at (t, b), which none of the probes is (each section's page rounding is the residue)."""
    template = _lstm_template(i, h)
    exact = fake_fidelity._rnn_probe((t, b), template)
    monkeypatch.setattr(fake_fidelity, "RNN_PROBE_BYTES", 8 * 2**20)
    mkldnn_rnn_workspace_bytes.cache_clear()
    try:
        fitted = mkldnn_rnn_workspace_bytes(template, t, b)
    finally:
        mkldnn_rnn_workspace_bytes.cache_clear()
    assert exact > 8 * 2**20 and abs(fitted / exact - 1) <= 0.02, (fitted, exact)


@pytest.mark.parametrize(("loss", "kwargs", "unreduced"), [
    (nn.functional.mse_loss, {}, True), (nn.functional.mse_loss, {"reduction": "sum"}, True),
    (nn.functional.mse_loss, {"reduction": "none"}, True), (nn.functional.smooth_l1_loss, {}, True),
    (nn.functional.smooth_l1_loss, {"beta": 0.0}, False), (nn.functional.l1_loss, {}, False),
])
def test_reduced_losses_keep_the_real_kernels_storage(loss, kwargs, unreduced) -> None:
    x, y = torch.randn(2, 3, 8, 8, requires_grad=True), torch.randn(2, 3, 8, 8)
    out = loss(x, y, **kwargs)
    assert out.untyped_storage().nbytes() == (x.numel() * 4 if unreduced else 4)
    with FakeTensorMode() as mode, real_kernel_sizes():
        fake = loss(mode.from_tensor(x), mode.from_tensor(y), **kwargs)
        assert fake.untyped_storage().nbytes() == out.untyped_storage().nbytes() and fake.shape == out.shape


def test_a_scalar_draw_is_a_constant_that_drops_no_layer() -> None:
    with FakeTensorMode(), real_kernel_sizes():
        draw = torch.rand([])
        assert not bool(draw < 0.999) and float(draw) < 1.0
        assert torch.rand(3).constant is None  # a tensor of draws stays without values


def test_mask_padding_reads_masks_by_key_or_by_their_0_1_values() -> None:
    mask = torch.ones(2, 6, dtype=torch.long)
    assert mask_padding({"input_ids": torch.full((2, 6), 3), "attention_mask": mask}) == {(2, 6): False}
    mask[1, 4:] = 0
    batch = {"attention_mask": mask, "decoder_attention_mask": torch.ones(2, 3, dtype=torch.bool),
             "token_type_ids": torch.zeros(2, 6, dtype=torch.long)}
    assert mask_padding(batch) == {(2, 6): True, (2, 3): False}
    assert mask_padding((torch.full((2, 6), 7), mask, torch.arange(2))) == {(2, 6): True}  # a tuple batch
    assert mask_padding({"input_ids": torch.full((2, 6), 3)}) == {}


@pytest.mark.parametrize("padded", [True, False])
def test_a_bert_step_with_an_attention_mask_traces_as_the_real_one(padded: bool) -> None:
    """``padding_mask.all()`` made the fake trace stop (DataDependentOutputException); answered from the
    real batch, the fake step equals the real one with and without padding."""
    transformers = pytest.importorskip("transformers", reason="real Hugging Face models")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32)
    model = transformers.BertForMaskedLM(config)
    ids = torch.randint(5, 64, (3, 16))
    mask = torch.ones_like(ids)
    if padded:
        mask[2, 10:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    fake, real = trace_memory(model, batch), trace_memory(model, batch, fake=False)
    assert fake.mode == "fake" and fake.by_phase == real.by_phase
