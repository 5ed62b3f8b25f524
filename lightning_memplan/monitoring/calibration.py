"""The first batch's calibration of a :class:`~lightning_memplan.monitoring.session.MemorySession`: the
batch-dependent terms fitted from traced fake-tensor steps of the user's own module, optimizer class and
batch structure (:func:`~lightning_memplan.tracking.trace.calibrate`), and the report's ``run`` entry."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lightning_memplan.live import (
    BatchFactory,
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
from lightning_memplan.tracking.isolation import preserved_run_state

if TYPE_CHECKING:
    from lightning_memplan.monitoring.session import RunContext

__all__ = ["describe_run", "run_calibration"]


def _shapes_for(factory: BatchFactory, b: int, s: int, head_dim: int | None,
                note: Callable[[str], None]) -> list[tuple[int, int]]:
    """The shapes to trace: three that separate the terms when the batch can be resized along b and s;
    along b alone when no tensor has a dimension of s (said in a note); the real shape alone, measured
    and not fitted, when no tensor has the batch dimension either."""
    if not factory.resizes_batch:
        note(
            f"calibration measured the real shape only ({b} x {s}): {factory.describe()}; the estimate is "
            "exact at that shape and not calibrated at any other"
        )
        return [(b, s)]
    if s > 1 and not factory.resizes_seq:
        note(
            f"calibration varies the micro-batch only: no tensor of the batch has a dimension of seq_len={s} "
            f"({factory.describe()}), so its memory is fitted at s={s} alone; seq_len is the size axis the memory "
            "grows with (tokens for text, 1 for fixed-size images or clips), pass seq_len=1 for such inputs or "
            "the length of a batch dimension that varies"
        )
        return [(b, s), (2 * b, s)]
    if factory.batch_only_inputs:
        note(
            f"calibration varies the micro-batch only: the batch holds floating-point inputs without the sequence "
            f"axis ({', '.join(factory.batch_only_inputs[:4])}) beside tensors with it, so its memory is not a "
            f"function of b*s alone; it is fitted at s={s} (exact for any micro-batch at that length)"
        )
        return [(b, s), (2 * b, s)]
    return calibration_shapes(b, s, head_dim)


def _traced(module: torch.nn.Module, shapes: list[tuple[int, int]], factory: BatchFactory, b: int, s: int,
            kwargs: dict[str, Any], note: Callable[[str], None]) -> Calibration:
    """``calibrate`` at ``shapes``, exact at the real ``(b, s)``; when a shape of another sequence length
    cannot be traced (a model that accepts one input length only, or a dimension that equals s by chance)
    or the fit through them misses the real shape, again along the micro-batch."""
    from lightning_memplan.tracking.trace import calibrate

    along_s = any(shape[1] != s for shape in shapes)
    try:  # one sequence length: the b*s^2 term cannot be told from b*s (no third length is traced)
        return calibrate(module, shapes, input_fn=factory, exact_at=(b, s), **kwargs,
                         **({} if along_s else {"quadratic": False}))
    except Exception as exc:  # noqa: BLE001 - retried along b alone, else reported by the caller
        if not along_s:
            raise
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    calibration = calibrate(module, [(b, s), (2 * b, s)], input_fn=factory, quadratic=False, **kwargs)
    note(
        f"calibration varies the micro-batch only: the step at other sequence lengths than {s} could not be "
        f"fitted with it ({reason}), so the memory is fitted at s={s} alone and the estimate at other lengths is "
        "not calibrated"
    )
    return calibration


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
    enough that a real step costs less than a fake one).

    The run is left exactly as it was (:func:`~lightning_memplan.tracking.isolation.preserved_run_state`):
    every trace works on a copy of the module and the global random states are put back, so the user's
    next dropout mask and shuffle are the ones they would have been without the callback."""
    with preserved_run_state(run.module, run.optimizers) as guard:
        calibration = _calibrate_run(run, train, spec, batch, note, fake=fake)
    if guard.moved or guard.restored:
        note(
            "calibration changed the module it traces ("
            + ", ".join((guard.moved + guard.restored)[:6])
            + "); what could be put back was, the rest is a defect to report"
        )
    return calibration


