"""One training step the way Lightning runs it, without a Trainer, for tracing and measurement.

Precision emulation mirrors ``lightning.pytorch.plugins.precision`` (2.6):

- ``"32-true"`` (``Precision``): nothing changes.
- ``"bf16-mixed"`` / ``"16-mixed"`` (``MixedPrecision``): fp32 parameters; ``training_step`` runs inside
  ``torch.autocast(device, dtype, cache_enabled=False)`` (no weight-cast cache: every use of a weight
  makes its own low-precision copy); ``"16-mixed"`` adds a ``GradScaler`` (loss scaled before backward,
  gradients unscaled in place before the step, step skipped on inf/nan).
- ``"bf16-true"`` / ``"16-true"`` (``HalfPrecision``): ``module.to(dtype)`` (parameters, gradients and
  optimizer states in that dtype), floating inputs converted, default dtype switched during forward.

Order of one step (Lightning's automatic optimisation, ``_AutomaticOptimization`` + ``Closure``):
``training_step`` (forward and loss) -> ``optimizer.zero_grad()`` (``set_to_none=True``) -> backward ->
``optimizer.step()``. So the previous step's gradients are alive during the forward pass.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_memplan.model.specs import canonical_precision

__all__ = ["PrecisionEmulation", "run_training_step"]

_HALF = {"bf16-true": torch.bfloat16, "16-true": torch.float16}
_MIXED = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@dataclass(frozen=True, kw_only=True)
class PrecisionEmulation:
    """What a Lightning precision plugin does to a module, its inputs, forward, backward and step.

    Args:
        precision: a Lightning precision string (aliases ``"32"``, ``"16"``, ``"bf16"`` accepted).
        device_type: ``"cpu"`` or ``"cuda"`` (the autocast device).
        use_scaler: whether ``"16-mixed"`` uses a ``GradScaler`` (Lightning's default: yes).
    """

    precision: str = "32-true"
    device_type: str = "cpu"
    use_scaler: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", canonical_precision(self.precision))

    @property
    def param_dtype(self) -> torch.dtype:
        """dtype of parameters, gradients and optimizer states."""
        return _HALF.get(self.precision, torch.float32)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """``HalfPrecision.convert_module``: ``module.to(dtype)`` for the "-true" half precisions."""
        if self.precision not in _HALF:
            return module
        dtype = _HALF[self.precision]
        try:
            return module.to(dtype=dtype)
        except RuntimeError:
            # Fake parameters carry weak references (the fake-tensor memo), so ``Module._apply`` cannot
            # swap them in place; re-create each floating parameter/buffer instead (same result: tied
            # parameters stay tied through the ``converted`` memo).
            return _convert_floating(module, dtype)

    def make_scaler(self, *, fake: bool = False) -> Any:
        """A ``torch.amp.GradScaler`` for ``"16-mixed"`` (under fake tensors a :class:`_FixedScaler`
        with the same tensors but no host synchronisation), else ``None``."""
        if self.precision != "16-mixed" or not self.use_scaler:
            return None
        return _FixedScaler() if fake else torch.amp.GradScaler(self.device_type)

    def convert_input(self, batch: Any) -> Any:
        """``HalfPrecision.convert_input``: floating tensors to the half dtype (others unchanged)."""
        if self.precision not in _HALF:
            return batch
        dtype = _HALF[self.precision]
        if isinstance(batch, torch.Tensor):
            return batch.to(dtype) if batch.is_floating_point() else batch
        if isinstance(batch, dict):
            return {k: self.convert_input(v) for k, v in batch.items()}
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.convert_input(v) for v in batch)
        return batch

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Autocast (mixed) or the default-dtype switch (half) around ``training_step``."""
        if self.precision in _MIXED:
            with torch.autocast(self.device_type, dtype=_MIXED[self.precision], cache_enabled=False):
                yield
        elif self.precision in _HALF:
            default = torch.get_default_dtype()
            torch.set_default_dtype(_HALF[self.precision])
            try:
                yield
            finally:
                torch.set_default_dtype(default)
        else:
            yield



def _convert_floating(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    converted: dict[int, torch.Tensor] = {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.is_floating_point():
                if id(p) not in converted:
                    converted[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                mod._parameters[name] = converted[id(p)]  # type: ignore[assignment]
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_floating_point():
                mod._buffers[name] = b.to(dtype)
    return module


class _FixedScaler:
    """``GradScaler`` memory behaviour without its ``found_inf.item()`` host sync (impossible on fake
    tensors): scale the loss, unscale the gradients in place with the same fused op, always step."""

    def __init__(self, init_scale: float = 2.0**16) -> None:
        self._scale = torch.full((), init_scale, dtype=torch.float32)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale.to(loss.device)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            found_inf = torch.zeros((), dtype=torch.float32, device=grads[0].device)
            inv_scale = self._scale.double().reciprocal().float().to(grads[0].device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        optimizer.step()

    def update(self) -> None:
        """Nothing to update: the scale stays fixed."""



def _loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, dict):
        output = output.get("loss")
    if not isinstance(output, torch.Tensor) or output.numel() != 1:
        raise TypeError(
            f"the loss function returned {type(output).__name__}; it must return a scalar tensor (or a dict "
            "with key 'loss', like a LightningModule.training_step)"
        )
    return output


def run_training_step(
    module: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], Any],
    optimizer: torch.optim.Optimizer,
    *,
    precision: PrecisionEmulation | None = None,
    scaler: Any = None,
    on_phase: Callable[[str], None] | None = None,
    grads_alive_in_forward: bool = True,
) -> None:
    """Run forward + loss, ``zero_grad``, backward and ``optimizer.step`` in Lightning's order.

    ``on_phase(name)`` is called at the start of ``"forward"``, ``"backward"`` and ``"optimizer"``
    (pass ``tracker.set_phase``). Returns nothing measurable itself (the loss is dropped so that
    its graph is freed before the optimizer step, as in Lightning). ``grads_alive_in_forward=False``
    is a plain loop's order instead: ``zero_grad(set_to_none=True)`` before the forward.
    """
    precision = precision or PrecisionEmulation()
    if not grads_alive_in_forward:
        optimizer.zero_grad(set_to_none=True)
    if on_phase is not None:
        on_phase("forward")
    with precision.forward_context():
        loss = _loss_of(loss_fn(module, batch))
    if grads_alive_in_forward:
        optimizer.zero_grad(set_to_none=True)
    if on_phase is not None:
        on_phase("backward")
    (scaler.scale(loss) if scaler is not None else loss).backward()
    del loss
    if on_phase is not None:
        on_phase("optimizer")
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()

