"""Weight-averaging copies a run keeps beside the module it trains: what the ``averaged`` component of the
estimate and of the measurement counts (:attr:`~lightning_memplan.model.result.MemoryEstimate.averaged`).

Stochastic weight averaging (Izmailov et al. 2018, arXiv 1803.05407, Algorithm 1) and an exponential
moving average of the weights keep a second set of the model's parameters (and, with ``use_buffers``,
its buffers) for the whole fit, updated after optimizer steps. Where a run holds that copy:

- Lightning's ``StochasticWeightAveraging`` callback: a ``deepcopy`` of the LightningModule made in its
  ``setup`` and moved to the training device at the first SWA epoch (``swa_epoch_start``;
  lightning/pytorch/callbacks/stochastic_weight_avg.py, 2.6, ``setup`` and ``on_train_epoch_start``);
- Lightning's ``WeightAveraging`` and ``EMAWeightAveraging``: a ``torch.optim.swa_utils.AveragedModel`` of
  the module built in its ``setup`` (lightning/pytorch/callbacks/weight_averaging.py, 2.6), on the
  module's device at that moment;
- an ``AveragedModel`` the user keeps as a submodule of the trained module or beside it.

The copy counts where its tensors are: bytes on the training device, read when a step starts, so a copy
still in host memory (SWA before its first epoch on a GPU) adds nothing until it is moved. A tensor that
shares its storage with the trained module (a callback that merely points at the module) is never a copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

__all__ = ["averaged_copies", "copy_bytes", "is_averaging_callback"]

#: Names of Lightning's weight-averaging callbacks (lightning.pytorch.callbacks, 2.6): every module one of
#: them holds is its averaged copy (SWA's is a plain deepcopy of the LightningModule, not an AveragedModel).
_AVERAGING_CALLBACKS = ("StochasticWeightAveraging", "WeightAveraging")
#: Container levels searched in a holder's attributes (a list of copies is one).
_DEPTH = 2


def is_averaging_callback(obj: Any) -> bool:
    """Whether ``obj`` is (a subclass of) one of Lightning's weight-averaging callbacks, by class name along
    its MRO (so this module imports no Lightning callback)."""
    return any(cls.__name__ in _AVERAGING_CALLBACKS and cls.__module__.startswith("lightning")
               for cls in type(obj).__mro__)


def _modules_in(value: Any, depth: int = _DEPTH) -> Iterator[nn.Module]:
    if isinstance(value, nn.Module):
        yield value
    elif depth > 0 and isinstance(value, (list, tuple)):
        for item in value:
            yield from _modules_in(item, depth - 1)
    elif depth > 0 and isinstance(value, dict):
        for item in value.values():
            yield from _modules_in(item, depth - 1)


def _held_copies(holder: Any) -> Iterator[nn.Module]:
    """The copies ``holder`` keeps: itself when it is an ``AveragedModel``; its ``AveragedModel`` attributes;
    every module attribute of a Lightning weight-averaging callback."""
    if isinstance(holder, AveragedModel):
        yield holder
        return
    averaging = is_averaging_callback(holder)
    for value in getattr(holder, "__dict__", {}).values():
        for module in _modules_in(value):
            if averaging or isinstance(module, AveragedModel):
                yield module


def averaged_copies(module: nn.Module, holders: Iterable[Any] = ()) -> list[nn.Module]:
    """The weight-averaging copies of a run: the ``AveragedModel`` submodules of ``module`` and the copies
    the ``holders`` keep (the Trainer's callbacks, the models ``MemoryMonitor(averaged_models=...)`` names;
    see the module docstring). Each copy once, outermost first (an ``AveragedModel`` inside another copy is
    part of it)."""
    found: list[nn.Module] = []
    seen: set[int] = set()

    def add(copy: nn.Module) -> None:
        if id(copy) in seen or copy is module:
            return
        found.append(copy)
        seen.update(id(m) for m in copy.modules())

    for sub in module.modules():
        if isinstance(sub, AveragedModel):
            add(sub)
    for holder in holders:
        for copy in _held_copies(holder):
            add(copy)
    return found


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    try:
        return (t.device.type, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, functional wrappers)
        return None


def copy_bytes(copies: Iterable[nn.Module], module: nn.Module, device_type: str) -> int:
    """Bytes of the copies' parameters and buffers on ``device_type`` (each storage once), leaving out any
    storage the trained ``module`` shares (its own weights are ``params``, not a copy; an ``AveragedModel``
    submodule's tensors are the copy's)."""
    copies = list(copies)
    tensors = [t for copy in copies for t in (*copy.parameters(), *copy.buffers())]
    in_copies = {id(t) for t in tensors}
    own = {_storage_key(t) for t in (*module.parameters(), *module.buffers()) if id(t) not in in_copies}
    counted: set[tuple[str, int] | None] = set()
    total = 0
    for t in tensors:
        key = _storage_key(t)
        if t.device.type != device_type or key is None or key in own or key in counted or t.is_meta:
            continue
        counted.add(key)
        total += t.untyped_storage().nbytes()
    return total
