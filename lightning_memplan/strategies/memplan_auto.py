"""``MemplanAutoStrategy``: plan the parallel layout at setup, then apply it with PyTorch's own machinery.

A thin adapter (as torchtitan's ``parallelize.py`` over its ``parallel_dims.py``) over Lightning's :class:`~lightning.pytorch.strategies.ModelParallelStrategy`
(process group, DTensor checkpointing, optimizer handling) and PyTorch's FSDP2 ``fully_shard``, DTensor
``parallelize_module``, ``torch.distributed.pipelining`` and ``checkpoint_wrapper``. What it adds:

1. after the setup hooks (the DataModule's ``setup`` has built its data), before ``configure_model``:
   rank 0 reads the model, the batch shape, the precision and the hardware, asks
   :func:`lightning_memplan.planning.plan` (or takes ``plan=``), checks the plan can be applied to this
   module, and broadcasts the result; every rank builds the same ``pp x dp_replicate x dp_shard x tp``
   DeviceMesh and the ranks compare a fingerprint of plan and model (all-gather): a mismatch raises on
   every rank instead of hanging in a later collective.
2. ``setup``: unless the module parallelised itself in ``configure_model``, pipeline split -> tensor
   parallel -> activation checkpointing -> FSDP2 (torchtitan's order).
3. Under pipeline parallelism, ``training_step`` runs the schedule and ``backward`` hands its gradients
   to the parameters.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.model_parallel import _distributed_checkpoint_load, _has_dtensor_modules
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_memplan.live import has_fsdp2, parallelised_by
from lightning_memplan.live.layouts import TransformerLayout, find_layout
from lightning_memplan.model.specs import ParallelPlan, TrainSpec
from lightning_memplan.parallel.apply import apply_resolution, check_accelerator, planned_optimizer_mismatch
from lightning_memplan.parallel.decision import Resolution, ResolvedStrategy
from lightning_memplan.parallel.inputs import batch_reader, train_spec_for
from lightning_memplan.parallel.mesh import LIGHTNING_DP_ALIAS, MeshAxis, alias_mesh
from lightning_memplan.parallel.pipeline import PipelineRunner
from lightning_memplan.parallel.record import (
    CHECKPOINT_KEY,
    PLAN_FILENAME,
    checkpoint_plan,
    publish,
    record,
    stored_plan,
)
from lightning_memplan.parallel.resolve import PlanningOptions, plan_on_every_rank, rendezvous, resolve
from lightning_memplan.parallel.stall import RankRendezvous
from lightning_memplan.parallel.tensor_parallel import resume_blocker
from lightning_memplan.validation import check_bool

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["PLAN_FILENAME", "MemplanAutoStrategy"]

#: The barrier ``lightning.pytorch.trainer.call._call_setup_hook`` enters after the DataModule's, the
#: callbacks' and the LightningModule's ``setup``: the earliest point the batch shape is readable.
_AFTER_SETUP_HOOKS = "post_setup"

class MemplanAutoStrategy(ResolvedStrategy, ModelParallelStrategy):
    """Chooses DP / FSDP / TP / PP / activation checkpointing from the memory model and applies it.

    Args:
        memory_budget: bytes each rank may use for tensors; ``None`` uses the detected (or given)
            hardware memory minus ``headroom``. A small value simulates a small GPU.
        allow: restrictions passed to the planner (see :func:`lightning_memplan.planning.plan`).
        hardware: a :class:`~lightning_memplan.hardware.HardwareSpec` or preset name; ``None`` detects.
        plan: force this :class:`~lightning_memplan.model.specs.ParallelPlan` instead of searching
            (its world size must equal devices x num_nodes).
        train: the :class:`~lightning_memplan.model.specs.TrainSpec` to plan with (batch shape,
            precision, optimizer, recompute, loss); ``None`` reads it from the Trainer and first batch.
            With ``plan=``, its ``recompute`` is applied.
        headroom: fraction of device memory kept free (planner's ``headroom``).
        save_distributed_checkpoint, process_group_backend, timeout: as in ``ModelParallelStrategy``.
        calibrate: before a plan is said to fit, check it against the calibrated estimate of the module (its
            meta copy traced under fake tensors on rank 0, at setup; ``parallel/verify.py``), walking the
            planner's ranking until one fits; a forced plan records its calibrated estimate. ``False``: the
            analytic estimate alone decides.

    Attributes:
        decision: the planner's ``PlanDecision`` (or a ``ForcedDecision``); its ``plan`` is applied.
        applied_plan: the :class:`ParallelPlan` actually applied (``decision.plan`` unless a dimension
            had to be folded, which is warned about).
        resolution: plan, mesh sizes, recompute, loss mode and notes.

    Raises:
        ValueError: at setup, for an accelerator it cannot drive, a world size the forced plan does not
            match, a module whose own ``configure_model`` conflicts with the plan, or nothing that fits.

    Example::

        import lightning_memplan  # registers "memplan_auto"
        trainer = L.Trainer(strategy="memplan_auto", devices=8)
    """

    strategy_name = "memplan_auto"

    def __init__(
        self,
        memory_budget: int | None = None,
        allow: Any = None,
        hardware: Any = None,
        plan: ParallelPlan | None = None,
        train: TrainSpec | None = None,
        headroom: float = 0.1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        calibrate: bool = True,
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=check_bool("save_distributed_checkpoint", save_distributed_checkpoint),
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._options = PlanningOptions(
            memory_budget=memory_budget, allow=allow, hardware=hardware, plan=plan, train=train, headroom=headroom,
            calibrate=calibrate,
        )
        self.resolution: Resolution | None = None
        self._plan_pending = False
        self._layout: TransformerLayout | None = None
        self._pipeline: PipelineRunner | None = None
        self._applied = False
        self._self_parallel = False

    # ------------------------------------------------------------------------------------- properties
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        dp_mesh = alias_mesh(self.device_mesh, LIGHTNING_DP_ALIAS)
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    # ------------------------------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        self._check_accelerator()
        self._setup_distributed()
        self._rendezvous("start of fit")  # before Lightning's first collective of the fit
        # Planning needs the batch shape, which an ordinary DataModule knows only after its ``setup``.
        # ``Trainer._run`` calls this, then the setup hooks (ending with ``barrier("post_setup")``), then
        # ``configure_model`` inside ``model_sharded_context`` (which needs the mesh), then ``setup``:
        # the plan is made at the first of the last three.
        self._plan_pending = True

    @override
    def barrier(self, name: str | None = None) -> None:
        if name == _AFTER_SETUP_HOOKS:
            self._rendezvous("end of the setup hooks (prepare_data, setup)")
        super().barrier(name)
        if name == _AFTER_SETUP_HOOKS:
            self._plan_if_pending()

    def _rendezvous(self, what: str) -> RankRendezvous | None:
        """A bounded-wait check-in of every rank (:func:`~lightning_memplan.parallel.resolve.rendezvous`)."""
        return rendezvous(what, self.global_rank, self.world_size)

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Plans first when the setup hooks' barrier was not seen, so ``configure_model`` gets the mesh."""
        self._plan_if_pending()
        with super().model_sharded_context():
            yield

    def _plan_if_pending(self) -> None:
        if not self._plan_pending:
            return
        self._plan_pending = False
        lm = self._require_lightning_module()
        self.resolution, self._device_mesh = plan_on_every_rank(
            lambda: self._resolve(lm.trainer), module=lm, global_rank=self.global_rank,
            world_size=self.world_size, device_type=self.root_device.type,
            what="the same LightningModule (same config and parameter shapes) before fit",
            warn=rank_zero_warn, info=rank_zero_info,
        )
        lm._device_mesh = self._device_mesh

    def _check_accelerator(self) -> None:
        check_accelerator(
            self.accelerator, (CPUAccelerator, CUDAAccelerator), fix="Trainer(accelerator='cpu') or accelerator='cuda'"
        )

    def _require_lightning_module(self) -> pl.LightningModule:
        """``self.lightning_module``, which Lightning attaches before any hook that calls this."""
        lm = self.lightning_module
        if lm is None:
            raise RuntimeError("memplan_auto: no LightningModule is attached to the strategy yet")
        return lm

    def _require_model(self) -> torch.nn.Module:
        """``self.model`` (the wrapped module), set once the trainer connected the LightningModule."""
        model = self.model
        if model is None:
            raise RuntimeError("memplan_auto: no model is attached to the strategy yet")
        return model

    def _resolve(self, trainer: pl.Trainer) -> Resolution:
        """Rank 0: the Trainer's inputs to :func:`~lightning_memplan.parallel.resolve.resolve`."""
        lm = self._require_lightning_module()
        forced, source = self._options.plan, "forced"
        stored = stored_plan(getattr(trainer, "ckpt_path", None))
        if stored is not None and stored.world_size != self.num_processes * self.num_nodes:
            rank_zero_warn(f"memplan_auto: the checkpoint's stored plan {stored.describe()} needs {stored.world_size} "
                           f"processes, this run has {self.num_processes * self.num_nodes}; a plan is made afresh")
            stored = None
        if stored is not None and forced is None:
            forced, source = stored, "checkpoint"
        read_batch = batch_reader(trainer, lm)
        return resolve(
            options=self._options,
            module=lm,
            layout=find_layout(lm),
            read_train=lambda: train_spec_for(trainer, lm, self._options.train, read_batch),
            read_batch=read_batch,
            precision=str(trainer.precision),
            devices=self.num_processes,
            num_nodes=self.num_nodes,
            self_parallel=is_overridden("configure_model", lm),
            forced=forced,
            forced_source=source,
            warn=rank_zero_warn,
        )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        self._plan_if_pending()
        assert self.model is not None and self.accelerator is not None and self.resolution is not None
        self.accelerator.setup(trainer)
        lm = self._require_lightning_module()
        if not self._applied:
            self._self_parallel = _is_self_parallel(lm)
            if self._self_parallel:
                self._check_self_parallel(lm)
            else:
                self._apply(lm)
            self._applied = True
        if self._pipeline is not None:
            self._check_pipeline_loop(trainer)
        if any(isinstance(mod, FullyShardedDataParallel) for mod in self.model.modules()):
            raise TypeError(
                "memplan_auto found modules wrapped with FSDP1 (FullyShardedDataParallel); it applies FSDP2 "
                "(fully_shard) itself, remove the wrapping"
            )
        # FSDP2's CPUOffloadPolicy keeps every parameter (all are in units) and the optimizer states on the
        # CPU: moving them to the device is refused at the first forward (_validate_cpu_offload_params)
        on_host = self.resolution.offload == "params"
        _materialize_distributed_module(self.model, torch.device("cpu") if on_host else self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        if not on_host:
            self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._check_planned_optimizer()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not on_host:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._publish(trainer)

    def _check_planned_optimizer(self) -> None:
        """Warn when the optimizer Lightning built is not the one the plan assumed (see ``optimizer_of``)."""
        message = planned_optimizer_mismatch(
            self.decision,
            self.optimizers[0] if self.optimizers else None,
            fix="MemplanAutoStrategy(train=TrainSpec(..., optimizer={kind!r}))",
        )
        if message is not None:
            rank_zero_warn(message)

    def _apply(self, lm: torch.nn.Module) -> None:
        assert self.resolution is not None
        applied = apply_resolution(lm, self.resolution, self.device_mesh, self.root_device, warn=rank_zero_warn)
        self._layout, self._pipeline, self.plain_module = applied.layout, applied.pipeline, applied.plain
        for note in applied.notes:
            rank_zero_info(f"memplan_auto: {note}")

    def _check_self_parallel(self, lm: torch.nn.Module) -> None:
        plan = self.resolution.plan  # type: ignore[union-attr]
        from torch.distributed.tensor import DTensor

        tp_mesh_used = any(
            isinstance(p, DTensor) and p.device_mesh.mesh_dim_names
            and any(n in (str(MeshAxis.TP), "tensor_parallel") for n in p.device_mesh.mesh_dim_names)
            for p in lm.parameters()
        )
        if plan.tp > 1 and not tp_mesh_used:
            raise ValueError(
                f"the plan has tp={plan.tp} but configure_model applied no tensor parallelism over "
                "self.device_mesh['tensor_parallel'] (no parameter is a DTensor on it); apply TP there, remove "
                "configure_model so memplan_auto applies it, or force plan=ParallelPlan(dp=world_size, ...)"
            )
        dp = self.resolution.mesh.dp  # type: ignore[union-attr]
        if dp > 1 and not has_fsdp2(lm):
            raise ValueError(
                f"the plan has {dp} data-parallel ranks but configure_model applied no fully_shard over "
                "self.device_mesh['data_parallel'], so gradients would never be synchronised; call "
                "fully_shard there, or remove configure_model so memplan_auto applies it"
            )

    def _check_pipeline_loop(self, trainer: pl.Trainer) -> None:
        lm = self._require_lightning_module()
        if not lm.automatic_optimization:
            raise ValueError(
                "pipeline parallelism runs forward and backward inside the schedule, which needs automatic "
                "optimization; set automatic_optimization=True or force a plan with pp=1"
            )
        fn = trainer.state.fn
        if fn != TrainerFn.FITTING:
            fn_name = fn.value if fn is not None else "None"
            pp = self.resolution.plan.pp if self.resolution is not None else "?"
            raise ValueError(
                f"trainer.{fn_name}() is not supported with pipeline parallelism (pp="
                f"{pp}); force a plan with pp=1 for evaluation"
            )
        if is_overridden("validation_step", lm) and trainer.limit_val_batches != 0:
            raise ValueError(
                "validation under pipeline parallelism is not supported by memplan_auto; pass "
                "Trainer(limit_val_batches=0) or force a plan with pp=1"
            )

    def _publish(self, trainer: pl.Trainer) -> None:
        res = self.resolution
        assert res is not None
        log_dir = trainer.log_dir  # collective (broadcast) inside Lightning: every rank calls it
        if self.global_rank == 0:
            publish(res, log_dir, trainer.loggers)

    # ----------------------------------------------------------------------------------- train loop
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().training_step(*args, **kwargs)
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        window_start = batch_idx % self._require_lightning_module().trainer.accumulate_grad_batches == 0
        with self.precision_plugin.train_step_context():
            return self._pipeline.step(args[0], window_start=window_start)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        if self._pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The schedule already ran backward inside training_step; hand its gradients over now that
        # Lightning has zeroed the previous ones.
        self.pre_backward(closure_loss)
        lm = self._require_lightning_module()
        closure_loss = self.precision_plugin.pre_backward(closure_loss, lm)
        self._pipeline.install_grads()
        closure_loss = self.precision_plugin.post_backward(closure_loss, lm)
        self.post_backward(closure_loss)
        return closure_loss

    # ---------------------------------------------------------------------------------- checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        if self.resolution is not None:
            checkpoint[CHECKPOINT_KEY] = record(self.resolution)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        # A pipeline writes its optimizer states with flattened keys (see optimizer_state), every other
        # layout with Lightning's nested ones; the load must ask for the keys the checkpoint has, whatever
        # the layout it is loaded into (the distributed checkpoint reshards the tensors by name).
        written = stored_plan(path) if path.is_dir() else None
        flat = written.pp > 1 if written is not None else self._pipeline is not None
        if path.is_dir() and (self._pipeline is not None or flat or not _has_dtensor_modules(self.model)):
            checkpoint = self._load_sharded(path, weights_only, flatten=flat)
        else:
            checkpoint = super().load_checkpoint(path, weights_only=weights_only)
        stored = checkpoint_plan(checkpoint.get(CHECKPOINT_KEY), path) if isinstance(checkpoint, dict) else None
        if stored is not None and self.resolution is not None:
            blocked = resume_blocker(self._layout, stored.tp, self.resolution.plan.tp)
            if blocked is not None:
                raise ValueError(f"memplan_auto: fit(ckpt_path={str(path)!r}): {blocked}")
        if stored is not None and self.resolution is not None and stored.to_dict() != self.resolution.plan.to_dict():
            rank_zero_warn(
                f"memplan_auto: the checkpoint was written under plan {stored.describe()} "
                f"and is loaded into {self.resolution.plan.describe()} (the distributed checkpoint reshards "
                "parameters and optimizer states by name). fit(ckpt_path=...) reveals the path only after the "
                "layout is applied; set trainer.ckpt_path = path before fit to resume with the stored plan"
            )
        return checkpoint

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._pipeline is None or not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        # Pipeline ranks hold different parameters; flattened keys (``param_groups.<fqn>.lr``) keep each
        # rank's groups apart in the distributed checkpoint (torchtitan does the same for PP).
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return get_optimizer_state_dict(self._require_model(), optimizer, options=self._sharded_options())

    def _sharded_options(self, flatten: bool | None = None) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        flat = self._pipeline is not None if flatten is None else flatten
        return StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=flat)

    def _load_sharded(self, path: Path, weights_only: bool | None, *, flatten: bool) -> dict[str, Any]:
        # Lightning's loader insists on DTensor parameters and unflattened optimizer states; a module
        # without DTensors (one device, pipeline stages without FSDP/TP), a pipeline stage, or a
        # checkpoint written by one (flattened optimizer states, see optimizer_state) is loaded through
        # the same distributed-checkpoint calls, asking for the checkpoint's keys (``flatten``).
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        module = self._require_model()
        state = {"state_dict": get_model_state_dict(module)}
        _distributed_checkpoint_load(state, path)
        module.load_state_dict(state["state_dict"], strict=self._require_lightning_module().strict_loading)
        options = self._sharded_options(flatten)
        for idx, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{idx}"
            template: Any = get_optimizer_state_dict(module, optimizer, options=options)
            own_groups = [list(group.get("params", ())) for group in template.get("param_groups", ())]
            optim_state: dict[str, Any] = {key: template}
            _distributed_checkpoint_load(optim_state, path)
            # Nested keys store each group's parameter names as one object, the writer's full list; a
            # pipeline stage holds only its own parameters, so it keeps its own names.
            for group, names in zip(optim_state[key].get("param_groups", ()), own_groups, strict=False):
                group["params"] = names
            set_optimizer_state_dict(module, optimizer, optim_state_dict=optim_state[key], options=options)
        # As Lightning's ModelParallelStrategy (fabric ``_load_checkpoint``): ``weights_only`` is passed as
        # given, so None means torch's default (True since torch 2.6) and only an explicit
        # ``fit(weights_only=...)`` set to False by the user unpickles arbitrary objects.
        return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)


def _is_self_parallel(module: torch.nn.Module) -> bool:
    """Whether ``configure_model`` already parallelised the module (FSDP2 units or DTensor parameters)."""
    if not is_overridden("configure_model", module):
        return False
    return parallelised_by(module) is not None
