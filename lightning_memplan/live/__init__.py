"""Reading a live run: what a running Trainer or Fabric loop, its module, optimizer, strategy and batch
say about memory, as the specs the estimate takes.

- :mod:`~lightning_memplan.live.batch`: the batch shape ``(b, s)``, batches of other shapes with the same
  structure, the pipeline micro-batch and the calibration shapes (:class:`InferenceError` for a gap).
- :mod:`~lightning_memplan.live.optimizer`: the optimizer's TrainSpec strings, a factory that rebuilds it.
- :mod:`~lightning_memplan.live.strategy`: the running strategy's :class:`ParallelPlan`, DeepSpeed's and
  FSDP1's settings, DDP's gradient buckets, what parallelises a module in place.
- :mod:`~lightning_memplan.live.specs`: the running fit's :class:`TrainSpec` and :class:`ModelSpec`.
- :mod:`~lightning_memplan.live.layouts`: where a transformer module keeps its embedding, blocks, norm
  and head (:func:`find_layout`), read by the tensor-parallel and pipeline code above.

It sits below ``monitoring`` (the callback's and the Fabric monitor's core) and ``parallel`` (planning and
applying memplan_auto), which both read a live run through it, and above ``tracking`` and ``model``.
"""

from lightning_memplan.live.batch import (
    BatchFactory,
    InferenceError,
    batch_factory,
    batch_shape,
    calibration_shapes,
    stage_micro_batch,
)
from lightning_memplan.live.layouts import TransformerLayout, find_layout, get_submodule_or_none
from lightning_memplan.live.optimizer import infer_optimizer, optimizer_factory, unwrap_optimizer
from lightning_memplan.live.specs import infer_model_spec, infer_train_spec
from lightning_memplan.live.strategy import (
    ddp_bucket_bytes,
    deepspeed_settings,
    fsdp1_notes,
    fsdp1_param_counts,
    fsdp1_units,
    has_fsdp1,
    has_fsdp2,
    infer_plan,
    is_deepspeed,
    is_fsdp1,
    kernel_device,
    parallelised_by,
    pipeline_split,
)

__all__ = [
    "BatchFactory",
    "InferenceError",
    "TransformerLayout",
    "batch_factory",
    "batch_shape",
    "calibration_shapes",
    "ddp_bucket_bytes",
    "deepspeed_settings",
    "find_layout",
    "fsdp1_notes",
    "fsdp1_param_counts",
    "fsdp1_units",
    "get_submodule_or_none",
    "has_fsdp1",
    "has_fsdp2",
    "infer_model_spec",
    "infer_optimizer",
    "infer_plan",
    "infer_train_spec",
    "is_deepspeed",
    "is_fsdp1",
    "kernel_device",
    "optimizer_factory",
    "parallelised_by",
    "pipeline_split",
    "stage_micro_batch",
    "unwrap_optimizer",
]
