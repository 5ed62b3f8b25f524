"""Calibrating a LightningModule that optimises manually (``automatic_optimization = False``).

Such a ``training_step`` runs the whole step itself: ``opt = self.optimizers()``,
``self.manual_backward(loss)``, ``opt.step()``, maybe ``self.clip_gradients(...)``,
``self.lr_schedulers()`` and ``self.log(...)``. Each of these asks ``self.trainer``, and the traced copy
(:func:`lightning_memplan.tracking.trace.trace_memory` deep-copies the module without its Trainer) has
none, so the trace failed with "... is not attached to a `Trainer`".

:func:`manual_optimization_trace` gives the trace what a Trainer would: on the private copy only, these
methods are replaced by stand-ins that act on the trace's own optimizer, move the tensor tracker to the
``backward`` and ``optimizer`` phases where Lightning's hooks would (``manual_backward`` fires
``on_before_backward``, ``LightningOptimizer.step`` fires ``on_before_optimizer_step``), and drop what
only a Trainer records (logging). The step's own backward and optimizer steps are then the ones
measured; the trace's generic backward that follows acts on an empty graph, and its ``zero_grad`` and
``step`` are switched off on the trace's optimizers (Lightning calls neither under manual optimization, so
the gradients stay alive until the step's own ``zero_grad`` of the next step).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = ["manual_optimization_trace"]


def _set_phase(phase: str) -> None:
    """Move the innermost active tensor tracker (the trace's) to ``phase``."""
    from lightning_memplan.tracking.tracker import TensorTracker

    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, TensorTracker):
            mode.set_phase(phase)
            return


class _TracedOptimizer:
    """What ``self.optimizers()`` returns in the trace: the trace's optimizer, entering the optimizer
    phase on ``step`` (as ``LightningOptimizer.step`` runs ``on_before_optimizer_step``)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        if closure is not None:
            closure()
        _set_phase("optimizer")
        return type(self.optimizer).step(self.optimizer, **kwargs)  # the class's step (the instance's is off)

    def zero_grad(self, set_to_none: bool = True) -> None:
        type(self.optimizer).zero_grad(self.optimizer, set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


def _manual_backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    _set_phase("backward")
    loss.backward(*args, **kwargs)


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def manual_optimization_trace(
    optimizers: Sequence[str | Callable[[Any], torch.optim.Optimizer]],
) -> tuple[Callable[[Any], list[torch.optim.Optimizer]], Callable[[nn.Module, Any], torch.Tensor]]:
    """``(optimizer, loss_fn)`` for :func:`~lightning_memplan.tracking.trace.calibrate` of a manually
    optimising LightningModule with the optimizers ``optimizers`` builds (one ``params -> Optimizer``
    factory or TrainSpec name per optimizer of the run, in ``configure_optimizers``' order).

    ``optimizer(params)`` builds one trace optimizer per entry from the copy's parameters (each factory
    picks its own, ``live.optimizer_factory(module_params=...)``) and returns them all: the trace tracks
    every one's states (``trace_memory``'s several-optimizer factory). ``loss_fn(module, batch)`` runs the copy's ``training_step`` with the stand-ins
    described in the module docstring, ``self.optimizers()`` answering as Lightning does (the one
    optimizer, or the list of them), and returns a zero scalar (the step already ran backward and the
    optimizer steps)."""
    from lightning_memplan.tracking.trace import make_optimizer

    if not optimizers:
        raise ValueError("optimizers=[] has no optimizer to trace a manually optimised step with; "
                         "configure_optimizers must return at least one")
    created: list[torch.optim.Optimizer] = []

    def optimizer(params: Any) -> list[torch.optim.Optimizer]:
        copy = list(params)
        created[:] = [make_optimizer(f, copy) for f in optimizers]
        for opt in created:
            # the trace's own zero_grad and step after training_step do nothing: Lightning leaves a manual
            # step's gradients alone until the user's next zero_grad (they are alive in the next forward)
            opt.__dict__.update(zero_grad=_nothing, step=_nothing)
        return list(created)

    def loss_fn(module: nn.Module, batch: Any) -> torch.Tensor:
        traced = [_TracedOptimizer(o) for o in created]
        handed: Any = traced[0] if len(traced) == 1 else traced

        def clip_gradients(
            optimizer: Any, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
        ) -> None:
            if not gradient_clip_val:
                return
            params = [p for g in optimizer.param_groups for p in g["params"]]  # Lightning clips that optimizer's
            if gradient_clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)

        module.__dict__.update(
            optimizers=lambda use_pl_optimizer=True: handed,
            manual_backward=_manual_backward,
            clip_gradients=clip_gradients,
            lr_schedulers=lambda: None,
            toggle_optimizer=_nothing,
            untoggle_optimizer=_nothing,
            toggled_optimizer=lambda optimizer: contextlib.nullcontext(),
            log=_nothing,
            log_dict=_nothing,
        )
        module.training_step(batch, 0)  # type: ignore[operator]
        return torch.zeros((), requires_grad=True)

    return optimizer, loss_fn
