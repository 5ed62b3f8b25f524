"""The one rule for which tensor of a batch carries its shape, shared by the tracer
(:func:`~lightning_memplan.tracking.trace.trace_memory`) and the callback's reading of a live batch
(:func:`lightning_memplan.live.batch_shape`), so the two never pick different tensors of one batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["TOKEN_KEYS", "first_tensor"]

#: Mapping keys that hold the token ids of a language-model batch, in order of preference (Hugging Face
#: ``BatchEncoding`` uses ``input_ids``; nanoGPT/litgpt-style dicts use ``idx`` / ``tokens`` / ``x``).
TOKEN_KEYS = ("input_ids", "tokens", "idx", "input", "inputs", "x", "data")
#: How deep to look into nested containers before giving up.
_MAX_DEPTH = 6


def first_tensor(obj: Any, depth: int = 0) -> torch.Tensor | None:
    """The tensor that carries the batch shape: a token-id key of a mapping first, else the first tensor
    found depth-first in tuples, lists, mappings and dataclass-like objects."""
    if isinstance(obj, torch.Tensor):
        return obj
    if depth >= _MAX_DEPTH:
        return None
    if isinstance(obj, Mapping):  # dict, OrderedDict, Hugging Face BatchEncoding (a UserDict)
        for key in TOKEN_KEYS:
            if key in obj and isinstance(obj[key], torch.Tensor):
                return obj[key]
        values: Sequence[Any] = list(obj.values())
    elif isinstance(obj, (tuple, list)):
        values = obj
    elif hasattr(obj, "__dataclass_fields__"):
        values = [getattr(obj, name) for name in obj.__dataclass_fields__]
    else:
        return None
    for value in values:
        found = first_tensor(value, depth + 1)
        if found is not None:
            return found
    return None
