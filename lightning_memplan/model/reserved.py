"""Reserved vs allocated on CUDA: what PyTorch's caching allocator holds beyond the live tensor bytes.

``estimate_memory`` predicts *allocated* bytes (``torch.cuda.max_memory_allocated``); trainers such as
torchtitan report *reserved* bytes (``memory_stats()["reserved_bytes.all.peak"]``). The difference is a
function of the allocation sequence, modelled here by three hardware-independent terms:

1. block rounding [CCA]: every request is rounded up to ``kMinBlockSize`` = 512 bytes; requests of at
   most ``kSmallSize`` = 1 MiB come from 2 MiB segments (``kSmallBuffer``), requests below
   ``kMinLargeAlloc`` = 10 MiB from 20 MiB segments (``kLargeBuffer``), larger ones from segments
   rounded up to ``kRoundLarge`` = 2 MiB (:func:`rounded_block_bytes`, :func:`segment_bytes`);
2. per-stream pools [CCA]: a freed block is reused only by requests on the stream it was allocated on,
   and FSDP2 allocates its all-gather outputs on an all-gather stream and each unit's reduce-scatter
   output on a reduce-scatter stream [FSDP2]; the sharded gradients are ``as_strided`` views of those
   outputs, so every unit's sharded gradient lives in the reduce-scatter pool from its reduce-scatter
   until ``zero_grad``. Those pools are reserved next to the default stream's: the default stream's
   peak (the allocated bytes less what lives in the side pools, at its own peak phase) plus each
   pool's peak over the step. With FSDP2 the sharded gradients therefore add to the reserved peak even
   where the allocated peak (the loss's backward) comes before any gradient exists;
3. the loss's segments (without ``expandable_segments``): the logits' buffers are requested in an
   order the freed blocks cannot serve (``fp32_upcast``: the e-byte logits, the fp32 copy and the
   log-probabilities in forward; two fp32 [N, V] buffers in backward, one more than the cached
   fp32 copy), so one more segment of the e-byte logits' size stays reserved
   (:func:`loss_segment_bytes`). ``expandable_segments:True`` maps pages into one growing segment per
   stream, so this term is 0 (PyTorch docs, "CUDA semantics: Optimizing memory usage with
   PYTORCH_CUDA_ALLOC_CONF").

After the step everything stays reserved (the allocator returns memory to the driver only on
``torch.cuda.empty_cache()`` or an allocation failure), so reserved after the step equals the peak.

Sources:
  [CCA]   PyTorch ``c10/cuda/CUDACachingAllocator.cpp`` (constants ``kMinBlockSize``, ``kSmallSize``,
          ``kSmallBuffer``, ``kLargeBuffer``, ``kMinLargeAlloc``, ``kRoundLarge``; ``round_size``,
          ``get_allocation_size``; blocks keyed by stream in ``BlockPool``).
  [FSDP2] PyTorch ``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py`` (``FSDPCommContext``:
          ``all_gather_stream``, ``reduce_scatter_stream``) and ``_fsdp_collectives.py``
          (``foreach_reduce``: the reduce-scatter input in ``reduce_dtype``, allocated inside
          ``torch.cuda.stream(reduce_scatter_stream)`` in torch 2.4-2.6, the versions of the torchtitan
          benchmarks; ``reduce_output`` allocated there in every version, ``new_sharded_grad =
          torch.as_strided(reduce_output, ...)`` becoming ``sharded_param.grad``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_memplan.model import low_precision, terms
from lightning_memplan.model.result import DYNAMIC_COMPONENTS, MemoryEstimate, readable_bytes
from lightning_memplan.model.sizes import low_precision_of, precision_bytes
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.validation import check_int

__all__ = [
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK_SIZE",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "ReservedEstimate",
    "ReservedMargin",
    "batch_dependent_bytes",
    "default_stream_peak_bytes",
    "fsdp_stream_pool_bytes",
    "loss_segment_bytes",
    "reserved_memory",
    "rounded_block_bytes",
    "segment_bytes",
]

MiB = 2**20
K_MIN_BLOCK_SIZE = 512  #: all sizes are rounded to at least 512 bytes [CCA]
K_SMALL_SIZE = 1 * MiB  #: largest "small" allocation [CCA]
K_SMALL_BUFFER = 2 * MiB  #: "small" allocations are packed into 2 MiB blocks [CCA]
K_LARGE_BUFFER = 20 * MiB  #: allocations between 1 and 10 MiB may use 20 MiB blocks [CCA]
K_MIN_LARGE_ALLOC = 10 * MiB  #: allocations >= 10 MiB are rounded to kRoundLarge [CCA]
K_ROUND_LARGE = 2 * MiB  #: round up large allocations to 2 MiB [CCA]


def rounded_block_bytes(nbytes: int) -> int:
    """``round_size``: the block a request of ``nbytes`` occupies, ``max(512, ceil(n / 512) * 512)`` [CCA]."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return K_MIN_BLOCK_SIZE * math.ceil(nbytes / K_MIN_BLOCK_SIZE)


