"""Hardware facts for planning: a sourced per-chip table, :class:`HardwareSpec`, and local detection.

Pure except :func:`detect_hardware` (``HardwareSpec.detect()``), the only device query of the core.
"""

from lightning_memplan.hardware.detect import nvml_interconnect
from lightning_memplan.hardware.presets import (
    CHIP_ALIASES,
    CHIP_TABLE,
    FALLBACK_CHIP,
    ChipEntry,
    lookup_chip,
    match_device_name,
)
from lightning_memplan.hardware.spec import HardwareSpec, detect_hardware, known_presets

__all__ = [
    "CHIP_ALIASES",
    "CHIP_TABLE",
    "FALLBACK_CHIP",
    "ChipEntry",
    "HardwareSpec",
    "detect_hardware",
    "known_presets",
    "lookup_chip",
    "match_device_name",
    "nvml_interconnect",
]
