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

__all__ = ["FAKED_PARAMETER_CLASSES", "STAND_IN_ATTR", "carry_quantized_attributes", "fake_parameter_memo",
           "holds_quantized_parameters", "is_stand_in", "meta_stand_in"]

#: ``{class name: attributes the layers read off the parameter}``.
FAKED_PARAMETER_CLASSES: dict[str, tuple[str, ...]] = {
    "Params4bit": ("quant_state", "blocksize", "compress_statistics", "quant_type", "quant_storage", "bnb_quantized"),
    "Int8Params": ("CB", "SCB", "has_fp16_weights"),
}


#: Attribute naming the bitsandbytes class a plain stand-in parameter replaces (:func:`meta_stand_in`).
STAND_IN_ATTR = "_memplan_stands_for"


def _kind(param: Any) -> str | None:
    """The :data:`FAKED_PARAMETER_CLASSES` name ``param`` is (or stands in for), ``None`` for any other."""
    name = getattr(param, STAND_IN_ATTR, None) or type(param).__name__
    return name if name in FAKED_PARAMETER_CLASSES else None


def holds_quantized_parameters(module: nn.Module) -> bool:
    """Whether ``module`` holds a bitsandbytes ``Params4bit`` / ``Int8Params`` (or a stand-in for one)."""
    return any(_kind(p) is not None for p in module.parameters())


def is_stand_in(param: Any) -> bool:
    """Whether ``param`` is a plain parameter standing in for a bitsandbytes one (:func:`meta_stand_in`, or
    its fake copy): its layer-read attributes must follow it when it is re-created on another device."""
    return getattr(param, STAND_IN_ATTR, None) in FAKED_PARAMETER_CLASSES


def _same_storage(tensor: torch.Tensor, param: torch.Tensor) -> bool:
    """``tensor`` is ``param`` or a view of its storage (meta tensors have no storage: only identity)."""
    if tensor is param:
        return True
    pointer = param.untyped_storage().data_ptr()
    return bool(pointer) and not tensor.is_meta and tensor.untyped_storage().data_ptr() == pointer


def _tensors_of(value: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors an attribute value holds: itself, or a ``QuantState``'s (and its nested ``state2``'s)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 2 or not hasattr(value, "__dict__"):
        return []
    return [t for v in vars(value).values() for t in _tensors_of(v, depth + 1)]


def meta_stand_in(param: nn.Parameter, memo: dict[int, Any]) -> nn.Parameter:
    """A meta ``nn.Parameter`` standing in for a bitsandbytes ``Params4bit`` / ``Int8Params`` in a meta copy
    (``tracking/meta_copy.py``): the storage's shape and dtype, and the attributes the layers read with
    every tensor in them on the meta device (a ``QuantState`` copied through ``memo``, so the layer's own
    ``quant_state`` is the same copy), marked with :data:`STAND_IN_ATTR` so :func:`fake_parameter_memo`
    fakes it as it fakes the real class. A bitsandbytes parameter cannot be made on the meta device itself
    (``Params4bit.__deepcopy__`` builds on a real tensor)."""
    kind = _kind(param)
    if kind is None:
        raise TypeError(f"param of type {type(param).__name__} is not one of {sorted(FAKED_PARAMETER_CLASSES)}")
    stand_in = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
    memo[id(param)] = stand_in
    setattr(stand_in, STAND_IN_ATTR, kind)
    for attr in FAKED_PARAMETER_CLASSES[kind]:
        value = getattr(param, attr, None)
        for t in _tensors_of(value):
            if _same_storage(t, param):
                memo.setdefault(id(t), stand_in)  # Int8Params.CB is its own storage
            else:
                memo.setdefault(id(t), t.detach().to("meta"))
        setattr(stand_in, attr, copy.deepcopy(value, memo))
    return stand_in


def carry_quantized_attributes(source: nn.Parameter, target: nn.Parameter, device: torch.device) -> None:
    """Give ``target`` (``source`` re-created on ``device``) the bitsandbytes attributes ``source`` carries,
    their tensors moved to ``device`` in place (a ``QuantState`` is shared with its layer, which must see
    the same tensors); nothing for any other parameter."""
    kind = _kind(source)
    if kind is None:
        return
    setattr(target, STAND_IN_ATTR, kind)
    for attr in FAKED_PARAMETER_CLASSES[kind]:
        value: Any = getattr(source, attr, None)
        if value is source:
            value = target
        elif isinstance(value, torch.Tensor):
            value = value.to(device)
        elif callable(getattr(value, "to", None)) and _tensors_of(value):
            value.to(device)  # QuantState.to moves its tensors in place (bitsandbytes/functional.py)
        setattr(target, attr, value)


def _fake(param: nn.Parameter, kind: str, fake_mode: Any, memo: dict[int, Any]) -> nn.Parameter:
    fake = nn.Parameter(fake_mode.from_tensor(param.data), requires_grad=param.requires_grad)
    memo[id(param)] = fake
    setattr(fake, STAND_IN_ATTR, kind)  # moved to the traced device, it keeps its attributes (trace_batch.move_module)
    for attr in FAKED_PARAMETER_CLASSES[kind]:
        value = getattr(param, attr, None)
        if isinstance(value, torch.Tensor) and _same_storage(value, param):
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
            kind = _kind(param)
            if param is None or kind is None or id(param) in memo:
                continue
            fake = _fake(param, kind, fake_mode, memo)
            state_cb = getattr(getattr(mod, "state", None), "CB", None)
            if isinstance(state_cb, torch.Tensor) and _same_storage(state_cb, param):
                memo[id(state_cb)] = fake
    return memo
