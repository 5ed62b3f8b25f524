"""The batch and module copies one traced step runs on (:func:`~lightning_memplan.tracking.trace.trace_memory`):
where its batch comes from (a real batch, or a ``(b, s)`` shape built by ``input_fn`` or drawn as token ids),
as real or fake tensors, and the module's private copy on the traced device. The user's module and batch
are only read.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_memplan.tracking.batch import first_tensor
from lightning_memplan.tracking.fake_fidelity import fake_batch_tensor, mask_padding
from lightning_memplan.tracking.fake_params import carry_quantized_attributes, is_stand_in

__all__ = ["TraceBatches", "batch_source", "clone_batch", "copy_module", "map_tensors", "move_module", "token_batch",
           "vocab_of"]


def vocab_of(module: nn.Module) -> int | None:
    """The vocabulary of the module's largest ``nn.Embedding`` (``None`` without one)."""
    sizes = [m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)]
    return max(sizes) if sizes else None


def token_batch(module: nn.Module, micro_batch: int, seq_len: int) -> torch.Tensor:
    """Random token ids ``[micro_batch, seq_len]`` from :func:`vocab_of` (the error names what to pass)."""
    vocab = vocab_of(module)
    if vocab is None:
        raise ValueError(
            f"batch_shape=({micro_batch}, {seq_len}) builds token ids, but {type(module).__name__} has no "
            "nn.Embedding to take the vocabulary from; pass example_input= or input_fn=(b, s) -> batch"
        )
    return torch.randint(0, vocab, (micro_batch, seq_len))


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` with ``fn`` applied to each tensor of its tensors, mappings, lists and tuples."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def copy_module(module: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """A private deep copy of ``module``; what a LightningModule merely points at (its Trainer, Fabric)
    is not copied; ``memo`` pre-filled entries (``tracking/fake_params.py``) are taken as they are."""
    memo = {} if memo is None else memo
    for attr in ("_trainer", "_fabric", "_fabric_optimizers"):
        value = module.__dict__.get(attr)
        if value is not None:
            memo[id(value)] = None
    return copy.deepcopy(module, memo)


def move_module(module: nn.Module, device: torch.device) -> nn.Module:
    """The (private) module with its parameters and buffers on ``device``; fake ones (and bitsandbytes'
    stand-ins, ``tracking/fake_params.py``) re-created there."""
    tensors = [*module.parameters(), *module.buffers()]
    if all(t.device == device for t in tensors):
        return module
    if not any(is_stand_in(p) for p in module.parameters()):  # their attributes would not follow Module._apply
        try:
            return module.to(device)
        except RuntimeError:
            pass
    # Fake parameters carry weak references (the fake-tensor memo), so ``Module._apply`` cannot swap
    # them in place; re-create them on the device instead (tied parameters stay tied).
    return _recreated_on(module, device)


def _recreated_on(module: nn.Module, device: torch.device) -> nn.Module:
    """``module`` with every parameter re-created on ``device`` (a bitsandbytes stand-in with its attributes,
    a ``Linear8bitLt``'s ``state.CB`` following its weight) and every buffer moved."""
    moved: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in moved:
                moved[id(p)] = nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)
                carry_quantized_attributes(p, moved[id(p)], device)  # bitsandbytes' stand-ins
            mod._parameters[name] = moved[id(p)]
            state: Any = getattr(mod, "state", None)  # Linear8bitLt's MatmulLtState: CB is its weight
            if getattr(state, "CB", None) is p:
                state.CB = moved[id(p)]
        for name, buf in list(mod._buffers.items()):
            if buf is not None:
                mod._buffers[name] = buf.to(device)
    return module


@dataclass(frozen=True)
class TraceBatches:
    """How one trace gets its batch: ``real()`` builds real tensors (the real fallback step), ``fake(mode)``
    fake ones; b and s of the batch, and ``{(rows, length): padded}`` of its attention masks."""

    micro_batch: int
    seq: int | None
    real: Callable[[], Any]
    fake: Callable[[Any], Any]
    padding: Mapping[tuple[int, int], bool]


def clone_batch(batch: Any) -> Any:
    """The batch with every tensor cloned once (a tensor that appears twice stays one tensor)."""
    clones: dict[int, torch.Tensor] = {}

    def clone(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in clones:
            clones[id(t)] = t.detach().clone()
        return clones[id(t)]

    return map_tensors(batch, clone)


def batch_source(module: nn.Module, example_input: Any, batch_shape: tuple[int, int] | None,
                 input_fn: Callable[[int, int], Any] | None) -> TraceBatches:
    """The :class:`TraceBatches` of ``example_input``, or of ``batch_shape`` built by ``input_fn`` (token ids
    from the module's largest embedding when none); a batch factory's ``padding_at(b, s)`` is asked for the
    padding of its masks (the real batch's, resized)."""
    if batch_shape is not None:
        b, s = batch_shape

        def make_batch(_mode: Any = None) -> Any:
            return input_fn(b, s) if input_fn is not None else token_batch(module, b, s)

        padding_at = getattr(input_fn, "padding_at", None)
        return TraceBatches(b, s, make_batch, make_batch, padding_at(b, s) if callable(padding_at) else {})
    first = first_tensor(example_input)
    if first is None:
        raise ValueError("example_input holds no tensor; pass a batch of tensors or batch_shape=")
    micro_batch = int(first.shape[0]) if first.dim() else 1
    seq = int(first.shape[1]) if first.dim() == 2 and not first.is_floating_point() else None
    return TraceBatches(micro_batch, seq, lambda: clone_batch(example_input),
                        lambda mode: map_tensors(example_input, lambda t: fake_batch_tensor(mode, t)),
                        mask_padding(example_input))
