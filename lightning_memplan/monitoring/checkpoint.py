"""Checkpoint saves in the estimate / measure / report core, shared by the callback and the Fabric monitor.

Why a wrapper and not a hook: Lightning builds the state dict in ``_CheckpointConnector.dump_checkpoint``
(``strategy.lightning_module_state_dict()`` and ``strategy.optimizer_state()``: where a full state dict
is gathered) and only then calls ``Callback.on_save_checkpoint`` (the last thing ``dump_checkpoint``
does), after which ``Trainer.save_checkpoint`` calls ``strategy.save_checkpoint`` (the write: DCP's plan
exchange, ``torch.save`` into a ``BytesIO``). No hook spans both, and ``on_save_checkpoint`` sees neither
the gather nor the write. Fabric has no hook at all around ``fabric.save``. So the front door replaces the
bound method on the *instance* (``trainer.save_checkpoint``, ``fabric.save``) with :func:`measured_save`'s
wrapper, which calls the original with the same arguments and returns its result unchanged; the
measurement never raises (a failure is a warning) and the instance attribute is deleted again at
teardown (:func:`restore_save`), giving back the class's method. ``ModelCheckpoint`` saves through
``trainer.save_checkpoint``, so its saves are measured too.

A save is a collective (Lightning: "needs to be called on all processes"), so after it every rank's
record is gathered at once (the front door's gather) and joins the epoch under way (at its end) or, between
epochs (``ModelCheckpoint`` at a training epoch's end runs after this callback's ``on_train_epoch_end``, or a
save after ``fit``), the latest epoch of the report, which is written again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from lightning_memplan.model.checkpoint_estimate import checkpoint_mode, estimate_checkpoint_memory
from lightning_memplan.monitoring.eval_steps import live_training_state
from lightning_memplan.report.checkpoints import CheckpointRecord
from lightning_memplan.report.render import format_bytes

if TYPE_CHECKING:
    from lightning_memplan.monitoring.session import MemorySession, RunContext

__all__ = ["checkpoint_message", "measured_save", "restore_save", "state_dict_options"]

_WRAPPED = "__memplan_original__"


def state_dict_options(strategy: Any) -> tuple[bool, bool]:
    """``(full_state_dict, cpu_offload)`` as the strategy asks torch for the state dict: Lightning's
    ``ModelParallelStrategy`` (Trainer and Fabric, and ``memplan_auto``) uses
    ``StateDictOptions(full_state_dict=not save_distributed_checkpoint, cpu_offload=True)``; any other
    strategy saves ``module.state_dict()`` as it is."""
    sdc = getattr(strategy, "_save_distributed_checkpoint", None)
    if isinstance(sdc, bool):
        return (not sdc, True)
    return (False, False)


def checkpoint_message(record: CheckpointRecord, train_peak: int | None, capacity: int | None, units: str) -> str | None:
    """A warning with a remedy when the save is the run's peak or would not fit; ``None`` otherwise."""
    peak = record.measured_peak or record.estimated_peak
    if not peak:
        return None
    remedy = (
        "save a sharded checkpoint (save_distributed_checkpoint=True, the default of ModelParallelStrategy and "
        "memplan_auto) so no rank gathers the full state dict" if record.mode == "full"
        else "save less often, keep cpu_offload=True, or free memory before saving (e.g. set gradients to None)"
    )
    if capacity and peak > capacity:
        return (f"checkpoint save #{record.index} on rank {record.rank} ({record.mode}) needs {format_bytes(peak, units)}, "
                f"more than the {format_bytes(capacity, units)} available: it would not fit; {remedy}")
    if train_peak and peak > train_peak:
        return (f"checkpoint save #{record.index} on rank {record.rank} ({record.mode}) peaks at "
                f"{format_bytes(peak, units)}, above the training step's {format_bytes(train_peak, units)}: the save "
                f"is the run's peak; {remedy}")
    return None


