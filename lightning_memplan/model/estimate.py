"""``estimate_memory``: predicted peak tensor bytes per rank, per component, per phase.

The step is modelled as the timeline a Lightning training step really follows (steady state, i.e.
from the second optimizer step on, when optimizer states exist):

1. forward: model states + the previous step's gradients (Lightning zeroes them only after
   ``training_step`` [PL]) + saved activations of every in-flight micro-batch + the loss's transient
   logits + autocast's weight copies + communication buffers. Peak at the loss.
2. backward: starts with all activations and the loss's backward buffers (gradients exist only when
   accumulating); ends with every gradient allocated and the activations freed. A linear sweep over
   layers peaks at one of the two ends, so both are evaluated, next to the last block's backward (its
   rebuild under recompute) and, with eager attention, that block's softmax backward: its ``[b, a, s, s]``
   temporaries, once autograd has released what the head and the block's nodes after the softmax saved
   (``terms.eager_softmax_backward_*``).
3. optimizer step: model states + the optimizer's temporaries; activations and logits are gone.

Under a pipeline, every backward of the rank's schedule is a candidate for the backward peak
(:mod:`lightning_memplan.model.pipeline_timeline`): the micro-batches it still holds, next to the
gradients of the local chunks that have run a backward by then.

The peak is the largest phase; the components reported are those live at that moment, so they add up
to :attr:`MemoryEstimate.total`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from lightning_memplan.model import (
    checkpointing,
    deepspeed,
    experts,
    frameworks,
    offload,
    param_counts,
    pipeline_timeline,
    terms,
)
from lightning_memplan.model import frozen as frozen_parts
from lightning_memplan.model.result import COMPONENTS, DYNAMIC_COMPONENTS, PHASES, Calibration, MemoryEstimate
from lightning_memplan.model.runnable import pipeline_schedule_blocker
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.model.traced import traced_estimate
from lightning_memplan.validation import check_optional_int, divisor_list

__all__ = ["StageLayout", "check_compatible", "estimate_memory", "stage_layout"]




def check_compatible(model: ModelSpec, train: TrainSpec, plan: ParallelPlan) -> None:
    """Raise ``ValueError`` when the plan cannot split this model/batch (names the rule and the fix)."""
    if model.n_heads % plan.tp:
        # t must divide both head counts: the divisors of their gcd (bounded-time, validation.divisors)
        ok = divisor_list(math.gcd(model.n_heads, model.kv_heads), keep=12)
        raise ValueError(
            f"tp={plan.tp} does not divide n_heads={model.n_heads}; tensor parallelism splits whole "
            f"heads, use tp in {ok}"
        )
    if model.kv_heads % plan.tp:
        ok = divisor_list(model.kv_heads, keep=12)
        raise ValueError(
            f"tp={plan.tp} does not divide n_kv_heads={model.kv_heads}; each rank needs whole key/value "
            f"heads, use tp in {ok}"
        )
    if plan.pp > model.n_layers:
        raise ValueError(
            f"pp={plan.pp} exceeds n_layers={model.n_layers}; every pipeline stage needs at least one "
            f"block, use pp <= {model.n_layers}"
        )
    _check_schedule_runs(plan)
    if plan.schedule == "interleaved" and plan.pp > 1:
        chunks = plan.pp * plan.virtual_stages
        units = frameworks.pipeline_units(model.n_layers, train.framework)  # L (+ embedding and head)
        if units < chunks:  # uneven chunks are fine (the first L mod (p v) take one more)
            raise ValueError(
                f"virtual_stages={plan.virtual_stages} x pp={plan.pp} = {chunks} stages exceed "
                f"n_layers={model.n_layers}; every stage needs a block, use virtual_stages <= "
                f"{units // plan.pp}"
            )
    if train.framework == "deepspeed":
        _check_deepspeed(train, plan)
    blocker = offload.offload_blocker(train, plan)
    if blocker is not None:
        raise ValueError(f"plan={plan.describe()} cannot run this TrainSpec: {blocker}")
    if train.framework == "fsdp1" and (plan.pp > 1 or plan.cp > 1 or plan.tp > 1 or plan.zero == 1):
        raise ValueError(
            f"framework='fsdp1' models FSDP1 over data parallelism (zero 0, 2 or 3; got zero={plan.zero}, "
            f"tp={plan.tp}, pp={plan.pp}, cp={plan.cp}): Lightning's FSDPStrategy shards over data-parallel "
            "ranks only; use ParallelPlan(dp=..., zero=3|2|0), or framework='torch' for FSDP2 layouts"
        )
    if train.seq_len % plan.cp:
        raise ValueError(
            f"cp={plan.cp} does not divide seq_len={train.seq_len}; context parallelism splits the "
            f"sequence evenly, use a seq_len that is a multiple of {plan.cp}"
        )
    if plan.cp > 1 and train.attention == "eager":
        # Ring attention exchanges key/value blocks inside the fused kernel: PyTorch's context_parallel
        # replaces F.scaled_dot_product_attention (torch.distributed.tensor.experimental.context_parallel).
        raise ValueError(
            f"cp={plan.cp} needs attention='sdpa' (got attention='eager'): context parallelism splits the "
            "fused attention kernel over ranks; use attention='sdpa' or cp=1"
        )
    if plan.sp and (train.seq_len // plan.cp) % plan.tp:
        raise ValueError(
            f"sp=True splits the sequence over tp={plan.tp}, but seq_len={train.seq_len} (per cp rank "
            f"{train.seq_len // plan.cp}) is not divisible by it; pad seq_len or set sp=False"
        )


def _check_deepspeed(train: TrainSpec, plan: ParallelPlan) -> None:
    """The layouts ``framework="deepspeed"`` models: ZeRO over data parallelism (with tensor parallelism
    beside it), no pipeline or context parallelism; offload needs the ZeRO stages DeepSpeed accepts it
    with (``docs/_pages/config-json.md``: ``offload_optimizer`` "Valid for ZeRO stage 1, 2, 3",
    ``offload_param`` "Valid only with stage 3")."""
    if plan.pp > 1 or plan.cp > 1:
        raise ValueError(
            f"framework='deepspeed' models ZeRO over data parallelism (got pp={plan.pp}, cp={plan.cp}): DeepSpeed's "
            "pipeline engine and sequence parallelism are not modelled; use pp=1 and cp=1, or framework='torch'"
        )
    if train.offload == "params" and plan.zero < 3:
        raise ValueError(
            f"offload='params' needs zero=3 (got zero={plan.zero}): DeepSpeed offloads parameters only under "
            "ZeRO stage 3 (offload_param); use ParallelPlan(..., zero=3), or offload='optimizer' for stages 1-2"
        )
    if train.offload == "optimizer" and plan.zero < 1:
        raise ValueError(
            "offload='optimizer' needs zero>=1 (got zero=0): DeepSpeed's offload_optimizer is part of ZeRO "
            "stages 1, 2 and 3; use ParallelPlan(..., zero=1) or higher, or offload='none'"
        )


def _check_schedule_runs(plan: ParallelPlan) -> None:
    """Refuse a pipeline schedule that cannot run its micro-batches (1F1B with ``microbatches < pp``):
    the rule the planner's search and memplan_auto's setup apply,
    :func:`~lightning_memplan.model.runnable.pipeline_schedule_blocker` (the dataloader batch is not
    known here; ``train.micro_batch`` is one micro-batch)."""
    reason = pipeline_schedule_blocker(pp=plan.pp, schedule=plan.schedule, microbatches=plan.microbatches, batch=None)
    if reason is None:
        return
    fix = f"use microbatches>={plan.pp}, e.g. ParallelPlan(..., pp={plan.pp}, microbatches={plan.pp})"
    if pipeline_schedule_blocker(pp=plan.pp, schedule="gpipe", microbatches=plan.microbatches, batch=None) is None:
        fix += f", or schedule='gpipe' (it runs microbatches={plan.microbatches})"
    raise ValueError(f"plan={plan.describe()} cannot run: {reason}; {fix}")


@dataclass(frozen=True)
class StageLayout:
    """What one pipeline rank holds: ``n_layers`` blocks, and whether it has the embedding/head."""

    stage: int
    n_layers: int
    has_embedding: bool
    has_head: bool


def stage_layout(model: ModelSpec, plan: ParallelPlan, stage: int, framework: str = "torch") -> StageLayout:
    """Split L blocks over p stages (v chunks each when interleaved) as ``framework`` does
    (:func:`lightning_memplan.model.frameworks.rank_block_counts`: the first ``L mod (p v)`` chunks take
    one extra block; Llama 3's stack counts the embedding and the output layer as a block each). Stage 0
    holds the embedding, stage p-1 the final norm and lm_head (and, with tied embeddings and p > 1, its
    own copy of V*h)."""
    return _stage_layout(model.n_layers, plan.pp, plan.virtual_stages if plan.schedule == "interleaved" else 1, stage,
                         framework)


@functools.lru_cache(maxsize=4096)  # keyed by what the split depends on, not by the whole plan
def _stage_layout(n_layers: int, p: int, v: int, stage: int, framework: str) -> StageLayout:
    layers = frameworks.rank_block_counts(n_layers, p, v, framework)[stage] if p > 1 else n_layers
    return StageLayout(stage=stage, n_layers=layers, has_embedding=stage == 0, has_head=stage == p - 1)


def _local_params(model: ModelSpec, plan: ParallelPlan, layout: StageLayout) -> tuple[int, int, int]:
    """(parameters held by a rank before ZeRO sharding, its matmul weights, its largest tensor).

    TP splits matmul weights, biases, the vocab-parallel embedding and the lm_head by t; norms are
    replicated. With an explicit ``n_params`` the shape-derived count is rescaled to it.
    """
    return _local_params_of(model, plan.tp, plan.pp > 1, layout)


def _block_kinds(model: ModelSpec, n_layers: int) -> tuple[tuple[int, bool | None], ...]:
    """``(blocks, moe)`` per block kind among ``n_layers`` blocks of the stack: one kind for a dense
    model; for an MoE stack its MoE and dense blocks, a stage taking its share of MoE blocks
    (``round(L_moe * n / L)``: exact for the whole stack)."""
    if not experts.is_moe(model):
        return ((n_layers, None),)
    n_moe = round(experts.moe_layer_count(model) * n_layers / model.n_layers)
    return ((n_moe, True), (n_layers - n_moe, False))


def _blocks_matmul_local(model: ModelSpec, t: int, n_layers: int) -> int:
    """Matmul weights of ``n_layers`` blocks on one tensor-parallel rank (experts split by t)."""
    return sum(n * math.ceil(terms.layer_matmul_param_count(model, moe=moe) / t) for n, moe in _block_kinds(model, n_layers))


def _routed_experts_local(model: ModelSpec, t: int, n_layers: int) -> int:
    """Routed expert weights of ``n_layers`` blocks on one tensor-parallel rank (experts split by t)."""
    per_block = param_counts.routed_expert_param_count(model)
    return sum(n * math.ceil(per_block / t) for n, moe in _block_kinds(model, n_layers) if moe)


@functools.lru_cache(maxsize=4096)  # keyed by what the count depends on, not by the whole plan
def _local_params_of(model: ModelSpec, t: int, pipelined: bool, layout: StageLayout) -> tuple[int, int, int]:
    h, v = model.hidden, model.vocab_size
    norm = terms.norm_param_count(model)
    norms = 2 * norm
    params = matmul = 0
    for n_blocks, moe in _block_kinds(model, layout.n_layers):
        layer_matmul = terms.layer_matmul_param_count(model, moe=moe)
        layer_other = terms.layer_param_count(model, moe=moe) - layer_matmul
        per_layer = math.ceil(layer_matmul / t) + math.ceil((layer_other - norms) / t) + norms
        params += n_blocks * per_layer
        matmul += n_blocks * math.ceil(layer_matmul / t)
    largest = max(h * model.ffn, h * model.n_heads * model.dim_head) // t
    if experts.is_moe(model):  # transformers 5.3 keeps each block's experts as one [E, 2 f_e, h] gate_up_proj
        largest = max(largest, model.n_experts * 2 * model.expert_ffn * h // t)
    if layout.has_embedding:
        params += math.ceil(terms.embedding_param_count(model) / t)
        largest = max(largest, math.ceil(v * h / t))
    if layout.has_head:
        head_matrix = math.ceil(v * h / t)
        needs_own_head = not model.tied_embeddings or (pipelined and not layout.has_embedding)
        params += norm + (head_matrix if needs_own_head else 0)
        matmul += head_matrix
        largest = max(largest, head_matrix)
    if model.n_params is not None:
        scale = model.n_params / terms.param_count(model)
        params, matmul, largest = round(params * scale), round(matmul * scale), round(largest * scale)
    return params, matmul, largest


def _fsdp_units(model: ModelSpec, plan: ParallelPlan, layout: StageLayout, local: int) -> tuple[int, int]:
    """(parameters of the largest FSDP block unit, parameters of the root unit: embedding, final norm,
    lm_head) on one rank before sharding. One block is all-gathered at a time (plus the prefetched
    next one); for an MoE stack the largest block is an MoE block, every expert gathered (no expert
    parallelism yet). With an explicit ``n_params`` the block is rescaled as ``local`` is, so the root is
    what the stage holds besides its blocks, never the rest of a rescaled count (issue 25: a dense
    reading of Mixtral rescaled to 46.7B put 222 GiB in the root)."""
    unit = math.ceil(terms.layer_param_count(model) / plan.tp)
    if not experts.is_moe(model) and model.n_params is None:
        return unit, local - layout.n_layers * unit
    blocks = _local_params_of(model, plan.tp, plan.pp > 1,
                              dataclasses.replace(layout, has_embedding=False, has_head=False))[0]
    if model.n_params is not None:  # _local_params_of rescaled the blocks already
        unit = round(unit * model.n_params / terms.param_count(model))
    return unit, max(0, local - blocks)


def _own_unit_params(model: ModelSpec, plan: ParallelPlan, layout: StageLayout) -> tuple[int, int]:
    """(embedding, lm_head) parameters on one rank that are FSDP2 units of their own
    (``ParallelPlan.own_units``), not in the root unit: ``ceil(V h / t)`` each where the stage holds that
    part and it is untied (a tied matrix is one parameter, which ``memplan_auto`` keeps in the root),
    rescaled as the stage's parameters are when ``n_params`` is explicit; ``(0, 0)`` otherwise."""
    if model.tied_embeddings or not plan.own_units:
        return 0, 0
    matrix = math.ceil(model.vocab_size * model.hidden / plan.tp)
    if model.n_params is not None:
        matrix = round(matrix * model.n_params / terms.param_count(model))
    emb = matrix if "embedding" in plan.own_units and layout.has_embedding else 0
    head = matrix if "head" in plan.own_units and layout.has_head else 0
    return emb, head


def _chunk_shares(
    model: ModelSpec, plan: ParallelPlan, layout: StageLayout, framework: str
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Each local chunk's share of the stage's block activations (its blocks) and of its gradients (its
    parameters: blocks, the embedding on rank 0's first chunk, the final norm and lm_head on the last
    rank's last chunk). One chunk unless interleaved."""
    return _chunk_shares_of(model, plan.tp, plan.pp, plan.virtual_stages if plan.schedule == "interleaved" else 1,
                            layout, framework)


@functools.lru_cache(maxsize=4096)  # keyed by what the shares depend on, not by the batch shape or the whole plan
def _chunk_shares_of(
    model: ModelSpec, t: int, p: int, v: int, layout: StageLayout, framework: str
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    counts = frameworks.stage_block_counts(model.n_layers, p * v, framework)
    blocks = [counts[layout.stage + c * p] for c in range(v)] if v > 1 else [layout.n_layers]
    local, _, _ = _local_params_of(model, t, p > 1, layout)
    emb = _local_params_of(model, t, p > 1, dataclasses.replace(layout, has_head=False, n_layers=0))[0] if layout.has_embedding else 0
    head = _local_params_of(model, t, p > 1, dataclasses.replace(layout, has_embedding=False, n_layers=0))[0] if layout.has_head else 0
    per_block = (local - emb - head) / max(layout.n_layers, 1)
    params = [n * per_block for n in blocks]
    params[0] += emb
    params[-1] += head
    total_blocks, total_params = max(sum(blocks), 1), max(sum(params), 1.0)
    return tuple(n / total_blocks for n in blocks), tuple(x / total_params for x in params)


@dataclass(frozen=True)
class _PerMicroBatch:
    """The batch-dependent bytes of one rank for one micro-batch, before the schedule multiplies them."""

    block_acts: int
    head_acts: int
    saved_layer: int
    per_mb_attn: int
    logits: tuple[int, int, int]  # the loss's forward, held and backward bytes
    copies: int
    rebuild: int
    eager_bwd_ws: int
    softmax_point: bool  # the last block's eager softmax backward is a point of its own (_dynamic)
    softmax_grads: int  # activation gradients beside the softmax backward's temporaries
    softmax_freed_acts: int  # what the block's backward has released by then (one micro-batch)
    softmax_freed_attn: int
    softmax_freed_copies: int  # autocast weight copies released by then (pp = 1: the cache is gone)
    linear_bwd_ws: int
    rebuild_grads: int
    first_rebuild: int  # full recompute: the first block rebuilt and running its backward (backward_first)
    checkpointed_attn: int  # full recompute, eager: a block's [b, a, s, s] forward transients
    checkpointed_acts: int  # ... and its saves up to the scores, alive beside them
    inflight: float
    inflight_head: float
    batch_in: int  # the dataloader batch this rank holds for the whole step (other)
    positions: int  # one micro-batch's learned-position ids on the embedding stage (activations)


def _batch_tokens(train: TrainSpec, plan: ParallelPlan) -> int:
    """Tokens of the dataloader batch one rank holds during the step (:func:`terms.batch_input_bytes`):
    ``b s`` (the whole sequence under context parallelism: the in-place shard keeps the storage), times m
    under a pipeline (every stage receives the step's m micro-batches)."""
    return train.micro_batch * train.seq_len * (plan.microbatches if plan.pp > 1 else 1)


@functools.lru_cache(maxsize=8192)  # frozen inputs; one per layout, then assembled per pipeline moment
def _per_micro_batch(model: ModelSpec, train: TrainSpec, plan: ParallelPlan, layout: StageLayout) -> _PerMicroBatch:
    b, s = train.micro_batch, train.seq_len // plan.cp
    t, sp = plan.tp, plan.sp
    pb = terms.precision_bytes(train)
    tokens = b * s
    m = plan.microbatches
    inflight = terms.pipeline_inflight_microbatches(layout.stage, plan.pp, m, plan.schedule, plan.virtual_stages)

    full_layer = terms.layer_activation_bytes(model, train, b, s, t=t, sp=sp)
    attn_layer = terms.eager_attention_bytes(model, train, b, s, t=t)
    if train.recompute == "full":
        saved_layer = terms.full_recompute_layer_bytes(model, train, b, s, t=t, sp=sp)
        rebuild = full_layer + terms.eager_attention_bytes(model, train.replace(recompute="none"), b, s, t=t)
    elif train.recompute == "selective_op":
        # torchtitan's op-level policy: the kept outputs per block; the recompute rebuilds the rest
        saved_layer = checkpointing.selective_op_layer_bytes(model, train, b, s, t=t, sp=sp)
        rebuild = checkpointing.selective_op_rebuild_bytes(model, train, b, s, t=t, sp=sp)
    else:
        saved_layer, rebuild = full_layer, 0
    # [frozen hook 1] blocks no gradient reaches (a frozen backbone's prefix) save nothing (model/frozen.py)
    saving = frozen_parts.saving_layers(model, layout.n_layers, first_stage=layout.has_embedding)
    rebuild = rebuild if saving else 0
    head_acts = 0
    if layout.has_head:  # the final norm (a 1/t sequence slice under SP) and the lm_head's (gathered) input
        head_acts = terms.norm_saved_bytes(model, train, tokens, split=t if sp else 1) + tokens * model.hidden * pb.compute
    if layout.has_head:
        shard = t if train.loss in terms.VOCAB_SHARDED_LOSSES else 1
        lg = terms.logits_bytes(model, train, tokens, vocab_shard=shard)
    else:
        lg = {"forward": 0, "held": 0, "backward": 0}
    # Only the last stage computes the loss, once per micro-batch; in-flight ones keep their "held" part.
    # The last chunk runs each micro-batch's loss forward then its backward (1F1B, interleaved): its
    # loss-side tensors are held for fewer micro-batches than the stage's blocks (terms).
    inflight_head = terms.pipeline_head_inflight_microbatches(plan.pp, m, plan.schedule) if layout.has_head else 0
    _, matmul, _ = _local_params(model, plan, layout)
    # Autocast's weight cache lives for one autocast region; the pipeline schedule runs every
    # micro-batch inside the step's region, so the copies exist once. FSDP (zero >= 2 with d > 1)
    # all-gathers 16-bit parameters itself (MixedPrecisionPolicy), so autocast has nothing to cast.
    fsdp_mixed = plan.zero >= 2 and plan.dp * plan.cp > 1
    if train.recompute in ("full", "selective_op"):
        # Casts inside a non-reentrant ``checkpoint`` region are not kept in autocast's cache (measured on
        # torch 2.13 with the tracker: the blocks' 16-bit weight copies are gone after the forward);
        # only the head's copy remains.
        matmul -= _blocks_matmul_local(model, t, layout.n_layers)
    # The routed experts run transformers' grouped_mm kernel, outside autocast: no 16-bit copy of them.
    matmul -= _routed_experts_local(model, t, layout.n_layers)
    copies = 0 if fsdp_mixed else terms.autocast_copy_bytes(max(matmul, 0), train)
    # grad of the probabilities and of the scores for one layer [PT softmax_backward] (0 unless eager
    # attention without recompute)
    eager_bwd_ws = terms.eager_softmax_backward_bytes(model, train, b, s, t=t) if saving else 0
    # The last block's softmax backward is its own point (_dynamic), except under activation offloading,
    # where backward_layer holds the unpacked block and the temporaries beside it.
    softmax_point = bool(eager_bwd_ws) and layout.n_layers > 0 and not train.offload_activations
    freed = terms.eager_softmax_backward_freed_bytes(model, train, b, s, t=t, sp=sp)
    freed_copies = 0
    if softmax_point and copies and plan.pp == 1:
        # Outside a pipeline the autocast region ends with the forward, so a weight copy lives only as
        # long as the matmul node that saved it: the head's and the last block's output projection and
        # MLP are gone once their backward ran (not the routed experts: never copied). A pipeline
        # schedule runs its backwards inside the region, whose cache keeps every copy.
        after_matmul, _ = param_counts.layer_params_after_scores(model)
        freed_matmul = math.ceil(after_matmul / t) - math.ceil(param_counts.routed_expert_param_count(model) / t)
        if layout.has_head:
            freed_matmul += math.ceil(model.vocab_size * model.hidden / t)
        if model.n_params is not None:  # rescaled as _local_params_of rescales the matmul weights
            freed_matmul = round(freed_matmul * model.n_params / terms.param_count(model))
        freed_copies = min(copies, terms.autocast_copy_bytes(max(freed_matmul, 0), train))
    linear_bwd_ws = tokens * max(model.hidden, model.ffn // t) * pb.compute
    # While a checkpointed block is rebuilt and runs its backward, the gradient of its output (residual
    # dtype) and the widest matmul's input gradient exist next to the rebuilt activations.
    rebuild_grads = tokens * model.hidden * pb.residual // (t if sp else 1) + linear_bwd_ws if rebuild else 0
    # Full recompute: the first block is rebuilt for its backward after every other block's backward
    # ran, so its rebuilt activations and gradients sit beside (almost) every parameter gradient
    # (backward_first). Measured on a CPU step (tests/unit/test_recompute_first_block.py): without it the
    # backward was 4-11 % under with the chunked loss, whose buffers leave no larger point.
    first_rebuild = rebuild + rebuild_grads if train.recompute == "full" and layout.n_layers else 0
    checkpointed_attn = terms.eager_checkpointed_forward_bytes(model, train, b, s, t=t) if layout.n_layers else 0
    checkpointed_acts = 0
    if checkpointed_attn:
        # Eager attention: the rebuilt block's softmax backward is its peak (as backward_softmax without
        # recompute): what the block saves up to its scores, the probabilities, the two [b, a, s, s]
        # temporaries and the residual and value gradients; in its forward the same saves up to the
        # scores are alive beside the scores and probabilities.
        plain = train.replace(recompute="none")
        checkpointed_acts, _ = terms.layer_activation_split_bytes(model, plain, b, s, t=t, sp=sp)
        first_rebuild = max(first_rebuild, checkpointed_acts
                            + terms.eager_softmax_output_bytes(model, plain, b, s, t=t)
                            + terms.eager_softmax_backward_bytes(model, plain, b, s, t=t)
                            + terms.eager_softmax_backward_grad_bytes(model, plain, b, s, t=t, sp=sp))
    return _PerMicroBatch(
        batch_in=terms.batch_input_bytes(_batch_tokens(train, plan)),
        positions=terms.position_ids_bytes(model, s) if layout.has_embedding and not model.frozen_embedding else 0,
        # activation offloading (save_on_cpu around every block): the blocks' saves live on the host (their
        # bytes: _apply_offloads); one block's working set is a point of its own (_offloaded_block_points)
        block_acts=(0 if train.offload_activations else saving) * saved_layer,
        head_acts=head_acts,
        saved_layer=saved_layer,
        per_mb_attn=(0 if train.offload_activations else saving) * attn_layer,
        logits=(lg["forward"], lg["held"], lg["backward"]),
        copies=copies,
        rebuild=rebuild,
        eager_bwd_ws=eager_bwd_ws,
        softmax_point=softmax_point,
        softmax_grads=terms.eager_softmax_backward_grad_bytes(model, train, b, s, t=t, sp=sp),
        softmax_freed_acts=freed["activations"],
        softmax_freed_attn=freed["attention"],
        softmax_freed_copies=freed_copies,
        linear_bwd_ws=linear_bwd_ws,
        rebuild_grads=rebuild_grads,
        first_rebuild=first_rebuild,
        checkpointed_attn=checkpointed_attn,
        checkpointed_acts=checkpointed_acts,
        inflight=inflight,
        inflight_head=inflight_head,
    )


def _dynamic(
    model: ModelSpec,
    train: TrainSpec,
    plan: ParallelPlan,
    layout: StageLayout,
    moment: pipeline_timeline.StageMoment | None = None,
) -> dict[str, dict[str, int]]:
    """Per-phase bytes of the batch-dependent components on one rank (analytic); under a pipeline,
    the backward points at ``moment`` (default: the rank's most in-flight micro-batches, with the loss's
    backward on the last stage)."""
    mb = _per_micro_batch(model, train, plan, layout)
    block_acts, head_acts, saved_layer, per_mb_attn = mb.block_acts, mb.head_acts, mb.saved_layer, mb.per_mb_attn
    per_mb_acts = block_acts + head_acts
    lg = dict(zip(("forward", "held", "backward"), mb.logits, strict=True))
    copies, rebuild, eager_bwd_ws, linear_bwd_ws, rebuild_grads = (
        mb.copies, mb.rebuild, mb.eager_bwd_ws, mb.linear_bwd_ws, mb.rebuild_grads
    )
    inflight, inflight_head = mb.inflight, mb.inflight_head
    loss_backward = layout.has_head  # the backward points run the loss's backward (the last chunk's)
    fwd_inflight, fwd_inflight_head = inflight, inflight_head
    inflight_after = max(0.0, inflight - 1)  # what the first backward leaves of its micro-batch
    if moment is not None:
        inflight, inflight_after = moment.inflight, moment.inflight_after
        inflight_head = moment.inflight_head if layout.has_head else 0
        loss_backward = layout.has_head and moment.loss_backward
    acts_fwd = round(fwd_inflight * block_acts + fwd_inflight_head * head_acts)
    attn_fwd = round(fwd_inflight * per_mb_attn)
    acts_bwd = round(inflight * block_acts + inflight_head * head_acts)
    attn_bwd = round(inflight * per_mb_attn)
    held_logits = round(max(0.0, inflight_head - (1 if loss_backward else 0)) * lg["held"])
    # The batch is alive in every phase (other); each in-flight micro-batch's learned-position ids until
    # the embedding's backward (activations, first stage only).
    batch_in, positions = mb.batch_in, mb.positions
    acts_fwd += round(fwd_inflight * positions)
    acts_bwd += round(inflight * positions)
    out = {
        "forward": {
            "activations": acts_fwd,
            "attention": attn_fwd,
            "logits": round(max(0.0, fwd_inflight_head - 1) * lg["held"]) + lg["forward"],
            "workspace": 0,
            "other": copies + batch_in,
        },
        "backward_start": {
            "activations": acts_bwd,
            "attention": attn_bwd,
            "logits": held_logits + (lg["backward"] if loss_backward else 0),
            "workspace": 0,
            "other": copies + batch_in,
        },
        # the last block's backward: the loss buffers are gone and the block is rebuilt (full/selective-op);
        # eager attention's softmax backward is backward_softmax below (here only under activation
        # offloading, next to the unpacked block: _offloaded_block_points)
        "backward_layer": {
            "activations": acts_bwd,
            "attention": attn_bwd,
            "logits": held_logits,
            "workspace": rebuild + (0 if mb.softmax_point else eager_bwd_ws) + rebuild_grads,
            "other": copies + batch_in,
        },
        "backward_end": {
            "activations": round(
                inflight_after * block_acts
                + max(0.0, inflight_head - (1 if loss_backward else 0)) * head_acts
            )
            + min(saved_layer, per_mb_acts)
            + round(inflight_after * positions),
            "attention": round(inflight_after * per_mb_attn),
            "logits": held_logits,
            "workspace": linear_bwd_ws,
            "other": batch_in,
        },
        "optimizer": {**{c: 0 for c in DYNAMIC_COMPONENTS}, "other": batch_in},
    }
    if mb.first_rebuild:
        # Full recompute: the first block rebuilt (its saves, as backward_layer's rebuild) and running its
        # backward, with its output gradient and the widest matmul's input gradient; every later block's
        # saved input is gone. The parameter gradients of every block exist (_estimate_stage).
        out["backward_first"] = {**out["backward_end"], "workspace": mb.first_rebuild}
    if mb.checkpointed_attn:
        # Full recompute with eager attention: inside the last block's forward its scores and
        # probabilities exist (terms.eager_checkpointed_forward_bytes) beside every block's saved input,
        # before the head and the loss run.
        out["forward_checkpoint"] = {
            "activations": round(fwd_inflight * (block_acts + positions)
                                 + max(0.0, fwd_inflight_head - 1) * head_acts) + mb.checkpointed_acts,
            "attention": mb.checkpointed_attn,
            "logits": round(max(0.0, fwd_inflight_head - 1) * lg["held"]),
            "workspace": 0,
            "other": copies + batch_in,
        }
    if mb.softmax_point:
        # The last block's eager softmax backward (terms.eager_softmax_backward_*): its [b, a, s, s]
        # temporaries and the residual and value gradients beside them; by then autograd has released
        # what the micro-batch's head (its final norm and lm_head input, when this backward ran the loss's)
        # and the block's nodes after the softmax saved, and their autocast weight copies
        # (terms.eager_softmax_backward_freed_bytes). The gradients of those parameters exist
        # (_estimate_stage).
        out["backward_softmax"] = {
            "activations": acts_bwd - (head_acts if loss_backward else 0) - mb.softmax_freed_acts,
            "attention": attn_bwd - mb.softmax_freed_attn,
            "logits": held_logits,
            "workspace": eager_bwd_ws + mb.softmax_grads,
            "other": copies - mb.softmax_freed_copies + batch_in,
        }
    # The module's buffers (litgpt's RoPE tables, ModelSpec.buffer_bytes) are whole on every rank in every
    # phase: TP and FSDP shard parameters only. Measured, litgpt GPT tp=2 with block_size 4096 (rotary 1.0):
    # without them the estimate was 15 % under (tests/distributed/test_strategy_litgpt_tp.py).
    for point in out.values():
        point["other"] += model.buffer_bytes
    if train.offload_activations and layout.n_layers:
        _offloaded_block_points(out, model, train, plan, saved_layer)
    return out


def _offloaded_block_points(
    out: dict[str, dict[str, int]], model: ModelSpec, train: TrainSpec, plan: ParallelPlan, saved_layer: int
) -> None:
    """Activation offloading (``save_on_cpu`` around every block, pp = 1): the device holds no block's saves
    at the loss; inside a block's forward its own tensors exist until they are packed and the block returns
    (``"forward_block"``: one block's saved bytes, next to the autocast copies and the batch), and in a
    block's backward its saves are unpacked back to the device (``backward_layer``, ``backward_end``: one
    block's) [torch/autograd/graph.py ``save_on_cpu``; ``model/offload.py``]. On a CPU step the unpack is
    ``tensor.to("cpu")`` of a CPU tensor, the packed copy itself: nothing is allocated in the backward."""
    attn_layer = terms.eager_attention_bytes(model, train, train.micro_batch, train.seq_len // plan.cp, t=plan.tp)
    out["forward_block"] = {"activations": saved_layer, "attention": attn_layer, "logits": 0, "workspace": 0,
                            "other": out["forward"]["other"]}
    if train.device != "cuda":
        return
    out["backward_layer"]["activations"] += saved_layer
    out["backward_layer"]["attention"] += attn_layer
    end = out["backward_end"]  # the first block's backward: its saves (the analytic end holds min(saved, head))
    end["activations"], end["attention"] = max(end["activations"], saved_layer), max(end["attention"], attn_layer)


def _calibrated_dynamic(
    model: ModelSpec,
    train: TrainSpec,
    plan: ParallelPlan,
    layout: StageLayout,
    calibration: Calibration,
    analytic: dict[str, dict[str, int]],
) -> dict[str, dict[str, int]]:
    """Replace analytic dynamic terms by the traced coefficients. The calibration was fitted on one
    rank without model parallelism; for another plan each component is scaled by the analytic ratio
    plan / single-rank, so the exactness at the traced shapes carries over to the per-layer split."""
    b, s = train.micro_batch, train.seq_len
    # the trace ran without activation offloading: scale it by the analytic offloaded / plain ratio
    ref_train = train.replace(offload_activations=False) if train.offload_activations else train
    trivial = plan.tp == plan.pp == plan.cp == 1 and ref_train is train
    # the single-rank analytic terms are only needed to scale the fit to another plan
    single = None if trivial else _dynamic(model, ref_train, ParallelPlan(), stage_layout(model, ParallelPlan(), 0))
    out: dict[str, dict[str, int]] = {}
    phase_map = {
        "forward": "forward",
        "forward_block": "forward",
        "forward_checkpoint": "forward",
        "backward_start": "backward",
        "backward_layer": "backward",
        "backward_softmax": "backward",
        "backward_end": "backward",
        "backward_first": "backward",
        "optimizer": "optimizer",
    }
    for key, comps in analytic.items():
        phase = phase_map[key]
        out[key] = {}
        for comp in DYNAMIC_COMPONENTS:
            fitted = calibration.bytes_for(phase, comp, b, s)
            if key in ("backward_layer", "backward_softmax", "backward_end", "backward_first"):
                # The trace reports one backward peak; keep the analytic points inside the backward.
                out[key][comp] = comps[comp]
            elif trivial:
                out[key][comp] = fitted
            else:
                assert single is not None  # not trivial
                base = single[key][comp]
                out[key][comp] = round(fitted * comps[comp] / base) if base else comps[comp]
    return out


def _estimate_stage(
    model: ModelSpec, train: TrainSpec, plan: ParallelPlan, stage: int, rank: int, calibration: Calibration | None
) -> MemoryEstimate:
    layout = stage_layout(model, plan, stage, train.framework)
    inflight = terms.pipeline_inflight_microbatches(stage, plan.pp, plan.microbatches, plan.schedule, plan.virtual_stages)
    pb = terms.precision_bytes(train)
    local, matmul, largest = _local_params(model, plan, layout)
    shard = plan.dp * plan.cp  # ZeRO/FSDP shards over the data-parallel (and context-parallel) ranks
    states = terms.model_state_bytes(local, train)
    frozen = model.n_trainable_params is not None
    if frozen:  # frozen parameters (LoRA base weights): no gradients, optimizer states or master copies
        trainable_local = round(local * model.trainable_fraction)
        states = {**terms.model_state_bytes(trainable_local, train), "params": states["params"]}
        local_for_optimizer = trainable_local
    else:
        local_for_optimizer = local
    # zero=2 is FSDP2 ``fully_shard(reshard_after_forward=False)`` (SHARD_GRAD_OP, parallel/mesh.py):
    # the parameters are sharded as for zero=3 (each rank keeps its 1/N shard for the whole step); the
    # unsharded copy it keeps from forward to backward is the ``comm`` term below [PT fully_shard].
    # Measured on 2 gloo ranks (tests/distributed/test_zero2_memory.py): a whole-parameter term here
    # over-estimated by the other ranks' shards, +2.9 %.
    params = math.ceil(states["params"] / shard) if plan.zero >= 2 else states["params"]
    grads = math.ceil(states["grads"] / shard) if plan.zero >= 2 else states["grads"]
    # FSDP1 (framework="fsdp1"): one FlatParameter per unit (the L blocks and the root), each padded to a
    # multiple of the shard group, so a rank keeps ceil(n_unit / d) of every unit (terms.fsdp1_shard_numel)
    flat = frameworks.framework_facts(train.framework).fsdp_flat_params
    if flat and plan.zero >= 2 and shard > 1 and local:
        unit_n, root_n = _fsdp_units(model, plan, layout, local)
        kept = terms.fsdp1_rank_flat_numel([unit_n] * layout.n_layers + [root_n], shard)
        params = math.ceil(states["params"] * kept / local)
        grads = math.ceil(states["grads"] * kept / local)
    # FSDP2 (ZeRO-2/3, or replication without DDP buckets) inside a pipeline stage: the schedule runs
    # every micro-batch's backward with ``set_requires_gradient_sync(False)`` and
    # ``set_reshard_after_backward(False)`` (torch 2.13 ``torch/distributed/pipelining/stage.py``,
    # ``_PipelineStageBase.backward_maybe_with_nosync``), so each unit stays unsharded after its first
    # backward and its *unsharded* gradient accumulates over the micro-batches (``FSDPParamGroup.
    # post_backward`` returns before the reduce when ``reduce_grads`` is off); one reduce-scatter per
    # unit at the end of the step (``perform_reduce_grad``) leaves the sharded gradients. Measured on
    # 2 x 2 gloo ranks, dp=2 pp=2 m=2 (tests/distributed/test_strategy_3d.py): the per-block unshard and
    # one-gradient-in-flight terms gave +9.9 % / +8.5 % (stage 0 / 1).
    pipelined_fsdp = plan.pp > 1 and shard > 1 and (plan.zero >= 2 or (plan.zero == 0 and not plan.grad_buckets))
    # Llama 3's FSDP reduce-scatters each micro-batch's gradients into the sharded fp32 accumulator
    # (arXiv 2407.21783 section 3.3.2, lightning_memplan.model.frameworks): sharded gradients, and one
    # unit's unsharded gradient in flight during the backward (counted with comm below).
    per_mb_grads = pipelined_fsdp and plan.zero >= 2 and frameworks.framework_facts(train.framework).grads_per_microbatch
    pipelined_fsdp = pipelined_fsdp and not per_mb_grads
    grads_accum = states["grads"] if pipelined_fsdp else grads  # the stage's gradients before the reduce
    optimizer = math.ceil(states["optimizer"] / shard) if plan.zero >= 1 else states["optimizer"]
    master = math.ceil(states["master"] / shard) if plan.zero >= 1 else states["master"]
    opt_local = math.ceil(local_for_optimizer / shard) if plan.zero >= 1 else local_for_optimizer
    opt_ws = terms.optimizer_workspace_bytes(train, opt_local, largest)
    if train.framework == "deepspeed":
        return _deepspeed_stage(model, train, plan, layout, rank, calibration,
                                local=local, trainable=local_for_optimizer, largest=largest,
                                opt_ws=0 if train.offload != "none" else opt_ws)
    # FSDP2's CPUOffloadPolicy on one data-parallel rank: memplan_auto shards over a one-rank mesh, each
    # block copied into its unsharded buffer for its forward and backward (the zero=3 branch below)
    one_rank_fsdp = offload.offloads_params(train) and shard == 1

    # Communication buffers.
    b, s = train.micro_batch, train.seq_len // plan.cp
    comm_static = 0
    comm_fwd = comm_bwd = 0
    comm_bwd_start = None  # the loss's backward, before any block's: as comm_bwd unless set below
    comm_bwd_end = None  # the end of the backward: as comm_bwd unless set below
    gathered = pb.compute if pb.autocast_copy else pb.param  # all-gather dtype of FSDP units
    if shard > 1 and plan.zero <= 1 and plan.grad_buckets and not flat:
        comm_static = terms.ddp_bucket_bytes(states["grads"])
    elif shard > 1 and plan.zero == 2:
        # SHARD_GRAD_OP keeps every unit unsharded (in the 16-bit compute dtype under mixed
        # precision: FSDP's MixedPrecisionPolicy) from its forward until its backward.
        comm_fwd = comm_bwd = local * gathered
        # In forward, FSDP2 also keeps the last unit's flat all-gather output alive until the next
        # unit's copy-out (synchronous all-gather, world size > 1: ``FSDPParamGroup.wait_for_unshard``
        # stores it in ``comm_ctx.all_gather_state``) [PT fully_shard]; the last block's is still
        # alive at the loss. Measured on 2 gloo ranks (tests/distributed/test_strategy_budget.py):
        # without it -5.5 %, exactly one block's parameters short.
        if flat:
            # FSDP1 gathers straight into each unit's unsharded flat parameter and keeps nothing else
            # (``FlatParamHandle._all_gather_flat_param``); its reduce-scatter needs the unit's unsharded
            # flat gradient (``_runtime_utils._reduce_grad``), as the per-block gradient of the backward
            # below. Measured on 2 gloo ranks (tests/distributed/test_fsdp1.py): FSDP2's extra block here
            # over-estimated SHARD_GRAD_OP by +5.3 %, one block's parameters.
            comm_bwd += math.ceil(terms.layer_param_count(model) / plan.tp) * pb.grad
        else:
            comm_fwd += math.ceil(terms.layer_param_count(model) / plan.tp) * gathered
        if per_mb_grads:  # the block whose gradient waits for its reduce-scatter
            comm_bwd += math.ceil(terms.layer_param_count(model) / plan.tp) * pb.grad
    elif shard > 1 and plan.zero == 0 and flat:
        # FSDP1 NO_SHARD computes on the flat parameter itself and all-reduces its flat gradient in place
        # (torch 2.13 ``_runtime_utils._reduce_grad_no_shard``): no unsharded copy, no bucket.
        pass
    elif (shard > 1 and (plan.zero == 3 or (plan.zero == 0 and not plan.grad_buckets))) or one_rank_fsdp:
        # ZeRO-3, and replication without DDP buckets: FSDP2 over a replicate mesh (shard size 1) still
        # copies each unit into its unsharded buffer for its forward and backward
        # (``FSDPParamGroup.wait_for_unshard``, world size 1 branch) [PT fully_shard].
        unit_params, root_params = _fsdp_units(model, plan, layout, local)
        # An embedding or lm_head that is a unit of its own (plan.own_units) is resharded after its forward
        # like a block, so it is not in the root. Its re-gather for the loss's backward comes after the
        # logits' gradient peak: measured on 2 gloo ranks, an HF Llama under memplan_auto dp=2 (no
        # LinearCrossEntropy, so the head has its own unit; tests/distributed/test_memplan_auto_hf_estimate.py),
        # the root with them in it was +6.7 % over the step peak, -0.02 % without; the head's gathered
        # copy at the backward's start would put that phase +3.8 % over its measured peak, -0.02 % without.
        own_emb, own_head = _own_unit_params(model, plan, layout)
        unit, root = unit_params * gathered, max(0, root_params - own_emb - own_head) * gathered
        # forward: the root unit (embedding/head) and, under ZeRO-3, the last block's flat all-gather
        # output, kept until the next unit's copy-out (``comm_ctx.all_gather_state``); a replicate mesh's
        # shard group has size 1 and keeps none (torch 2.13 ``_fsdp_param_group.py``,
        # ``FSDPParamGroup.wait_for_unshard``: ``world_size > 1``); measured on 2 gloo ranks,
        # examples/fabric memplan_auto dp=2 (tests/integration/test_examples.py): one block's
        # parameters over without this. Backward: current + prefetched block and the unsharded
        # gradient of one block waiting for reduce-scatter.
        # reshard_after_forward=n (1 < n < d): every block keeps 1/n of its gathered parameters from its
        # forward to its backward (terms.fsdp_post_forward_shard_bytes), all of them at the loss; at the
        # last block's backward that block and the prefetched one have been re-gathered (their slices
        # dropped), the other L - 2 still hold theirs.
        post_fwd = functools.partial(terms.fsdp_post_forward_shard_bytes, unit, reshard_to=plan.reshard_to, shard=shard)
        comm_fwd = root + (unit if plan.zero == 3 and shard > 1 else 0) + post_fwd(layout.n_layers)
        comm_bwd = root + 2 * unit + unit // gathered * pb.grad + post_fwd(max(layout.n_layers - 2, 0))
        if pipelined_fsdp:  # every unit stays unsharded after its backward; its gradient is in grads_accum
            comm_bwd = local * gathered
        # When the loss's backward starts (the logits' gradient), no block has been re-gathered yet:
        # FSDP2 unshards a block in its pre-backward hook [PT fully_shard].
        comm_bwd_start = root + post_fwd(layout.n_layers)
        if not pipelined_fsdp and root:
            # the root unit reduce-scatters last, in the backward's final callback: its unsharded
            # gradients and their reduce-dtype copy-in (its gathered parameters are freed just before)
            root_end = terms.fsdp_root_post_backward_bytes(root // gathered, gathered, pb.grad)
            comm_bwd_end = max(comm_bwd, root_end)
    extra = 0
    if plan.tp > 1:
        extra += b * s * model.hidden * pb.compute
    if plan.pp > 1:
        extra += 2 * b * s * model.hidden * pb.residual  # p2p send/receive buffers
    if plan.cp > 1:
        extra += 2 * 2 * b * s * model.kv_heads // plan.tp * model.dim_head * pb.compute  # ring k/v
    comm_fwd += extra
    comm_bwd += extra
    comm_bwd_start = comm_bwd if comm_bwd_start is None else comm_bwd_start + extra
    comm_bwd_end = comm_bwd if comm_bwd_end is None else comm_bwd_end + extra

    dynamic = _dynamic(model, train, plan, layout)
    source = "analytic"
    if calibration is not None:
        dynamic = _calibrated_dynamic(model, train, plan, layout, calibration, dynamic)
        source = "calibrated"

    # Gradients of the final norm and lm_head exist once the loss's backward is done.
    # (with tied embeddings the shared matrix's gradient is allocated here too).
    head_grads = 0
    if layout.has_head:
        head_params = terms.norm_param_count(model) + math.ceil(model.vocab_size * model.hidden / plan.tp)
        head_grads = frozen_parts.grad_params(model, head_params, "head") * pb.grad  # [frozen hook 2]
        if plan.zero >= 2:
            head_grads = math.ceil(head_grads / shard) if not pipelined_fsdp else head_grads
    # At the last block's eager softmax backward (dynamic "backward_softmax") the gradients of that block's
    # parameters after the scores exist too (output projection, second norm, MLP; split as the stage's
    # parameters are). Under FSDP (zero >= 2, sharded) a unit's unsharded gradients are comm's (its block
    # gradient waiting for the reduce-scatter).
    softmax_grads = 0
    if "backward_softmax" in dynamic and not (plan.zero >= 2 and shard > 1 and not pipelined_fsdp):
        after_matmul, after_other = param_counts.layer_params_after_scores(model)
        norm = terms.norm_param_count(model)
        after = math.ceil(after_matmul / plan.tp) + math.ceil(max(after_other - norm, 0) / plan.tp) + norm
        if model.n_params is not None:  # rescaled as _local_params_of rescales the stage's parameters
            after = round(after * model.n_params / terms.param_count(model))
        softmax_grads = frozen_parts.grad_params(model, after, "last_block") * pb.grad  # [frozen hook 2]
    # At the first block's rebuilt backward (dynamic "backward_first", pp = 1) the embedding's gradient
    # does not exist yet (its backward comes last); a tied embedding's is the head's, already there.
    first_missing = 0
    if "backward_first" in dynamic and layout.has_embedding and not model.tied_embeddings:
        emb = math.ceil(terms.embedding_param_count(model) / plan.tp)
        if model.n_params is not None:  # rescaled as _local_params_of rescales the stage's parameters
            emb = round(emb * model.n_params / terms.param_count(model))
        first_missing = frozen_parts.grad_params(model, emb, "embedding") * pb.grad  # [frozen hook 2]
        if plan.zero >= 2 and not pipelined_fsdp:
            first_missing = math.ceil(first_missing / shard)
    static = {"params": params, "optimizer": optimizer, "master": master}
    points: dict[str, dict[str, int]] = {}
    if plan.pp == 1:
        accumulating = train.grad_accumulation > 1
        grads_fwd = grads if (train.grads_alive_in_forward or accumulating) else 0
        grads_bwd_start = grads if accumulating else 0
        points["forward"] = {**static, "grads": grads_fwd, "comm": comm_static + comm_fwd, **dynamic["forward"]}
        for key in ("forward_block", "forward_checkpoint"):  # inside the last block's forward
            if key in dynamic:  # (activation offloading; full recompute with eager attention)
                points[key] = {**static, "grads": grads_fwd, "comm": comm_static + comm_fwd, **dynamic[key]}
        points["backward_start"] = {
            **static, "grads": grads_bwd_start, "comm": comm_static + comm_bwd_start, **dynamic["backward_start"]
        }
        points["backward_layer"] = {
            **static, "grads": max(grads_bwd_start, head_grads), "comm": comm_static + comm_bwd, **dynamic["backward_layer"]
        }
        if "backward_softmax" in dynamic:
            points["backward_softmax"] = {
                **static, "grads": max(grads_bwd_start, head_grads + softmax_grads), "comm": comm_static + comm_bwd,
                **dynamic["backward_softmax"],
            }
        points["backward_end"] = {
            **static, "grads": grads_accum, "comm": comm_static + comm_bwd_end, **dynamic["backward_end"]
        }
        if "backward_first" in dynamic:  # full recompute: the first block's rebuilt backward
            points["backward_first"] = {
                **static, "grads": max(grads_bwd_start, grads_accum - first_missing),
                "comm": comm_static + comm_bwd, **dynamic["backward_first"],
            }
    else:
        # A pipeline step drops the previous step's gradients before its schedule runs (the optimizer
        # has consumed them); each local chunk's gradients appear at its first backward of the step.
        # Every backward of the rank's schedule is a candidate (pipeline_timeline): the micro-batches it
        # still holds next to the gradients that exist by then [N21 2.2]. Accumulating across steps
        # keeps every gradient alive throughout.
        acts_share, grads_share = _chunk_shares(model, plan, layout, train.framework)
        v = plan.virtual_stages if plan.schedule == "interleaved" else 1
        moments = pipeline_timeline.stage_moments(
            layout.stage, plan.pp, plan.microbatches, plan.schedule, v, acts_share, grads_share, layout.has_head
        )
        accumulating = train.grad_accumulation > 1

        def grads_at(fraction: float) -> int:
            return grads_accum if accumulating else round(grads_accum * fraction)

        # The forward with the most micro-batches in flight is the one just before the latest backward
        # that still holds them all: that backward's earlier gradients exist during it.
        all_unsharded = local * gathered + extra  # every unit of the stage gathered, with the p2p buffers
        most = max(mom.inflight for mom in moments)
        grads_fwd = grads_at(max(mom.grads_before for mom in moments if mom.inflight >= most - 1e-9))
        points["forward"] = {**static, "grads": grads_fwd, "comm": comm_static + comm_fwd, **dynamic["forward"]}
        if pipelined_fsdp and grads_fwd:
            # a forward after a backward starts with every unit still unsharded (the backward kept them);
            # each unit reshards after its forward (measured, 2 x 4 gloo ranks, dp=2 tp=2 pp=2), so at
            # that moment only the micro-batches held before it exist
            start = dict(dynamic["forward"], logits=0)
            for comp in ("activations", "attention"):
                start[comp] = round(start[comp] * max(0.0, most - 1) / most)
            points["forward_start"] = {**static, "grads": grads_fwd, "comm": comm_static + all_unsharded, **start}
        best: tuple[int, dict[str, int]] = (-1, {})
        static_total = sum(static.values()) + comm_static
        for mom in moments:
            dyn = _dynamic(model, train, plan, layout, mom)
            if calibration is not None:
                dyn = _calibrated_dynamic(model, train, plan, layout, calibration, dyn)
            before, after = grads_at(mom.grads_before), grads_at(mom.grads_after)
            head_new = head_grads if mom.loss_backward and mom.grads_after > mom.grads_before else 0
            start_comm = comm_bwd_start
            if pipelined_fsdp and plan.zero == 3 and mom.grads_before > 0:
                # ZeRO-3 re-gathers the units its forward resharded: at the B1 peak of 2 x 2 gloo ranks
                # (dp=2 zero=3 pp=2 m=2, tests/distributed/test_strategy_3d.py) one gathered unit and
                # 77.6 KB of all-gather/reduce temporaries sat beside the accumulated gradients; the
                # whole stage unsharded stands for them (-3.1 %; the reshard alone gave -5.6 %).
                # Replication (shard group of 1) only copies, and matched the reshard (+2.0 %).
                start_comm = max(comm_bwd_start, all_unsharded)
            block_new = softmax_grads if not accumulating and mom.grads_after > mom.grads_before else 0
            for key, grads_now, comm_now in (
                ("backward_start", before, start_comm),
                ("backward_layer", before + head_new, comm_bwd),
                ("backward_softmax", before + head_new + block_new, comm_bwd),
                ("backward_end", after, comm_bwd_end),
                ("backward_first", after, comm_bwd),
            ):
                if key not in dyn:
                    continue
                total = static_total + grads_now + comm_now + sum(dyn[key].values())
                if total > best[0]:  # only the largest point is built (the planner evaluates many)
                    best = (total, {"grads": grads_now, "comm": comm_static + comm_now, **dyn[key]})
        points["backward"] = {**static, **best[1]}
    points["optimizer"] = {**static, "grads": grads, "comm": comm_static, **dynamic["optimizer"]}
    if calibration is None:  # a calibrated optimizer phase already holds the traced step's temporaries
        points["optimizer"]["workspace"] += opt_ws
    host_layout = None
    if offload.offloads_params(train) or train.offload_activations:
        host_layout = _apply_offloads(points, model, train, plan, layout, local=local, params=params, grads=grads,
                                      optimizer=optimizer, master=master, opt_local=opt_local, largest=largest,
                                      opt_ws=opt_ws)
    by_phase = {
        "forward": max((points[k] for k in points if k.startswith("forward")), key=lambda c: sum(c.values())),
        "backward": max(
            (points[k] for k in points if k.startswith("backward")), key=lambda c: sum(c.values())
        ),
        "optimizer": points["optimizer"],
    }
    by_phase = {p: {c: int(by_phase[p].get(c, 0)) for c in COMPONENTS} for p in PHASES}
    peak_phase = max(PHASES, key=lambda p: sum(by_phase[p].values()))
    details = {
        "local_params": local,
        "autocast_weight_copies": terms.autocast_copy_bytes(matmul, train),
        "optimizer_workspace": opt_ws,
        "layers_on_stage": layout.n_layers,
        "inflight_microbatches_x1000": round(1000 * inflight),
        "batch_input": terms.batch_input_bytes(_batch_tokens(train, plan)),
    }
    if host_layout is not None:
        details.update({f"host_{part}": value for part, value in host_layout.host.items()})
        details.update(host_pinned=host_layout.pinned, offload_h2d_bytes=host_layout.h2d,
                       offload_d2h_bytes=host_layout.d2h)
    return MemoryEstimate(
        **by_phase[peak_phase],
        peak_phase=peak_phase,
        rank=rank,
        stage=stage,
        by_phase=by_phase,
        details=details,
        source=source,
        host=0 if host_layout is None else host_layout.total,
    )


def _apply_offloads(
    points: dict[str, dict[str, int]],
    model: ModelSpec,
    train: TrainSpec,
    plan: ParallelPlan,
    layout: StageLayout,
    *,
    local: int,
    params: int,
    grads: int,
    optimizer: int,
    master: int,
    opt_local: int,
    largest: int,
    opt_ws: int,
) -> offload.HostLayout:
    """Move what FSDP2's offloads keep on the host out of the device ``points`` (in place) and return the
    host side (``lightning_memplan.model.offload``; pp = 1, checked by :func:`check_compatible`).

    ``CPUOffloadPolicy``: the sharded parameters, gradients, optimizer states and master copies leave every
    point; the CPU step's temporaries replace the device optimizer's; during the backward one unit's
    host-to-device all-gather input and the previous unit's reduce-scatter output (``ceil(U/d) (e + g)``)
    sit on the device until their copies finish. Activation offloading: the blocks' device activations
    are already one block's working set (``_per_micro_batch``); their packed saves are host bytes."""
    shard = plan.dp * plan.cp
    accumulation = train.grad_accumulation
    pb = terms.precision_bytes(train)
    host = offload.HostLayout(host=dict.fromkeys(offload.HOST_PARTS, 0), pinned=0, h2d=0, d2h=0)
    if offload.offloads_params(train):
        unit_params, _ = _fsdp_units(model, plan, layout, local)
        # a CPU step copies nothing: the all-gather input is the shard, the reduce-scatter output the host gradient
        in_flight = offload.unit_shard_params(unit_params, plan) * (pb.param + pb.grad) if train.device == "cuda" else 0
        for key, point in points.items():
            for comp in ("params", "grads", "optimizer", "master"):
                point[comp] = 0
            if key.startswith("backward") and key != "backward_start":
                point["comm"] += in_flight
        points["optimizer"]["workspace"] = max(0, points["optimizer"]["workspace"] - opt_ws)
        host = offload.params_host_layout(
            params=params, grads=grads, optimizer=optimizer, master=master,
            step_workspace=offload.cpu_step_workspace_bytes(train, opt_local, math.ceil(largest / shard)),
            gathers=2 if (plan.zero == 3 or shard == 1) else 1, accumulation=accumulation,
        )
    if train.offload_activations:
        mb = _per_micro_batch(model, train, plan, layout)
        b, s = train.micro_batch, train.seq_len // plan.cp
        acts = offload.activation_host_bytes(
            model, train, b=b, s=s, n_layers=layout.n_layers,
            saved_layer=mb.saved_layer, attn_layer=terms.eager_attention_bytes(model, train, b, s, t=plan.tp),
            matmul_params=_blocks_matmul_local(model, plan.tp, layout.n_layers), t=plan.tp, sp=plan.sp,
        )
        parts = dict(host.host, activations=acts)
        host = offload.HostLayout(host=parts, pinned=host.pinned + acts, h2d=host.h2d + accumulation * acts,
                                  d2h=host.d2h + accumulation * acts)
    if train.device != "cuda":  # a CPU step pins nothing (memplan_auto passes pin_memory=False there)
        host = dataclasses.replace(host, pinned=0)
    return host


def _deepspeed_stage(
    model: ModelSpec,
    train: TrainSpec,
    plan: ParallelPlan,
    layout: StageLayout,
    rank: int,
    calibration: Calibration | None,
    *,
    local: int,
    trainable: int,
    largest: int,
    opt_ws: int,
) -> MemoryEstimate:
    """One rank under DeepSpeed's ZeRO engine (``TrainSpec(framework="deepspeed")``, pp = cp = 1): the
    model states, reduce buckets, gathered stage-3 parameters and host bytes of
    :func:`lightning_memplan.model.deepspeed.zero_layout`, beside the activation, attention and logits
    terms every framework shares (DeepSpeed runs the module's own kernels). The on-device optimizer's
    temporaries (``opt_ws``, 0 with offload: the step runs on the CPU) come with the step's gradient
    conversion."""
    config = train.zero_config or frameworks.ZeroConfig()
    persistent = deepspeed.persistent_param_count(model, config, plan.tp) if plan.zero == 3 else 0
    zl = deepspeed.zero_layout(train, stage=plan.zero, d=plan.dp, local=local, trainable=trainable,
                               largest=largest, persistent=persistent)
    dynamic = _dynamic(model, train, plan, layout)
    source = "analytic"
    if calibration is not None:
        dynamic = _calibrated_dynamic(model, train, plan, layout, calibration, dynamic)
        source = "calibrated"
    pb = terms.precision_bytes(train)
    tp_buffer = train.micro_batch * train.seq_len * model.hidden * pb.compute if plan.tp > 1 else 0
    points: dict[str, dict[str, int]] = {}
    # the last block's eager softmax backward (when it is a point) falls in DeepSpeed's backward_layer
    keys = [(key, key) for key in deepspeed.POINTS]
    if "backward_softmax" in dynamic:
        keys.append(("backward_softmax", "backward_layer"))
    if "backward_first" in dynamic:  # full recompute's first block rebuilt: every gradient as at the end
        keys.append(("backward_first", "backward_end"))
    for key, zero_key in keys:
        comm = zl.comm[zero_key] + (tp_buffer if key != "optimizer" else 0)
        points[key] = {"params": zl.params, "optimizer": zl.optimizer, "master": zl.master,
                       "grads": zl.grads[zero_key], "comm": comm, **dynamic[key]}
    if calibration is None:  # a calibrated optimizer phase already holds the traced step's temporaries
        points["optimizer"]["workspace"] += opt_ws
    points["optimizer"]["workspace"] += zl.workspace
    by_phase = {
        "forward": points["forward"],
        "backward": max((points[k] for k in points if k.startswith("backward")), key=lambda c: sum(c.values())),
        "optimizer": points["optimizer"],
    }
    by_phase = {p: {c: int(by_phase[p].get(c, 0)) for c in COMPONENTS} for p in PHASES}
    peak_phase = max(PHASES, key=lambda p: sum(by_phase[p].values()))
    details = {
        "local_params": local,
        "autocast_weight_copies": 0,
        "optimizer_workspace": opt_ws,
        "layers_on_stage": layout.n_layers,
        "batch_input": terms.batch_input_bytes(_batch_tokens(train, plan)),
        "zero_stage": plan.zero,
        "zero_model_states_peak": zl.model_states_peak,
        "zero_fp32_grad_partition": zl.fp32_grad_partition,
        "zero_gathered_largest": zl.gathered_largest,
        "zero_persistent_params": persistent,
        **{f"host_{part}": value for part, value in zl.host.items()},
    }
    return MemoryEstimate(**by_phase[peak_phase], peak_phase=peak_phase, rank=rank, stage=layout.stage,
                          by_phase=by_phase, details=details, source=source, host=sum(zl.host.values()))


def estimate_memory(
    model: ModelSpec,
    train: TrainSpec,
    plan: ParallelPlan | None = None,
    *,
    rank: int | None = None,
    calibration: Calibration | None = None,
) -> MemoryEstimate:
    """Predicted peak allocated-tensor bytes of one rank, per component.

    Args:
        model: the architecture (:class:`ModelSpec`).
        train: batch shape, precision, optimizer, recompute, attention and loss (:class:`TrainSpec`).
        plan: the parallel layout (:class:`ParallelPlan`); ``None`` means one device.
        rank: a global rank (mesh order pp, dp, cp, tp with tp fastest); ``None`` returns the worst
            rank. Ranks differ only by pipeline stage.
        calibration: coefficients fitted by :func:`lightning_memplan.tracking.trace.calibrate` for this
            model; replaces the analytic activation/attention/logits/workspace/other terms.

    Returns:
        :class:`MemoryEstimate` in integer bytes; steady state (optimizer states exist, the previous
        step's gradients are alive during the forward as in Lightning's loop).

    Raises:
        ValueError: the plan cannot split this model or batch (see :func:`check_compatible`).
        TypeError: an argument is not the expected spec type.
    """
    for name, value, cls in (("model", model, ModelSpec), ("train", train, TrainSpec)):
        if not isinstance(value, cls):
            raise TypeError(f"{name}={value!r} must be a {cls.__name__}")
    plan = plan if plan is not None else ParallelPlan()
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"plan={plan!r} must be a ParallelPlan (or None for one device)")
    if calibration is not None and not isinstance(calibration, Calibration):
        raise TypeError(f"calibration={calibration!r} must be a Calibration from trace.calibrate()")
    rank = check_optional_int("rank", rank, minimum=0, maximum=plan.world_size - 1,
                              hint=f"a global rank of this plan's {plan.world_size} ranks, or None for the worst one")
    check_compatible(model, train, plan)
    source = model.calibration_source
    if calibration is None and source is not None and source.available():
        # traced coefficients handed over with the spec (e.g. a Hugging Face config's real class): scaled
        # by the analytic terms (model/traced.py); None when the source has nothing for this spec
        traced = traced_estimate(model, train, plan, rank=rank, source=source, stage_estimate=_estimate_stage)
        if traced is not None:
            return traced
    if rank is not None:
        return _estimate_stage(model, train, plan, plan.stage_of_rank(rank), rank, calibration)
    ranks_per_stage = plan.dp * plan.cp * plan.tp
    estimates = [
        _estimate_stage(model, train, plan, stage, stage * ranks_per_stage, calibration) for stage in range(plan.pp)
    ]
    return max(estimates, key=lambda e: e.total)
