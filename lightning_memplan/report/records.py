"""The memory report's data model: one :class:`StepRecord` per measured step, one :class:`RankSummary`
per rank and epoch, one :class:`EpochReport` per epoch (all ranks side by side), one
:class:`MemoryReport` per run.

Everything is integer bytes (as PyTorch's ``torch/distributed/_tools/mem_tracker.py`` counts them) and round-trips through plain JSON (``to_dict`` /
``from_dict``), so a saved ``memory_report.json`` can be rendered again by ``lightning-memplan report``
and a resumed run can continue it.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

from lightning_memplan.model.eval_estimate import EVAL_PHASES
from lightning_memplan.model.result import COMPONENTS, PHASES, shown_components
from lightning_memplan.report.checkpoints import CheckpointRecord, peak_ratio
from lightning_memplan.tracking.timeline import DEFAULT_SERIES_POINTS, SeriesBuilder, StepSeries, StepTimeline

_SERIES = ("estimated_peak", "measured_peak", "reserved", "seq_len")  # StepSeries' per-step fields

__all__ = [
    "MAX_EPOCH_RANKS",
    "MAX_REPORT_SUMMARIES",
    "REPORT_FORMAT_VERSION",
    "SUMMARY_RANKS",
    "RUN_PHASES",
    "EpochReport",
    "Incident",
    "MemoryReport",
    "RankAccumulator",
    "RankSummary",
    "Spread",
    "StepRecord",
    "representative_ranks",
    "summarize_rank",
]

#: Bumped when a field changes meaning or is added; ``from_dict`` refuses newer formats and reads every
#: older one (version 1 had no step timelines, per-phase estimate breakdowns nor per-step series; version 2
#: had no ``run`` per epoch: each ``trainer.fit`` of one callback is a run of its own since version 3; version 3
#: had no evaluation phases: ``EpochReport.phases`` and ``StepRecord.phase`` since version 4). A field written
#: only when it differs from its default (``estimated_host``, ``released_late``) needs no new version: a report
#: without it reads as before.
REPORT_FORMAT_VERSION = 4
#: Phases of a run a step record can belong to: the training step, then Lightning's evaluation loops
#: (:data:`lightning_memplan.model.eval_estimate.EVAL_PHASES`).
RUN_PHASES: tuple[str, ...] = ("train", *EVAL_PHASES)
_T = TypeVar("_T")
#: Byte counts and step indices are below 2**63 (a signed 64-bit integer, what the allocators report).
_MAX_COUNT = 2**63
#: Deepest nesting of a report's free-form parts (``lightning_memplan.files.MAX_JSON_DEPTH``).
_MAX_DEPTH = 200


def _shown(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"  # repr of a huge int is long (or refused past 4300 digits)
    return f"{value!r:.80}"


def _count(name: str, value: Any, *, minimum: int | None = 0, optional: bool = True) -> int | None:
    """A byte count / index read from a report: an ``int`` (or an integral finite float, as other JSON
    writers give), at least ``minimum``, below 2**63. Raises a ValueError/TypeError naming ``name``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={_shown(value)} must be an integer (a count of bytes or steps), not {type(value).__name__}")
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise ValueError(f"{name}={value!r} must be a whole, finite number")
        value = int(value)
    if abs(value) >= _MAX_COUNT or (minimum is not None and value < minimum):
        low = f"{minimum}" if minimum is not None else "-2**63"
        raise ValueError(f"{name}={_shown(value)} must be in [{low}, 2**63)")
    return value


def _required(name: str, value: Any, *, minimum: int | None = 0) -> int:
    """:func:`_count` of a value that must be present."""
    number = _count(name, value, minimum=minimum, optional=False)
    assert number is not None
    return number


def _text(name: str, value: Any, *, optional: bool = False) -> str | None:
    """A string read from a report (a note, a warning, an incident's kind or error)."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name}={_shown(value)} must be a string, not {type(value).__name__}")
    return value


def _ratio_value(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={_shown(value)} must be a finite number or null")
    return float(value)


def _at(where: str, parse: Callable[[Any], _T], data: Any) -> _T:
    """``parse(data)``, with ``where`` (``"epochs[2]"``) put in front of a ValueError/TypeError's message so
    it names the field's place in the file."""
    if not isinstance(data, Mapping):
        raise TypeError(f"{where}={_shown(data)} must be a JSON object, not {type(data).__name__}")
    try:
        return parse(data)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{where}.{exc}") from None


def _items(name: str, value: Any) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name}={_shown(value)} must be a list, not {type(value).__name__}")
    return list(value)


def _name(name: str, key: Any, allowed: Sequence[str]) -> str:
    """A component or phase name read from a report: exactly one of ``allowed`` (a look-alike such as
    ``"Params"``, ``"params\u200b"`` or rich markup is refused, never shown beside the real one)."""
    if key not in allowed:
        raise ValueError(f"{name} has the key {ascii(key)[:60]}, which is not one of {', '.join(allowed)}")
    return str(key)


def _int_map(data: Mapping[str, Any] | None, name: str = "map", allowed: Sequence[str] = COMPONENTS) -> dict[str, int] | None:
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise TypeError(f"{name}={_shown(data)} must be a JSON object of byte counts")
    return {_name(name, k, allowed): _required(f"{name}[{str(k)!r:.40}]", v) for k, v in data.items()}


#: The per-component and per-phase maps of a step record or a rank summary, and the names their keys take.
_MAP_FIELDS = {"estimated_components": COMPONENTS, "estimated_phase_peaks": PHASES, "measured_components": COMPONENTS,
               "measured_phase_peaks": PHASES}


def _run_phase(name: str, value: Any) -> str:
    """One of :data:`RUN_PHASES`, read from a report."""
    if value not in RUN_PHASES:
        raise ValueError(f"{name}={_shown(value)} must be one of {RUN_PHASES}")
    return str(value)


def _by_phase(value: Any) -> dict[str, dict[str, int] | None] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"estimated_by_phase={_shown(value)} must be a JSON object")
    return {_name("estimated_by_phase", p, PHASES): _int_map(c, f"estimated_by_phase[{str(p)!r:.40}]") for p, c in value.items()}


