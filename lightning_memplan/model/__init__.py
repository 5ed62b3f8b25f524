"""The pure memory model: specs in, bytes per component per rank out. No Lightning, no device query."""

from lightning_memplan.model.estimate import check_compatible, estimate_memory
from lightning_memplan.model.frameworks import ZeroConfig
from lightning_memplan.model.reserved import ReservedEstimate, reserved_memory
from lightning_memplan.model.result import COMPONENTS, PHASES, Calibration, MemoryEstimate
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec

__all__ = [
    "COMPONENTS",
    "PHASES",
    "Calibration",
    "MemoryEstimate",
    "ModelSpec",
    "ParallelPlan",
    "ReservedEstimate",
    "TrainSpec",
    "ZeroConfig",
    "check_compatible",
    "estimate_memory",
    "reserved_memory",
]
