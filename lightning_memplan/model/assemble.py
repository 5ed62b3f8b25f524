"""Stage 5 of the estimate: assemble one rank's points of the step into a ``MemoryEstimate``
(``docs/architecture.md``, "The estimate's stages").

:func:`assemble_stage` puts the model states (``model/states.py``), the communication buffers
(``model/comm_buffers.py``) and the activation timeline (``model/activations.py``) together at every point
of the step, with the gradients that exist at each: the previous step's gradients are alive during the
forward (Lightning zeroes them only after ``training_step`` [PL ``loops/optimization/automatic.py``]);
without a pipeline each backward point holds the gradients made by then; under a pipeline every backward
of the rank's schedule is a candidate (:mod:`lightning_memplan.model.pipeline_timeline`): the micro-batches
it still holds next to the gradients of the local chunks that have run a backward by then [N21 section
2.2: Narayanan et al. 2021, arXiv 2104.04473]. FSDP2's offloads move states and saved activations to the
host here (``model/offload.py``); DeepSpeed's placement per point is its own (``model/deepspeed.py``).

The peak is the largest phase; the components reported are those live at that moment, so they add up to
:attr:`MemoryEstimate.total`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from lightning_memplan.model import offload, pipeline_timeline, terms
from lightning_memplan.model.activations import (
    LOW_PRECISION_HEAD_BACKWARD,
    LOW_PRECISION_HEAD_POINT,
    LOW_PRECISION_POINT,
    activation_points,
    calibrated_points,
    low_precision_points,
    micro_batch_bytes,
)
from lightning_memplan.model.comm_buffers import CommBuffers
from lightning_memplan.model.param_counts import attention_matmul_param_count
from lightning_memplan.model.resolve import ResolvedStage
from lightning_memplan.model.result import COMPONENTS, PHASES, Calibration, MemoryEstimate
from lightning_memplan.model.specs import ModelSpec, ParallelPlan
from lightning_memplan.model.stage_layout import blocks_matmul_local, chunk_shares, fsdp_units
from lightning_memplan.model.states import StageStates

__all__ = ["assemble_stage"]

Points = dict[str, dict[str, int]]
PointsAt = Callable[[pipeline_timeline.StageMoment], Points]


def _timeline(model: ModelSpec, r: ResolvedStage, plan: ParallelPlan, moment: pipeline_timeline.StageMoment | None,
              calibration: Calibration | None, reference: ResolvedStage | None) -> Points:
    """The activation points at ``moment``, analytic or scaled from ``calibration``."""
    points = activation_points(model, r, plan, moment)
    if calibration is not None:
        points = calibrated_points(model, r, plan, calibration, points, reference)
    return low_precision_points(points, r, traced_backward=calibration is not None and calibration.quantized)


def assemble_stage(
    model: ModelSpec,
    r: ResolvedStage,
    plan: ParallelPlan,
    states: StageStates,
    comm: CommBuffers,
    *,
    rank: int,
    calibration: Calibration | None = None,
    reference: ResolvedStage | None = None,
) -> MemoryEstimate:
    """One rank's :class:`MemoryEstimate` from the earlier stages' records (module docstring).
    ``calibration`` replaces the analytic activation terms (``reference``: the step resolved on one device
    without offloading, ``None`` when ``r`` is that step: ``activations.calibrated_points``)."""
    dynamic = _timeline(model, r, plan, None, calibration, reference)
    source = "analytic" if calibration is None else "calibrated"
    if states.zero is not None:
        return _deepspeed_estimate(r, plan, states, comm, dynamic, rank=rank, source=source,
                                   calibrated=calibration is not None)
    static = {"params": states.params, "optimizer": states.optimizer, "master": states.master}
    if plan.pp == 1:
        points = _one_stage_points(r, states, comm, static, dynamic)
    else:
        points = _pipeline_points(model, r, plan, states, comm, static, dynamic,
                                  lambda mom: _timeline(model, r, plan, mom, calibration, reference))
    points["optimizer"] = {**static, "grads": states.grads, "comm": comm.static, **dynamic["optimizer"]}
    if calibration is None:  # a calibrated optimizer phase already holds the traced step's temporaries
        points["optimizer"]["workspace"] += states.opt_ws
    host = _apply_offloads(points, model, r, plan, states) if r.offload_params or r.offload_activations else None
    details = {
        "local_params": r.params.local,
        "autocast_weight_copies": terms.autocast_copy_bytes(r.params.matmul, r.sizes),
        "optimizer_workspace": states.opt_ws,
        "layers_on_stage": r.layout.n_layers,
        "inflight_microbatches_x1000": round(1000 * r.inflight),
        "batch_input": terms.batch_input_bytes(r.batch_tokens),
    }
    if host is not None:
        details.update({f"host_{part}": value for part, value in host.host.items()})
        details.update(host_pinned=host.pinned, offload_h2d_bytes=host.h2d, offload_d2h_bytes=host.d2h)
    if r.low is not None:  # quantized base weights / float8 linears (model/low_precision.py)
        details.update(r.low.details)
    if states.paged_optimizer:
        details["host_paged_optimizer"] = states.paged_optimizer
    host_total = (0 if host is None else host.total) + states.paged_optimizer
    return _estimate(points, r, rank=rank, details=details, source=source, host=host_total)


def _estimate(points: Points, r: ResolvedStage, *, rank: int, details: dict[str, int], source: str,
              host: int) -> MemoryEstimate:
    """The largest point of each phase (the first of equals, in step order), the peak phase's components."""
    by_phase = {
        "forward": max((points[k] for k in points if k.startswith("forward")), key=lambda c: sum(c.values())),
        "backward": max((points[k] for k in points if k.startswith("backward")), key=lambda c: sum(c.values())),
        "optimizer": points["optimizer"],
    }
    by_phase = {p: {c: int(by_phase[p].get(c, 0)) for c in COMPONENTS} for p in PHASES}
    peak_phase = max(PHASES, key=lambda p: sum(by_phase[p].values()))
    return MemoryEstimate(**by_phase[peak_phase], peak_phase=peak_phase, rank=rank, stage=r.layout.stage,
                          by_phase=by_phase, details=details, source=source, host=host)


