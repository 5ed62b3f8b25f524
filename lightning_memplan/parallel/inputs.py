"""What memplan_auto reads from the Trainer before it plans: the model's shape, one batch, the precision.

Planning happens after the DataModule's and LightningModule's ``setup`` hooks and before
``configure_model`` (the mesh must exist by then), which is before Lightning has built the dataloaders.
The batch shape therefore comes from, in order: the ``train=`` TrainSpec given to the strategy, the
LightningModule's ``example_input_array``, or the first batch of the training dataloader (a DataModule
that builds its datasets in ``setup`` has done so by then), drawn under
``tracking.isolation.preserved_run_state`` so that building the loader here does not shift any random
stream the real fit loop will see.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_memplan.live.layouts import TransformerLayout
from lightning_memplan.model.introspect import norm_impl_of
from lightning_memplan.model.specs import ModelSpec, TrainSpec
from lightning_memplan.tracking.isolation import preserved_run_state

__all__ = [
    "RUN_FIELDS",
    "BatchShapeUnknown",
    "batch_reader",
    "compose_train_spec",
    "lce_loss_mode",
    "model_spec_for",
    "optimizer_of",
    "optimizer_spec",
    "peek_batch",
    "peek_loader",
    "train_spec_for",
]


class BatchShapeUnknown(ValueError):
    """No batch shape could be found before setup; the message names the arguments that supply it."""


def model_spec_for(lightning_module: nn.Module, layout: TransformerLayout | None) -> ModelSpec:
    """The :class:`ModelSpec` of the module: ``ModelSpec.from_module`` (introspection), the module's own
    ``spec()`` (zoo models), a Hugging Face ``config``, or -- for anything else -- an exact parameter count
    on a one-block placeholder shape (activations then come from the batch only)."""
    root = layout.root if layout is not None else lightning_module
    spec_fn = getattr(root, "spec", None)
    if callable(spec_fn):
        spec = spec_fn()
        if isinstance(spec, ModelSpec):
            return spec
    try:
        return ModelSpec.from_module(root)
    except ImportError:
        pass
    except (ValueError, TypeError) as exc:
        warnings.warn(f"ModelSpec.from_module({type(root).__name__}) failed ({exc}); using a parameter count", stacklevel=2)
    config = getattr(root, "config", None)
    if config is not None and hasattr(config, "num_hidden_layers"):
        try:
            return ModelSpec.from_hf_config(config)
        except ImportError:
            pass
    n_params = sum(p.numel() for p in lightning_module.parameters())
    hidden = next((m.in_features for m in root.modules() if isinstance(m, nn.Linear)), 1)
    n_layers = len(layout.block_list) if layout is not None else 1
    return ModelSpec(max(n_layers, 1), hidden, 1, 1, n_params=max(n_params, 1), name=type(root).__name__)


def peek_batch(trainer: Any) -> Any:
    """The first training batch, without disturbing the fit loop's random state; ``None`` if unavailable."""
    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
    if source is None or not source.is_defined():
        return None
    return peek_loader(source.dataloader)


def peek_loader(make_loader: Any) -> Any:
    """The first batch of ``make_loader()`` (a fresh iterator: the loop's own iteration starts from the
    beginning), drawn under :func:`~lightning_memplan.tracking.isolation.preserved_run_state` so a
    shuffling sampler's seed draw does not shift any random stream (CPU, CUDA, Python, NumPy); ``None``
    (with a warning) if it cannot be drawn."""
    with preserved_run_state():
        try:
            return next(iter(make_loader()))
        except Exception as exc:  # noqa: BLE001 - any failure just means "unknown here"
            warnings.warn(f"memplan_auto could not draw a batch before setup to read its shape: {exc}", stacklevel=2)
            return None


#: TrainSpec fields that describe the run itself; each one left at its TrainSpec default in ``train=``
#: is read from the Trainer and the LightningModule instead (the fields the user set win).
RUN_FIELDS = ("precision", "grad_accumulation", "device", "optimizer", "optimizer_impl", "loss", "loss_chunk_size",
              "norm_impl", "base_weights", "quantized_head", "float8", "param_bytes")


def batch_reader(trainer: Any, lightning_module: Any) -> Callable[[], Any]:
    """``() -> batch``: the module's ``example_input_array``, else the first training batch
    (:func:`peek_batch`), read once at the first call and kept (``None`` when neither exists). The batch
    shape and the calibrated check's traced steps (``parallel/calibrated.py``) read the same one."""
    cache: list[Any] = []

    def read() -> Any:
        if not cache:
            sample = getattr(lightning_module, "example_input_array", None)
            cache.append(sample if sample is not None else peek_batch(trainer))
        return cache[0]

    return read


