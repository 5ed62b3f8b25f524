"""Token-level metrics of the loss, computed inside the chunks, and their aggregation across steps/ranks.

``linear_cross_entropy(..., return_metrics=True)`` returns ``(loss, LossMetrics)``. Every field is a
0-dim tensor on the loss's device (no host synchronisation), ready for ``self.log``. Under vocab
parallelism the values are already global over the tensor-parallel group; across data-parallel ranks
and steps use :class:`CrossEntropyMetricAggregator` (a torchmetrics ``Metric``: token-weighted sums
with ``dist_reduce_fx="sum"``, so ranks with more tokens weigh more).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torchmetrics import Metric

__all__ = ["CrossEntropyMetricAggregator", "LossMetrics", "metrics_from_stats"]


class LossMetrics(NamedTuple):
    """Token metrics of one call (means over non-ignored tokens; 0 when there are none)."""

    n_tokens: torch.Tensor
    """Number of non-ignored tokens (int64)."""
    accuracy: torch.Tensor
    """Fraction of tokens whose argmax logit (after softcap) is the target."""
    entropy: torch.Tensor
    """Mean entropy of the predicted distribution, nats."""
    z_loss: torch.Tensor
    """Mean z-loss term λ·lse² (0 when ``z_loss=0``)."""
    lse_sq: torch.Tensor
    """Mean lse² (the z-loss monitor of PaLM, logged even when λ = 0)."""

    def as_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """``{prefix + name: float tensor}`` for ``LightningModule.log_dict`` (``n_tokens`` as float so
        Lightning can reduce it)."""
        return {f"{prefix}{name}": value.float() for name, value in zip(self._fields, self, strict=True)}


def metrics_from_stats(stats: torch.Tensor, z_loss: float) -> LossMetrics:
    """Build :class:`LossMetrics` from the ``[n_tokens, correct, entropy_sum, lse_sq_sum]`` sums."""
    count = stats[0]
    denom = count.clamp(min=1.0)
    lse_sq = stats[3] / denom
    return LossMetrics(
        n_tokens=count.to(torch.int64),
        accuracy=(stats[1] / denom).float(),
        entropy=(stats[2] / denom).float(),
        z_loss=(z_loss * lse_sq).float(),
        lse_sq=lse_sq.float(),
    )


class CrossEntropyMetricAggregator(Metric):
    """Token-weighted running means of :class:`LossMetrics` over steps and data-parallel ranks.

    Example::

        agg = CrossEntropyMetricAggregator()
        loss, m = linear_cross_entropy(h, w, y, return_metrics=True)
        agg.update(m)
        agg.compute()  # {'accuracy': ..., 'entropy': ..., 'z_loss': ..., 'lse_sq': ..., 'n_tokens': ...}
    """

    n_tokens: torch.Tensor
    accuracy: torch.Tensor
    entropy: torch.Tensor
    z_loss: torch.Tensor
    lse_sq: torch.Tensor
    full_state_update = False
    higher_is_better = None
    is_differentiable = False

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        for name in ("n_tokens", "accuracy", "entropy", "z_loss", "lse_sq"):
            self.add_state(name, default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, metrics: LossMetrics) -> None:  # type: ignore[override]
        """Add one call's metrics, weighted by its token count."""
        if not isinstance(metrics, LossMetrics):
            raise TypeError(
                f"metrics={type(metrics).__name__} must be the LossMetrics returned by "
                "linear_cross_entropy(..., return_metrics=True)"
            )
        count = metrics.n_tokens.to(torch.float64)
        self.n_tokens += count
        self.accuracy += metrics.accuracy.to(torch.float64) * count
        self.entropy += metrics.entropy.to(torch.float64) * count
        self.z_loss += metrics.z_loss.to(torch.float64) * count
        self.lse_sq += metrics.lse_sq.to(torch.float64) * count

    def compute(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """Token-weighted means (0 when no tokens were seen) and the total token count."""
        denom = self.n_tokens.clamp(min=1.0)
        return {
            "accuracy": (self.accuracy / denom).float(),
            "entropy": (self.entropy / denom).float(),
            "z_loss": (self.z_loss / denom).float(),
            "lse_sq": (self.lse_sq / denom).float(),
            "n_tokens": self.n_tokens.to(torch.int64),
        }