def _one_stage_points(r: ResolvedStage, states: StageStates, comm: CommBuffers, static: dict[str, int],
                      dynamic: Points) -> Points:
    """The points of a step without a pipeline: the forward (and inside its last block), the backward's
    start, its last block, that block's softmax backward, its end and the first block's rebuilt backward."""
    grads_fwd = states.grads if (r.grads_alive_in_forward or r.accumulating) else 0
    grads_bwd_start = states.grads if r.accumulating else 0
    fwd = comm.static + comm.forward
    points: Points = {"forward": {**static, "grads": grads_fwd, "comm": fwd, **dynamic["forward"]}}
    for key in ("forward_block", "forward_checkpoint", LOW_PRECISION_POINT, LOW_PRECISION_HEAD_POINT):  # inside a
        # block (activation offloading; full recompute with eager attention; low precision) or a quantized head
        if key in dynamic:
            points[key] = {**static, "grads": grads_fwd, "comm": fwd, **dynamic[key]}
    bwd = comm.static + comm.backward
    points["backward_start"] = {**static, "grads": grads_bwd_start, "comm": comm.static + comm.backward_start,
                                **dynamic["backward_start"]}
    if LOW_PRECISION_HEAD_BACKWARD in dynamic:  # inside a quantized lm_head's backward (model/activations.py)
        points[LOW_PRECISION_HEAD_BACKWARD] = {**points["backward_start"], **dynamic[LOW_PRECISION_HEAD_BACKWARD]}
    points["backward_layer"] = {**static, "grads": max(grads_bwd_start, states.head_grads), "comm": bwd,
                                **dynamic["backward_layer"]}
    if "backward_softmax" in dynamic:
        points["backward_softmax"] = {**static, "grads": max(grads_bwd_start, states.head_grads + states.after_scores_grads),
                                      "comm": bwd, **dynamic["backward_softmax"]}
    points["backward_end"] = {**static, "grads": states.grads_accum, "comm": comm.static + comm.backward_end,
                              **dynamic["backward_end"]}
    if "backward_first" in dynamic:  # full recompute: the first block's rebuilt backward
        points["backward_first"] = {**static, "grads": max(grads_bwd_start, states.grads_accum - states.first_missing),
                                    "comm": bwd, **dynamic["backward_first"]}
    return points


