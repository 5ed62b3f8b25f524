"""``MemoryPlanCallback``: estimate and measure per-rank memory every step, report after each epoch.

The Trainer's front door over :class:`~lightning_memplan.monitoring.session.MemorySession` (the core it
shares with Fabric's :class:`~lightning_memplan.fabric.MemoryMonitor`): the hooks describe the fit with
a :class:`~lightning_memplan.monitoring.session.RunContext` and drive the session; logging, the report
folders of the Trainer's loggers and the spawn hand-off stay here.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_memplan.model.reserved import ReservedMargin
from lightning_memplan.model.result import Calibration
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.monitoring import emit
from lightning_memplan.monitoring.artifacts import log_report_files, report_dirs
from lightning_memplan.monitoring.checkpoint import CheckpointSaves, measured_save
from lightning_memplan.monitoring.handoff import load_handoff, runs_in_children, save_handoff
from lightning_memplan.monitoring.options import MonitorOptions
from lightning_memplan.monitoring.session import MemorySession, RunContext
from lightning_memplan.report.gather import gather_objects
from lightning_memplan.report.records import MemoryReport

__all__ = ["MemoryPlanCallback"]


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
    figures and writes ``memory_report.json`` (all ranks, every epoch, merged and replaced atomically) and
    ``memory_report.md`` to ``trainer.log_dir`` (or ``default_root_dir``, named in one log line; another fit's
    report already there is kept, this fit's epochs are added as a new run), prints a rich table on rank 0 and
    logs to every logger; ``memory_report.html`` and ``memory_report.png`` (with matplotlib) are drawn on a
    background thread when that is cheap and always at the end of the fit, before ``trainer.fit`` returns
    (:mod:`~lightning_memplan.monitoring.writer`).

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
    - ``memplan/released_late`` — on a tracked step, the bytes of its peak gloo's worker thread released late
    - ``memplan/{forward,backward,optimizer}/estimated_peak`` — the estimate's peak within each phase
    - ``memplan/{forward,backward,optimizer}/measured_peak`` — the measured peak within each phase
    - ``memplan/<component>/estimated`` and ``memplan/<component>/measured`` — on tracked steps, for each
      component ``params, grads, optimizer, master, activations, attention, logits, comm, workspace, other, averaged``
      (``averaged``: a weight-averaging copy's parameters and buffers, only when the run keeps one: Lightning's
      ``StochasticWeightAveraging`` or ``WeightAveraging``/``EMAWeightAveraging``, or a
      ``torch.optim.swa_utils.AveragedModel`` on the module)
    - after each epoch: ``memplan/epoch/{estimated_peak,measured_peak,reserved}_{max,min,imbalance}``
      (imbalance = max / mean - 1 across ranks), ``memplan/epoch/headroom_min``, ``memplan/epoch/ranks``
    - after each validation, test or predict run: ``memplan/<phase>/estimated_peak`` and
      ``memplan/<phase>/measured_peak`` for ``<phase>`` in val, test, predict (e.g. memplan/val/measured_peak),
      and the step keys above under the phase (reserved, headroom, measured_to_estimated, micro_batch,
      seq_len, per-phase and, on tracked steps, per-component), the largest value of the run (smallest headroom)

    **Evaluation steps.** Validation (inside ``trainer.fit``, after the sanity check), test and predict steps
    are estimated for the eval batch's shape
    (:func:`~lightning_memplan.model.eval_estimate.estimate_eval_memory`: no saved activations under
    ``no_grad``, one block's working set, the logits and the loss's buffers, the last training step's
    gradients and the optimizer states as they exist at the step) and measured like training steps (the
    tensor tracker on the first step of each phase per epoch and every ``measure_every_n_steps``). The
    epoch report holds them per phase; a warning with a remedy says when an evaluation phase is the run's
    peak or would not fit. ``trainer.validate``/``test``/``predict`` after a fit add their figures to the
    latest epoch and write the report again. A step that also calls a Hugging Face model's greedy
    ``generate`` on its batch says so with ``generate_tokens``: its KV cache is then part of the estimate.

    Args:
        measure_every_n_steps: run the tensor tracker on the first step and every this many steps
            (CPU/MPS; also CUDA with ``track_tensors=True``). A tracked step runs ~1.3-1.7x slower on a
            small CPU model, so the default keeps the amortised cost under 1%.
        tolerance: warn when a measured peak exceeds the estimate by more than this fraction.
        min_headroom: warn when free memory falls below this fraction of the capacity.
        units: display unit of the report and of the metric views: ``"B"``, ``"KiB"``, ``"MiB"``,
            ``"GiB"``, ``"KB"``, ``"MB"``, ``"GB"``.
        calibrate: fit the batch-dependent terms with one traced fake-tensor step at fit start.
        seq_len: the size axis the memory grows with: tokens for text (read from ``[b, s]`` ids), 1 for
            fixed-size samples (images, videos, waveforms, read as such); pass it to follow another axis
            (a waveform's samples), whose batch dimensions the calibration then resizes.
        max_seq_len: forecast whether this sequence length would fit (default: the largest seen).
        model_spec, train_spec, plan: explicit :class:`ModelSpec` / :class:`TrainSpec` /
            :class:`ParallelPlan` for what cannot be inferred (``train_spec``'s batch shape is replaced by
            each step's real one when it can be read).
        memory_budget: capacity in bytes for headroom and forecasts instead of the device's memory
            (on CPU the default is the machine's RAM).
        track_tensors: ``None`` tracks tensors on CPU and MPS only; ``True`` also on CUDA; ``False`` never.
        write_files: write the report files (JSON and Markdown after each epoch, every file by the end of the
            fit) and on an exception.
        print_report: print the rich table on rank 0 after each epoch.
        generate_tokens: the ``max_new_tokens`` of a greedy Hugging Face ``generate`` your validation, test
            or predict step runs on its batch (the batch is the prompt); its ``DynamicCache`` of
            ``s + generate_tokens - 1`` tokens and the last position's logits are estimated
            (:func:`~lightning_memplan.model.eval_estimate.eval_generate_bytes`) and the step's estimate is
            the larger of its forward and its generation. 0 (the default): the steps generate nothing.

    Raises:
        ValueError: ``tolerance`` < 0, ``min_headroom`` outside [0, 1), ``measure_every_n_steps`` < 1,
            an unknown ``units``, ``seq_len``/``max_seq_len``/``memory_budget`` not a positive int,
            ``generate_tokens`` < 0.
        TypeError: ``model_spec``/``train_spec``/``plan`` of the wrong type; ``generate_tokens`` not an int.
        ValueError: at ``setup``, a second ``MemoryPlanCallback`` in the Trainer (one per Trainer: two would
            write the same report files and metrics; two of this class already stop at ``Trainer(...)`` with
            Lightning's duplicate ``state_key`` error).

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
        generate_tokens: int = 0,
    ) -> None:
        options = MonitorOptions(
            measure_every_n_steps=measure_every_n_steps, tolerance=tolerance, min_headroom=min_headroom,
            units=units, calibrate=calibrate, seq_len=seq_len, max_seq_len=max_seq_len, model_spec=model_spec,
            train_spec=train_spec, plan=plan, memory_budget=memory_budget, track_tensors=track_tensors,
            write_files=write_files, print_report=print_report, generate_tokens=generate_tokens,
        )
        self.measure_every_n_steps = options.measure_every_n_steps
        self.tolerance = options.tolerance
        self.min_headroom = options.min_headroom
        self.units = options.units
        self.calibrate = options.calibrate
        self.seq_len = options.seq_len
        self.max_seq_len = options.max_seq_len
        self.memory_budget = options.memory_budget
        self.model_spec = options.model_spec
        self.train_spec = options.train_spec
        self.plan = options.plan
        self.track_tensors = options.track_tensors
        self.write_files = options.write_files
        self.print_report = options.print_report
        self.generate_tokens = options.generate_tokens
        # Run state (persisted by state_dict): the report so far, steps seen, warnings already given.
        self._session = MemorySession(options, owner="MemoryPlanCallback")
        self._saves = CheckpointSaves(self._session, gather_objects)
        # Shared with the copies a spawning launcher pickles into its processes (callbacks.handoff).
        self._handoff_token = uuid.uuid4().hex
        self._spawned = False  # the fit runs in processes a spawning launcher started (callbacks.handoff)
        self._log_dir: str | None = None
        self._report_dirs: list[str] | None = None

    @property
    def report(self) -> MemoryReport:
        """The memory report so far (every rank, every epoch). After a fit that ran in child processes
        (``ddp_spawn``), the calling process's callback reads what rank 0 handed back."""
        if self._session.fit.probe is None:  # this process ran no fit: maybe its children did
            recovered = load_handoff(self._handoff_token)
            if recovered is not None:
                self._session.report = recovered
        return self._session.report

    @report.setter
    def report(self, value: MemoryReport) -> None:
        self._session.report = value

    @property
    def reserved_margin(self) -> ReservedMargin | None:
        """The CUDA caching allocator's measured margin (reserved - allocated bytes at the worst rank's
        allocated peak) of the report's latest run, the epoch under way included, for
        ``MemoryPlanBatchSizeFinder(reserved_margin=...)`` or ``max_micro_batch(..., reserved_margin=...)``
        (:func:`~lightning_memplan.report.margin.measured_reserved_margin`); ``None`` without CUDA training
        steps. The epoch report shows it as "reserved - allocated"."""
        self.report  # noqa: B018 - a spawned fit's report comes back through the property
        return self._session.reserved_margin()

    @property
    def _spec(self) -> ModelSpec | None:
        """The ModelSpec the estimates use (inferred at the first batch)."""
        return self._session.fit.spec

    @property
    def _train(self) -> TrainSpec | None:
        """The TrainSpec the estimates use (inferred at the first batch; each step's shape replaces its own)."""
        return self._session.fit.train

    @property
    def _calibration(self) -> Calibration | None:
        return self._session.fit.calibration

    def _run(self, trainer: Trainer, pl_module: LightningModule) -> RunContext:
        return RunContext(
            module=pl_module,
            optimizers=tuple(trainer.optimizers),
            strategy=trainer.strategy,
            precision=str(trainer.precision),
            precision_plugin=trainer.precision_plugin,
            accumulate_grad_batches=int(trainer.accumulate_grad_batches),
            world_size=int(trainer.world_size),
            rank=int(trainer.global_rank),
            automatic_optimization=bool(pl_module.automatic_optimization),
            owner="MemoryPlanCallback",
            holders=tuple(getattr(trainer, "callbacks", ())),  # Lightning's SWA / EMA callbacks keep their copy
        )

    # ------------------------------------------------------------------------------------ set-up
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._check_single(trainer)
        if stage != "fit":
            return
        self._report_dirs = None  # rank 0's report folders, resolved at the first write
        self._spawned = runs_in_children(trainer)
        # trainer.log_dir broadcasts from rank 0: resolve it now, while every rank calls the hook, and
        # never from on_exception (where the other ranks would not join the collective).
        self._log_dir = trainer.log_dir or trainer.default_root_dir
        self._session.begin_fit(trainer.strategy.root_device, trainer.global_rank)
        # No hook spans a checkpoint save (the state dict is built before on_save_checkpoint, written after it):
        # the trainer's save_checkpoint is wrapped on the instance (monitoring/checkpoint.py), for every
        # later save of this trainer (ModelCheckpoint's and the user's); restore_save(trainer,
        # "save_checkpoint") takes it away.
        measured_save(trainer, "save_checkpoint", self._saves,
                      lambda: (self._run(trainer, trainer.lightning_module), trainer.current_epoch, trainer.global_step),
                      after=lambda: self._write_files(trainer, epoch_end=True))

    def _check_single(self, trainer: Trainer) -> None:
        """Refuse a second ``MemoryPlanCallback`` in the Trainer (docs/callback.md, "One callback per Trainer").
        Two of the same class already stop at ``Trainer(...)`` (Lightning's duplicate ``state_key``); this
        catches a subclass beside the class, or one appended to ``trainer.callbacks`` later."""
        mine = [cb for cb in getattr(trainer, "callbacks", ()) if isinstance(cb, MemoryPlanCallback)]
        if len(mine) > 1:
            raise ValueError(
                f"callbacks=[...] holds {len(mine)} MemoryPlanCallback instances "
                f"({', '.join(type(cb).__name__ for cb in mine)}); use one MemoryPlanCallback per Trainer. Two would "
                "write the same memory_report.* files in the same log folders, log the same memplan/* metrics, run "
                "their tensor trackers inside each other on the measured steps and both wrap trainer.save_checkpoint. "
                "One callback already estimates and measures every rank; give it the options you need (units=, "
                "memory_budget=, measure_every_n_steps=, ...)"
            )

    # ------------------------------------------------------------------------------------ per step
    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._session.start_epoch(trainer.current_epoch)

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # fit without setup(stage="fit"): the session has no probe and does nothing
        self._session.start_step(self._run(trainer, pl_module), batch, trainer.current_epoch)

    @override
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._session.enter_phase("backward")

    @override
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Closes the backward peak at its end; anything until the optimizer step (clipping) is backward too.
        self._session.enter_phase("backward")

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._session.enter_phase("optimizer")
        self._session.mark_stepped()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._session.end_step(trainer.current_epoch) is None:
            return
        if emit.accumulating(trainer, pl_module):
            return  # one value per optimizer step, at the step self.log uses (as Lightning logs)
        window = self._session.take_window()
        # Trainer(log_every_n_steps=...) is stored on the trainer by its logger connector; same rule as
        # Lightning's own `should_update_logs`: log when (optimizer steps + 1) is a multiple of it.
        step = emit.lightning_step(trainer)
        every = max(1, int(trainer.log_every_n_steps))  # type: ignore[attr-defined]
        should_log = (step + 1) % every == 0 or any(r.tracked for r in window)
        if should_log and self._session.rank == 0:
            emit.log_metrics(trainer, emit.merge_window(window, self.units), step=step)

    # ------------------------------------------------------------------------------------ evaluation steps
    def _eval_start(self, phase: str, trainer: Trainer, pl_module: LightningModule, batch: Any) -> None:
        if trainer.sanity_checking:  # before the first training batch: nothing to compare with, not measured
            return
        self._session.start_eval_step(phase, self._run(trainer, pl_module), batch, trainer.current_epoch)

    def _eval_end(self, phase: str, trainer: Trainer) -> None:
        """One set of ``memplan/<phase>/...`` metrics per evaluation run (its largest values); outside
        ``trainer.fit`` (``validate``/``test``/``predict`` after it) the run's figures join the latest
        epoch of the report, which is written again."""
        session = self._session
        window = session.take_eval_window(phase)
        fitting = trainer.state.fn == "fit"
        epoch = None if fitting else session.end_eval_run()
        if session.rank != 0:
            return
        step = emit.lightning_step(trainer)
        if window:
            emit.log_metrics(trainer, emit.merge_window(window, self.units), step=step)
        if epoch is not None:
            self._write_files(trainer)

    @override
    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._eval_start("val", trainer, pl_module, batch)

    @override
    def on_validation_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._session.end_eval_step("val", trainer.current_epoch)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_end("val", trainer)

    @override
    def on_test_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._eval_start("test", trainer, pl_module, batch)

    @override
    def on_test_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._session.end_eval_step("test", trainer.current_epoch)

    @override
    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_end("test", trainer)

    @override
    def on_predict_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._eval_start("predict", trainer, pl_module, batch)

    @override
    def on_predict_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._session.end_eval_step("predict", trainer.current_epoch)

    @override
    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_end("predict", trainer)

    # ------------------------------------------------------------------------------------ epoch end
    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        session = self._session
        if session.fit.probe is None:
            return
        epoch = session.end_epoch(trainer.current_epoch)
        if session.rank != 0:
            return
        if self._spawned:
            save_handoff(self._handoff_token, session.report)
        files = self._write_files(trainer, epoch_end=True)  # JSON, Markdown; the pictures when cheap (writer.py)
        session.print_epoch(epoch.epoch)
        step = emit.lightning_step(trainer, epoch_end=True)
        emit.log_metrics(trainer, emit.epoch_metrics(epoch, self.units), step=step)
        emit.log_report_text(trainer, epoch, self.units, step=step)
        if files is not None:
            log_report_files(trainer, files, epoch, self.units, step=step)

    def _write_files(self, trainer: Trainer, *, epoch_end: bool = False, final: bool = False) -> Any:
        """Write the report to every logger's own run folder (``report_dirs``, rank 0): every file now, or at
        an ``epoch_end`` (and after a checkpoint save) the JSON and Markdown now and the pictures on the
        writer's thread when cheap, or at the ``final`` end of the fit the pictures not on disk yet
        (monitoring/writer.py). The first folder's :class:`~lightning_memplan.report.io.WrittenFiles`, or
        ``None`` when nothing was written."""
        if not self.write_files or not self._log_dir:
            return None
        if self._report_dirs is None:
            self._report_dirs = report_dirs(trainer, self._log_dir)
            self._say_where(trainer, self._report_dirs)
        if final:
            return self._session.finish_writes(self._report_dirs)
        if epoch_end:
            return self._session.write_epoch(self._report_dirs)
        return self._session.write(self._report_dirs)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The pictures of the final report (the epoch ends wrote its JSON and Markdown), so that every file is
        on disk when ``trainer.fit`` returns; handed to the loggers as the epoch ends hand theirs."""
        session = self._session
        if session.fit.probe is None or session.rank != 0:
            return
        files = self._write_files(trainer, final=True)
        latest = session.report.latest
        if files is not None and latest is not None:
            pictures = replace(files, json=None, markdown=None)  # the JSON/Markdown went at the epoch end
            log_report_files(trainer, pictures, latest, self.units, step=emit.lightning_step(trainer, epoch_end=True))

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Wait for the report writer's thread (a fit that raised wrote its report in ``on_exception``)."""
        self._session.writer.wait()

    @staticmethod
    def _say_where(trainer: Trainer, dirs: list[str]) -> None:
        """One line (rank 0, at the first write) naming the folders the report goes to; without a logger it is
        the Trainer's ``default_root_dir`` (the working folder unless one was given), which another run may
        share: its epochs are then added as a new run of the same file, never in place of this one's."""
        where = ", ".join(dirs)
        if not trainer.loggers:
            rank_zero_info(
                f"MemoryPlanCallback: no logger (logger=False), so memory_report.json/.md/.html/.png go to the "
                f"Trainer's default_root_dir {where}; a run already reported there is kept (this fit's epochs are "
                "added as a new run). Pass Trainer(default_root_dir=...) or a logger for a folder of the run's own"
            )
        else:
            rank_zero_info(f"MemoryPlanCallback: memory_report.json/.md/.html/.png go to {where}")

    # ------------------------------------------------------------------------------------ failures
    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Write the report, with the failing step's estimate and the allocator state, before the error
        propagates. Never raises itself (the original exception must surface)."""
        try:
            self._session.record_incident(exception)
            if self._session.rank == 0 and self._spawned:
                save_handoff(self._handoff_token, self._session.report)
            if self._log_dir:
                self._session.write_incident((self._report_dirs or [self._log_dir])[0])
        except Exception as exc:  # noqa: BLE001 - must not mask the original exception
            rank_zero_warn(
                f"MemoryPlanCallback could not write the report after {type(exception).__name__}: {exc!r}"
            )

    # ------------------------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return self._session.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._session.load_state_dict(state_dict)