def segment_bytes(nbytes: int) -> int:
    """``get_allocation_size``: the segment ``cudaMalloc`` gets when no cached block fits: 2 MiB for
    requests <= 1 MiB, 20 MiB below 10 MiB, else the request rounded up to 2 MiB [CCA]."""
    size = rounded_block_bytes(nbytes)
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * math.ceil(size / K_ROUND_LARGE)


def loss_segment_bytes(model: ModelSpec, train: TrainSpec, plan: ParallelPlan, *, expandable_segments: bool = False) -> int:
    """The extra reserved segment of a materialised-logits loss (term 3 of the module docstring).

    ``fp32_upcast`` with e-byte logits (e < 4): forward requests e*E, 4E (copy), 4E (log-probs); the
    copy and (in torchtitan's loop, ``del pred``) the e-byte logits are freed before backward, which
    requests 4E (gradient of the log-probs, served by the copy's block) and 4E (gradient of the
    logits: no free block is large enough, the e-byte block is too small) -> one new 4E segment, the
    e*E block staying cached: reserved - allocated = e*E at the backward's peak. 0 for the chunked and
    vocab-parallel losses (no [N, V] buffer), for 32-bit logits, and with ``expandable_segments``.
    """
    if expandable_segments or train.loss != "fp32_upcast":
        return 0
    e = precision_bytes(train).logits
    if e >= terms.FP32_BYTES:
        return 0
    tokens = train.micro_batch * train.seq_len // plan.cp
    return segment_bytes(tokens * model.vocab_size * e)


def _fsdp(plan: ParallelPlan) -> bool:
    return plan.zero >= 2 and plan.dp * plan.cp > 1


def fsdp_stream_pool_bytes(
    model: ModelSpec, train: TrainSpec, plan: ParallelPlan, *, reduce_bytes: int = 4, sharded_grad_bytes: int = 0
) -> dict[str, int]:
    """FSDP2's side-stream pools (term 2): ``{"all_gather": ..., "reduce_scatter": ...}``, 0 without FSDP.

    - all-gather stream: the root unit's gathered parameters (embedding + head + final norm when they are
      not wrapped per block; kept from the forward to the end of the backward) plus two blocks
      (the current and the prefetched one), in the compute dtype;
    - reduce-scatter stream: every unit's sharded gradient (``sharded_grad_bytes``, the rank's gradient
      bytes after sharding: views of the units' reduce-scatter outputs, kept until ``zero_grad``) plus
      the largest unit's reduce-scatter input in ``reduce_dtype`` (``reduce_bytes``, fp32 by default as
      in torchtitan's ``mixed_precision_reduce="float32"``); the root unit's reduce-scatter runs last
      and is the largest for Llama-size vocabularies.
    """
    if not _fsdp(plan):
        return {"all_gather": 0, "reduce_scatter": 0}
    pb = precision_bytes(train)
    block = math.ceil(terms.layer_param_count(model) / plan.tp)
    root = math.ceil((terms.embedding_param_count(model) + terms.head_param_count(model)) / plan.tp)
    largest = max(block, root)
    # quantized base weights gathered packed, float8 weights under the float8 all-gather (model/low_precision.py)
    block_saving, head_saving = low_precision.gather_saving_bytes(model, low_precision_of(train), plan, pb.compute)
    return {
        "all_gather": (root + 2 * block) * pb.compute - 2 * block_saving - head_saving,
        "reduce_scatter": largest * reduce_bytes + sharded_grad_bytes,
    }


