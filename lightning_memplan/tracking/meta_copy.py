"""A storage-free copy of a module to trace later: its parameters and buffers on the meta device.

A strategy that parallelises a module in place (``memplan_auto``: FSDP2 ``fully_shard``, DTensor tensor
parallelism) leaves nothing a fake-tensor trace can copy as one plain model: FSDP2 swaps parameters for
sharded DTensors and installs hooks, tensor parallelism patches head counts. Taken just before, a meta
copy keeps what :func:`~lightning_memplan.tracking.trace.trace_memory` needs (module structure, shapes,
dtypes, ``requires_grad``, tied parameters) and allocates nothing: ``FakeCopyMode`` makes a fake tensor
of each meta one, and the traced step moves them to the device it pretends to run on. The calibration
of such a copy equals that of the live module (a peft LoRA Llama at bf16-true: every fitted coefficient
the same).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from lightning_memplan.tracking.fake_params import FAKED_PARAMETER_CLASSES, meta_stand_in

__all__ = ["meta_copy"]

#: Attributes of a LightningModule that point at the run (Trainer, Fabric, the device mesh), never copied.
_RUN_ATTRIBUTES = ("_trainer", "_fabric", "_fabric_optimizers", "_device_mesh")


def meta_copy(module: nn.Module) -> nn.Module:
    """``copy.deepcopy(module)`` with every parameter and buffer replaced by a meta tensor of the same
    shape, dtype and ``requires_grad`` (a parameter shared by two submodules stays shared); the run
    attributes of a LightningModule (:data:`_RUN_ATTRIBUTES`) are ``None`` in the copy. A bitsandbytes
    ``Params4bit`` / ``Int8Params`` becomes a plain meta parameter carrying the attributes its layer reads,
    their tensors on the meta device too (:func:`~lightning_memplan.tracking.fake_params.meta_stand_in`).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module={module!r:.80} must be an nn.Module to copy onto the meta device")
    memo: dict[int, Any] = {}
    for attr in _RUN_ATTRIBUTES:
        value = module.__dict__.get(attr)
        if value is not None:
            memo[id(value)] = None
    for param in module.parameters():
        if type(param).__name__ in FAKED_PARAMETER_CLASSES:  # bitsandbytes' packed weights and their constants
            meta_stand_in(param, memo)
            continue
        memo[id(param)] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
    for buf in module.buffers():
        memo[id(buf)] = buf.detach().to("meta")
    with torch.no_grad():
        return copy.deepcopy(module, memo)
