"""Argument rules of :class:`~lightning_memplan.callbacks.MemoryPlanCallback`: each check names the
argument, the value it got, the rule and a valid example (the house rule for bad input)."""

from __future__ import annotations

from typing import Any

from lightning_memplan import validation

__all__ = ["check_fraction", "check_measure_every", "check_optional_int", "check_tolerance", "check_type"]


def check_measure_every(value: Any) -> int:
    return validation.check_int(
        "measure_every_n_steps", value,
        hint="the tensor tracker runs on the first step and every this many steps; e.g. measure_every_n_steps=100",
    )


def check_tolerance(value: Any) -> float:
    return validation.check_number("tolerance", value, minimum=0.0, hint="a finite fraction; e.g. tolerance=0.1 for 10%")


def check_fraction(name: str, value: Any, *, upper: float) -> float:
    return validation.check_number(name, value, minimum=0.0, maximum=upper, max_inclusive=False,
                                   hint=f"e.g. {name}=0.1 for 10%")


def check_optional_int(name: str, value: Any, hint: str) -> int | None:
    return validation.check_optional_int(name, value, hint=f"a positive int or None; {hint}")


def check_type(name: str, value: Any, cls: type) -> Any:
    if value is not None and not isinstance(value, cls):
        raise TypeError(f"{name}={value!r} must be a {cls.__name__} or None")
    return value