def default_stream_peak_bytes(plan: ParallelPlan, estimate: MemoryEstimate, pooled_comm: int | None = None) -> int:
    """The default stream's peak: the largest phase of ``estimate`` less what lives in FSDP2's side
    pools in that phase (its ``comm`` buffers up to ``pooled_comm``, the in-flight collective buffers
    the side pools hold, and its gradients where they are the sharded ones: always without a pipeline;
    with one only in the optimizer phase, the stages accumulating unsharded gradients on the default
    stream until the step's reduce-scatter). ``estimate.total`` without FSDP.

    ``pooled_comm`` caps the ``comm`` taken out: the unsharded parameters a unit keeps after its
    forward (ZeRO-2, or an int ``reshard_after_forward``) are copied out of the all-gather buffer into
    storages allocated on the default stream (torch 2.13 ``_fsdp_collectives.foreach_all_gather_copy_out``
    and ``FSDPParam.alloc_all_gather_outputs``), so they stay in the default stream's count; without a
    cap every ``comm`` byte is taken out (the reserved estimate could then fall below the allocated one)."""
    if not _fsdp(plan):
        return estimate.total
    peaks = []
    for phase, comps in estimate.by_phase.items():
        side = comps.get("comm", 0)
        if pooled_comm is not None:
            side = min(side, pooled_comm)
        if plan.pp == 1 or phase == "optimizer":
            side += comps.get("grads", 0)
        peaks.append(sum(comps.values()) - side)
    return max(peaks)


@dataclass(frozen=True, kw_only=True)
class ReservedEstimate:
    """Predicted peak reserved bytes of one rank and its terms (all integer bytes).

    ``reserved = default_stream_peak + all_gather_pool + reduce_scatter_pool + loss_segment + rounding
    + measured_margin`` (the communication buffers and sharded gradients the allocated estimate counts live
    in FSDP2's side-stream pools, so the default stream's own peak is added to the pools' peaks).
    ``measured_margin`` is 0 in the model; a need built from a :class:`ReservedMargin` (the allocator's
    margin as a run measured it, ``planning.fit``'s ``reserved_margin=``) has it instead of the modelled
    terms: ``default_stream_peak == allocated`` and the pools, loss segment and rounding 0.
    """

    allocated: int
    default_stream_peak: int
    all_gather_pool: int
    reduce_scatter_pool: int
    loss_segment: int
    rounding: int
    expandable_segments: bool
    measured_margin: int = 0

    @property
    def reserved(self) -> int:
        return (self.default_stream_peak + self.all_gather_pool + self.reduce_scatter_pool
                + self.loss_segment + self.rounding + self.measured_margin)

    @property
    def overhead(self) -> int:
        """reserved - allocated."""
        return self.reserved - self.allocated


