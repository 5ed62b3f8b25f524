"""Lightning callbacks: :class:`MemoryPlanCallback` estimates and measures per-rank memory every step and
reports it after each epoch."""

from lightning_memplan.callbacks.memory_plan import MemoryPlanCallback
from lightning_memplan.monitoring.step_record import is_out_of_memory

__all__ = ["MemoryPlanCallback", "is_out_of_memory"]
