"""Measure live tensor bytes per memory-model component during a training step (real or fake tensors)."""

from lightning_memplan.tracking.report import TrackerReport
from lightning_memplan.tracking.step import PrecisionEmulation, run_training_step
from lightning_memplan.tracking.tracker import TensorTracker

__all__ = ["PrecisionEmulation", "TensorTracker", "TrackerReport", "run_training_step"]
