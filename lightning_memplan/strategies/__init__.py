"""Lightning Trainer strategy: ``MemplanAutoStrategy`` (``strategy="memplan_auto"``), a thin adapter over the
planning/applying core in :mod:`lightning_memplan.parallel` (mesh axes, FSDP2/DDP, tensor parallel,
pipeline parallel, activation checkpointing, the layout recogniser), whose public names it re-exports.

Lightning does not discover third-party strategies: ``import lightning_memplan`` registers
``"memplan_auto"`` in the Trainer's and Fabric's registries (:mod:`lightning_memplan._registration`, the
composition root's wiring; this package knows nothing of it). With LightningCLI use the class path
``lightning_memplan.strategies.MemplanAutoStrategy``.
"""

from __future__ import annotations

from lightning_memplan.live.layouts import TransformerLayout, find_layout
from lightning_memplan.parallel.decision import ForcedDecision, Resolution
from lightning_memplan.parallel.mesh import MeshAxis, MeshLayout
from lightning_memplan.parallel.pipeline import PipelineRunner
from lightning_memplan.parallel.record import PLAN_FILENAME
from lightning_memplan.strategies.memplan_auto import MemplanAutoStrategy

__all__ = [
    "PLAN_FILENAME",
    "ForcedDecision",
    "MemplanAutoStrategy",
    "MeshAxis",
    "MeshLayout",
    "PipelineRunner",
    "Resolution",
    "TransformerLayout",
    "find_layout",
]
