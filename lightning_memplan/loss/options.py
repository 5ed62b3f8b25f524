"""Options of the linear cross-entropy loss, their validation, and the ``chunk_size="auto"`` rule.

:class:`LossOptions` is the frozen, keyword-only record that :func:`linear_cross_entropy` and
:class:`LinearCrossEntropy` build from their keyword arguments (frozen, keyword-only, validated in ``__post_init__``). Everything that can be
checked without looking at tensors is checked in ``__post_init__``; the shape checks that need the
tensors live in :func:`check_inputs`. Every error names the argument, shows the value with ``!r``,
states the rule and suggests the fix.

Symbols follow docs/concepts.md: N tokens (b·s), h hidden, V vocab, t tensor-parallel size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = [
    "AUTO_CHUNK_BUDGET_BYTES",
    "BACKENDS",
    "AUTO_MIN_CHUNKS",
    "CHUNK_ROW_MULTIPLE",
    "LossOptions",
    "MODES",
    "REDUCTIONS",
    "auto_chunk_size",
    "chunk_row_bytes",
    "check_inputs",
    "check_targets",
]

REDUCTIONS = ("mean", "sum", "none")
"""Accepted ``reduction`` values, as in ``F.cross_entropy``."""

MODES = ("auto", "chunked", "vocab_parallel", "fp32_upcast", "naive")
"""Loss modes. ``"auto"``: vocab-parallel when ``weight`` is a vocab-sharded DTensor or a
``process_group`` is given, chunked otherwise. ``"chunked"``: token chunks, one process.
``"vocab_parallel"``: local vocab slice per rank (also chunked). ``"fp32_upcast"``: the reference
``F.cross_entropy(logits.float())`` that materialises [N, V]. ``"naive"``: the same on logits in the
input dtype. The last four names match ``TrainSpec.loss`` of the memory model."""

BACKENDS = ("auto", "memplan", "torch")
"""Chunked-path implementations. ``"torch"`` is ``F.linear_cross_entropy`` with
``LinearCrossEntropyOptions`` (torch >= 2.13), usable only without label smoothing, z-loss, softcap,
metrics, validation or vocab parallelism. ``"auto"`` picks per device from measurements
(benchmarks/results/*loss*.md): on CPU ours was faster, so ``"auto"`` uses ``"memplan"`` there."""

# The auto-chunk rule and its constants live in the pure memory model, so the loss, the planner and
# the estimate use one rule.
from lightning_memplan.model.terms import (  # noqa: E402
    AUTO_CHUNK_BUDGET_BYTES,
    AUTO_MIN_CHUNKS,
    CHUNK_ROW_MULTIPLE,
    auto_loss_chunk_tokens,
    loss_chunk_row_bytes,
)
from lightning_memplan.validation import check_bool, check_choice, check_int, check_number  # noqa: E402

#: The range of ``ignore_index``: targets are int64 (``F.cross_entropy``'s), so an id outside it never matches.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True, kw_only=True)
class LossOptions:
    """Options of :func:`~lightning_memplan.loss.linear_cross_entropy` (all keyword-only).

    Validated on construction; shape checks that need tensors are in :func:`check_inputs`.
    """

    ignore_index: int = -100
    """Target id that contributes neither to the loss nor to the token count (``F.cross_entropy``)."""
    reduction: str = "mean"
    """``"mean"`` (sum over non-ignored tokens divided by their count; 0 when every token is
    ignored), ``"sum"``, or ``"none"`` (per-token losses shaped like ``target``, 0 where ignored)."""
    label_smoothing: float = 0.0
    """ε in [0, 1): target distribution (1-ε)·onehot + ε/V, as ``F.cross_entropy`` (Szegedy et al.
    2016, arXiv:1512.00567 §7); V is the *global* vocabulary also under vocab parallelism."""
    z_loss: float = 0.0
    """λ ≥ 0: adds λ·lse² per token (PaLM, arXiv:2204.02311 §5; Liger's ``lse_square_scale``)."""
    softcap: float | None = None
    """c > 0 or None: logits ← c·tanh(logits / c) before the loss (Gemma 2, arXiv:2408.00118 §2)."""
    shift: bool = False
    """Predict ``target[:, 1:]`` from ``hidden[:, :-1]`` (causal LM labels equal to the inputs)."""
    chunk_size: int | str = "auto"
    """Tokens per chunk (int > 0) or ``"auto"`` (:func:`auto_chunk_size`)."""
    chunk_budget_bytes: int = AUTO_CHUNK_BUDGET_BYTES
    """Working-set budget in bytes used by ``chunk_size="auto"``."""
    mode: str = "auto"
    """One of :data:`MODES`."""
    backend: str = "auto"
    """One of :data:`BACKENDS` (chunked path only)."""
    validate_targets: bool = False
    """Check target ids (``0 <= id < V`` or ``ignore_index``) and sequence-shard sizes eagerly, raising
    ``ValueError`` that lists the bad ids; costs one host synchronisation per call on CUDA. Whatever
    this flag, an out-of-range id never gives a loss: on CPU it is always checked eagerly
    (``ValueError``); on CUDA without this flag the check is queued on the device
    (``torch._assert_async``, no host sync), so a bad id fails as a device-side assertion at the next
    synchronisation, as ``F.cross_entropy``'s own bound check does."""
    sequence_parallel: bool = False
    """With a plain-tensor ``hidden`` and ``process_group``: ``hidden`` is this rank's slice of the
    sequence dim (every rank the same length); ``target`` may be the same slice or the full sequence.
    A DTensor ``hidden`` sharded on the sequence dim implies it (uneven shards allowed)."""
    allow_retain_graph: bool = False
    """Keep the precomputed gradients intact in backward so the graph can be backpropagated twice
    (``retain_graph=True``, ``torch.autograd.gradcheck``); costs one more [V, h] buffer in backward.
    Without it a second backward raises ``RuntimeError``."""
    accum_dtype: torch.dtype = torch.float32
    """Dtype of the weight/bias gradient accumulator across chunks (fp32 by default; the low-precision
    accumulation that made Liger-Kernel diverge, Liger issue 512, is what this avoids)."""

    def __post_init__(self) -> None:
        # checked values stored back plain (np.int64 -> int, a 0-d tensor -> its item): options are data
        keep = functools.partial(object.__setattr__, self)
        keep("ignore_index", check_int(
            "ignore_index", self.ignore_index, minimum=INT64_MIN, maximum=INT64_MAX,
            hint="a target id compared with int64 targets, e.g. -100 (F.cross_entropy's default)"))
        keep("reduction", check_choice("reduction", self.reduction, REDUCTIONS))
        keep("label_smoothing", check_number(
            "label_smoothing", self.label_smoothing, minimum=0.0, maximum=1.0, max_inclusive=False,
            hint="in [0, 1), as in F.cross_entropy; typical values are 0.0 or 0.1"))
        keep("z_loss", check_number("z_loss", self.z_loss, minimum=0.0,
                                    hint="a finite float >= 0; PaLM uses 1e-4, 0 disables it"))
        if self.softcap is not None:
            keep("softcap", check_number("softcap", self.softcap, minimum=0.0, min_inclusive=False,
                                         hint="a finite float > 0 or None; Gemma 2 uses 30.0 for final logits"))
        if isinstance(self.chunk_size, str):
            if self.chunk_size != "auto":
                raise ValueError(f"chunk_size={self.chunk_size!r} must be a positive int or 'auto'")
            keep("chunk_size", "auto")
        else:
            keep("chunk_size", check_int("chunk_size", self.chunk_size,
                                         hint="tokens per chunk, an int > 0 (e.g. 1024), or 'auto'"))
        keep("chunk_budget_bytes", check_int("chunk_budget_bytes", self.chunk_budget_bytes,
                                             hint="a positive int number of bytes, e.g. 2**30"))
        keep("mode", check_choice("mode", self.mode, MODES))
        keep("backend", check_choice("backend", self.backend, BACKENDS))
        for name in ("shift", "validate_targets", "allow_retain_graph", "sequence_parallel"):
            keep(name, check_bool(name, getattr(self, name)))
        if self.accum_dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            raise ValueError(f"accum_dtype={self.accum_dtype!r} must be a floating dtype; keep torch.float32")
        if self.mode in ("naive", "fp32_upcast") and self.sequence_parallel:
            raise ValueError(
                f"sequence_parallel=True needs mode 'vocab_parallel' or 'auto', got mode={self.mode!r}"
            )


def _device_type(device: str | torch.device) -> str:
    """``"cuda"``, ``"cpu"``, ... of a device or device string; a clear error for anything else."""
    if isinstance(device, torch.device):
        return device.type
    if not isinstance(device, str):
        raise TypeError(f"device={device!r} must be a device type string such as 'cuda' or 'cpu', or a torch.device")
    try:
        return torch.device(device).type
    except RuntimeError:
        raise ValueError(f"device={device!r} is not a torch device; pass 'cuda', 'cpu' or another torch device type") from None


def chunk_row_bytes(
    vocab: int, compute_dtype: torch.dtype, *, softcap: bool = False, device: str | torch.device = "cuda"
) -> int:
    """Bytes of chunk working set per token row on ``device``: ``V·(4 + g [+ 4])``, g the GEMM dtype's
    element size (:func:`lightning_memplan.model.terms.loss_chunk_row_bytes`)."""
    return loss_chunk_row_bytes(vocab, compute_dtype.itemsize, softcap=softcap, device=_device_type(device))


def auto_chunk_size(
    n_tokens: int,
    hidden: int,
    vocab: int,
    compute_dtype: torch.dtype = torch.float32,
    *,
    budget_bytes: int = AUTO_CHUNK_BUDGET_BYTES,
    softcap: bool = False,
    device: str | torch.device = "cuda",
) -> int:
    """Tokens per chunk for ``chunk_size="auto"`` on ``device``: deterministic in the shapes
    (:func:`lightning_memplan.model.terms.auto_loss_chunk_tokens`). Chunking is skipped (one chunk
    of N rows) when N ≤ h: then the [N, V] logits are no larger than the [V, h] weight and its fp32
    gradient that exist anyway."""
    return auto_loss_chunk_tokens(
        n_tokens,
        hidden,
        vocab,
        compute_dtype.itemsize,
        budget_bytes=budget_bytes,
        softcap=softcap,
        device=_device_type(device),
    )


def check_inputs(
    hidden_shape: tuple[int, ...],
    weight_shape: tuple[int, ...],
    target_shape: tuple[int, ...],
    bias_shape: tuple[int, ...] | None,
    *,
    target_dtype: torch.dtype,
    shift: bool,
) -> None:
    """Check shapes of ``hidden`` [B, S, h] or [N, h], ``weight`` [V, h], ``bias`` [V], ``target``.

    ``weight_shape`` is the local (per-rank) shape under vocab parallelism.
    """
    if len(hidden_shape) not in (2, 3):
        raise ValueError(
            f"hidden must be [B, S, h] or [N, h], got shape {tuple(hidden_shape)}; reshape it first"
        )
    if len(weight_shape) != 2:
        raise ValueError(f"weight must be [V, h] (an lm_head weight), got shape {tuple(weight_shape)}")
    if hidden_shape[-1] != weight_shape[1]:
        raise ValueError(
            f"hidden last dim {hidden_shape[-1]} (hidden.shape={tuple(hidden_shape)}) must equal "
            f"weight dim 1 (weight.shape={tuple(weight_shape)}); pass the lm_head weight [V, h]"
        )
    if bias_shape is not None and tuple(bias_shape) != (weight_shape[0],):
        raise ValueError(
            f"bias.shape={tuple(bias_shape)} must be ({weight_shape[0]},) to match "
            f"weight.shape={tuple(weight_shape)}"
        )
    if target_dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target.dtype={target_dtype} must be torch.int64 (class ids)")
    expected = tuple(hidden_shape[:-1])
    if tuple(target_shape) != expected:
        raise ValueError(
            f"target.shape={tuple(target_shape)} must equal hidden.shape[:-1]={expected} "
            f"(hidden.shape={tuple(hidden_shape)})"
        )
    if shift and len(hidden_shape) != 3:
        raise ValueError(
            f"shift=True needs hidden [B, S, h] and target [B, S], got hidden.shape={tuple(hidden_shape)}"
        )


def check_targets(target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Raise ``ValueError`` listing out-of-range target ids (validation mode; synchronises the host)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        ids = torch.unique(target[bad])[:8].tolist()
        raise ValueError(
            f"target contains ids {ids} outside [0, {vocab}) that are not ignore_index={ignore_index}; "
            "fix the labels or the vocab size (weight.shape[0])"
        )
