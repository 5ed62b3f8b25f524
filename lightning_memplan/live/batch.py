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

__all__ = ["BatchFactory", "InferenceError", "batch_factory", "batch_shape", "calibration_shapes", "stage_micro_batch"]


class InferenceError(ValueError):
    """Something the callback could not infer; the message names the argument that supplies it."""

def batch_shape(batch: Any, *, seq_len: int | None = None) -> tuple[int, int]:
    """``(micro_batch, seq_len)`` of one step's batch: b, and s the size axis the memory grows with.

    The batch tensor is the token ids of a mapping (``input_ids``, ``tokens``, ``idx``, ...) or the first
    tensor found in nested tuples/lists/dicts/dataclasses. Its first dimension is b. s is:

    - text: the tokens, from integer token ids ``[b, s]`` or embeddings ``[b, s, h]``;
    - a fixed-size sample: 1, for a floating-point ``[b, features]`` tensor (an MLP's input or a raw
      waveform ``[b, samples]``) and for images and videos (``[b, c, H, W]``, ``[b, c, T, H, W]``): their
      memory grows with b alone while the sample size stays fixed, so the estimate is per sample;
    - ``seq_len=`` when given: the length of the axis to follow instead (a waveform's samples, a video's
      frames); the calibration then resizes every batch dimension of that length.

    Raises:
        InferenceError: no tensor in the batch or a 0-d tensor.
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
    if not tensor.is_floating_point() and tensor.ndim == 2:
        return b, int(tensor.shape[1])
    if tensor.is_floating_point() and tensor.ndim == 3:
        return b, int(tensor.shape[1])
    return b, 1


def _resample_index(n_from: int, n_to: int, *, cycle: bool) -> torch.Tensor:
    """Indices into ``n_from`` positions for ``n_to``: samples repeat in turn (``cycle``, the batch axis),
    sequence positions are the nearest with both ends kept (position 0 -> 0, the last -> the last), so a
    mask's padding run, a segment boundary or a run of ignored labels keeps its place and share."""
    positions = torch.arange(n_to, dtype=torch.int64)
    if cycle:
        return positions % n_from
    if n_to == 1 or n_from == 1:
        return torch.zeros(n_to, dtype=torch.int64)
    return torch.div(positions * (n_from - 1) * 2 + (n_to - 1), 2 * (n_to - 1), rounding_mode="floor")


class BatchFactory:
    """``(b, s) -> batch``: the real batch resized from ``(micro_batch, seq_len)`` to ``(b, s)``, for
    tracing other shapes of the same step (:func:`batch_factory`).

    Attributes:
        resized: ``"<path>[<dims>]"`` for each tensor that is resized (dim 0 the batch, the others the
            sequence), e.g. ``("input_ids[0,1]", "labels[0,1]", "pixel_values[0]")``.
        resizes_batch: whether any tensor has the batch dimension (``micro_batch`` first).
        resizes_seq: whether any tensor has a dimension of ``seq_len`` after the first (``seq_len > 1``).
        batch_only_inputs: the floating-point tensors resized along the batch alone while others have the
            sequence axis (a dual encoder's ``pixel_values`` beside its ``input_ids``): then memory is not
            a function of b*s alone.
    :meth:`padding_at` says which attention masks of a resized batch hold padding: what a fake step
    answers when a library asks (``tracking/fake_fidelity.py``).
    """

    def __init__(self, batch: Any, micro_batch: int, seq_len: int) -> None:
        self.batch, self.micro_batch, self.seq_len = batch, int(micro_batch), int(seq_len)
        self.resized: tuple[str, ...] = tuple(self._plan(batch, "batch", 0))
        self.resizes_batch = any("[0" in r for r in self.resized)
        self.resizes_seq = self.seq_len > 1 and any(r.split("[")[-1] != "0]" for r in self.resized)
        self.batch_only_inputs: tuple[str, ...] = tuple(self._batch_only(batch, "batch", 0))

    def _dims(self, t: torch.Tensor) -> tuple[bool, ...]:
        if not t.ndim or t.shape[0] != self.micro_batch:
            return (False,) * t.ndim
        seq = [self.seq_len > 1 and t.shape[d] == self.seq_len for d in range(1, t.ndim)]
        return (True, *seq)

    def _plan(self, obj: Any, path: str, depth: int) -> list[str]:
        if isinstance(obj, torch.Tensor):
            dims = [str(d) for d, r in enumerate(self._dims(obj)) if r]
            return [f"{path}[{','.join(dims)}]"] if dims else []
        if depth > 6:
            return []
        items = _children(obj)
        return [r for key, value in items for r in self._plan(value, f"{path}.{key}" if path != "batch" else
                                                                 str(key), depth + 1)]

    def _batch_only(self, obj: Any, path: str, depth: int) -> list[str]:
        if not self.resizes_seq or depth > 6:
            return []
        if isinstance(obj, torch.Tensor):
            return [path] if obj.is_floating_point() and self._dims(obj) == (True,) + (False,) * (obj.ndim - 1) else []
        return [r for key, value in _children(obj)
                for r in self._batch_only(value, f"{path}.{key}" if path != "batch" else str(key), depth + 1)]

    def describe(self) -> str:
        """One line: what is resized, for the report's notes."""
        if not self.resized:
            return "no tensor of the batch has the batch dimension, so nothing can be resized"
        return "resized " + ", ".join(self.resized[:8]) + (" ..." if len(self.resized) > 8 else "") + \
            " (dim 0 the micro-batch, the others the sequence)"

    def _tensor(self, t: torch.Tensor, b: int, s: int) -> torch.Tensor:
        from torch._guards import active_fake_mode
        from torch.utils._python_dispatch import _disable_current_modes

        from lightning_memplan.tracking.fake_fidelity import fake_batch_tensor

        dims = self._dims(t)
        shape = [(b if d == 0 else s) if r else n for d, (n, r) in enumerate(zip(t.shape, dims, strict=True))]
        mode = active_fake_mode()
        if mode is not None and (t.is_floating_point() or t.is_complex()):
            return torch.empty(shape, dtype=t.dtype, device=t.device)  # a fake step: no values, no allocation
        if mode is not None:  # integer ids, labels and masks keep their values (fake_batch_tensor)
            with _disable_current_modes():
                real = self._resampled(t, dims, shape)
            return fake_batch_tensor(mode, real)
        return self._resampled(t, dims, shape)

    @staticmethod
    def _resampled(t: torch.Tensor, dims: tuple[bool, ...], shape: list[int]) -> torch.Tensor:
        out = t.detach()
        for d, resize in enumerate(dims):
            if resize and shape[d] != t.shape[d]:
                index = _resample_index(t.shape[d], shape[d], cycle=d == 0).to(t.device)
                out = out.index_select(d, index)
        return out.clone()

    def __call__(self, b: int, s: int) -> Any:
        return _rebuild(self.batch, lambda t: self._tensor(t, b, s))

    def padding_at(self, b: int, s: int) -> dict[tuple[int, int], bool]:
        """``{(rows, length): padded}`` of the attention masks of the batch resized to ``(b, s)``
        (:func:`~lightning_memplan.tracking.fake_fidelity.mask_padding` of the real values, resized)."""
        from torch.utils._python_dispatch import _disable_current_modes

        from lightning_memplan.tracking.fake_fidelity import mask_padding

        def masks_only(t: torch.Tensor) -> torch.Tensor:  # the 2-d integer tensors: masks and token ids
            small = t.ndim == 2 and not t.is_floating_point() and not t.is_complex()
            return self._tensor(t, b, s) if small else t

        with _disable_current_modes():  # real values, also when asked inside a fake step
            return mask_padding(_rebuild(self.batch, masks_only))


