"""The calibrated per-rank estimate of a candidate plan for the user's own module, before it is sharded.

What memplan_auto checks a plan against before it says FITS (``parallel/verify.py``). The module is
copied onto the meta device (:func:`~lightning_memplan.tracking.meta_copy.meta_copy`: structure, shapes,
dtypes, nothing allocated), with the candidate's activation checkpointing applied as
``parallel/apply.py`` will apply it, and traced under fake tensors with the run's batch structure,
optimizer and precision:

* without a pipeline (``pp = 1``): the batch-dependent terms are fitted from traced steps of the whole
  module (:func:`~lightning_memplan.tracking.trace.calibrate`, the shapes of
  :func:`~lightning_memplan.live.calibration_shapes`) and :func:`~lightning_memplan.model.estimate.estimate_memory`
  scales them to the plan (data parallelism, FSDP2, TP and SP, context parallelism, offloads): the
  estimate ``MemoryPlanCallback`` calibrates for a run;
* under a pipeline: each pipeline rank's own step is traced (its blocks, the embedding on the first
  stage, the final norm and head on the last, the schedule's order of forwards and backwards:
  ``parallel/pipeline_replay.py``). That trace is the rank's estimate when the stages are not sharded
  further; with data or tensor parallelism inside the stages it is scaled by the analytic ratio of the
  plan to the same pipeline on one rank per stage.

Traces are cached by what they depend on (the recompute mode for the whole-module fit; the pipeline
shape, micro-batch, recompute mode and rank for a stage), so candidates that differ only in their
sharding share them, and only the candidates the ranking reaches are traced.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_memplan.model.result import COMPONENTS, Calibration, MemoryEstimate
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.tracking.fake_fidelity import readable_scalars

__all__ = ["CalibratedEstimator", "CalibrationUnavailable"]


class CalibrationUnavailable(ValueError):
    """The module could not be traced for this plan; the message says why (the analytic estimate decides)."""


class CalibratedEstimator:
    """Calibrated estimates of plans for one module (rank 0, before the layout is applied).

    Args:
        module: the module to plan for, not yet sharded (a LightningModule, or the module given to
            ``fabric.setup``); it is copied, never run or modified.
        model: its :class:`ModelSpec` (the analytic terms the fit is scaled with).
        read_batch: returns one batch of the run (its structure and dtypes; ``None`` when none can be read).
        loss_fn: ``(module, batch) -> loss`` for the traced step (``None``: a LightningModule's
            ``training_step``, else :func:`~lightning_memplan.tracking.trace.default_loss`).
    """

    def __init__(self, module: nn.Module, model: ModelSpec, read_batch: Callable[[], Any],
                 loss_fn: Callable[[nn.Module, Any], Any] | None = None) -> None:
        self.module = module
        self.model = model
        self.analytic_model = dataclasses.replace(model, calibration_source=None)
        self._read_batch = read_batch
        self._loss_fn = loss_fn
        self._batch: Any = None
        self._batch_read = False
        self._fits: dict[tuple[Any, ...], Calibration | str] = {}
        self._ranks: dict[tuple[Any, ...], MemoryEstimate | str] = {}
        #: traces run (whole-module fits count their shapes), for the explanation and the benchmark
        self.traces = 0

    # ------------------------------------------------------------------------------------- public
    def estimate(self, plan: ParallelPlan, train: TrainSpec) -> MemoryEstimate:
        """The worst rank's calibrated estimate of ``plan`` with ``train`` (``train.micro_batch``: one
        micro-batch of the plan; the dataloader batch is ``micro_batch * microbatches`` under a pipeline).

        Raises:
            CalibrationUnavailable: the module cannot be traced for it (why in the message).
        """
        return max(self.stages(plan, train), key=lambda e: e.total)

    def stages(self, plan: ParallelPlan, train: TrainSpec) -> list[MemoryEstimate]:
        """The calibrated estimate of each pipeline stage (of its first rank), in stage order; one entry,
        the worst rank, without a pipeline.

        Raises:
            CalibrationUnavailable: as :meth:`estimate`.
        """
        if plan.pp > 1:
            return [self._pipeline_rank(plan, train, r) for r in range(plan.pp)]
        calibration = self._whole(train)
        try:
            estimate = _estimate(self.model, train, plan, calibration=calibration)
        except Exception as exc:  # noqa: BLE001 - the analytic estimate decides; the note says why
            raise CalibrationUnavailable(f"the calibrated estimate failed ({type(exc).__name__}: {exc})") from exc
        return [dataclasses.replace(estimate, source="calibrated")]

    # ------------------------------------------------------------------------------------ helpers
    def _batch_fn(self) -> tuple[Callable[[int, int], Any], int, int]:
        """``(b, s) -> batch`` with the run's batch structure, and the batch's own shape."""
        from lightning_memplan.live import InferenceError, batch_factory, batch_shape

        if not self._batch_read:
            self._batch_read = True
            try:
                self._batch = self._read_batch()
            except Exception:  # noqa: BLE001 - an unreadable batch only means "not traced"
                self._batch = None
        if self._batch is None:
            raise CalibrationUnavailable("no batch of the run to trace (give example_input_array or a dataloader)")
        try:
            b, s = batch_shape(self._batch)
        except InferenceError as exc:
            raise CalibrationUnavailable(str(exc)) from exc
        return batch_factory(self._batch, b, s), b, s

    def _plain(self, recompute: str) -> tuple[nn.Module, str]:
        """A meta copy of the module with ``recompute`` applied (and the mode that could be applied)."""
        from lightning_memplan.live.layouts import find_layout
        from lightning_memplan.parallel.fsdp import apply_activation_checkpointing
        from lightning_memplan.tracking.meta_copy import meta_copy

        try:
            plain = meta_copy(self.module)
        except Exception as exc:  # noqa: BLE001 - a module deepcopy cannot take
            raise CalibrationUnavailable(f"the module could not be copied to trace ({type(exc).__name__}: {exc})") from exc
        layout = find_layout(plain)
        if recompute != "none":
            if layout is None:
                return plain, "none"  # parallel/apply.py cannot apply it either
            apply_activation_checkpointing(layout, recompute)
        return plain, recompute

    def _trace_kwargs(self, train: TrainSpec) -> dict[str, Any]:
        from lightning_memplan.tracking.trace import default_loss, make_optimizer

        name, impl = train.optimizer, train.optimizer_impl
        return {
            "optimizer": lambda params: make_optimizer(name, params, optimizer_impl=impl),
            "precision": train.precision,
            "loss_fn": readable_scalars(self._loss_fn or default_loss),
        }

    def _whole(self, train: TrainSpec) -> Calibration:
        """The whole module's fit for ``train``'s recompute mode (cached)."""
        key = (train.recompute, train.micro_batch, train.seq_len, train.precision, train.optimizer)
        if key not in self._fits:
            self._fits[key] = self._fit(train)
        found = self._fits[key]
        if isinstance(found, str):
            raise CalibrationUnavailable(found)
        return found

    def _traceable(self, train: TrainSpec) -> tuple[Callable[[int, int], Any], nn.Module] | str:
        """``(the batch function, the plain module with train's recompute applied)``, or why there is none."""
        try:
            input_fn, _, _ = self._batch_fn()
            plain, applied = self._plain(train.recompute)
        except CalibrationUnavailable as exc:
            return str(exc)
        if applied != train.recompute:
            return f"recompute={train.recompute!r} cannot be applied to the module (no list of repeated blocks)"
        return input_fn, plain

    def _fit(self, train: TrainSpec) -> Calibration | str:
        from lightning_memplan.live import calibration_shapes
        from lightning_memplan.tracking.trace import calibrate

        ready = self._traceable(train)
        if isinstance(ready, str):
            return ready
        input_fn, plain = ready
        # The first two of the callback's shapes: every pp = 1 candidate runs the dataloader's (b, s), where
        # a two-term fit is exact; ``calibrate`` traces a third itself when the attention scores are
        # materialised (the b*s^2 term). One trace fewer than the callback's least-squares fit.
        shapes = calibration_shapes(train.micro_batch, train.seq_len, self.model.dim_head)[:2]
        try:
            fitted = calibrate(plain, shapes, input_fn=input_fn, grads_alive_in_forward=train.grads_alive_in_forward,
                               **self._trace_kwargs(train))
        except Exception as exc:  # noqa: BLE001 - any tracing failure: the analytic estimate decides
            self.traces += len(shapes)
            return f"the traced step failed ({type(exc).__name__}: {str(exc)[:200]})"
        self.traces += len(fitted.traced_shapes)
        return fitted

    def _pipeline_rank(self, plan: ParallelPlan, train: TrainSpec, pp_rank: int) -> MemoryEstimate:
        """Pipeline rank ``pp_rank``'s calibrated estimate (module docstring)."""
        v = plan.virtual_stages if plan.schedule == "interleaved" else 1
        key = (plan.pp, plan.schedule, v, plan.microbatches, train.micro_batch, train.seq_len, train.recompute,
               train.precision, train.optimizer, pp_rank)
        if key not in self._ranks:
            self._ranks[key] = self._trace_rank(plan, train, pp_rank)
        traced = self._ranks[key]
        if isinstance(traced, str):
            raise CalibrationUnavailable(traced)
        rank = pp_rank * plan.dp * plan.cp * plan.tp
        base = ParallelPlan(pp=plan.pp, microbatches=plan.microbatches, schedule=plan.schedule,
                            virtual_stages=plan.virtual_stages, grad_buckets=False)
        if dataclasses.replace(plan, grad_buckets=False, own_units=()) == base and not _offloads(train):
            return dataclasses.replace(traced, rank=rank, stage=pp_rank, source="calibrated")
        try:
            target = _estimate(self.analytic_model, train, plan, rank=rank).total
            reference = _estimate(self.analytic_model, train, base, rank=pp_rank).total
        except Exception as exc:  # noqa: BLE001 - the analytic estimate decides; the note says why
            raise CalibrationUnavailable(f"the analytic scaling failed: {exc}") from exc
        return _scaled(traced, target / reference if reference else 1.0, rank=rank, stage=pp_rank)

    def _trace_rank(self, plan: ParallelPlan, train: TrainSpec, pp_rank: int) -> MemoryEstimate | str:
        from lightning_memplan.parallel.pipeline_replay import trace_pipeline_rank

        ready = self._traceable(train)
        if isinstance(ready, str):
            return ready
        input_fn, plain = ready
        self.traces += 1
        kwargs = self._trace_kwargs(train)
        kwargs.pop("loss_fn")  # the rank's replay is the traced step's loss_fn; the module's pipeline_loss inside
        try:
            return trace_pipeline_rank(
                plain, pp_rank=pp_rank, pp=plan.pp, microbatches=plan.microbatches, schedule=plan.schedule,
                virtual_stages=plan.virtual_stages, batch_fn=input_fn, batch=train.micro_batch * plan.microbatches,
                seq_len=train.seq_len, hidden=self.model.hidden, vocab_size=self.model.vocab_size,
                wrap_loss=readable_scalars, **kwargs,
            )
        except Exception as exc:  # noqa: BLE001 - any tracing failure: the analytic estimate decides
            return f"the traced pipeline step failed ({type(exc).__name__}: {str(exc)[:200]})"


def _offloads(train: TrainSpec) -> bool:
    return train.offload != "none" or train.offload_activations


def _estimate(model: ModelSpec, train: TrainSpec, plan: ParallelPlan, **kwargs: Any) -> MemoryEstimate:
    from lightning_memplan.model.estimate import estimate_memory

    return estimate_memory(model, train, plan, **kwargs)


def _scaled(estimate: MemoryEstimate, factor: float, *, rank: int, stage: int) -> MemoryEstimate:
    """``estimate`` with every component (and phase) times ``factor``, rounded up."""
    comps = {c: math.ceil(getattr(estimate, c) * factor) for c in COMPONENTS}
    by_phase = {p: {c: math.ceil(v * factor) for c, v in parts.items()} for p, parts in estimate.by_phase.items()}
    return dataclasses.replace(estimate, **comps, by_phase=by_phase, rank=rank, stage=stage, source="calibrated")
