"""Build a :class:`~lightning_memplan.model.specs.ModelSpec` from a live module or a Hugging Face config.

The public entry points of the readers in ``model/readers.py`` (which return field dicts, so that
``specs`` can use them without importing this module): :func:`spec_from_hf_config` is
:meth:`ModelSpec.from_hf_config`, :func:`spec_from_module` is :meth:`ModelSpec.from_module`,
:func:`spec_from_litgpt` reads a litgpt ``GPT``; :func:`norm_impl_of` and :func:`recompute_of` describe
how a module runs (``TrainSpec.norm_impl``, ``TrainSpec.recompute``).
"""

from __future__ import annotations

from typing import Any

from lightning_memplan.model.litgpt_spec import litgpt_fields
from lightning_memplan.model.readers import norm_impl_of, recompute_of
from lightning_memplan.model.specs import ModelSpec

__all__ = ["norm_impl_of", "recompute_of", "spec_from_hf_config", "spec_from_litgpt", "spec_from_module"]


def spec_from_hf_config(config: Any, *, calibration: Any = "auto") -> ModelSpec:
    """A :class:`ModelSpec` from a Hugging Face config: :meth:`ModelSpec.from_hf_config` (see there)."""
    return ModelSpec.from_hf_config(config, calibration=calibration)


def spec_from_module(module: Any, *, calibration: Any = "auto") -> ModelSpec:
    """A :class:`ModelSpec` for a live ``nn.Module``: :meth:`ModelSpec.from_module` (see there)."""
    return ModelSpec.from_module(module, calibration=calibration)


def spec_from_litgpt(module: Any) -> ModelSpec | None:
    """The spec of the litgpt ``GPT`` inside ``module`` (without its exact parameter count, which
    :meth:`ModelSpec.from_module` adds); ``None`` when there is none or its MLP/norm kind has no
    ModelSpec form (then the generic recognisers decide)."""
    fields = litgpt_fields(module)
    return None if fields is None else ModelSpec(**fields)
