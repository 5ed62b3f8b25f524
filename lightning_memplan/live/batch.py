"""The batch of a running step: its shape ``(b, s)``, batches of other shapes with its structure, the
micro-batch of a pipeline step and the shapes a calibration traces.

Each function either returns its answer or raises :class:`InferenceError`, whose message says exactly
what could not be inferred and which argument supplies it, so the callback can keep measuring and report
the gap instead of failing the run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_memplan.model.specs import ParallelPlan
from lightning_memplan.tracking.batch import first_tensor

__all__ = ["InferenceError", "batch_factory", "batch_shape", "calibration_shapes", "stage_micro_batch"]


class InferenceError(ValueError):
    """Something the callback could not infer; the message names the argument that supplies it."""

def batch_shape(batch: Any, *, seq_len: int | None = None) -> tuple[int, int]:
    """``(micro_batch, seq_len)`` of one step's batch.

    The batch tensor is the token ids of a mapping (``input_ids``, ``tokens``, ``idx``, ...) or the first
    tensor found in nested tuples/lists/dicts/dataclasses. Its first dimension is b. Its second is s
    when the tensor holds integer token ids ``[b, s]`` or embeddings ``[b, s, h]``; a floating-point
    ``[b, features]`` tensor (an MLP's input) counts as one position per sample, s = 1. Anything else
    (images ``[b, c, H, W]``) needs ``seq_len=``: the sequence length the memory model should use.

    Raises:
        InferenceError: no tensor in the batch, a 0-d tensor, or an ambiguous layout without ``seq_len``.
    """
    tensor = first_tensor(batch)
    if tensor is None:
        raise InferenceError(
            f"could not find a tensor in the batch (type {type(batch).__name__}) to read its shape; pass "
            "MemoryPlanCallback(train_spec=TrainSpec(micro_batch=..., seq_len=...)) to give the shape"
        )
    if tensor.ndim == 0:
        raise InferenceError(
            "the batch tensor is a scalar, so it has no batch dimension; pass "
            "MemoryPlanCallback(train_spec=TrainSpec(micro_batch=..., seq_len=...))"
        )
    b = int(tensor.shape[0])
    if seq_len is not None:
        return b, int(seq_len)
    if tensor.ndim == 1:
        return b, 1
    if not tensor.is_floating_point() and tensor.ndim == 2:
        return b, int(tensor.shape[1])
    if tensor.is_floating_point() and tensor.ndim == 2:
        return b, 1
    if tensor.is_floating_point() and tensor.ndim == 3:
        return b, int(tensor.shape[1])
    raise InferenceError(
        f"the batch tensor has shape {tuple(tensor.shape)} and dtype {tensor.dtype}, which has no single "
        "sequence dimension; pass MemoryPlanCallback(seq_len=...) with the length the memory model should use"
    )

def batch_factory(batch: Any, micro_batch: int, seq_len: int) -> Callable[[int, int], Any]:
    """``(b, s) -> batch``: new batches with ``batch``'s structure and dtypes, resized from
    ``(micro_batch, seq_len)`` to ``(b, s)``, for tracing other shapes of the same step.

    Every tensor whose first dimension is ``micro_batch`` gets b there, and (when ``seq_len > 1``) every
    later dimension equal to ``seq_len`` gets s (token ids, labels, ``[b, 1, s, s]`` masks). Values are
    drawn with factory functions (``randint`` within the real tensor's value range, ``randn`` for floats)
    so that the batch is made of fake tensors when built inside ``FakeTensorMode``. Containers keep their
    type: tuples, lists, named tuples, dicts, ``BatchEncoding``-like mappings and dataclasses.
    """

    def template(t: torch.Tensor) -> tuple[Any, ...]:
        lo = hi = 0
        if t.numel() and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            lo, hi = int(t.min()), int(t.max())
        resized = [False] * t.ndim
        if t.ndim and t.shape[0] == micro_batch:
            resized[0] = True
            if seq_len > 1:
                for d in range(1, t.ndim):
                    resized[d] = t.shape[d] == seq_len
        return (tuple(t.shape), t.dtype, lo, hi, tuple(resized))

    def build(obj: Any, tmpl: Any, b: int, s: int) -> Any:
        if isinstance(obj, torch.Tensor):
            shape0, dtype, lo, hi, resized = tmpl
            shape = [
                (b if d == 0 else s) if r else n for d, (n, r) in enumerate(zip(shape0, resized, strict=True))
            ]
            if dtype == torch.bool:
                return torch.zeros(shape, dtype=dtype)
            if dtype.is_floating_point or dtype.is_complex:
                return torch.randn(shape, dtype=dtype)
            return torch.randint(lo, hi + 1, shape, dtype=dtype)
        if isinstance(obj, Mapping):
            data = {k: build(v, tmpl[k], b, s) for k, v in obj.items()}
            cls: Any = type(obj)
            try:
                return cls(data)
            except TypeError:
                return data
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(build(v, t, b, s) for v, t in zip(obj, tmpl, strict=True)))
        if isinstance(obj, (tuple, list)):
            return type(obj)(build(v, t, b, s) for v, t in zip(obj, tmpl, strict=True))
        if hasattr(obj, "__dataclass_fields__"):
            import dataclasses

            return dataclasses.replace(obj, **{k: build(getattr(obj, k), tmpl[k], b, s) for k in tmpl})
        return obj

    def make_template(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return template(obj)
        if isinstance(obj, Mapping):
            return {k: make_template(v) for k, v in obj.items()}
        if isinstance(obj, (tuple, list)):
            return [make_template(v) for v in obj]
        if hasattr(obj, "__dataclass_fields__"):
            return {k: make_template(getattr(obj, k)) for k in obj.__dataclass_fields__}
        return None

    tmpl = make_template(batch)
    return lambda b, s: build(batch, tmpl, b, s)

def stage_micro_batch(plan: ParallelPlan, batch: int) -> int:
    """The micro-batch one pipeline step runs: a dataloader batch of ``batch`` sequences is split into
    ``plan.microbatches`` micro-batches when ``pp > 1`` (``torch.distributed.pipelining`` schedules
    chunk the batch dimension), so the estimate is for ``batch // microbatches``; ``batch`` otherwise."""
    if plan.pp > 1 and plan.microbatches > 1:
        return max(1, batch // plan.microbatches)
    return batch

def calibration_shapes(b: int, s: int, head_dim: int | None) -> list[tuple[int, int]]:
    """Batch shapes to trace for the calibration fit, starting with the real one (exact there).

    ``(b, s)``, ``(b, s')`` with s' = 3s/4 and ``(2b, s)``: never longer than the real sequence (a learned
    position table may end at s), and three shapes so that the b*s and b*s^2 terms separate when attention
    is materialised (for sdpa the linear fit is a least-squares fit through the three, exact when memory is
    linear in tokens). s' avoids the head width, where ``[b, a, s, d]`` tensors would look like ``[.., s, s]``
    attention scores to the tracker. One-position batches (s = 1) vary the batch only.
    """
    if s < 4:
        return [(b, s), (2 * b, s)]
    shorter = (3 * s) // 4
    if shorter == head_dim:
        shorter -= 1
    return [(b, s), (b, shorter), (2 * b, s)]
