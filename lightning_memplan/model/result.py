"""Outputs of the memory model: :class:`MemoryEstimate` (bytes per component on one rank) and
:class:`Calibration` (per-model coefficients fitted from traced steps).

Component names line up with what the trackers measure (as PyTorch's ``torch/distributed/_tools/mem_tracker.py``
names its categories), so an estimate and a
measurement compare field by field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "COMPONENTS",
    "DYNAMIC_COMPONENTS",
    "OPTIONAL_COMPONENTS",
    "PHASES",
    "Calibration",
    "MemoryEstimate",
    "readable_bytes",
    "shown_components",
    "trim_optional",
]

#: Every component, in report order.
COMPONENTS: tuple[str, ...] = (
    "params",  # parameter storage held by this rank (its shard under ZeRO-3)
    "grads",  # gradient storage (.grad, or FSDP's sharded grads)
    "optimizer",  # optimizer states (Adam's exp_avg / exp_avg_sq, momentum buffers, step counters)
    "master",  # fp32 master copy of low-precision parameters
    "activations",  # tensors saved for backward, except attention scores and logits
    "attention",  # materialised [b, a, s, s] attention scores / probabilities / dropout masks
    "logits",  # [b, s, V] logits, their fp32 copies, softmax and loss buffers and logits' gradient
    "comm",  # all-gathered parameter units, reduce-scatter / all-reduce buckets, pipeline p2p buffers
    "workspace",  # transient op temporaries: optimizer foreach temporaries, matmul outputs in flight
    "other",  # autocast's low-precision weight copies, buffers, anything not above
    "averaged",  # weight-averaging copies (SWA, EMA: torch.optim.swa_utils.AveragedModel) of params and buffers
)
#: Components that appear in a breakdown only when they hold bytes (``to_dict``, :meth:`MemoryEstimate.
#: components`, the report's tables and metrics): few runs keep a weight-averaging copy, and estimates,
#: records and reports without one keep the keys they always had.
OPTIONAL_COMPONENTS: frozenset[str] = frozenset({"averaged"})
#: Components that scale with the batch shape (fitted by :class:`Calibration`).
DYNAMIC_COMPONENTS: tuple[str, ...] = ("activations", "attention", "logits", "workspace", "other")
#: Phases of one training step, in order.
PHASES: tuple[str, ...] = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted allocated-tensor bytes on one rank at the peak of a training step.

    The component fields are the bytes of each component *live at the peak moment*; they add up to
    :attr:`total`. Components not live at that moment are 0 there (logits are freed before the
    optimizer step; the optimizer step's temporaries do not exist in forward). :attr:`by_phase` holds
    the same breakdown at the peak of each phase, so a measurement per phase compares too.

    Attributes:
        params ... other: integer bytes per component at the peak (see :data:`COMPONENTS`).
        averaged: bytes of the weight-averaging copies the run keeps on this device for the whole step
            (Lightning's ``StochasticWeightAveraging``, ``WeightAveraging``/``EMAWeightAveraging``, a
            ``torch.optim.swa_utils.AveragedModel``): its parameters and buffers, from the moment the copy
            is on the device (:meth:`with_averaged`). 0 without one, and then left out of
            :meth:`components`, :meth:`to_dict` and ``by_phase`` (:data:`OPTIONAL_COMPONENTS`).
        peak_phase: ``"forward"``, ``"backward"`` or ``"optimizer"``.
        rank: the global rank this estimate is for.
        stage: its pipeline stage (0 without pipeline parallelism).
        by_phase: ``{phase: {component: bytes}}`` at each phase's own peak.
        details: named sub-terms (e.g. ``"autocast_weight_copies"``, ``"inflight_microbatches"``),
            for reports; informational, not added to the total.
        source: which path produced it: ``"analytic"`` (the hand-written terms), ``"calibrated"``
            (dynamic terms fitted from a traced step), ``"hf_trace"`` (config-only, traced from the
            real Hugging Face class: ``tracking/hf_trace.py``), ``"traced"`` (:func:`trace_memory`) or
            ``"measured"``.
        host: bytes this rank keeps in *host* (CPU) memory for the step: what DeepSpeed's ZeRO-Offload
            moves there (``TrainSpec(framework="deepspeed", offload=...)``: fp32 master weights, optimizer
            states, gradient partitions, 16-bit parameter partitions and their staging buffers; the parts
            are ``details["host_params"]``, ``"host_grads"``, ``"host_optimizer"``, ``"host_master"``,
            ``"host_buffers"``), or FSDP2's offloads (``TrainSpec(offload="params")``: CPUOffloadPolicy's
            sharded parameters, gradients, optimizer states and the CPU step's temporaries;
            ``offload_activations=True``: ``details["host_activations"]``, what ``save_on_cpu`` packs;
            ``details["host_pinned"]`` the page-locked part, ``"offload_h2d_bytes"``/``"offload_d2h_bytes"``
            the copies per step; ``lightning_memplan.model.offload``). An upper bound of what is on the host
            at once (every part counted for the whole step). Not part of :attr:`total`, which is device
            memory. 0 without offload.
    """

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    master: int = 0
    activations: int = 0
    attention: int = 0
    logits: int = 0
    comm: int = 0
    workspace: int = 0
    other: int = 0
    averaged: int = 0
    peak_phase: str = field(default="forward", kw_only=True)
    rank: int = field(default=0, kw_only=True)
    stage: int = field(default=0, kw_only=True)
    by_phase: Mapping[str, Mapping[str, int]] = field(default_factory=dict, kw_only=True)
    details: Mapping[str, int] = field(default_factory=dict, kw_only=True)
    source: str = field(default="analytic", kw_only=True)
    host: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        for name in (*COMPONENTS, "host"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"MemoryEstimate.{name}={value!r} must be an int number of bytes")
            if value < 0:
                raise ValueError(f"MemoryEstimate.{name}={value!r} must be >= 0 bytes")
        if self.peak_phase not in PHASES:
            raise ValueError(f"peak_phase={self.peak_phase!r} must be one of {PHASES}")
        if any(not c.get(name) and name in c for c in self.by_phase.values() for name in OPTIONAL_COMPONENTS):
            # a phase breakdown built over COMPONENTS holds "averaged": 0; dropped, as components() drops it
            object.__setattr__(self, "by_phase", {p: trim_optional(c) for p, c in self.by_phase.items()})

    @property
    def total(self) -> int:
        """Predicted peak of allocated tensor bytes on this rank (sum of the components at the peak)."""
        return sum(getattr(self, name) for name in COMPONENTS)

    @property
    def model_states(self) -> int:
        """params + grads + optimizer + master at the peak (the '16N' part)."""
        return self.params + self.grads + self.optimizer + self.master

    def components(self) -> dict[str, int]:
        """``{component: bytes}`` at the peak, in report order (an :data:`OPTIONAL_COMPONENTS` entry only
        when it holds bytes)."""
        return trim_optional({name: getattr(self, name) for name in COMPONENTS})

    def with_averaged(self, nbytes: int) -> MemoryEstimate:
        """This estimate with ``nbytes`` of weight-averaging copies (:attr:`averaged`) alive in every phase:
        a copy of the weights is made before the step and kept for the whole fit, so it adds the same
        bytes to each phase's peak and to the step's (the peak phase does not move)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes={nbytes!r} must be a non-negative int of bytes")
        if nbytes == self.averaged:
            return self
        delta = nbytes - self.averaged
        by_phase = {p: {**c, "averaged": int(c.get("averaged", 0)) + delta} for p, c in self.by_phase.items()}
        return replace(self, averaged=nbytes, by_phase=by_phase)

    def phase_total(self, phase: str) -> int:
        """Peak bytes of one phase (``"forward"``, ``"backward"``, ``"optimizer"``)."""
        if phase not in PHASES:
            raise ValueError(f"phase={phase!r} must be one of {PHASES}")
        return sum(self.by_phase.get(phase, {}).values())

    def largest_component(self) -> str:
        """Name of the largest component at the peak."""
        comps = self.components()
        return max(comps, key=lambda name: comps[name])

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON; ``"host"`` only when there are host bytes and ``"averaged"`` only when a weight-
        averaging copy exists (so estimates without offload or averaging keep the keys they always had)."""
        out = {
            **self.components(),
            "total": self.total,
            "peak_phase": self.peak_phase,
            "rank": self.rank,
            "stage": self.stage,
            "by_phase": {p: trim_optional(c) for p, c in self.by_phase.items()},
            "details": dict(self.details),
            "source": self.source,
        }
        if self.host:
            out["host"] = self.host
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryEstimate:
        kwargs: dict[str, Any] = {name: int(data.get(name, 0)) for name in COMPONENTS}
        return cls(
            **kwargs,
            peak_phase=data.get("peak_phase", "forward"),
            rank=int(data.get("rank", 0)),
            stage=int(data.get("stage", 0)),
            by_phase={p: {k: int(v) for k, v in c.items()} for p, c in data.get("by_phase", {}).items()},
            details={k: int(v) for k, v in data.get("details", {}).items()},
            source=data.get("source", "analytic"),
            host=int(data.get("host", 0)),
        )


