"""The materialising loss (modes ``"fp32_upcast"`` and ``"naive"``) and the torch backend adapter.

``fp32_upcast`` is what most training code does: ``F.cross_entropy(lm_head(h).float(), y)``; it holds
the [N, V] logits in the input dtype plus an fp32 copy and its log-softmax (seed
000_ae44ffcbb4645c0b.txt: 1×128K×128K bf16 logits are 32 GiB, the fp32 copy 64 GiB). It is kept as
a mode so that a memory plan can choose it when the logits are small, and so that benchmarks and the
memory model measure exactly what the chunked path replaces. It supports every option except vocab
parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_memplan.loss.chunked import STAT_FIELDS

__all__ = ["materialized_linear_cross_entropy", "torch_backend_supported", "torch_linear_cross_entropy"]


def materialized_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    upcast: bool,
    metrics: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, stats)`` from full [N, V] logits; same conventions as the chunked function."""
    logits = F.linear(hidden, weight, bias)
    if upcast:
        logits = logits.float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    per_token = F.cross_entropy(
        logits, target, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    ).float()
    valid = target != ignore_index
    count = valid.sum()
    stats = torch.zeros(len(STAT_FIELDS), dtype=torch.float32, device=hidden.device)
    stats[0] = count
    lse = torch.logsumexp(logits.float(), dim=-1) if (z_loss > 0.0 or metrics) else per_token
    if z_loss > 0.0:
        per_token = per_token + torch.where(valid, z_loss * lse * lse, 0.0)
    if metrics:
        with torch.no_grad():
            validf = valid.float()
            logp = torch.log_softmax(logits.float(), dim=-1)
            entropy = -(logp.exp() * logp).sum(-1)
            stats[1] = ((logits.argmax(-1) == target) & valid).sum()
            stats[2] = (entropy * validf).sum()
            stats[3] = (lse.detach() ** 2 * validf).sum()
    if reduction == "none":
        return per_token, stats
    total = per_token.sum()
    if reduction == "mean":
        total = total / count.clamp(min=1)
    return total, stats


def torch_backend_supported(
    *, label_smoothing: float, z_loss: float, softcap: float | None, metrics: bool, vocab_parallel: bool
) -> str | None:
    """None when torch's chunked ``F.linear_cross_entropy`` supports the options, else the reason."""
    if not hasattr(F, "linear_cross_entropy"):
        return f"torch {torch.__version__} has no F.linear_cross_entropy (added in 2.13)"
    unsupported = {
        "label_smoothing": label_smoothing != 0.0,
        "z_loss": z_loss != 0.0,
        "softcap": softcap is not None,
        "return_metrics": metrics,
        "process_group/DTensor weight": vocab_parallel,
    }
    names = [name for name, used in unsupported.items() if used]
    return None if not names else "torch's chunked path does not support " + ", ".join(names)


def torch_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    ignore_index: int,
    reduction: str,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's chunked ``F.linear_cross_entropy`` with our ``mean`` convention.

    torch returns NaN for a mean over zero tokens; this calls it with ``reduction="sum"`` and divides
    by ``max(count, 1)`` so an all-ignored batch gives 0 and zero gradients, like the chunked path.
    """
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_size, chunking_method=None)
    inner = "none" if reduction == "none" else "sum"
    loss = F.linear_cross_entropy(
        hidden,
        weight,
        target,
        linear_bias=bias,
        reduction=inner,
        ignore_index=ignore_index,
        options=options,
    ).float()
    valid = target != ignore_index
    count = valid.sum()
    stats = torch.zeros(len(STAT_FIELDS), dtype=torch.float32, device=hidden.device)
    stats[0] = count
    if reduction == "mean":
        loss = loss / count.clamp(min=1)
    return loss, stats
