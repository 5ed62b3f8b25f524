"""The estimate/measure/report core shared by :class:`~lightning_memplan.callbacks.MemoryPlanCallback` and
:class:`~lightning_memplan.fabric.MemoryMonitor`: options, the per-rank session (calibrate, estimate,
measure, record), advice, what is emitted to loggers, and the report artifacts written after each epoch.

The front doors (:mod:`lightning_memplan.callbacks`, :mod:`lightning_memplan.fabric`) are thin adapters
over these modules; nothing here imports either of them.
"""
