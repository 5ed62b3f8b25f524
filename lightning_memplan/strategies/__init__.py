"""Lightning strategies: ``MemplanAutoStrategy`` (``strategy="memplan_auto"``) and its parts, one file per
technique (torchtitan's ``distributed/`` layout): mesh axes, FSDP2/DDP, tensor parallel, pipeline
parallel, activation checkpointing, and the layout recogniser they share.

Lightning does not discover third-party strategies: ``import lightning_memplan`` calls
:func:`register_strategies` so that ``Trainer(strategy="memplan_auto")`` resolves, and registers the
Fabric front door (:mod:`lightning_memplan.fabric`) so that ``Fabric(strategy="memplan_auto")`` does. With LightningCLI use
the class path ``lightning_memplan.strategies.MemplanAutoStrategy``.
"""

from __future__ import annotations

from typing import Any

from lightning_memplan.parallel.decision import ForcedDecision, Resolution
from lightning_memplan.parallel.layouts import TransformerLayout, find_layout
from lightning_memplan.strategies.memplan_auto import MemplanAutoStrategy
from lightning_memplan.parallel.mesh import MeshAxis, MeshLayout
from lightning_memplan.parallel.pipeline import PipelineRunner
from lightning_memplan.parallel.record import PLAN_FILENAME

__all__ = [
    "PLAN_FILENAME",
    "STRATEGY_NAME",
    "ForcedDecision",
    "MemplanAutoStrategy",
    "MeshAxis",
    "MeshLayout",
    "PipelineRunner",
    "Resolution",
    "TransformerLayout",
    "find_layout",
    "register_strategies",
]

STRATEGY_NAME = "memplan_auto"


def register_strategies(registry: Any = None) -> None:
    """Register ``"memplan_auto"`` in Lightning's ``StrategyRegistry`` (idempotent).

    Args:
        registry: the registry to add to; ``None`` means ``lightning.pytorch.strategies.StrategyRegistry``,
            and Fabric's ``STRATEGY_REGISTRY`` too (``Fabric(strategy="memplan_auto")``, see
            :func:`lightning_memplan._registration.register_fabric_strategy`).
    """
    if registry is None:
        from lightning.pytorch.strategies import StrategyRegistry

        from lightning_memplan._registration import register_fabric_strategy

        register_fabric_strategy()
        registry = StrategyRegistry
    if STRATEGY_NAME in registry:
        return
    registry.register(
        STRATEGY_NAME,
        MemplanAutoStrategy,
        description="lightning_memplan: plans DP/FSDP/TP/PP/recompute from the memory model and applies it",
    )


register_strategies()
