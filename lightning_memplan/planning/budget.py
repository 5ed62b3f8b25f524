"""The per-device memory budget, and what of a plan must fit under it.

``budget = memory * (1 - headroom) - cuda_context - nccl * groups``

What must fit (:func:`device_need`): on CUDA the modelled peak *reserved* bytes of PyTorch's caching
allocator (:func:`lightning_memplan.model.reserved.reserved_memory`: block rounding, FSDP2's side-stream
pools, the loss's extra segment, ``expandable_segments``), since the allocator holds its cached segments
whether or not a tensor uses them; on a CPU step (no caching allocator) reserved == allocated, the
estimate's ``total``. The device also holds what no tensor accounts for (CUDA context, NCCL buffers):
each such term is an explicit, documented constant so a user can see and override the arithmetic
(``plan(memory_budget=...)`` replaces the whole derivation; the need is compared with it the same way).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_memplan.hardware.spec import HardwareSpec
from lightning_memplan.model.reserved import ReservedEstimate, reserved_memory
from lightning_memplan.model.result import MemoryEstimate, readable_bytes
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "NCCL_BYTES_PER_GROUP",
    "Budget",
    "caching_allocator_applies",
    "device_need",
    "memory_budget",
    "need_text",
]

MiB = 2**20

#: CUDA context, loaded kernels and cuBLAS/cuDNN handles on each device. With lazy module loading
#: (CUDA >= 11.7, the default in PyTorch's CUDA 12 builds) the context is ~300-500 MiB, and the cuBLAS
#: workspace adds up to 32 MiB per stream (PyTorch docs, "CUDA semantics: cuBLAS workspaces"; CUDA
#: C++ Programming Guide, "Lazy Loading"). 768 MiB covers both with margin.
CUDA_CONTEXT_BYTES = 768 * MiB

#: NCCL buffers per communicator (process group with > 1 rank): NCCL_BUFFSIZE defaults to 4 MiB per
#: channel per peer for the Simple protocol (NCCL docs, "Environment Variables: NCCL_BUFFSIZE"), plus
#: the LL/LL128 buffers; a ring uses 2 peers and up to 16-32 channels on NVSwitch systems. 256 MiB per
#: group is the order observed with ``nvidia-smi`` after ``init_process_group`` + a first collective.
NCCL_BYTES_PER_GROUP = 256 * MiB


@dataclass(frozen=True, kw_only=True)
class Budget:
    """The derivation of one plan's budget, every term in bytes (``budget`` is what the allocator may
    reserve: the plan's :func:`device_need` must not exceed it)."""

    device: int
    headroom: int
    cuda_context: int
    nccl: int
    budget: int
    explicit: bool = False

    def describe(self) -> str:
        if self.explicit:
            return f"{readable_bytes(self.budget)} (memory_budget given)"
        gib = 2**30
        terms = [("headroom", self.headroom, 1), ("CUDA context", self.cuda_context, 2), ("NCCL", self.nccl, 2)]
        return f"{self.budget / gib:.1f} GiB = {self.device / gib:.1f} GiB device" + "".join(
            f" - {v / gib:.{nd}f} {name}" for name, v, nd in terms if v)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _BUDGET_FIELDS}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Budget:
        """Inverse of :meth:`to_dict`; a decision saved before the fit used the reserved bytes also has a
        ``fragmentation`` term (a flat 5 % of the device), already subtracted from its ``budget``: dropped."""
        return cls(**{k: data[k] for k in _BUDGET_FIELDS if k in data})


_BUDGET_FIELDS = ("device", "headroom", "cuda_context", "nccl", "budget", "explicit")


def process_groups(plan: ParallelPlan) -> int:
    """Communicators with more than one rank a rank joins: one per parallel axis of size > 1, plus the
    dp x cp group that reduces gradients when both are > 1."""
    groups = sum(1 for n in (plan.dp, plan.tp, plan.pp, plan.cp) if n > 1)
    return groups + (1 if plan.dp > 1 and plan.cp > 1 else 0)


def memory_budget(hardware: HardwareSpec | None, plan: ParallelPlan, *, headroom: float,
                  explicit: int | None = None) -> Budget:
    """The budget for ``plan`` on ``hardware`` (see the module docstring); ``explicit`` overrides it
    (then ``hardware`` may be ``None``: the device size is only shown, taken as the budget itself)."""
    if explicit is not None:
        device = hardware.memory_bytes if hardware is not None else int(explicit)
        return Budget(device=device, headroom=0, cuda_context=0, nccl=0, budget=int(explicit), explicit=True)
    if hardware is None:
        raise ValueError("hardware=None needs an explicit memory budget; pass memory_budget= (bytes) or a HardwareSpec")
    from lightning_memplan.planning.timing import is_cpu_host

    device = hardware.memory_bytes
    head = round(device * headroom)
    cpu = is_cpu_host(hardware)  # a CPU host has no CUDA context and talks gloo, not NCCL
    nccl = 0 if cpu else NCCL_BYTES_PER_GROUP * process_groups(plan)
    context = 0 if cpu else CUDA_CONTEXT_BYTES
    return Budget(device=device, headroom=head, cuda_context=context, nccl=nccl, budget=device - head - context - nccl)


def caching_allocator_applies(hardware: HardwareSpec | None, train: TrainSpec) -> bool:
    """Whether PyTorch's CUDA caching allocator holds the step's tensors: a ``"cuda"`` step on a host
    that is not :func:`~lightning_memplan.planning.timing.is_cpu_host` (``hardware=None``: the step's
    ``train.device`` alone decides)."""
    from lightning_memplan.planning.timing import is_cpu_host

    return train.device == "cuda" and (hardware is None or not is_cpu_host(hardware))


def device_need(
    model: ModelSpec, train: TrainSpec, plan: ParallelPlan, estimate: MemoryEstimate, hardware: HardwareSpec | None,
    *, expandable_segments: bool = False,
) -> ReservedEstimate:
    """What ``plan`` needs of the device's memory, its ``.reserved`` compared with :func:`memory_budget`:
    on CUDA the caching allocator's modelled peak reserved bytes of ``estimate``
    (:func:`~lightning_memplan.model.reserved.reserved_memory`, ``.allocated`` = ``estimate.total``);
    without a caching allocator (a CPU step) the allocated bytes themselves (every term 0)."""
    if caching_allocator_applies(hardware, train):
        return reserved_memory(model, train, plan, estimate, expandable_segments=expandable_segments)
    total = estimate.total
    return ReservedEstimate(allocated=total, default_stream_peak=total, all_gather_pool=0, reduce_scatter_pool=0,
                            loss_segment=0, rounding=0, expandable_segments=expandable_segments)


def need_text(need: ReservedEstimate) -> str:
    """``"81.4 GiB reserved (68.0 GiB allocated)"`` on CUDA, ``"68.0 GiB"`` where reserved == allocated."""
    if need.reserved == need.allocated:
        return readable_bytes(need.allocated)
    return f"{readable_bytes(need.reserved)} reserved ({readable_bytes(need.allocated)} allocated)"