class _Measurement:
    """One rank's measurement of one save: the tensor tracker (CPU) or the probe's allocator peak (CUDA)."""

    def __init__(self, session: MemorySession, run: RunContext) -> None:
        self.session, self.run = session, run
        self.tracker: Any = None
        self.before: int | None = None
        self.probed = False
        fit = session.fit
        if fit.probe is None or fit.current is not None:  # no fit set up, or inside a step: do not disturb it
            return
        if fit.tracking_enabled:
            from lightning_memplan.live import unwrap_optimizer
            from lightning_memplan.tracking.tracker import TensorTracker

            device = getattr(run.strategy, "root_device", None)
            self.tracker = TensorTracker(run.module, [unwrap_optimizer(o) for o in run.optimizers], device=device,
                                         timeline_points=None)
            self.tracker.start()
            self.tracker.set_phase("optimizer")
            self.tracker.reset_peaks()
            self.before = self.tracker.live_bytes
        elif fit.probe.kind == "cuda":
            fit.probe.start_step()
            self.probed = True

    def stop(self) -> tuple[int | None, str]:
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            try:
                return sum(tracker.report().peak.values()), "tensor_tracker"
            finally:
                tracker.stop()
        if self.probed:
            self.probed = False
            probe = self.session.fit.probe
            assert probe is not None
            return probe.end_step().measured_peak, "cuda_allocator"
        return None, "none"


def _estimate(session: MemorySession, run: RunContext, full: bool, offload: bool, device: str) -> Any:
    fit = session.fit
    if fit.spec is None or fit.train is None or fit.plan is None:
        return None
    grads, states = live_training_state(run.module, run.optimizers)
    try:
        return estimate_checkpoint_memory(
            fit.spec, fit.train, fit.plan, full_state_dict=full, cpu_offload=offload, rank=fit.est_rank,
            device="cpu" if device == "cpu" else "cuda", grads_alive=grads, optimizer_states=states,
            param_tensors=sum(1 for _ in run.module.parameters()) or None,
        )
    except (ValueError, TypeError) as exc:
        session.note(f"the memory model cannot estimate the checkpoint save: {exc}")
        return None


