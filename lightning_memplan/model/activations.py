"""Stage 4 of the estimate: the batch-dependent bytes of one rank along the step's timeline
(``docs/architecture.md``, "The estimate's stages").

:func:`micro_batch_bytes` works out what one micro-batch holds on a rank (:class:`MicroBatchBytes`: saved
activations per block under each recompute mode, the head's saves, the loss's logits, autocast's weight
copies, the rebuilt block and the backward's transients); :func:`activation_points` places them on the
points of the step (:data:`POINTS`), scaled by the micro-batches in flight:

1. forward: saved activations of every in-flight micro-batch + the loss's transient logits + autocast's
   weight copies + the batch. Peak at the loss. Inside the last block's forward: one block's working
   set under activation offloading (``forward_block``), a checkpointed block's eager scores under full
   recompute (``forward_checkpoint``).
2. backward: starts with all activations and the loss's backward buffers (``backward_start``); the last
   block's backward (its rebuild under recompute, ``backward_layer``), with eager attention that block's
   softmax backward (``backward_softmax``: its ``[b, a, s, s]`` temporaries once autograd has released
   what the head and the block's nodes after the softmax saved, ``terms.eager_softmax_backward_*``), the
   first block's rebuilt backward under full recompute (``backward_first``) and the end, activations
   freed (``backward_end``). A linear sweep over layers peaks at one of these points.
3. optimizer step: activations and logits are gone; the batch stays.

Under a pipeline each backward of the rank's schedule is a ``moment``
(:func:`lightning_memplan.model.pipeline_timeline.stage_moments`): the micro-batches it still holds.
:func:`calibrated_points` replaces the analytic bytes by a trace's fitted coefficients.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

from lightning_memplan.model import checkpointing, param_counts, pipeline_timeline, terms
from lightning_memplan.model import frozen as frozen_parts
from lightning_memplan.model.resolve import ResolvedStage
from lightning_memplan.model.result import DYNAMIC_COMPONENTS, Calibration
from lightning_memplan.model.specs import ModelSpec, ParallelPlan
from lightning_memplan.model.stage_layout import blocks_matmul_local, rescaled, routed_experts_local

__all__ = [
    "LOW_PRECISION_HEAD_BACKWARD",
    "LOW_PRECISION_HEAD_POINT",
    "LOW_PRECISION_POINT",
    "PHASE_OF_POINT",
    "MicroBatchBytes",
    "activation_points",
    "calibrated_points",
    "low_precision_points",
    "micro_batch_bytes",
]

#: The phase each point of the timeline belongs to.
PHASE_OF_POINT = {
    "forward": "forward",
    "forward_block": "forward",
    "forward_checkpoint": "forward",
    "forward_low_precision": "forward",
    "forward_head_low_precision": "forward",
    "backward_head_low_precision": "backward",
    "backward_start": "backward",
    "backward_layer": "backward",
    "backward_softmax": "backward",
    "backward_end": "backward",
    "backward_first": "backward",
    "optimizer": "optimizer",
}


@dataclass(frozen=True)
class MicroBatchBytes:
    """The batch-dependent bytes of one rank for one micro-batch, before the schedule multiplies them."""

    block_acts: int
    head_acts: int
    saved_layer: int
    attn_layer: int  # one block's eager attention probabilities (0 without them)
    per_mb_attn: int
    logits: tuple[int, int, int]  # the loss's forward, held and backward bytes
    copies: int
    rebuild: int
    eager_bwd_ws: int
    softmax_point: bool  # the last block's eager softmax backward is a point of its own
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


def _saved_and_rebuild(model: ModelSpec, r: ResolvedStage) -> tuple[int, int]:
    """``(saved bytes per block, bytes of one block rebuilt for its backward)`` under the recompute mode."""
    k, b, s, t, sp = r.kernels, r.b, r.s, r.t, r.sp
    if k.recompute == "full":
        rebuild = terms.layer_activation_bytes(model, k, b, s, t=t, sp=sp) + terms.eager_attention_bytes(
            model, dataclasses.replace(k, recompute="none"), b, s, t=t)
        return terms.full_recompute_layer_bytes(model, k.sizes.residual, b, s, t=t, sp=sp), rebuild
    if k.recompute == "selective_op":
        # torchtitan's op-level policy: the kept outputs per block; the recompute rebuilds the rest
        return (checkpointing.selective_op_layer_bytes(model, k, b, s, t=t, sp=sp),
                checkpointing.selective_op_rebuild_bytes(model, k, b, s, t=t, sp=sp))
    return terms.layer_activation_bytes(model, k, b, s, t=t, sp=sp), 0


def _autocast_copies(model: ModelSpec, r: ResolvedStage, plan: ParallelPlan) -> int:
    """Autocast's weight cache lives for one autocast region; the pipeline schedule runs every micro-batch
    inside the step's region, so the copies exist once. FSDP (zero >= 2 with d > 1) all-gathers 16-bit
    parameters itself (MixedPrecisionPolicy), so autocast has nothing to cast."""
    if plan.zero >= 2 and r.shard > 1:
        return 0
    matmul, n_layers = r.params.matmul, r.layout.n_layers
    if r.kernels.recompute in ("full", "selective_op"):
        # Casts inside a non-reentrant ``checkpoint`` region are not kept in autocast's cache (measured on
        # torch 2.13 with the tracker: the blocks' 16-bit weight copies are gone after the forward);
        # only the head's copy remains.
        matmul -= blocks_matmul_local(model, r.t, n_layers)
    # The routed experts run transformers' grouped_mm kernel, outside autocast: no 16-bit copy of them.
    matmul -= routed_experts_local(model, r.t, n_layers)
    matmul -= _uncopied(r)
    return terms.autocast_copy_bytes(max(matmul, 0), r.sizes)


def _uncopied(r: ResolvedStage) -> int:
    """Matmul values autocast does not cast and keep: quantized linears (bitsandbytes rebuilds the weight
    inside its op and keeps only the packed one) and float8 linears (torchao's autograd function takes the
    weight as it is and casts it to float8 itself) [``model/quantized.py``, ``model/float8.py``]. Under full
    or op-level recompute the blocks' copies are already gone (:func:`_autocast_copies`)."""
    if r.low is None:
        return 0
    blocks = 0 if r.kernels.recompute in ("full", "selective_op") else r.low.uncopied_blocks
    return blocks + r.low.uncopied_head


