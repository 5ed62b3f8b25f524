"""Which training stack runs the step (``TrainSpec.framework``), and the facts of it the memory and time
models depend on: what sequence-parallel linears save, when gradients inside pipeline stages are
reduce-scattered, and how blocks are split over pipeline stages.

The default, ``"torch"``, is what ``memplan_auto`` runs (DTensor tensor/sequence parallelism,
``torch.distributed.pipelining``, FSDP2). The others describe published runs made with other stacks, so
that a published row is checked against the facts of the stack it ran on:

- ``"megatron"``: Megatron-LM (Narayanan et al. 2021, arXiv 2104.04473; Korthikanti et al. 2022, arXiv
  2205.05198). Sequence-parallel linears save their 1/t sequence shard and all-gather it again in the
  backward [K22 section 4.2.2 and Table 2: ``34sbh/t``; Megatron-LM ``megatron/core/tensor_parallel/
  layers.py``, ``LinearWithGradAccumulationAndAsyncCommunication`` saves the un-gathered input when
  ``sequence_parallel``]; the fused SwiGLU saves only its input (``megatron/core/fusions/
  fused_bias_swiglu.py``, ``SwiGLUFunction`` saves the fc1 output); blocks split evenly over the stages.
- ``"llama3"``: the stack of Dubey et al. 2024 (Llama 3, arXiv 2407.21783) section 3.3.2: Megatron-style
  tensor parallelism (it cites Shoeybi et al. and Korthikanti et al.), so the same saved tensors as
  ``"megatron"``; FSDP that "shards optimizer states and gradients, but for model shards we do not
  reshard after forward computation" (FSDP ``SHARD_GRAD_OP``: each micro-batch's gradients are
  reduce-scattered into a sharded fp32 accumulator, "reduce-scatter gradients in FP32"), where
  ``torch.distributed.pipelining`` instead accumulates unsharded gradients until one reduce-scatter per
  step; and the stage split "we reduce one Transformer layer each from the first and the last stages
  ... the first model chunk on the first stage has only the embedding, and the last model chunk on the
  last stage has only output projection and loss calculation": the embedding and the output layer each
  count as one block when the blocks are split (torchtitan's ``generate_llm_fqn_per_model_part(...,
  input_weight=1, output_weight=1)``, ``torchtitan/distributed/pipeline_parallel.py`` at
  ``1ce7f761d76bc408c9e6f32e2bbd2cf9f2ac25ae``, implements the same rule); and context parallelism that
  all-gathers K and V, "exposed in the critical path", where torch's ring overlaps the attention.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FRAMEWORKS", "FrameworkFacts", "framework_facts", "pipeline_units", "rank_block_counts", "stage_block_counts"]


@dataclass(frozen=True, kw_only=True)
class FrameworkFacts:
    """What one training stack does where the models depend on it.

    Attributes:
        sp_saves_shard: sequence-parallel linears save their 1/t input shard (and gather it again in
            backward) instead of the gathered input (DTensor's ``ColwiseParallel`` keeps the gathered one).
        fused_swiglu: the SwiGLU saves only its input (the fc1 output), not silu's output and the product.
        grads_per_microbatch: FSDP inside pipeline stages reduce-scatters every micro-batch's gradients
            into a sharded accumulator (False: unsharded accumulation, one reduce-scatter per step).
        embedding_head_weight: blocks the embedding and the output layer each count as when blocks are
            split over pipeline stages (0: only blocks are split).
        cp_all_gather: context parallelism all-gathers K and V before the attention, on the critical path
            (Llama 3: "the all-gather communication latency is exposed"), instead of a ring that overlaps
            the blockwise attention (torch's ``context_parallel``).
    """

    sp_saves_shard: bool
    fused_swiglu: bool
    grads_per_microbatch: bool
    embedding_head_weight: int
    cp_all_gather: bool = False


FRAMEWORKS: dict[str, FrameworkFacts] = {
    "torch": FrameworkFacts(sp_saves_shard=False, fused_swiglu=False, grads_per_microbatch=False, embedding_head_weight=0),
    "megatron": FrameworkFacts(sp_saves_shard=True, fused_swiglu=True, grads_per_microbatch=False, embedding_head_weight=0),
    "llama3": FrameworkFacts(sp_saves_shard=True, fused_swiglu=True, grads_per_microbatch=True, embedding_head_weight=1,
                             cp_all_gather=True),
}


def framework_facts(name: str) -> FrameworkFacts:
    """The facts of ``name`` (one of :data:`FRAMEWORKS`; ``TrainSpec`` validates the name)."""
    return FRAMEWORKS[name]


def pipeline_units(n_layers: int, framework: str) -> int:
    """Units split over the pipeline's stages: the L blocks, plus the embedding and the output layer
    weighted as blocks where the stack does so (``"llama3"``: L + 2)."""
    return n_layers + 2 * framework_facts(framework).embedding_head_weight


def stage_block_counts(n_layers: int, n_stages: int, framework: str = "torch") -> list[int]:
    """Blocks on each of ``n_stages`` consecutive stages (``p * v`` when interleaved).

    The units (:func:`pipeline_units`) are split evenly, the first ``units mod n_stages`` stages taking one
    more (``torch.distributed.pipelining``'s and :func:`lightning_memplan.parallel.pipeline.split_blocks`'s
    rule, torchtitan's too); the first stage then gives up the embedding's weight and the last the output
    layer's. Llama 3 405B, 126 blocks on 16 x 8 stages: stage 0 and stage 127 hold 0 blocks, the rest 1."""
    w = framework_facts(framework).embedding_head_weight
    base, extra = divmod(n_layers + 2 * w, n_stages)
    counts = [base + (1 if i < extra else 0) for i in range(n_stages)]
    if n_stages > 1:
        counts[0] -= w
        counts[-1] -= w
    else:
        counts[0] -= 2 * w
    return counts


def rank_block_counts(n_layers: int, p: int, v: int = 1, framework: str = "torch") -> list[int]:
    """Blocks held by each of the ``p`` pipeline ranks, rank r holding stages r, r + p, ..., r + (v-1) p
    (looped placement, Narayanan et al. 2021 section 2.2.2; :func:`lightning_memplan.parallel.pipeline.
    stage_indices`)."""
    counts = stage_block_counts(n_layers, p * v, framework)
    return [sum(counts[r + k * p] for k in range(v)) for r in range(p)]
