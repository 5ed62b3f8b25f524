"""What the running strategy does to memory: the :class:`~lightning_memplan.model.specs.ParallelPlan` it
runs, DeepSpeed's and FSDP1's settings read from the strategy object, DDP's gradient buckets, and what
parallelises a module in place.

Strategies are recognised by class name along the MRO so that optional backends (DeepSpeed) are never
imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_memplan.live.batch import InferenceError
from lightning_memplan.model.frameworks import zero_settings_from_deepspeed_config
from lightning_memplan.model.specs import ParallelPlan

__all__ = [
    "ddp_bucket_bytes",
    "deepspeed_settings",
    "fsdp1_notes",
    "fsdp1_param_counts",
    "fsdp1_units",
    "has_fsdp1",
    "has_fsdp2",
    "infer_plan",
    "is_deepspeed",
    "is_fsdp1",
    "kernel_device",
    "parallelised_by",
    "pipeline_split",
]


def kernel_device(trainer: Any) -> str:
    """``TrainSpec.device`` for the running fit: ``"cpu"`` on the CPU, else ``"cuda"`` (the CUDA
    kernels' saving behaviour is the model's default for accelerators)."""
    root = getattr(getattr(trainer, "strategy", None), "root_device", None)
    return "cpu" if getattr(root, "type", "cuda") == "cpu" else "cuda"

def is_deepspeed(strategy: Any) -> bool:
    """Whether ``strategy`` is Lightning's ``DeepSpeedStrategy`` (Trainer's ``lightning.pytorch.strategies``
    or Fabric's ``lightning.fabric.strategies``) or a subclass: recognised by class name along the MRO, so
    neither deepspeed nor the strategy module is imported (both classes exist without deepspeed installed,
    but constructing one needs it)."""
    return any(cls.__name__ == "DeepSpeedStrategy" for cls in type(strategy).__mro__)

def deepspeed_settings(strategy: Any) -> tuple[int, str, Any]:
    """``(zero stage, TrainSpec.offload, ZeroConfig)`` of a DeepSpeed strategy, read from its ``config``
    dict (``zero_optimization``: stage, ``offload_optimizer`` / ``offload_param`` devices, bucket and
    stage-3 sizes; :func:`~lightning_memplan.model.frameworks.zero_settings_from_deepspeed_config`).

    Raises:
        InferenceError: the config holds something the model does not read (the message says what to pass).
    """
    config = getattr(strategy, "config", None)
    try:
        return zero_settings_from_deepspeed_config(config if isinstance(config, Mapping) else None)
    except (TypeError, ValueError) as exc:
        raise InferenceError(
            f"DeepSpeed config not readable for the memory model: {exc}; pass MemoryPlanCallback(train_spec="
            "TrainSpec(..., framework='deepspeed', offload=...), plan=ParallelPlan(dp=..., zero=...))"
        ) from None

def is_fsdp1(strategy: Any) -> bool:
    """Whether ``strategy`` is Lightning's ``FSDPStrategy`` (FSDP1, ``FullyShardedDataParallel``; Trainer's or
    Fabric's) or a subclass, recognised by class name along the MRO as :func:`is_deepspeed`."""
    return any(cls.__name__ == "FSDPStrategy" for cls in type(strategy).__mro__)

def _sharding_name(strategy: Any) -> str:
    """The FSDP1 ``ShardingStrategy`` name of a strategy (``"FULL_SHARD"``, ``"HYBRID_SHARD"``, ...)."""
    value = getattr(strategy, "sharding_strategy", "FULL_SHARD")
    return str(getattr(value, "name", value)).upper()

def _fsdp_zero(sharding_strategy: Any) -> int:
    """ZeRO stage of an FSDP1 ``ShardingStrategy`` (FULL_SHARD/HYBRID_SHARD 3, SHARD_GRAD_OP and
    _HYBRID_SHARD_ZERO2 2, NO_SHARD 0)."""
    name = str(getattr(sharding_strategy, "name", sharding_strategy)).upper()
    if "NO_SHARD" in name:
        return 0
    if "GRAD_OP" in name or "ZERO2" in name:
        return 2
    return 3

