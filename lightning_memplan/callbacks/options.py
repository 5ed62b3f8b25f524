"""Argument rules of :class:`~lightning_memplan.callbacks.MemoryPlanCallback`: each check names the
argument, the value it got, the rule and a valid example (the house rule for bad input)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_fraction", "check_measure_every", "check_optional_int", "check_tolerance", "check_type"]


def check_measure_every(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"measure_every_n_steps={value!r} must be an int >= 1 (the tensor tracker runs on the first step "
            "and every this many steps); e.g. measure_every_n_steps=100"
        )
    return value


def check_tolerance(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"tolerance={value!r} must be a finite fraction >= 0; e.g. tolerance=0.1 for 10%")
    return float(value)


def check_fraction(name: str, value: Any, *, upper: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) < upper:
        raise ValueError(f"{name}={value!r} must be a number in [0, {upper:g}); e.g. {name}=0.1 for 10%")
    return float(value)


def check_optional_int(name: str, value: Any, hint: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int or None; {hint}")
    return value


def check_type(name: str, value: Any, cls: type) -> Any:
    if value is not None and not isinstance(value, cls):
        raise TypeError(f"{name}={value!r} must be a {cls.__name__} or None")
    return value
