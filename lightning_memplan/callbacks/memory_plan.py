"""``MemoryPlanCallback``: estimate and measure per-rank memory every step, report after each epoch."""

from __future__ import annotations

import uuid
from collections import OrderedDict
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_memplan.callbacks import emit
from lightning_memplan.callbacks.advice import forecast_message, headroom_message, mismatch_message
from lightning_memplan.callbacks.artifacts import log_report_files, report_dirs
from lightning_memplan.callbacks.handoff import load_handoff, runs_in_children, save_handoff
from lightning_memplan.callbacks.infer import (
    InferenceError,
    _calibration_shapes,
    _optimizer_factory,
    _unwrap,
    batch_factory,
    batch_shape,
    infer_model_spec,
    infer_plan,
    infer_train_spec,
    parallelised_by,
    pipeline_split,
    stage_micro_batch,
)
from lightning_memplan.callbacks.manual import manual_optimization_trace
from lightning_memplan.callbacks.measure import PhaseProbe, make_probe, read_rss
from lightning_memplan.callbacks.options import (
    check_fraction,
    check_measure_every,
    check_optional_int,
    check_tolerance,
    check_type,
)
from lightning_memplan.callbacks.step_record import build_incident, build_step_record
from lightning_memplan.model.result import Calibration, MemoryEstimate
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.report.gather import gather_objects
from lightning_memplan.report.io import write_report
from lightning_memplan.report.records import (
    EpochReport,
    MemoryReport,
    RankAccumulator,
    RankSummary,
    StepRecord,
)
from lightning_memplan.report.render import check_units, render_rich
from lightning_memplan.tracking.compiled import AllocationMeter, compiled_parts, eager_view
from lightning_memplan.validation import check_bool, check_mapping

__all__ = ["MemoryPlanCallback"]

#: Per-(micro_batch, seq_len) estimates kept (sequence length may change every batch).
_ESTIMATE_CACHE_SIZE = 256


