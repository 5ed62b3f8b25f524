"""Keep ``torch.compile`` working under monitoring: find compiled modules, trace on their eager
originals, and measure compiled steps without a dispatch mode.

Why this exists: TorchDynamo refuses to convert a frame while a non-infra ``TorchDispatchMode`` is on
the stack ("skipping: forward (reason: non-infra torch dispatch mode present, this is not supported
today in torch.compile)", ``torch/_dynamo/convert_frame.py``), and the skip it returns is applied to
the *code object* for every future call (``ConvertFrameReturn.apply_to_code = True``,
``torch/_dynamo/types.py``). So one fake-tensor calibration trace or one tensor-tracked step that
reaches a compiled frame first leaves that model eager for the rest of the process. Hence:

- :func:`compiled_parts` finds what ``torch.compile`` wrapped: ``OptimizedModule`` sub-modules (a
  ``self.model = torch.compile(model)``), a LightningModule given to the Trainer as
  ``torch.compile(lit)`` (Lightning's ``from_compiled`` stores ``_compiler_ctx`` and wraps
  ``forward``/``training_step``/... in the dynamo context), and dynamo-wrapped methods set on the
  instance.
- :func:`eager_view` swaps them for their eager originals and sets the ``"force_eager"`` stance
  (``torch.compiler.set_stance``: the eval-frame callback is ``None``, so no frame is converted or
  marked) for the duration of a trace, and restores everything on exit; the compiled objects, their
  caches and guards are never touched.
- :class:`AllocationMeter` measures a compiled step on the CPU from the profiler's allocator events
  (``torch.profiler.profile(profile_memory=True)``: the c10 CPU allocator reports every allocation and
  free with its size to the profiler; the profiler is an observer, not a dispatch mode, and compiled
  code runs under it). The peak is the persistent bytes at the step start (parameters, buffers,
  gradients, optimizer states and the batch, counted once per storage) plus the largest running sum of
  the allocation events, per phase between marker events.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_memplan.model.result import PHASES

__all__ = ["AllocationMeter", "compiled_parts", "eager_view"]

#: Methods Lightning's ``from_compiled`` wraps in the dynamo context (lightning/pytorch/utilities/compile.py).
_LIGHTNING_COMPILED_METHODS = ("forward", "training_step", "validation_step", "test_step", "predict_step")
#: Name prefix of the profiler marker events opened at each phase boundary.
_MARK = "memplan::"
#: Kineto's log level above its highest (USDT = 5): silences the "profiler_start"/"profiler_stop" lines
#: it otherwise prints on every profiled step (only set when the user has not set it).
_KINETO_QUIET = "6"


def _optimized_module_type() -> type | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a build without dynamo
        return None
    return OptimizedModule


def _is_dynamo_wrapped(fn: Any) -> bool:
    # ``_TorchDynamoContext.__call__`` marks the function it returns with the original callable.
    return callable(fn) and hasattr(fn, "_torchdynamo_orig_callable")


def compiled_parts(module: nn.Module | None) -> list[str]:
    """What ``torch.compile`` wrapped in ``module``: ``"model (OptimizedModule)"`` for each compiled
    sub-module, ``"LightningModule (torch.compile given to the Trainer)"``, ``"training_step"`` for a
    dynamo-wrapped method on the instance. Empty when nothing is compiled."""
    if module is None:
        return []
    found: list[str] = []
    optimized = _optimized_module_type()
    if optimized is not None:
        if isinstance(module, optimized):
            found.append(f"{type(module._orig_mod).__name__} (OptimizedModule)")
        for name, sub in module.named_modules():
            if name and isinstance(sub, optimized):
                found.append(f"{name} (OptimizedModule)")
    if getattr(module, "_compiler_ctx", None):
        found.append(f"{type(module).__name__} (torch.compile given to the Trainer)")
    else:
        found.extend(m for m in _LIGHTNING_COMPILED_METHODS if _is_dynamo_wrapped(module.__dict__.get(m)))
    return found


@contextlib.contextmanager
def eager_view(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` with every compiled part replaced by its eager original, under the ``force_eager``
    stance, until the block exits; then everything is put back as it was (same objects).

    Used to trace a compiled model (``copy.deepcopy`` inside the block copies the eager modules) without
    converting, skipping or guarding any of its frames. Parameters are shared by an ``OptimizedModule``
    and its ``_orig_mod``, so the view has the model's parameters.
    """
    optimized = _optimized_module_type()
    swapped: list[tuple[nn.Module, str, Any]] = []
    methods: list[tuple[str, Any]] = []
    root: Any = module
    if optimized is not None and isinstance(module, optimized):
        root = getattr(module, "_orig_mod")  # noqa: B009 - typed as Tensor | Module by nn.Module
    try:
        if optimized is not None:
            for parent in list(root.modules()):
                for name, child in list(parent._modules.items()):
                    if isinstance(child, optimized):
                        swapped.append((parent, name, child))
                        parent._modules[name] = getattr(child, "_orig_mod")  # noqa: B009
        ctx = getattr(root, "_compiler_ctx", None)
        for name in _LIGHTNING_COMPILED_METHODS:
            current = root.__dict__.get(name)
            if current is None or not _is_dynamo_wrapped(current):
                continue
            methods.append((name, current))
            original = ctx.get(f"original_{name}") if ctx else None
            if original is not None and getattr(original, "__self__", None) is root:
                # the class's method, bound: dropping the instance attribute gives it back (and a deep
                # copy then calls the copy's own method, not the original module's)
                del root.__dict__[name]
            else:
                root.__dict__[name] = original if original is not None else current._torchdynamo_orig_callable
        with torch.compiler.set_stance("force_eager"):
            yield root
    finally:
        for name, current in methods:
            root.__dict__[name] = current
        for parent, name, child in reversed(swapped):
            parent._modules[name] = child


