"""The record of one checkpoint save on one rank (:attr:`EpochReport.checkpoints`) and its table rows.

A save is estimated by :func:`~lightning_memplan.model.checkpoint_estimate.estimate_checkpoint_memory` and
measured around ``trainer.save_checkpoint`` / ``fabric.save`` (``monitoring/checkpoint.py``); the report
shows both next to the training peak, so a save that is the run's peak is visible.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["CHECKPOINT_HEADERS", "CheckpointRecord", "checkpoint_rows", "peak_ratio"]

#: Columns of the checkpoint table (Markdown, terminal, HTML).
CHECKPOINT_HEADERS = ("save", "rank", "mode", "estimated peak", "measured peak", "host (est.)", "measured by")


def peak_ratio(measured: int | None, estimated: int | None) -> float | None:
    """``measured / estimated``, ``None`` when either is missing or zero (a step record's and a checkpoint
    record's ``ratio``)."""
    if not measured or not estimated:
        return None
    return measured / estimated


@dataclass(frozen=True, kw_only=True)
class CheckpointRecord:
    """One rank's figures of one checkpoint save.

    Attributes:
        rank: global rank. epoch, step: the epoch and global step of the save (``-1`` outside a fit).
        index: the save's number in the run (0 for the first).
        mode: ``"plain"``, ``"full"`` or ``"sharded"`` (``model.checkpoint_estimate.CHECKPOINT_MODES``).
        full_state_dict, cpu_offload: how the state dict was asked for.
        estimated_peak: predicted peak device tensor bytes during the save (``None``: no estimate).
        estimated_resident: the part of it alive before the save.
        estimated_host: predicted host bytes (CPU copies and serialisation buffers).
        measured_peak: measured peak tensor bytes during the save (``None``: not measured).
        measured_before: measured tensor bytes when the save started.
        measurement: ``"tensor_tracker"``, ``"cuda_allocator"`` or ``"none"``.
    """

    rank: int
    epoch: int
    step: int
    index: int = 0
    mode: str = "plain"
    full_state_dict: bool = False
    cpu_offload: bool = False
    estimated_peak: int | None = None
    estimated_resident: int | None = None
    estimated_host: int | None = None
    measured_peak: int | None = None
    measured_before: int | None = None
    measurement: str = "none"

    @property
    def ratio(self) -> float | None:
        """measured_peak / estimated_peak (:func:`peak_ratio`)."""
        return peak_ratio(self.measured_peak, self.estimated_peak)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CheckpointRecord:
        if not isinstance(data, Mapping):
            raise TypeError(f"a checkpoint record must be a JSON object, got {type(data).__name__}")

        def opt_int(key: str) -> int | None:
            value = data.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"checkpoint record {key}={value!r} must be an integer or null")
            return value

        return cls(
            rank=int(data["rank"]), epoch=int(data.get("epoch", -1)), step=int(data.get("step", -1)),
            index=int(data.get("index", 0)), mode=str(data.get("mode", "plain")),
            full_state_dict=bool(data.get("full_state_dict", False)), cpu_offload=bool(data.get("cpu_offload", False)),
            estimated_peak=opt_int("estimated_peak"), estimated_resident=opt_int("estimated_resident"),
            estimated_host=opt_int("estimated_host"), measured_peak=opt_int("measured_peak"),
            measured_before=opt_int("measured_before"), measurement=str(data.get("measurement", "none")),
        )


def checkpoint_rows(records: tuple[CheckpointRecord, ...], fmt: Any) -> list[list[str]]:
    """One row per save and rank, columns :data:`CHECKPOINT_HEADERS`; ``fmt(bytes_or_None) -> str``."""
    return [
        [f"#{r.index} (step {r.step})" if r.step >= 0 else f"#{r.index}", str(r.rank), r.mode, fmt(r.estimated_peak),
         fmt(r.measured_peak), fmt(r.estimated_host), r.measurement]
        for r in sorted(records, key=lambda r: (r.index, r.rank))
    ]
