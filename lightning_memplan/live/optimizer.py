"""The optimizer of a running fit: its :class:`~lightning_memplan.model.specs.TrainSpec` strings, a
factory that rebuilds it for a trace, and the ``torch.optim.Optimizer`` inside Lightning's wrapper."""

from __future__ import annotations

from typing import Any

import torch

from lightning_memplan.live.batch import InferenceError

__all__ = ["infer_optimizer", "optimizer_factory", "unwrap_optimizer"]


def infer_optimizer(optimizer: Any) -> tuple[str, str]:
    """``(optimizer, optimizer_impl)`` TrainSpec strings for a ``torch.optim.Optimizer`` (possibly
    wrapped by Lightning's ``LightningOptimizer``).

    Raises:
        InferenceError: an optimizer class the memory model does not know.
    """
    opt = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer wraps the real one
    name = type(opt).__name__.lower()
    defaults = getattr(opt, "defaults", {}) or {}
    low_bit = _low_bit_kind(name, defaults)
    if low_bit is not None:
        kind = low_bit
    elif name in ("adamw", "adam", "lion", "adafactor"):
        kind = name
    elif name == "sgd":
        kind = "sgd_momentum" if float(defaults.get("momentum", 0.0) or 0.0) > 0.0 else "sgd"
    else:
        raise InferenceError(
            f"optimizer {type(opt).__name__!r} has no entry in the memory model (known: Adam, AdamW, SGD, "
            "Lion, Adafactor, bitsandbytes' and torchao's 8-bit, 4-bit, float8, bf16 and paged Adam); pass MemoryPlanCallback(train_spec=TrainSpec(..., "
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

def _low_bit_kind(name: str, defaults: dict[str, Any]) -> str | None:
    """The TrainSpec optimizer of bitsandbytes' and torchao's Adam variants by lower-cased class name
    (``lightning_memplan.model.quantized``): bitsandbytes ``PagedAdamW8bit`` / ``PagedAdamW(32bit)``
    (paged), ``AdamW8bit`` / ``Adam8bit``; torchao ``AdamW4bit``, ``AdamWFp8``, ``AdamW8bit`` and ``_AdamW``
    (bf16 states with ``bf16_stochastic_round``); ``None`` for anything else."""
    if "adam" not in name:
        return None
    if name.startswith("paged"):
        return "paged_adamw8bit" if "8bit" in name else "paged_adamw"
    for marker, kind in (("8bit", "adamw8bit"), ("4bit", "adamw4bit"), ("fp8", "adamw_fp8")):
        if marker in name:
            return kind
    if name == "_adamw":
        return "adamw_bf16" if defaults.get("bf16_stochastic_round") else "adamw"
    return None


def optimizer_factory(opt: torch.optim.Optimizer, *, module_params: list[Any] | None = None) -> Any:
    """``params -> Optimizer`` rebuilding ``opt``'s class with its defaults (only the keywords its
    constructor accepts: ``defaults`` also holds derived entries such as ``decoupled_weight_decay``).

    With ``module_params`` (the trained module's ``list(module.parameters())``), the factory rebuilds
    ``opt``'s own parameter groups on a copy of that module: given the copy's parameters (the same order,
    as ``copy.deepcopy`` and a fake copy keep it), each group takes the copy's parameters at the positions
    ``opt``'s hold in ``module_params``, with the group's options; so an optimizer of the discriminator only
    (one of a GAN's two) steps only the copy's discriminator. ``None`` is returned instead of a factory when
    ``opt`` holds a parameter that is not in ``module_params``."""
    import inspect

    cls = type(opt)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in opt.defaults.items() if k in accepted and k != "params"}
    if module_params is None:
        return lambda params: cls(params, **kwargs)
    index = {id(p): i for i, p in enumerate(module_params)}
    groups: list[tuple[list[int], dict[str, Any]]] = []
    for group in opt.param_groups:
        positions = [index.get(id(p)) for p in group["params"]]
        if any(i is None for i in positions):
            return None
        groups.append(([int(i) for i in positions if i is not None],
                       {k: v for k, v in group.items() if k != "params"}))
    n_params = len(module_params)

    def build(params: Any) -> torch.optim.Optimizer:
        copy = list(params)
        if len(copy) != n_params:
            raise ValueError(f"the traced copy has {len(copy)} parameters, the trained module {n_params}: the "
                             "optimizer's parameter groups cannot be rebuilt on it")
        return cls([{**options, "params": [copy[i] for i in positions]} for positions, options in groups], **kwargs)

    return build


def unwrap_optimizer(optimizer: Any) -> Any:
    """The ``torch.optim.Optimizer`` inside a ``LightningOptimizer``."""
    return getattr(optimizer, "optimizer", optimizer)
