"""The model-kind harness: one model fitted twice, with and without ``MemoryPlanCallback``, compared.

A monitoring callback must never change the run it watches. :func:`fit_twice` fits the same module
(built by ``make_module()`` after ``lightning.seed_everything(seed)``) on the same data twice with a real
``Trainer.fit`` on the CPU, once with the callback and once without, and returns a :class:`KindResult`:
the per-step losses of both fits (compared bitwise), whether the weights (parameters and buffers, e.g.
BatchNorm's running statistics) and the global random states (CPU, CUDA, Python ``random``, NumPy)
ended equal bitwise, what the callback's report estimated and measured for its first steady-state
tracked step, and its notes. With ``guard=True`` every hook of the callback is also checked on its
own: the random states, parameters, buffers, gradients, optimizer states and ``training`` flags are
snapshot before the hook and compared after it (:func:`run_state_snapshot`), so a change is pinned to
the hook that made it. With ``memtracker=True`` the fit without the callback measures the same
training step with PyTorch's own ``torch.distributed._tools.mem_tracker.MemTracker``: the independent
reference for the callback's measurement.

Example::

    from lightning_memplan.testing.model_kinds import fit_twice

    result = fit_twice(lambda: LitBert(), lambda: DataLoader(ds, batch_size=2), steps=4)
    assert result.losses_equal and result.weights_equal and not result.hook_changes
    assert abs(result.error) <= 0.05, result.notes
"""

from __future__ import annotations

import contextlib
import random
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from lightning.pytorch import Callback
from torch import nn

from lightning_memplan.callbacks import MemoryPlanCallback
from lightning_memplan.report.records import MemoryReport, StepRecord

__all__ = [
    "KindResult",
    "MemTrackerProbe",
    "StateGuard",
    "fit_twice",
    "run_state_snapshot",
    "snapshot_differences",
]


@dataclass(frozen=True, kw_only=True)
class KindResult:
    """Both fits of :func:`fit_twice` side by side.

    Attributes:
        losses_with, losses_without: the loss of every training step, with and without the callback.
        weights_equal: whether every parameter and buffer ended bitwise equal.
        rng_equal: whether the global random states (CPU, CUDA, Python, NumPy) ended bitwise equal.
        estimated_peak, measured_peak: the callback's estimate and tensor-tracker measurement of its
            first steady-state tracked step (``None`` when there was none), bytes.
        measured_step: the step index they describe (``None`` without one).
        memtracker_peak: PyTorch's ``MemTracker`` peak of the same step in the fit without the callback
            (``None`` unless ``memtracker=True``), bytes.
        notes: the report's notes (what could not be inferred, estimated or calibrated, and why).
        estimate_source: the report's ``run["estimate_source"]`` (``"calibrated"``, ``"analytic"``, ...).
        hook_changes: ``"<hook>: <what moved>"`` for every callback hook that changed the run state
            (empty unless ``guard=True`` found one).
        report: the callback's :class:`MemoryReport`.
    """

    losses_with: tuple[float, ...]
    losses_without: tuple[float, ...]
    weights_equal: bool
    rng_equal: bool = True
    estimated_peak: int | None = None
    measured_peak: int | None = None
    measured_step: int | None = None
    memtracker_peak: int | None = None
    notes: tuple[str, ...] = ()
    estimate_source: str | None = None
    hook_changes: tuple[str, ...] = ()
    report: MemoryReport | None = field(default=None, repr=False, compare=False)

    @property
    def losses_equal(self) -> bool:
        """Whether both fits' losses are the same floats, step for step (bitwise)."""
        return self.losses_with == self.losses_without and len(self.losses_with) > 0

    @property
    def error(self) -> float | None:
        """``estimated / measured - 1`` of the steady-state tracked step (``None`` without one)."""
        if not self.estimated_peak or not self.measured_peak:
            return None
        return self.estimated_peak / self.measured_peak - 1.0

    @property
    def unchanged(self) -> bool:
        """Losses, weights and random states equal, and no hook changed the run state."""
        return self.losses_equal and self.weights_equal and self.rng_equal and not self.hook_changes