def train_spec_for(
    trainer: Any, lightning_module: Any, base: TrainSpec | None, read_batch: Callable[[], Any] | None = None
) -> TrainSpec:
    """The :class:`TrainSpec` to plan with.

    The run's own settings come from the Trainer: precision (``trainer.precision``), accumulation
    (``accumulate_grad_batches``), the device kind, the optimizer of ``configure_optimizers``
    (:func:`optimizer_of`; AdamW when it cannot be read before setup), the loss mode
    (``LinearCrossEntropy`` found or not) and quantized base weights / float8 linears from the precision
    plugin and the module (:func:`~lightning_memplan.live.low_precision.low_precision_fields`, what the
    callback reads too). ``base`` (the strategy's ``train=``) overrides: its batch
    shape always, and every :data:`RUN_FIELDS` field whose value differs from the TrainSpec default
    (a field left at its default is read from the run); a precision that contradicts the Trainer's is
    warned about. Without ``base`` the shape is read from ``example_input_array`` or the first batch
    (which, after the DataModule's ``setup``, is readable for an ordinary DataModule too), through
    ``read_batch`` when given (:func:`batch_reader`).

    Raises:
        BatchShapeUnknown: neither ``base``, ``example_input_array`` nor a batch gives the shape.
    """
    read = read_batch if read_batch is not None else batch_reader(trainer, lightning_module)
    shape = (base.micro_batch, base.seq_len) if base is not None else _batch_shape_of(read())
    from lightning_memplan.live import kernel_device
    from lightning_memplan.live.low_precision import low_precision_fields

    device = kernel_device(trainer)
    optimizer, impl = optimizer_of(lightning_module, device)
    precision = str(trainer.precision)
    return compose_train_spec(
        shape=shape,
        module=lightning_module,
        precision=precision,
        grad_accumulation=int(trainer.accumulate_grad_batches),
        device=device,
        optimizer=(optimizer, impl),
        base=base,
        runner="the Trainer",
        low=low_precision_fields(getattr(trainer, "precision_plugin", None), lightning_module, precision),
    )


def compose_train_spec(
    *,
    shape: tuple[int, int],
    module: Any,
    precision: str,
    grad_accumulation: int,
    device: str,
    optimizer: tuple[str, str],
    base: TrainSpec | None,
    runner: str,
    low: Mapping[str, Any] | None = None,
) -> TrainSpec:
    """The TrainSpec of a run from what its front door read (shared by the Trainer and Fabric).

    ``shape``: ``(micro_batch, seq_len)``; ``optimizer``: ``(optimizer, optimizer_impl)``; ``low``: the
    quantized-weight / float8 fields of the run (``low_precision_fields``: ``base_weights``,
    ``quantized_head``, ``float8``, ``param_bytes`` and the precision a quantization plugin implies); the loss mode
    (:func:`lce_loss_mode`) and the RMSNorm implementation
    (:func:`~lightning_memplan.model.introspect.norm_impl_of`) come from ``module``. ``base`` (the strategy's ``train=``) overrides every
    :data:`RUN_FIELDS` field it sets to a non-default value; a precision that contradicts the run's is
    warned about (``runner`` names the run, e.g. ``"the Trainer"``, ``"Fabric"``).
    """
    b, s = shape
    loss, chunk = lce_loss_mode(module)
    low = dict(low or {})
    precision = low.pop("precision", precision)
    run = TrainSpec(
        micro_batch=b,
        seq_len=s,
        precision=precision,
        grad_accumulation=grad_accumulation,
        device=device,
        optimizer=optimizer[0],
        optimizer_impl=optimizer[1],
        loss=loss,
        loss_chunk_size=chunk,
        norm_impl=norm_impl_of(module),
        **low,
    )
    if base is None:
        return run
    defaults = TrainSpec(micro_batch=1, seq_len=1)
    taken = {name: getattr(run, name) for name in RUN_FIELDS if getattr(base, name) == getattr(defaults, name)}
    if "precision" not in taken and base.precision != run.precision:
        warnings.warn(
            f"memplan_auto: train=TrainSpec(precision={base.precision!r}) plans for another precision than "
            f"{runner} runs ({run.precision!r}); the estimate describes {base.precision!r}. Leave "
            f"TrainSpec.precision at its default to take {runner}'s",
            stacklevel=3,
        )
    return base.replace(**taken)


