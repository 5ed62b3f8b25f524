"""Library parameter classes a fake copy cannot make by itself, and how the trace fakes them.

``trace_memory`` copies the module under ``FakeCopyMode`` (every tensor becomes a ``FakeTensor``, nothing
is allocated). Two parameter subclasses of bitsandbytes 0.50.2 (``bitsandbytes/nn/modules.py``) defeat
that copy: ``Params4bit.__deepcopy__`` builds the new parameter with ``__new__`` on an empty real tensor
and assigns the copied data afterwards (the result holds a real tensor, and its ``quant_state`` is copied
without the memo, so the layer's own ``quant_state`` no longer is the weight's), and ``Int8Params`` cannot
wrap a ``FakeTensor`` at all (``Tensor._make_subclass``: "the raw Tensor object is already associated to
a python object of type FakeTensor"). :func:`fake_parameter_memo` fakes them before the copy: each becomes
a fake ``nn.Parameter`` of the same storage dtype and shape carrying, as plain attributes, what the
layers read off it (``Params4bit``: ``quant_state`` with its absmaxes, codes and nested constants faked,
``blocksize``, ``quant_type`` ...; ``Int8Params``: ``CB``, ``SCB``, ``has_fp16_weights``). The layers
accept that: ``Linear4bit.forward`` reads ``weight.quant_state`` (``fix_4bit_weight_quant_state_from_module``
leaves a weight that has one alone), ``Linear8bitLt.forward`` reads ``weight.CB`` and its
``MatmulLtState``, whose ``CB`` is the weight's storage and is mapped to the fake weight; bitsandbytes'
operators have fake kernels (``bitsandbytes/_ops.py`` ``register_fake``). The tensor tracker counts the
constants through :func:`lightning_memplan.tracking.tracker.quantization_constants`, by attribute, as in a
real step.

Matched by class name and attributes, so bitsandbytes is never imported here.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["FAKED_PARAMETER_CLASSES", "fake_parameter_memo"]

#: ``{class name: attributes the layers read off the parameter}``.
FAKED_PARAMETER_CLASSES: dict[str, tuple[str, ...]] = {
    "Params4bit": ("quant_state", "blocksize", "compress_statistics", "quant_type", "quant_storage", "bnb_quantized"),
    "Int8Params": ("CB", "SCB", "has_fp16_weights"),
}


def _fake(param: nn.Parameter, attrs: tuple[str, ...], fake_mode: Any, memo: dict[int, Any]) -> nn.Parameter:
    fake = nn.Parameter(fake_mode.from_tensor(param.data), requires_grad=param.requires_grad)
    memo[id(param)] = fake
    for attr in attrs:
        value = getattr(param, attr, None)
        if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == param.untyped_storage().data_ptr():
            setattr(fake, attr, fake)  # Int8Params.CB is its own storage
        else:
            setattr(fake, attr, copy.deepcopy(value, memo))
    return fake


def fake_parameter_memo(module: nn.Module, fake_mode: Any) -> dict[int, Any]:
    """A ``copy.deepcopy`` memo that maps each bitsandbytes ``Params4bit`` / ``Int8Params`` of ``module``
    (and a ``Linear8bitLt``'s ``state.CB``, the weight's storage) to its fake stand-in (module docstring).
    Call it inside ``FakeCopyMode(fake_mode)`` and pass the memo to the module's deep copy; ``{}`` for a
    module without them."""
    memo: dict[int, Any] = {}
    for mod in module.modules():
        for param in mod._parameters.values():
            attrs = FAKED_PARAMETER_CLASSES.get(type(param).__name__)
            if param is None or attrs is None or id(param) in memo:
                continue
            fake = _fake(param, attrs, fake_mode, memo)
            state_cb = getattr(getattr(mod, "state", None), "CB", None)
            if isinstance(state_cb, torch.Tensor) and state_cb.untyped_storage().data_ptr() == param.untyped_storage().data_ptr():
                memo[id(state_cb)] = fake
    return memo