@dataclass(frozen=True)
class Calibration:
    """Per-model coefficients of the batch-dependent components, fitted from traced steps.

    For each phase and each dynamic component, ``bytes = c0 + c1 * (b*s) + c2 * (b*s^2)``: c1 is
    bytes per token (activations, logits), c2 bytes per token x sequence position (materialised
    attention scores), c0 what does not scale with the batch (autocast weight copies, temporaries).
    Fitted on one rank with no model parallelism; :func:`estimate_memory` scales it to a plan.

    Attributes:
        coefficients: ``{phase: {component: (c0, c1, c2)}}``.
        traced_shapes: the ``(micro_batch, seq_len)`` pairs it was fitted from.
        precision: the precision string the trace ran under (coefficients depend on it).
        n_params: parameters of the traced module.
        quantized: the traced module held bitsandbytes quantized weights, so its backward already holds
            their rebuilt weights (``MatMul4Bit.backward`` calls ``dequantize_4bit``, an operator the trace
            sees; bitsandbytes 0.50.2 ``autograd/_functions.py``): the estimate does not add that transient
            again (``model/activations.low_precision_points``).
    """

    coefficients: Mapping[str, Mapping[str, tuple[float, float, float]]]
    traced_shapes: tuple[tuple[int, int], ...] = ()
    precision: str = "32-true"
    n_params: int = 0
    quantized: bool = False

    def bytes_for(self, phase: str, component: str, micro_batch: int, seq_len: int) -> int:
        """Fitted bytes of ``component`` at the peak of ``phase`` for a (b, s) batch (never < 0)."""
        c0, c1, c2 = self.coefficients.get(phase, {}).get(component, (0.0, 0.0, 0.0))
        tokens = micro_batch * seq_len
        return max(0, round(c0 + c1 * tokens + c2 * tokens * seq_len))

    def to_dict(self) -> dict[str, Any]:
        return {
            "coefficients": {p: {c: list(v) for c, v in comps.items() if any(v) or c not in OPTIONAL_COMPONENTS}
                             for p, comps in self.coefficients.items()},
            "traced_shapes": [list(s) for s in self.traced_shapes],
            "precision": self.precision,
            "n_params": self.n_params,
            **({"quantized": True} if self.quantized else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        return cls(
            coefficients={
                p: {c: tuple(float(x) for x in v) for c, v in comps.items()}  # type: ignore[misc]
                for p, comps in data["coefficients"].items()
            },
            traced_shapes=tuple(tuple(int(x) for x in s) for s in data.get("traced_shapes", ())),  # type: ignore[misc]
            precision=data.get("precision", "32-true"),
            n_params=int(data.get("n_params", 0)),
            quantized=data.get("quantized", False) is True,
        )


def trim_optional(components: Mapping[str, int]) -> dict[str, int]:
    """``components`` without the :data:`OPTIONAL_COMPONENTS` entries that hold no bytes."""
    return {k: v for k, v in components.items() if v or k not in OPTIONAL_COMPONENTS}


def shown_components(*breakdowns: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The :data:`COMPONENTS` a table or a picture of ``breakdowns`` shows, in report order: every
    component except an :data:`OPTIONAL_COMPONENTS` one that no breakdown holds bytes of."""
    held = {k for b in breakdowns if b for k, v in b.items() if v}
    return tuple(c for c in COMPONENTS if c not in OPTIONAL_COMPONENTS or c in held)


def readable_bytes(n: int | float) -> str:
    """``n`` bytes for a sentence: GiB from 1 GiB up, else MiB, KiB or bytes, one decimal (so a 50 MiB
    budget does not read "0.0 GiB")."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
