"""lightning_memplan: per-rank memory estimation and measurement, automatic parallel layout and a
logits-free LM loss for PyTorch Lightning.

Importing the package registers ``strategy="memplan_auto"`` in Lightning's ``StrategyRegistry`` and in
Fabric's ``STRATEGY_REGISTRY``. This module is the composition root: it wires the registries (nothing
below it registers itself) and resolves the public names lazily; docs/architecture.md draws the layers.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_memplan._version import __version__

# Public name -> module that defines it. Resolved on first attribute access (PEP 562) so that the pure
# core (``lightning_memplan.model``) can be imported without pulling in Lightning.
_EXPORTS: dict[str, str] = {
    "ModelSpec": "lightning_memplan.model",
    "TrainSpec": "lightning_memplan.model",
    "ParallelPlan": "lightning_memplan.model",
    "MemoryEstimate": "lightning_memplan.model",
    "estimate_memory": "lightning_memplan.model",
    "trace_memory": "lightning_memplan.tracking.trace",
    "calibrate": "lightning_memplan.tracking.trace",
    "PlanDoesNotFitError": "lightning_memplan.planning",
    "TraceResult": "lightning_memplan.tracking.trace",
    "TensorTracker": "lightning_memplan.tracking",
    "TrackerReport": "lightning_memplan.tracking",
    "LossMetrics": "lightning_memplan.loss",
    "LossOptions": "lightning_memplan.loss",
    "CrossEntropyMetricAggregator": "lightning_memplan.loss",
    "HardwareSpec": "lightning_memplan.hardware",
    "plan": "lightning_memplan.planning",
    "PlanDecision": "lightning_memplan.planning",
    "max_micro_batch": "lightning_memplan.planning",
    "max_seq_len": "lightning_memplan.planning",
    "linear_cross_entropy": "lightning_memplan.loss",
    "LinearCrossEntropy": "lightning_memplan.loss",
    "MemoryPlanCallback": "lightning_memplan.callbacks",
    "MemoryPlanBatchSizeFinder": "lightning_memplan.callbacks",
    "MemplanAutoStrategy": "lightning_memplan.strategies",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_memplan' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


from lightning_memplan._registration import ensure_registered as _ensure_registered  # noqa: E402

# Lightning discovers no third-party strategies by itself: importing this package registers "memplan_auto"
# in the Trainer's and Fabric's registries (immediately if Lightning is loaded, else the moment
# lightning.pytorch / lightning.fabric finish importing).
_ensure_registered()

from lightning_memplan.model.traced import register_coefficient_source as _register_coefficient_source  # noqa: E402


def _hf_trace_source() -> Any:
    """``calibration="auto"``'s source for a spec read from a Hugging Face config: the tracer
    (``tracking/hf_trace.py``, imported only when such a spec is built; ``None`` without transformers)."""
    from lightning_memplan.tracking.hf_trace import auto_source

    return auto_source()


# The model layer may not import the tracer (it sits above it): the composition root hands it the factory.
_register_coefficient_source("hf_config", _hf_trace_source)