def reserved_memory(
    model: ModelSpec,
    train: TrainSpec,
    plan: ParallelPlan,
    estimate: MemoryEstimate,
    *,
    expandable_segments: bool = False,
    reduce_bytes: int = 4,
) -> ReservedEstimate:
    """Reserved bytes for ``estimate`` (from :func:`~lightning_memplan.model.estimate.estimate_memory`
    with the same specs). ``rounding``: each block's saved tensors are at least 512-byte blocks; the
    large ones (>= 10 MiB) are rounded to 2 MiB: half a 2 MiB unit per tensor on average, counted for
    the per-block saved tensors (about 8 per block and micro-batch) and the model-state tensors."""
    if not isinstance(estimate, MemoryEstimate):
        raise TypeError(f"estimate={estimate!r} must be a MemoryEstimate from estimate_memory()")
    sharded_grads = estimate.by_phase.get("optimizer", {}).get("grads", 0)  # every gradient, sharded
    pools = fsdp_stream_pool_bytes(model, train, plan, reduce_bytes=reduce_bytes, sharded_grad_bytes=sharded_grads)
    tensors = model.n_layers // plan.pp * (8 + 9 * 3)  # saved tensors + (param, grad, 2 states) x 9 weights
    rounding = 0 if expandable_segments else tensors * K_ROUND_LARGE // 2
    return ReservedEstimate(
        allocated=estimate.total,
        default_stream_peak=default_stream_peak_bytes(
            plan, estimate, pooled_comm=pools["all_gather"] + pools["reduce_scatter"] - sharded_grads
        ),
        all_gather_pool=pools["all_gather"],
        reduce_scatter_pool=pools["reduce_scatter"],
        loss_segment=loss_segment_bytes(model, train, plan, expandable_segments=expandable_segments),
        rounding=rounding,
        expandable_segments=expandable_segments,
    )


def batch_dependent_bytes(estimate: MemoryEstimate) -> int:
    """The estimate's batch-dependent bytes at its peak: the sum of its
    :data:`~lightning_memplan.model.result.DYNAMIC_COMPONENTS` (activations, attention, logits, workspace,
    other), what grows with ``b`` and ``s`` while the model states stay."""
    return sum(getattr(estimate, name) for name in DYNAMIC_COMPONENTS)


_MAX_BYTES = 2**63 - 1  # what the allocators count in (a signed 64-bit integer)