def _children(obj: Any) -> list[tuple[Any, Any]]:
    if isinstance(obj, Mapping):
        return list(obj.items())
    if isinstance(obj, (tuple, list)):
        return list(enumerate(obj))
    if hasattr(obj, "__dataclass_fields__"):
        return [(k, getattr(obj, k)) for k in obj.__dataclass_fields__]
    return []


def _rebuild(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor], depth: int = 0) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor)``; containers keep their type: tuples, lists,
    named tuples, dicts, ``BatchEncoding``-like mappings and dataclasses."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if depth > 6:
        return obj
    if isinstance(obj, Mapping):
        data = {k: _rebuild(v, fn, depth + 1) for k, v in obj.items()}
        cls: Any = type(obj)
        try:
            return cls(data)
        except TypeError:
            return data
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_rebuild(v, fn, depth + 1) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_rebuild(v, fn, depth + 1) for v in obj)
    if hasattr(obj, "__dataclass_fields__"):
        import dataclasses

        return dataclasses.replace(obj, **{k: _rebuild(getattr(obj, k), fn, depth + 1)
                                           for k in obj.__dataclass_fields__ if getattr(obj, k) is not None})
    return obj


def batch_factory(batch: Any, micro_batch: int, seq_len: int) -> BatchFactory:
    """``(b, s) -> batch``: the real ``batch`` resized from ``(micro_batch, seq_len)`` to ``(b, s)``, with
    its structure, dtypes and meaning, for tracing other shapes of the same step.

    Every tensor whose first dimension is ``micro_batch`` gets b there (its samples repeated in turn), and
    (when ``seq_len > 1``) every later dimension equal to ``seq_len`` gets s (token ids, labels, masks,
    ``[b, 1, s, s]`` masks), by taking the real tensor's nearest positions with both ends kept. So the
    resized batch holds only the real batch's values: ignored labels (-100) stay at the same relative
    positions and share and every other label is a real class id, attention masks keep their 0/1 padding
    runs, token-type ids their segments, pixel and audio values their range, dtypes and devices as they
    were. Under ``FakeTensorMode`` the tensors are made empty (fake: no values, no allocation).
    Containers keep their type: tuples, lists, named tuples, dicts, ``BatchEncoding``-like mappings and
    dataclasses. The returned :class:`BatchFactory` says what it resizes (``resized``, ``resizes_seq``):
    a batch with no dimension of ``seq_len`` (an image batch with ``seq_len=`` the patch count) cannot be
    traced at another s.
    """
    return BatchFactory(batch, micro_batch, seq_len)


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
