"""Lightning callbacks: :class:`MemoryPlanCallback` estimates and measures per-rank memory every step and
reports it after each epoch; :class:`MemoryPlanBatchSizeFinder` sets the largest batch size that fits before the
first step."""

from lightning_memplan.callbacks.batch_size_finder import MemoryPlanBatchSizeFinder
from lightning_memplan.callbacks.memory_plan import MemoryPlanCallback
from lightning_memplan.monitoring.step_record import is_out_of_memory

__all__ = ["MemoryPlanBatchSizeFinder", "MemoryPlanCallback", "is_out_of_memory"]