def fsdp1_units(root: Any) -> list[tuple[str, int, int]]:
    """``(wrapped module class, unpadded numel, padded unsharded numel)`` of every FSDP1 unit under
    ``root`` (Lightning's ``strategy.model``), the root unit first, read from each ``FlatParameter``
    (torch 2.13 ``torch/distributed/fsdp/_flat_param.py``, ``FlatParamHandle._init_flat_param_and_metadata``:
    ``_unpadded_unsharded_size`` is the parameters plus their 16-byte alignment padding under
    ``use_orig_params``, ``_padded_unsharded_size`` adds the padding to a multiple of the world size).
    Empty when nothing is wrapped by FSDP1 (or torch has no FSDP1)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without FSDP1
        return []
    units: list[tuple[str, int, int]] = []
    if not isinstance(root, torch.nn.Module):
        return units
    for module in root.modules():
        handle = getattr(module, "_handle", None) if isinstance(module, FullyShardedDataParallel) else None
        flat = getattr(handle, "flat_param", None)
        if flat is None:
            continue
        unpadded = getattr(flat, "_unpadded_unsharded_size", None)
        padded = getattr(flat, "_padded_unsharded_size", None)
        if unpadded is None:
            continue
        padded = unpadded if padded is None else padded
        inner = getattr(module, "_fsdp_wrapped_module", module)
        units.append((type(inner).__name__, int(unpadded.numel()), int(padded.numel())))
    return units

def fsdp1_param_counts(root: Any) -> tuple[int, int] | None:
    """``(parameters, trainable parameters)`` of the whole model under FSDP1, from the original shapes each
    ``FlatParameter`` records (``_shapes``; ``_params`` under ``use_orig_params``, whose ``requires_grad``
    says what is trained): a rank's own parameters are only its flat shard's views. ``None`` without FSDP1."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without FSDP1
        return None
    total = trainable = 0
    found = False
    if not isinstance(root, torch.nn.Module):
        return None
    for module in root.modules():
        flat = getattr(getattr(module, "_handle", None), "flat_param", None) if isinstance(
            module, FullyShardedDataParallel) else None
        shapes = getattr(flat, "_shapes", None)
        if flat is None or shapes is None:
            continue
        found = True
        originals = getattr(flat, "_params", None) or [None] * len(shapes)
        for shape, param in zip(shapes, originals, strict=False):
            n = int(torch.Size(shape).numel())
            total += n
            trains = param.requires_grad if param is not None else flat.requires_grad
            trainable += n if trains else 0
    return (total, trainable) if found else None

def _fsdp1_shard_size(strategy: Any, world: int) -> int:
    """Ranks one FSDP1 unit is sharded over: the world, or for ``HYBRID_SHARD`` the intra-node shard group
    (the wrapped model's ``process_group``, else the ``device_mesh=(replicate, shard)`` tuple, else the
    devices per node, FSDP1's default intra-node group: torch 2.13 ``_init_utils.py``,
    ``_init_process_group_state_for_hybrid_shard``)."""
    if "HYBRID" not in _sharding_name(strategy):
        return world
    group = getattr(getattr(strategy, "model", None), "process_group", None)
    size = getattr(group, "size", None)
    if callable(size):
        try:
            return max(1, int(size()))
        except Exception:  # noqa: BLE001 - a group of another process world: fall back to the settings
            pass
    mesh = (getattr(strategy, "kwargs", None) or {}).get("device_mesh")
    if isinstance(mesh, tuple) and len(mesh) == 2:
        return max(1, int(mesh[1]))
    shape = getattr(getattr(mesh, "mesh", None), "shape", None)
    if shape is not None and len(shape) == 2:
        return max(1, int(shape[1]))
    return max(1, int(getattr(strategy, "num_processes", world) or world))

def ddp_bucket_bytes(strategy: Any) -> int:
    """Bytes of the gradient buckets that the running strategy's ``DistributedDataParallel`` keeps between
    steps and no Python tensor reaches (its C++ ``Reducer`` owns them), for a tracker to
    :meth:`~lightning_memplan.tracking.tracker.TensorTracker.hold`; 0 when there is no DDP wrapper, when
    gradients are views into the buckets (``gradient_as_bucket_view``: a tracker sees them as the
    gradients), or before the Reducer rebuilt its buckets. DDP rebuilds them once, at the start of the
    second forward (torch 2.13 ``nn/parallel/distributed.py``, ``_pre_forward``: ``_has_rebuilt_buckets``),
    and a tracker of that step sees the new ones allocated; the total is the sum of ``bucket_sizes``
    (bytes) of ``_get_ddp_logging_data()``, which the rebuild keeps (the same gradients, re-split)."""
    model = getattr(strategy, "model", None)
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel) or not getattr(model, "_has_rebuilt_buckets", False):
        return 0
    try:
        data = model._get_ddp_logging_data()
        if data.get("gradient_as_bucket_view"):
            return 0
        return sum(int(size) for size in str(data.get("bucket_sizes", "")).replace(",", " ").split())
    except (AttributeError, RuntimeError, ValueError):  # a torch without the logging data: nothing held
        return 0

