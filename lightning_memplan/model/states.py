"""Stage 2 of the estimate: one rank's model states by framework, the one place for the sharding rules
(``docs/architecture.md``, "The estimate's stages").

:func:`stage_states` turns a :class:`~lightning_memplan.model.resolve.ResolvedStage` and the plan into a
:class:`StageStates`: the parameters, gradients, optimizer states and master copies a rank holds, under

- one device and DDP (replicated states; DDP's buckets are communication, ``model/comm_buffers.py``);
- ZeRO-1 (optimizer states and master copies sharded over ``dp * cp``) and FSDP2's ZeRO-2/3 (parameters
  and gradients sharded too);
- FSDP1 (``framework="fsdp1"``): one padded ``FlatParameter`` per unit (``terms.fsdp1_rank_flat_numel``);
- FSDP2 inside pipeline stages: unsharded gradients accumulated until the step's reduce-scatter, or
  Llama 3's per-micro-batch reduce-scatter (``frameworks.FrameworkFacts.grads_per_microbatch``);
- DeepSpeed's ZeRO engine (``framework="deepspeed"``): :func:`lightning_memplan.model.deepspeed.
  zero_layout` (its states per point of the step, on the device or the host);
- frozen parameters (a LoRA base, a frozen backbone): no gradients, optimizer states or master copies
  for them; the gradients at the backward's points follow the frozen layout (``model/frozen.py``:
  a frozen head or embedding has none, the last block's are its trainable share).

FSDP2's ``CPUOffloadPolicy`` and DeepSpeed's offloads move these states to the host in the last stage
(``model/assemble.py``), where the device points are known. Quantized frozen base weights (QLoRA) are
one (:func:`_quantized_params`); paged optimizer states are host bytes. A new way to hold states
(expert-parallel groups) is a rule here: its element sizes come from ``model/sizes.py``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from lightning_memplan.model import deepspeed, param_counts, terms
from lightning_memplan.model import frozen as frozen_parts
from lightning_memplan.model.resolve import ResolvedStage
from lightning_memplan.model.specs import ModelSpec, ParallelPlan
from lightning_memplan.model.stage_layout import fsdp_units, rescaled

__all__ = ["StageStates", "stage_states"]


class StageStates(NamedTuple):
    """One rank's model states (device bytes before any offload) and the gradients that exist at the
    backward's points. (A named tuple, not a frozen dataclass: one is made on every estimate, and the
    planner asks for thousands.)

    Attributes:
        params, optimizer, master: bytes for the whole step.
        grads: the gradients once the step's reduce ran (sharded under ZeRO >= 2).
        grads_accum: the stage's gradients before that reduce (unsharded under FSDP2 in a pipeline).
        grads_unsharded: every trainable gradient unsharded (what DDP's buckets mirror).
        opt_local: the parameters the optimizer steps on this rank. opt_ws: the step's temporaries.
        head_grads: the final norm's and lm_head's gradients, once the loss's backward ran.
        after_scores_grads: the gradients of the last block's parameters after the attention scores, at
            its eager softmax backward (0 where a unit's unsharded gradients are communication).
        first_missing: the embedding's gradient, not yet made at the first block's rebuilt backward.
        pipelined_fsdp: FSDP2 in a pipeline keeps units unsharded and accumulates unsharded gradients.
        per_mb_grads: Llama 3's FSDP reduce-scatters every micro-batch's gradients.
        one_rank_fsdp: FSDP2's ``CPUOffloadPolicy`` on one data-parallel rank (a one-rank mesh).
        zero: DeepSpeed's placement (``framework="deepspeed"``), else ``None``.
        zero_persistent: DeepSpeed ZeRO-3's parameters kept whole on every rank.
        paged_optimizer: optimizer states in CUDA unified memory (bitsandbytes' paged optimizers): host
            bytes, not in :attr:`optimizer`.
    """

    params: int
    grads: int
    grads_accum: int
    grads_unsharded: int
    optimizer: int
    master: int
    opt_local: int
    opt_ws: int
    head_grads: int
    after_scores_grads: int
    first_missing: int
    pipelined_fsdp: bool
    per_mb_grads: bool
    one_rank_fsdp: bool
    zero: deepspeed.ZeroLayout | None = None
    zero_persistent: int = 0
    paged_optimizer: int = 0


def stage_states(model: ModelSpec, r: ResolvedStage, plan: ParallelPlan) -> StageStates:
    """The :class:`StageStates` of resolved stage ``r`` under ``plan`` (the module docstring's rules)."""
    local, largest, shard = r.params.local, r.params.largest, r.shard
    sizes, per_param = r.sizes, r.optimizer.per_param
    states = terms.model_state_bytes(local, sizes, per_param)
    trainable_local = local
    if model.n_trainable_params is not None:  # frozen parameters: no gradients, optimizer states or masters
        trainable_local = round(local * model.trainable_fraction)
        states = {**terms.model_state_bytes(trainable_local, sizes, per_param), "params": states["params"]}
    # zero=2 is FSDP2 ``fully_shard(reshard_after_forward=False)`` (SHARD_GRAD_OP, parallel/mesh.py):
    # the parameters are sharded as for zero=3 (each rank keeps its 1/N shard for the whole step); the
    # unsharded copy it keeps from forward to backward is communication (model/comm_buffers.py) [PT
    # fully_shard]. Measured on 2 gloo ranks (tests/distributed/test_zero2_memory.py): a whole-parameter
    # term here over-estimated by the other ranks' shards, +2.9 %.
    params = math.ceil(states["params"] / shard) if plan.zero >= 2 else states["params"]
    if r.low is not None and r.low.quantized_bytes:
        params = _quantized_params(r, plan)
    grads = math.ceil(states["grads"] / shard) if plan.zero >= 2 else states["grads"]
    if r.flat_params and plan.zero >= 2 and shard > 1 and local:
        params, grads = _fsdp1_flat(model, r, plan, states)
    pipelined_fsdp, per_mb_grads = _pipelined_fsdp(r, plan)
    opt_local = math.ceil(trainable_local / shard) if plan.zero >= 1 else trainable_local
    opt_ws = terms.optimizer_workspace_bytes(r.optimizer, opt_local, largest)
    head, after_scores, first_missing = _point_grads(model, r, plan, pipelined_fsdp)
    optimizer = math.ceil(states["optimizer"] / shard) if plan.zero >= 1 else states["optimizer"]
    out = StageStates(
        params=params,
        grads=grads,
        grads_accum=states["grads"] if pipelined_fsdp else grads,
        grads_unsharded=states["grads"],
        optimizer=0 if r.optimizer.paged else optimizer,
        master=math.ceil(states["master"] / shard) if plan.zero >= 1 else states["master"],
        opt_local=opt_local,
        opt_ws=opt_ws,
        head_grads=head,
        after_scores_grads=after_scores,
        first_missing=first_missing,
        pipelined_fsdp=pipelined_fsdp,
        per_mb_grads=per_mb_grads,
        # FSDP2's CPUOffloadPolicy on one data-parallel rank: memplan_auto shards over a one-rank mesh, each
        # block copied into its unsharded buffer for its forward and backward (model/comm_buffers.py)
        one_rank_fsdp=r.offload_params and shard == 1,
        paged_optimizer=optimizer if r.optimizer.paged else 0,
    )
    return _deepspeed(model, r, plan, out, trainable_local) if r.framework == "deepspeed" else out


def _quantized_params(r: ResolvedStage, plan: ParallelPlan) -> int:
    """Parameter bytes with quantized frozen base weights (``model/low_precision.py``): the packed values,
    ``(N_local - Q + A) * param_bytes`` for the rest (A: a :meth:`ModelSpec.with_lora` adapter, not in N),
    both sharded under FSDP (``zero >= 2``: bitsandbytes' packed storage is a parameter FSDP flattens), and
    every layer's ``QuantState`` constants whole on each rank (an attribute of the layer, not a parameter:
    bitsandbytes' ``fix_4bit_weight_quant_state_from_module`` restores it on the gathered weight)."""
    low = r.low
    assert low is not None
    sharded = low.quantized_bytes - low.state_bytes + (max(r.params.local - low.quantized, 0) + low.adapter) * r.sizes.param
    return (math.ceil(sharded / r.shard) if plan.zero >= 2 else sharded) + low.state_bytes


def _fsdp1_flat(model: ModelSpec, r: ResolvedStage, plan: ParallelPlan, states: dict[str, int]) -> tuple[int, int]:
    """FSDP1 (``framework="fsdp1"``): one FlatParameter per unit (the L blocks and the root), each padded to
    a multiple of the shard group, so a rank keeps ``ceil(n_unit / d)`` of every unit
    (``terms.fsdp1_shard_numel``): its (params, grads) bytes."""
    local = r.params.local
    unit_n, root_n = fsdp_units(model, plan.tp, plan.pp > 1, r.layout, local)
    kept = terms.fsdp1_rank_flat_numel([unit_n] * r.layout.n_layers + [root_n], r.shard)
    return math.ceil(states["params"] * kept / local), math.ceil(states["grads"] * kept / local)


def _pipelined_fsdp(r: ResolvedStage, plan: ParallelPlan) -> tuple[bool, bool]:
    """``(pipelined_fsdp, per_mb_grads)``.

    FSDP2 (ZeRO-2/3, or replication without DDP buckets) inside a pipeline stage: the schedule runs every
    micro-batch's backward with ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``
    (torch 2.13 ``torch/distributed/pipelining/stage.py``, ``_PipelineStageBase.backward_maybe_with_nosync``),
    so each unit stays unsharded after its first backward and its *unsharded* gradient accumulates over
    the micro-batches (``FSDPParamGroup.post_backward`` returns before the reduce when ``reduce_grads`` is
    off); one reduce-scatter per unit at the end of the step (``perform_reduce_grad``) leaves the sharded
    gradients. Measured on 2 x 2 gloo ranks, dp=2 pp=2 m=2 (tests/distributed/test_strategy_3d.py): the
    per-block unshard and one-gradient-in-flight terms gave +9.9 % / +8.5 % (stage 0 / 1).

    Llama 3's FSDP reduce-scatters each micro-batch's gradients into the sharded fp32 accumulator
    (arXiv 2407.21783 section 3.3.2, lightning_memplan.model.frameworks): sharded gradients, and one
    unit's unsharded gradient in flight during the backward (communication)."""
    pipelined = plan.pp > 1 and r.shard > 1 and (plan.zero >= 2 or (plan.zero == 0 and not plan.grad_buckets))
    per_mb = pipelined and plan.zero >= 2 and r.grads_per_microbatch
    return pipelined and not per_mb, per_mb


def _point_grads(model: ModelSpec, r: ResolvedStage, plan: ParallelPlan, pipelined_fsdp: bool) -> tuple[int, int, int]:
    """``(head, after_scores, first_missing)`` gradient bytes at the backward's points (the class
    docstring), with the stage's tensor-parallel split and ``n_params`` rescaling."""
    g, t, shard = r.sizes.grad, plan.tp, r.shard
    sharded = plan.zero >= 2 and not pipelined_fsdp  # a unit's gradients are reduce-scattered per block
    head = 0
    if r.layout.has_head:  # with tied embeddings the shared matrix's gradient is allocated here too
        head_params = terms.norm_param_count(model) + math.ceil(model.vocab_size * model.hidden / t)
        head = frozen_parts.grad_params(model, head_params, "head") * g
        if sharded:
            head = math.ceil(head / shard)
    # At the last block's eager softmax backward the gradients of that block's parameters after the scores
    # exist too (output projection, second norm, MLP; split as the stage's parameters are). Under FSDP
    # (zero >= 2, sharded) a unit's unsharded gradients are comm's (its block gradient waiting for the
    # reduce-scatter).
    after_scores = 0
    if r.kernels.eager and not (sharded and shard > 1):
        after_matmul, after_other = param_counts.layer_params_after_scores(model)
        norm = terms.norm_param_count(model)
        after = math.ceil(after_matmul / t) + math.ceil(max(after_other - norm, 0) / t) + norm
        after_scores = frozen_parts.grad_params(model, rescaled(model, after), "last_block") * g
    # At the first block's rebuilt backward (full recompute, pp = 1) the embedding's gradient does not
    # exist yet (its backward comes last); a tied embedding's is the head's, already there.
    first_missing = 0
    if r.kernels.recompute == "full" and r.layout.has_embedding and not model.tied_embeddings:
        emb = rescaled(model, math.ceil(terms.embedding_param_count(model) / t))
        first_missing = frozen_parts.grad_params(model, emb, "embedding") * g
        if sharded:
            first_missing = math.ceil(first_missing / shard)
    return head, after_scores, first_missing


def _deepspeed(model: ModelSpec, r: ResolvedStage, plan: ParallelPlan, states: StageStates, trainable: int) -> StageStates:
    """DeepSpeed's ZeRO engine (pp = cp = 1): its states per point of the step
    (:func:`~lightning_memplan.model.deepspeed.zero_layout`); the on-device optimizer's temporaries are 0
    with offload (the step runs on the CPU)."""
    persistent = deepspeed.persistent_param_count(model, r.zero_config, plan.tp) if plan.zero == 3 else 0
    zl = deepspeed.zero_layout(deepspeed.ZeroInputs(
        sizes=r.sizes, optimizer_per_param=r.optimizer.per_param, config=r.zero_config, offload=r.offload,
        accumulating=r.accumulating, stage=plan.zero, d=plan.dp, local=r.params.local, trainable=trainable,
        largest=r.params.largest, persistent=persistent,
    ))
    return StageStates(
        params=zl.params, grads=zl.grads["optimizer"], grads_accum=zl.grads["backward_end"],
        grads_unsharded=states.grads_unsharded, optimizer=zl.optimizer, master=zl.master,
        opt_local=states.opt_local, opt_ws=0 if r.offload != "none" else states.opt_ws, head_grads=0,
        after_scores_grads=0, first_missing=0, pipelined_fsdp=False, per_mb_grads=False, one_rank_fsdp=False,
        zero=zl, zero_persistent=persistent,
    )