def _pipeline_points(model: ModelSpec, r: ResolvedStage, plan: ParallelPlan, states: StageStates,
                     comm: CommBuffers, static: dict[str, int], dynamic: Points, points_at: PointsAt) -> Points:
    """The points of a pipeline stage: the forward with the most micro-batches in flight, the forward that
    starts after a backward (FSDP2 keeps the units unsharded) and the largest backward point over the
    rank's schedule.

    A pipeline step drops the previous step's gradients before its schedule runs (the optimizer has
    consumed them); each local chunk's gradients appear at its first backward of the step. Accumulating
    across steps keeps every gradient alive throughout. The forward with the most micro-batches in flight
    is the one just before the latest backward that still holds them all: that backward's earlier
    gradients exist during it."""
    acts_share, grads_share = chunk_shares(model, plan, r.layout, r.framework)
    v = plan.virtual_stages if plan.schedule == "interleaved" else 1
    moments = pipeline_timeline.stage_moments(r.layout.stage, plan.pp, plan.microbatches, plan.schedule, v,
                                              acts_share, grads_share, r.layout.has_head)

    def grads_at(fraction: float) -> int:
        return states.grads_accum if r.accumulating else round(states.grads_accum * fraction)

    most = max(mom.inflight for mom in moments)
    grads_fwd = grads_at(max(mom.grads_before for mom in moments if mom.inflight >= most - 1e-9))
    points: Points = {"forward": {**static, "grads": grads_fwd, "comm": comm.static + comm.forward, **dynamic["forward"]}}
    for key in (LOW_PRECISION_POINT, LOW_PRECISION_HEAD_POINT):  # inside a quantized or float8 linear
        if key in dynamic:  # (model/activations.py)
            points[key] = {**points["forward"], **dynamic[key]}
    if states.pipelined_fsdp and grads_fwd:
        # a forward after a backward starts with every unit still unsharded (the backward kept them);
        # each unit reshards after its forward (measured, 2 x 4 gloo ranks, dp=2 tp=2 pp=2), so at
        # that moment only the micro-batches held before it exist
        start = dict(dynamic["forward"], logits=0)
        for comp in ("activations", "attention"):
            start[comp] = round(start[comp] * max(0.0, most - 1) / most)
        points["forward_start"] = {**static, "grads": grads_fwd, "comm": comm.static + comm.all_unsharded, **start}
    best = _best_backward(model, plan, r, states, comm, static, moments, grads_at, points_at)
    points["backward"] = {**static, **best}
    return points


def _best_backward(model: ModelSpec, plan: ParallelPlan, r: ResolvedStage, states: StageStates, comm: CommBuffers,
                   static: dict[str, int], moments: tuple[pipeline_timeline.StageMoment, ...],
                   grads_at: Callable[[float], int], points_at: PointsAt) -> dict[str, int]:
    """The largest backward point over ``moments`` (only the largest is built: the planner evaluates many);
    each block's backward as :func:`_block_backward` says."""
    best: tuple[int, dict[str, int]] = (-1, {})
    static_total = sum(static.values()) + comm.static
    for mom in moments:
        dyn = points_at(mom)
        before, after = grads_at(mom.grads_before), grads_at(mom.grads_after)
        made = mom.grads_after > mom.grads_before
        head_new = states.head_grads if mom.loss_backward and made else 0
        start_comm = comm.backward_start
        if states.pipelined_fsdp and plan.zero == 3 and mom.grads_before > 0:
            # ZeRO-3 re-gathers the units its forward resharded: at the B1 peak of 2 x 2 gloo ranks
            # (dp=2 zero=3 pp=2 m=2, tests/distributed/test_strategy_3d.py) one gathered unit and
            # 77.6 KB of all-gather/reduce temporaries sat beside the accumulated gradients; the
            # whole stage unsharded stands for them (-3.1 %; the reshard alone gave -5.6 %).
            # Replication (shard group of 1) only copies, and matched the reshard (+2.0 %).
            start_comm = max(comm.backward_start, comm.all_unsharded)
        block_new = states.after_scores_grads if not r.accumulating and made else 0
        end, mlp_ws = _block_backward(model, r, plan, before, after, made and not r.accumulating)
        for key, grads_now, comm_now in (
            ("backward_start", before, start_comm),
            (LOW_PRECISION_HEAD_BACKWARD, before, start_comm),
            ("backward_layer", before + head_new, comm.backward),
            ("backward_softmax", before + head_new + block_new, comm.backward),
            ("backward_end", end, comm.backward_end),
            ("backward_first", end, comm.backward),
        ):
            if key not in dyn:
                continue
            point = dyn[key]
            if key in ("backward_layer", "backward_end") and point["workspace"] < mlp_ws:
                point = {**point, "workspace": mlp_ws}
            total = static_total + grads_now + comm_now + sum(point.values())
            if total > best[0]:
                best = (total, {"grads": grads_now, "comm": comm.static + comm_now, **point})
    return best[1]