def fsdp1_notes(strategy: Any, module: Any) -> list[str]:
    """What the memory model approximates for a Lightning ``FSDPStrategy`` (FSDP1) run: units other than one
    per transformer block plus the root (a custom or missing ``auto_wrap_policy``), ``cpu_offload``, and
    ``HYBRID_SHARD`` across nodes. Empty for anything else."""
    if not is_fsdp1(strategy):
        return []
    notes = []
    units = fsdp1_units(getattr(strategy, "model", None))
    blocks = _block_class(module)
    inner = [name for name, _, _ in units[1:]]
    if units and (blocks is None or not inner or any(name != blocks for name in inner)):
        wrapped = sorted(set(inner)) or ["nothing below the root"]
        notes.append(
            f"FSDPStrategy wraps {', '.join(wrapped)} as FSDP units, not one unit per transformer block"
            + (f" ({blocks})" if blocks else "")
            + ": the memory model assumes per-block units plus the root, so the gathered-parameter (comm) "
            "bytes are approximated; pass auto_wrap_policy={<block class>} for an exact layout"
        )
    offload = getattr(strategy, "cpu_offload", None)
    if getattr(offload, "offload_params", False):
        notes.append(
            "FSDPStrategy(cpu_offload=True) keeps the sharded parameters and gradients in host memory and "
            "steps the optimizer there; the estimate counts them on the device (an upper bound of device memory)"
        )
    name = _sharding_name(strategy)
    if "HYBRID" in name:
        notes.append(
            f"FSDPStrategy({name}) shards within a group and replicates across groups: estimated as "
            "ParallelPlan(dp=<shard group>, zero=3 or 2), the replicas' in-place all-reduce adding no buffer"
        )
    return notes

def _block_class(module: Any) -> str | None:
    """Class name of the repeated transformer block of ``module`` (its largest uniform ``ModuleList``, the
    units inside unwrapped), or ``None``."""
    if not isinstance(module, torch.nn.Module):
        return None
    best = None
    for sub in module.modules():
        if isinstance(sub, torch.nn.ModuleList) and len(sub) > 1:
            names = {type(getattr(m, "_fsdp_wrapped_module", m)).__name__ for m in sub}
            if len(names) == 1 and (best is None or len(sub) > best[0]):
                best = (len(sub), names.pop())
    return best[1] if best else None