@dataclass(frozen=True, kw_only=True)
class ReservedMargin:
    """What PyTorch's CUDA caching allocator reserved beyond the allocated bytes, as a run measured it, and
    the rule that carries it to another batch shape (``planning.fit``'s ``reserved_margin=``).

    Measured (:func:`lightning_memplan.report.margin.measured_reserved_margin`): ``overhead = reserved -
    allocated`` of the run's worst CUDA rank, both the allocator's own peak counters
    (``max_memory_reserved``, ``max_memory_allocated``) at the shape ``micro_batch x seq_len`` it ran.
    Given by hand (an int ``reserved_margin=``): ``overhead`` bytes at every shape (no reference shape).

    Why bytes carried by the batch-dependent bytes, not a ratio of the totals. The overhead is made of
    segments that do not depend on the batch (the model states' block rounding, FSDP2's side-stream
    pools) and segments that grow with it (the loss's extra ``[N, V]`` segment, the rounding and split
    blocks of the saved activations): ``overhead = c0 + c1 * D`` with ``c0, c1 >= 0``, ``D`` the
    estimate's :func:`batch_dependent_bytes`. The margin at a candidate shape is

        ``margin = overhead * max(1, D(candidate) / D(reference))`` (rounded up to a byte)

    with both ``D`` estimated from the same specs (the search's own). For a larger shape (``k = D /
    D_ref >= 1``) this is ``c0 k + c1 D >= c0 + c1 D``, never below the true overhead; at a smaller one
    the measured bytes stay (the overhead is non-decreasing in the batch, so they bound it too). A ratio
    ``reserved / allocated`` applied to the whole allocation would count the states' share as growing with
    the batch, yet under-count a batch-driven overhead where large states dilute the ratio. The margin is
    the allocator's alone: it is added to the estimate's allocated bytes, whose own error (measured /
    estimated) is the calibration's business. With ``expandable_segments:True`` the run's allocator maps
    pages into growing segments and the measured overhead already shows it (no loss segment, little
    rounding); a margin measured under one setting does not describe the other (``planning.fit`` refuses
    the mix when the margin records its setting).

    Attributes:
        overhead: reserved - allocated bytes at the reference shape (>= 0).
        micro_batch, seq_len: the reference shape (one micro-batch, as :class:`TrainSpec` counts it);
            both ``None`` for a fixed byte margin.
        allocated, reserved: the measured peaks the overhead came from (``None`` when given by hand).
        expandable_segments: the measured run's allocator setting (``None``: not recorded).
        run, epoch, rank: where it was measured (``None`` when given by hand).
    """

    overhead: int
    micro_batch: int | None = None
    seq_len: int | None = None
    allocated: int | None = None
    reserved: int | None = None
    expandable_segments: bool | None = None
    run: int | None = None
    epoch: int | None = None
    rank: int | None = None

    def __post_init__(self) -> None:
        fix = "use measured_reserved_margin(report) or ReservedMargin(overhead=bytes)"
        object.__setattr__(self, "overhead", check_int("ReservedMargin.overhead", self.overhead, minimum=0,
                                                        maximum=_MAX_BYTES, hint=fix))
        if (self.micro_batch is None) != (self.seq_len is None):
            raise ValueError(f"ReservedMargin(micro_batch={self.micro_batch!r}, seq_len={self.seq_len!r}): give "
                             "both (the shape the overhead was measured at) or neither (a fixed byte margin)")
        for name in ("micro_batch", "seq_len", "allocated", "reserved", "run", "epoch", "rank"):
            value = getattr(self, name)
            if value is not None:
                low = 1 if name in ("micro_batch", "seq_len") else 0
                object.__setattr__(self, name, check_int(f"ReservedMargin.{name}", value, minimum=low,
                                                         maximum=_MAX_BYTES, hint=fix))
        if self.expandable_segments is not None and not isinstance(self.expandable_segments, bool):
            raise TypeError(f"ReservedMargin.expandable_segments={self.expandable_segments!r:.80} must be a bool "
                            "or None")

    @property
    def ratio(self) -> float | None:
        """Measured reserved / allocated (``None`` when given by hand or nothing was allocated)."""
        if self.allocated is None or self.reserved is None or self.allocated <= 0:
            return None
        return self.reserved / self.allocated

    def bytes_at(self, dynamic: int, reference_dynamic: int | None) -> int:
        """The margin at a shape whose estimate has ``dynamic`` batch-dependent bytes, the reference shape's
        being ``reference_dynamic`` (the class docstring's rule; ``None`` or a fixed margin: ``overhead``)."""
        if reference_dynamic is None or self.micro_batch is None or reference_dynamic <= 0 \
                or dynamic <= reference_dynamic:
            return self.overhead
        return -(-self.overhead * dynamic // reference_dynamic)

    def need(self, estimate: MemoryEstimate, reference_dynamic: int | None, *,
             expandable_segments: bool = False) -> ReservedEstimate:
        """The device need of ``estimate`` with this margin: its allocated bytes plus :meth:`bytes_at`."""
        total = estimate.total
        return ReservedEstimate(
            allocated=total, default_stream_peak=total, all_gather_pool=0, reduce_scatter_pool=0, loss_segment=0,
            rounding=0, expandable_segments=expandable_segments,
            measured_margin=self.bytes_at(batch_dependent_bytes(estimate), reference_dynamic),
        )

    def describe(self) -> str:
        """``"1.2 GiB (9.5 % of 12.6 GiB allocated, at 8 x 2048, rank 0, epoch 3)"``, or ``"1.2 GiB"``."""
        text = readable_bytes(self.overhead)
        where = []
        if self.ratio is not None and self.allocated is not None:
            where.append(f"{100 * (self.ratio - 1):.1f} % of {readable_bytes(self.allocated)} allocated")
        if self.micro_batch is not None:
            where.append(f"at {self.micro_batch} x {self.seq_len}")
        where += [f"{name} {getattr(self, name)}" for name in ("rank", "epoch") if getattr(self, name) is not None]
        return f"{text} ({', '.join(where)})" if where else text

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _MARGIN_FIELDS}

    @classmethod
    def from_dict(cls, data: Any) -> ReservedMargin:
        if not isinstance(data, dict):
            raise TypeError(f"ReservedMargin.from_dict(data={data!r:.80}): pass what ReservedMargin.to_dict() returned")
        return cls(**{name: data[name] for name in _MARGIN_FIELDS if name in data})


_MARGIN_FIELDS = ("overhead", "micro_batch", "seq_len", "allocated", "reserved", "expandable_segments", "run", "epoch",
                  "rank")
