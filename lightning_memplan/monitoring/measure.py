"""Per-step memory probes for :class:`~lightning_memplan.callbacks.MemoryPlanCallback`, one per backend.

A probe sees one training step as a sequence of phases opened by Lightning's hooks: ``forward``
(``on_train_batch_start`` .. ``on_before_backward``), ``backward`` (.. ``on_before_optimizer_step``,
including ``on_after_backward`` and gradient clipping) and ``optimizer`` (.. ``on_train_batch_end``).

- CUDA: the caching allocator's peak counters, reset at every phase boundary
  (``torch.cuda.reset_peak_memory_stats``), give exact per-phase peaks of allocated and reserved
  bytes; ``torch.cuda.mem_get_info`` adds what other processes and the CUDA context hold.
- MPS: ``torch.mps`` has no peak counters; current allocated and driver-allocated bytes are sampled at
  each boundary (a lower bound of the true peak).
- CPU: no allocator statistics exist, so every step reads the process's resident set size from
  ``/proc/self/statm`` (no psutil dependency; one small file read per boundary). Tensor-level bytes on
  CPU come from the tensor tracker on sampled steps, not from here.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_memplan.model.result import PHASES

__all__ = ["PhaseProbe", "ProbeReading", "make_probe", "machine_ram", "read_rss"]

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_STATM = "/proc/self/statm"


_statm_fd: int | None = None  # "/proc/self" is resolved when the file is opened


def _forget_statm() -> None:
    """A forked child's inherited descriptor still describes the parent: the child opens its own."""
    global _statm_fd
    _statm_fd = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_statm)


def read_rss() -> int | None:
    """Resident set size of this process in bytes from ``/proc/self/statm`` (field 2, in pages);
    ``None`` where ``/proc`` does not exist (macOS, Windows).

    The file stays open and is re-read with ``pread`` at offset 0 (~2 us instead of ~40 us for
    open/read/close; it is read at every phase boundary of every step). A forked child reopens it
    (``os.register_at_fork``), so no ``getpid`` call is needed per read (a system call: 10 us in a sandbox).
    """
    global _statm_fd
    try:
        if _statm_fd is None:
            _statm_fd = os.open(_STATM, os.O_RDONLY)
        return int(os.pread(_statm_fd, 256, 0).split()[1]) * _PAGE_SIZE
    except (OSError, IndexError, ValueError):
        return None


@functools.lru_cache(maxsize=1)
def machine_ram() -> int | None:
    """Physical RAM of the machine in bytes (``SC_PHYS_PAGES * SC_PAGE_SIZE``), ``None`` if unknown; read
    once per process (it is asked at every step's end)."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(_PAGE_SIZE)
    except (AttributeError, ValueError, OSError):
        return None


@dataclass(kw_only=True)
class ProbeReading:
    """What a probe measured over one step.

    Attributes:
        measured_peak: peak allocated tensor bytes (CUDA exact, MPS sampled; ``None`` on CPU).
        phase_peaks: ``{phase: bytes}`` of the same quantity per phase.
        reserved: peak reserved bytes (CUDA), driver-allocated (MPS), or peak sampled RSS (CPU).
        unavailable: bytes of the device that the allocator cannot use because other processes or the
            CUDA context hold them (CUDA only; 0 elsewhere).
        device_memory: total bytes of the device (RAM on CPU); ``None`` if unknown.
    """

    measured_peak: int | None = None
    phase_peaks: dict[str, int] = field(default_factory=dict)
    reserved: int | None = None
    unavailable: int = 0
    device_memory: int | None = None


class PhaseProbe:
    """Base probe: tracks the open phase; subclasses sample the backend's counters at each boundary."""

    kind = "cpu"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._phase: str | None = None
        self._reading = ProbeReading()

    # hooks ---------------------------------------------------------------------------------------
    def start_step(self) -> None:
        self._reading = ProbeReading()
        self._reset()
        self._phase = PHASES[0]

    def enter_phase(self, phase: str) -> None:
        """Close the open phase (recording its peak) and open ``phase``."""
        self._close()
        self._phase = phase

    def end_step(self) -> ProbeReading:
        self._close()
        self._phase = None
        self._finish(self._reading)
        return self._reading

    @property
    def phase(self) -> str | None:
        return self._phase

    # backend specifics -------------------------------------------------------------------------
    def _reset(self) -> None:
        """Reset peak counters at a phase boundary."""

    def _sample(self) -> tuple[int | None, int | None]:
        """``(allocated_peak_since_reset, reserved_peak_since_reset)``."""
        return None, read_rss()

    def _finish(self, reading: ProbeReading) -> None:
        reading.device_memory = machine_ram()

    def allocator_summary(self) -> dict[str, Any]:
        """State of the allocator now, for the out-of-memory record."""
        return {"rss": read_rss(), "machine_ram": machine_ram()}

    def _close(self) -> None:
        if self._phase is None:
            return
        allocated, reserved = self._sample()
        r = self._reading
        if allocated is not None:
            r.phase_peaks[self._phase] = max(r.phase_peaks.get(self._phase, 0), allocated)
            r.measured_peak = max(r.measured_peak or 0, allocated)
        if reserved is not None:
            r.reserved = max(r.reserved or 0, reserved)
        self._reset()


class CudaProbe(PhaseProbe):
    """Exact per-phase peaks from the CUDA caching allocator."""

    kind = "cuda"

    def _reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def _sample(self) -> tuple[int | None, int | None]:
        return torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)

    def _finish(self, reading: ProbeReading) -> None:
        free, total = torch.cuda.mem_get_info(self.device)
        reserved_now = torch.cuda.memory_reserved(self.device)
        # What this process's allocator does not hold but is not free either: the CUDA context, NCCL
        # buffers, other processes on the same GPU.
        reading.unavailable = max(0, total - free - reserved_now)
        reading.device_memory = int(total)

    def allocator_summary(self) -> dict[str, Any]:
        stats = torch.cuda.memory_stats(self.device)
        keep = (
            "allocated_bytes.all.current",
            "allocated_bytes.all.peak",
            "reserved_bytes.all.current",
            "reserved_bytes.all.peak",
            "inactive_split_bytes.all.current",
            "num_ooms",
            "num_alloc_retries",
        )
        summary: dict[str, Any] = {k: int(stats.get(k, 0)) for k in keep}
        free, total = torch.cuda.mem_get_info(self.device)
        summary.update(free=int(free), total=int(total))
        summary["summary"] = torch.cuda.memory_summary(self.device, abbreviated=True)
        return summary


class MpsProbe(PhaseProbe):
    """Sampled current allocations on Apple silicon (``torch.mps`` has no peak counters)."""

    kind = "mps"

    def _sample(self) -> tuple[int | None, int | None]:
        return int(torch.mps.current_allocated_memory()), int(torch.mps.driver_allocated_memory())

    def _finish(self, reading: ProbeReading) -> None:
        reading.device_memory = int(torch.mps.recommended_max_memory())

    def allocator_summary(self) -> dict[str, Any]:
        return {
            "current_allocated": int(torch.mps.current_allocated_memory()),
            "driver_allocated": int(torch.mps.driver_allocated_memory()),
            "recommended_max": int(torch.mps.recommended_max_memory()),
        }


def make_probe(device: torch.device) -> PhaseProbe:
    """The probe for ``device``'s type: CUDA, MPS, or the RSS probe for everything else."""
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaProbe(device)
    if device.type == "mps" and torch.backends.mps.is_available():
        return MpsProbe(device)
    return PhaseProbe(device)