def _batch_shape_of(sample: Any) -> tuple[int, int]:
    from lightning_memplan.live import InferenceError, batch_shape

    if sample is None:
        raise BatchShapeUnknown(
            "memplan_auto needs the batch shape to plan, and found neither LightningModule.example_input_array "
            "nor a training dataloader it could read after the DataModule's setup; pass "
            "MemplanAutoStrategy(train=TrainSpec(micro_batch=..., seq_len=...)) or "
            "MemplanAutoStrategy(plan=ParallelPlan(...))"
        )
    try:
        return batch_shape(sample)
    except InferenceError as exc:
        raise BatchShapeUnknown(
            f"{exc}; for memplan_auto pass MemplanAutoStrategy(train=TrainSpec(micro_batch=..., seq_len=...))"
        ) from exc


def optimizer_of(lightning_module: Any, device: str) -> tuple[str, str]:
    """``(optimizer, optimizer_impl)`` of the module's ``configure_optimizers``, read before setup.

    Lightning builds the real optimizers after the layout is applied (they must hold the sharded
    parameters), so this calls ``configure_optimizers`` once on the unwrapped module and discards the
    result (creating a ``torch.optim`` optimizer allocates no state). It is not called when the hook
    reads ``trainer.estimated_stepping_batches``, which would load the training dataloader (and enter
    a barrier) from rank 0 alone; then, or when the hook fails or returns an optimizer the memory
    model does not know, AdamW (the heaviest common state) is assumed and ``setup`` warns if the real
    optimizer differs. The implementation follows ``torch.optim``'s default for the run's device
    (foreach on CUDA, the for-loop on CPU) unless the optimizer was built with ``fused``/``foreach``.
    """
    fallback = ("adamw", "for_loop" if device == "cpu" else "foreach")
    hook = getattr(type(lightning_module), "configure_optimizers", None)
    code = getattr(hook, "__code__", None)
    if code is None or "estimated_stepping_batches" in code.co_names:
        return fallback
    try:
        with preserved_run_state(lightning_module), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            conf = lightning_module.configure_optimizers()
            optimizer = _first_optimizer(conf)
            if optimizer is None:
                return fallback
            return optimizer_spec(optimizer, device)
    except Exception:  # noqa: BLE001 - the user's hook (or an InferenceError): "unknown here"
        return fallback


def optimizer_spec(optimizer: Any, device: str) -> tuple[str, str]:
    """``(optimizer, optimizer_impl)`` of a built ``torch.optim`` optimizer: its kind, and its
    implementation as ``torch.optim`` picks it for ``device`` (foreach on CUDA, the for-loop on CPU)
    unless it was built with ``fused``/``foreach``.

    Raises:
        InferenceError: an optimizer the memory model does not know.
    """
    from lightning_memplan.live import infer_optimizer

    kind, impl = infer_optimizer(optimizer)
    defaults = getattr(optimizer, "defaults", {}) or {}
    explicit = bool(defaults.get("fused")) or defaults.get("foreach") is not None
    return kind, impl if explicit else ("for_loop" if device == "cpu" else "foreach")


def _first_optimizer(conf: Any) -> Any:
    """The first ``torch.optim.Optimizer`` in any of the return forms ``configure_optimizers`` allows."""
    if isinstance(conf, torch.optim.Optimizer):
        return conf
    if isinstance(conf, dict):
        return _first_optimizer(conf.get("optimizer"))
    if isinstance(conf, (list, tuple)):
        for item in conf:
            found = _first_optimizer(item)
            if found is not None:
                return found
    return None


def lce_loss_mode(module: Any) -> tuple[str, int | None]:
    """The memory model's loss mode for ``module``: ``"chunked"`` (with its chunk size, ``None`` for
    "auto") when it computes its loss with ``LinearCrossEntropy``, which memplan_auto runs chunked or
    vocab-parallel (the latter decided by the plan's tp); ``"naive"`` otherwise (logits in full)."""
    from lightning_memplan.parallel.tensor_parallel import find_linear_cross_entropy

    losses = find_linear_cross_entropy(module)
    if not losses:
        return "naive", None
    chunk = getattr(losses[0], "chunk_size", None)
    return "chunked", chunk if isinstance(chunk, int) and not isinstance(chunk, bool) else None
