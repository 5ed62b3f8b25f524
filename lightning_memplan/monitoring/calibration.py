"""The first batch's calibration of a :class:`~lightning_memplan.monitoring.session.MemorySession`: the
batch-dependent terms fitted from traced fake-tensor steps of the user's own module, optimizer class and
batch structure (:func:`~lightning_memplan.tracking.trace.calibrate`), and the report's ``run`` entry."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lightning_memplan.live import (
    batch_factory,
    calibration_shapes,
    optimizer_factory,
    parallelised_by,
    pipeline_split,
    unwrap_optimizer,
)
from lightning_memplan.model.result import Calibration
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.monitoring.manual import manual_optimization_trace
from lightning_memplan.tracking.compiled import eager_view

if TYPE_CHECKING:
    from lightning_memplan.monitoring.session import RunContext

__all__ = ["describe_run", "run_calibration"]


def run_calibration(
    run: RunContext, train: TrainSpec, spec: ModelSpec | None, batch: Any, note: Callable[[str], None],
    *, fake: bool = True,
) -> Calibration | None:
    """Fit the batch-dependent terms from traced fake-tensor steps of ``run.module`` with the real
    optimizer class and the real batch's structure; ``None`` and a ``note`` saying why when tracing
    fails or cannot describe the run (a module split into pipeline stages, or sharded in place with no
    plain copy at hand).

    A module that ``memplan_auto`` sharded (FSDP2, tensor parallelism) is traced through the copy the
    strategy kept from just before (``plain_module``, on the meta device, with the plan's activation
    checkpointing): one rank of the plain model, which ``estimate_memory`` scales to the plan.
    ``fake=False`` traces real CPU steps of private copies instead (what the session asks for a model small
    enough that a real step costs less than a fake one)."""
    from lightning_memplan.tracking.trace import calibrate

    module = run.module
    sharded = pipeline_split(run) or parallelised_by(module)
    plain = getattr(run.strategy, "plain_module", None)
    if sharded is not None and pipeline_split(run) is None and isinstance(plain, torch.nn.Module):
        module, sharded = plain, None
    if sharded is not None:
        what = "LightningModule" if hasattr(module, "training_step") else type(module).__name__
        note(
            f"calibration skipped: the {what} is already parallelised ({sharded}), and a "
            "fake-tensor trace needs a plain copy of it; the analytic memory model is used"
        )
        return None
    b, s = train.micro_batch, train.seq_len
    shapes = calibration_shapes(b, s, spec.dim_head if spec is not None else None)
    optimizer: Any = train.optimizer
    if run.optimizers:
        optimizer = optimizer_factory(unwrap_optimizer(run.optimizers[0]))
    extra: dict[str, Any] = {} if fake else {"fake": False}  # real CPU steps: a small model (session.py)
    if run.loss_fn is not None:
        extra["loss_fn"] = run.loss_fn
    if not train.grads_alive_in_forward:
        extra["grads_alive_in_forward"] = False
    if not run.automatic_optimization:
        if len(run.optimizers) != 1:
            note(
                f"calibration skipped: manual optimization with {len(run.optimizers)} optimizers cannot be "
                "traced with one; the analytic memory model is used"
            )
            return None
        # training_step runs backward and the optimizer step itself, through Trainer-backed methods
        optimizer, extra["loss_fn"] = manual_optimization_trace(optimizer)
    try:
        # The eager original under the force_eager stance: the fake-tensor trace (a dispatch mode) never
        # reaches a compiled frame, so dynamo neither converts nor skips any (eager_view).
        with eager_view(module) as eager:
            return calibrate(
                eager, shapes, input_fn=batch_factory(batch, b, s), optimizer=optimizer,
                precision=train.precision, **extra,
            )
    except Exception as exc:  # noqa: BLE001 - any tracing failure falls back to the analytic model
        note(
            f"calibration with a traced fake-tensor step failed ({type(exc).__name__}: {exc}); using the "
            "analytic memory model (pass calibrate=False to skip the attempt)"
        )
        return None


def describe_run(
    run: RunContext,
    spec: ModelSpec | None,
    train: TrainSpec | None,
    plan: ParallelPlan,
    how: str,
    source: str,
    accelerator: str,
    compiled: list[str],
) -> dict[str, Any]:
    """The report's ``run`` entry: model, specs, plan (and how it was found), precision, estimate source."""
    name = type(run.module).__name__
    return {
        "model": spec.name or name if spec is not None else name,
        "model_spec": spec.to_dict() if spec is not None else None,
        "train_spec": train.to_dict() if train is not None else None,
        "plan": plan.to_dict(),
        "plan_description": f"{plan.describe()} ({how})",
        "precision": str(run.precision),
        "estimate_source": source,
        "accelerator": accelerator,
        "world_size": run.world_size,
        "compiled": list(compiled),
    }