def _trace_optimizers(run: RunContext, module: torch.nn.Module, train: TrainSpec) -> list[Any]:
    """``params -> Optimizer`` factories for the trace, one per optimizer of the run: each rebuilds its
    optimizer's class, options and parameter groups on the traced copy (``live.optimizer_factory`` with
    ``module_params``) when ``module`` is the trained module itself; on another copy (memplan_auto's plain
    module) or for a parameter outside the module, the class over every parameter. No optimizer yet: the
    TrainSpec's name."""
    if not run.optimizers:
        return [train.optimizer]
    own = list(module.parameters()) if module is run.module else None
    factories = []
    for wrapped in run.optimizers:
        opt = unwrap_optimizer(wrapped)
        grouped = optimizer_factory(opt, module_params=own) if own is not None else None
        factories.append(grouped if grouped is not None else optimizer_factory(opt))
    return factories


def _calibrate_run(
    run: RunContext, train: TrainSpec, spec: ModelSpec | None, batch: Any, note: Callable[[str], None],
    *, fake: bool,
) -> Calibration | None:
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
    optimizers = _trace_optimizers(run, module, train)
    extra: dict[str, Any] = {"optimizer": optimizers[0], "precision": train.precision}
    if not fake:  # real CPU steps of private copies: a small model (monitoring/first_batch.py)
        extra["fake"] = False
    if run.loss_fn is not None:
        extra["loss_fn"] = run.loss_fn
    if not train.grads_alive_in_forward:
        extra["grads_alive_in_forward"] = False
    if not run.automatic_optimization:
        # training_step runs backward and the optimizer steps itself, through Trainer-backed methods: one
        # trace optimizer per real one (a GAN's generator and discriminator optimizers)
        extra["optimizer"], extra["loss_fn"] = manual_optimization_trace(optimizers)
    try:
        factory = batch_factory(batch, b, s)
        shapes = _shapes_for(factory, b, s, spec.dim_head if spec is not None else None, note)
        # The eager original under the force_eager stance: the fake-tensor trace (a dispatch mode) never
        # reaches a compiled frame, so dynamo neither converts nor skips any (eager_view).
        with eager_view(module) as eager:
            return _traced(eager, shapes, factory, b, s, extra, note)
    except Exception as exc:  # noqa: BLE001 - any tracing failure falls back to the analytic model
        note(
            f"calibration with a traced step failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}), so "
            "the estimate comes from the analytic memory model alone, which may not describe this model's "
            "activations: do not trust it until a tracked step's measurement agrees (the report compares them); "
            "pass model_spec= and train_spec= that describe the model, or calibrate=False to skip the attempt"
        )
        return None


def _precision_label(precision: str, train: TrainSpec | None) -> str:
    """The run's precision string, with the quantized base weights, float8 linears or low-bit optimizer the
    estimate assumed (``"32-true; base weights nf4-dq"``): Lightning's ``BitsandbytesPrecision`` reports
    ``"32-true"`` whatever it quantizes, so the report names what was read (``live/low_precision.py``)."""
    if train is None:
        return precision
    parts = [precision]
    if train.base_weights is not None:
        parts.append(f"base weights {train.base_weights}" + (" (lm_head too)" if train.quantized_head else ""))
    if train.float8 is not None:
        parts.append(f"float8 {train.float8}")
    if train.optimizer not in ("adamw", "adam", "sgd", "sgd_momentum", "adafactor", "lion"):
        parts.append(f"optimizer {train.optimizer}")
    return "; ".join(parts)


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
        "precision": _precision_label(str(run.precision), train),
        "estimate_source": source,
        "accelerator": accelerator,
        "world_size": run.world_size,
        "compiled": list(compiled),
    }