# ---------------------------------------------------------------------------------------------- snapshots
def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"torch.cpu": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["torch.cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        states["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy comes with torch's wheels
        pass
    return states


def _tensor_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _optimizer_state(optimizer: Any) -> list[tuple[str, Any]]:
    inner = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer wraps the torch one
    out: list[tuple[str, Any]] = []
    for i, (param, state) in enumerate(getattr(inner, "state", {}).items()):
        for key, value in sorted(state.items(), key=lambda kv: str(kv[0])):
            name = f"optimizer[{i}:{tuple(param.shape)}].{key}"
            out.append((name, _tensor_copy(value) if isinstance(value, torch.Tensor) else value))
    return out


def run_state_snapshot(module: nn.Module, optimizers: tuple[Any, ...] | list[Any] = ()) -> dict[str, Any]:
    """Everything a monitoring feature must leave as it found it, copied: the global random states,
    every parameter, buffer and gradient of ``module`` (bitwise), every optimizer's state tensors and
    values, every submodule's ``training`` flag and every parameter's ``requires_grad``, the grad mode and
    the default dtype. Compare two with :func:`snapshot_differences`."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad():  # copies made outside any tracker's dispatch mode
        return {
            "rng": _rng_states(),
            "params": {n: _tensor_copy(p) for n, p in module.named_parameters(remove_duplicate=False)},
            "grads": {n: None if p.grad is None else _tensor_copy(p.grad)
                      for n, p in module.named_parameters(remove_duplicate=False)},
            "requires_grad": {n: p.requires_grad for n, p in module.named_parameters(remove_duplicate=False)},
            "buffers": {n: _tensor_copy(b) for n, b in module.named_buffers(remove_duplicate=False)},
            "training": {n or "<root>": m.training for n, m in module.named_modules(remove_duplicate=False)},
            "optimizers": [_optimizer_state(o) for o in optimizers],
            "grad_enabled": torch.is_grad_enabled(),
            "default_dtype": torch.get_default_dtype(),
        }


def _bitwise_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype == torch.bool or a.numel() == 0:
            return bool(torch.equal(a, b))
        return bool(torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_bitwise_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_bitwise_equal(a[k], b[k]) for k in a)
    try:
        import numpy as np

        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            return bool(np.array_equal(a, b))
    except ImportError:  # pragma: no cover
        pass
    return bool(a == b)


def snapshot_differences(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """What moved between two :func:`run_state_snapshot` results, one line per changed item (empty when
    nothing did), e.g. ``["rng torch.cpu", "buffers bn.running_mean", "training dropout"]``."""
    moved: list[str] = []
    for section in ("rng", "params", "grads", "requires_grad", "buffers", "training"):
        a, b = before[section], after[section]
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b or not _bitwise_equal(a[key], b[key]):
                moved.append(f"{section} {key}")
    for i, (a_opt, b_opt) in enumerate(zip(before["optimizers"], after["optimizers"], strict=False)):
        if not _bitwise_equal(a_opt, b_opt):
            moved.append(f"optimizers[{i}] state")
    for key in ("grad_enabled", "default_dtype"):
        if before[key] != after[key]:
            moved.append(f"{key} {before[key]} -> {after[key]}")
    return moved


# ---------------------------------------------------------------------------------------------- callbacks
class StateGuard:
    """Wraps every hook of one callback instance: the run state is snapshot before the hook runs and
    compared after (:func:`run_state_snapshot`); each change is kept in :attr:`changes` as
    ``"<hook>@<batch>: <what moved>"``. The callback itself is unchanged otherwise."""

    def __init__(self, callback: Callback) -> None:
        self.callback = callback
        self.changes: list[str] = []
        self.calls = 0
        for name in dir(Callback):
            if (name.startswith("on_") or name in ("setup", "teardown")) and callable(getattr(callback, name)):
                setattr(callback, name, self._guarded(name, getattr(callback, name)))

    def _guarded(self, name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> Any:
            optimizers = tuple(getattr(trainer, "optimizers", ()) or ())
            before = run_state_snapshot(pl_module, optimizers)
            try:
                return hook(trainer, pl_module, *args, **kwargs)
            finally:
                self.calls += 1
                from torch.utils._python_dispatch import _disable_current_modes

                with _disable_current_modes():  # no op of the comparison reaches a tracker of the step
                    moved = snapshot_differences(before, run_state_snapshot(pl_module, optimizers))
                if moved:
                    where = f"{name}@{getattr(trainer, 'global_step', '?')}"
                    self.changes.append(f"{where}: {', '.join(moved[:8])}" + (" ..." if len(moved) > 8 else ""))

        return guarded


class _LossRecorder(Callback):
    """The loss of every training step, as the float the step returned."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            self.losses.append(float(loss.detach()))


def _batch_tensors(batch: Any, depth: int = 4) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if depth <= 0:
        return []
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    return [t for v in values for t in _batch_tensors(v, depth - 1)]


def _total_tracker() -> Any:
    """PyTorch's ``MemTracker`` counting every live storage of the step (its ``Total``) without its
    per-module snapshots: those hooks refuse a module called twice in one step (a UNet's shared block, a
    dual encoder) and a parameter that needs no gradient (a frozen position table), where the totals are
    still well defined. The parameters, buffers, gradients and optimizer states are tracked up front
    (``track_external``); everything else is allocated through the dispatcher, where it is counted."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class TotalMemTracker(MemTracker):
        def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
            return None

        def _post_fw_hook(self, module: nn.Module, inputs: Any, outputs: Any) -> None:
            return None

        def _pre_bw_hook(self, module: nn.Module, args: Any) -> None:
            return None

        def _post_bw_hook(self, module: nn.Module, args: Any) -> None:
            return None

    return TotalMemTracker()


class MemTrackerProbe(Callback):
    """PyTorch's ``MemTracker`` around training step ``step`` (its batch, the module's parameters,
    buffers and gradients, and the optimizer states tracked from before the step): the independent
    reference for the callback's tensor tracker. :attr:`peak` is its peak ``Total`` on the CPU, bytes."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.peak: int | None = None
        self._tracker: Any = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx != self.step:
            return
        tracker = _total_tracker()
        optimizers = [getattr(o, "optimizer", o) for o in trainer.optimizers]
        tracker.track_external(pl_module, *optimizers, *_batch_tensors(batch))
        tracker.__enter__()
        self._tracker = tracker

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        tracker, self._tracker = self._tracker, None
        if tracker is None:
            return
        tracker.__exit__(None, None, None)
        self.peak = int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