def _unique_storage_bytes(tensors: Iterable[torch.Tensor], device_type: str) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != device_type or t.layout is not torch.strided:
            continue
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        key = st.data_ptr()
        if key in seen or st.nbytes() == 0:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def _flatten(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _flatten(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _flatten(v)


class AllocationMeter:
    """Peak allocated CPU tensor bytes of one step, per phase, from the profiler's allocator events.

    Usage: ``meter.start(module, optimizers, batch)``, ``meter.set_phase("backward")`` at each phase
    boundary, ``meter.stop()`` -> ``(peak, {phase: peak})``. Only CPU allocations are counted
    (``device_type``); the baseline is the bytes alive at the start that the step keeps or frees
    (parameters, buffers, gradients, optimizer states, the batch).
    """

    method = "profiler"

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type
        self._prof: Any = None
        self._mark: Any = None
        self._baseline = 0

    def start(self, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer], batch: Any) -> None:
        from torch.profiler import ProfilerActivity, profile

        tensors: list[torch.Tensor] = [*module.parameters(), *module.buffers()]
        tensors += [p.grad for p in module.parameters() if p.grad is not None]
        for opt in optimizers:
            tensors += [t for state in opt.state.values() for t in _flatten(state)]
        tensors += list(_flatten(batch))
        self._baseline = _unique_storage_bytes(tensors, self.device_type)
        os.environ.setdefault("KINETO_LOG_LEVEL", _KINETO_QUIET)
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        self.set_phase(PHASES[0])

    def set_phase(self, phase: str) -> None:
        if self._prof is None:
            return
        from torch.autograd.profiler import record_function

        self._close_mark()
        self._mark = record_function(f"{_MARK}{phase}")
        self._mark.__enter__()

    def _close_mark(self) -> None:
        if self._mark is not None:
            mark, self._mark = self._mark, None
            mark.__exit__(None, None, None)

    def stop(self) -> tuple[int, dict[str, int]] | None:
        """``(peak, {phase: peak})`` in bytes, or ``None`` if the meter was not started."""
        if self._prof is None:
            return None
        self._close_mark()
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        events = prof.profiler.kineto_results.events()
        cpu = torch.autograd.DeviceType.CPU if self.device_type == "cpu" else None
        allocs = sorted(
            (e.start_ns(), int(e.nbytes()))
            for e in events
            if e.name() == "[memory]" and (cpu is None or e.device_type() == cpu)
        )
        marks = sorted(
            (e.start_ns(), e.start_ns() + e.duration_ns(), e.name()[len(_MARK):])
            for e in events
            if e.name().startswith(_MARK)
        )
        live = self._baseline
        peak = live
        phase_peaks: dict[str, int] = {}
        i = 0
        for begin, end, phase in marks:
            while i < len(allocs) and allocs[i][0] < begin:  # between markers: the previous phase's
                live += allocs[i][1]
                i += 1
            top = live
            while i < len(allocs) and allocs[i][0] <= end:
                live += allocs[i][1]
                top = max(top, live)
                i += 1
            phase_peaks[phase] = max(phase_peaks.get(phase, 0), top)
            peak = max(peak, top)
        return peak, phase_peaks

    def close(self) -> None:
        """Stop profiling without a result (on an exception)."""
        self._close_mark()
        if self._prof is not None:
            prof, self._prof = self._prof, None
            with contextlib.suppress(Exception):
                prof.__exit__(None, None, None)
