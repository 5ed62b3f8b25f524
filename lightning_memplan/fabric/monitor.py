"""``MemoryMonitor``: the :class:`~lightning_memplan.callbacks.MemoryPlanCallback`'s estimate, measurement,
warnings, OOM report and epoch report for a hand-written Lightning Fabric loop.

Fabric's front door over the same :class:`~lightning_memplan.monitoring.session.MemorySession` the
callback drives: the monitor describes the loop with a
:class:`~lightning_memplan.monitoring.session.RunContext` read from the Fabric and what ``fabric.setup``
returned, and ``with monitor.step(batch):`` stands where the Trainer's batch hooks would.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from lightning_memplan.fabric.collectives import broadcast_json, gather_json
from lightning_memplan.model.eval_estimate import EVAL_PHASES
from lightning_memplan.monitoring import emit
from lightning_memplan.monitoring.artifacts import log_report_files
from lightning_memplan.monitoring.checkpoint import CheckpointSaves, measured_save, restore_save
from lightning_memplan.monitoring.options import MonitorOptions
from lightning_memplan.monitoring.session import MemorySession, RunContext
from lightning_memplan.report.records import EpochReport, MemoryReport, StepRecord
from lightning_memplan.validation import check_bool, check_choice, check_int, keyword_options

__all__ = ["MemoryMonitor"]

_OWNER = "MemoryMonitor"
#: Lightning's default ``Trainer(log_every_n_steps=50)``.
_LOG_EVERY_N_STEPS = 50


def _check_fabric(fabric: Any) -> None:
    from lightning.fabric import Fabric

    if not isinstance(fabric, Fabric):
        raise TypeError(
            f"MemoryMonitor(fabric={type(fabric).__name__} object) must be a lightning.fabric.Fabric; create "
            "fabric = Fabric(...), call fabric.launch(), then model, optimizer = fabric.setup(model, optimizer) "
            "and pass MemoryMonitor(fabric, model, optimizer)"
        )


def _check_model(fabric: Any, model: Any) -> None:
    from lightning.fabric.wrappers import _FabricModule

    if isinstance(model, _FabricModule):
        if model._strategy is not fabric.strategy:
            raise ValueError(
                f"MemoryMonitor(model=...): this {type(model.module).__name__} was set up by another Fabric "
                "object; pass the Fabric that set it up"
            )
        return
    if getattr(fabric, "_models_setup", 0) == 0:
        raise ValueError(
            f"MemoryMonitor(model={type(model).__name__}) was created before fabric.setup: nothing is set up "
            "yet; call fabric.launch() (for several processes), model, optimizer = fabric.setup(model, optimizer), "
            "then MemoryMonitor(fabric, model, optimizer) with what fabric.setup returned"
        )
    raise TypeError(
        f"MemoryMonitor(model={type(model).__name__}) is not a module set up by Fabric (a _FabricModule); "
        "pass the model that model, optimizer = fabric.setup(model, optimizer) returned, not the original"
    )


def _check_optimizer(fabric: Any, optimizer: Any) -> None:
    from lightning.fabric.wrappers import _FabricOptimizer

    if not isinstance(optimizer, _FabricOptimizer):
        raise TypeError(
            f"MemoryMonitor(optimizer={type(optimizer).__name__}) is not an optimizer set up by Fabric (a "
            "_FabricOptimizer); pass the optimizer that model, optimizer = fabric.setup(model, optimizer) returned"
        )
    if optimizer._strategy is not fabric.strategy:
        raise ValueError("MemoryMonitor(optimizer=...) was set up by another Fabric object; pass the Fabric that set it up")


def _check_callable(name: str, value: Any, hint: str) -> Any:
    if value is not None and not callable(value):
        raise TypeError(f"{name}={value!r} must be callable or None; {hint}")
    return value


def _check_averaged(value: Any) -> tuple[Any, ...]:
    """``averaged_models`` as a tuple of modules (one module alone is taken as a tuple of one)."""
    from torch import nn

    models = (value,) if isinstance(value, nn.Module) else value
    if not isinstance(models, (list, tuple)) or not all(isinstance(m, nn.Module) for m in models):
        raise TypeError(
            f"averaged_models={value!r:.80} must be a module or a list of modules (the weight-averaging copies the "
            "loop keeps), e.g. averaged_models=[torch.optim.swa_utils.AveragedModel(model)]"
        )
    return tuple(getattr(m, "module", m) if type(m).__name__ == "_FabricModule" else m for m in models)


def _check_dirpath(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise TypeError(f"dirpath={value!r} must be a folder path (str or os.PathLike) or None (the first logger's log_dir)")
    return os.fspath(value)


class MemoryMonitor:
    r"""Estimate and measure per-rank memory of a Fabric training loop; report it after each epoch.

    The :class:`~lightning_memplan.callbacks.MemoryPlanCallback` for loops without a Trainer, sharing its
    code: at the first step it infers the :class:`ModelSpec` from the module ``fabric.setup`` wrapped, the
    :class:`TrainSpec` from Fabric's precision plugin and the optimizer, the :class:`ParallelPlan` from
    ``fabric.strategy``, and calibrates with one traced fake-tensor step (the same ``loss_fn`` the loop
    uses). Each ``with monitor.step(batch):`` block is one training step: estimated for its batch shape
    and measured (CUDA allocator peaks every step; on CPU the process RSS every step and the tensor
    tracker on the first step, the first step after the first optimizer step and every
    ``measure_every_n_steps``). Inside the block, ``fabric.backward`` marks the backward phase and the
    optimizer's step (a torch ``register_step_pre_hook``) the optimizer phase. An exception inside the
    block (an out-of-memory error) writes the incident report, then propagates.
    :meth:`end_epoch` gathers every rank's figures (Fabric's ``all_gather``), writes
    ``memory_report.json`` and ``.md`` on rank 0, prints the table and logs; the pictures
    (``memory_report.html``, ``.png``) are drawn on a background thread when that costs at most 5 % of the
    loop's time, and for the final report at :meth:`close` (or, if the loop never calls it, when the monitor
    is collected or the interpreter exits), as the callback draws them at the end of the fit.

    **Logged metrics**: the callback's (``memplan/estimated_peak``, ``memplan/measured_peak``, ...,
    ``memplan/epoch/...``; see its docstring), through ``fabric.log_dict`` on rank 0, one value per
    optimizer step at the count of optimizer steps before it, every ``log_every_n_steps`` optimizer steps
    and on every tracked step; ``memplan/val/...`` (``test``, ``predict``) once per epoch for the
    :meth:`eval_step` blocks.

    Args:
        fabric: the launched :class:`lightning.fabric.Fabric`.
        model, optimizer: what ``fabric.setup(model, optimizer)`` returned.
        loss_fn: ``(module, batch) -> loss`` the calibration trace runs on a fake copy of the module;
            pass the loss of your loop (default: next-token cross-entropy of a token batch, as
            :func:`~lightning_memplan.tracking.trace.default_loss`).
        grads_alive_in_forward: ``False`` (default) for the usual Fabric order ``backward, step,
            zero_grad`` (no gradients exist in the next forward); ``True`` when the loop zeroes gradients
            only after the forward.
        accumulate_grad_batches: micro-batches per optimizer step (``fabric.no_backward_sync`` loops).
        log_every_n_steps: log step metrics every this many optimizer steps (Lightning's default 50).
        dirpath: folder of the report files (default: the first logger's ``log_dir``, else the current
            folder), the same on every rank (rank 0's).
        averaged_models: the weight-averaging copies the loop keeps beside the model (e.g.
            ``ema = torch.optim.swa_utils.AveragedModel(model)``), counted as the ``averaged`` component of
            the estimate and the measurement; an ``AveragedModel`` inside the model is found by itself.
        **options: the options :class:`~lightning_memplan.callbacks.MemoryPlanCallback` takes, with its
            defaults and checks (one :class:`~lightning_memplan.monitoring.options.MonitorOptions`):
            ``measure_every_n_steps``, ``tolerance``, ``min_headroom``, ``units``, ``calibrate``,
            ``seq_len``, ``max_seq_len``, ``model_spec``, ``train_spec``, ``plan``, ``memory_budget``,
            ``track_tensors``, ``write_files``, ``print_report``, ``generate_tokens``.

    Raises:
        TypeError: ``fabric`` not a Fabric; ``model``/``optimizer`` not what ``fabric.setup`` returned;
            an unknown option; options of the wrong type (as the callback's).
        ValueError: created before ``fabric.setup``; a model or optimizer of another Fabric; option
            values out of range (as the callback's).

    Example::

        fabric = Fabric(accelerator="cpu", devices=2); fabric.launch()
        model, optimizer = fabric.setup(model, optimizer)
        monitor = MemoryMonitor(fabric, model, optimizer, loss_fn=loss_fn)
        for batch in loader:
            with monitor.step(batch):
                loss = loss_fn(model, batch); fabric.backward(loss); optimizer.step(); optimizer.zero_grad()
        report = monitor.end_epoch()
        monitor.close()  # the final report's pictures
    """

    def __init__(
        self,
        fabric: Any,
        model: Any,
        optimizer: Any,
        *,
        loss_fn: Callable[[Any, Any], Any] | None = None,
        grads_alive_in_forward: bool = False,
        accumulate_grad_batches: int = 1,
        log_every_n_steps: int = _LOG_EVERY_N_STEPS,
        dirpath: str | os.PathLike[str] | None = None,
        averaged_models: Any = (),
        **options: Any,
    ) -> None:
        _check_fabric(fabric)
        _check_model(fabric, model)
        _check_optimizer(fabric, optimizer)
        self.options = keyword_options(
            MonitorOptions, options, owner=_OWNER,
            also=("loss_fn", "grads_alive_in_forward", "accumulate_grad_batches", "log_every_n_steps", "dirpath",
                  "averaged_models"),
        )
        hint = "e.g. loss_fn=lambda model, batch: F.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())"
        self.loss_fn = _check_callable("loss_fn", loss_fn, hint)
        self.grads_alive_in_forward = check_bool("grads_alive_in_forward", grads_alive_in_forward)
        self.accumulate_grad_batches = check_int(
            "accumulate_grad_batches", accumulate_grad_batches, hint="micro-batches per optimizer step, e.g. 4"
        )
        self.log_every_n_steps = check_int("log_every_n_steps", log_every_n_steps, hint="e.g. log_every_n_steps=50")
        self._fabric, self._model, self._optimizer = fabric, model, optimizer
        self._session = MemorySession(self.options, owner=_OWNER)
        self._session.begin_fit(fabric.device, fabric.global_rank)
        self._run = RunContext(
            module=model.module,
            optimizers=(optimizer.optimizer,),
            strategy=fabric.strategy,
            precision=str(getattr(fabric.strategy.precision, "precision", "32-true")),
            precision_plugin=fabric.strategy.precision,
            accumulate_grad_batches=self.accumulate_grad_batches,
            world_size=int(fabric.world_size),
            rank=int(fabric.global_rank),
            loss_fn=self.loss_fn,
            grads_alive_in_forward=self.grads_alive_in_forward,
            owner=_OWNER,
            holders=_check_averaged(averaged_models),
        )
        # Every rank constructs the monitor: agree on rank 0's folder now (a collective), never later.
        self.log_dir: str = broadcast_json(fabric, _check_dirpath(dirpath) or self._default_dir())
        self._epoch = 0
        self._epoch_started = False
        self._optimizer_steps = 0  # optimizer steps before the step under way (the step metrics log at)
        self.files: Any = None  # the last epoch's WrittenFiles on rank 0
        # fabric.save has no hook: it is wrapped on this Fabric instance and measured like the Trainer's saves
        # (monitoring/checkpoint.py); close() gives the Fabric its own method back.
        self._saves = CheckpointSaves(self._session, lambda obj: gather_json(self._fabric, obj))
        measured_save(fabric, "save", self._saves, lambda: (self._run, self._epoch, self._optimizer_steps),
                      after=lambda: self._session.write_epoch([self.log_dir]))
        # The pictures of the final report: at close(), or when the monitor is collected or the interpreter
        # exits without it (the callback's end of the fit; monitoring/session.py finish_later)
        self._finish = self._session.finish_later(self, [self.log_dir])

    def close(self) -> None:
        """Finish the report files and stop measuring ``fabric.save``: wait for the report writer's thread and
        draw the final report's pictures (``memory_report.html`` / ``.png``) unless an epoch end drew them, then
        give the Fabric instance its own ``save`` back. Call it after the last :meth:`end_epoch`; without it the
        pictures are drawn when the monitor is collected or at interpreter exit. A second call does nothing."""
        restore_save(self._fabric, "save")
        files = self._finish()  # None when it ran already, or nothing new was drawn
        latest = self._session.report.latest
        if files is not None and latest is not None and self.rank == 0:
            pictures = replace(files, json=None, markdown=None)  # the epoch ends logged the JSON/Markdown
            log_report_files(self._fabric, pictures, latest, self.options.units, step=max(0, self._optimizer_steps - 1))
            self.files = replace(self.files, html=files.html, png=files.png) if self.files is not None else files

    def _default_dir(self) -> str:
        loggers = self._fabric.loggers
        log_dir = getattr(loggers[0], "log_dir", None) if loggers else None
        return os.fspath(log_dir) if log_dir else os.getcwd()

    @property
    def report(self) -> MemoryReport:
        """The memory report so far (every rank, every epoch ended)."""
        return self._session.report

    @property
    def rank(self) -> int:
        return self._session.rank

    # ------------------------------------------------------------------------------------ per step
    @contextmanager
    def step(self, batch: Any) -> Iterator[None]:
        """One training step: the forward, ``fabric.backward`` and ``optimizer.step()`` run inside.

        Raises:
            RuntimeError: a step started inside another one.
        """
        session = self._session
        if session.in_step:
            raise RuntimeError("MemoryMonitor.step() was entered inside another step; close the first `with` block")
        if not self._epoch_started:
            session.start_epoch(self._epoch)
            self._epoch_started = True
        session.start_step(self._run, batch, self._epoch)
        restore = self._hook_phases()
        try:
            yield
        except BaseException as exc:
            restore()
            self._incident(exc)
            raise
        restore()
        stepped = bool((session.fit.current or {}).get("stepped"))
        record = session.end_step(self._epoch)
        if record is not None and stepped:
            self._log_window()

    @contextmanager
    def eval_step(self, batch: Any, *, phase: str = "val") -> Iterator[None]:
        """One evaluation step of ``phase`` (``"val"``, ``"test"`` or ``"predict"``): the no-grad forward
        (and loss) runs inside; run it under ``torch.no_grad()`` or ``torch.inference_mode()`` as usual.
        Estimated for the batch's shape with what the loop left alive (gradients, optimizer states) and
        measured like a training step; the figures join the epoch's report (``EpochReport.phases``) and
        :meth:`end_epoch` logs ``memplan/<phase>/...`` (e.g. ``memplan/val/measured_peak``). Steps before the
        first training step are not measured (the estimate needs the training run). A failure to measure
        is a warning; an exception inside the block writes the incident report, then propagates.

        Raises:
            ValueError: an unknown ``phase``.
            RuntimeError: entered inside another step.
        """
        phase = check_choice("phase", phase, EVAL_PHASES, hint="the loop the step belongs to, e.g. phase='val'")
        session = self._session
        if session.in_step:
            raise RuntimeError("MemoryMonitor.eval_step() was entered inside another step; close the first `with` block")
        session.start_eval_step(phase, self._run, batch, self._epoch)
        try:
            yield
        except BaseException as exc:
            if session.in_step:
                self._incident(exc)
            raise
        session.end_eval_step(phase, self._epoch)

    def _hook_phases(self) -> Callable[[], None]:
        """Mark backward (``fabric.backward``, wrapped on this Fabric object for the block) and the
        optimizer phase (a step pre-hook of the real optimizer); returns what undoes both."""
        session, fabric = self._session, self._fabric
        original = fabric.backward

        def backward(*args: Any, **kwargs: Any) -> Any:
            session.enter_phase("backward")
            try:
                return original(*args, **kwargs)
            finally:
                session.enter_phase("backward")  # closes the backward peak at its end, as the callback does

        def before_step(*_: Any) -> None:
            session.enter_phase("optimizer")
            session.mark_stepped()

        fabric.backward = backward
        handle = self._optimizer.optimizer.register_step_pre_hook(before_step)

        def restore() -> None:
            handle.remove()
            fabric.__dict__.pop("backward", None)

        return restore

    def _log_window(self) -> None:
        window: list[StepRecord] = self._session.take_window()
        step = self._optimizer_steps
        self._optimizer_steps += 1
        should_log = (step + 1) % self.log_every_n_steps == 0 or any(r.tracked for r in window)
        if should_log and window and self.rank == 0:
            self._fabric.log_dict(emit.merge_window(window, self.options.units), step=step)

    def _incident(self, exception: BaseException) -> None:
        """The incident report of a step that raised; never raises itself."""
        from lightning.fabric.utilities.rank_zero import rank_zero_warn

        try:
            self._session.record_incident(exception)
            self._session.write_incident(self.log_dir)
        except Exception as exc:  # noqa: BLE001 - must not mask the original exception
            rank_zero_warn(f"MemoryMonitor could not write the report after {type(exception).__name__}: {exc!r}")

    # ------------------------------------------------------------------------------------ epoch end
    def end_epoch(self) -> EpochReport:
        """Gather every rank's figures into this epoch's report (a collective: call it on every rank);
        on rank 0 write the report files, print the table and log. Returns the epoch's report.

        Raises:
            RuntimeError: called inside a ``with monitor.step(...)`` block.
        """
        session = self._session
        if session.in_step:
            raise RuntimeError("MemoryMonitor.end_epoch() was called inside a step; call it after the `with` block")
        if session.fit.window:  # micro-batches after the last optimizer step
            self._log_window()
        for phase in EVAL_PHASES:  # one set of memplan/<phase>/... metrics per epoch
            window = session.take_eval_window(phase)
            if window and self.rank == 0:
                self._fabric.log_dict(emit.merge_window(window, self.options.units), step=max(0, self._optimizer_steps - 1))
        epoch = session.end_epoch(self._epoch, gather=lambda obj: gather_json(self._fabric, obj))
        self._epoch += 1
        self._epoch_started = False
        if self.rank != 0:
            return epoch
        units = self.options.units
        # JSON and Markdown now; the pictures on the writer's thread when cheap, and at close() (writer.py)
        self.files = session.write_epoch([self.log_dir])
        if not self._finish.alive:  # an epoch after close(): its pictures at the next close() or at exit
            self._finish = session.finish_later(self, [self.log_dir])
        session.print_epoch(epoch.epoch)
        step = max(0, self._optimizer_steps - 1)
        self._fabric.log_dict(emit.epoch_metrics(epoch, units), step=step)
        emit.log_report_text(self._fabric, epoch, units, step=step)
        if self.files is not None:
            log_report_files(self._fabric, self.files, epoch, units, step=step)
        return epoch

    # ------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The report so far and the counters (JSON-able; save it with ``fabric.save``)."""
        return {**self._session.state_dict(), "epoch": self._epoch, "optimizer_steps": self._optimizer_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue a report from :meth:`state_dict`: every field checked; what is invalid, another run's or
        another version's is dropped with one warning and the loop goes on with fresh state for it
        (:mod:`~lightning_memplan.monitoring.state`)."""
        counters = self._session.load_state_dict(state_dict, counters=("epoch", "optimizer_steps"))
        self._epoch, self._optimizer_steps = counters["epoch"], counters["optimizer_steps"]
