"""``MemoryPlanBatchSizeFinder``: set the largest batch size the memory model says fits, before the first
step, with no trial step.

The Trainer's front door over :func:`lightning_memplan.planning.fit.largest_fit` (the planner's fit test).
The specs are inferred as :class:`~lightning_memplan.callbacks.MemoryPlanCallback` infers them
(:mod:`lightning_memplan.live`); the batch size attribute is found and set with Lightning's
own utilities (``lightning_hasattr`` / ``lightning_getattr`` / ``lightning_setattr``, as its
``BatchSizeFinder``).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_memplan.live import batch_shape, infer_model_spec, infer_plan, infer_train_spec
from lightning_memplan.model.reserved import ReservedMargin
from lightning_memplan.model.result import Calibration
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.planning.budget import caching_allocator_applies
from lightning_memplan.planning.fit import LargestFit, check_reserved_margin, largest_fit
from lightning_memplan.validation import check_bool, check_number, check_optional_int, check_str

__all__ = ["MemoryPlanBatchSizeFinder"]


class MemoryPlanBatchSizeFinder(Callback):
    r"""Set the module's (or DataModule's) batch size to the largest the memory model says fits over every
    phase of a training step, before the first step, without running a trial step.

    At ``on_fit_start`` (after the strategy set the model up and built the optimizers, before the fit loop
    loads the training dataloader) it infers the :class:`ModelSpec` (the module), the :class:`TrainSpec`
    (precision, accumulation, the optimizer, memplan_auto's recompute and loss mode) and the
    :class:`ParallelPlan` (the running strategy: one device, DDP, FSDP, ``ModelParallelStrategy``,
    memplan_auto) the way :class:`~lightning_memplan.callbacks.MemoryPlanCallback` does, searches the
    largest micro-batch with :func:`~lightning_memplan.planning.fit.largest_fit` (the planner's fit test:
    reserved bytes on CUDA, allocated bytes on CPU, against ``memory_budget`` or the device's memory less
    ``headroom``), and sets ``batch_arg_name`` with Lightning's ``lightning_setattr`` (the
    module, its ``hparams`` and the DataModule, as Lightning's ``BatchSizeFinder``). Every rank sets rank
    0's answer (broadcast). Under pipeline parallelism the dataloader batch is ``b * microbatches``.

    The sequence length (the size axis the memory grows with: tokens for text, 1 for fixed-size images,
    videos or waveforms) is ``seq_len=``, else ``train_spec.seq_len``, else read from
    ``example_input_array`` or one batch drawn from a fresh training dataloader (no step runs on it).

    **Calibrated** (``calibrate=True``, the default): the module at hand is traced under fake tensors with
    that batch's structure, the optimizer and the precision, as :class:`~lightning_memplan.callbacks.MemoryPlanCallback`
    calibrates (its meta copy under memplan_auto, which sharded the module; ``monitoring/calibration.py``),
    and the search runs on the calibrated estimate (``largest_fit(calibration=...)``): the batch size set is
    one whose calibrated estimate fits, the rule memplan_auto applies before it says FITS. When the module
    cannot be traced (a module sharded by another strategy, no batch to read, a trace that fails) the
    analytic estimate decides and :attr:`calibration_note` says why.

    **Reserved margin on CUDA** (what the caching allocator holds beyond the allocated bytes), in this
    order: ``reserved_margin=`` when given ("given"); else the margin a
    :class:`~lightning_memplan.callbacks.MemoryPlanCallback` in ``trainer.callbacks`` measured, when its
    report holds CUDA training steps: a fit resumed from a checkpoint restores the callback's state before
    ``on_fit_start`` ("measured in the restored run"; :attr:`MemoryPlanCallback.reserved_margin`,
    :func:`~lightning_memplan.report.margin.measured_reserved_margin`), unless that run had the other
    ``expandable_segments`` setting; else the memory model's (``model.reserved``, with this process's
    ``expandable_segments`` from ``PYTORCH_ALLOC_CONF``: "modelled"). A measured margin is carried to each
    candidate batch by the estimate's batch-dependent bytes
    (:class:`~lightning_memplan.model.reserved.ReservedMargin`). FSDP, DeepSpeed and
    ``ModelParallelStrategy`` (memplan_auto) restore callback state only after ``on_fit_start``: there
    pass ``reserved_margin=`` (e.g. ``2 * 2**30``, the "reserved - allocated" line of the run's report).

    **Logged**: ``rank_zero_info`` says the value, the binding phase and component, and which reserved
    margin was used (``reserved margin: given | measured in the restored run | modelled``); rank 0 logs
    ``memplan/max_micro_batch`` and ``memplan/batch_size`` to ``trainer.loggers`` (step 0).

    Args:
        memory_budget: bytes per device the need must fit under (replaces the device's memory less
            ``headroom``, as ``plan(memory_budget=)``).
        headroom: fraction of the device's memory kept free when ``memory_budget`` is ``None``.
        batch_arg_name: the attribute that holds the batch size (module, ``hparams`` or DataModule).
        seq_len: the sequence length to size the batch for (see above; 1 for an image model).
        max_batch_size: largest batch size to set (default: the search bound, 2**20).
        model_spec, train_spec, plan: explicit specs for what cannot be inferred.
        reserved_margin: the caching allocator's margin on CUDA: a
            :class:`~lightning_memplan.model.reserved.ReservedMargin` (``MemoryPlanCallback.reserved_margin``
            of an earlier run) or an int of bytes added at every batch size; ``None``: a restored
            ``MemoryPlanCallback``'s measurement, else the modelled margin (see above).
        calibrate: search on the calibrated estimate of the module (see above); ``False``: the analytic one.

    Raises:
        ValueError / TypeError: an argument of the wrong value or type (at construction).
        MisconfigurationException: ``batch_arg_name`` not found (at ``setup``).
        ValueError: at fit start, when even a batch of 1 does not fit (the message says what binds).

    Attributes:
        optimal_batch_size: the batch size set (``None`` before a fit).
        fit_result: the :class:`~lightning_memplan.planning.fit.LargestFit` behind it (its
            ``reserved_margin``: the measured or given margin used, ``None`` for the modelled one).
        margin_source: which reserved margin the search used (``"given"``, ``"measured in the restored
            run"``, ``"measured in an earlier fit"``, ``"modelled"``, or ``"none (...)"`` off CUDA).
        calibration_note: which estimate the search ran on: ``"calibrated"``, or why the analytic one
            (``"analytic: calibrate=False"``, ``"analytic: ..."``); ``None`` before a fit.

    Example::

        from lightning import Trainer
        from lightning_memplan import MemoryPlanBatchSizeFinder
        trainer = Trainer(callbacks=[MemoryPlanBatchSizeFinder(memory_budget=20 * 2**30)])
    """

    def __init__(
        self,
        memory_budget: int | None = None,
        headroom: float = 0.1,
        batch_arg_name: str = "batch_size",
        *,
        seq_len: int | None = None,
        max_batch_size: int | None = None,
        model_spec: ModelSpec | None = None,
        train_spec: TrainSpec | None = None,
        plan: ParallelPlan | None = None,
        reserved_margin: ReservedMargin | int | None = None,
        calibrate: bool = True,
    ) -> None:
        if memory_budget is not None:
            memory_budget = int(check_number("memory_budget", memory_budget, minimum=1.0,
                                             hint="bytes per device, e.g. 20 * 2**30, or None for the device's memory"))
        self.memory_budget = memory_budget
        self.headroom = check_number("headroom", headroom, minimum=0.0, maximum=1.0, max_inclusive=False,
                                     hint="a fraction, e.g. 0.1 for 10 % of device memory")
        name = check_str("batch_arg_name", batch_arg_name, hint="the attribute holding the batch size, e.g. 'batch_size'")
        if not name:
            raise ValueError("batch_arg_name='' must name an attribute, e.g. 'batch_size'")
        self.batch_arg_name: str = name
        self.seq_len = check_optional_int("seq_len", seq_len,
                                          hint="tokens per sequence, e.g. 2048, or 1 for fixed-size images")
        self.max_batch_size = check_optional_int("max_batch_size", max_batch_size, hint="e.g. 512, or None")
        for arg, value, cls in (("model_spec", model_spec, ModelSpec), ("train_spec", train_spec, TrainSpec),
                                ("plan", plan, ParallelPlan)):
            if value is not None and not isinstance(value, cls):
                raise TypeError(f"{arg}={value!r:.200} must be a {cls.__name__} or None")
        self.model_spec, self.train_spec, self.plan = model_spec, train_spec, plan
        margin = check_reserved_margin(reserved_margin)  # a ReservedMargin kept as given, bytes as a plain int
        self.reserved_margin: ReservedMargin | int | None = (
            margin if margin is None or isinstance(reserved_margin, ReservedMargin) else margin.overhead)
        self.calibrate = check_bool("calibrate", calibrate, hint="True searches on the module's calibrated estimate")
        self.optimal_batch_size: int | None = None
        self.fit_result: LargestFit | None = None
        self.margin_source: str | None = None
        self.calibration_note: str | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise MisconfigurationException(
                f"MemoryPlanBatchSizeFinder(batch_arg_name={self.batch_arg_name!r}): no such field in the model, "
                "its hparams, the datamodule or its hparams; set one (e.g. self.batch_size = 1) and read it in "
                "train_dataloader()"
            )

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        found, plan = self._search(trainer, pl_module)
        mine = self._batch_size(found, plan)
        size = int(trainer.strategy.broadcast(mine, src=0))  # every rank sets rank 0's answer
        self.fit_result, self.optimal_batch_size = found, size
        if size < 1:
            raise ValueError(f"MemoryPlanBatchSizeFinder: not even a batch of 1 fits: {found.describe()}; "
                             "use a shorter sequence, activation checkpointing, FSDP or a larger budget")
        lightning_setattr(pl_module, self.batch_arg_name, size)
        if trainer.train_dataloader is not None:  # loaded before fit start (estimated_stepping_batches)
            from lightning.pytorch.tuner.batch_size_scaling import _reset_dataloaders

            _reset_dataloaders(trainer)  # Lightning's own finder reloads the same way
        rank_zero_info(f"MemoryPlanBatchSizeFinder: {self.batch_arg_name}={size} ({found.describe()}; "
                       f"reserved margin: {self.margin_source}; estimate: {self.calibration_note})")
        if trainer.global_rank == 0:
            for logger in trainer.loggers:
                logger.log_metrics({"memplan/max_micro_batch": float(found.value), "memplan/batch_size": float(size)},
                                   step=0)

    def _batch_size(self, found: LargestFit, plan: ParallelPlan) -> int:
        per_rank = found.value * (plan.microbatches if plan.pp > 1 else 1)
        return min(per_rank, self.max_batch_size) if self.max_batch_size is not None else per_rank

    def _search(self, trainer: Trainer, pl_module: LightningModule) -> tuple[LargestFit, ParallelPlan]:
        model = self.model_spec if self.model_spec is not None else infer_model_spec(trainer, pl_module)
        plan = self.plan if self.plan is not None else infer_plan(trainer, pl_module)[0]
        s = self._sequence_length(trainer, pl_module)
        # a placeholder batch of the shape to size (meta: nothing allocated, no step run on it)
        placeholder = torch.empty((1, s), dtype=torch.long, device="meta")
        train = infer_train_spec(trainer, placeholder, seq_len=s, base=self.train_spec)
        root = trainer.strategy.root_device
        hardware = None
        if self.memory_budget is None:
            from lightning_memplan.hardware.spec import HardwareSpec

            hardware = HardwareSpec.detect(device=root.index if root.type == "cuda" else None)
        from lightning_memplan.parallel.planner_bridge import expandable_segments_enabled

        expandable = expandable_segments_enabled()
        if caching_allocator_applies(hardware, train):
            margin, self.margin_source = self._margin(trainer, expandable)
        else:
            margin, self.margin_source = None, f"none (a {train.device} step has no caching allocator: allocated bytes)"
        calibration = self._calibration(trainer, pl_module, model, train)
        found = largest_fit(model, train, plan, axis="micro_batch", memory_budget=self.memory_budget,
                            hardware=hardware, headroom=self.headroom, expandable_segments=expandable,
                            reserved_margin=margin, calibration=calibration)
        return found, plan

    def _calibration(self, trainer: Trainer, pl_module: LightningModule, model: ModelSpec,
                     train: TrainSpec) -> Calibration | None:
        """The module's calibration (``monitoring/calibration.run_calibration``, the callback's), traced at
        the shape of one batch of the run; ``None`` with :attr:`calibration_note` saying why."""
        if not self.calibrate:
            self.calibration_note = "analytic: calibrate=False"
            return None
        from lightning_memplan.monitoring.calibration import run_calibration
        from lightning_memplan.monitoring.session import RunContext
        from lightning_memplan.parallel.inputs import peek_batch
        from lightning_memplan.tracking.fake_fidelity import readable_scalars
        from lightning_memplan.tracking.trace import default_loss

        sample = getattr(pl_module, "example_input_array", None)
        sample = sample if sample is not None else peek_batch(trainer)
        notes: list[str] = []
        try:
            b, s = batch_shape(sample)
        except Exception as exc:  # noqa: BLE001 - no batch to trace: the analytic estimate decides
            self.calibration_note = f"analytic: no batch to trace ({exc})"
            return None
        run = RunContext(
            module=pl_module, optimizers=tuple(trainer.optimizers), strategy=trainer.strategy,
            precision=str(trainer.precision), accumulate_grad_batches=int(trainer.accumulate_grad_batches),
            world_size=int(trainer.world_size), rank=int(trainer.global_rank),
            automatic_optimization=bool(pl_module.automatic_optimization),
            loss_fn=readable_scalars(default_loss), owner="MemoryPlanBatchSizeFinder",
        )
        calibration = run_calibration(run, train.replace(micro_batch=b, seq_len=s), model, sample, notes.append)
        self.calibration_note = "calibrated" if calibration is not None else "analytic: " + "; ".join(notes)
        return calibration

    def _margin(self, trainer: Trainer, expandable: bool) -> tuple[ReservedMargin | int | None, str]:
        """The reserved margin on CUDA and where it came from (the class docstring's order)."""
        if self.reserved_margin is not None:
            shown = self.reserved_margin if isinstance(self.reserved_margin, ReservedMargin) \
                else ReservedMargin(overhead=self.reserved_margin)
            return self.reserved_margin, f"given, {shown.describe()}"
        from lightning_memplan.callbacks.memory_plan import MemoryPlanCallback

        monitor = next((cb for cb in getattr(trainer, "callbacks", ()) if isinstance(cb, MemoryPlanCallback)), None)
        measured = monitor.reserved_margin if monitor is not None else None
        if measured is None:
            if monitor is not None and trainer.strategy.restore_checkpoint_after_setup:
                return None, (f"modelled (MemoryPlanCallback holds no CUDA steps at fit start, and "
                              f"{type(trainer.strategy).__name__} restores a checkpoint's callback state only after "
                              "it; pass MemoryPlanBatchSizeFinder(reserved_margin=...) to use a measured margin)")
            return None, "modelled"
        if measured.expandable_segments is not None and measured.expandable_segments != expandable:
            return None, (f"modelled (the measured run had expandable_segments={measured.expandable_segments}, "
                          f"this one {expandable})")
        where = "measured in the restored run" if trainer.ckpt_path is not None else "measured in an earlier fit"
        return measured, f"{where}, {measured.describe()}"

    def _sequence_length(self, trainer: Trainer, pl_module: LightningModule) -> int:
        if self.seq_len is not None:
            return self.seq_len
        if self.train_spec is not None:
            return self.train_spec.seq_len
        sample = getattr(pl_module, "example_input_array", None)
        if sample is None:
            from lightning_memplan.parallel.inputs import peek_batch

            sample = peek_batch(trainer)
        if sample is None:
            raise ValueError("MemoryPlanBatchSizeFinder could not read the sequence length (no example_input_array, "
                             "no training batch); pass MemoryPlanBatchSizeFinder(seq_len=...)")
        return batch_shape(sample)[1]

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"optimal_batch_size": self.optimal_batch_size}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``optimal_batch_size``; a checkpoint's value that is not a whole number in [1, 2**62) (or
        no dict at all) is dropped with one warning and the run goes on (monitoring/state.py's rule)."""
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn

        from lightning_memplan.monitoring.state import MAX_RESTORED_COUNT

        value = state_dict.get("optimal_batch_size") if isinstance(state_dict, dict) else state_dict
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value < MAX_RESTORED_COUNT):
            self.optimal_batch_size = value
            return
        self.optimal_batch_size = None
        rank_zero_warn(f"MemoryPlanBatchSizeFinder.load_state_dict: the checkpoint's 'optimal_batch_size' "
                       f"({value!r:.60}) is not a batch size (a whole number >= 1) and is not used; the run goes on")
