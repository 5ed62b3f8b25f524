"""The formula terms of the loss, one function each, shared by the chunked and vocab-parallel paths.

Per token i with post-softcap logits s (global vocabulary V, target t, smoothing ε, z-loss λ):

    lse   = log Σ_j exp(s_j)                                   (fp32 whatever the input dtype)
    loss  = lse - (1-ε)·s_t - (ε/V)·Σ_j s_j + λ·lse²
    ∂loss/∂s_j = p_j·(1 + 2λ·lse) - (1-ε)·[j = t] - ε/V,        p = softmax(s)
    softcap: s = c·tanh(z/c),  ∂s/∂z = 1 - (s/c)²

Under vocab parallelism every rank r holds the slice of s for its vocabulary rows and these terms
combine across ranks with the functions below (sums, and a max for numerical safety). Functions ending
in ``_`` work in place on the [chunk, V] buffer so that only one such buffer is alive.
"""

from __future__ import annotations

import torch

__all__ = [
    "apply_softcap_",
    "combine_entropy",
    "combine_lse",
    "entropy_partial",
    "gradient_row_scale",
    "local_entropy",
    "softcap_derivative",
    "token_loss",
]


def apply_softcap_(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``s = c·tanh(z/c)`` in place (logit soft-capping; Gemma 2, arXiv:2408.00118 §2, and Grok-1)."""
    return logits.div_(cap).tanh_().mul_(cap)


def softcap_derivative(capped: torch.Tensor, cap: float, out: torch.Tensor) -> torch.Tensor:
    """``∂s/∂z = 1 - tanh²(z/c) = 1 - (s/c)²`` written into ``out`` (same shape as ``capped``)."""
    torch.div(capped, cap, out=out)
    return out.square_().neg_().add_(1.0)


def combine_lse(max_local: torch.Tensor, sumexp_local: torch.Tensor) -> torch.Tensor:
    """``lse = m + log Σ_j exp(s_j - m)`` from a row max m and the shifted sum (the stable
    log-sum-exp; Milakov & Gimelshein 2018, arXiv:1805.02867, eq. 4 for the cross-partition merge)."""
    return max_local + torch.log(sumexp_local)


def token_loss(
    lse: torch.Tensor,
    target_logit: torch.Tensor,
    sum_logits: torch.Tensor | None,
    *,
    label_smoothing: float,
    inv_vocab: float | torch.Tensor,
    z_loss: float,
) -> torch.Tensor:
    """Per-token loss ``lse - (1-ε)·s_t - (ε/V)·Σ_j s_j + λ·lse²``.

    The smoothing term follows ``F.cross_entropy`` (target (1-ε)·onehot + ε/V; Szegedy et al. 2016,
    arXiv:1512.00567 §7); the z-loss term is PaLM's auxiliary loss (arXiv:2204.02311 §5) that keeps
    the softmax normaliser near 1. ``inv_vocab`` is 1/V with V the global vocabulary.
    """
    loss = lse - (1.0 - label_smoothing) * target_logit
    if label_smoothing > 0.0 and sum_logits is not None:
        loss = loss - (label_smoothing * inv_vocab) * sum_logits
    if z_loss > 0.0:
        loss = loss + z_loss * lse * lse
    return loss


def gradient_row_scale(
    token_weight: torch.Tensor, lse: torch.Tensor, row_max: torch.Tensor, *, z_loss: float
) -> torch.Tensor:
    """Factor that turns ``exp(s - m)`` (the chunk buffer after the exp pass) into
    ``w·(1 + 2λ·lse)·p``: ``w·(1 + 2λ·lse)·exp(m - lse)``.

    ``w`` is the token's weight in the reduced loss (1/count for mean, 1 for sum, the incoming
    gradient for ``"none"``, 0 for ignored tokens); ``∂(λ·lse²)/∂s_j = 2λ·lse·p_j`` gives the z-loss
    part. With vocab parallelism ``m`` is the local row max and ``lse`` the global one, so the same
    factor yields the global softmax on the local slice.
    """
    scale = token_weight * torch.exp(row_max - lse)
    if z_loss > 0.0:
        scale = scale * (1.0 + 2.0 * z_loss * lse)
    return scale


def local_entropy(exp_shifted: torch.Tensor, sumexp: torch.Tensor, block_rows: int = 32) -> torch.Tensor:
    """Entropy of the local softmax ``H = log S - (Σ_j E_j log E_j)/S`` with ``E = exp(s - m)``.

    Evaluated in row blocks so the ``E log E`` temporary stays ``block_rows × V`` (metrics only).
    """
    acc = torch.empty(exp_shifted.shape[0], dtype=torch.float32, device=exp_shifted.device)
    for start in range(0, exp_shifted.shape[0], block_rows):
        block = exp_shifted[start : start + block_rows]
        acc[start : start + block_rows] = torch.special.xlogy(block, block).sum(1)
    return torch.log(sumexp) - acc / sumexp


def entropy_partial(
    entropy_local: torch.Tensor, lse_local: torch.Tensor, shift: torch.Tensor
) -> torch.Tensor:
    """Rank r's summand of the cross-rank entropy, ``exp(lse_r - M)·(H_r - lse_r)``.

    From ``H = lse - Σ_j p_j s_j`` and ``Σ_{j∈r} p_j s_j = q_r·(lse_r - H_r)`` with
    ``q_r = exp(lse_r - lse)``: ``H = Σ_r q_r·(H_r - lse_r) + lse``. ``M`` (any common shift, here the
    max of the ``lse_r``) keeps the exponentials bounded; :func:`combine_entropy` divides it back out.
    """
    return torch.exp(lse_local - shift) * (entropy_local - lse_local)


def combine_entropy(
    partial_sum: torch.Tensor, sumexp_shifted: torch.Tensor, lse_global: torch.Tensor
) -> torch.Tensor:
    """``H = (Σ_r exp(lse_r - M)·(H_r - lse_r)) / (Σ_r exp(lse_r - M)) + lse`` (see
    :func:`entropy_partial`)."""
    return partial_sum / sumexp_shifted + lse_global
