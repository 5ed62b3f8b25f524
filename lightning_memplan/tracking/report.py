"""What a :class:`~lightning_memplan.tracking.tracker.TensorTracker` measured: live tensor bytes per
component at the overall peak and at the peak of each phase of a training step.

The component and phase names are the memory model's (:data:`~lightning_memplan.model.result.COMPONENTS`,
:data:`~lightning_memplan.model.result.PHASES`), so a measurement converts to a
:class:`~lightning_memplan.model.result.MemoryEstimate` and compares with an estimate field by field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_memplan.model.result import COMPONENTS, PHASES, MemoryEstimate, shown_components, trim_optional
from lightning_memplan.tracking.timeline import StepTimeline

__all__ = ["TrackerReport"]


def _zero() -> dict[str, int]:
    return trim_optional(dict.fromkeys(COMPONENTS, 0))


@dataclass(frozen=True, kw_only=True)
class TrackerReport:
    """Measured live-storage bytes of one (or more) training steps.

    Attributes:
        peak: ``{component: bytes}`` live at the overall peak moment (each storage counted once).
        peak_phase: the phase in which the overall peak happened (``"forward"`` when nothing ran).
        by_phase: ``{phase: {component: bytes}}`` at each phase's own peak; a phase that did not run
            is absent.
        current: ``{component: bytes}`` live when the report was taken.
        peak_ops: ``{phase: moment}``: each phase's peak came right after ``"<operator>#<k>"``, the k-th
            call of that operator in the phase (``"start"``: at the phase's start, before any operator).
        pinned: ``{phase: {component: bytes}}`` at the moments requested with ``TensorTracker(pin=)``.
        n_ops: tensor operations observed.
        device: the device type whose storages were counted (``"cpu"``, ``"cuda"``, ...).
        timeline: live bytes per component over the step (bounded samples), ``None`` when off.
        released_late: how much of :attr:`peak` is storages the step no longer used that another thread
            released late (gloo's worker thread drops a finished collective's buffers when the scheduler
            lets it): the part of a peak that varies between identical runs, 0 when nothing was released
            late. It counts each such storage from its last use by the step, so it may name more than the
            step's own peak differs by, never less: ``total - released_late`` is at most that peak.
    """

    peak: Mapping[str, int] = field(default_factory=_zero)
    peak_phase: str = "forward"
    by_phase: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    current: Mapping[str, int] = field(default_factory=_zero)
    peak_ops: Mapping[str, str] = field(default_factory=dict)
    pinned: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    n_ops: int = 0
    device: str = "cpu"
    timeline: StepTimeline | None = None
    released_late: int = 0

    def __post_init__(self) -> None:
        if self.peak_phase not in PHASES:
            raise ValueError(f"peak_phase={self.peak_phase!r} must be one of {PHASES}")
        for phase in self.by_phase:
            if phase not in PHASES:
                raise ValueError(f"by_phase has phase {phase!r}; phases are {PHASES}")

    @property
    def total(self) -> int:
        """Peak live tensor bytes (sum of :attr:`peak`)."""
        return sum(self.peak.values())

    def phase_total(self, phase: str) -> int:
        """Peak live tensor bytes within ``phase`` (0 when that phase did not run)."""
        if phase not in PHASES:
            raise ValueError(f"phase={phase!r} must be one of {PHASES}")
        return sum(self.by_phase.get(phase, {}).values())

    def to_estimate(self, *, source: str = "measured", rank: int = 0) -> MemoryEstimate:
        """The measurement as a :class:`MemoryEstimate` (``source`` says where it came from)."""
        components: dict[str, Any] = {name: int(self.peak.get(name, 0)) for name in COMPONENTS}
        return MemoryEstimate(
            **components,
            peak_phase=self.peak_phase,
            rank=rank,
            by_phase={p: {c: int(v) for c, v in comps.items()} for p, comps in self.by_phase.items()},
            source=source,
        )

    def to_dict(self) -> dict[str, Any]:
        return {  # an optional component (a weight-averaging copy) only when it held bytes
            "peak": trim_optional(self.peak),
            "total": self.total,
            "peak_phase": self.peak_phase,
            "by_phase": {p: trim_optional(c) for p, c in self.by_phase.items()},
            "current": trim_optional(self.current),
            "peak_ops": dict(self.peak_ops),
            "pinned": {p: trim_optional(c) for p, c in self.pinned.items()},
            "n_ops": self.n_ops,
            "device": self.device,
            "timeline": self.timeline.to_dict() if self.timeline is not None else None,
            "released_late": self.released_late,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrackerReport:
        return cls(
            peak={k: int(v) for k, v in data.get("peak", {}).items()},
            peak_phase=data.get("peak_phase", "forward"),
            by_phase={p: {k: int(v) for k, v in c.items()} for p, c in data.get("by_phase", {}).items()},
            current={k: int(v) for k, v in data.get("current", {}).items()},
            peak_ops={k: str(v) for k, v in data.get("peak_ops", {}).items()},
            pinned={p: {k: int(v) for k, v in c.items()} for p, c in data.get("pinned", {}).items()},
            n_ops=int(data.get("n_ops", 0)),
            device=data.get("device", "cpu"),
            timeline=StepTimeline.from_dict(data["timeline"]) if data.get("timeline") else None,
            released_late=int(data.get("released_late", 0)),
        )

    def format_table(self, unit: int = 1) -> str:
        """A plain-text table (components x overall peak and phase peaks); ``unit`` divides the bytes."""
        phases = [p for p in PHASES if p in self.by_phase]
        header = f"{'component':<12}{'peak':>14}" + "".join(f"{p:>14}" for p in phases)
        lines = [header]
        for name in (*shown_components(self.peak, *self.by_phase.values()), "total"):
            if name == "total":
                row = [self.total] + [self.phase_total(p) for p in phases]
            else:
                row = [self.peak.get(name, 0)] + [self.by_phase[p].get(name, 0) for p in phases]
            lines.append(f"{name:<12}" + "".join(f"{v / unit:>14.6g}" for v in row))
        return "\n".join(lines)