def _block_backward(model: ModelSpec, r: ResolvedStage, plan: ParallelPlan, before: int, after: int,
                    making: bool) -> tuple[int, int]:
    """``(gradient bytes at the chunk's first-block points, a block backward's least workspace)`` of a
    pipeline stage's backward (``before`` / ``after``: the gradient bytes when it starts / ends).

    Gradients: at the chunk's first backward of the step (``making``) its first block runs its backward
    with its saves alive (``backward_end``, ``backward_first``) before that block's gradients exist: of
    the ``after - before`` the backward makes, the chunk's other blocks' share (none for a one-block chunk),
    not all of it (the chunk's gradients taken as spread evenly over its blocks; the embedding's, made
    after the first block's, are counted in that share). Workspace: a SwiGLU MLP's backward holds
    three ``[tokens, f / t]`` tensors in the compute dtype (the output gradient's product with the up and
    the gate branch and the gate's activation gradient), where the analytic block point has the widest
    linear's input gradient only. Measured against the rank's traced step (parallel/pipeline_replay.py,
    whose per-stage estimates were within 1.9 % of real 2- and 4-process gloo runs), a Hugging Face Llama
    (h 64, f 172, 2-8 layers): a one-block stage's backward peak held one matmul's gradient (44,032 B, not
    the stage's 247,296 B) and 3 x 44,032 B of workspace; the analytic stages were -5.4 % .. +8.8 % without
    these, -4.7 % .. -1.3 % with them (tests/unit/test_pipeline_stage_estimates.py)."""
    blocks = max(1, r.layout.n_layers // (plan.virtual_stages if plan.schedule == "interleaved" else 1))
    made = _first_block_made(model)
    grads = before + round((after - before) * (blocks - 1 + made) / blocks) if making else after
    mlp = 3 * r.tokens * math.ceil(model.ffn / plan.tp) * r.sizes.compute if model.ffn_kind == "swiglu" else 0
    return grads, mlp


def _first_block_made(model: ModelSpec) -> float:
    """The share of the first block's own gradients made at its backward's largest moment: none for a gated
    (SwiGLU) MLP, whose backward peaks at the MLP's three ``[tokens, f]`` tensors with one matmul's gradient
    made (:func:`_block_backward`); the MLP's share of the block's weights for a two-matrix (GELU/ReLU) MLP,
    whose backward peaks later, in the attention's backward, after the MLP's weight gradients exist (the zoo
    GPT under 2 x 2 gloo ranks, tests/distributed/test_strategy_3d.py: stage 0 -4.1 % and -5.2 % with none,
    +2.2 % and +0.9 % with all of them). Dense blocks only (an MoE block: none)."""
    if model.ffn_kind == "swiglu" or model.n_experts:
        return 0.0
    block = terms.layer_param_count(model)
    mlp = terms.layer_matmul_param_count(model, moe=False) - attention_matmul_param_count(model)
    return min(1.0, mlp / block) if block else 0.0


def _apply_offloads(points: Points, model: ModelSpec, r: ResolvedStage, plan: ParallelPlan,
                    states: StageStates) -> offload.HostLayout:
    """Move what FSDP2's offloads keep on the host out of the device ``points`` (in place) and return the
    host side (``lightning_memplan.model.offload``; pp = 1, checked by ``check_compatible``).

    ``CPUOffloadPolicy``: the sharded parameters, gradients, optimizer states and master copies leave every
    point; the CPU step's temporaries replace the device optimizer's; during the backward one unit's
    host-to-device all-gather input and the previous unit's reduce-scatter output (``ceil(U/d) (e + g)``)
    sit on the device until their copies finish. Activation offloading: the blocks' device activations
    are already one block's working set (``model/activations.py``); their packed saves are host bytes."""
    accumulation, sizes = r.accumulation, r.sizes
    host = offload.HostLayout(host=dict.fromkeys(offload.HOST_PARTS, 0), pinned=0, h2d=0, d2h=0)
    if r.offload_params:
        unit_params, _ = fsdp_units(model, plan.tp, plan.pp > 1, r.layout, r.params.local)
        # a CPU step copies nothing: the all-gather input is the shard, the reduce-scatter output the host gradient
        in_flight = offload.unit_shard_params(unit_params, plan) * (sizes.param + sizes.grad) if r.device == "cuda" else 0
        for key, point in points.items():
            for comp in ("params", "grads", "optimizer", "master"):
                point[comp] = 0
            if key.startswith("backward") and key != "backward_start":
                point["comm"] += in_flight
        points["optimizer"]["workspace"] = max(0, points["optimizer"]["workspace"] - states.opt_ws)
        host = offload.params_host_layout(
            params=states.params, grads=states.grads, optimizer=states.optimizer, master=states.master,
            step_workspace=offload.cpu_step_workspace_bytes(r.optimizer, states.opt_local,
                                                            math.ceil(r.params.largest / r.shard)),
            gathers=2 if (plan.zero == 3 or r.shard == 1) else 1, accumulation=accumulation,
        )
    if r.offload_activations:
        mb = micro_batch_bytes(model, r, plan)
        acts = offload.activation_host_bytes(
            model, r.kernels, b=r.b, s=r.s, n_layers=r.layout.n_layers, saved_layer=mb.saved_layer,
            attn_layer=mb.attn_layer, matmul_params=blocks_matmul_local(model, plan.tp, r.layout.n_layers),
            t=plan.tp, sp=plan.sp,
        )
        parts = dict(host.host, activations=acts)
        host = offload.HostLayout(host=parts, pinned=host.pinned + acts, h2d=host.h2d + accumulation * acts,
                                  d2h=host.d2h + accumulation * acts)
    if r.device != "cuda":  # a CPU step pins nothing (memplan_auto passes pin_memory=False there)
        host = dataclasses.replace(host, pinned=0)
    return host


def _deepspeed_estimate(r: ResolvedStage, plan: ParallelPlan, states: StageStates, comm: CommBuffers,
                        dynamic: Points, *, rank: int, source: str, calibrated: bool) -> MemoryEstimate:
    """One rank under DeepSpeed's ZeRO engine (pp = cp = 1): the states, reduce buckets, gathered stage-3
    parameters and host bytes of its :class:`~lightning_memplan.model.deepspeed.ZeroLayout` at each point,
    beside the activation, attention and logits terms every framework shares (DeepSpeed runs the module's
    own kernels) and the tensor-parallel buffer. The on-device optimizer's temporaries come with the
    step's gradient conversion."""
    from lightning_memplan.model.deepspeed import POINTS

    zl = states.zero
    assert zl is not None
    keys = [(key, key) for key in POINTS]
    # the last block's eager softmax backward (when it is a point) falls in DeepSpeed's backward_layer
    if "backward_softmax" in dynamic:
        keys.append(("backward_softmax", "backward_layer"))
    if "backward_first" in dynamic:  # full recompute's first block rebuilt: every gradient as at the end
        keys.append(("backward_first", "backward_end"))
    points: Points = {}
    for key, zero_key in keys:
        points[key] = {"params": zl.params, "optimizer": zl.optimizer, "master": zl.master,
                       "grads": zl.grads[zero_key], "comm": zl.comm[zero_key] + (comm.extra if key != "optimizer" else 0),
                       **dynamic[key]}
    if not calibrated:  # a calibrated optimizer phase already holds the traced step's temporaries
        points["optimizer"]["workspace"] += states.opt_ws
    points["optimizer"]["workspace"] += zl.workspace
    details = {
        "local_params": r.params.local,
        "autocast_weight_copies": 0,
        "optimizer_workspace": states.opt_ws,
        "layers_on_stage": r.layout.n_layers,
        "batch_input": terms.batch_input_bytes(r.batch_tokens),
        "zero_stage": plan.zero,
        "zero_model_states_peak": zl.model_states_peak,
        "zero_fp32_grad_partition": zl.fp32_grad_partition,
        "zero_gathered_largest": zl.gathered_largest,
        "zero_persistent_params": states.zero_persistent,
        **{f"host_{part}": value for part, value in zl.host.items()},
    }
    return _estimate(points, r, rank=rank, details=details, source=source, host=sum(zl.host.values()))
