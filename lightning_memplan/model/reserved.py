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

from lightning_memplan.model import terms
from lightning_memplan.model.result import MemoryEstimate
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec

__all__ = [
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK_SIZE",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "ReservedEstimate",
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
    e = terms.precision_bytes(train).logits
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
    pb = terms.precision_bytes(train)
    block = math.ceil(terms.layer_param_count(model) / plan.tp)
    root = math.ceil((terms.embedding_param_count(model) + terms.head_param_count(model)) / plan.tp)
    largest = max(block, root)
    return {
        "all_gather": (root + 2 * block) * pb.compute,
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

    ``reserved = default_stream_peak + all_gather_pool + reduce_scatter_pool + loss_segment + rounding``
    (the communication buffers and sharded gradients the allocated estimate counts live in FSDP2's
    side-stream pools, so the default stream's own peak is added to the pools' peaks).
    """

    allocated: int
    default_stream_peak: int
    all_gather_pool: int
    reduce_scatter_pool: int
    loss_segment: int
    rounding: int
    expandable_segments: bool

    @property
    def reserved(self) -> int:
        return (self.default_stream_peak + self.all_gather_pool + self.reduce_scatter_pool
                + self.loss_segment + self.rounding)

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
