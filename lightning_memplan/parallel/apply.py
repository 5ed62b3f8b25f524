"""Applying a :class:`~lightning_memplan.parallel.decision.Resolution` to a module, for both front doors
(the Trainer's ``MemplanAutoStrategy`` and Fabric's ``MemplanAutoFabricStrategy``).

torchtitan's order (``torchtitan/models/llama3/infra/parallelize.py``): pipeline split -> tensor parallel
-> activation checkpointing -> FSDP2, then the loss mode the plan assumes on every ``LinearCrossEntropy``.
Plain functions over explicit arguments; the strategies only log the notes they return.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_memplan.live.layouts import TransformerLayout, find_layout
from lightning_memplan.parallel.decision import Resolution
from lightning_memplan.parallel.fsdp import (
    apply_activation_checkpointing,
    apply_activation_offload,
    apply_data_parallel,
    data_parallel_mesh,
)
from lightning_memplan.parallel.mesh import MeshAxis
from lightning_memplan.parallel.pipeline import PipelineRunner
from lightning_memplan.parallel.tensor_parallel import apply_tensor_parallel, find_linear_cross_entropy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Applied", "apply_resolution", "check_accelerator", "configure_losses", "planned_optimizer_mismatch"]


@dataclass(frozen=True, kw_only=True)
class Applied:
    """What :func:`apply_resolution` did.

    Args:
        layout: the transformer layout found in the module (``None``: none recognised).
        pipeline: the pipeline runner when ``pp > 1``, else ``None``.
        notes: what was applied or skipped, in words (for rank-zero info).
        plain: the module as it was before FSDP2 and tensor parallelism, with the plan's activation
            checkpointing, its parameters on the meta device (:func:`~lightning_memplan.tracking.meta_copy.
            meta_copy`): what the monitoring core traces to calibrate its estimate, since the module itself
            is sharded now; ``None`` when nothing was parallelised in place, under a pipeline (a rank holds
            one stage), or when the module could not be copied.
    """

    layout: TransformerLayout | None
    pipeline: PipelineRunner | None = None
    notes: tuple[str, ...] = field(default=())
    plain: nn.Module | None = None


def apply_resolution(
    module: nn.Module,
    resolution: Resolution,
    mesh: DeviceMesh,
    device: torch.device,
    *,
    warn: Callable[[str], None],
) -> Applied:
    """Apply the plan to ``module`` in place: pipeline split, TP(+SP), activation checkpointing, FSDP2.

    Args:
        module: the module to parallelise (LightningModule, or the module given to ``fabric.setup``).
        resolution: the broadcast resolution.
        mesh: the ``pp x dp_replicate x dp_shard x tp`` mesh built from ``resolution.mesh``.
        device: this rank's device (pipeline stages are placed on it).
        warn: rank-zero warning function (the loss-mode warning).

    The untied embedding and lm_head get FSDP2 units of their own as ``resolution.plan.own_units`` says
    (:func:`~lightning_memplan.parallel.decision.decide` chose them, and the estimate counts them so).
    """
    sizes = resolution.mesh
    layout = find_layout(module)
    # FSDP2 also on one data-parallel rank when the plan offloads parameters (CPUOffloadPolicy needs units)
    fsdp = sizes.dp > 1 or resolution.offload == "params"
    plain = _plain_copy(module, resolution) if sizes.pp == 1 and (sizes.tp > 1 or fsdp) else None
    pipeline: PipelineRunner | None = None
    notes: list[str] = []
    if sizes.pp > 1:
        assert layout is not None
        pipeline = PipelineRunner(
            module,
            layout,
            mesh[str(MeshAxis.PP)],
            device,
            microbatches=resolution.plan.microbatches,
            schedule=resolution.plan.schedule,
            virtual_stages=resolution.plan.virtual_stages,
        )
    if sizes.tp > 1:
        notes += apply_tensor_parallel(module, layout, mesh[str(MeshAxis.TP)], sequence_parallel=resolution.plan.sp)
    if resolution.recompute != "none":
        if layout is None:
            notes.append(f"recompute={resolution.recompute!r} not applied: no list of repeated blocks found")
        else:
            notes.append(apply_activation_checkpointing(layout, resolution.recompute))
            if pipeline is not None:
                pipeline.refresh_blocks()
    if resolution.offload_activations:
        if layout is None:
            notes.append("activation offloading not applied: no list of repeated blocks found")
        else:
            notes.append(apply_activation_offload(layout))
            if pipeline is not None:
                pipeline.refresh_blocks()
    cpu_offload = resolution.offload == "params"
    if fsdp:
        dp_mesh = data_parallel_mesh(mesh, sizes)
        if pipeline is not None:
            apply_data_parallel(
                module, layout, dp_mesh, reshard_after_forward=sizes.reshard_after_forward,
                roots=tuple(pipeline.modules), units=resolution.plan.own_units, cpu_offload=cpu_offload,
            )
        else:
            apply_data_parallel(
                module, layout, dp_mesh, reshard_after_forward=sizes.reshard_after_forward,
                units=resolution.plan.own_units, cpu_offload=cpu_offload,
            )
        if cpu_offload:
            notes.append("FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer states in pinned host "
                         "memory, the optimizer step on the CPU")
    notes += configure_losses(module, resolution, pipelined=pipeline is not None, warn=warn)
    return Applied(layout=layout, pipeline=pipeline, notes=tuple(n for n in notes if n), plain=plain)


def _plain_copy(module: nn.Module, resolution: Resolution) -> nn.Module | None:
    """The module on the meta device before it is sharded, with the plan's activation checkpointing
    (what the traced calibration must see); ``None`` when it cannot be copied (the run goes on, the
    monitoring core then says why it does not calibrate)."""
    from lightning_memplan.tracking.meta_copy import meta_copy

    try:
        plain = meta_copy(module)
        if resolution.recompute != "none":
            copied = find_layout(plain)
            if copied is None:
                return None
            apply_activation_checkpointing(copied, resolution.recompute)
    except Exception:  # noqa: BLE001 - a module deepcopy cannot take: no calibration, the run goes on
        return None
    return plain


def configure_losses(
    module: nn.Module, resolution: Resolution, *, pipelined: bool, warn: Callable[[str], None]
) -> list[str]:
    """Set the loss mode the plan assumes on every ``LinearCrossEntropy`` (``configure(mode=...)``):
    vocab-parallel under TP without a pipeline (the lm_head weight is a vocab-sharded DTensor,
    ``ColwiseParallel``), chunked when the plan assumes a logits-free loss; warns when the plan assumes
    one and the module has none."""
    losses = find_linear_cross_entropy(module)
    if not losses:
        if resolution.loss in ("chunked", "vocab_parallel"):
            warn(
                f"memplan_auto: the plan assumes loss={resolution.loss!r} but the module has no LinearCrossEntropy; "
                "its logits are materialised in full, so the real peak can exceed the estimate. Compute the "
                "loss with lightning_memplan.LinearCrossEntropy"
            )
        return []
    if resolution.mesh.tp > 1 and not pipelined:
        mode = "vocab_parallel"
    elif resolution.loss in ("chunked", "vocab_parallel"):
        mode = "chunked"
    else:
        return [f"{len(losses)} LinearCrossEntropy module(s) keep their own mode (plan loss={resolution.loss!r})"]
    chunk = getattr(getattr(resolution.decision, "train", None), "loss_chunk_size", None)
    for loss in losses:
        configure = getattr(loss, "configure", None)
        if callable(configure):
            configure(mode=mode, chunk_size=chunk)
    return [f"{len(losses)} LinearCrossEntropy module(s) set to mode={mode!r}" + (f", chunk_size={chunk}" if chunk else "")]


def planned_optimizer_mismatch(decision: Any, optimizer: Any, *, fix: str) -> str | None:
    """The warning when the optimizer the run uses is not the one the plan assumed, else ``None``.

    Args:
        decision: the resolution's decision (its ``train.optimizer`` is what was planned).
        optimizer: the run's first optimizer (a Lightning/Fabric wrapper is unwrapped).
        fix: how to plan for it, e.g. ``"MemplanAutoStrategy(train=TrainSpec(..., optimizer={kind!r}))"``
            (formatted with ``kind``).
    """
    from lightning_memplan.live import InferenceError, infer_optimizer

    planned = getattr(getattr(decision, "train", None), "optimizer", None)
    if planned is None or optimizer is None:
        return None
    try:
        kind, _ = infer_optimizer(optimizer)
    except InferenceError:
        return None
    if kind == planned:
        return None
    return (
        f"memplan_auto: the plan assumed optimizer={planned!r} (the optimizer could not be read before the "
        f"layout was applied) but the run uses {kind!r}; pass {fix.format(kind=kind)} to plan for it"
    )


def check_accelerator(accelerator: Any, supported: tuple[type, ...], *, fix: str) -> None:
    """Refuse an accelerator memplan_auto cannot drive (it needs torch.distributed collectives).

    Raises:
        ValueError: naming the accelerator and ``fix`` (how to choose CPU or CUDA).
    """
    if not isinstance(accelerator, supported):
        raise ValueError(
            f"accelerator={type(accelerator).__name__!r} is not supported by memplan_auto: it needs "
            f"torch.distributed collectives (gloo on CPU, NCCL on CUDA); use {fix}, or another strategy"
        )
