"""What memplan_auto reads from the Trainer before it plans: the model's shape, one batch, the precision.

Planning happens in ``setup_environment`` (the mesh must exist before ``configure_model``), which is
before Lightning has built the dataloaders. The batch shape therefore comes from, in order: the
``train=`` TrainSpec given to the strategy, the LightningModule's ``example_input_array``, or the first
batch of the training dataloader, drawn under ``torch.random.fork_rng`` so that building the loader here
does not shift the random stream the real fit loop will see.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from lightning_memplan.model.specs import ModelSpec, TrainSpec
from lightning_memplan.strategies.layouts import TransformerLayout

__all__ = ["BatchShapeUnknown", "lce_loss_mode", "model_spec_for", "peek_batch", "train_spec_for"]


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
    with torch.random.fork_rng(devices=[]):
        try:
            loader = source.dataloader()
            return next(iter(loader))
        except Exception as exc:  # noqa: BLE001 - any failure just means "unknown here"
            warnings.warn(f"memplan_auto could not draw a batch before setup to read its shape: {exc}", stacklevel=2)
            return None


def train_spec_for(trainer: Any, lightning_module: Any, base: TrainSpec | None) -> TrainSpec:
    """The :class:`TrainSpec` to plan with.

    ``base`` wins for every field; its batch shape too. Otherwise the shape is read from
    ``example_input_array`` or the first batch, precision from the trainer, accumulation from
    ``accumulate_grad_batches``; the optimizer is assumed to be AdamW (it is created after planning).

    Raises:
        BatchShapeUnknown: neither ``base``, ``example_input_array`` nor a batch gives the shape.
    """
    if base is not None:
        return base
    from lightning_memplan.callbacks.infer import InferenceError, batch_shape

    sample = getattr(lightning_module, "example_input_array", None)
    if sample is None:
        sample = peek_batch(trainer)
    if sample is None:
        raise BatchShapeUnknown(
            "memplan_auto needs the batch shape before setup to plan, and found neither "
            "LightningModule.example_input_array nor a training dataloader it could read; pass "
            "MemplanAutoStrategy(train=TrainSpec(micro_batch=..., seq_len=...)) or "
            "MemplanAutoStrategy(plan=ParallelPlan(...))"
        )
    try:
        b, s = batch_shape(sample)
    except InferenceError as exc:
        raise BatchShapeUnknown(
            f"{exc}; for memplan_auto pass MemplanAutoStrategy(train=TrainSpec(micro_batch=..., seq_len=...))"
        ) from exc
    from lightning_memplan.callbacks.infer import kernel_device

    device = kernel_device(trainer)
    loss, chunk = lce_loss_mode(lightning_module)
    return TrainSpec(
        micro_batch=b,
        seq_len=s,
        precision=str(trainer.precision),
        grad_accumulation=int(trainer.accumulate_grad_batches),
        device=device,
        # the optimizer is not built yet; torch.optim defaults to foreach only for CUDA tensors
        optimizer_impl="for_loop" if device == "cpu" else "foreach",
        loss=loss,
        loss_chunk_size=chunk,
    )


def lce_loss_mode(module: Any) -> tuple[str, int | None]:
    """The memory model's loss mode for ``module``: ``"chunked"`` (with its chunk size, ``None`` for
    "auto") when it computes its loss with ``LinearCrossEntropy``, which memplan_auto runs chunked or
    vocab-parallel (the latter decided by the plan's tp); ``"naive"`` otherwise (logits in full)."""
    from lightning_memplan.strategies.tensor_parallel import find_linear_cross_entropy

    losses = find_linear_cross_entropy(module)
    if not losses:
        return "naive", None
    chunk = getattr(losses[0], "chunk_size", None)
    return "chunked", chunk if isinstance(chunk, int) and not isinstance(chunk, bool) else None
