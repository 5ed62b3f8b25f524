"""``return_metrics=True``: accuracy, entropy, z-loss and token count against full-logit references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_memplan.loss import CrossEntropyMetricAggregator, LossMetrics, linear_cross_entropy


def reference_metrics(hidden, weight, target, *, softcap=None, z_loss=0.0, ignore_index=-100):
    logits = F.linear(hidden, weight).double().reshape(-1, weight.shape[0])
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    y = target.reshape(-1)
    valid = y != ignore_index
    logp = torch.log_softmax(logits, -1)[valid]
    lse = torch.logsumexp(logits, -1)[valid]
    return {
        "n_tokens": int(valid.sum()),
        "accuracy": (logits.argmax(-1)[valid] == y[valid]).double().mean(),
        "entropy": (-(logp.exp() * logp).sum(-1)).mean(),
        "lse_sq": (lse**2).mean(),
        "z_loss": z_loss * (lse**2).mean(),
    }


@pytest.mark.parametrize("mode", ["chunked", "fp32_upcast"])
@pytest.mark.parametrize("opts", [{}, {"softcap": 2.0, "z_loss": 1e-2}])
def test_metrics_match_reference(mode, opts):
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16)
    weight = torch.randn(41, 16) * 0.5
    target = torch.randint(0, 41, (3, 7))
    # make some predictions right so accuracy is not trivially 0
    logits = F.linear(hidden, weight)
    target[0] = logits[0].argmax(-1)
    target[2, :3] = -100
    loss, metrics = linear_cross_entropy(
        hidden, weight, target, chunk_size=4, return_metrics=True, mode=mode, **opts
    )
    assert isinstance(metrics, LossMetrics)
    ref = reference_metrics(hidden, weight, target, **opts)
    assert metrics.n_tokens.dtype == torch.int64 and int(metrics.n_tokens) == ref["n_tokens"] == 18
    assert 0 < float(metrics.accuracy) < 1
    for name in ("accuracy", "entropy", "lse_sq", "z_loss"):
        torch.testing.assert_close(getattr(metrics, name).double(), ref[name].double(), atol=1e-5, rtol=1e-5)
    assert set(metrics.as_dict("train/")) == {f"train/{k}" for k in LossMetrics._fields}


def test_metrics_all_ignored_are_zero_not_nan():
    loss, metrics = linear_cross_entropy(
        torch.randn(4, 8), torch.randn(5, 8), torch.full((4,), -100), return_metrics=True
    )
    assert int(metrics.n_tokens) == 0
    for value in metrics:
        assert torch.isfinite(value).all() and float(value) == 0.0


def test_aggregator_token_weighted_means():
    torch.manual_seed(1)
    weight = torch.randn(23, 8)
    agg = CrossEntropyMetricAggregator()
    batches = []
    for n in (5, 11):
        hidden, target = torch.randn(n, 8), torch.randint(0, 23, (n,))
        _, metrics = linear_cross_entropy(hidden, weight, target, return_metrics=True)
        agg.update(metrics)
        batches.append((hidden, target))
    hidden = torch.cat([b[0] for b in batches])
    target = torch.cat([b[1] for b in batches])
    ref = reference_metrics(hidden, weight, target)
    out = agg.compute()
    assert int(out["n_tokens"]) == 16
    for name in ("accuracy", "entropy", "lse_sq"):
        torch.testing.assert_close(out[name].double(), ref[name], atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="LossMetrics"):
        agg.update({"accuracy": 1.0})
