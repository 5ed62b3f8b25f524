"""The estimate / measure / report core shared by :class:`~lightning_memplan.callbacks.MemoryPlanCallback`
(the Trainer's front door) and :class:`~lightning_memplan.fabric.MemoryMonitor` (Fabric's).

A :class:`MemorySession` knows nothing of a Trainer or a Fabric: each front door describes its run
with a :class:`RunContext` (the module, its optimizers, the running strategy, precision, world size,
rank, device) and drives the session through one training step at a time: :meth:`~MemorySession.start_step`
with the batch, :meth:`~MemorySession.enter_phase` at backward and the optimizer step,
:meth:`~MemorySession.end_step`; :meth:`~MemorySession.end_epoch` gathers every rank's figures (a
collective) into the epoch report. Logging, the report folders and the Trainer's spawn hand-off stay
with the front doors. The inference helpers (:mod:`~lightning_memplan.live`) read a
``RunContext`` and a ``Trainer`` alike: the context carries the attributes they read under the
Trainer's names.
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_memplan.live import (
    InferenceError,
    batch_shape,
    ddp_bucket_bytes,
    fsdp1_notes,
    infer_model_spec,
    infer_plan,
    infer_train_spec,
    stage_micro_batch,
    unwrap_optimizer,
)
from lightning_memplan.model.reserved import ReservedMargin
from lightning_memplan.model.result import Calibration, MemoryEstimate
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.monitoring.advice import (
    eval_phase_message,
    forecast_message,
    headroom_message,
    mismatch_message,
)
from lightning_memplan.monitoring.averaged import averaged_copies, copy_bytes
from lightning_memplan.monitoring.calibration import describe_run, run_calibration
from lightning_memplan.monitoring.eval_steps import EvalState
from lightning_memplan.monitoring.first_batch import (
    block_types,
    not_a_decoder,
    real_trace_is_cheaper,
    recompute_seen,
)
from lightning_memplan.monitoring.measure import PhaseProbe, make_probe, read_rss
from lightning_memplan.monitoring.options import MonitorOptions
from lightning_memplan.monitoring.step_record import build_incident, build_step_record
from lightning_memplan.monitoring.writer import ReportWriter
from lightning_memplan.report.gather import gather_objects
from lightning_memplan.report.records import (
    EpochReport,
    MemoryReport,
    RankAccumulator,
    RankSummary,
    StepRecord,
)
from lightning_memplan.report.render import format_bytes
from lightning_memplan.tracking.compiled import (
    AllocationMeter,
    CompileSafeTracker,
    compiled_parts,
    dynamo_frames,
)
from lightning_memplan.tracking.recompute import RecomputeObserver, RecomputeSeen

__all__ = ["MemorySession", "RunContext"]

#: Per-(micro_batch, seq_len) estimates kept (sequence length may change every batch).
_ESTIMATE_CACHE_SIZE = 256
#: Nesting levels of a batch searched for its tensors (a dict of lists of tensors is two).
_BATCH_DEPTH = 4


def _batch_tensors(batch: Any, depth: int = _BATCH_DEPTH) -> list[torch.Tensor]:
    """The tensors of a batch: itself, or inside mappings (a dict, Hugging Face's ``BatchEncoding``),
    lists and tuples, ``depth`` levels down."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if depth <= 0:
        return []
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    return [t for value in values for t in _batch_tensors(value, depth - 1)]


@dataclass(frozen=True, kw_only=True)
class RunContext:
    """What a front door knows about the running fit, under the names a ``Trainer`` gives them."""

    #: The user's module (a LightningModule, or the module given to ``fabric.setup``), not a wrapper.
    module: torch.nn.Module
    #: The real ``torch.optim.Optimizer`` objects (wrappers are unwrapped where read).
    optimizers: tuple[Any, ...]
    #: The running strategy (Trainer's or Fabric's), read by class name by ``infer_plan``.
    strategy: Any
    #: Lightning precision string, e.g. ``"32-true"``, ``"bf16-mixed"``.
    precision: str
    #: The precision plugin object (``BitsandbytesPrecision``, ``TransformerEnginePrecision`` ... are read
    #: from it: ``live/low_precision.py``); ``None`` when the front door has none to give.
    precision_plugin: Any = None
    #: Micro-batches per optimizer step.
    accumulate_grad_batches: int = 1
    world_size: int = 1
    rank: int = 0
    #: Whether the Trainer steps the optimizer itself (``False``: manual optimization in training_step).
    automatic_optimization: bool = True
    #: ``(module, batch) -> loss`` that the calibration trace runs (``None``: ``model.trace.default_loss``).
    loss_fn: Callable[[Any, Any], Any] | None = None
    #: Whether the previous step's gradients exist during the forward (Lightning's order: yes; a loop
    #: that calls ``zero_grad()`` after ``optimizer.step()``: no).
    grads_alive_in_forward: bool = True
    #: Name used in warnings and in the argument hints of notes.
    owner: str = "MemoryPlanCallback"
    #: What may hold weight-averaging copies beside the module (the Trainer's callbacks; the models given to
    #: ``MemoryMonitor(averaged_models=...)``): the ``averaged`` component (monitoring/averaged.py).
    holders: tuple[Any, ...] = ()

    @property
    def lightning_module(self) -> torch.nn.Module:
        """The module, under the attribute name ``Trainer`` uses (read by ``infer_train_spec``)."""
        return self.module


@dataclass
class _FitState:
    """State of one fit (reset at each set-up)."""

    probe: PhaseProbe | None = None
    tracker: Any = None
    meter: AllocationMeter | None = None
    compiled: list[str] = field(default_factory=list)  # what torch.compile wrapped, found at the first batch
    frames_at_start: int = 0  # dynamo's converted-frame count at the step's start (dynamo_frames)
    tracking_enabled: bool = False
    spec: ModelSpec | None = None
    train: TrainSpec | None = None
    plan: ParallelPlan | None = None
    est_rank: int | None = None
    calibration: Calibration | None = None
    estimates: OrderedDict[tuple[int, int], MemoryEstimate | None] = field(default_factory=OrderedDict)
    initialised: bool = False
    stepped: bool = False
    steady_tracked: bool = False  # whether a step after the first optimizer step was tracked
    current: dict[str, Any] | None = None
    window: list[StepRecord] = field(default_factory=list)  # micro-batches of the optimizer step under way
    epoch_warnings: list[str] = field(default_factory=list)
    epoch_warning_steps: list[int] = field(default_factory=list)  # the step each warning was raised at
    evals: EvalState = field(default_factory=EvalState)  # validation / test / predict steps (eval_steps.py)
    copies: list[Any] = field(default_factory=list)  # weight-averaging copies found (monitoring/averaged.py)
    averaged: int = 0  # their bytes on the training device when last looked
    copies_epoch: int | None = None  # the epoch they were last looked for in
    with_copies: tuple[Any, int, Any] | None = None  # (estimate, averaged, estimate with them): the last one


class MemorySession:
    """Estimate and measure one rank's training steps and collect the memory report (module docstring).

    ``report``, ``batches_seen``, ``warned``, ``acc`` and ``max_shape_seen`` persist across fits (a
    resumed fit continues them); everything else is reset by :meth:`begin_fit`.
    """

    def __init__(self, options: MonitorOptions, *, owner: str = "MemoryPlanCallback") -> None:
        self.options = options
        self.owner = owner
        self.report = MemoryReport()
        self.batches_seen = 0
        self.warned: set[str] = set()
        self.acc: RankAccumulator | None = None
        self.max_shape_seen = (0, 0)
        self.rank = 0
        self.fit = _FitState()
        # Every rank's records of the checkpoint saves of the epoch under way (monitoring/checkpoint.py).
        self.pending_checkpoints: list[Any] = []
        # The report files: JSON and Markdown at once, the pictures on a thread (monitoring/writer.py).
        self.writer = ReportWriter(self._write_folder)
        self._png: bool | None = None  # whether matplotlib imports (asked once, on this thread)

    # ------------------------------------------------------------------------------------ set-up
    def begin_fit(self, device: torch.device, rank: int) -> None:
        """Start a fit on ``device`` as ``rank``: a fresh probe, tracking on or off by device kind. A second
        fit of the same callback starts a new run of the report (its epochs are added, not put in place of
        the first fit's); a resumed fit's checkpoint restores the run it belongs to."""
        self.fit = _FitState()
        self.report = self.report.new_run()
        self.rank = int(rank)
        self.writer.wait()
        self.writer = ReportWriter(self._write_folder)  # the run's clock starts now
        self.fit.probe = make_probe(device)
        kind = self.fit.probe.kind
        track = self.options.track_tensors
        self.fit.tracking_enabled = track is True or (track is None and kind in ("cpu", "mps"))

    @property
    def backend(self) -> str:
        return self.fit.probe.kind if self.fit.probe is not None else "cpu"

    def note(self, text: str) -> None:
        """Record what could not be inferred or measured; warn once (rank 0)."""
        if self.owner != "MemoryPlanCallback":  # the inference helpers name the callback's arguments
            text = text.replace("MemoryPlanCallback(", f"{self.owner}(")
        if text not in self.report.notes:
            self.report = replace(self.report, notes=(*self.report.notes, text))
        self.warn_once(f"note:{text}", text)

    def warn_once(self, key: str, text: str) -> None:
        if key in self.warned:
            return
        self.warned.add(key)
        self.fit.epoch_warnings.append(text)
        self.fit.epoch_warning_steps.append(int((self.fit.current or {}).get("step", self.batches_seen)))
        rank_zero_warn(f"{self.owner}: {text}")

    def initialise(self, run: RunContext, batch: Any) -> None:
        """Infer specs and calibrate at the first batch of the fit (needs the batch and the optimizer)."""
        fit, opts = self.fit, self.options
        fit.initialised = True
        fit.compiled = compiled_parts(run.module)
        if fit.compiled:
            how = "the profiler's allocator events" if self.backend == "cpu" else "the allocator counters"
            self.note(
                f"torch.compile detected ({', '.join(fit.compiled)}): calibration traces the eager original "
                f"and measured steps use {how} instead of the tensor tracker (a dispatch mode would make "
                "dynamo skip the compiled frames); no per-component measurement"
            )
        spec = opts.model_spec
        if spec is None:
            try:
                spec = infer_model_spec(run, run.module)
            except (ValueError, TypeError) as exc:
                self.note(
                    f"could not infer a ModelSpec from {type(run.module).__name__} ({exc}); estimates are off, "
                    f"measurement continues; pass {self.owner}(model_spec=ModelSpec(...))"
                )
        try:
            fit.train = infer_train_spec(run, batch, seq_len=opts.seq_len, base=opts.train_spec)
            if opts.train_spec is None and fit.train.grads_alive_in_forward != run.grads_alive_in_forward:
                fit.train = fit.train.replace(grads_alive_in_forward=run.grads_alive_in_forward)
        except InferenceError as exc:
            self.note(f"{exc}; estimates are off until it is given, measurement continues")
        if opts.plan is not None:
            plan, how = opts.plan, "given by plan="
        else:
            try:
                plan, how = infer_plan(run, run.module)
            except InferenceError as exc:
                plan, how = ParallelPlan(dp=run.world_size), f"assumed dp={run.world_size}"
                self.note(f"{exc}; assumed ParallelPlan(dp={run.world_size}) meanwhile")
        fit.plan = plan
        for text in fsdp1_notes(run.strategy, run.module):  # what the model approximates for FSDP1
            self.note(text)
        fit.est_rank = self.rank if self.rank < plan.world_size else None
        if fit.est_rank is None:
            self.note(
                f"plan {plan.describe()} has {plan.world_size} ranks but the run has {run.world_size}; "
                "reporting the worst rank's estimate on every rank; pass a matching plan="
            )
        fit.spec = spec
        source = "none"
        if spec is not None and fit.train is not None:
            source = "analytic"
            seen = RecomputeSeen()
            if opts.calibrate:
                # a module memplan_auto sharded is traced through its meta copy: fake tensors only
                plain = getattr(run.strategy, "plain_module", None) is None
                real = self.backend == "cpu" and plain and real_trace_is_cheaper(spec, fit.train)
                with RecomputeObserver(block_types(run.module)) as observer:
                    fit.calibration = run_calibration(run, fit.train, spec, batch, self.note, fake=not real)
                seen = observer.seen
                source = "calibrated" if fit.calibration is not None else "analytic"
            self._follow_recompute(run, seen)
            if fit.calibration is None and spec.calibration_source is not None:
                # traced coefficients that came with the spec (a Hugging Face config's real class): the
                # estimate says whether they covered this run ("hf_trace") or it fell back to the terms
                first = self.estimate(fit.train.micro_batch, fit.train.seq_len)
                if first is not None and first.source != "analytic":
                    source = "traced"
        if opts.model_spec is None and spec is not None and source == "analytic":
            self._analytic_notes(run, spec)
        run_info = describe_run(run, spec, fit.train, plan, how, source, self.backend, fit.compiled)
        run_info["units"] = opts.units  # what `lightning-memplan report` re-renders in by default
        if self.backend == "cuda":  # the allocator setting its measured reserved margin holds for (report/margin.py)
            from lightning_memplan.parallel.planner_bridge import expandable_segments_enabled

            run_info["expandable_segments"] = expandable_segments_enabled()
        self.report = replace(self.report, run=run_info)

    def _analytic_notes(self, run: RunContext, spec: ModelSpec) -> None:
        """Why an uncalibrated estimate of an inferred spec is not to be trusted: the spec was guessed (not a
        transformer), or the module is not a decoder-only language model, which the analytic terms describe."""
        fix = (
            "or pass calibrate=True" if not self.options.calibrate
            else "(calibration was asked for but did not run: see the note above)"
        )
        if "guessed" in (spec.name or ""):
            self.note(
                f"the ModelSpec was guessed ({spec.name}) and no traced step calibrated it, so the analytic "
                f"estimate of activations is unreliable; pass {self.owner}(model_spec=...) {fix}"
            )
            return
        kind = not_a_decoder(run.module)
        if kind is not None:
            self.note(
                f"{kind}: the analytic memory terms describe decoder-only language models and no traced step "
                f"calibrated them, so this estimate is not to be trusted (17-79 % under the measured peak on the "
                f"encoders, encoder-decoders, vision and audio models of the project's tests); pass {self.owner}(model_spec=...) {fix}"
            )

    def _follow_recompute(self, run: RunContext, seen: RecomputeSeen) -> None:
        """Hand-written activation checkpointing (monitoring/first_batch.py): ``recompute="full"`` when the
        calibration trace saw every block run again in the backward, else a note when it saw a partial one or,
        without a trace, a ``torch.utils.checkpoint`` call in the code."""
        if self.fit.train is None:
            return
        self.fit.train, text = recompute_seen(self.fit.train, seen, run.module, explicit=self.options.train_spec
                                              is not None, owner=self.owner)
        if text is not None:
            self.note(text)

    # ------------------------------------------------------------------------------------ estimates
    def estimate(self, b: int, s: int) -> MemoryEstimate | None:
        """The estimate of a ``(b, s)`` step, with the weight-averaging copies alive now (:meth:`find_copies`)."""
        return self._with_copies(self._estimate(b, s))

    def _with_copies(self, est: MemoryEstimate | None) -> MemoryEstimate | None:
        fit = self.fit
        if est is None or not fit.averaged:
            return est
        last = fit.with_copies
        if last is not None and last[0] is est and last[1] == fit.averaged:
            return last[2]  # type: ignore[no-any-return]
        out = est.with_averaged(fit.averaged)
        fit.with_copies = (est, fit.averaged, out)
        return out

    def find_copies(self, run: RunContext) -> None:
        """Look for the run's weight-averaging copies and their bytes on the training device (the ``averaged``
        component; monitoring/averaged.py). Called at the first step of each epoch and on tracked steps: SWA
        moves its copy to the device at an epoch start; a copy appears at set-up otherwise."""
        fit = self.fit
        try:
            fit.copies = averaged_copies(run.module, run.holders)
            fit.averaged = copy_bytes(fit.copies, run.module, self.backend) if fit.copies else 0
        except Exception as exc:  # noqa: BLE001 - monitoring never ends the run
            fit.copies, fit.averaged = [], 0
            self.warn_once("averaged", f"could not read the weight-averaging copies ({type(exc).__name__}: {exc}); "
                                       "they are left out of the estimate and the measurement")

    def _estimate(self, b: int, s: int) -> MemoryEstimate | None:
        fit = self.fit
        key = (b, s)
        if key in fit.estimates:
            fit.estimates.move_to_end(key)
            return fit.estimates[key]
        est = None
        if fit.spec is not None and fit.train is not None and fit.plan is not None:
            from lightning_memplan.model.estimate import estimate_memory

            try:
                train = fit.train.replace(micro_batch=stage_micro_batch(fit.plan, b), seq_len=s)
                est = estimate_memory(fit.spec, train, fit.plan, rank=fit.est_rank, calibration=fit.calibration)
                bound = est.details.get("int8_outlier_bound", 0)
                if bound and "int8_outliers" not in self.warned:  # bytes the estimate cannot know
                    self.warned.add("int8_outliers")
                    self.note(f"int8 base weights on CUDA: LLM.int8()'s outlier columns are not in the estimate (they "
                              f"depend on the data); at most {format_bytes(bound, 'MiB')} at batch {b} x {s}")
            except (ValueError, TypeError) as exc:
                self.note(f"the memory model cannot estimate batch {b} x {s}: {exc}")
        fit.estimates[key] = est
        if len(fit.estimates) > _ESTIMATE_CACHE_SIZE:
            fit.estimates.popitem(last=False)
        return est

    # ------------------------------------------------------------------------------------ per step
    def start_epoch(self, epoch: int) -> None:
        if self.acc is None or self.acc.epoch != epoch or self.acc.rank != self.rank:
            self.acc = RankAccumulator(rank=self.rank, epoch=epoch, backend=self.backend)

    def start_step(self, run: RunContext, batch: Any, epoch: int) -> None:
        """Before the step's forward: initialise at the first batch, estimate this batch's shape, start
        the tensor tracker (or the compiled step's allocation meter) on a tracked step, and the probe."""
        fit = self.fit
        if fit.probe is None:
            return
        if not fit.initialised:
            self.initialise(run, batch)
        shape: tuple[int, int] | None
        try:
            shape = batch_shape(batch, seq_len=self.options.seq_len)
        except InferenceError as exc:
            shape = (fit.train.micro_batch, fit.train.seq_len) if fit.train is not None else None
            self.note(f"{exc} (per-step shape unknown; using train_spec's)" if shape else str(exc))
        step = self.batches_seen
        # The first step is warm-up (no optimizer states yet), so the first steady-state step is
        # tracked too: every run gets at least one measurement the estimate is compared with.
        first_steady = fit.stepped and not fit.steady_tracked
        tracked = fit.tracking_enabled and (
            step == 0 or first_steady or (step + 1) % self.options.measure_every_n_steps == 0
        )
        if tracked and fit.stepped:
            fit.steady_tracked = True
        if tracked or fit.copies_epoch != epoch:
            fit.copies_epoch = epoch
            self.find_copies(run)
        fit.current = {
            "step": step,
            "epoch": epoch,
            "shape": shape,
            "estimate": self.estimate(*shape) if shape is not None else None,
            "tracked": tracked,
            "warmup": not fit.stepped,
        }
        if tracked:
            self._start_measuring(run, batch, shape)
        fit.frames_at_start = dynamo_frames()
        fit.probe.start_step()

    def _start_measuring(self, run: RunContext, batch: Any, shape: tuple[int, int] | None) -> None:
        """The tensor tracker (or a compiled CPU step's allocation meter) for a tracked step."""
        fit = self.fit
        optimizers = [unwrap_optimizer(o) for o in run.optimizers]
        if fit.compiled:
            if fit.probe is not None and fit.probe.kind == "cpu":
                fit.meter = AllocationMeter("cpu")
                fit.meter.start(run.module, optimizers, batch)
        else:
            self._start_tracker(run, optimizers, batch, shape)

    # ------------------------------------------------------------------------------------ evaluation steps
    def start_eval_step(self, phase: str, run: RunContext, batch: Any, epoch: int) -> None:
        """Before a validation / test / predict step (``phase``): estimate it
        (:func:`~lightning_memplan.model.eval_estimate.estimate_eval_memory` for the eval batch's shape and
        what the training run left alive) and start the probe and, on a tracked step, the tensor tracker.
        Nothing before the first training batch (the estimate needs the training run's specs) and nothing
        inside a training step; a failure is a warning and the step runs unmeasured."""
        fit = self.fit
        if fit.probe is None or not fit.initialised or fit.current is not None:
            return
        try:
            shape = batch_shape(batch, seq_len=self.options.seq_len)
        except InferenceError as exc:
            shape = None
            self.note(f"the {phase} batch's shape is unknown ({exc}); its steps are measured, not estimated")
        est = None
        if shape is not None and fit.spec is not None and fit.train is not None and fit.plan is not None:
            try:
                b = stage_micro_batch(fit.plan, shape[0])
                est = self._with_copies(fit.evals.estimate(
                    fit.spec, fit.train, fit.plan, fit.est_rank, phase, b, shape[1], run.module, run.optimizers,
                    self.options.generate_tokens))
            except (ValueError, TypeError) as exc:
                self.note(f"the memory model cannot estimate the {phase} batch {shape[0]} x {shape[1]}: {exc}")
        tracked = fit.evals.should_track(phase, fit.tracking_enabled, self.options.measure_every_n_steps)
        fit.current = {
            "step": fit.evals.seen.get(phase, 0), "epoch": epoch, "shape": shape, "estimate": est,
            "tracked": tracked, "warmup": False, "phase": phase,
        }
        try:
            if tracked:
                self._start_measuring(run, batch, shape)
            fit.probe.start_step()
        except Exception as exc:  # noqa: BLE001 - monitoring never stops the user's evaluation
            self._abandon_eval(phase, exc)

    def end_eval_step(self, phase: str, epoch: int) -> StepRecord | None:
        """After an evaluation step: its record (added to the phase's accumulator and to the evaluation run
        under way), checked for the phase warnings; ``None`` when the step was not measured."""
        fit = self.fit
        if fit.probe is None or fit.current is None or fit.current.get("phase") != phase:
            return None
        try:
            reading = fit.probe.end_step()
            metered = self._stop_meter(reading)
            record = self._record(reading, self._stop_tracker(), metered)
        except Exception as exc:  # noqa: BLE001 - monitoring never stops the user's evaluation
            self._abandon_eval(phase, exc)
            return None
        fit.current = None
        fit.evals.add(record, epoch=epoch, rank=self.rank, backend=self.backend)
        self.check_eval(record)
        return record

    def _abandon_eval(self, phase: str, exc: BaseException) -> None:
        fit = self.fit
        fit.current = None
        for stop in (self._stop_tracker, lambda: fit.meter.close() if fit.meter is not None else None):
            try:
                stop()
            except Exception:  # noqa: BLE001,S110 - already reporting a failure
                pass
        fit.meter = None
        self.warn_once(f"eval_failed:{phase}", f"the {phase} step could not be measured ({type(exc).__name__}: "
                       f"{exc}); the run goes on without that measurement")

    def end_eval_run(self, gather: Callable[[Any], list[Any]] = gather_objects) -> EpochReport | None:
        """After ``trainer.validate``/``test``/``predict`` outside a fit (a collective: every rank calls it):
        the evaluation figures join the latest epoch of the report; ``None`` when there is none to join
        (no epoch finished, or nothing measured)."""
        gathered = gather(self.fit.evals.take_summaries())
        phases: dict[str, tuple[RankSummary, ...]] = {}
        for evals in gathered:
            for phase, summary in evals.items():
                phases[phase] = (*phases.get(phase, ()), RankSummary.from_dict(summary))
        latest = self.report.latest
        if not phases or latest is None:
            return None
        merged = replace(latest, phases={**latest.phases, **{p: tuple(sorted(rs, key=lambda r: r.rank))
                                                               for p, rs in phases.items()}})
        self.report = replace(self.report, epochs=tuple(merged if e.key == latest.key else e for e in self.report.epochs))
        return merged

    def take_eval_window(self, phase: str) -> list[StepRecord]:
        """The records of the ``phase`` run just finished (one set of metrics per evaluation run)."""
        return self.fit.evals.take_window(phase)

    def check_eval(self, record: StepRecord) -> None:
        """Warn (once per phase) when the evaluation step is the run's peak or would not fit."""
        opts = self.options
        train = self.acc.summary() if self.acc is not None and self.acc.steps else None
        text = eval_phase_message(record, train, min_headroom=opts.min_headroom, units=opts.units,
                                  loss=self.fit.train.loss if self.fit.train is not None else None)
        if text:
            self.warn_once(f"eval:{record.phase}", text)

    def _start_tracker(self, run: RunContext, optimizers: list[Any], batch: Any, shape: tuple[int, int] | None) -> None:
        seq = shape[1] if shape is not None and shape[1] > 1 else None
        vocab = self.options.model_spec.vocab_size if self.options.model_spec is not None else None
        device = getattr(run.strategy, "root_device", None)
        # dynamo passes over this tracker: a compiled function the scan missed still compiles (compiled.py)
        tracker = CompileSafeTracker(run.module, optimizers, seq_len=seq, vocab_size=vocab, device=device)
        # the step's batch is live while it runs, as the estimate (model/terms.batch_input_bytes), the traced
        # calibration (tracking/trace.py) and the compiled step's AllocationMeter count it
        tracker.track(_batch_tensors(batch), "other")
        for copy in self.fit.copies:  # weight-averaging copies beside the module (its AveragedModel parts: itself)
            tracker.track_copy(copy)
        tracker.hold(ddp_bucket_bytes(run.strategy), "comm")  # DDP's buckets: no Python tensor holds them
        tracker.start()
        tracker.set_phase("forward")
        self.fit.tracker = tracker

    def enter_phase(self, phase: str) -> None:
        fit = self.fit
        if fit.probe is not None and fit.probe.phase is not None:
            fit.probe.enter_phase(phase)
        if fit.tracker is not None:
            fit.tracker.set_phase(phase)
        if fit.meter is not None:
            fit.meter.set_phase(phase)

    def mark_stepped(self) -> None:
        """The optimizer steps in the step under way (called as its optimizer phase starts)."""
        if self.fit.current is not None:
            self.fit.current["stepped"] = True

    @property
    def in_step(self) -> bool:
        return self.fit.current is not None

    def _stop_tracker(self) -> Any:
        tracker, self.fit.tracker = self.fit.tracker, None
        if tracker is None:
            return None
        try:
            return tracker.report()
        finally:
            tracker.stop()

    def _stop_meter(self, reading: Any) -> bool:
        """Put the allocation meter's peaks (a compiled CPU step) into ``reading``; whether it ran."""
        meter, self.fit.meter = self.fit.meter, None
        if meter is None:
            return False
        result = meter.stop()
        if result is None or reading is None:
            return False
        reading.measured_peak, reading.phase_peaks = result[0], dict(result[1])
        return True

    def _measurement(self, tracker_report: Any, metered: bool) -> str:
        if tracker_report is not None:
            return "tensor_tracker"
        if metered:
            return f"compiled:{AllocationMeter.method}"
        return {"cuda": "cuda_allocator", "mps": "mps_sampled"}.get(self.backend, "rss")

    def _record(self, reading: Any, tracker_report: Any, metered: bool = False) -> StepRecord:
        return build_step_record(
            self.fit.current or {}, reading, tracker_report, rank=self.rank, default_step=self.batches_seen,
            memory_budget=self.options.memory_budget, backend=self.backend,
            measurement=self._measurement(tracker_report, metered),
        )

    def end_step(self, epoch: int) -> StepRecord | None:
        """After the step: its record (added to the epoch, checked for warnings, kept in the window of
        the optimizer step under way); ``None`` outside a step."""
        fit = self.fit
        if fit.probe is None or fit.current is None:
            return None
        reading = fit.probe.end_step()
        metered = self._stop_meter(reading)
        tracker_report = self._stop_tracker()
        if not fit.compiled and dynamo_frames() != fit.frames_at_start:
            self._compiled_at_run_time()
            tracker_report = None
        record = self._record(reading, tracker_report, metered)
        if self.acc is None:
            self.acc = RankAccumulator(rank=self.rank, epoch=epoch, backend=self.backend)
        self.acc.add(record)
        self.check(record)
        fit.window.append(record)
        self.batches_seen += 1
        if fit.current.get("stepped"):
            fit.stepped = True
        fit.current = None
        return record

    def _compiled_at_run_time(self) -> None:
        """Compiled code ran in this step that ``compiled_parts`` did not find (dynamo converted frames):
        the step's tracker numbers are dropped (a dispatch mode sees only what reaches the dispatcher of
        a compiled region) and later tracked steps use the profiler or the allocator counters."""
        fit = self.fit
        step = (fit.current or {}).get("step", self.batches_seen)
        fit.compiled.append(f"compiled code called in training (dynamo converted frames in step {step})")
        self.report.run["compiled"] = list(fit.compiled)
        self.note(
            f"torch.compile found at run time (dynamo converted frames in step {step}, not through a compiled "
            "module or a function training_step names): that step's tensor-level measurement is dropped and "
            "later measured steps use the profiler's allocator events (CPU) or the allocator counters"
        )

    def take_window(self) -> list[StepRecord]:
        """The records of the optimizer step just finished (its micro-batches), emptying the window."""
        window, self.fit.window = self.fit.window, []
        return window

    def calibration_state(self) -> str:
        """``"calibrated"``, ``"off"`` (``calibrate=False``) or ``"skipped"`` (asked for, did not run)."""
        if self.fit.calibration is not None:
            return "calibrated"
        return "skipped" if self.options.calibrate else "off"

    def check(self, record: StepRecord) -> None:
        """Mismatch, headroom and forecast warnings (each once per run)."""
        fit, opts = self.fit, self.options
        if record.tracked or record.backend == "cuda":
            text = mismatch_message(record, opts.tolerance, units=opts.units, calibration=self.calibration_state())
            if text:
                self.warn_once("mismatch", text)
        plan = fit.plan or ParallelPlan()
        low = record.headroom is not None and record.device_memory and (
            record.headroom < opts.min_headroom * record.device_memory)
        if low and "headroom" not in self.warned:  # the step's TrainSpec only for the remedy's text
            train = (
                fit.train.replace(micro_batch=record.micro_batch, seq_len=record.seq_len)
                if (fit.train is not None and record.micro_batch and record.seq_len)
                else fit.train
            )
            text = headroom_message(record, opts.min_headroom, plan, train, units=opts.units)
            if text:
                self.warn_once("headroom", text)
        if record.micro_batch is None or record.seq_len is None or not record.device_memory:
            return
        b = max(self.max_shape_seen[0], record.micro_batch)
        s = max(self.max_shape_seen[1], record.seq_len)
        grew = (b, s) != self.max_shape_seen
        self.max_shape_seen = (b, s)
        if not grew or "forecast" in self.warned:
            return
        target = max(opts.max_seq_len or 0, s)
        est = self.estimate(b, target)
        if est is not None:
            text = forecast_message(
                target,
                est.total,
                record.device_memory,
                est.components(),
                plan,
                fit.train.replace(micro_batch=b, seq_len=target) if fit.train is not None else None,
                rank=self.rank,
                units=opts.units,
            )
            if text:
                self.warn_once("forecast", text)

    # ------------------------------------------------------------------------------------ epoch end
    def end_epoch(self, epoch: int, gather: Callable[[Any], list[Any]] = gather_objects) -> EpochReport:
        """Gather every rank's summary and warnings (``gather`` is a collective: every rank calls this)
        into the epoch's report, which joins :attr:`report`."""
        fit = self.fit
        acc = self.acc or RankAccumulator(rank=self.rank, epoch=epoch, backend=self.backend)
        gathered = gather((acc.summary().to_dict(), list(fit.epoch_warnings), list(fit.epoch_warning_steps),
                           fit.evals.take_summaries(), self.report.current_run_id))
        # every rank files the epoch under rank 0's run id (the one rank 0 writes)
        self.report = replace(self.report, current_run_id=gathered[0][4] or self.report.current_run_id)
        ranks = tuple(sorted((RankSummary.from_dict(s) for s, *_ in gathered), key=lambda r: r.rank))
        phases: dict[str, tuple[RankSummary, ...]] = {}
        for _, _, _, evals, _ in gathered:
            for phase, summary in evals.items():
                phases[phase] = (*phases.get(phase, ()), RankSummary.from_dict(summary))
        phases = {p: tuple(sorted(rs, key=lambda r: r.rank)) for p, rs in phases.items()}
        first_at: dict[str, int] = {}  # each warning, in order of appearance, at the first step any rank raised it
        for _, ws, steps, _, _ in gathered:
            for text, at in zip(ws, steps, strict=True):
                first_at[text] = min(at, first_at.get(text, at))
        warnings = list(first_at)
        for text in warnings:  # other ranks' warnings surface on rank 0 (rank_zero_warn) once each
            if text not in fit.epoch_warnings:
                self.warn_once(f"peer:{text[:80]}", text)
        report = EpochReport(
            epoch=acc.epoch, ranks=ranks, warnings=tuple(warnings), warning_steps=tuple(first_at[t] for t in warnings),
            phases=phases, checkpoints=tuple(self.pending_checkpoints),
        )
        self.pending_checkpoints = []
        self.report = self.report.with_epoch(report)
        report = next(e for e in self.report.epochs if e.key == (self.report.current_run, report.epoch))  # its run, run id
        self.acc = None
        fit.epoch_warnings = []
        fit.epoch_warning_steps = []
        return report

    def png_possible(self) -> bool:
        """Whether matplotlib imports; if not, say once that no PNG is written (it is a dependency, so a
        broken or removed install is worth a word, not a silent gap)."""
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            self.note(
                f"memory_report.png is not written: matplotlib cannot be imported ({exc}); the JSON, Markdown "
                "and HTML reports are; pip install matplotlib for the picture"
            )
            return False
        return True

    def _write_folder(self, report: MemoryReport, directory: str, pictures: bool, texts: bool = True) -> Any:
        """One folder's files of ``report`` (the JSON and Markdown with ``texts``, the HTML and PNG with
        ``pictures``): what the writer calls."""
        from lightning_memplan.report.io import write_report

        png = bool(pictures and self._png)
        return write_report(report, directory, units=self.options.units, png=png, html=pictures, text=texts,
                            errors="warn")[1]

    def _writing(self, directories: list[str]) -> bool:
        if not self.options.write_files or not directories:
            return False
        if self._png is None:
            self._png = self.png_possible()
        return True

    def write(self, directories: list[str]) -> Any:
        """Write the report to each folder (rank 0), every file now; the first folder's
        :class:`~lightning_memplan.report.io.WrittenFiles`, or ``None`` when nothing was written. A file
        that cannot be written is a warning naming it and its error; the run goes on."""
        if not self._writing(directories):
            return None
        return self.writer.write_now(self.report, directories, pictures=True)

    def write_epoch(self, directories: list[str]) -> Any:
        """At an epoch end or after a checkpoint save (rank 0): the JSON and Markdown now, the HTML and PNG on
        the writer's thread when that is cheap (monitoring/writer.py); the first folder's JSON/Markdown files."""
        if not self._writing(directories):
            return None
        return self.writer.epoch_end(self.report, directories)

    def finish_writes(self, directories: list[str]) -> Any:
        """At the end of the fit (rank 0): wait for the writer and draw the final pictures if they are not
        on disk yet; the first folder's files, or ``None`` when nothing new was written."""
        if not self._writing(directories):
            self.writer.wait()
            return None
        return self.writer.finish(self.report, directories)

    def finish_later(self, owner: Any, directories: list[str]) -> weakref.finalize:
        """What finishes the files when ``owner`` (a Fabric ``MemoryMonitor``, which has no end-of-fit hook)
        is closed, collected or left alive at interpreter exit, whichever comes first: a ``weakref.finalize``
        (it holds the session, never ``owner``; its ``atexit`` runs it at exit) that waits for the writer and
        draws the final report's pictures unless they are on disk (:meth:`finish_writes`), on rank 0; calling
        it runs it once and returns the first folder's files. It never raises (a warning instead)."""
        return weakref.finalize(owner, _finish_quietly, self, list(directories))

    def print_epoch(self, epoch: int) -> None:
        if self.options.print_report:
            import rich

            from lightning_memplan.report.render import render_rich

            rich.get_console().print(render_rich(self.report, epoch=epoch, units=self.options.units))

    # ------------------------------------------------------------------------------------ failures
    def record_incident(self, exception: BaseException) -> None:
        """Add the failing step (its record so far, the allocator state) to the report as an incident."""
        fit = self.fit
        tracker_report = None
        if fit.tracker is not None:
            tracker_report = self._stop_tracker()
        if fit.meter is not None:
            meter, fit.meter = fit.meter, None
            meter.close()
        reading = None
        if fit.probe is not None and fit.probe.phase is not None:
            reading = fit.probe.end_step()
        record = self._record(reading, tracker_report) if fit.current is not None else None
        allocator = fit.probe.allocator_summary() if fit.probe is not None else {"rss": read_rss()}
        incident = build_incident(
            exception, record, allocator, tracker_report, current=fit.current or {}, rank=self.rank,
            accumulator=self.acc, default_step=self.batches_seen,
        )
        self.report = self.report.with_incident(incident)
        fit.current = None

    def write_incident(self, directory: str | None) -> None:
        """The report with the incident, into ``directory`` (``memory_report.rank<N>.*`` off rank 0)."""
        from lightning_memplan.report.io import write_report

        self.writer.wait()  # the thread's drawing first: the incident's files are the last written
        if self.options.write_files and directory:
            write_report(
                self.report, directory, units=self.options.units,
                rank_suffix=None if self.rank == 0 else self.rank, errors="warn",
            )

    def reserved_margin(self) -> ReservedMargin | None:
        """The CUDA caching allocator's margin (reserved - allocated) the report's latest run measured,
        the epoch under way included (:func:`~lightning_memplan.report.margin.measured_reserved_margin`);
        ``None`` without CUDA training steps."""
        from lightning_memplan.report.margin import measured_reserved_margin

        return measured_reserved_margin(self.report, in_progress=self.acc.summary() if self.acc is not None else None)

    # ------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        from lightning_memplan.monitoring.state import warned_state

        return {
            "report": self.report.to_dict(),
            "batches_seen": self.batches_seen,
            "warned": warned_state(self.report, self.warned),
            "accumulator": self.acc.to_dict() if self.acc is not None else None,
            "max_shape_seen": list(self.max_shape_seen),
        }

    def load_state_dict(self, state_dict: Any, *, counters: tuple[str, ...] = ()) -> dict[str, int]:
        """Continue from a checkpoint's state: every field checked, what is invalid, foreign or from another
        version dropped with one warning, fresh state kept for it (monitoring/state.py); never raises.
        Returns the ``counters`` restored (0 when absent or dropped)."""
        from lightning_memplan.monitoring.state import restore_state

        got = restore_state(state_dict, rank=self.rank, owner=self.owner, counters=counters)
        if got.report is not None:
            self.report = got.report
        self.batches_seen = got.batches_seen or 0
        self.warned = got.warned or set()
        self.max_shape_seen = got.max_shape_seen or (0, 0)
        self.acc = got.accumulator
        return got.counters


def _finish_quietly(session: MemorySession, directories: list[str]) -> Any:
    """:meth:`MemorySession.finish_writes` on rank 0 (the writer only waited for elsewhere), a warning for any
    failure: it runs from a finalizer or at interpreter exit, where an exception would only be printed."""
    try:
        if session.rank != 0 or not session.report.epochs:  # nothing of this rank's to draw: no epoch ended
            session.writer.wait()
            return None
        return session.finish_writes(directories)
    except Exception as exc:  # noqa: BLE001 - finishing the report files never raises
        warnings.warn(f"{session.owner}: the report's pictures could not be finished ({type(exc).__name__}: {exc}); "
                      "the JSON and Markdown reports are written", UserWarning, stacklevel=1)
        return None
