"""``Fabric(strategy="memplan_auto")``: plan the parallel layout at ``fabric.setup`` and apply it.

A thin adapter over Lightning Fabric's :class:`~lightning.fabric.strategies.ModelParallelStrategy` (process
group, distributed checkpoints, FSDP2 ``no_backward_sync``) sharing the Trainer strategy's core
(one core, two front doors, as Lightning's ``ModelParallelStrategy`` builds on
``lightning.fabric.strategies.model_parallel``): :mod:`lightning_memplan.parallel.resolve` plans (rank 0 resolves, broadcasts, every
rank builds the mesh and checks agreement) and :mod:`lightning_memplan.parallel.apply` applies
TP(+SP) -> activation checkpointing -> FSDP2 / replication, through ``ModelParallelStrategy``'s own
``parallelize_fn`` hook. What only Fabric needs:

* the batch shape comes from ``train=TrainSpec(...)``, else the module's ``example_input_array``, else
  the first batch of a dataloader given to ``fabric.setup_dataloaders`` *before* ``fabric.setup``
  (drawn from a fresh iterator under ``torch.random.fork_rng``; the loop's own iteration is untouched);
* samplers Fabric made before the plan existed split the data over all ranks; once the mesh exists they
  are re-initialised over the data-parallel ranks only (tensor-parallel peers must see the same batch);
* FSDP2 and DTensor TP replace parameters, so an optimizer created before ``fabric.setup(model,
  optimizer)`` points at the old tensors: its param groups are remapped by parameter name onto the new
  ones in place (the same object, class and hyperparameters; Fabric does the same for XLA in
  ``Fabric._move_model_to_device``). An optimizer that already holds state is refused;
* pipeline parallelism is not run: its forward and backward run inside the schedule, which a
  hand-written loop does not call. The search is restricted to ``pp=1`` and a forced ``pp > 1`` is
  refused, naming the Trainer strategy, which runs it.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.strategies.model_parallel import _has_dtensor_modules
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import Strategy
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_memplan.live.layouts import TransformerLayout, find_layout
from lightning_memplan.model.specs import TrainSpec
from lightning_memplan.parallel.apply import apply_resolution, check_accelerator, planned_optimizer_mismatch
from lightning_memplan.parallel.decision import Resolution, ResolvedStrategy
from lightning_memplan.parallel.inputs import (
    BatchShapeUnknown,
    compose_train_spec,
    optimizer_spec,
    peek_loader,
)
from lightning_memplan.parallel.mesh import LIGHTNING_DP_ALIAS, alias_mesh
from lightning_memplan.parallel.record import publish, record
from lightning_memplan.parallel.resolve import PlanningOptions, plan_on_every_rank, resolve
from lightning_memplan.validation import check_bool, keyword_options

__all__ = ["PIPELINE_REFUSAL", "MemplanAutoFabricStrategy"]

#: Why a forced ``pp > 1`` is refused under Fabric, and how to run it.
PIPELINE_REFUSAL = (
    "pipeline parallelism is not run under Fabric: its forward and backward run inside the pipeline "
    "schedule (lightning_memplan.strategies.PipelineRunner), which a hand-written loop does not call. Run "
    "pp > 1 with the Trainer, L.Trainer(strategy=MemplanAutoStrategy(plan=...)), or force a plan with pp=1 "
    "(Fabric's search only considers pp=1)"
)

_SUPPORTED_ACCELERATORS = (CPUAccelerator, CUDAAccelerator)
_ACCELERATOR_FIX = "Fabric(accelerator='cpu') or accelerator='cuda'"


class MemplanAutoFabricStrategy(ResolvedStrategy, ModelParallelStrategy):
    """Chooses DP / FSDP / TP / activation checkpointing at ``fabric.setup`` and applies it.

    Args:
        log_dir: folder for ``memplan_plan.json`` (rank 0 writes it at setup); ``None``: call
            :meth:`log_plan` with the Fabric object to write it into its logger's folder.
        save_distributed_checkpoint, process_group_backend, timeout: as in ``ModelParallelStrategy``.
        **planning: the planning options :class:`~lightning_memplan.strategies.MemplanAutoStrategy` takes,
            with its defaults and checks (one :class:`~lightning_memplan.parallel.resolve.PlanningOptions`):
            ``memory_budget``, ``allow``, ``hardware``, ``plan`` (here with ``pp=1``; its world size must
            equal devices x num_nodes), ``train`` (fields left at their defaults are read from the run),
            ``headroom`` and ``calibrate`` (check the plan against the module's calibrated estimate; its
            traced step runs the module's forward with the loss of ``tracking.trace.default_loss``, since the
            loop's own loss is outside the module).

    Attributes:
        decision, applied_plan, resolution: what was planned and applied
            (:class:`~lightning_memplan.parallel.decision.ResolvedStrategy`).

    Raises:
        ValueError: an accelerator it cannot drive (not CPU or CUDA), a forced plan with ``pp > 1`` or for
            another world size, no batch shape to plan with, an optimizer with state, or nothing that fits.
        TypeError: an unknown option; ``fabric.setup`` given something that is not a ``torch.nn.Module``.

    Example::

        import lightning_memplan  # registers "memplan_auto" for the Trainer and for Fabric
        fabric = L.Fabric(strategy="memplan_auto", devices=8)
        fabric.launch()
        loader = fabric.setup_dataloaders(loader)  # before setup: the plan reads the batch shape
        model, optimizer = fabric.setup(model, optimizer)
    """

    def __init__(
        self,
        *,
        log_dir: str | os.PathLike[str] | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **planning: Any,
    ) -> None:
        options = keyword_options(
            PlanningOptions, planning, owner="MemplanAutoFabricStrategy",
            also=("log_dir", "save_distributed_checkpoint", "process_group_backend", "timeout"),
        )
        if options.plan is not None and options.plan.pp > 1:
            raise ValueError(f"plan={options.plan.describe()!r}: {PIPELINE_REFUSAL}")
        super().__init__(
            parallelize_fn=self._parallelize,
            save_distributed_checkpoint=check_bool("save_distributed_checkpoint", save_distributed_checkpoint),
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._options = options
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(f"log_dir={log_dir!r:.80} must be a folder path (str or os.PathLike) or None (the logger's)")
        self._log_dir = None if log_dir is None else os.fspath(log_dir)
        self.resolution: Resolution | None = None
        self._layout: TransformerLayout | None = None
        self._module: nn.Module | None = None
        self._loaders: list[Any] = []
        self._batch: Any = None

    # ------------------------------------------------------------------------------------- properties
    @property  # type: ignore[override]
    @override
    def accelerator(self) -> Any:
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: Any) -> None:
        # Fabric's connector sets it while building the Fabric: refuse there, not at the first collective.
        if accelerator is not None:
            check_accelerator(accelerator, _SUPPORTED_ACCELERATORS, fix=_ACCELERATOR_FIX)
        self._accelerator = accelerator

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self._device_mesh is None:
            # Before the plan every rank is its own data-parallel rank; _fix_samplers narrows it at setup.
            return {"num_replicas": self.world_size, "rank": self.global_rank}
        dp_mesh = alias_mesh(self.device_mesh, LIGHTNING_DP_ALIAS)
        return {"num_replicas": dp_mesh.size(), "rank": dp_mesh.get_local_rank()}

    # ------------------------------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        check_accelerator(self.accelerator, _SUPPORTED_ACCELERATORS, fix=_ACCELERATOR_FIX)
        # ParallelStrategy's part (the device) and the process group; the mesh waits for the plan.
        ParallelStrategy.setup_environment(self)
        self._setup_distributed()

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        if self._device_mesh is None:
            self._loaders.append(dataloader)  # its first batch gives the shape; its sampler is fixed at setup
        return dataloader

    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
        for i, optimizer in enumerate(optimizers):
            if any(optimizer.state.values()):
                raise ValueError(
                    f"optimizers[{i}] ({type(optimizer).__name__}) already holds state (it stepped before "
                    "fabric.setup); memplan_auto replaces the parameters (FSDP2/TP) and remaps the optimizer onto "
                    "them, which would orphan that state. Create the optimizer fresh before fabric.setup(model, "
                    "optimizer), or after fabric.setup_module(model) from model.parameters()"
                )
        names = _parameter_names(module) if isinstance(module, nn.Module) else {}
        module = self._setup(module, optimizers)
        for optimizer in optimizers:
            _remap_optimizer(optimizer, names, module)
        return module, optimizers, scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        return self._setup(module, [])

    @override
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``fabric.setup_optimizers(optimizer)`` after ``fabric.setup_module(model)``: the optimizer must hold
        the set-up module's parameters (created from ``model.parameters()`` after setup)."""
        if self._module is not None:
            current = {id(p) for p in self._module.parameters()}
            if any(id(p) not in current for group in optimizer.param_groups for p in group["params"]):
                raise ValueError(
                    f"the optimizer ({type(optimizer).__name__}) holds parameters that are not the set-up model's: "
                    "memplan_auto replaced them (FSDP2/TP) in fabric.setup_module. Create the optimizer after "
                    "setup_module from model.parameters(), or pass both to fabric.setup(model, optimizer), which "
                    "remaps it"
                )
            message = planned_optimizer_mismatch(
                self.decision, optimizer, fix="MemplanAutoFabricStrategy(train=TrainSpec(..., optimizer={kind!r}))"
            )
            if message is not None:
                rank_zero_warn(message)
        return optimizer

    def _setup(self, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> nn.Module:
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"module={module!r} must be a torch.nn.Module; memplan_auto plans and shards the model given to "
                "fabric.setup(model, optimizer)"
            )
        if self._module is not None:
            raise ValueError(
                "memplan_auto plans one model per Fabric, and one is already set up; put the models in one "
                "nn.Module, or use another strategy for the second"
            )
        from lightning_memplan.live import parallelised_by

        already = parallelised_by(module)
        if already is not None:
            raise ValueError(
                f"the module passed to fabric.setup is already parallelised ({already}); memplan_auto applies the "
                "layout itself: pass the plain module, or use Fabric(strategy=ModelParallelStrategy("
                "parallelize_fn=...)) to apply your own"
            )
        self._plan(module, optimizers)
        module = super().setup_module(module)  # FSDP1 check, parallelize_fn (below), meta materialisation
        if self.resolution is None or self.resolution.offload != "params":
            # parameters outside FSDP2/TP units (one process) join the device; under CPUOffloadPolicy every
            # parameter is in a unit and must stay on the CPU (torch's _validate_cpu_offload_params)
            module.to(self.root_device)
        self._module = module
        if self._log_dir is not None and self.global_rank == 0:
            os.makedirs(self._log_dir, exist_ok=True)
            assert self.resolution is not None
            publish(self.resolution, self._log_dir, ())
        return module

    def _plan(self, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        """Rank 0 resolves, every rank receives it, builds the mesh and checks agreement."""
        options = self._options

        def compute() -> Resolution:
            return resolve(
                options=options,
                module=module,
                layout=find_layout(module),
                read_train=lambda: self._read_train(module, optimizers),
                read_batch=lambda: self._sample(module),
                precision=str(self.precision.precision),
                devices=self.num_processes,
                num_nodes=self.num_nodes,
                self_parallel=False,
                forced=options.plan,
                forced_source="forced",
                never=frozenset({"pp"}),
                runner="Fabric",
                warn=rank_zero_warn,
                # The loop computes its loss outside the module and may read lm_head.weight whole
                # (LinearCrossEntropy(model(x), model.lm_head.weight, y)): the head stays in the root unit.
                head_in_root=True,
            )

        self.resolution, self._device_mesh = plan_on_every_rank(
            compute, module=module, global_rank=self.global_rank, world_size=self.world_size,
            device_type=self.root_device.type,
            what="the same model (same config and parameter shapes) before fabric.setup",
            warn=rank_zero_warn, info=rank_zero_info,
        )
        self._fix_samplers()

    def _parallelize(self, module: nn.Module, mesh: Any) -> nn.Module:
        """``ModelParallelStrategy``'s ``parallelize_fn``: apply the broadcast resolution."""
        assert self.resolution is not None
        applied = apply_resolution(module, self.resolution, mesh, self.root_device, warn=rank_zero_warn)
        self._layout, self.plain_module = applied.layout, applied.plain
        for note in applied.notes:
            rank_zero_info(f"memplan_auto: {note}")
        return module

    def _read_train(self, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> TrainSpec:
        """The run's TrainSpec: shape from ``train=``, ``example_input_array`` or the first loader's batch;
        precision from Fabric's precision plugin; the optimizer given to ``fabric.setup`` (AdamW if none)."""
        from lightning_memplan.live import InferenceError

        base = self._options.train
        shape = (base.micro_batch, base.seq_len) if base is not None else self._batch_shape(module)
        device = "cpu" if self.root_device.type == "cpu" else "cuda"  # as live.kernel_device
        optimizer = ("adamw", "for_loop" if device == "cpu" else "foreach")  # optimizer_of's fallback
        if optimizers:
            try:
                optimizer = optimizer_spec(optimizers[0], device)
            except InferenceError:
                pass
        from lightning_memplan.live.low_precision import low_precision_fields

        precision = str(self.precision.precision)
        return compose_train_spec(
            shape=shape, module=module, precision=precision, grad_accumulation=1,
            device=device, optimizer=optimizer, base=base, runner="Fabric",
            low=low_precision_fields(self.precision, module, precision),
        )

    def _sample(self, module: nn.Module) -> Any:
        """The module's ``example_input_array``, else the first batch of the first loader set up before
        ``fabric.setup`` (read once, kept for the calibrated check); ``None`` when neither exists."""
        if self._batch is None:
            sample = getattr(module, "example_input_array", None)
            if sample is None and self._loaders:
                sample = peek_loader(lambda: self._loaders[0])
            self._batch = sample
        return self._batch

    def _batch_shape(self, module: nn.Module) -> tuple[int, int]:
        from lightning_memplan.live import InferenceError, batch_shape

        sample = self._sample(module)
        if sample is None:
            raise BatchShapeUnknown(
                "memplan_auto needs the batch shape to plan at fabric.setup and found no dataloader: call "
                "fabric.setup_dataloaders(train_loader) before fabric.setup(model, optimizer), or pass "
                "MemplanAutoFabricStrategy(train=TrainSpec(micro_batch=..., seq_len=...)), or force "
                "MemplanAutoFabricStrategy(plan=ParallelPlan(...))"
            )
        try:
            return batch_shape(sample)
        except InferenceError as exc:
            raise BatchShapeUnknown(
                f"{exc}; for memplan_auto under Fabric pass MemplanAutoFabricStrategy(train=TrainSpec(micro_batch=..., "
                "seq_len=...))"
            ) from exc

    def _fix_samplers(self) -> None:
        """Re-initialise the distributed samplers made before the plan over the data-parallel ranks."""
        from torch.utils.data import DistributedSampler

        kwargs = self.distributed_sampler_kwargs
        for loader in self._loaders:
            sampler = getattr(loader, "sampler", None)
            if not isinstance(sampler, DistributedSampler):
                sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
            if not isinstance(sampler, DistributedSampler):
                continue
            if (sampler.num_replicas, sampler.rank) == (kwargs["num_replicas"], kwargs["rank"]):
                continue
            DistributedSampler.__init__(
                sampler, sampler.dataset, shuffle=sampler.shuffle, seed=sampler.seed, drop_last=sampler.drop_last,
                **kwargs,
            )
        self._loaders = []

    # ---------------------------------------------------------------------------------- checkpoints
    @property  # type: ignore[override]
    @override
    def checkpoint_io(self) -> Any:
        """Fabric's single-device checkpoint IO (``torch.save``; loading passes ``weights_only`` as given),
        used only for a model the plan left without DTensors (one process); see :meth:`save_checkpoint`."""
        from lightning.fabric.plugins import TorchCheckpointIO

        return TorchCheckpointIO()

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        raise NotImplementedError(f"The `{type(self).__name__}` does not support setting a `CheckpointIO` plugin.")

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Any = None) -> None:
        """``ModelParallelStrategy``'s distributed checkpoint; a model without DTensors (the one-process
        plan ``dp=1``, which shards nothing) is saved as Fabric saves a single device's, since Fabric's
        distributed checkpoint insists on DTensor modules."""
        if self._unsharded():
            Strategy.save_checkpoint(self, path, state, storage_options=storage_options, filter=filter)
            return
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    @override
    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """As :meth:`save_checkpoint`; ``weights_only`` is passed on as given (``None``: torch's default,
        ``True``), never turned off here."""
        if self._unsharded() and os.path.isfile(path):
            return Strategy.load_checkpoint(self, path, state, strict=strict, weights_only=weights_only)
        return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)

    def _unsharded(self) -> bool:
        return self._module is not None and not _has_dtensor_modules(self._module)

    # -------------------------------------------------------------------------------------- records
    def plan_record(self) -> dict[str, Any]:
        """The JSON-ready record of the decision (what ``memplan_plan.json`` holds)."""
        if self.resolution is None:
            raise RuntimeError("memplan_auto has no plan yet: call fabric.setup(model, optimizer) first")
        return record(self.resolution)

    def log_plan(self, fabric: Any) -> None:
        """Write ``memplan_plan.json`` into ``fabric.logger.log_dir`` and log the plan as hyperparameters
        on every ``fabric.loggers`` (rank 0; the other ranks return). Call after ``fabric.setup``."""
        self.plan_record()  # raises before setup
        if self.global_rank != 0:
            return
        assert self.resolution is not None
        log_dir = getattr(fabric.logger, "log_dir", None) if fabric.loggers else None
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
        publish(self.resolution, log_dir, fabric.loggers)


def _parameter_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` (the first name of a tied parameter), before the layout is applied."""
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def _remap_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], module: nn.Module) -> None:
    """Point ``optimizer``'s param groups at ``module``'s current parameters, by name, in place."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    current = {
        name.replace(_CHECKPOINT_PREFIX, ""): p for name, p in module.named_parameters(remove_duplicate=False)
    }
    for group in optimizer.param_groups:
        remapped = []
        for p in group["params"]:
            name = names.get(id(p))
            if name is None or name not in current:
                raise ValueError(
                    f"the optimizer ({type(optimizer).__name__}) holds a parameter of shape {tuple(p.shape)} that is "
                    "not a parameter of the model given with it to fabric.setup; build it from model.parameters()"
                )
            remapped.append(current[name])
        group["params"] = remapped
