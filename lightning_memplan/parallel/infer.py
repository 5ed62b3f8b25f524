"""What :class:`~lightning_memplan.callbacks.MemoryPlanCallback` infers from the running Trainer: the
batch shape of each step, the :class:`TrainSpec` (precision plugin, gradient accumulation, optimizer)
and the :class:`ParallelPlan` (the running strategy).

Each function either returns its answer or raises :class:`InferenceError` whose message says exactly
what could not be inferred and which callback argument supplies it, so the callback can keep
measuring and report the gap instead of failing the run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lightning_memplan.model.frameworks import zero_settings_from_deepspeed_config
from lightning_memplan.model.specs import LOSS_MODES, RECOMPUTE_MODES, ModelSpec, ParallelPlan, TrainSpec

__all__ = [
    "InferenceError",
    "batch_factory",
    "batch_shape",
    "ddp_bucket_bytes",
    "infer_optimizer",
    "infer_model_spec",
    "infer_plan",
    "infer_train_spec",
    "is_deepspeed",
    "deepspeed_settings",
    "pipeline_split",
    "stage_micro_batch",
    "has_fsdp1",
    "has_fsdp2",
    "fsdp1_notes",
    "fsdp1_param_counts",
    "fsdp1_units",
    "is_fsdp1",
    "parallelised_by",
]

#: Mapping keys that hold the token ids of a language-model batch, in order of preference (Hugging Face
#: ``BatchEncoding`` uses ``input_ids``; nanoGPT/litgpt-style dicts use ``idx`` / ``tokens`` / ``x``).
TOKEN_KEYS = ("input_ids", "tokens", "idx", "input", "inputs", "x", "data")
#: How deep to look into nested containers before giving up.
_MAX_DEPTH = 6


class InferenceError(ValueError):
    """Something the callback could not infer; the message names the argument that supplies it."""


def _first_tensor(obj: Any, depth: int = 0) -> torch.Tensor | None:
    """The tensor that carries the batch shape: a token-id key of a mapping first, else the first tensor
    found depth-first in tuples, lists, mappings and dataclass-like objects."""
    if isinstance(obj, torch.Tensor):
        return obj
    if depth >= _MAX_DEPTH:
        return None
    if isinstance(obj, Mapping):  # dict, OrderedDict, Hugging Face BatchEncoding (a UserDict)
        for key in TOKEN_KEYS:
            if key in obj and isinstance(obj[key], torch.Tensor):
                return obj[key]
        values: Sequence[Any] = list(obj.values())
    elif isinstance(obj, (tuple, list)):
        values = obj
    elif hasattr(obj, "__dataclass_fields__"):
        values = [getattr(obj, name) for name in obj.__dataclass_fields__]
    else:
        return None
    for value in values:
        found = _first_tensor(value, depth + 1)
        if found is not None:
            return found
    return None


def batch_shape(batch: Any, *, seq_len: int | None = None) -> tuple[int, int]:
    """``(micro_batch, seq_len)`` of one step's batch.

    The batch tensor is the token ids of a mapping (``input_ids``, ``tokens``, ``idx``, ...) or the first
    tensor found in nested tuples/lists/dicts/dataclasses. Its first dimension is b. Its second is s
    when the tensor holds integer token ids ``[b, s]`` or embeddings ``[b, s, h]``; a floating-point
    ``[b, features]`` tensor (an MLP's input) counts as one position per sample, s = 1. Anything else
    (images ``[b, c, H, W]``) needs ``seq_len=``: the sequence length the memory model should use.

    Raises:
        InferenceError: no tensor in the batch, a 0-d tensor, or an ambiguous layout without ``seq_len``.
    """
    tensor = _first_tensor(batch)
    if tensor is None:
        raise InferenceError(
            f"could not find a tensor in the batch (type {type(batch).__name__}) to read its shape; pass "
            "MemoryPlanCallback(train_spec=TrainSpec(micro_batch=..., seq_len=...)) to give the shape"
        )
    if tensor.ndim == 0:
        raise InferenceError(
            "the batch tensor is a scalar, so it has no batch dimension; pass "
            "MemoryPlanCallback(train_spec=TrainSpec(micro_batch=..., seq_len=...))"
        )
    b = int(tensor.shape[0])
    if seq_len is not None:
        return b, int(seq_len)
    if tensor.ndim == 1:
        return b, 1
    if not tensor.is_floating_point() and tensor.ndim == 2:
        return b, int(tensor.shape[1])
    if tensor.is_floating_point() and tensor.ndim == 2:
        return b, 1
    if tensor.is_floating_point() and tensor.ndim == 3:
        return b, int(tensor.shape[1])
    raise InferenceError(
        f"the batch tensor has shape {tuple(tensor.shape)} and dtype {tensor.dtype}, which has no single "
        "sequence dimension; pass MemoryPlanCallback(seq_len=...) with the length the memory model should use"
    )


def batch_factory(batch: Any, micro_batch: int, seq_len: int) -> Callable[[int, int], Any]:
    """``(b, s) -> batch``: new batches with ``batch``'s structure and dtypes, resized from
    ``(micro_batch, seq_len)`` to ``(b, s)``, for tracing other shapes of the same step.

    Every tensor whose first dimension is ``micro_batch`` gets b there, and (when ``seq_len > 1``) every
    later dimension equal to ``seq_len`` gets s (token ids, labels, ``[b, 1, s, s]`` masks). Values are
    drawn with factory functions (``randint`` within the real tensor's value range, ``randn`` for floats)
    so that the batch is made of fake tensors when built inside ``FakeTensorMode``. Containers keep their
    type: tuples, lists, named tuples, dicts, ``BatchEncoding``-like mappings and dataclasses.
    """

    def template(t: torch.Tensor) -> tuple[Any, ...]:
        lo = hi = 0
        if t.numel() and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            lo, hi = int(t.min()), int(t.max())
        resized = [False] * t.ndim
        if t.ndim and t.shape[0] == micro_batch:
            resized[0] = True
            if seq_len > 1:
                for d in range(1, t.ndim):
                    resized[d] = t.shape[d] == seq_len
        return (tuple(t.shape), t.dtype, lo, hi, tuple(resized))

    def build(obj: Any, tmpl: Any, b: int, s: int) -> Any:
        if isinstance(obj, torch.Tensor):
            shape0, dtype, lo, hi, resized = tmpl
            shape = [
                (b if d == 0 else s) if r else n for d, (n, r) in enumerate(zip(shape0, resized, strict=True))
            ]
            if dtype == torch.bool:
                return torch.zeros(shape, dtype=dtype)
            if dtype.is_floating_point or dtype.is_complex:
                return torch.randn(shape, dtype=dtype)
            return torch.randint(lo, hi + 1, shape, dtype=dtype)
        if isinstance(obj, Mapping):
            data = {k: build(v, tmpl[k], b, s) for k, v in obj.items()}
            cls: Any = type(obj)
            try:
                return cls(data)
            except TypeError:
                return data
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(build(v, t, b, s) for v, t in zip(obj, tmpl, strict=True)))
        if isinstance(obj, (tuple, list)):
            return type(obj)(build(v, t, b, s) for v, t in zip(obj, tmpl, strict=True))
        if hasattr(obj, "__dataclass_fields__"):
            import dataclasses

            return dataclasses.replace(obj, **{k: build(getattr(obj, k), tmpl[k], b, s) for k in tmpl})
        return obj

    def make_template(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return template(obj)
        if isinstance(obj, Mapping):
            return {k: make_template(v) for k, v in obj.items()}
        if isinstance(obj, (tuple, list)):
            return [make_template(v) for v in obj]
        if hasattr(obj, "__dataclass_fields__"):
            return {k: make_template(getattr(obj, k)) for k in obj.__dataclass_fields__}
        return None

    tmpl = make_template(batch)
    return lambda b, s: build(batch, tmpl, b, s)


def infer_optimizer(optimizer: Any) -> tuple[str, str]:
    """``(optimizer, optimizer_impl)`` TrainSpec strings for a ``torch.optim.Optimizer`` (possibly
    wrapped by Lightning's ``LightningOptimizer``).

    Raises:
        InferenceError: an optimizer class the memory model does not know.
    """
    opt = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer wraps the real one
    name = type(opt).__name__.lower()
    defaults = getattr(opt, "defaults", {}) or {}
    if "8bit" in name and "adam" in name:
        kind = "adamw8bit"
    elif name in ("adamw", "adam", "lion", "adafactor"):
        kind = name
    elif name == "sgd":
        kind = "sgd_momentum" if float(defaults.get("momentum", 0.0) or 0.0) > 0.0 else "sgd"
    else:
        raise InferenceError(
            f"optimizer {type(opt).__name__!r} has no entry in the memory model (known: Adam, AdamW, SGD, "
            "Lion, Adafactor, 8-bit Adam); pass MemoryPlanCallback(train_spec=TrainSpec(..., "
            "optimizer_bytes_per_param=...)) with its state bytes per parameter"
        )
    if defaults.get("fused"):
        impl = "fused"
    elif defaults.get("foreach") is False:
        impl = "for_loop"
    elif defaults.get("foreach"):
        impl = "foreach"
    else:
        # torch.optim's default (_default_to_fused_or_foreach): foreach only when every parameter is a
        # CUDA tensor, the single-tensor loop otherwise.
        params = [p for g in opt.param_groups for p in g["params"]]
        impl = "foreach" if params and all(p.is_cuda for p in params) else "for_loop"
    return kind, impl


def kernel_device(trainer: Any) -> str:
    """``TrainSpec.device`` for the running fit: ``"cpu"`` on the CPU, else ``"cuda"`` (the CUDA
    kernels' saving behaviour is the model's default for accelerators)."""
    root = getattr(getattr(trainer, "strategy", None), "root_device", None)
    return "cpu" if getattr(root, "type", "cuda") == "cpu" else "cuda"


def infer_train_spec(
    trainer: Any, batch: Any, *, seq_len: int | None = None, base: TrainSpec | None = None
) -> TrainSpec:
    """The TrainSpec of the running fit: Lightning's precision string, ``accumulate_grad_batches``, the
    first optimizer of ``configure_optimizers``, and ``batch``'s shape.

    ``base`` (an explicit ``train_spec=``) wins for every field except the batch shape, which is this
    batch's own whenever it can be read.
    """
    try:
        b, s = batch_shape(batch, seq_len=seq_len)
    except InferenceError:
        if base is None:
            raise
        b, s = base.micro_batch, seq_len or base.seq_len
    if base is not None:
        return base.replace(micro_batch=b, seq_len=s)
    if not trainer.optimizers:
        raise InferenceError(
            "the LightningModule configured no optimizer, so its state bytes are unknown; pass "
            "MemoryPlanCallback(train_spec=TrainSpec(..., optimizer='sgd'))"
        )
    optimizer, impl = infer_optimizer(trainer.optimizers[0])
    spec = TrainSpec(
        micro_batch=b,
        seq_len=s,
        precision=str(trainer.precision),
        optimizer=optimizer,
        optimizer_impl=impl,
        grad_accumulation=int(trainer.accumulate_grad_batches),
        device=kernel_device(trainer),
    )
    # strategy="memplan_auto" applies activation checkpointing and picks the loss mode itself; its
    # resolution says which, so the estimate assumes what really runs.
    resolution = getattr(trainer.strategy, "resolution", None)
    changes = {}
    for name, allowed in (("recompute", RECOMPUTE_MODES), ("loss", LOSS_MODES)):
        value = getattr(resolution, name, None)
        if value in allowed:
            changes[name] = value
    # FSDP2's offloads memplan_auto applied (CPUOffloadPolicy, save_on_cpu): host bytes, not device bytes
    if getattr(resolution, "offload", "none") == "params":
        changes["offload"] = "params"
    if getattr(resolution, "offload_activations", False) is True:
        changes["offload_activations"] = True
    if is_fsdp1(trainer.strategy):  # FSDP1's flat parameters (lightning_memplan.model.frameworks)
        changes["framework"] = "fsdp1"
    if is_deepspeed(trainer.strategy):  # DeepSpeed's engine: its ZeRO layout, offload and bucket sizes
        _, offload, zero_config = deepspeed_settings(trainer.strategy)
        changes.update(framework="deepspeed", offload=offload, zero_config=zero_config)
    if changes.get("loss", "naive") == "naive":
        # A Fabric loop's loss is a callable beside the module (MemoryMonitor(loss_fn=...)); a
        # LinearCrossEntropy it uses never materialises the logits, whatever the strategy assumed.
        mode = _loss_mode_of_callable(getattr(trainer, "loss_fn", None))
        if mode is not None:
            changes["loss"] = mode
    if "recompute" not in changes:
        # checkpointing the user applied (HF gradient_checkpointing_enable, checkpoint_wrapper, composable)
        from lightning_memplan.model.introspect import recompute_of

        detected = recompute_of(getattr(trainer, "lightning_module", None))
        if detected != "none":
            changes["recompute"] = detected
    # the RMSNorm implementation (Hugging Face's and torchtune's save fp32 copies a fused kernel does not)
    from lightning_memplan.model.introspect import norm_impl_of

    norm_impl = norm_impl_of(getattr(trainer, "lightning_module", None))
    if norm_impl != "native":
        changes["norm_impl"] = norm_impl
    return spec.replace(**changes) if changes else spec


def _loss_mode_of_callable(loss_fn: Any) -> str | None:
    """``"chunked"`` when ``loss_fn`` reaches a ``LinearCrossEntropy`` (a global it names or a variable
    it closes over, see ``tracking.compiled.referenced_objects``), else ``None`` (nothing known)."""
    if loss_fn is None:
        return None
    from lightning_memplan.loss.module import LinearCrossEntropy
    from lightning_memplan.tracking.compiled import referenced_objects

    if any(isinstance(obj, LinearCrossEntropy) for _, obj in referenced_objects(loss_fn)):
        return "chunked"
    return None


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


def infer_model_spec(trainer: Any, pl_module: Any) -> ModelSpec:
    """The :class:`ModelSpec` of the whole model the running strategy trains.

    Under memplan_auto, the spec it planned with (``strategy.decision.model``), read from the whole
    model before the pipeline split and the TP/FSDP sharding: the local module of a pipeline rank holds
    only its stage, and tensor parallelism patches per-rank head counts into the attention modules, so
    neither describes the model the per-rank estimate is for. Otherwise the LightningModule itself
    (:meth:`ModelSpec.from_module`; DTensor parameters report their global shapes).

    Raises:
        ValueError / TypeError: from :meth:`ModelSpec.from_module` when the module is not understood.
    """
    strategy = getattr(trainer, "strategy", None)
    planned = getattr(getattr(strategy, "decision", None), "model", None)
    if isinstance(planned, ModelSpec):
        return planned
    with _global_head_counts(pl_module):
        spec = ModelSpec.from_module(pl_module)
    counts = fsdp1_param_counts(getattr(strategy, "model", None)) if has_fsdp1(pl_module) else None
    if counts is not None:
        # FSDP1 leaves each rank views of its flat shard only: the counts come from the FlatParameters
        import dataclasses

        total, trainable = counts
        spec = dataclasses.replace(spec, n_params=total, n_trainable_params=trainable if trainable < total else None)
    return spec


class _global_head_counts:
    """Within the block: the attention head counts of a tensor-parallel zoo GPT (Lightning's
    ``ModelParallelStrategy`` with a ``configure_model`` that shards it) as whole-model counts.

    Its attention reshapes the rank's local q/k/v with ``view(b, s, self.n_heads, d)``, so under TP
    ``n_heads``/``kv_heads`` hold per-rank counts, while the DTensor weights report their global shapes;
    the spec is read from the global view, the counts multiplied by the q projection's global/local
    rows (its tp degree) and restored afterwards.
    """

    def __init__(self, module: Any) -> None:
        self.changes: list[tuple[Any, str, int]] = []
        from torch.distributed.tensor import DTensor

        from lightning_memplan.parallel.layouts import find_layout

        layout = find_layout(module) if isinstance(module, torch.nn.Module) else None
        if layout is None or not layout.head_count_attrs or layout.attn is None:
            return
        q_path = next((p for p in layout.colwise if p.endswith("q_proj")), None)
        for block in layout.block_list:
            attn = block.get_submodule(layout.attn)
            weight = getattr(block.get_submodule(q_path), "weight", None) if q_path else None
            if not isinstance(weight, DTensor) or weight.to_local().shape[0] == 0:
                continue
            factor = weight.shape[0] // weight.to_local().shape[0]
            if factor > 1:
                self.changes += [(attn, n, int(getattr(attn, n))) for n in layout.head_count_attrs if hasattr(attn, n)]
        self.factor = factor if self.changes else 1

    def __enter__(self) -> None:
        for attn, name, value in self.changes:
            setattr(attn, name, value * self.factor)

    def __exit__(self, *exc: Any) -> None:
        for attn, name, value in self.changes:
            setattr(attn, name, value)


def pipeline_split(trainer: Any) -> str | None:
    """``"pipeline stages (pp=N)"`` when the running strategy split the model into pipeline stages (this
    rank's module holds only its stage, so a trace of it is not the model the estimate is for), else
    ``None``."""
    plan = getattr(getattr(trainer, "strategy", None), "applied_plan", None)
    if isinstance(plan, ParallelPlan) and plan.pp > 1:
        return f"pipeline stages (pp={plan.pp})"
    return None


def stage_micro_batch(plan: ParallelPlan, batch: int) -> int:
    """The micro-batch one pipeline step runs: a dataloader batch of ``batch`` sequences is split into
    ``plan.microbatches`` micro-batches when ``pp > 1`` (``torch.distributed.pipelining`` schedules
    chunk the batch dimension), so the estimate is for ``batch // microbatches``; ``batch`` otherwise."""
    if plan.pp > 1 and plan.microbatches > 1:
        return max(1, batch // plan.microbatches)
    return batch


def _calibration_shapes(b: int, s: int, head_dim: int | None) -> list[tuple[int, int]]:
    """Batch shapes to trace for the calibration fit, starting with the real one (exact there).

    ``(b, s)``, ``(b, s')`` with s' = 3s/4 and ``(2b, s)``: never longer than the real sequence (a learned
    position table may end at s), and three shapes so that the b*s and b*s^2 terms separate when attention
    is materialised (for sdpa the linear fit is a least-squares fit through the three, exact when memory is
    linear in tokens). s' avoids the head width, where ``[b, a, s, d]`` tensors would look like ``[.., s, s]``
    attention scores to the tracker. One-position batches (s = 1) vary the batch only.
    """
    if s < 4:
        return [(b, s), (2 * b, s)]
    shorter = (3 * s) // 4
    if shorter == head_dim:
        shorter -= 1
    return [(b, s), (b, shorter), (2 * b, s)]


def _optimizer_factory(opt: torch.optim.Optimizer) -> Any:
    """``params -> Optimizer`` rebuilding ``opt``'s class with its defaults (only the keywords its
    constructor accepts: ``defaults`` also holds derived entries such as ``decoupled_weight_decay``)."""
    import inspect

    cls = type(opt)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in opt.defaults.items() if k in accepted and k != "params"}
    return lambda params: cls(params, **kwargs)


def _unwrap(optimizer: Any) -> Any:
    """The ``torch.optim.Optimizer`` inside a ``LightningOptimizer``."""
    return getattr(optimizer, "optimizer", optimizer)
