"""The specs of a running fit: the :class:`~lightning_memplan.model.specs.TrainSpec` (precision plugin,
gradient accumulation, optimizer, what memplan_auto or the user applied) and the
:class:`~lightning_memplan.model.specs.ModelSpec` of the whole model a strategy trains."""

from __future__ import annotations

from typing import Any

import torch

from lightning_memplan.live.batch import InferenceError, batch_shape
from lightning_memplan.live.low_precision import infer_low_precision
from lightning_memplan.live.optimizer import infer_optimizer
from lightning_memplan.live.strategy import (
    deepspeed_settings,
    fsdp1_param_counts,
    has_fsdp1,
    is_deepspeed,
    is_fsdp1,
    kernel_device,
)
from lightning_memplan.model.specs import LOSS_MODES, RECOMPUTE_MODES, ModelSpec, TrainSpec

__all__ = ["infer_model_spec", "infer_train_spec"]


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
    # low precision: quantized base weights / float8 linears from the plugin and the module (live/low_precision.py)
    low = infer_low_precision(trainer)
    spec = TrainSpec(
        micro_batch=b,
        seq_len=s,
        precision=low.pop("precision", str(trainer.precision)),
        optimizer=optimizer,
        optimizer_impl=impl,
        grad_accumulation=int(trainer.accumulate_grad_batches),
        device=kernel_device(trainer),
        **low,
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
    attention = _attention_kernel(getattr(trainer, "lightning_module", None), spec.device, spec.precision)
    if attention is not None:
        changes["attention"] = attention
    # the RMSNorm implementation (Hugging Face's and torchtune's save fp32 copies a fused kernel does not)
    from lightning_memplan.model.introspect import norm_impl_of

    norm_impl = norm_impl_of(getattr(trainer, "lightning_module", None))
    if norm_impl != "native":
        changes["norm_impl"] = norm_impl
    return spec.replace(**changes) if changes else spec

def _attention_kernel(module: Any, device: str, precision: str) -> str | None:
    """``"eager"`` when a Hugging Face model inside ``module`` keeps the ``[b, a, s, s]`` attention
    probabilities: it runs eager attention, or SDPA down PyTorch's math path, which saves what eager
    attention saves (the softmax output, dropout's mask and the dropped probabilities) -- on the CPU for
    any attention dropout or unequal head sizes (:func:`~lightning_memplan.tracking.hf_calibrate.
    sdpa_keeps_scores`, PyTorch's kernel selection); ``None`` (the spec's ``"sdpa"``) otherwise."""
    if not isinstance(module, torch.nn.Module):
        return None
    for sub in module.modules():
        config: Any = getattr(sub, "config", None)
        implementation = getattr(config, "_attn_implementation", None)
        if not isinstance(implementation, str) or not callable(getattr(config, "to_dict", None)):
            continue
        if implementation == "eager":
            return "eager"
        if implementation == "sdpa":
            from lightning_memplan.tracking.hf_calibrate import sdpa_keeps_scores

            return "eager" if sdpa_keeps_scores(config.to_dict(), device=device, precision=precision) else None
        return None
    return None


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

        from lightning_memplan.live.layouts import find_layout

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