def _freed_copies(model: ModelSpec, r: ResolvedStage, plan: ParallelPlan, copies: int) -> int:
    """Outside a pipeline the autocast region ends with the forward, so a weight copy lives only as long
    as the matmul node that saved it: the head's and the last block's output projection and MLP are gone
    once their backward ran (not the routed experts: never copied). A pipeline schedule runs its
    backwards inside the region, whose cache keeps every copy."""
    if not copies or plan.pp != 1:
        return 0
    t = r.t
    after_matmul, _ = param_counts.layer_params_after_scores(model)
    freed_matmul = math.ceil(after_matmul / t) - math.ceil(param_counts.routed_expert_param_count(model) / t)
    if r.low is not None and r.low.uncopied_blocks:  # the block's quantized or float8 linears had no copy
        freed_matmul = 0
    if r.layout.has_head and not (r.low is not None and r.low.uncopied_head):
        freed_matmul += math.ceil(model.vocab_size * model.hidden / t)
    freed_matmul = rescaled(model, freed_matmul)  # as stage_params rescales the matmul weights
    return min(copies, terms.autocast_copy_bytes(max(freed_matmul, 0), r.sizes))


def _full_recompute(model: ModelSpec, r: ResolvedStage, rebuild: int, rebuild_grads: int) -> tuple[int, int, int]:
    """``(first_rebuild, checkpointed_attn, checkpointed_acts)`` under full recompute.

    The first block is rebuilt for its backward after every other block's backward ran, so its rebuilt
    activations and gradients sit beside (almost) every parameter gradient (backward_first). Measured on a
    CPU step (tests/unit/test_recompute_first_block.py): without it the backward was 4-11 % under with the
    chunked loss, whose buffers leave no larger point. With eager attention the rebuilt block's softmax
    backward is its peak (as backward_softmax without recompute): what the block saves up to its scores,
    the probabilities, the two [b, a, s, s] temporaries and the residual and value gradients; in its
    forward the same saves up to the scores are alive beside the scores and probabilities."""
    k, b, s, t, sp, n_layers = r.kernels, r.b, r.s, r.t, r.sp, r.layout.n_layers
    first_rebuild = rebuild + rebuild_grads if k.recompute == "full" and n_layers else 0
    checkpointed_attn = terms.eager_checkpointed_forward_bytes(model, k, b, s, t=t) if n_layers else 0
    if not checkpointed_attn:
        return first_rebuild, 0, 0
    plain = dataclasses.replace(k, recompute="none")
    checkpointed_acts, _ = terms.layer_activation_split_bytes(model, plain, b, s, t=t, sp=sp)
    first_rebuild = max(first_rebuild, checkpointed_acts
                        + terms.eager_softmax_output_bytes(model, plain, b, s, t=t)
                        + terms.eager_softmax_backward_bytes(model, plain, b, s, t=t)
                        + terms.eager_softmax_backward_grad_bytes(model, plain, b, s, t=t, sp=sp))
    return first_rebuild, checkpointed_attn, checkpointed_acts