# ---------------------------------------------------------------------------------------------- fitting
@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def _fit(
    make_module: Callable[[], L.LightningModule],
    make_loader: Callable[[], Any],
    callbacks: list[Callback],
    *,
    steps: int,
    seed: int,
    trainer_kwargs: Mapping[str, Any],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One seeded fit; ``(state dict copy, random states at the end)``."""
    L.seed_everything(seed, verbose=False)
    module = make_module()
    loader = make_loader()
    with tempfile.TemporaryDirectory(prefix="memplan_kinds_") as root:
        options: dict[str, Any] = dict(
            accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=steps, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=root,
        )
        options.update(trainer_kwargs)
        L.Trainer(callbacks=callbacks, **options).fit(module, loader)
    weights = {k: _tensor_copy(v) for k, v in module.state_dict(keep_vars=False).items()}
    return weights, _rng_states()


def _steady_record(report: MemoryReport) -> StepRecord | None:
    """The callback's first tracked step after an optimizer step (the steady state it estimates)."""
    for epoch in report.epochs:
        for rank in epoch.ranks:
            steady = [t for t in rank.tracked if not t.warmup and t.measured_peak]
            if steady:
                return min(steady, key=lambda t: t.step)
    return None


def fit_twice(
    make_module: Callable[[], L.LightningModule],
    make_loader: Callable[[], Any],
    *,
    steps: int = 4,
    callback_kwargs: Mapping[str, Any] | None = None,
    trainer_kwargs: Mapping[str, Any] | None = None,
    extra_callbacks: Callable[[], list[Callback]] | None = None,
    seed: int = 0,
    guard: bool = True,
    memtracker: bool = False,
) -> KindResult:
    """Fit ``make_module()`` on ``make_loader()`` for ``steps`` training batches with and without a
    ``MemoryPlanCallback(**callback_kwargs)`` (its defaults when ``None``) and compare (module docstring).

    Args:
        make_module: builds the LightningModule; called after ``seed_everything(seed)`` for each fit.
        make_loader: builds the training data (a ``DataLoader``); called right after ``make_module``.
        steps: training batches per fit (``limit_train_batches``).
        callback_kwargs: keywords of ``MemoryPlanCallback`` (``None``: its defaults).
        trainer_kwargs: keywords of ``Trainer`` over the harness's quiet CPU defaults (e.g.
            ``accumulate_grad_batches=2, gradient_clip_val=1.0``).
        extra_callbacks: builds further callbacks for both fits (e.g. Lightning's weight averaging), fresh
            for each fit.
        seed: the seed of both fits.
        guard: check every hook of the callback with a :class:`StateGuard` (``hook_changes``).
        memtracker: measure the callback's steady tracked step with ``MemTracker`` in the fit without it.
    """
    extra = extra_callbacks or (lambda: [])
    callback = MemoryPlanCallback(**dict(callback_kwargs or {}))
    guarded = StateGuard(callback) if guard else None
    with_losses, without_losses = _LossRecorder(), _LossRecorder()
    kwargs = dict(trainer_kwargs or {})
    with _deterministic():
        weights_with, rng_with = _fit(make_module, make_loader, [callback, with_losses, *extra()],
                                      steps=steps, seed=seed, trainer_kwargs=kwargs)
        record = _steady_record(callback.report)
        probe = MemTrackerProbe(record.step) if memtracker and record is not None else None
        weights_without, rng_without = _fit(
            make_module, make_loader, [without_losses, *extra(), *([probe] if probe is not None else [])],
            steps=steps, seed=seed, trainer_kwargs=kwargs,
        )
    return KindResult(
        losses_with=tuple(with_losses.losses),
        losses_without=tuple(without_losses.losses),
        weights_equal=_bitwise_equal(weights_with, weights_without),
        rng_equal=_bitwise_equal(rng_with, rng_without),
        estimated_peak=record.estimated_peak if record is not None else None,
        measured_peak=record.measured_peak if record is not None else None,
        measured_step=record.step if record is not None else None,
        memtracker_peak=probe.peak if probe is not None else None,
        notes=tuple(callback.report.notes),
        estimate_source=callback.report.run.get("estimate_source"),
        hook_changes=tuple(guarded.changes) if guarded is not None else (),
        report=callback.report,
    )
