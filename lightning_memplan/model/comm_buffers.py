"""Stage 3 of the estimate: one rank's communication buffers at each point of the step
(``docs/architecture.md``, "The estimate's stages").

:func:`comm_buffers` reads the resolved stage and its :class:`~lightning_memplan.model.states.StageStates`
and returns :class:`CommBuffers`: DDP's gradient buckets, FSDP2's gathered units (ZeRO-2's kept copies,
ZeRO-3's current and prefetched blocks, the root unit, ``reshard_after_forward=n`` slices, the root's
post-backward reduce), FSDP1's flat gradient, and the tensor-, pipeline- and context-parallel buffers.
DeepSpeed's buckets and gathered parameters come with its states (:class:`~lightning_memplan.model.
deepspeed.ZeroLayout`); only the parallel buffers are added here. [PT fully_shard]: torch 2.13
``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py`` and ``_fsdp_collectives.py``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from lightning_memplan.model import terms
from lightning_memplan.model.resolve import ResolvedStage
from lightning_memplan.model.specs import ModelSpec, ParallelPlan
from lightning_memplan.model.stage_layout import fsdp_units, own_unit_params
from lightning_memplan.model.states import StageStates

__all__ = ["CommBuffers", "comm_buffers"]


class CommBuffers(NamedTuple):
    """Communication bytes of one rank (a named tuple: one is made on every estimate).

    Attributes:
        static: alive for the whole step (DDP's buckets).
        forward: at the forward's peak. backward: during a block's backward. backward_start: when the
            loss's backward starts (no block re-gathered yet). backward_end: at the end of the backward
            (the root unit's reduce). All of them include :attr:`extra`.
        extra: the tensor-, pipeline- and context-parallel buffers (at every point but the optimizer step).
        all_unsharded: every unit of the stage gathered, with :attr:`extra` (FSDP2 in a pipeline).
    """

    static: int
    forward: int
    backward: int
    backward_start: int
    backward_end: int
    extra: int
    all_unsharded: int


def comm_buffers(model: ModelSpec, r: ResolvedStage, plan: ParallelPlan, states: StageStates) -> CommBuffers:
    """The :class:`CommBuffers` of resolved stage ``r`` (module docstring)."""
    sizes, shard = r.sizes, r.shard
    gathered = sizes.compute if sizes.autocast_copy else sizes.param  # all-gather dtype of FSDP units
    static = forward = backward = 0
    start = end = None  # the loss's backward / the backward's end: as ``backward`` unless set below
    if states.zero is None and shard > 1 and plan.zero <= 1 and plan.grad_buckets and not r.flat_params:
        static = terms.ddp_bucket_bytes(states.grads_unsharded)
    elif states.zero is None and shard > 1 and plan.zero == 2:
        forward, backward = _shard_grad_op(model, r, plan, states, gathered)
    elif states.zero is None and shard > 1 and plan.zero == 0 and r.flat_params:
        # FSDP1 NO_SHARD computes on the flat parameter itself and all-reduces its flat gradient in place
        # (torch 2.13 ``_runtime_utils._reduce_grad_no_shard``): no unsharded copy, no bucket.
        pass
    elif states.zero is None and (
        (shard > 1 and (plan.zero == 3 or (plan.zero == 0 and not plan.grad_buckets))) or states.one_rank_fsdp
    ):
        forward, backward, start, end = _fully_sharded(model, r, plan, states, gathered)
    extra = _parallel_buffers(model, r, plan)
    backward += extra
    return CommBuffers(
        static=static,
        forward=forward + extra,
        backward=backward,
        backward_start=backward if start is None else start + extra,
        backward_end=backward if end is None else end + extra,
        extra=extra,
        all_unsharded=r.params.local * gathered - _low_saving(r, r.layout.n_layers) + extra,
    )


def _low_saving(r: ResolvedStage, blocks: int, root: bool = True) -> int:
    """Bytes ``blocks`` gathered block units (and the root unit, ``root``) hold less than their parameters
    in the gathered dtype: quantized base weights gathered as their packed values, float8 weights under
    the float8 all-gather (``model/low_precision.py``); 0 without them."""
    low = r.low
    if low is None:
        return 0
    return blocks * low.gather_block + (low.gather_head if root else 0)


def _shard_grad_op(model: ModelSpec, r: ResolvedStage, plan: ParallelPlan, states: StageStates,
                   gathered: int) -> tuple[int, int]:
    """ZeRO-2 (``(forward, backward)``): SHARD_GRAD_OP keeps every unit unsharded (in the 16-bit compute
    dtype under mixed precision: FSDP's MixedPrecisionPolicy) from its forward until its backward.

    In forward, FSDP2 also keeps the last unit's flat all-gather output alive until the next unit's
    copy-out (synchronous all-gather, world size > 1: ``FSDPParamGroup.wait_for_unshard`` stores it in
    ``comm_ctx.all_gather_state``) [PT fully_shard]; the last block's is still alive at the loss. Measured
    on 2 gloo ranks (tests/distributed/test_strategy_budget.py): without it -5.5 %, exactly one block's
    parameters short."""
    forward = backward = r.params.local * gathered - _low_saving(r, r.layout.n_layers)
    block = math.ceil(terms.layer_param_count(model) / plan.tp)
    if r.flat_params:
        # FSDP1 gathers straight into each unit's unsharded flat parameter and keeps nothing else
        # (``FlatParamHandle._all_gather_flat_param``); its reduce-scatter needs the unit's unsharded
        # flat gradient (``_runtime_utils._reduce_grad``), as the per-block gradient of the backward
        # below. Measured on 2 gloo ranks (tests/distributed/test_fsdp1.py): FSDP2's extra block here
        # over-estimated SHARD_GRAD_OP by +5.3 %, one block's parameters.
        backward += block * r.sizes.grad
    else:
        forward += block * gathered - _low_saving(r, 1, root=False)
    if states.per_mb_grads:  # the block whose gradient waits for its reduce-scatter
        backward += block * r.sizes.grad
    return forward, backward


def _fully_sharded(model: ModelSpec, r: ResolvedStage, plan: ParallelPlan, states: StageStates,
                   gathered: int) -> tuple[int, int, int, int | None]:
    """ZeRO-3, and replication without DDP buckets (``(forward, backward, backward_start, backward_end)``):
    FSDP2 over a replicate mesh (shard size 1) still copies each unit into its unsharded buffer for its
    forward and backward (``FSDPParamGroup.wait_for_unshard``, world size 1 branch) [PT fully_shard].

    An embedding or lm_head that is a unit of its own (``plan.own_units``) is resharded after its forward
    like a block, so it is not in the root. Its re-gather for the loss's backward comes after the logits'
    gradient peak: measured on 2 gloo ranks, an HF Llama under memplan_auto dp=2 (no LinearCrossEntropy,
    so the head has its own unit; tests/distributed/test_memplan_auto_hf_estimate.py), the root with them
    in it was +6.7 % over the step peak, -0.02 % without; the head's gathered copy at the backward's start
    would put that phase +3.8 % over its measured peak, -0.02 % without.

    Forward: the root unit (embedding/head) and, under ZeRO-3, the last block's flat all-gather output,
    kept until the next unit's copy-out (``comm_ctx.all_gather_state``); a replicate mesh's shard group
    has size 1 and keeps none (``FSDPParamGroup.wait_for_unshard``: ``world_size > 1``); measured on 2
    gloo ranks, examples/fabric memplan_auto dp=2 (tests/integration/test_examples.py): one block's
    parameters over without this. Backward: current + prefetched block and the unsharded gradient of one
    block waiting for reduce-scatter. ``reshard_after_forward=n`` (1 < n < d): every block keeps 1/n of its
    gathered parameters from its forward to its backward (``terms.fsdp_post_forward_shard_bytes``), all of
    them at the loss; at the last block's backward that block and the prefetched one have been re-gathered
    (their slices dropped), the other L - 2 still hold theirs."""
    shard, n_layers = r.shard, r.layout.n_layers
    unit_params, root_params = fsdp_units(model, plan.tp, plan.pp > 1, r.layout, r.params.local)
    own_emb, own_head = own_unit_params(model, plan, r.layout)
    unit, root = unit_params * gathered, max(0, root_params - own_emb - own_head) * gathered
    # quantized or float8 weights gathered in fewer bytes; only a quantized base's adapter gets gradients
    unit -= _low_saving(r, 1, root=False)
    root -= _low_saving(r, 0, root=not own_head)
    grad_params = r.low.block_trainable if r.low is not None and r.low.quantized_bytes else unit_params
    post_fwd = functools.partial(terms.fsdp_post_forward_shard_bytes, unit, reshard_to=plan.reshard_to, shard=shard)
    sharded = plan.zero == 3 and shard > 1  # all-gathers into buffers of their own (a shard group of 1 only copies)
    forward = root + (unit if sharded else 0) + post_fwd(n_layers)
    backward = root + _backward_units(sharded) * unit + grad_params * r.sizes.grad + post_fwd(max(n_layers - 2, 0))
    if states.pipelined_fsdp:  # every unit stays unsharded after its backward; its gradient is in grads_accum
        backward = r.params.local * gathered - _low_saving(r, n_layers)
    # When the loss's backward starts (the logits' gradient), no block has been re-gathered yet: FSDP2
    # unshards a block in its pre-backward hook [PT fully_shard]; the root's own pre-backward hook has
    # prefetched the last unit of the forward by then.
    prefetch = 0 if r.flat_params else _loss_backward_prefetch(unit, own_head * gathered, sharded=sharded)  # FSDP2's
    start = root + prefetch + post_fwd(n_layers)
    end = None
    if not states.pipelined_fsdp and root:
        # the root unit reduce-scatters last, in the backward's final callback: its unsharded gradients
        # and their reduce-dtype copy-in (its gathered parameters are freed just before)
        root_grads = max(0, root_params - own_emb - own_head)  # (a frozen root's gradients: not modelled apart)
        end = max(backward, terms.fsdp_root_post_backward_bytes(root_grads, gathered, r.sizes.grad))
    return forward, backward, start, end


def _backward_units(sharded: bool) -> int:
    """Gathered block units alive during a block's backward: its own unsharded parameters and, when the
    units are sharded over more than one rank, the next block's all-gather output that its pre-backward hook
    prefetched (``FSDPParamGroup._backward_prefetch`` -> ``unshard``: ``foreach_all_gather`` allocates it).
    On a shard group of one rank (FSDP2 over a replicate mesh: DDP semantics) ``unshard`` allocates nothing
    and ``wait_for_unshard`` copies the parameters in when the block's backward starts, so one unit
    [PT fully_shard]. Measured on 2 gloo ranks (tests/distributed/test_memplan_auto_qlora.py, dp=2 with
    selective_op recompute, the tensor tracker's timeline): the largest communication bytes of a block's
    backward were the root unit plus exactly one block unit (1,155,072 = 1,049,088 + 105,984 B)."""
    return 2 if sharded else 1


def _loss_backward_prefetch(unit: int, own_head: int, *, sharded: bool) -> int:
    """Bytes FSDP2 has all-gathered when the loss's backward starts: the root unit's pre-backward hook
    (registered on the step's output, the loss) prefetches the unit whose forward ended last,
    ``comm_ctx.post_forward_order[-2]`` (``FSDPParamGroup._backward_prefetch``) -- the lm_head when it
    is a unit of its own (``own_head``: its parameters' gathered bytes), else the last block -- before the
    logits' gradient exists [PT fully_shard]; 0 on a shard group of one rank (nothing is allocated until
    the copy-in). Measured on 2 gloo ranks, FSDP2 ZeRO-3 over a bitsandbytes NF4 Llama + LoRA
    (tests/distributed/test_fsdp_qlora.py): without it the step was 1.0-1.1 % under the measurement,
    about one gathered block (105,984 B); an HF Llama under memplan_auto dp=2 zero=3 (embedding and head in
    units of their own; tests/distributed/test_strategy_memory_tp.py) -1.15 %, 131,160 B. FSDP1's flat
    parameters (its own backward prefetch) are not modelled here."""
    if not sharded:
        return 0
    return own_head or unit


def _parallel_buffers(model: ModelSpec, r: ResolvedStage, plan: ParallelPlan) -> int:
    """The tensor-parallel all-gather/reduce-scatter buffer ``b s h`` (compute dtype), the pipeline's
    send/receive buffers ``2 b s h`` (residual dtype) and the ring attention's key/value blocks
    ``2 x 2 b s k d_h / t`` (compute dtype)."""
    b, s, sizes = r.b, r.s, r.sizes
    extra = 0
    if plan.tp > 1:
        extra += b * s * model.hidden * sizes.compute
    if plan.pp > 1:
        extra += 2 * b * s * model.hidden * sizes.residual  # p2p send/receive buffers
    if plan.cp > 1:
        extra += 2 * 2 * b * s * model.kv_heads // plan.tp * model.dim_head * sizes.compute  # ring k/v
    return extra