class CheckpointSaves:
    """The saves of one session: counts them, measures each, gathers the records (module docstring)."""

    def __init__(self, session: MemorySession, gather: Callable[[Any], list[Any]]) -> None:
        self.session = session
        self.gather = gather
        self.saves = 0
        self._inside = False

    def around(self, run: RunContext, save: Callable[..., Any], args: tuple, kwargs: dict, epoch: int, step: int,
               after: Callable[[], Any] | None) -> Any:
        """``save(*args, **kwargs)`` measured; its result, or its exception, unchanged."""
        if self._inside:  # a save inside a save (Fabric's strategy through fabric.save): measured once
            return save(*args, **kwargs)
        session = self.session
        full, offload = state_dict_options(run.strategy)
        device = session.backend
        measurement: _Measurement | None = None
        estimate = None
        try:
            estimate = _estimate(session, run, full, offload, device)
            measurement = _Measurement(session, run)
        except Exception as exc:  # noqa: BLE001 - monitoring never stops the user's save
            session.warn_once("checkpoint_failed", f"the checkpoint save could not be measured ({type(exc).__name__}: "
                              f"{exc}); the save goes on without that measurement")
        self._inside = True
        try:
            result = save(*args, **kwargs)
        except BaseException:
            self._stop(measurement)
            raise
        finally:
            self._inside = False
        measured, how = self._stop(measurement)
        plan = session.fit.plan
        record = CheckpointRecord(
            rank=session.rank, epoch=epoch, step=step, index=self.saves,
            mode=estimate.mode if estimate is not None else checkpoint_mode(plan, full_state_dict=full) if plan else "plain",
            full_state_dict=full, cpu_offload=offload,
            estimated_peak=estimate.device_peak if estimate is not None else None,
            estimated_resident=estimate.resident if estimate is not None else None,
            estimated_host=estimate.host_peak if estimate is not None else None,
            measured_peak=measured, measured_before=measurement.before if measurement is not None else None,
            measurement=how,
        )
        self.saves += 1
        self._collect(record, after)
        return result

    def _stop(self, measurement: _Measurement | None) -> tuple[int | None, str]:
        if measurement is None:
            return None, "none"
        try:
            return measurement.stop()
        except Exception as exc:  # noqa: BLE001 - monitoring never stops the user's save
            self.session.warn_once("checkpoint_failed", f"the checkpoint save could not be measured "
                                   f"({type(exc).__name__}: {exc}); the run goes on")
            return None, "none"

    def _collect(self, record: CheckpointRecord, after: Callable[[], Any] | None) -> None:
        """Gather every rank's record (a collective, as the save is), warn, and file the records."""
        session = self.session
        try:
            gathered = [CheckpointRecord.from_dict(d) for d in self.gather(record.to_dict())]
        except Exception as exc:  # noqa: BLE001 - monitoring never stops the user's run
            session.warn_once("checkpoint_gather", f"the checkpoint records could not be gathered "
                              f"({type(exc).__name__}: {exc}); this rank's record only")
            gathered = [record]
        self._check(record)
        latest = session.report.latest
        if session.acc is not None or latest is None:  # an epoch is under way: it files them at its end
            session.pending_checkpoints.extend(gathered)
            return
        merged = replace(latest, checkpoints=(*latest.checkpoints, *gathered))
        session.report = replace(session.report, epochs=tuple(merged if e.key == latest.key else e
                                                              for e in session.report.epochs))
        if after is not None and session.rank == 0:
            try:
                after()
            except Exception as exc:  # noqa: BLE001 - monitoring never stops the user's run
                session.warn_once("checkpoint_write", f"the report could not be written after the checkpoint save "
                                  f"({type(exc).__name__}: {exc})")

    def _check(self, record: CheckpointRecord) -> None:
        session = self.session
        train_peak = None
        if session.acc is not None and session.acc.steps:
            summary = session.acc.summary()
            train_peak = summary.measured_peak or summary.estimated_peak
        elif session.report.latest is not None:
            mine = [r for r in session.report.latest.ranks if r.rank == session.rank]
            if mine:
                train_peak = mine[0].measured_peak or mine[0].estimated_peak
        capacity = session.options.memory_budget
        text = checkpoint_message(record, train_peak, capacity, session.options.units)
        if text:
            session.warn_once(f"checkpoint:{record.mode}", text)


def measured_save(owner: Any, name: str, saves: CheckpointSaves, context: Callable[[], tuple[RunContext, int, int]],
                  after: Callable[[], Any] | None = None) -> None:
    """Replace ``owner.<name>`` (a bound method: ``trainer.save_checkpoint``, ``fabric.save``) on the
    instance with a measuring wrapper; ``context()`` gives the run, the epoch and the global step at the
    save. Installed once; :func:`restore_save` takes it away."""
    original = getattr(owner, name)
    if getattr(original, _WRAPPED, None) is not None:
        return

    @functools.wraps(original)
    def save(*args: Any, **kwargs: Any) -> Any:
        try:
            run, epoch, step = context()
        except Exception:  # noqa: BLE001 - monitoring never stops the user's save
            return original(*args, **kwargs)
        return saves.around(run, original, args, kwargs, epoch, step, after)

    setattr(save, _WRAPPED, original)
    setattr(owner, name, save)


def restore_save(owner: Any, name: str) -> None:
    """Undo :func:`measured_save`: the instance gets its class's method back."""
    current = owner.__dict__.get(name) if hasattr(owner, "__dict__") else None
    if current is not None and getattr(current, _WRAPPED, None) is not None:
        delattr(owner, name)
