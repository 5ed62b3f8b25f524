"""The planner: choose dp / ZeRO / tp / pp / cp, recompute, loss mode and micro-batch from the memory
model and the hardware, explain every choice and every rejection. Pure: no Lightning, no device query."""

from lightning_memplan.planning.budget import (
    CUDA_CONTEXT_BYTES,
    NCCL_BYTES_PER_GROUP,
    Budget,
    device_need,
    memory_budget,
)
from lightning_memplan.planning.decision import (
    Candidate,
    CheckedCandidate,
    PlanDecision,
    PlanDoesNotFitError,
    Rejection,
    Suggestion,
)
from lightning_memplan.planning.fit import LargestFit, largest_fit, max_micro_batch, max_seq_len
from lightning_memplan.planning.planner import CHANGE_COST, CHANGE_PENALTY, SIMPLICITY_MARGIN, plan
from lightning_memplan.planning.space import ALLOW_NAMES, Allow
from lightning_memplan.planning.timing import (
    TIME_MODEL_OFF,
    Layout,
    StepTime,
    StepTimeModel,
    bubble_fraction,
    bubble_overhead,
    predict_step_time,
)

__all__ = [
    "ALLOW_NAMES",
    "Allow",
    "Budget",
    "CHANGE_COST",
    "CHANGE_PENALTY",
    "SIMPLICITY_MARGIN",
    "CUDA_CONTEXT_BYTES",
    "Candidate",
    "CheckedCandidate",
    "LargestFit",
    "Layout",
    "NCCL_BYTES_PER_GROUP",
    "PlanDecision",
    "PlanDoesNotFitError",
    "Rejection",
    "StepTime",
    "StepTimeModel",
    "Suggestion",
    "TIME_MODEL_OFF",
    "bubble_fraction",
    "bubble_overhead",
    "device_need",
    "largest_fit",
    "max_micro_batch",
    "max_seq_len",
    "memory_budget",
    "plan",
    "predict_step_time",
]