def _head(model: ModelSpec, r: ResolvedStage) -> tuple[int, tuple[int, int, int]]:
    """``(the head's saves, the loss's (forward, held, backward) logits)`` of one micro-batch on the last
    stage: the final norm (a 1/t sequence slice under SP) and the lm_head's (gathered) input."""
    if not r.layout.has_head:
        return 0, (0, 0, 0)
    k, t, tokens = r.kernels, r.t, r.tokens
    head_acts = terms.norm_saved_bytes(model, k, tokens, split=t if r.sp else 1) + tokens * model.hidden * k.sizes.compute
    lg = terms.logits_bytes(model, k, tokens, vocab_shard=t if k.loss in terms.VOCAB_SHARDED_LOSSES else 1)
    return head_acts, (lg["forward"], lg["held"], lg["backward"])


@functools.lru_cache(maxsize=8192)  # frozen inputs; one per stage, then placed per pipeline moment
def micro_batch_bytes(model: ModelSpec, r: ResolvedStage, plan: ParallelPlan) -> MicroBatchBytes:
    """The :class:`MicroBatchBytes` of resolved stage ``r``."""
    k, b, s, t, sp, layout = r.kernels, r.b, r.s, r.t, r.sp, r.layout
    saved_layer, rebuild = _saved_and_rebuild(model, r)
    # blocks no gradient reaches (a frozen backbone's prefix) save nothing and rebuild nothing (model/frozen.py)
    saving = frozen_parts.saving_layers(model, layout.n_layers, first_stage=layout.has_embedding)
    rebuild = rebuild if saving else 0
    head_acts, logits = _head(model, r)
    copies = _autocast_copies(model, r, plan)
    # grad of the probabilities and of the scores for one layer [PT softmax_backward] (0 unless eager
    # attention without recompute)
    eager_bwd_ws = terms.eager_softmax_backward_bytes(model, k, b, s, t=t) if saving else 0
    # The last block's softmax backward is its own point, except under activation offloading, where
    # backward_layer holds the unpacked block and the temporaries beside it.
    softmax_point = bool(eager_bwd_ws) and layout.n_layers > 0 and not r.offload_activations
    freed = terms.eager_softmax_backward_freed_bytes(model, k, b, s, t=t, sp=sp)
    linear_bwd_ws = r.tokens * max(model.hidden, model.ffn // t) * k.sizes.compute
    # While a checkpointed block is rebuilt and runs its backward, the gradient of its output (residual
    # dtype) and the widest matmul's input gradient exist next to the rebuilt activations.
    rebuild_grads = r.tokens * model.hidden * k.sizes.residual // (t if sp else 1) + linear_bwd_ws if rebuild else 0
    first_rebuild, checkpointed_attn, checkpointed_acts = _full_recompute(model, r, rebuild, rebuild_grads)
    attn_layer = terms.eager_attention_bytes(model, k, b, s, t=t)
    # activation offloading (save_on_cpu around every block): the blocks' saves live on the host (their
    # bytes: model/assemble.py); one block's working set is a point of its own (_offloaded_block_points)
    blocks = 0 if r.offload_activations else saving
    return MicroBatchBytes(
        block_acts=blocks * saved_layer,
        head_acts=head_acts,
        saved_layer=saved_layer,
        attn_layer=attn_layer,
        per_mb_attn=blocks * attn_layer,
        logits=logits,
        copies=copies,
        rebuild=rebuild,
        eager_bwd_ws=eager_bwd_ws,
        softmax_point=softmax_point,
        softmax_grads=terms.eager_softmax_backward_grad_bytes(model, k, b, s, t=t, sp=sp),
        softmax_freed_acts=freed["activations"],
        softmax_freed_attn=freed["attention"],
        softmax_freed_copies=_freed_copies(model, r, plan, copies) if softmax_point else 0,
        linear_bwd_ws=linear_bwd_ws,
        rebuild_grads=rebuild_grads,
        first_rebuild=first_rebuild,
        checkpointed_attn=checkpointed_attn,
        checkpointed_acts=checkpointed_acts,
        inflight=r.inflight,
        inflight_head=terms.pipeline_head_inflight_microbatches(plan.pp, plan.microbatches, plan.schedule)
        if layout.has_head else 0,
        batch_in=terms.batch_input_bytes(r.batch_tokens),
        positions=terms.position_ids_bytes(model, s) if layout.has_embedding and not model.frozen_embedding else 0,
    )


class _InFlight(NamedTuple):
    """Micro-batches held at the forward's peak and at a backward point (``moment``)."""

    fwd: float
    fwd_head: float
    bwd: float
    bwd_head: float
    after: float  # what the first backward leaves of its micro-batch
    loss_backward: bool  # the backward points run the loss's backward (the last chunk's)


def _in_flight(mb: MicroBatchBytes, r: ResolvedStage, moment: pipeline_timeline.StageMoment | None) -> _InFlight:
    if moment is None:
        return _InFlight(mb.inflight, mb.inflight_head, mb.inflight, mb.inflight_head, max(0.0, mb.inflight - 1),
                         r.layout.has_head)
    return _InFlight(mb.inflight, mb.inflight_head, moment.inflight,
                     moment.inflight_head if r.layout.has_head else 0, moment.inflight_after,
                     r.layout.has_head and moment.loss_backward)


def activation_points(
    model: ModelSpec, r: ResolvedStage, plan: ParallelPlan, moment: pipeline_timeline.StageMoment | None = None
) -> dict[str, dict[str, int]]:
    """Per-point bytes of the batch-dependent components (:data:`~lightning_memplan.model.result.
    DYNAMIC_COMPONENTS`) on one rank; under a pipeline, the backward points at ``moment`` (default: the
    rank's most in-flight micro-batches, with the loss's backward on the last stage)."""
    mb = micro_batch_bytes(model, r, plan)
    f = _in_flight(mb, r, moment)
    out = _main_points(mb, f)
    _extra_points(out, mb, f)
    # The module's buffers (litgpt's RoPE tables, ModelSpec.buffer_bytes) are whole on every rank in every
    # phase: TP and FSDP shard parameters only. Measured, litgpt GPT tp=2 with block_size 4096 (rotary 1.0):
    # without them the estimate was 15 % under (tests/distributed/test_strategy_litgpt_tp.py).
    for point in out.values():
        point["other"] += model.buffer_bytes
    if r.offload_activations and r.layout.n_layers:
        _offloaded_block_points(out, mb, r.device)
    return out


def _main_points(mb: MicroBatchBytes, f: _InFlight) -> dict[str, dict[str, int]]:
    """forward, backward_start, backward_layer, backward_end and optimizer. The batch is alive in every
    phase (``other``); each in-flight micro-batch's learned-position ids until the embedding's backward
    (``activations``, first stage only). Only the last stage computes the loss, once per micro-batch;
    in-flight ones keep their "held" part."""
    lg_fwd, lg_held, lg_bwd = mb.logits
    acts_bwd = round(f.bwd * mb.block_acts + f.bwd_head * mb.head_acts) + round(f.bwd * mb.positions)
    attn_bwd = round(f.bwd * mb.per_mb_attn)
    held_logits = round(max(0.0, f.bwd_head - (1 if f.loss_backward else 0)) * lg_held)
    copies_batch = mb.copies + mb.batch_in
    return {
        "forward": {
            "activations": round(f.fwd * mb.block_acts + f.fwd_head * mb.head_acts) + round(f.fwd * mb.positions),
            "attention": round(f.fwd * mb.per_mb_attn),
            "logits": round(max(0.0, f.fwd_head - 1) * lg_held) + lg_fwd,
            "workspace": 0,
            "other": copies_batch,
        },
        "backward_start": {"activations": acts_bwd, "attention": attn_bwd,
                           "logits": held_logits + (lg_bwd if f.loss_backward else 0), "workspace": 0,
                           "other": copies_batch},
        # the last block's backward: the loss buffers are gone and the block is rebuilt (full/selective-op);
        # eager attention's softmax backward is backward_softmax (here only under activation offloading,
        # next to the unpacked block: _offloaded_block_points)
        "backward_layer": {"activations": acts_bwd, "attention": attn_bwd, "logits": held_logits,
                           "workspace": mb.rebuild + (0 if mb.softmax_point else mb.eager_bwd_ws) + mb.rebuild_grads,
                           "other": copies_batch},
        "backward_end": {
            "activations": round(f.after * mb.block_acts
                                 + max(0.0, f.bwd_head - (1 if f.loss_backward else 0)) * mb.head_acts)
            + min(mb.saved_layer, mb.block_acts + mb.head_acts) + round(f.after * mb.positions),
            "attention": round(f.after * mb.per_mb_attn),
            "logits": held_logits,
            "workspace": mb.linear_bwd_ws,
            "other": mb.batch_in,
        },
        "optimizer": {**{c: 0 for c in DYNAMIC_COMPONENTS}, "other": mb.batch_in},
    }


def _extra_points(out: dict[str, dict[str, int]], mb: MicroBatchBytes, f: _InFlight) -> None:
    """backward_first, forward_checkpoint and backward_softmax, where they exist (in place)."""
    if mb.first_rebuild:
        # Full recompute: the first block rebuilt (its saves, as backward_layer's rebuild) and running its
        # backward, with its output gradient and the widest matmul's input gradient; every later block's
        # saved input is gone. The parameter gradients of every block exist (model/assemble.py).
        out["backward_first"] = {**out["backward_end"], "workspace": mb.first_rebuild}
    if mb.checkpointed_attn:
        # Full recompute with eager attention: inside the last block's forward its scores and
        # probabilities exist (terms.eager_checkpointed_forward_bytes) beside every block's saved input,
        # before the head and the loss run.
        out["forward_checkpoint"] = {
            "activations": round(f.fwd * (mb.block_acts + mb.positions)
                                 + max(0.0, f.fwd_head - 1) * mb.head_acts) + mb.checkpointed_acts,
            "attention": mb.checkpointed_attn,
            "logits": round(max(0.0, f.fwd_head - 1) * mb.logits[1]),
            "workspace": 0,
            "other": mb.copies + mb.batch_in,
        }
    if mb.softmax_point:
        # The last block's eager softmax backward (terms.eager_softmax_backward_*): its [b, a, s, s]
        # temporaries and the residual and value gradients beside them; by then autograd has released
        # what the micro-batch's head (its final norm and lm_head input, when this backward ran the loss's)
        # and the block's nodes after the softmax saved, and their autocast weight copies
        # (terms.eager_softmax_backward_freed_bytes). The gradients of those parameters exist
        # (model/assemble.py).
        start = out["backward_start"]
        out["backward_softmax"] = {
            "activations": start["activations"] - (mb.head_acts if f.loss_backward else 0) - mb.softmax_freed_acts,
            "attention": start["attention"] - mb.softmax_freed_attn,
            "logits": out["backward_layer"]["logits"],
            "workspace": mb.eager_bwd_ws + mb.softmax_grads,
            "other": mb.copies - mb.softmax_freed_copies + mb.batch_in,
        }


def _offloaded_block_points(out: dict[str, dict[str, int]], mb: MicroBatchBytes, device: str) -> None:
    """Activation offloading (``save_on_cpu`` around every block, pp = 1): the device holds no block's saves
    at the loss; inside a block's forward its own tensors exist until they are packed and the block returns
    (``"forward_block"``: one block's saved bytes, next to the autocast copies and the batch), and in a
    block's backward its saves are unpacked back to the device (``backward_layer``, ``backward_end``: one
    block's) [torch/autograd/graph.py ``save_on_cpu``; ``model/offload.py``]. On a CPU step the unpack is
    ``tensor.to("cpu")`` of a CPU tensor, the packed copy itself: nothing is allocated in the backward."""
    saved_layer, attn_layer = mb.saved_layer, mb.attn_layer
    out["forward_block"] = {"activations": saved_layer, "attention": attn_layer, "logits": 0, "workspace": 0,
                            "other": out["forward"]["other"]}
    if device != "cuda":
        return
    out["backward_layer"]["activations"] += saved_layer
    out["backward_layer"]["attention"] += attn_layer
    end = out["backward_end"]  # the first block's backward: its saves (the analytic end holds min(saved, head))
    end["activations"], end["attention"] = max(end["activations"], saved_layer), max(end["attention"], attn_layer)


#: The forward's points inside its largest quantized or float8 block linear and inside a quantized lm_head
#: (:func:`low_precision_points`).
LOW_PRECISION_POINT = "forward_low_precision"
LOW_PRECISION_HEAD_POINT = "forward_head_low_precision"
#: The loss's backward inside a quantized lm_head: the logits' gradient and the head's rebuilt weight.
LOW_PRECISION_HEAD_BACKWARD = "backward_head_low_precision"


def low_precision_points(points: dict[str, dict[str, int]], r: ResolvedStage,
                         traced_backward: bool = False) -> dict[str, dict[str, int]]:
    """``points`` with the quantized or float8 linears' transients (``model/low_precision.py``), analytic
    or calibrated alike (a trace runs the unquantized step: ``model/traced.traced_train``; on the CPU
    bitsandbytes' forward rebuild happens inside its ``gemm_4bit`` op, which dispatch-mode trackers do not
    see). Forward: a point of its own inside the last block, its largest linear running (the forward
    without the loss's logits, :data:`LOW_PRECISION_POINT`), and with a quantized lm_head one inside it
    (its rebuilt weight beside its ``[b s, V]`` output, :data:`LOW_PRECISION_HEAD_POINT`); backward: the
    last block's backward (``backward_layer``) holds the largest linear's backward transient in
    ``workspace``; a quantized head's backward is a point of its own after the loss's
    (:data:`LOW_PRECISION_HEAD_BACKWARD`: the loss's buffers gone but the logits' gradient, the head's
    rebuilt weight); float8's persistent scales are ``other`` at every point. ``traced_backward``: the points
    are calibrated on a trace of the quantized module itself (``Calibration.quantized``), whose backward
    already holds the rebuilt weights (bitsandbytes' ``dequantize_4bit`` is an operator the trace sees; its
    forward rebuild inside ``gemm_4bit`` is not), so the backward transients are not added again."""
    low = r.low
    if low is None:
        return points
    out = {key: dict(point, other=point["other"] + low.scales) for key, point in points.items()}
    out[LOW_PRECISION_POINT] = dict(out["forward"], logits=0, workspace=out["forward"]["workspace"] + low.forward)
    out["backward_layer"]["workspace"] += 0 if traced_backward else low.backward
    if low.head_output:  # a quantized lm_head: its rebuilt weight beside its output / its output's gradient
        out[LOW_PRECISION_HEAD_POINT] = dict(out["forward"], logits=low.head_output,
                                             workspace=out["forward"]["workspace"] + low.head_forward)
        if not traced_backward:
            out[LOW_PRECISION_HEAD_BACKWARD] = dict(out["backward_start"], logits=low.head_output,
                                                    workspace=out["backward_start"]["workspace"] + low.head_backward)
    return out


def calibrated_points(
    model: ModelSpec,
    r: ResolvedStage,
    plan: ParallelPlan,
    calibration: Calibration,
    analytic: dict[str, dict[str, int]],
    reference: ResolvedStage | None,
) -> dict[str, dict[str, int]]:
    """Replace analytic points by the traced coefficients. The calibration was fitted on one rank without
    model parallelism or activation offloading; for another plan each component is scaled by the analytic
    ratio plan / single-rank (``reference``: the same step resolved on one device without offloading,
    ``None`` when ``r`` is that step), so the exactness at the traced shapes carries over to the per-layer
    split."""
    b, s = r.b, r.seq_len
    single = None if reference is None else activation_points(model, reference, ParallelPlan())
    out: dict[str, dict[str, int]] = {}
    for key, comps in analytic.items():
        phase = PHASE_OF_POINT[key]
        if key in ("backward_layer", "backward_softmax", "backward_end", "backward_first") or (
            single is not None and key not in single
        ):
            # The trace reports one backward peak; keep the analytic points inside the backward. A point the
            # traced step has no counterpart of (one offloaded block's forward, ``forward_block``: the trace
            # ran without activation offloading) stays analytic too.
            out[key] = {comp: comps[comp] for comp in DYNAMIC_COMPONENTS}
            continue
        out[key] = {}
        for comp in DYNAMIC_COMPONENTS:
            fitted = calibration.bytes_for(phase, comp, b, s)
            if single is None:
                out[key][comp] = fitted
            else:
                base = single[key][comp]
                out[key][comp] = round(fitted * comps[comp] / base) if base else comps[comp]
    if single is None and plan.world_size == plan.dp and plan.zero == 0:  # every rank runs the traced step
        _bound_by_traced_backward(out, calibration, b, s)
    return out


def _bound_by_traced_backward(out: dict[str, dict[str, int]], calibration: Calibration, b: int, s: int) -> None:
    """On the traced plan itself, or plain replication (each rank runs the traced step; its gradient buckets
    are comm, not bounded here: a sharded plan's unsharded root gradients and their reduce-scatter copies are
    backward bytes a one-device trace never holds), no analytic point inside the backward holds more dynamic
    bytes than the traced backward's peak at (b, s): that peak is the largest moment of the real backward, so an analytic
    point above it describes a model the terms do not fit (a convolutional or recurrent model read as a
    guessed transformer, whose [s, s] terms at s = an audio clip's samples are 24x the real step). Such a
    point is scaled down to that peak, its components in proportion."""
    traced = sum(calibration.bytes_for("backward", comp, b, s) for comp in DYNAMIC_COMPONENTS)
    for key in ("backward_layer", "backward_softmax", "backward_end", "backward_first"):
        point = out.get(key)
        total = sum(point.values()) if point else 0
        if point and total > traced:
            for comp in point:
                point[comp] = point[comp] * traced // total