def _map_reader(allowed: Sequence[str]) -> Callable[[str, Any], Any]:
    return lambda name, value: _int_map(value, name, allowed)


#: How each field of a step record / rank summary is read (the fields not named here are their own classes').
_FIELD_READERS: dict[str, Callable[[str, Any], Any]] = {
    **{key: _map_reader(allowed) for key, allowed in _MAP_FIELDS.items()},
    "estimated_by_phase": lambda _k, v: _by_phase(v),
    **dict.fromkeys(("step", "epoch", "rank", "steps"), _required),
    **dict.fromkeys(("micro_batch", "seq_len", "estimated_peak", "measured_peak", "reserved", "device_memory",
                     "worst_step", "max_seq_len", "estimated_host"), _count),
    "headroom": lambda k, v: _count(k, v, minimum=None),  # negative: over capacity
    "backend": _text,
    **dict.fromkeys(("estimated_peak_phase", "measurement"), lambda k, v: _text(k, v, optional=True)),
    "phase": _run_phase,
    "released_late": _required,  # absent in older reports: 0
}
#: Fields whose reader accepts any int in [0, 2**63) as it is (the common case, checked without a call).
_PLAIN_COUNTS = frozenset(k for k, f in _FIELD_READERS.items() if f is _required or f is _count)


