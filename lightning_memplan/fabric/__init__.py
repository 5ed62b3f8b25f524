"""Lightning Fabric front door: ``Fabric(strategy="memplan_auto")`` (:class:`MemplanAutoFabricStrategy`), and
:class:`MemoryMonitor` for the memory of a hand-written loop.

``import lightning_memplan`` registers ``"memplan_auto"`` in Fabric's ``STRATEGY_REGISTRY``; construct
:class:`MemplanAutoFabricStrategy` directly to pass options (``plan=``, ``memory_budget=``, ``train=``).
"""

from __future__ import annotations

from lightning_memplan.fabric.monitor import MemoryMonitor
from lightning_memplan.fabric.strategy import MemplanAutoFabricStrategy

__all__ = ["MemoryMonitor", "MemplanAutoFabricStrategy"]
