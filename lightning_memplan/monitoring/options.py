"""Argument rules of :class:`~lightning_memplan.callbacks.MemoryPlanCallback` and
:class:`~lightning_memplan.fabric.MemoryMonitor`: each check names the argument, the value it got, the
rule and a valid example (the house rule for bad input), and :class:`MonitorOptions` holds the options
both front doors share, validated once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_memplan import validation
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec

__all__ = [
    "MonitorOptions",
    "check_fraction",
    "check_measure_every",
    "check_optional_bool",
    "check_optional_int",
    "check_tolerance",
    "check_type",
]


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
        raise TypeError(f"{name}={value!r:.200} must be a {cls.__name__} or None")
    return value


def check_optional_bool(name: str, value: Any, meaning_of_none: str) -> bool | None:
    """``None`` or a real bool (:func:`~lightning_memplan.validation.check_bool`): ``0``, ``"no"`` and
    ``"false"`` are refused, never taken as a truth value."""
    if value is None:
        return None
    return validation.check_bool(name, value, hint=f"or None ({meaning_of_none})")


@dataclass(frozen=True, kw_only=True)
class MonitorOptions:
    """What to estimate, measure and report; the arguments of ``MemoryPlanCallback`` and
    ``MemoryMonitor`` (their docstrings describe each one). Validated on construction."""

    #: Run the tensor tracker on the first step and every this many steps (CPU/MPS; CUDA with track_tensors).
    measure_every_n_steps: int = 100
    #: Warn when a measured peak exceeds the estimate by more than this fraction.
    tolerance: float = 0.10
    #: Warn when free memory falls below this fraction of the capacity, in [0, 1).
    min_headroom: float = 0.10
    #: Display unit of the report and of the metric views (``"B"``, ``"KiB"``, ..., ``"GB"``).
    units: str = "GiB"
    #: Fit the batch-dependent terms with one traced fake-tensor step at the first batch.
    calibrate: bool = True
    #: The size axis the memory grows with (tokens; 1 for fixed-size images or clips); ``None`` reads it.
    seq_len: int | None = None
    #: Sequence length to forecast; ``None``: the largest seen.
    max_seq_len: int | None = None
    #: Explicit specs for what cannot be inferred (``None``: inferred).
    model_spec: ModelSpec | None = None
    train_spec: TrainSpec | None = None
    plan: ParallelPlan | None = None
    #: Capacity in bytes for headroom and forecasts (``None``: the device's memory, RAM on CPU).
    memory_budget: int | None = None
    #: ``None``: track tensors on CPU and MPS only; ``True`` also on CUDA; ``False`` never.
    track_tensors: bool | None = None
    #: Write the report files after each epoch and on an exception.
    write_files: bool = True
    #: Print the rich table on rank 0 after each epoch.
    print_report: bool = True
    #: ``max_new_tokens`` of a greedy ``generate`` the validation/test/predict step runs on its batch (0: none).
    generate_tokens: int = 0

    def __post_init__(self) -> None:
        from lightning_memplan.report.render import check_units

        checked = {
            "measure_every_n_steps": check_measure_every(self.measure_every_n_steps),
            "tolerance": check_tolerance(self.tolerance),
            "min_headroom": check_fraction("min_headroom", self.min_headroom, upper=1.0),
            "units": check_units(self.units),
            "calibrate": validation.check_bool("calibrate", self.calibrate),
            "seq_len": check_optional_int("seq_len", self.seq_len, "the tokens per sequence, e.g. seq_len=2048 (1 for fixed-size images)"),
            "max_seq_len": check_optional_int("max_seq_len", self.max_seq_len, "e.g. max_seq_len=8192"),
            "memory_budget": check_optional_int("memory_budget", self.memory_budget, "bytes, e.g. 80 * 2**30"),
            "generate_tokens": validation.check_int(
                "generate_tokens", self.generate_tokens, minimum=0, maximum=2**24,
                hint="the max_new_tokens of a generate call in your validation/test/predict step, or 0 for none; "
                     "e.g. generate_tokens=128",
            ),
        }
        for name, value in checked.items():  # the checks' normalised values (0 -> 0.0, numpy ints -> int)
            object.__setattr__(self, name, value)
        check_type("model_spec", self.model_spec, ModelSpec)
        check_type("train_spec", self.train_spec, TrainSpec)
        check_type("plan", self.plan, ParallelPlan)
        flags = {
            "track_tensors": check_optional_bool("track_tensors", self.track_tensors, "CPU/MPS only"),
            "write_files": validation.check_bool("write_files", self.write_files),
            "print_report": validation.check_bool("print_report", self.print_report),
        }
        for name, value in flags.items():  # np.bool_ -> bool
            object.__setattr__(self, name, value)