def has_fsdp2(module: Any) -> bool:
    """Whether ``fully_shard`` (FSDP2) was applied anywhere in ``module``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return module is not None and any(isinstance(m, FSDPModule) for m in module.modules())

def has_fsdp1(module: Any) -> bool:
    """Whether FSDP1 (``FullyShardedDataParallel``) wraps ``module`` or a part of it: an FSDP1 unit inside, or
    parameters FSDP1 flattened (``_fsdp_flattened``, set on the original parameters by torch 2.13
    ``torch/distributed/fsdp/_common_utils.py``, ``_set_fsdp_flattened``; Lightning's ``FSDPStrategy``
    wraps the LightningModule from outside, so without an auto-wrap policy nothing inside is an FSDP unit)."""
    if not isinstance(module, torch.nn.Module):
        return False
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without FSDP1
        return False
    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        return True
    return any(getattr(p, "_fsdp_flattened", False) for p in module.parameters())

def parallelised_by(module: Any) -> str | None:
    """What parallelises ``module`` in place, or ``None``: FSDP2 units, FSDP1 units or flattened parameters
    (Lightning's ``FSDPStrategy``), or DTensor parameters (tensor parallelism), the forms a LightningModule's
    ``configure_model``, a strategy or memplan_auto leave behind."""
    if has_fsdp2(module):
        return "FSDP2 fully_shard"
    if has_fsdp1(module):
        return "FSDP1 FullyShardedDataParallel"
    from torch.distributed.tensor import DTensor

    if module is not None and any(isinstance(p, DTensor) for p in module.parameters()):
        return "DTensor parameters (tensor parallel)"
    return None

def infer_plan(trainer: Any, pl_module: Any = None) -> tuple[ParallelPlan, str]:
    """``(ParallelPlan, description)`` of the running strategy.

    Recognised by class name so that optional backends (DeepSpeed) are never imported: memplan_auto's
    decision, ``ModelParallelStrategy`` (its device mesh: data_parallel x tensor_parallel, ZeRO-3 when
    FSDP2 ``fully_shard`` was applied), ``FSDPStrategy`` (its sharding strategy), ``DeepSpeedStrategy``
    (its ``zero_optimization.stage``, kept on one device too: DeepSpeed runs its ZeRO optimizer there; the
    rest of its config goes into ``TrainSpec(framework="deepspeed")``, :func:`infer_train_spec`), DDP
    variants (dp = world size) and single-device strategies.
    For memplan_auto, the plan it really applied (``applied_plan``) wins over its planner's decision.
    """
    strategy = trainer.strategy
    name = type(strategy).__name__
    world = int(trainer.world_size)
    applied = getattr(strategy, "applied_plan", None)  # memplan_auto: the plan it really applied
    if isinstance(applied, ParallelPlan):
        return applied, f"{name} applied plan: {applied.describe()}"
    decision = getattr(strategy, "decision", None)
    if decision is not None and isinstance(getattr(decision, "plan", None), ParallelPlan):
        return decision.plan, f"{name} decision: {decision.plan.describe()}"
    if name == "ModelParallelStrategy":
        mesh = strategy.device_mesh
        names = tuple(mesh.mesh_dim_names or ())
        dp = mesh["data_parallel"].size() if "data_parallel" in names else 1
        tp = mesh["tensor_parallel"].size() if "tensor_parallel" in names else 1
        zero = 3 if has_fsdp2(pl_module) else 0
        return ParallelPlan(
            dp=dp, tp=tp, zero=zero
        ), f"{name} mesh {dict(zip(names, mesh.mesh.shape, strict=True))}"
    if is_fsdp1(strategy):
        # FSDP1 (Lightning's FSDPStrategy): FULL_SHARD / HYBRID_SHARD are ZeRO-3, SHARD_GRAD_OP ZeRO-2 over the
        # shard group (HYBRID: within the group; each replica holds the same bytes); NO_SHARD replicates
        # with flat parameters whose gradients are all-reduced in place (no DDP buckets). Its flat-parameter
        # facts go with TrainSpec(framework="fsdp1"), which infer_train_spec sets.
        sharding = _sharding_name(strategy)
        zero = _fsdp_zero(sharding)
        shard = _fsdp1_shard_size(strategy, world) if zero else world
        if shard <= 1:
            return ParallelPlan(), f"{name} ({sharding}, one rank)"
        plan = ParallelPlan(dp=shard, zero=zero) if zero else ParallelPlan(dp=shard, grad_buckets=False)
        replicas = f", replicated x{world // shard}" if shard != world else ""
        return plan, f"{name} ({sharding}{replicas})"
    if is_deepspeed(strategy):
        # DeepSpeed's own ZeRO, not FSDP's layout: the stage goes with TrainSpec(framework="deepspeed"),
        # which infer_train_spec sets from the same config.
        stage, offload, _ = deepspeed_settings(strategy)
        return ParallelPlan(dp=world, zero=stage), (
            f"{name} ZeRO stage {stage}" + (f", offload {offload}" if offload != "none" else "")
        )
    if "DDP" in name or name in ("SingleDeviceStrategy", "SingleDeviceXLAStrategy"):
        return ParallelPlan(dp=world), f"{name} (dp={world})"
    raise InferenceError(
        f"strategy {name!r} is not one the callback can read a layout from; pass "
        f"MemoryPlanCallback(plan=ParallelPlan(dp=..., tp=..., pp=..., zero=...))"
    )

def pipeline_split(trainer: Any) -> str | None:
    """``"pipeline stages (pp=N)"`` when the running strategy split the model into pipeline stages (this
    rank's module holds only its stage, so a trace of it is not the model the estimate is for), else
    ``None``."""
    plan = getattr(getattr(trainer, "strategy", None), "applied_plan", None)
    if isinstance(plan, ParallelPlan) and plan.pp > 1:
        return f"pipeline stages (pp={plan.pp})"
    return None