class MemoryPlanCallback(Callback):
    r"""Estimate and measure per-rank memory every training step; report it after each epoch.

    At fit start the callback infers the :class:`ModelSpec` from the LightningModule, the
    :class:`TrainSpec` from the Trainer (precision plugin, ``accumulate_grad_batches``, the optimizer
    from ``configure_optimizers``, the first batch's shape) and the :class:`ParallelPlan` from the running
    strategy, and calibrates the batch-dependent terms with one traced fake-tensor step (falling back to
    the analytic model, and saying so, when tracing fails). Every training step, on every rank, it
    estimates memory for that step's real batch shape and measures it: on CUDA the allocator's peak
    allocated/reserved bytes per phase (peaks reset each step); on CPU the process RSS every step and
    live tensor bytes per component (a tensor tracker) on the first step and every
    ``measure_every_n_steps`` (and on the first step after the first optimizer step, the first one
    the steady-state estimate describes); on MPS sampled allocator counters. After each epoch it gathers every rank's
    figures and writes ``memory_report.json`` (all ranks, every epoch, merged and replaced atomically),
    ``memory_report.md`` and ``memory_report.png`` (with matplotlib) to ``trainer.log_dir`` (or
    ``default_root_dir``), prints a rich table on rank 0 and logs to every logger.

    **Logged metrics** (to ``trainer.loggers``, rank 0's values, every ``log_every_n_steps`` optimizer steps
    and on every tracked step, at the step ``self.log`` uses, one value per optimizer step; bytes are exact
    integers, and each byte metric also has a view in ``units`` named ``<key>_<units lower-case>``, e.g.
    ``memplan/measured_peak_gib``):

    - ``memplan/estimated_peak`` — the memory model's peak allocated tensor bytes for this step's shape
    - ``memplan/measured_peak`` — measured peak allocated tensor bytes of the step (CUDA allocator every
      step; tensor tracker on tracked CPU steps; sampled on MPS)
    - ``memplan/reserved`` — peak reserved bytes (CUDA allocator), driver-allocated (MPS) or process RSS (CPU)
    - ``memplan/headroom`` — capacity (``memory_budget``, device memory, or RAM on CPU) minus ``reserved``
      (minus memory held outside the allocator on CUDA)
    - ``memplan/measured_to_estimated`` — measured_peak / estimated_peak (not for warm-up steps)
    - ``memplan/micro_batch``, ``memplan/seq_len`` — the step's batch shape
    - ``memplan/{forward,backward,optimizer}/estimated_peak`` — the estimate's peak within each phase
    - ``memplan/{forward,backward,optimizer}/measured_peak`` — the measured peak within each phase
    - ``memplan/<component>/estimated`` and ``memplan/<component>/measured`` — on tracked steps, for each
      component ``params, grads, optimizer, master, activations, attention, logits, comm, workspace, other``
    - after each epoch: ``memplan/epoch/{estimated_peak,measured_peak,reserved}_{max,min,imbalance}``
      (imbalance = max / mean - 1 across ranks), ``memplan/epoch/headroom_min``, ``memplan/epoch/ranks``

    Args:
        measure_every_n_steps: run the tensor tracker on the first step and every this many steps
            (CPU/MPS; also CUDA with ``track_tensors=True``). A tracked step runs ~1.3-1.7x slower on a
            small CPU model, so the default keeps the amortised cost under 1%.
        tolerance: warn when a measured peak exceeds the estimate by more than this fraction.
        min_headroom: warn when free memory falls below this fraction of the capacity.
        units: display unit of the report and of the metric views: ``"B"``, ``"KiB"``, ``"MiB"``,
            ``"GiB"``, ``"KB"``, ``"MB"``, ``"GB"``.
        calibrate: fit the batch-dependent terms with one traced fake-tensor step at fit start.
        seq_len: sequence length to use when the batch layout has none (images, odd layouts).
        max_seq_len: forecast whether this sequence length would fit (default: the largest seen).
        model_spec, train_spec, plan: explicit :class:`ModelSpec` / :class:`TrainSpec` /
            :class:`ParallelPlan` for what cannot be inferred (``train_spec``'s batch shape is replaced by
            each step's real one when it can be read).
        memory_budget: capacity in bytes for headroom and forecasts instead of the device's memory
            (on CPU the default is the machine's RAM).
        track_tensors: ``None`` tracks tensors on CPU and MPS only; ``True`` also on CUDA; ``False`` never.
        write_files: write the report files after each epoch and on an exception.
        print_report: print the rich table on rank 0 after each epoch.

    Raises:
        ValueError: ``tolerance`` < 0, ``min_headroom`` outside [0, 1), ``measure_every_n_steps`` < 1,
            an unknown ``units``, ``seq_len``/``max_seq_len``/``memory_budget`` not a positive int.
        TypeError: ``model_spec``/``train_spec``/``plan`` of the wrong type.

    Example::

        from lightning import Trainer
        from lightning_memplan import MemoryPlanCallback
        trainer = Trainer(callbacks=[MemoryPlanCallback()])
    """

    def __init__(
        self,
        *,
        measure_every_n_steps: int = 100,
        tolerance: float = 0.10,
        min_headroom: float = 0.10,
        units: str = "GiB",
        calibrate: bool = True,
        seq_len: int | None = None,
        max_seq_len: int | None = None,
        model_spec: ModelSpec | None = None,
        train_spec: TrainSpec | None = None,
        plan: ParallelPlan | None = None,
        memory_budget: int | None = None,
        track_tensors: bool | None = None,
        write_files: bool = True,
        print_report: bool = True,
    ) -> None:
        self.measure_every_n_steps = check_measure_every(measure_every_n_steps)
        self.tolerance = check_tolerance(tolerance)
        self.min_headroom = check_fraction("min_headroom", min_headroom, upper=1.0)
        self.units = check_units(units)
        self.calibrate = check_bool("calibrate", calibrate)
        self.seq_len = check_optional_int("seq_len", seq_len, "the tokens per sequence, e.g. seq_len=2048")
        self.max_seq_len = check_optional_int("max_seq_len", max_seq_len, "e.g. max_seq_len=8192")
        self.memory_budget = check_optional_int("memory_budget", memory_budget, "bytes, e.g. 80 * 2**30")
        self.model_spec = check_type("model_spec", model_spec, ModelSpec)
        self.train_spec = check_type("train_spec", train_spec, TrainSpec)
        self.plan = check_type("plan", plan, ParallelPlan)
        if track_tensors not in (None, True, False):
            raise ValueError(f"track_tensors={track_tensors!r} must be None (CPU/MPS only), True or False")
        self.track_tensors = track_tensors
        self.write_files = check_bool("write_files", write_files)
        self.print_report = check_bool("print_report", print_report)
        # Run state (persisted by state_dict): the report so far, steps seen, warnings already given.
        self._report = MemoryReport()
        # Shared with the copies a spawning launcher pickles into its processes (callbacks.handoff).
        self._handoff_token = uuid.uuid4().hex
        self._batches_seen = 0
        self._warned: set[str] = set()
        self._acc: RankAccumulator | None = None
        self._max_shape_seen = (0, 0)
        self._reset_fit_state()

    @property
    def report(self) -> MemoryReport:
        """The memory report so far (every rank, every epoch). After a fit that ran in child processes
        (``ddp_spawn``), the calling process's callback reads what rank 0 handed back."""
        if getattr(self, "_probe", None) is None:  # this process ran no fit: maybe its children did
            recovered = load_handoff(self._handoff_token)
            if recovered is not None:
                self._report = recovered
        return self._report

    @report.setter
    def report(self, value: MemoryReport) -> None:
        self._report = value

    def _reset_fit_state(self) -> None:
        self._rank = 0
        self._spawned = False  # the fit runs in processes a spawning launcher started (callbacks.handoff)
        self._log_dir: str | None = None
        self._probe: PhaseProbe | None = None
        self._tracker: Any = None
        self._meter: AllocationMeter | None = None
        self._compiled: list[str] = []  # what torch.compile wrapped (compiled_parts), found at the first batch
        self._tracking_enabled = False
        self._spec: ModelSpec | None = None
        self._train: TrainSpec | None = None
        self._plan_: ParallelPlan | None = None
        self._est_rank: int | None = None
        self._calibration: Calibration | None = None
        self._estimates: OrderedDict[tuple[int, int], MemoryEstimate | None] = OrderedDict()
        self._initialised = False
        self._stepped = False
        self._steady_tracked = False  # whether a step after the first optimizer step was tracked
        self._current: dict[str, Any] | None = None
        self._window: list[StepRecord] = []  # records of the micro-batches of the optimizer step under way
        self._epoch_warnings: list[str] = []
        self._epoch_warning_steps: list[int] = []  # the step each of _epoch_warnings was raised at

    # ------------------------------------------------------------------------------------ set-up
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset_fit_state()
        self._rank = trainer.global_rank
        self._report_dirs: list[str] | None = None  # rank 0's report folders, resolved at the first write
        self._spawned = runs_in_children(trainer)
        # trainer.log_dir broadcasts from rank 0: resolve it now, while every rank calls the hook, and
        # never from on_exception (where the other ranks would not join the collective).
        self._log_dir = trainer.log_dir or trainer.default_root_dir
        self._probe = make_probe(trainer.strategy.root_device)
        kind = self._probe.kind
        self._tracking_enabled = self.track_tensors is True or (
            self.track_tensors is None and kind in ("cpu", "mps")
        )

    def _note(self, text: str) -> None:
        """Record what could not be inferred or measured; warn once (rank 0)."""
        if text not in self.report.notes:
            from dataclasses import replace

            self.report = replace(self.report, notes=(*self.report.notes, text))
        self._warn_once(f"note:{text}", text)

    def _warn_once(self, key: str, text: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        self._epoch_warnings.append(text)
        self._epoch_warning_steps.append(int((self._current or {}).get("step", self._batches_seen)))
        rank_zero_warn(f"MemoryPlanCallback: {text}")

    def _initialise(self, trainer: Trainer, pl_module: LightningModule, batch: Any) -> None:
        """Infer specs and calibrate at the first batch of the fit (needs the batch and the optimizer)."""
        self._initialised = True
        self._compiled = compiled_parts(pl_module)
        if self._compiled:
            how = (
                "the profiler's allocator events" if self._probe is not None and self._probe.kind == "cpu"
                else "the allocator counters"
            )
            self._note(
                f"torch.compile detected ({', '.join(self._compiled)}): calibration traces the eager original "
                f"and measured steps use {how} instead of the tensor tracker (a dispatch mode would make "
                "dynamo skip the compiled frames); no per-component measurement"
            )
        spec = self.model_spec
        if spec is None:
            try:
                spec = infer_model_spec(trainer, pl_module)
            except (ValueError, TypeError) as exc:
                self._note(
                    f"could not infer a ModelSpec from {type(pl_module).__name__} ({exc}); estimates are off, "
                    "measurement continues; pass MemoryPlanCallback(model_spec=ModelSpec(...))"
                )
        try:
            self._train = infer_train_spec(trainer, batch, seq_len=self.seq_len, base=self.train_spec)
        except InferenceError as exc:
            self._note(f"{exc}; estimates are off until it is given, measurement continues")
        if self.plan is not None:
            plan, how = self.plan, "given by plan="
        else:
            try:
                plan, how = infer_plan(trainer, pl_module)
            except InferenceError as exc:
                plan, how = ParallelPlan(dp=trainer.world_size), f"assumed dp={trainer.world_size}"
                self._note(f"{exc}; assumed ParallelPlan(dp={trainer.world_size}) meanwhile")
        self._plan_ = plan
        self._est_rank = self._rank if self._rank < plan.world_size else None
        if self._est_rank is None:
            self._note(
                f"plan {plan.describe()} has {plan.world_size} ranks but the run has {trainer.world_size}; "
                "reporting the worst rank's estimate on every rank; pass a matching plan="
            )
        self._spec = spec
        source = "none"
        if spec is not None and self._train is not None:
            source = "analytic"
            if self.calibrate:
                self._calibration = self._run_calibration(trainer, pl_module, batch)
                source = "calibrated" if self._calibration is not None else "analytic"
        if (
            self.model_spec is None
            and spec is not None
            and "guessed" in (spec.name or "")
            and source == "analytic"
        ):
            fix = (
                "or pass calibrate=True" if not self.calibrate
                else "(calibration was asked for but did not run: see the note above)"
            )
            self._note(
                f"the ModelSpec was guessed ({spec.name}) and no traced step calibrated it, so the {source} "
                f"estimate of activations is unreliable; pass MemoryPlanCallback(model_spec=...) {fix}"
            )
        run = {
            "model": spec.name or type(pl_module).__name__ if spec is not None else type(pl_module).__name__,
            "model_spec": spec.to_dict() if spec is not None else None,
            "train_spec": self._train.to_dict() if self._train is not None else None,
            "plan": plan.to_dict(),
            "plan_description": f"{plan.describe()} ({how})",
            "precision": str(trainer.precision),
            "estimate_source": source,
            "accelerator": self._probe.kind if self._probe else "cpu",
            "world_size": trainer.world_size,
            "compiled": list(self._compiled),
        }
        from dataclasses import replace

        self.report = replace(self.report, run=run)

    def _run_calibration(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any
    ) -> Calibration | None:
        """Fit the batch-dependent terms from traced fake-tensor steps of the real LightningModule with
        the real optimizer class and the real batch's structure (``model.trace.calibrate``); ``None``
        and a note saying why when tracing fails."""
        from lightning_memplan.model.trace import calibrate

        assert self._train is not None
        sharded = parallelised_by(pl_module) or pipeline_split(trainer)
        if sharded is not None:
            self._note(
                f"calibration skipped: the LightningModule is already parallelised ({sharded}), and a "
                "fake-tensor trace needs a plain copy of it; the analytic memory model is used"
            )
            return None
        b, s = self._train.micro_batch, self._train.seq_len
        shapes = _calibration_shapes(b, s, self._spec.dim_head if self._spec is not None else None)
        optimizer: Any = self._train.optimizer
        if trainer.optimizers:
            opt = _unwrap(trainer.optimizers[0])
            optimizer = _optimizer_factory(opt)
        extra: dict[str, Any] = {}
        if not pl_module.automatic_optimization:
            if len(trainer.optimizers) != 1:
                self._note(
                    f"calibration skipped: manual optimization with {len(trainer.optimizers)} optimizers cannot be "
                    "traced with one; the analytic memory model is used"
                )
                return None
            # training_step runs backward and the optimizer step itself, through Trainer-backed methods
            optimizer, extra["loss_fn"] = manual_optimization_trace(optimizer)
        try:
            # The eager original under the force_eager stance: the fake-tensor trace (a dispatch mode) never
            # reaches a compiled frame, so dynamo neither converts nor skips any (eager_view).
            with eager_view(pl_module) as eager:
                return calibrate(
                    eager,
                    shapes,
                    input_fn=batch_factory(batch, b, s),
                    optimizer=optimizer,
                    precision=self._train.precision,
                    **extra,
                )
        except Exception as exc:  # noqa: BLE001 - any tracing failure falls back to the analytic model
            self._note(
                f"calibration with a traced fake-tensor step failed ({type(exc).__name__}: {exc}); using the "
                "analytic memory model (pass calibrate=False to skip the attempt)"
            )
            return None

    # ------------------------------------------------------------------------------------ estimates
    def _estimate(self, b: int, s: int) -> MemoryEstimate | None:
        key = (b, s)
        if key in self._estimates:
            self._estimates.move_to_end(key)
            return self._estimates[key]
        est = None
        if self._spec is not None and self._train is not None and self._plan_ is not None:
            from lightning_memplan.model.estimate import estimate_memory

            try:
                train = self._train.replace(micro_batch=stage_micro_batch(self._plan_, b), seq_len=s)
                est = estimate_memory(
                    self._spec, train, self._plan_, rank=self._est_rank, calibration=self._calibration
                )
            except (ValueError, TypeError) as exc:
                self._note(f"the memory model cannot estimate batch {b} x {s}: {exc}")
        self._estimates[key] = est
        if len(self._estimates) > _ESTIMATE_CACHE_SIZE:
            self._estimates.popitem(last=False)
        return est

    # ------------------------------------------------------------------------------------ per step
    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        epoch = trainer.current_epoch
        if self._acc is None or self._acc.epoch != epoch or self._acc.rank != self._rank:
            self._acc = RankAccumulator(rank=self._rank, epoch=epoch, backend=self._backend())

    def _backend(self) -> str:
        return self._probe.kind if self._probe is not None else "cpu"

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._probe is None:  # fit without setup(stage="fit"): nothing to do
            return
        if not self._initialised:
            self._initialise(trainer, pl_module, batch)
        shape: tuple[int, int] | None
        try:
            shape = batch_shape(batch, seq_len=self.seq_len)
        except InferenceError as exc:
            shape = (self._train.micro_batch, self._train.seq_len) if self._train is not None else None
            self._note(f"{exc} (per-step shape unknown; using train_spec's)" if shape else str(exc))
        step = self._batches_seen
        # The first step is warm-up (no optimizer states yet), so the first steady-state step is
        # tracked too: every run gets at least one measurement the estimate is compared with.
        first_steady = self._stepped and not self._steady_tracked
        tracked = self._tracking_enabled and (
            step == 0 or first_steady or (step + 1) % self.measure_every_n_steps == 0
        )
        if tracked and self._stepped:
            self._steady_tracked = True
        self._current = {
            "step": step,
            "epoch": trainer.current_epoch,
            "shape": shape,
            "estimate": self._estimate(*shape) if shape is not None else None,
            "tracked": tracked,
            "warmup": not self._stepped,
        }
        if tracked:
            if self._compiled:
                if self._probe.kind == "cpu":
                    self._meter = AllocationMeter("cpu")
                    self._meter.start(pl_module, [_unwrap(o) for o in trainer.optimizers], batch)
            else:
                self._start_tracker(trainer, pl_module, shape)
        self._probe.start_step()

    def _start_tracker(
        self, trainer: Trainer, pl_module: LightningModule, shape: tuple[int, int] | None
    ) -> None:
        from lightning_memplan.tracking import TensorTracker

        seq = shape[1] if shape is not None and shape[1] > 1 else None
        vocab = self.model_spec.vocab_size if self.model_spec is not None else None
        tracker = TensorTracker(
            pl_module,
            [_unwrap(o) for o in trainer.optimizers],
            seq_len=seq,
            vocab_size=vocab,
            device=trainer.strategy.root_device,
        )
        tracker.start()
        tracker.set_phase("forward")
        self._tracker = tracker

    def _enter_phase(self, phase: str) -> None:
        if self._probe is not None and self._probe.phase is not None:
            self._probe.enter_phase(phase)
        if self._tracker is not None:
            self._tracker.set_phase(phase)
        if self._meter is not None:
            self._meter.set_phase(phase)

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._enter_phase("backward")

    @override
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Closes the backward peak at its end; anything until the optimizer step (clipping) is backward too.
        self._enter_phase("backward")

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._enter_phase("optimizer")
        if self._current is not None:
            self._current["stepped"] = True

    def _stop_tracker(self) -> Any:
        tracker, self._tracker = self._tracker, None
        if tracker is None:
            return None
        try:
            return tracker.report()
        finally:
            tracker.stop()

    def _stop_meter(self, reading: Any) -> bool:
        """Put the allocation meter's peaks (a compiled CPU step) into ``reading``; whether it ran."""
        meter, self._meter = self._meter, None
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
        return {"cuda": "cuda_allocator", "mps": "mps_sampled"}.get(self._backend(), "rss")

    def _record(self, reading: Any, tracker_report: Any, metered: bool = False) -> StepRecord:
        return build_step_record(
            self._current or {}, reading, tracker_report, rank=self._rank, default_step=self._batches_seen,
            memory_budget=self.memory_budget, backend=self._backend(),
            measurement=self._measurement(tracker_report, metered),
        )

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._probe is None or self._current is None:
            return
        reading = self._probe.end_step()
        metered = self._stop_meter(reading)
        record = self._record(reading, self._stop_tracker(), metered)
        if self._acc is None:
            self._acc = RankAccumulator(rank=self._rank, epoch=trainer.current_epoch, backend=self._backend())
        self._acc.add(record)
        self._check(record)
        self._window.append(record)
        self._batches_seen += 1
        if self._current.get("stepped"):
            self._stepped = True
        self._current = None
        if emit.accumulating(trainer, pl_module):
            return  # one value per optimizer step, at the step self.log uses (as Lightning logs)
        window, self._window = self._window, []
        # Trainer(log_every_n_steps=...) is stored on the trainer by its logger connector; same rule as
        # Lightning's own `should_update_logs`: log when (optimizer steps + 1) is a multiple of it.
        step = emit.lightning_step(trainer)
        every = max(1, int(trainer.log_every_n_steps))  # type: ignore[attr-defined]
        should_log = (step + 1) % every == 0 or any(r.tracked for r in window)
        if should_log and self._rank == 0:
            emit.log_metrics(trainer, emit.merge_window(window, self.units), step=step)

    def _calibration_state(self) -> str:
        """``"calibrated"``, ``"off"`` (``calibrate=False``) or ``"skipped"`` (asked for, did not run)."""
        if self._calibration is not None:
            return "calibrated"
        return "skipped" if self.calibrate else "off"

    def _check(self, record: StepRecord) -> None:
        """Mismatch, headroom and forecast warnings (each once per run)."""
        if record.tracked or record.backend == "cuda":
            text = mismatch_message(record, self.tolerance, units=self.units, calibration=self._calibration_state())
            if text:
                self._warn_once("mismatch", text)
        plan = self._plan_ or ParallelPlan()
        train = (
            self._train.replace(micro_batch=record.micro_batch, seq_len=record.seq_len)
            if (self._train is not None and record.micro_batch and record.seq_len)
            else self._train
        )
        text = headroom_message(record, self.min_headroom, plan, train, units=self.units)
        if text:
            self._warn_once("headroom", text)
        if record.micro_batch is None or record.seq_len is None or not record.device_memory:
            return
        b = max(self._max_shape_seen[0], record.micro_batch)
        s = max(self._max_shape_seen[1], record.seq_len)
        grew = (b, s) != self._max_shape_seen
        self._max_shape_seen = (b, s)
        if not grew or "forecast" in self._warned:
            return
        target = max(self.max_seq_len or 0, s)
        est = self._estimate(b, target)
        if est is not None:
            text = forecast_message(
                target,
                est.total,
                record.device_memory,
                est.components(),
                plan,
                self._train.replace(micro_batch=b, seq_len=target) if self._train is not None else None,
                rank=self._rank,
                units=self.units,
            )
            if text:
                self._warn_once("forecast", text)

    # ------------------------------------------------------------------------------------ epoch end
    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._probe is None:
            return
        acc = self._acc or RankAccumulator(
            rank=self._rank, epoch=trainer.current_epoch, backend=self._backend()
        )
        gathered = gather_objects((acc.summary().to_dict(), list(self._epoch_warnings), list(self._epoch_warning_steps)))
        ranks = tuple(sorted((RankSummary.from_dict(s) for s, _, _ in gathered), key=lambda r: r.rank))
        first_at: dict[str, int] = {}  # each warning, in order of appearance, at the first step any rank raised it
        for _, ws, steps in gathered:
            for text, at in zip(ws, steps, strict=True):
                first_at[text] = min(at, first_at.get(text, at))
        warnings = list(first_at)
        for text in warnings:  # other ranks' warnings surface on rank 0 (rank_zero_warn) once each
            if text not in self._epoch_warnings:
                self._warn_once(f"peer:{text[:80]}", text)
        epoch = EpochReport(
            epoch=acc.epoch, ranks=ranks, warnings=tuple(warnings), warning_steps=tuple(first_at[t] for t in warnings)
        )
        self.report = self.report.with_epoch(epoch)
        self._acc = None
        self._epoch_warnings = []
        self._epoch_warning_steps = []
        if self._rank != 0:
            return
        if self._spawned:
            save_handoff(self._handoff_token, self.report)
        files = self._write_files(trainer)
        if self.print_report:
            import rich

            rich.get_console().print(render_rich(self.report, epoch=epoch.epoch, units=self.units))
        step = emit.lightning_step(trainer, epoch_end=True)
        emit.log_metrics(trainer, emit.epoch_metrics(epoch, self.units), step=step)
        emit.log_report_text(trainer, epoch, self.units, step=step)
        if files is not None:
            log_report_files(trainer, files, epoch, self.units, step=step)

    def _png_possible(self) -> bool:
        """Whether matplotlib imports; if not, say once that no PNG is written (it is a dependency, so a
        broken or removed install is worth a word, not a silent gap)."""
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            self._note(
                f"memory_report.png is not written: matplotlib cannot be imported ({exc}); the JSON, Markdown "
                "and HTML reports are; pip install matplotlib for the picture"
            )
            return False
        return True

    def _write_files(self, trainer: Trainer) -> Any:
        """Write the report to every logger's own run folder (``report_dirs``, rank 0); the first
        folder's :class:`~lightning_memplan.report.io.WrittenFiles`, or ``None`` when nothing was written."""
        if not self.write_files or not self._log_dir:
            return None
        if self._report_dirs is None:
            self._report_dirs = report_dirs(trainer, self._log_dir)
        png = self._png_possible()
        first = None
        for directory in self._report_dirs:
            _, written = write_report(self.report, directory, units=self.units, png=png)
            first = first or written
        return first

    # ------------------------------------------------------------------------------------ failures
    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Write the report, with the failing step's estimate and the allocator state, before the error
        propagates. Never raises itself (the original exception must surface)."""
        try:
            self._record_incident(exception)
        except Exception as exc:  # noqa: BLE001 - must not mask the original exception
            rank_zero_warn(
                f"MemoryPlanCallback could not write the report after {type(exception).__name__}: {exc!r}"
            )

    def _record_incident(self, exception: BaseException) -> None:
        tracker_report = None
        if self._tracker is not None:
            tracker_report = self._stop_tracker()
        if self._meter is not None:
            meter, self._meter = self._meter, None
            meter.close()
        reading = None
        if self._probe is not None and self._probe.phase is not None:
            reading = self._probe.end_step()
        record = self._record(reading, tracker_report) if self._current is not None else None
        allocator = self._probe.allocator_summary() if self._probe is not None else {"rss": read_rss()}
        incident = build_incident(
            exception, record, allocator, tracker_report, current=self._current or {}, rank=self._rank,
            accumulator=self._acc, default_step=self._batches_seen,
        )
        self.report = self.report.with_incident(incident)
        self._current = None
        if self._rank == 0 and self._spawned:
            save_handoff(self._handoff_token, self.report)
        if self.write_files and self._log_dir:
            write_report(
                self.report,
                (self._report_dirs or [self._log_dir])[0],
                units=self.units,
                rank_suffix=None if self._rank == 0 else self._rank,
            )

    # ------------------------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "report": self.report.to_dict(),
            "batches_seen": self._batches_seen,
            "warned": sorted(self._warned),
            "accumulator": self._acc.to_dict() if self._acc is not None else None,
            "max_shape_seen": list(self._max_shape_seen),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_mapping("MemoryPlanCallback.load_state_dict(state_dict)", state_dict, ("report",),
                      hint="pass what MemoryPlanCallback.state_dict() returned (a checkpoint's callback state)")
        try:
            report = MemoryReport.from_dict(state_dict["report"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(
                f"MemoryPlanCallback.load_state_dict(state_dict): state_dict['report'] is not a memory report "
                f"({type(exc).__name__}: {exc}); pass what MemoryPlanCallback.state_dict() returned"
            ) from None
        self.report = report
        self._batches_seen = int(state_dict.get("batches_seen", 0))
        self._warned = set(state_dict.get("warned", ()))
        self._max_shape_seen = tuple(int(x) for x in state_dict.get("max_shape_seen", (0, 0)))  # type: ignore[assignment]
        acc = state_dict.get("accumulator")
        # A checkpoint holds rank 0's state; another rank's partial epoch cannot be restored from it.
        self._acc = RankAccumulator.from_dict(acc) if acc and int(acc["rank"]) == self._rank else None

