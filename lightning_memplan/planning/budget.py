"""The per-device memory budget a plan's predicted tensor peak must fit under.

``budget = memory * (1 - headroom) - cuda_context - nccl * groups - fragmentation * memory``

The memory model predicts *allocated tensor* bytes; the device also holds what no tensor accounts for.
Each such term is an explicit, documented constant so a user can see and override the arithmetic
(``plan(memory_budget=...)`` replaces the whole derivation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_memplan.hardware.spec import HardwareSpec
from lightning_memplan.model.result import readable_bytes
from lightning_memplan.model.specs import ParallelPlan

__all__ = [
    "ALLOCATOR_FRAGMENTATION_FRACTION",
    "CUDA_CONTEXT_BYTES",
    "NCCL_BYTES_PER_GROUP",
    "Budget",
    "memory_budget",
]

MiB = 2**20

#: CUDA context, loaded kernels and cuBLAS/cuDNN handles on each device. With lazy module loading
#: (CUDA >= 11.7, the default in PyTorch's CUDA 12 builds) the context is ~300-500 MiB, and the cuBLAS
#: workspace adds up to 32 MiB per stream (PyTorch docs, "CUDA semantics: cuBLAS workspaces"); seed 002
#: ("CUDA上下文本身就要占几百MB"). 768 MiB covers both with margin.
CUDA_CONTEXT_BYTES = 768 * MiB

#: NCCL buffers per communicator (process group with > 1 rank): NCCL_BUFFSIZE defaults to 4 MiB per
#: channel per peer for the Simple protocol (NCCL docs, "Environment Variables: NCCL_BUFFSIZE"), plus
#: the LL/LL128 buffers; a ring uses 2 peers and up to 16-32 channels on NVSwitch systems. 256 MiB per
#: group is the order observed with ``nvidia-smi`` after ``init_process_group`` + a first collective.
NCCL_BYTES_PER_GROUP = 256 * MiB

#: Caching-allocator fragmentation: reserved minus allocated at the peak, as a fraction of device
#: memory. Seed 002 reports ``expandable_segments:True`` cutting the peak by 5-10 % on long-sequence
#: training, i.e. fragmentation of that size without it; 5 % is the planner's default.
ALLOCATOR_FRAGMENTATION_FRACTION = 0.05


@dataclass(frozen=True, kw_only=True)
class Budget:
    """The derivation of one plan's budget, every term in bytes (``budget`` is what tensors may use)."""

    device: int
    headroom: int
    cuda_context: int
    nccl: int
    fragmentation: int
    budget: int
    explicit: bool = False

    def describe(self) -> str:
        if self.explicit:
            return f"{readable_bytes(self.budget)} (memory_budget given)"
        gib = 2**30
        terms = [("headroom", self.headroom, 1), ("CUDA context", self.cuda_context, 2), ("NCCL", self.nccl, 2),
                 ("fragmentation", self.fragmentation, 2)]
        return f"{self.budget / gib:.1f} GiB = {self.device / gib:.1f} GiB device" + "".join(
            f" - {v / gib:.{nd}f} {name}" for name, v, nd in terms if v)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("device", "headroom", "cuda_context", "nccl", "fragmentation", "budget", "explicit")}


def process_groups(plan: ParallelPlan) -> int:
    """Communicators with more than one rank a rank joins: one per parallel axis of size > 1, plus the
    dp x cp group that reduces gradients when both are > 1."""
    groups = sum(1 for n in (plan.dp, plan.tp, plan.pp, plan.cp) if n > 1)
    return groups + (1 if plan.dp > 1 and plan.cp > 1 else 0)


def memory_budget(hardware: HardwareSpec, plan: ParallelPlan, *, headroom: float, explicit: int | None = None) -> Budget:
    """The budget for ``plan`` on ``hardware`` (see the module docstring); ``explicit`` overrides it."""
    if explicit is not None:
        return Budget(device=hardware.memory_bytes, headroom=0, cuda_context=0, nccl=0, fragmentation=0,
                      budget=int(explicit), explicit=True)
    from lightning_memplan.planning.timing import is_cpu_host

    device = hardware.memory_bytes
    head = round(device * headroom)
    cpu = is_cpu_host(hardware)  # a CPU host has no CUDA context and talks gloo, not NCCL
    nccl = 0 if cpu else NCCL_BYTES_PER_GROUP * process_groups(plan)
    context = 0 if cpu else CUDA_CONTEXT_BYTES
    frag = round(device * ALLOCATOR_FRAGMENTATION_FRACTION)
    return Budget(device=device, headroom=head, cuda_context=context, nccl=nccl, fragmentation=frag,
                  budget=device - head - context - nccl - frag)
