"""Activation checkpointing written inside ``forward`` (``torch.utils.checkpoint.checkpoint`` or
``checkpoint_sequential`` called by hand), which the module tree does not show.

``model.readers.recompute_of`` recognises checkpointing applied *to* modules (Hugging Face's
``gradient_checkpointing_enable``, ``checkpoint_wrapper``, the composable ``checkpoint``); a call in a
``forward`` or ``training_step`` leaves no trace on the modules. What every form of checkpointing does,
however it is applied, is run a checkpointed module's ``forward`` a second time *during the backward*
(torch 2.13 ``torch/utils/checkpoint.py``: the non-reentrant form recomputes in the unpack hook of the
first saved tensor needed, the reentrant form in ``CheckpointFunction.backward``; both inside the autograd
engine). :class:`RecomputeObserver` counts, while a training step runs (the calibration trace), how many
forward calls of the transformer blocks' class happen outside the engine and how many inside it
(``torch._C._current_graph_task_id() != -1`` while the engine runs a graph task):

- every block run again in the backward: full recompute, ``TrainSpec(recompute="full")``;
- some: partial (e.g. ``checkpoint_sequential``, which never checkpoints its last segment);
- modules re-run but no block: checkpointing inside the blocks.

:func:`written_checkpointing` is the fallback when no step was observed: the methods of the module's
classes whose code reaches ``torch.utils.checkpoint`` (:func:`~lightning_memplan.tracking.compiled.
referenced_objects` plus the attribute names the code reads).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_memplan.tracking.compiled import referenced_objects

__all__ = ["RecomputeObserver", "RecomputeSeen", "written_checkpointing"]

#: The functions of ``torch.utils.checkpoint`` a hand-written checkpoint calls.
_CHECKPOINT_NAMES = frozenset({"checkpoint", "checkpoint_sequential"})


@dataclass(frozen=True)
class RecomputeSeen:
    """Forward calls observed during a step. ``blocks``: of the blocks' class outside the backward;
    ``rebuilt``: of the blocks' class inside it; ``others_rebuilt``: of any other module inside it."""

    blocks: int = 0
    rebuilt: int = 0
    others_rebuilt: int = 0

    @property
    def recompute(self) -> str:
        """``"full"`` when every block forward was run again in the backward, else ``"none"``."""
        return "full" if self.blocks and self.rebuilt >= self.blocks else "none"

    def describe(self) -> str | None:
        """A sentence for the report when checkpointing was seen that ``recompute`` does not capture
        (partial, or inside the blocks); ``None`` otherwise."""
        if self.blocks and 0 < self.rebuilt < self.blocks:
            return (f"activation checkpointing written in forward recomputes {self.rebuilt} of every {self.blocks} "
                    "block forward calls (seen in the calibration trace): a partial recompute the memory model has "
                    "no form for; the calibrated peak is traced, the analytic backward points count those blocks "
                    "as saving everything (an upper bound)")
        if not self.rebuilt and self.others_rebuilt:
            return ("activation checkpointing written inside the blocks' forward (modules run again in the backward, "
                    "seen in the calibration trace): the calibrated peak is traced, the analytic backward points count "
                    "the blocks as saving everything (an upper bound)")
        return None


class RecomputeObserver:
    """Within the ``with`` block, counts forward calls of modules of ``block_types`` outside and inside the
    autograd engine (a global forward pre-hook, removed on exit; module docstring).

    Example::

        with RecomputeObserver({type(model.blocks[0])}) as observer:
            trace_memory(model, batch_shape=(2, 64))
        observer.seen.recompute  # "full" when every block was checkpointed
    """

    def __init__(self, block_types: Iterable[type]) -> None:
        self.block_types = tuple(block_types)
        self._counts = [0, 0, 0]
        self._handle: Any = None

    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        in_backward = torch._C._current_graph_task_id() != -1
        if isinstance(module, self.block_types):
            self._counts[1 if in_backward else 0] += 1
        elif in_backward:
            self._counts[2] += 1

    @property
    def seen(self) -> RecomputeSeen:
        return RecomputeSeen(*self._counts)

    def __enter__(self) -> RecomputeObserver:
        self._handle = nn.modules.module.register_module_forward_pre_hook(self._pre_hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def _reaches_checkpoint(fn: Any) -> bool:
    """Whether ``fn``'s code calls ``torch.utils.checkpoint``'s ``checkpoint``/``checkpoint_sequential``: it
    names one of them (imported as a global, closed over) or reads an attribute of that name through
    ``torch`` or the ``torch.utils.checkpoint`` module."""
    import torch.utils.checkpoint as ckpt

    targets = {id(ckpt.checkpoint), id(ckpt.checkpoint_sequential)}
    objects = referenced_objects(fn)
    if any(id(obj) in targets for _, obj in objects):
        return True
    code = getattr(inspect.unwrap(fn), "__code__", None)
    names = set(code.co_names) if code is not None else set()
    via_module = any(obj is ckpt or obj is torch or obj is torch.utils for _, obj in objects)
    return via_module and bool(names & _CHECKPOINT_NAMES)


def written_checkpointing(module: nn.Module) -> list[str]:
    """``"<Class>.<method>"`` for each ``forward`` (of any submodule's class) and ``training_step`` whose
    code calls ``torch.utils.checkpoint`` by hand (:func:`_reaches_checkpoint`); empty when none does."""
    found: list[str] = []
    seen: set[type] = set()
    for sub in module.modules():
        cls = type(sub)
        if cls in seen or cls.__module__.startswith("torch."):
            continue
        seen.add(cls)
        for method in ("forward", "training_step"):
            fn = cls.__dict__.get(method)
            if fn is not None and _reaches_checkpoint(fn):
                found.append(f"{cls.__name__}.{method}")
    return found
