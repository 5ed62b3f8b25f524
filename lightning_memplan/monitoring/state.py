"""Saving and restoring the monitoring state a checkpoint carries (``MemoryPlanCallback``'s and the Fabric
``MemoryMonitor``'s, :mod:`~lightning_memplan.monitoring.session`): every field is checked on load.

A checkpoint is someone's file: it may be tampered with, from another run, or from another version of
this package. A field that is invalid (``batches_seen=-5``, a string, an accumulator missing a key), foreign
(a ``warned`` record of another run, an accumulator of another rank) or from another format (a report of a
newer ``format_version``, a ``warned`` list of the format before run ids) is dropped, the run goes on with
fresh state for it, and one warning (rank 0) names every dropped field and why. A resumed run never ends
here, as Lightning's own callbacks tolerate a missing key (``ModelCheckpoint.load_state_dict``).

The ``warned`` record is saved with the run id of the report it belongs to (``{"run_id": ..., "keys":
[...]}``) and restored only into that run: a warning given in another run (whose record was pasted into
this checkpoint) is given again here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_memplan.report.records import MemoryReport, RankAccumulator

__all__ = ["MAX_RESTORED_COUNT", "RestoredState", "restore_state", "warned_state"]

#: Largest counter (steps seen, epochs, optimizer steps, a shape) a checkpoint may restore: far below the
#: 2**63 the report reader accepts, so every count that grows from it stays readable.
MAX_RESTORED_COUNT = 2**62
#: Most ``warned`` keys restored, and their longest (a key is a short name or ``"note:"`` and a note's text).
_MAX_WARNED = 4096
_MAX_KEY_CHARS = 16_384
#: What a field's check may raise: each means "drop it", never "end the run".
_INVALID = (ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError, RecursionError, MemoryError)
_T = TypeVar("_T")


@dataclass
class RestoredState:
    """What :func:`restore_state` kept: ``None`` (or the counter's 0) for a field that was absent or dropped."""

    report: MemoryReport | None = None
    batches_seen: int | None = None
    warned: set[str] | None = None
    accumulator: RankAccumulator | None = None
    max_shape_seen: tuple[int, int] | None = None
    counters: dict[str, int] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)


def warned_state(report: MemoryReport, warned: Iterable[str]) -> dict[str, Any]:
    """The saved form of the keys of the warnings given: tied to the run of ``report`` they were given in."""
    return {"run_id": report.current_run_id, "keys": sorted(warned)}


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r:.60} is a {type(value).__name__}, not a whole number")
    if not 0 <= value < MAX_RESTORED_COUNT:
        raise ValueError(f"{value} is outside [0, 2**62)")
    return value


def _report(value: Any) -> MemoryReport:
    if not isinstance(value, Mapping):
        raise TypeError(f"a {type(value).__name__}, not a memory report")
    return MemoryReport.from_dict(value)


def _warned(value: Any, run_id: str) -> set[str]:
    if not isinstance(value, Mapping):
        raise TypeError(f"a {type(value).__name__}, not the {{'run_id', 'keys'}} record of this version")
    if not run_id or value.get("run_id") != run_id:
        raise ValueError(f"recorded in another run (run_id {str(value.get('run_id'))[:40]!r}, not the restored report's)")
    keys = value.get("keys")
    if not isinstance(keys, list) or len(keys) > _MAX_WARNED:
        raise TypeError(f"keys must be a list of at most {_MAX_WARNED} strings")
    if not all(isinstance(k, str) and len(k) <= _MAX_KEY_CHARS for k in keys):
        raise TypeError("keys must all be strings")
    return set(keys)


def _accumulator(value: Any, rank: int) -> RankAccumulator | None:
    acc = RankAccumulator.from_dict(value)
    # A checkpoint holds rank 0's state; another rank's partial epoch cannot be restored from it.
    return acc if acc.rank == rank else None


def _shape(value: Any) -> tuple[int, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise TypeError(f"{value!r:.60} is not a [micro_batch, seq_len] pair")
    return _count("max_shape_seen", value[0]), _count("max_shape_seen", value[1])


def _counter(name: str) -> Callable[[Any], int]:
    return lambda value: _count(name, value)


def _field(state: Mapping[str, Any], name: str, parse: Callable[[Any], _T], dropped: list[str]) -> _T | None:
    """``parse(state[name])``, or ``None`` when absent (or ``None``) or invalid (then noted in ``dropped``)."""
    value = state.get(name)
    if value is None:
        return None
    try:
        return parse(value)
    except _INVALID as exc:
        detail = f"missing key {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        dropped.append(f"{name!r} ({detail:.300})")
        return None


def restore_state(state: Any, *, rank: int, owner: str, counters: tuple[str, ...] = ()) -> RestoredState:
    """Check a saved state field by field (module docstring); warns once (rank 0) when a field is dropped.

    Args:
        state: what the checkpoint holds for ``owner`` (should be what its ``state_dict()`` returned).
        rank: this process's global rank (a saved accumulator of another rank is not restored).
        owner: the class name shown in the warning.
        counters: further whole-number fields to restore (the Fabric monitor's ``epoch``,
            ``optimizer_steps``); each is 0 when absent or dropped.
    """
    out = RestoredState()
    if not isinstance(state, Mapping):
        out.dropped.append(f"the whole state ({type(state).__name__}, not a dict)")
        state = {}
    out.report = _field(state, "report", _report, out.dropped)
    run_id = out.report.current_run_id if out.report is not None else ""
    out.batches_seen = _field(state, "batches_seen", lambda v: _count("batches_seen", v), out.dropped)
    out.warned = _field(state, "warned", lambda v: _warned(v, run_id), out.dropped)
    out.accumulator = _field(state, "accumulator", lambda v: _accumulator(v, rank), out.dropped)
    out.max_shape_seen = _field(state, "max_shape_seen", _shape, out.dropped)
    for name in counters:
        out.counters[name] = _field(state, name, _counter(name), out.dropped) or 0
    if out.dropped:
        rank_zero_warn(
            f"{owner}.load_state_dict: the checkpoint's {'; '.join(out.dropped)} "
            f"{'is' if len(out.dropped) == 1 else 'are'} not used (invalid, from another run or another version); "
            "the run goes on with fresh state for it. Resume from a checkpoint this run wrote to keep its report"
        )
    return out
