"""Bounded time series for the report's pictures: live bytes over one step (:class:`StepTimeline`, what
the tensor tracker samples) and the per-step peaks over an epoch (:class:`StepSeries`).

Both hold at most a fixed number of points whatever the length of the step or the epoch. They are
built by *max-preserving decimation*: consecutive samples are grouped in buckets of ``stride`` and a
bucket keeps its largest value; when the buffer is full, neighbouring buckets are merged pairwise and
``stride`` doubles. So the peak of the step or the epoch is always a point of the series, the points
stay evenly spread over the step (or epoch), and the cost per sample is O(1) amortised.

Pure Python, integer bytes, JSON round-trip (``to_dict`` / ``from_dict``), so every picture is drawn
from the saved ``memory_report.json``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_memplan.model.result import COMPONENTS, PHASES

__all__ = [
    "DEFAULT_SERIES_POINTS",
    "DEFAULT_TIMELINE_POINTS",
    "SeriesBuilder",
    "StepSeries",
    "StepTimeline",
    "TimelineBuilder",
]

#: Points kept per tracked step (live bytes by component over the step's operator calls).
DEFAULT_TIMELINE_POINTS = 200
#: Points kept per rank and epoch for the across-the-run chart.
DEFAULT_SERIES_POINTS = 256


def _check_points(points: Any, argument: str) -> int:
    if isinstance(points, bool) or not isinstance(points, int) or points < 4:
        raise ValueError(f"{argument}={points!r} must be an int >= 4 (points kept per series)")
    return points


@dataclass(frozen=True, kw_only=True)
class StepTimeline:
    """Live tensor bytes per component over one training step, sampled at operator calls.

    Attributes:
        ops: the operator-call index (counted from the tracker's start) of each sample, increasing.
        phases: the phase (``"forward"``, ``"backward"``, ``"optimizer"``) of each sample.
        components: ``{component: (bytes at each sample, ...)}``; components that stayed at 0 are left out.
        n_ops: operator calls observed in the step (the x-axis extent).
        stride: operator calls per bucket after decimation (1: every call is a sample).
    """

    ops: tuple[int, ...]
    phases: tuple[str, ...]
    components: Mapping[str, tuple[int, ...]]
    n_ops: int
    stride: int = 1

    def __post_init__(self) -> None:
        n = len(self.ops)
        if len(self.phases) != n or any(len(v) != n for v in self.components.values()):
            raise ValueError(
                f"StepTimeline has {n} ops but phases/components of other lengths; every series needs one "
                "value per sample"
            )
        bad = [p for p in self.phases if p not in PHASES] + [c for c in self.components if c not in COMPONENTS]
        if bad:
            raise ValueError(f"StepTimeline names {bad[0]!r}, not a phase of {PHASES} nor a component of {COMPONENTS}")

    def totals(self) -> list[int]:
        """Live bytes (all components) at each sample."""
        return [sum(vals) for vals in zip(*self.components.values(), strict=True)] if self.components else [0] * len(self.ops)

    def phase_spans(self) -> list[tuple[str, int, int]]:
        """``(phase, first op, last op)`` for each run of consecutive samples in one phase."""
        spans: list[tuple[str, int, int]] = []
        for op, phase in zip(self.ops, self.phases, strict=True):
            if spans and spans[-1][0] == phase:
                spans[-1] = (phase, spans[-1][1], op)
            else:
                spans.append((phase, op, op))
        return spans

    def to_dict(self) -> dict[str, Any]:
        return {
            "ops": list(self.ops),
            "phases": [PHASES.index(p) for p in self.phases],
            "components": {c: list(v) for c, v in self.components.items()},
            "n_ops": self.n_ops,
            "stride": self.stride,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepTimeline:
        return cls(
            ops=tuple(int(o) for o in data["ops"]),
            phases=tuple(PHASES[int(p)] if not isinstance(p, str) else p for p in data["phases"]),
            components={str(c): tuple(int(x) for x in v) for c, v in data["components"].items()},
            n_ops=int(data.get("n_ops", 0)),
            stride=int(data.get("stride", 1)),
        )


class TimelineBuilder:
    """Collects a :class:`StepTimeline` with at most ``points`` samples (see the module docstring).

    :meth:`sample` is called after every operator with the call index, the phase and the live bytes per
    component; within a bucket the sample with the largest total is kept.
    """

    __slots__ = ("_best", "_best_total", "_bucket", "_rows", "points", "stride")

    def __init__(self, points: int = DEFAULT_TIMELINE_POINTS) -> None:
        self.points = _check_points(points, "timeline_points")
        self.stride = 1
        self._rows: list[tuple[int, str, tuple[int, ...], int]] = []
        self._bucket = -1
        self._best: tuple[int, str, tuple[int, ...], int] | None = None
        self._best_total = -1

    def sample(self, op: int, phase: str, total: int, values: Iterable[int]) -> None:
        """Offer the state after operator call ``op`` (``values`` in :data:`COMPONENTS` order)."""
        bucket = op // self.stride
        if bucket != self._bucket:
            self._flush()
            self._bucket = bucket
        elif total <= self._best_total:
            return
        self._best = (op, phase, tuple(values), total)
        self._best_total = total

    def _flush(self) -> None:
        if self._best is None:
            return
        self._rows.append(self._best)
        self._best, self._best_total = None, -1
        if len(self._rows) >= self.points:
            rows = self._rows
            self._rows = [max(rows[i : i + 2], key=lambda r: r[3]) for i in range(0, len(rows), 2)]
            self.stride *= 2
            self._bucket = -1

    def timeline(self, n_ops: int) -> StepTimeline:
        """The samples so far (the open bucket included) as a :class:`StepTimeline`."""
        rows = [*self._rows, *([self._best] if self._best is not None else [])]
        columns = list(zip(*(r[2] for r in rows), strict=True)) if rows else []
        components = {c: tuple(col) for c, col in zip(COMPONENTS, columns, strict=False) if any(col)}
        return StepTimeline(
            ops=tuple(r[0] for r in rows),
            phases=tuple(r[1] for r in rows),
            components=components,
            n_ops=n_ops,
            stride=self.stride,
        )


_SERIES_FIELDS = ("estimated_peak", "measured_peak", "reserved", "seq_len")


@dataclass(frozen=True, kw_only=True)
class StepSeries:
    """One rank's per-step figures over an epoch, at most a fixed number of points.

    Attributes:
        steps: the first step index of each bucket.
        estimated_peak, measured_peak, reserved, seq_len: the largest value in each bucket (``None``
            where no step of the bucket had one).
        stride: steps per bucket (1: every step is a point).
    """

    steps: tuple[int, ...] = ()
    estimated_peak: tuple[int | None, ...] = ()
    measured_peak: tuple[int | None, ...] = ()
    reserved: tuple[int | None, ...] = ()
    seq_len: tuple[int | None, ...] = ()
    stride: int = 1

    def __post_init__(self) -> None:
        n = len(self.steps)
        if any(len(getattr(self, f)) != n for f in _SERIES_FIELDS):
            raise ValueError(f"StepSeries has {n} steps but fields of other lengths; each needs one value per step")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"steps": list(self.steps), "stride": self.stride}
        for name in _SERIES_FIELDS:
            out[name] = list(getattr(self, name))
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepSeries:
        opt = lambda v: None if v is None else int(v)  # noqa: E731
        return cls(
            steps=tuple(int(s) for s in data.get("steps", ())),
            stride=int(data.get("stride", 1)),
            **{name: tuple(opt(v) for v in data.get(name, ())) for name in _SERIES_FIELDS},
        )


def _max_opt(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else max(a, b)


class SeriesBuilder:
    """Folds step records into a :class:`StepSeries` with at most ``points`` points (O(points) memory)."""

    def __init__(self, points: int = DEFAULT_SERIES_POINTS) -> None:
        self.points = _check_points(points, "series_points")
        self.stride = 1
        self.count = 0
        self.rows: list[list[int | None]] = []  # [step, estimated, measured, reserved, seq_len]

    def add(self, step: int, values: Sequence[int | None]) -> None:
        """Add one step's ``(estimated_peak, measured_peak, reserved, seq_len)``."""
        if self.count % self.stride == 0:
            if len(self.rows) >= self.points:
                merged = []
                for i in range(0, len(self.rows), 2):
                    pair = self.rows[i : i + 2]
                    row = list(pair[0])
                    for other in pair[1:]:
                        row[1:] = [_max_opt(x, y) for x, y in zip(row[1:], other[1:], strict=True)]
                    merged.append(row)
                self.rows = merged
                self.stride *= 2
            if self.count % self.stride == 0:
                self.rows.append([step, *values])
                self.count += 1
                return
        last = self.rows[-1]
        last[1:] = [_max_opt(x, y) for x, y in zip(last[1:], values, strict=True)]
        self.count += 1

    def series(self) -> StepSeries:
        cols = list(zip(*self.rows, strict=True)) if self.rows else [()] * 5
        return StepSeries(
            steps=tuple(int(s) for s in cols[0] if s is not None),
            estimated_peak=tuple(cols[1]),
            measured_peak=tuple(cols[2]),
            reserved=tuple(cols[3]),
            seq_len=tuple(cols[4]),
            stride=self.stride,
        )

    def to_dict(self) -> dict[str, Any]:
        return {"points": self.points, "stride": self.stride, "count": self.count, "rows": [list(r) for r in self.rows]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SeriesBuilder:
        builder = cls(int(data.get("points", DEFAULT_SERIES_POINTS)))
        builder.stride, builder.count = int(data.get("stride", 1)), int(data.get("count", 0))
        builder.rows = [[None if v is None else int(v) for v in r] for r in data.get("rows", ())]
        return builder