def _with_int_maps(data: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``data`` with every known field read by its :data:`_FIELD_READERS` entry (maps hold ints,
    JSON may give floats); one pass, the plain in-range integers without a call (a report of 65,536 ranks
    is read in about a second)."""
    kwargs = dict(data)
    for key, value in kwargs.items():
        if key in _PLAIN_COUNTS and type(value) is int and 0 <= value < _MAX_COUNT:
            continue
        read = _FIELD_READERS.get(key)
        if read is not None:
            kwargs[key] = read(key, value)
    for key in _MAP_FIELDS:
        kwargs.setdefault(key, None)
    return kwargs


def _series(data: Mapping[str, Any]) -> StepSeries:
    """A per-step series read from a report: step indices and byte counts / lengths as whole numbers
    >= 0 (or null), one per step, and a stride >= 1; a string or a negative value is refused."""
    steps = [_required(f"steps[{i}]", v) for i, v in enumerate(_items("steps", data.get("steps")))]
    values = {
        name: [_count(f"{name}[{i}]", v) for i, v in enumerate(_items(name, data.get(name)))] for name in _SERIES
    }
    for name, column in values.items():
        if len(column) != len(steps):
            raise ValueError(f"{name} has {len(column)} values for {len(steps)} steps; each needs one value per step")
    return StepSeries(steps=tuple(steps), stride=_required("stride", data.get("stride", 1), minimum=1),
                      **{name: tuple(column) for name, column in values.items()})


def _timeline(data: Mapping[str, Any]) -> StepTimeline:
    """A step timeline read from a report: operator indices and byte counts as whole numbers >= 0, phases
    as names or indices of :data:`PHASES`, components named as in :data:`COMPONENTS`."""
    phases = []
    for p in _items("phases", data.get("phases")):
        index = p if isinstance(p, int) and not isinstance(p, bool) and 0 <= p < len(PHASES) else None
        phases.append(PHASES[index] if index is not None else _name("phases", p, PHASES))
    components = data.get("components")
    if not isinstance(components, Mapping):
        raise TypeError(f"components={_shown(components)} must be a JSON object of byte series")
    return StepTimeline(
        ops=tuple(_required(f"ops[{i}]", v) for i, v in enumerate(_items("ops", data.get("ops")))),
        phases=tuple(phases),
        components={_name("components", c, COMPONENTS): tuple(_required(f"components[{c!r}][{i}]", x)
                                                                for i, x in enumerate(_items(f"components[{c!r}]", v)))
                    for c, v in components.items()},
        n_ops=_required("n_ops", data.get("n_ops", 0)),
        stride=_required("stride", data.get("stride", 1), minimum=1),
    )


def _check_size(epochs: Any) -> None:
    """Refuse a report of more rank summaries than :data:`MAX_REPORT_SUMMARIES`, counted before any is read."""
    if not isinstance(epochs, (list, tuple)):
        return
    total = 0
    for e in epochs:
        if isinstance(e, Mapping):
            total += sum(len(v) for v in (e.get("ranks"),) if isinstance(v, (list, tuple)))
            phases = e.get("phases")
            if isinstance(phases, Mapping):
                total += sum(len(v) for v in phases.values() if isinstance(v, (list, tuple)))
    if total > MAX_REPORT_SUMMARIES:
        raise ValueError(f"epochs hold {total:,d} rank summaries, more than the {MAX_REPORT_SUMMARIES:,d} a report holds "
                         "(lightning-memplan writes at most that many)")


def _unique(where: str, keys: Sequence[Any]) -> None:
    """Refuse a key (a rank, a run/epoch pair) that appears twice in one list of a report."""
    seen: set[Any] = set()
    for key in keys:
        if key in seen:
            raise ValueError(f"{where} holds {key!r} twice; a report lists each once")
        seen.add(key)


def _plain(name: str, value: Any) -> Any:
    """``value`` checked to be plain JSON data (objects with string keys, lists, strings, booleans, null,
    integers within 64 bits, finite floats) at most 200 deep: what a report's free-form parts (``run``, an
    incident's ``allocator``) may hold. Iterative, so no depth exhausts the interpreter's stack."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > _MAX_DEPTH:
            raise ValueError(f"{name} is nested more than {_MAX_DEPTH} deep")
        if isinstance(item, Mapping):
            if not all(isinstance(k, str) for k in item):
                raise TypeError(f"{name} has a key that is not a string")
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{name} holds the non-finite number {item!r}; a report holds finite numbers only")
        elif isinstance(item, int) and not isinstance(item, bool) and abs(item) >= _MAX_COUNT:
            raise ValueError(f"{name} holds {_shown(item)}, beyond 64 bits")
        elif not (item is None or isinstance(item, (str, bool, int, float))):
            raise TypeError(f"{name} holds a {type(item).__name__}, which is not JSON data")
    return value


def _drop_zero_late(data: dict[str, Any]) -> None:
    """Leave ``released_late`` out of a record's dict when it is 0 (every record of a run without late
    releases keeps the keys it always had, and older readers read it)."""
    if not data.get("released_late"):
        data.pop("released_late", None)


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """Estimate and measurement of one training step on one rank.

    Attributes:
        step: index of the training batch on this rank, counted from the start of the run.
        epoch: the epoch it belongs to.
        rank: global rank.
        micro_batch, seq_len: the batch shape the estimate was made for (``None`` if not inferred).
        estimated_peak: :attr:`MemoryEstimate.total` for that shape, bytes (``None`` without a model).
        estimated_components: the estimate's ``{component: bytes}`` at its peak.
        estimated_phase_peaks: ``{phase: bytes}``, :meth:`MemoryEstimate.phase_total` per phase.
        estimated_peak_phase: phase in which the estimate peaks.
        estimated_by_phase: ``{phase: {component: bytes}}``, the estimate at each phase's own peak
            (:attr:`MemoryEstimate.by_phase`); drawn as steps under the measured step timeline.
        measured_peak: measured peak of allocated tensor bytes in the step: the CUDA allocator's
            ``max_memory_allocated`` (reset each step), MPS's sampled ``current_allocated_memory``, or
            the tensor tracker on tracked CPU steps; ``None`` where nothing measured tensors.
        measured_components: ``{component: bytes}`` at the measured peak (tensor tracker only).
        measured_phase_peaks: ``{phase: bytes}`` measured peak of each phase.
        reserved: bytes the process holds for tensors: the CUDA allocator's peak reserved memory, MPS's
            driver-allocated memory, or on CPU the process's resident set size (RSS).
        device_memory: the capacity headroom is computed against (``memory_budget`` when given, else
            the device's total memory, or the machine's RAM on CPU).
        headroom: ``device_memory`` minus the peak of ``reserved`` (and, on CUDA, minus what other
            processes and the CUDA context hold), bytes; may be negative.
        tracked: whether the tensor tracker ran on this step.
        warmup: the step ran before the first optimizer step finished, so optimizer states did not
            exist yet; such steps are reported but not compared against the steady-state estimate.
        backend: ``"cuda"``, ``"mps"`` or ``"cpu"``.
        timeline: live bytes per component over the step (:class:`StepTimeline`), on tracked steps.
        measurement: how ``measured_peak`` was taken: ``"tensor_tracker"`` (live storages, tracked CPU/MPS
            steps), ``"cuda_allocator"`` (the caching allocator's peak counters), ``"mps_sampled"``,
            ``"compiled:profiler"`` (a ``torch.compile`` step on the CPU: the profiler's allocator
            events, no dispatch mode), ``"rss"`` (untracked CPU step: only ``reserved``); ``None`` in
            older reports.
        phase: the loop the step belongs to: ``"train"`` (the default, and every step of reports before
            format version 4), ``"val"``, ``"test"`` or ``"predict"`` (a no-grad evaluation step: its
            estimate is :func:`~lightning_memplan.model.eval_estimate.estimate_eval_memory`, its ``step``
            counts that loop's batches).
        released_late: bytes of ``measured_peak`` that were a finished collective's buffers another thread
            (gloo's worker) released after the step had let them go
            (:attr:`~lightning_memplan.tracking.report.TrackerReport.released_late`): the part of the peak
            that varies between identical runs; 0 when none was (and in reports written before it existed).
    """

    step: int
    epoch: int
    rank: int
    micro_batch: int | None = None
    seq_len: int | None = None
    estimated_peak: int | None = None
    estimated_components: dict[str, int] | None = None
    estimated_phase_peaks: dict[str, int] | None = None
    estimated_peak_phase: str | None = None
    measured_peak: int | None = None
    measured_components: dict[str, int] | None = None
    measured_phase_peaks: dict[str, int] | None = None
    reserved: int | None = None
    device_memory: int | None = None
    headroom: int | None = None
    tracked: bool = False
    warmup: bool = False
    backend: str = "cpu"
    estimated_by_phase: dict[str, dict[str, int]] | None = None
    timeline: StepTimeline | None = None
    measurement: str | None = None
    estimated_host: int | None = None
    phase: str = "train"
    released_late: int = 0

    @property
    def ratio(self) -> float | None:
        """measured_peak / estimated_peak (``None`` when either is missing): :func:`peak_ratio`."""
        return peak_ratio(self.measured_peak, self.estimated_peak)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(replace(self, timeline=None))
        data["timeline"] = self.timeline.to_dict() if self.timeline is not None else None
        if data["estimated_host"] is None:  # only offloading runs have host bytes; other records keep their keys
            del data["estimated_host"]
        if data["phase"] == "train":  # training records keep the keys they always had
            del data["phase"]
        _drop_zero_late(data)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepRecord:
        kwargs = _with_int_maps(data)
        timeline = kwargs.get("timeline")
        kwargs["timeline"] = _at("timeline", _timeline, timeline) if timeline else None
        return cls(**kwargs)


@dataclass(frozen=True, kw_only=True)
class RankSummary:
    """One rank's figures over one epoch.

    Attributes:
        rank, epoch: which rank and epoch.
        steps: training steps this rank ran in the epoch.
        backend: measurement backend (see :attr:`StepRecord.backend`).
        estimated_peak: largest per-step estimate in the epoch, bytes.
        estimated_components, estimated_phase_peaks: the breakdown of that largest estimate.
        measured_peak: largest measured peak in the epoch (any backend), bytes.
        measured_components: breakdown at the largest *tracked* measurement (tensor tracker).
        measured_phase_peaks: largest measured peak of each phase.
        reserved: largest ``reserved`` (allocator reserved / RSS), bytes.
        headroom: smallest headroom in the epoch, bytes.
        device_memory: capacity used for headroom, bytes.
        worst_step: step index of the largest measured (else estimated) peak.
        max_seq_len: largest sequence length seen.
        shapes: distinct ``(micro_batch, seq_len)`` seen, in order of first appearance (at most 16).
        tracked: the tracked steps (estimate and tensor-tracker measurement side by side).
        measured_to_estimated: measured / estimated peak at the steady-state step (not ``warmup``) with
            the largest measurement; ``None`` without one. Warm-up steps are left out because the
            estimate is the steady state (optimizer states exist).
        series: the per-step estimated and measured peak, reserved and sequence length over the epoch
            (:class:`StepSeries`, bounded); ``None`` in reports of format version 1.
        released_late: :attr:`StepRecord.released_late` of the step that measured :attr:`measured_peak`:
            how much of that peak gloo's worker thread released late (0: none).
    """

    rank: int
    epoch: int
    steps: int = 0
    backend: str = "cpu"
    estimated_peak: int | None = None
    estimated_components: dict[str, int] | None = None
    estimated_phase_peaks: dict[str, int] | None = None
    measured_peak: int | None = None
    measured_components: dict[str, int] | None = None
    measured_phase_peaks: dict[str, int] | None = None
    reserved: int | None = None
    headroom: int | None = None
    device_memory: int | None = None
    worst_step: int | None = None
    max_seq_len: int | None = None
    shapes: tuple[tuple[int, int], ...] = ()
    tracked: tuple[StepRecord, ...] = ()
    measured_to_estimated: float | None = None
    series: StepSeries | None = None
    estimated_host: int | None = None
    released_late: int = 0

    @property
    def ratio(self) -> float | None:
        """:attr:`measured_to_estimated` (steady-state measured / estimated peak)."""
        return self.measured_to_estimated

    def to_dict(self) -> dict[str, Any]:
        data = asdict(replace(self, tracked=(), series=None))
        data["shapes"] = [list(s) for s in self.shapes]
        data["tracked"] = [r.to_dict() for r in self.tracked]
        data["series"] = self.series.to_dict() if self.series is not None else None
        if data["estimated_host"] is None:
            del data["estimated_host"]
        _drop_zero_late(data)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankSummary:
        kwargs = _with_int_maps(data)
        kwargs["shapes"] = tuple(
            (_required(f"shapes[{i}]", shape[0]), _required(f"shapes[{i}]", shape[1]))
            for i, shape in enumerate(_items("shapes", kwargs.get("shapes")))
        )
        kwargs["tracked"] = tuple(
            _at(f"tracked[{i}]", StepRecord.from_dict, r) for i, r in enumerate(_items("tracked", kwargs.get("tracked")))
        )
        series = kwargs.get("series")
        kwargs["series"] = _at("series", _series, series) if series else None
        kwargs["measured_to_estimated"] = _ratio_value("measured_to_estimated", kwargs.get("measured_to_estimated"))
        return cls(**kwargs)


_MAX_SHAPES = 16
#: Most points a restored per-step series may hold (``MemoryPlanCallback(series_points=...)`` is far below).
_MAX_SERIES_POINTS = 2**20
#: Tracked steps kept per rank and epoch (the most recent ones, plus the worst one always).
_MAX_TRACKED = 32


class RankAccumulator:
    """Folds one rank's step records of one epoch into a :class:`RankSummary` as they arrive.

    Holds O(1) records (the worst estimated, worst measured and worst tracked step, and a bounded window
    of tracked steps, of which only the worst and the latest keep their step timeline, and a
    :class:`SeriesBuilder` of at most ``series_points`` points), so an epoch of any length costs constant
    memory. Its state round-trips through
    :meth:`to_dict` so a checkpoint taken mid-epoch resumes the same epoch.
    """

    def __init__(self, *, rank: int, epoch: int, backend: str, series_points: int = DEFAULT_SERIES_POINTS) -> None:
        self.rank, self.epoch, self.backend = rank, epoch, backend
        self.series = SeriesBuilder(series_points)
        self.steps = 0
        self.worst_est: StepRecord | None = None
        self.worst_meas: StepRecord | None = None
        self.worst_tracked: StepRecord | None = None
        self.worst_steady: StepRecord | None = None
        self.tracked: list[StepRecord] = []
        self.phase_peaks: dict[str, int] = {}
        self.reserved: int | None = None
        self.headroom: int | None = None
        self.device_memory: int | None = None
        self.max_seq_len: int | None = None
        self.shapes: list[tuple[int, int]] = []

    def add(self, r: StepRecord) -> None:
        self.steps += 1
        if r.estimated_peak is not None and (
            self.worst_est is None or r.estimated_peak > (self.worst_est.estimated_peak or 0)
        ):
            self.worst_est = r
        if r.measured_peak is not None and (
            self.worst_meas is None or r.measured_peak > (self.worst_meas.measured_peak or 0)
        ):
            self.worst_meas = r
        if (
            r.ratio is not None
            and not r.warmup
            and (self.worst_steady is None or (r.measured_peak or 0) > (self.worst_steady.measured_peak or 0))
        ):
            self.worst_steady = r
        if r.tracked:
            if self.worst_tracked is None or (r.measured_peak or 0) > (self.worst_tracked.measured_peak or 0):
                self.worst_tracked = r
            # Only the worst and the latest tracked step keep their timeline (bounded report size).
            self.tracked = [
                t if t.timeline is None or t is self.worst_tracked else replace(t, timeline=None) for t in self.tracked
            ]
            self.tracked.append(r)
            if len(self.tracked) > _MAX_TRACKED:
                self.tracked.pop(0)
        self.series.add(r.step, (r.estimated_peak, r.measured_peak, r.reserved, r.seq_len))
        for phase, value in (r.measured_phase_peaks or {}).items():
            self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), value)
        self.reserved = _max_opt((self.reserved, r.reserved))
        if r.headroom is not None:
            self.headroom = r.headroom if self.headroom is None else min(self.headroom, r.headroom)
        self.device_memory = _max_opt((self.device_memory, r.device_memory))
        self.max_seq_len = _max_opt((self.max_seq_len, r.seq_len))
        if r.micro_batch is not None and r.seq_len is not None:
            shape = (r.micro_batch, r.seq_len)
            if shape not in self.shapes and len(self.shapes) < _MAX_SHAPES:
                self.shapes.append(shape)

    def summary(self) -> RankSummary:
        worst = self.worst_tracked
        tracked = [worst if worst is not None and t.step == worst.step else t for t in self.tracked]
        if worst is not None and worst not in tracked:
            tracked.insert(0, worst)
        worst = self.worst_meas or self.worst_est
        return RankSummary(
            rank=self.rank,
            epoch=self.epoch,
            steps=self.steps,
            backend=self.backend,
            estimated_peak=self.worst_est.estimated_peak if self.worst_est else None,
            estimated_components=self.worst_est.estimated_components if self.worst_est else None,
            estimated_phase_peaks=self.worst_est.estimated_phase_peaks if self.worst_est else None,
            measured_peak=self.worst_meas.measured_peak if self.worst_meas else None,
            measured_components=self.worst_tracked.measured_components if self.worst_tracked else None,
            measured_phase_peaks=dict(self.phase_peaks) or None,
            reserved=self.reserved,
            headroom=self.headroom,
            device_memory=self.device_memory,
            worst_step=worst.step if worst else None,
            max_seq_len=self.max_seq_len,
            shapes=tuple(self.shapes),
            tracked=tuple(tracked),
            measured_to_estimated=self.worst_steady.ratio if self.worst_steady else None,
            series=self.series.series() if self.series.rows else None,
            estimated_host=self.worst_est.estimated_host if self.worst_est else None,
            released_late=self.worst_meas.released_late if self.worst_meas else 0,
        )

    def to_dict(self) -> dict[str, Any]:
        rec = lambda r: r.to_dict() if r is not None else None  # noqa: E731
        return {
            "rank": self.rank,
            "epoch": self.epoch,
            "backend": self.backend,
            "steps": self.steps,
            "worst_est": rec(self.worst_est),
            "worst_meas": rec(self.worst_meas),
            "worst_tracked": rec(self.worst_tracked),
            "worst_steady": rec(self.worst_steady),
            "tracked": [r.to_dict() for r in self.tracked],
            "phase_peaks": dict(self.phase_peaks),
            "reserved": self.reserved,
            "headroom": self.headroom,
            "device_memory": self.device_memory,
            "max_seq_len": self.max_seq_len,
            "shapes": [list(s) for s in self.shapes],
            "series": self.series.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankAccumulator:
        """The accumulator :meth:`to_dict` saved (a checkpoint's), every field checked as the report reader
        checks it.

        Raises:
            KeyError: ``rank``, ``epoch`` or ``backend`` missing.
            ValueError, TypeError: a field of the wrong type or out of range (names it).
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"accumulator={_shown(data)} must be a JSON object")
        acc = cls(rank=_required("rank", data["rank"]), epoch=_required("epoch", data["epoch"]),
                  backend=str(_text("backend", data["backend"])), series_points=_series_points(data.get("series")))
        rec = lambda name: _at(name, StepRecord.from_dict, data[name]) if data.get(name) else None  # noqa: E731
        acc.steps = _required("steps", data.get("steps", 0))
        acc.worst_est, acc.worst_meas = rec("worst_est"), rec("worst_meas")
        acc.worst_tracked, acc.worst_steady = rec("worst_tracked"), rec("worst_steady")
        acc.tracked = [_at(f"tracked[{i}]", StepRecord.from_dict, d) for i, d in enumerate(_items("tracked", data.get("tracked")))]
        if len(acc.tracked) > _MAX_TRACKED:
            raise ValueError(f"tracked holds {len(acc.tracked)} steps, more than the {_MAX_TRACKED} an accumulator keeps")
        acc.phase_peaks = _int_map(data.get("phase_peaks") or {}, "phase_peaks", PHASES) or {}
        acc.reserved, acc.device_memory = _count("reserved", data.get("reserved")), _count("device_memory", data.get("device_memory"))
        acc.headroom = _count("headroom", data.get("headroom"), minimum=None)
        acc.max_seq_len = _count("max_seq_len", data.get("max_seq_len"))
        acc.shapes = [_shape(f"shapes[{i}]", shape) for i, shape in enumerate(_items("shapes", data.get("shapes")))][:_MAX_SHAPES]
        if data.get("series"):
            acc.series = _at("series", _series_builder, data["series"])
        return acc


def _series_points(data: Any) -> int:
    points = data.get("points", DEFAULT_SERIES_POINTS) if isinstance(data, Mapping) else DEFAULT_SERIES_POINTS
    if isinstance(points, bool) or not isinstance(points, int) or not 4 <= points <= _MAX_SERIES_POINTS:
        raise ValueError(f"series.points={_shown(points)} must be a whole number in [4, {_MAX_SERIES_POINTS}]")
    return points


def _shape(name: str, shape: Any) -> tuple[int, int]:
    if not isinstance(shape, (list, tuple)) or len(shape) != 2:
        raise TypeError(f"{name}={_shown(shape)} must be a [micro_batch, seq_len] pair")
    return _required(name, shape[0]), _required(name, shape[1])


def _series_builder(data: Mapping[str, Any]) -> SeriesBuilder:
    """A :class:`SeriesBuilder`'s saved state: rows of ``[step, estimated, measured, reserved, seq_len]``,
    whole numbers >= 0 (``null`` but the step), at most ``points`` of them."""
    builder = SeriesBuilder(_series_points(data))
    builder.stride = _required("stride", data.get("stride", 1), minimum=1)
    builder.count = _required("count", data.get("count", 0))
    rows = _items("rows", data.get("rows"))
    if len(rows) > builder.points:
        raise ValueError(f"rows holds {len(rows)} rows, more than its {builder.points} points")
    for i, row in enumerate(rows):
        if not isinstance(row, (list, tuple)) or len(row) != 1 + len(_SERIES):
            raise TypeError(f"rows[{i}]={_shown(row)} must be a list of {1 + len(_SERIES)} numbers")
        builder.rows.append([_required(f"rows[{i}][0]", row[0]), *(_count(f"rows[{i}][{j}]", v) for j, v in enumerate(row[1:], 1))])
    return builder


def _max_opt(values: Iterable[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def summarize_rank(records: Sequence[StepRecord], *, rank: int, epoch: int, backend: str) -> RankSummary:
    """Fold a list of one rank's step records of one epoch into a :class:`RankSummary`."""
    acc = RankAccumulator(rank=rank, epoch=epoch, backend=backend)
    for record in records:
        acc.add(record)
    return acc.summary()


@dataclass(frozen=True, kw_only=True)
class Spread:
    """One figure across ranks: smallest, largest, and imbalance = max / mean - 1 (0 when balanced)."""

    min: int
    max: int
    imbalance: float

    @classmethod
    def of(cls, values: Iterable[int | None]) -> Spread | None:
        present = [int(v) for v in values if v is not None]
        if not present:
            return None
        mean = sum(present) / len(present)
        return cls(min=min(present), max=max(present), imbalance=(max(present) / mean - 1.0) if mean else 0.0)


@dataclass(frozen=True, kw_only=True)
class EpochReport:
    """Every rank's :class:`RankSummary` for one epoch, and the warnings raised during it.

    ``warning_steps[i]`` is the step at which ``warnings[i]`` was first raised (on any rank); it may be
    shorter than ``warnings`` (reports of format version 1 have none), the pictures then place the
    warning at the start of the epoch. ``run`` counts the ``trainer.fit`` calls of one callback (0 for the
    first; a second fit appends run 1 instead of replacing run 0's epochs); set by
    :meth:`MemoryReport.with_epoch`, with ``run_id``, the fit's random id (``""`` in reports written before
    run ids), by which :meth:`MemoryReport.merged_with` tells two fits that wrote one folder apart. ``phases`` holds the evaluation steps that ran during the epoch
    (validation inside ``trainer.fit``; test / predict / validate runs after it), ``{phase: every rank's
    summary}`` for the phases that ran (``"val"``, ``"test"``, ``"predict"``); empty in reports before
    format version 4."""

    epoch: int
    ranks: tuple[RankSummary, ...]
    warnings: tuple[str, ...] = ()
    warning_steps: tuple[int, ...] = ()
    run: int = 0
    run_id: str = ""
    phases: Mapping[str, tuple[RankSummary, ...]] = field(default_factory=dict)
    #: Every rank's record of each checkpoint save during (or, for the last epoch, after) the epoch.
    checkpoints: tuple[CheckpointRecord, ...] = ()

    def phase_spread(self, phase: str, name: str) -> Spread | None:
        """:class:`Spread` of a :class:`RankSummary` field over the ranks' summaries of an evaluation phase."""
        return Spread.of(getattr(r, name) for r in self.phases.get(phase, ()))

    @property
    def key(self) -> tuple[int, int]:
        """``(run, epoch)``: what identifies an epoch in a report."""
        return (self.run, self.epoch)

    @property
    def label(self) -> str:
        """``"epoch 3"``, or ``"run 1, epoch 3"`` for the epochs of a second or later fit."""
        return f"run {self.run}, epoch {self.epoch}" if self.run else f"epoch {self.epoch}"

    def spread(self, name: str) -> Spread | None:
        """:class:`Spread` of a :class:`RankSummary` field (``"measured_peak"``, ``"headroom"``, ...)."""
        return Spread.of(getattr(r, name) for r in self.ranks)

    def to_dict(self) -> dict[str, Any]:
        across = {}
        for name in ("estimated_peak", "measured_peak", "reserved", "headroom"):
            spread = self.spread(name)
            across[name] = asdict(spread) if spread else None
        return {
            "epoch": self.epoch,
            "run": self.run,
            **({"run_id": self.run_id} if self.run_id else {}),
            "ranks": [r.to_dict() for r in self.ranks],
            "across_ranks": across,
            "warnings": list(self.warnings),
            "warning_steps": list(self.warning_steps),
            **({"phases": {p: [r.to_dict() for r in rs] for p, rs in self.phases.items()}} if self.phases else {}),
            **({"checkpoints": [c.to_dict() for c in self.checkpoints]} if self.checkpoints else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EpochReport:
        phases = data.get("phases") or {}
        if not isinstance(phases, Mapping):
            raise TypeError(f"phases={_shown(phases)} must be a JSON object of evaluation phases")
        for key, items in (("ranks", data.get("ranks")), *((f"phases[{p!r}]", rs) for p, rs in phases.items())):
            if isinstance(items, (list, tuple)) and len(items) > MAX_EPOCH_RANKS:
                raise ValueError(f"{key} holds {len(items):,d} rank summaries, more than the {MAX_EPOCH_RANKS:,d} an "
                                 "epoch holds (lightning-memplan writes at most that many)")
        by_phase = {
            _run_phase("phases", p): tuple(
                _at(f"phases[{p!r}][{i}]", RankSummary.from_dict, r) for i, r in enumerate(_items(f"phases[{p!r}]", rs))
            )
            for p, rs in phases.items()
        }
        ranks = tuple(_at(f"ranks[{i}]", RankSummary.from_dict, r) for i, r in enumerate(_items("ranks", data.get("ranks"))))
        _unique("ranks (by rank)", [r.rank for r in ranks])
        for p, summaries in by_phase.items():
            _unique(f"phases[{p!r}] (by rank)", [r.rank for r in summaries])
        return cls(
            phases=by_phase,
            epoch=_required("epoch", data["epoch"]),
            ranks=ranks,
            warnings=tuple(str(_text(f"warnings[{i}]", w)) for i, w in enumerate(_items("warnings", data.get("warnings")))),
            warning_steps=tuple(
                _required(f"warning_steps[{i}]", x)
                for i, x in enumerate(_items("warning_steps", data.get("warning_steps")))
            ),
            run=_required("run", data.get("run", 0)),
            run_id=str(_text("run_id", data.get("run_id", ""))),
            checkpoints=tuple(
                _at(f"checkpoints[{i}]", CheckpointRecord.from_dict, c)
                for i, c in enumerate(_items("checkpoints", data.get("checkpoints")))
            ),
        )


#: Most rank summaries one epoch (or one of its evaluation phases) holds, and a whole report: the reader
#: refuses more (read at ~20 us a summary, a report answers in seconds) and the writer keeps within them
#: (:meth:`MemoryReport.with_epoch`).
MAX_EPOCH_RANKS = 2**16
MAX_REPORT_SUMMARIES = 2**18
#: Ranks an epoch keeps once the report is over :data:`MAX_REPORT_SUMMARIES`, and the rows of a rank table.
SUMMARY_RANKS = 64


def representative_ranks(ranks: Sequence[RankSummary], limit: int) -> tuple[RankSummary, ...]:
    """At most ``limit`` of ``ranks`` (all of them when they are that few), in rank order: rank 0, the rank
    with the smallest headroom, then those with the largest measured (else estimated) peak. What a table or a
    chart of a large run shows, and what a report beyond the caps keeps."""
    if len(ranks) <= limit:
        return tuple(ranks)
    chosen: dict[int, RankSummary] = {}
    first = next((r for r in ranks if r.rank == 0), None)
    tight = min((r for r in ranks if r.headroom is not None), key=lambda r: r.headroom or 0, default=None)
    for r in (first, tight):
        if r is not None and len(chosen) < limit:
            chosen[r.rank] = r
    by_peak = sorted(ranks, key=lambda r: -(r.measured_peak if r.measured_peak is not None else r.estimated_peak or 0))
    for r in by_peak:
        if len(chosen) >= limit:
            break
        chosen.setdefault(r.rank, r)
    return tuple(sorted(chosen.values(), key=lambda r: r.rank))


def _capped(epoch: EpochReport, limit: int) -> EpochReport:
    if len(epoch.ranks) <= limit and all(len(rs) <= limit for rs in epoch.phases.values()):
        return epoch
    return replace(epoch, ranks=representative_ranks(epoch.ranks, limit),
                   phases={p: representative_ranks(rs, limit) for p, rs in epoch.phases.items()})


def _summaries(epoch: EpochReport) -> int:
    return len(epoch.ranks) + sum(len(rs) for rs in epoch.phases.values())


@dataclass(frozen=True, kw_only=True)
class Incident:
    """An exception that ended the run (out-of-memory or otherwise), recorded before it propagated.

    Attributes:
        kind: ``"oom"`` or ``"exception"``.
        error: ``"TypeName: message"`` of the exception.
        rank, epoch, step: where it happened.
        step_record: the failing step's estimate and whatever was measured before the error.
        allocator: a summary of the allocator state (CUDA ``memory_stats`` subset and
            ``memory_summary``; RSS and the tracker's live bytes on CPU).
        partial_epoch: this rank's summary of the epoch that was interrupted.
    """

    kind: str
    error: str
    rank: int
    epoch: int
    step: int
    step_record: StepRecord | None = None
    allocator: dict[str, Any] = field(default_factory=dict)
    partial_epoch: RankSummary | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "error": self.error,
            "rank": self.rank,
            "epoch": self.epoch,
            "step": self.step,
            "step_record": self.step_record.to_dict() if self.step_record else None,
            "allocator": dict(self.allocator),
            "partial_epoch": self.partial_epoch.to_dict() if self.partial_epoch else None,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Incident:
        rec = data.get("step_record")
        part = data.get("partial_epoch")
        allocator = data.get("allocator") or {}
        if not isinstance(allocator, Mapping):
            raise TypeError(f"allocator={_shown(allocator)} must be a JSON object")
        _plain("allocator", allocator)
        return cls(
            kind=str(_text("kind", data["kind"])),
            error=str(_text("error", data["error"])),
            rank=_required("rank", data["rank"]),
            epoch=_required("epoch", data["epoch"]),
            step=_required("step", data["step"]),
            step_record=_at("step_record", StepRecord.from_dict, rec) if rec else None,
            allocator=dict(allocator),
            partial_epoch=_at("partial_epoch", RankSummary.from_dict, part) if part else None,
        )


@dataclass(frozen=True, kw_only=True)
class MemoryReport:
    """A run's memory report: what was assumed (``run``), every epoch, and any incident.

    Attributes:
        run: what the estimate assumed: ``model_spec``, ``train_spec``, ``plan`` (their ``to_dict``),
            ``estimate_source`` (``"calibrated"``: a traced step of the run's own module; ``"traced"``:
            the coefficients that came with the ModelSpec, e.g. a Hugging Face config's class; ``"analytic"``;
            ``"none"``), ``world_size``, ``accelerator``.
        notes: what could not be inferred or measured, and which argument supplies it.
        epochs: one :class:`EpochReport` per finished epoch, in ``(run, epoch)`` order.
        incidents: exceptions recorded by ``on_exception``.
        current_run: the run (``trainer.fit`` of the callback, counted from 0) that :meth:`with_epoch`
            adds to; :meth:`new_run` starts the next one.
        current_run_id: the random id of that run (:meth:`new_run` makes one), given to its epochs.
    """

    run: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    epochs: tuple[EpochReport, ...] = ()
    incidents: tuple[Incident, ...] = ()
    current_run: int = 0
    current_run_id: str = ""

    def with_epoch(self, epoch: EpochReport) -> MemoryReport:
        """A copy with ``epoch`` added to the current run (replacing an earlier entry for the same epoch
        number of that run: a resumed epoch)."""
        epoch = replace(epoch, run=self.current_run, run_id=self.current_run_id)
        kept = [e for e in self.epochs if e.key != epoch.key]
        return replace(self, epochs=tuple(sorted([*kept, epoch], key=lambda e: e.key)))._within_caps()

    def _within_caps(self) -> MemoryReport:
        """This report with at most :data:`MAX_EPOCH_RANKS` summaries per epoch and phase and
        :data:`MAX_REPORT_SUMMARIES` in all (what :meth:`from_dict` reads): a larger epoch keeps its
        :func:`representative_ranks`, and while the whole is too large the oldest full epochs keep
        :data:`SUMMARY_RANKS` each; a note says so. Nothing changes below the caps."""
        epochs = [_capped(e, MAX_EPOCH_RANKS) for e in self.epochs]
        total = sum(_summaries(e) for e in epochs)
        for i, e in enumerate(epochs):
            if total <= MAX_REPORT_SUMMARIES:
                break
            small = _capped(e, SUMMARY_RANKS)
            total -= _summaries(e) - _summaries(small)
            epochs[i] = small
        if all(a is b for a, b in zip(epochs, self.epochs, strict=True)):
            return self
        note = (f"rank summaries beyond {MAX_EPOCH_RANKS:,d} per epoch or {MAX_REPORT_SUMMARIES:,d} per report are left "
                "out: an epoch keeps rank 0, the smallest headroom and the largest peaks (older epochs first "
                f"keep {SUMMARY_RANKS}); its across-ranks spread and imbalance count only the ranks kept")
        notes = self.notes if note in self.notes else (*self.notes, note)
        return replace(self, epochs=tuple(epochs), notes=notes)

    def new_run(self) -> MemoryReport:
        """A copy whose next epochs form a new run (a second ``trainer.fit`` of the same callback), with a fresh
        random run id: the earlier fit's epochs are kept, not replaced. While the current run has no epoch yet
        only a missing run id is made."""
        if not any(e.run >= self.current_run for e in self.epochs):
            return self if self.current_run_id else replace(self, current_run_id=uuid.uuid4().hex)
        nxt = replace(self, current_run=max(e.run for e in self.epochs) + 1, current_run_id=uuid.uuid4().hex)
        return nxt._runs_in_range()

    def _runs_in_range(self) -> MemoryReport:
        """This report, or (when a run number reached 2**63, which the reader refuses) a copy whose runs are
        numbered 0, 1, ... in their order: the counters stay inside what :meth:`from_dict` reads."""
        runs = sorted({e.run for e in self.epochs} | {self.current_run})
        if runs[-1] < _MAX_COUNT:
            return self
        dense = {run: i for i, run in enumerate(runs)}
        epochs = tuple(replace(e, run=dense[e.run]) for e in self.epochs)
        return replace(self, epochs=epochs, current_run=dense[self.current_run])

    def _run_numbers(self, older: MemoryReport) -> dict[int, int]:
        """``{run: run in the merged report}`` for this report's runs: a run ``older`` already holds (the same
        run id, or both without one) keeps ``older``'s number; a different fit (another Trainer, another
        process) whose number ``older`` already uses gets the next free one, so its epochs join the file
        beside the earlier fit's instead of replacing them."""
        old_id = {e.run: e.run_id for e in older.epochs}
        by_id = {e.run_id: e.run for e in older.epochs if e.run_id}
        ids = {e.run: e.run_id for e in self.epochs}
        if self.current_run not in ids:
            ids[self.current_run] = self.current_run_id
        used, numbers = set(old_id), {}
        for run in sorted(ids):
            rid = ids[run]
            if rid and rid in by_id:
                numbers[run] = by_id[rid]
            elif run not in used and run not in old_id:
                numbers[run] = run
            elif run in old_id and old_id[run] == rid:
                numbers[run] = run
            else:
                numbers[run] = max(used | set(numbers.values())) + 1
            used.add(numbers[run])
        return numbers

    def with_incident(self, incident: Incident) -> MemoryReport:
        return replace(self, incidents=(*self.incidents, incident))

    def merged_with(self, older: MemoryReport) -> MemoryReport:
        """This report plus every epoch and incident of ``older`` it does not already hold.

        Used when writing over an existing ``memory_report.json``: epochs written earlier (by this run
        before a restart, or by another run in the same directory) are never lost.
        """
        numbers = self._run_numbers(older)
        mine = [replace(e, run=numbers[e.run]) for e in self.epochs]
        have = {e.key for e in mine}
        epochs = sorted([*mine, *(e for e in older.epochs if e.key not in have)], key=lambda e: e.key)
        seen = {(i.rank, i.epoch, i.step, i.error) for i in self.incidents}
        incidents = (
            *(i for i in older.incidents if (i.rank, i.epoch, i.step, i.error) not in seen),
            *self.incidents,
        )
        notes = tuple(dict.fromkeys((*older.notes, *self.notes)))
        return replace(
            self, run=self.run or older.run, notes=notes, epochs=tuple(epochs), incidents=incidents,
            current_run=numbers[self.current_run],
        )._runs_in_range()._within_caps()

    @property
    def latest(self) -> EpochReport | None:
        return self.epochs[-1] if self.epochs else None

    def _breakdowns(self) -> list[Mapping[str, int] | None]:
        """Every rank's and tracked step's component breakdowns (what says whether an optional component,
        a weight-averaging copy, is in the report)."""
        ranks = [r for e in self.epochs for r in (*e.ranks, *(x for rs in e.phases.values() for x in rs))]
        steps: list[Any] = [*ranks, *(t for r in ranks for t in r.tracked)]
        return [m for r in steps for m in (r.estimated_components, r.measured_components)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": REPORT_FORMAT_VERSION,
            "components": list(shown_components(*self._breakdowns())),
            "phases": list(PHASES),
            "run": dict(self.run),
            "current_run": self.current_run,
            **({"current_run_id": self.current_run_id} if self.current_run_id else {}),
            "notes": list(self.notes),
            "epochs": [e.to_dict() for e in self.epochs],
            "incidents": [i.to_dict() for i in self.incidents],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryReport:
        version = data.get("format_version")
        if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= REPORT_FORMAT_VERSION:
            raise ValueError(
                f"format_version={_shown(version)} is not a memory report this version can read (it reads 1 to "
                f"{REPORT_FORMAT_VERSION}); upgrade lightning-memplan for a newer one, or pass a memory_report.json"
            )
        run = data.get("run") or {}
        if not isinstance(run, Mapping):
            raise TypeError(f"run={_shown(run)} must be a JSON object")
        _plain("run", run)
        _check_size(data.get("epochs"))
        epochs = tuple(_at(f"epochs[{i}]", EpochReport.from_dict, e) for i, e in enumerate(_items("epochs", data.get("epochs"))))
        _unique("epochs (by run and epoch)", [e.key for e in epochs])
        return cls(
            run=dict(run),
            notes=tuple(str(_text(f"notes[{i}]", n)) for i, n in enumerate(_items("notes", data.get("notes")))),
            epochs=tuple(sorted(epochs, key=lambda e: e.key)),
            incidents=tuple(
                _at(f"incidents[{i}]", Incident.from_dict, x) for i, x in enumerate(_items("incidents", data.get("incidents")))
            ),
            current_run=_required("current_run", data.get("current_run", max((e.run for e in epochs), default=0))),
            current_run_id=str(_text("current_run_id", data.get("current_run_id", ""))),
        )
