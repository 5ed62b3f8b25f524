"""The run a monitoring feature watches stays as it was: one context manager for every step, batch draw or
trace that the callback, the Fabric monitor or ``memplan_auto`` runs beside the user's training.

A traced or real calibration step runs dropout, draws synthetic batches and builds optimizers; a batch
peeked before setup runs the sampler's seed draw. Each of these advances a global random generator, and
every later dropout mask or shuffled order of the user's run would then differ from the run without the
callback (a BERT masked-LM trained 2.2e-2 apart in loss after 4 steps). :func:`preserved_run_state`
makes that impossible by construction:

- the global random states are forked and put back on exit: the CPU generator and every initialised
  CUDA device's (``torch.random.fork_rng``), the MPS generator, Python's ``random`` and NumPy's global
  ``RandomState`` (when NumPy is imported);
- the grad mode and the default dtype are put back;
- the ``training`` flag of every submodule of ``module``, every parameter's ``requires_grad`` and the
  gradient tensor each parameter holds (``p.grad``, by identity) are put back;
- what cannot be put back without a copy of every tensor -- the values of parameters, buffers, gradients
  and optimizer states -- is checked by the tensors' version counters (``Tensor._version``, which every
  in-place operation advances; PyTorch's autograd uses it to detect tensors saved for backward and then
  modified, ``torch/csrc/autograd/variable.h``) and, if one moved, named in :attr:`RunStateGuard.moved`.
  The features that run inside this block work on copies, so a name there is a defect to report.

Nothing here allocates a tensor of the module's size: the check costs one integer per tensor.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["RunStateGuard", "preserved_run_state"]


@dataclass
class RunStateGuard:
    """What :func:`preserved_run_state` found on exit.

    Attributes:
        restored: what had changed and was put back (``"training flag of dropout"``, ``"rng numpy"`` is
            never listed: random states are always put back, changed or not).
        moved: tensors whose values changed in place and could not be put back (``"parameter
            encoder.weight"``, ``"optimizer state 0.exp_avg"``): a defect of the feature that ran.
    """

    restored: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)


def _numpy_state() -> Any:
    numpy = sys.modules.get("numpy")  # never imported here: a run without NumPy has no state to keep
    return numpy.random.get_state() if numpy is not None else None


def _cuda_devices() -> list[int]:
    """Devices whose generator exists now: CUDA initialised (asking an uninitialised CUDA for its state
    would initialise it in the user's process, e.g. before a fork)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return list(range(torch.cuda.device_count()))


def _reseed_new_cuda() -> None:
    """CUDA initialised inside the block: each device's generator back to its state right after lazy
    initialisation (its initial seed, offset 0), as if nothing had drawn from it."""
    for device in range(torch.cuda.device_count()):
        with torch.cuda.device(device):
            torch.cuda.manual_seed(torch.cuda.initial_seed())


@contextlib.contextmanager
def _forked_rngs() -> Iterator[None]:
    cuda_before = _cuda_devices()
    python_state, numpy_state = random.getstate(), _numpy_state()
    mps = getattr(torch, "mps", None)
    mps_state = mps.get_rng_state() if mps is not None and torch.backends.mps.is_available() else None
    try:
        with torch.random.fork_rng(devices=cuda_before):
            yield
    finally:
        random.setstate(python_state)
        if numpy_state is not None:
            sys.modules["numpy"].random.set_state(numpy_state)
        if mps_state is not None and mps is not None:
            mps.set_rng_state(mps_state)
        if not cuda_before and _cuda_devices():
            _reseed_new_cuda()


def _optimizer_tensors(optimizers: Iterable[Any]) -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = []
    for i, optimizer in enumerate(optimizers):
        inner = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer / Fabric's wrapper
        for j, state in enumerate(getattr(inner, "state", {}).values()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out.append((f"optimizer {i} state {j}.{key}", value))
    return out


class _ModuleState:
    """Training flags, ``requires_grad``, gradient identities and version counters of a module."""

    def __init__(self, module: nn.Module | None, optimizers: Iterable[Any]) -> None:
        self.modules = list(module.named_modules(remove_duplicate=False)) if module is not None else []
        self.training = [m.training for _, m in self.modules]
        params = list(module.named_parameters(remove_duplicate=False)) if module is not None else []
        self.params = params
        self.requires_grad = [p.requires_grad for _, p in params]
        self.grads = [p.grad for _, p in params]
        tensors: list[tuple[str, torch.Tensor]] = [(f"parameter {n}", p) for n, p in params]
        tensors += [(f"gradient {n}", p.grad) for n, p in params if p.grad is not None]
        if module is not None:
            tensors += [(f"buffer {n}", b) for n, b in module.named_buffers(remove_duplicate=False)]
        tensors += _optimizer_tensors(optimizers)
        self.versions = [(name, t, _version(t)) for name, t in tensors]

    def restore(self, guard: RunStateGuard) -> None:
        for (name, mod), flag in zip(self.modules, self.training, strict=True):
            if mod.training != flag:
                mod.training = flag  # this module only: its children are restored by their own entries
                guard.restored.append(f"training flag of {name or '<root>'}")
        for (name, p), flag, grad in zip(self.params, self.requires_grad, self.grads, strict=True):
            if p.requires_grad != flag:
                p.requires_grad_(flag)
                guard.restored.append(f"requires_grad of {name}")
            if p.grad is not grad:
                p.grad = grad
                guard.restored.append(f"gradient of {name}")
        guard.moved.extend(name for name, t, v in self.versions if _version(t) != v)


def _version(t: torch.Tensor) -> int:
    try:
        return int(t._version)
    except (RuntimeError, AttributeError):  # a tensor subclass without a version counter
        return -1


@contextlib.contextmanager
def preserved_run_state(module: nn.Module | None = None, optimizers: Iterable[Any] = ()) -> Iterator[RunStateGuard]:
    """Run the block and leave the run as it was (module docstring): random states, grad mode and default
    dtype always put back; ``module``'s training flags, ``requires_grad`` and gradients put back; in-place
    changes of its parameters, buffers, gradients and of ``optimizers``' states named in the yielded
    :class:`RunStateGuard`'s ``moved`` (filled on exit, also when the block raises)."""
    guard = RunStateGuard()
    state = _ModuleState(module, list(optimizers))
    grad_enabled, default_dtype = torch.is_grad_enabled(), torch.get_default_dtype()
    try:
        with _forked_rngs():
            yield guard
    finally:
        torch.set_grad_enabled(grad_enabled)
        torch.set_default_dtype(default_dtype)
        state.restore(guard)
