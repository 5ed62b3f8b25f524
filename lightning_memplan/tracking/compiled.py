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
  ``forward``/``training_step``/... in the dynamo context), ``nn.Module.compile()`` (it sets
  ``_compiled_call_impl``, ``torch/nn/modules/module.py``), dynamo-wrapped callables set on any
  sub-module (``block.forward = torch.compile(block.forward)``) or defined on its class
  (``@torch.compile`` on a method), and compiled free functions that ``training_step`` names (a
  module-level ``fn = torch.compile(block_fn)``).
- :func:`eager_view` swaps them for their eager originals and sets the ``"force_eager"`` stance
  (``torch.compiler.set_stance``: the eval-frame callback is ``None``, so no frame is converted or
  marked; this also covers compiled functions no scan can see) for the duration of a trace, and
  restores everything on exit; the compiled objects, their caches and guards are never touched.
- :class:`CompileSafeTracker` is the tensor tracker with ``ignore_compile_internals() = True``
  (``torch/utils/_python_dispatch.py``: dynamo's dispatch-mode check, ``any_torch_dispatch_mode_on_stack``,
  passes over such a mode), so a tracked step never makes dynamo skip a compiled function the scan
  missed; :func:`dynamo_frames` (dynamo's own ``counters["frames"]["total"]``, one per frame it
  converts) tells the callback that compiled code ran in a step, after which it measures with the
  profiler (inductor's buffers are allocated outside the dispatcher, so a dispatch mode sees only its
  extern kernels).
- :class:`AllocationMeter` measures a compiled step on the CPU from the profiler's allocator events
  (``torch.profiler.profile(profile_memory=True)``: the c10 CPU allocator reports every allocation and
  free with its size to the profiler; the profiler is an observer, not a dispatch mode, and compiled
  code runs under it). The peak is the persistent bytes at the step start (parameters, buffers,
  gradients, optimizer states and the batch, counted once per storage) plus the largest running sum of
  the allocation events, per phase between marker events.
"""

from __future__ import annotations

import bisect
import contextlib
import inspect
import os
import sys
import types
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_memplan.model.result import PHASES
from lightning_memplan.tracking.tracker import TensorTracker

__all__ = ["AllocationMeter", "CompileSafeTracker", "compiled_parts", "dynamo_frames", "eager_view", "referenced_objects"]

#: Name prefix of the profiler marker events opened at each phase boundary.
_MARK = "memplan::"
#: Name prefix of the zero-length marker a watched gradient's death leaves (``memplan-free::<bytes>``).
_FREE_MARK = "memplan-free::"
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


#: Classes whose own methods are never the user's compiled code (skipped by the class scan).
_FRAMEWORK_MODULES = ("torch.", "lightning.", "pytorch_lightning.")


def _class_compiled_methods(cls: type) -> list[str]:
    """Methods of ``cls`` (and its user-defined bases) decorated with ``torch.compile``."""
    return [
        name
        for klass in cls.__mro__
        if not klass.__module__.startswith(_FRAMEWORK_MODULES) and klass.__module__ != "builtins"
        for name, value in vars(klass).items()
        if _is_dynamo_wrapped(value)
    ]


def _code_names(code: types.CodeType) -> set[str]:
    """Global names a function's code (and the code of functions nested in it) refers to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def referenced_objects(fn: Any) -> list[tuple[str, Any]]:
    """``(name, object)`` for every global ``fn``'s code names (nested functions included) and every
    variable it closes over: what a function such as ``training_step`` or a Fabric loop's ``loss_fn``
    can reach without being handed it. Written by hand: ``inspect.getclosurevars`` misses nested code."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    scope = getattr(fn, "__globals__", {})
    found = [(name, scope[name]) for name in sorted(_code_names(code)) if name in scope]
    for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=False):
        with contextlib.suppress(ValueError):  # an empty cell
            found.append((name, cell.cell_contents))
    return found


def _compiled_free_functions(module: nn.Module, method: str) -> list[str]:
    """Compiled callables that ``type(module).<method>`` names as globals or closes over."""
    fn = getattr(type(module), method, None) or (lambda: None)
    return [name for name, obj in referenced_objects(fn) if _is_dynamo_wrapped(obj)]


def compiled_parts(module: nn.Module | None) -> list[str]:
    """What ``torch.compile`` wrapped in ``module``: ``"model (OptimizedModule)"`` for each compiled
    sub-module, ``"LightningModule (torch.compile given to the Trainer)"``, ``"model.blocks.0
    (nn.Module.compile)"``, ``"model.blocks.0.forward (torch.compile)"`` for a dynamo-wrapped callable
    on a sub-module or its class, ``"fn (torch.compile, called in training_step)"`` for a compiled
    function ``training_step`` names. Empty when nothing is compiled."""
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
    lightning_compiled = bool(getattr(module, "_compiler_ctx", None))
    if lightning_compiled:
        found.append(f"{type(module).__name__} (torch.compile given to the Trainer)")
    classes_seen: set[type] = set()
    for name, sub in module.named_modules():
        if optimized is not None and isinstance(sub, optimized):
            continue
        prefix = f"{name}." if name else ""
        if getattr(sub, "_compiled_call_impl", None) is not None:
            found.append(f"{name or type(sub).__name__} (nn.Module.compile)")
        if not (lightning_compiled and sub is module):  # from_compiled's wrapped methods are named above
            found.extend(
                f"{prefix}{attr} (torch.compile)"
                for attr, v in vars(sub).items()
                if attr != "_compiled_call_impl" and _is_dynamo_wrapped(v)
            )
        if type(sub) not in classes_seen:
            classes_seen.add(type(sub))
            found.extend(f"{type(sub).__name__}.{m} (torch.compile)" for m in _class_compiled_methods(type(sub)))
    found.extend(
        f"{fn} (torch.compile, called in training_step)" for fn in _compiled_free_functions(module, "training_step")
    )
    return found


def dynamo_frames() -> int:
    """Frames TorchDynamo has converted in this process so far (``torch._dynamo.utils.counters["frames"]
    ["total"]``; 0 before dynamo is imported: nothing was compiled). A change across a step means
    compiled code ran in it (a first compile or a recompile)."""
    utils = sys.modules.get("torch._dynamo.utils")
    frames = getattr(utils, "counters", {}).get("frames") if utils is not None else None
    return int(frames["total"]) if frames else 0


class CompileSafeTracker(TensorTracker):
    """:class:`TensorTracker` that dynamo passes over (``ignore_compile_internals``), so a compiled
    function called inside a tracked step compiles and runs as it would without the tracker.

    What it sees of a compiled region is what reaches the dispatcher: every aten op under the
    ``eager``/``aot_eager`` backends, only extern kernels under inductor; the callback therefore drops
    the tracker's numbers for a step in which :func:`dynamo_frames` changed and measures compiled
    steps with :class:`AllocationMeter`.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


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
    attrs: list[tuple[nn.Module, str, Any]] = []
    call_impls: list[tuple[nn.Module, Any]] = []
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
        for sub in list(root.modules()):
            if getattr(sub, "_compiled_call_impl", None) is not None:  # nn.Module.compile()
                call_impls.append((sub, sub._compiled_call_impl))
                sub._compiled_call_impl = None
            for name, current in list(vars(sub).items()):
                if not _is_dynamo_wrapped(current):
                    continue
                attrs.append((sub, name, current))
                original = ctx.get(f"original_{name}") if (ctx and sub is root) else None
                if original is None:
                    original = inspect.unwrap(current._torchdynamo_orig_callable)
                if getattr(original, "__self__", None) is sub and getattr(type(sub), name, None) is getattr(
                    original, "__func__", None
                ):
                    # the class's method, bound: dropping the instance attribute gives it back (and a deep
                    # copy then calls the copy's own method, not the original module's)
                    del sub.__dict__[name]
                else:
                    sub.__dict__[name] = original
        with torch.compiler.set_stance("force_eager"):
            yield root
    finally:
        for sub, name, current in attrs:
            sub.__dict__[name] = current
        for sub, impl in call_impls:
            sub._compiled_call_impl = impl
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


def _with_unreported_frees(allocs: list[tuple[int, int]], events: Any) -> list[tuple[int, int]]:
    """``allocs`` (sorted ``(ns, bytes)``) plus a free at each ``memplan-free::<n>`` marker that the
    profiler did not report itself: the storage is released right after the weak-reference callback
    returns, so a reported free is the first memory event after the marker, of ``-n`` bytes."""
    frees = sorted(
        (e.start_ns(), int(e.name()[len(_FREE_MARK):])) for e in events if e.name().startswith(_FREE_MARK)
    )
    if not frees:
        return allocs
    extra = []
    for ns, nbytes in frees:
        i = bisect.bisect_left(allocs, (ns, -(2**62)))
        if i < len(allocs) and allocs[i][1] == -nbytes:
            continue  # reported by the allocator
        extra.append((ns, -nbytes))
    return sorted(allocs + extra)


class AllocationMeter:
    """Peak allocated CPU tensor bytes of one step, per phase, from the profiler's allocator events.

    Usage: ``meter.start(module, optimizers, batch)``, ``meter.set_phase("backward")`` at each phase
    boundary, ``meter.stop()`` -> ``(peak, {phase: peak})``. Only CPU allocations are counted
    (``device_type``); the baseline is the bytes alive at the start that the step keeps or frees
    (parameters, buffers, gradients, optimizer states, the batch).

    Gradients are watched: c10's CPU allocator reports a free to the profiler only for a block it
    saw allocated while memory profiling was on (``ProfiledCPUMemoryReporter``,
    ``c10/core/CPUAllocator.cpp``: "Memory block of unknown size was allocated before the profiling
    started, profiler results will not include the deallocation event"). After an unprofiled step,
    ``zero_grad(set_to_none=True)`` frees the previous gradients unreported, and they would be counted
    twice (in the baseline and as the new gradients): up to +8.6 % on a one-layer GPT's step peak, +21 %
    in the MemTracker comparison of ``test_callback_compile``. A weak
    reference to each gradient leaves a zero-length ``memplan-free::<bytes>`` marker when it dies;
    :meth:`stop` counts it as the free unless the profiler reported that free itself (the next memory
    event is the same size).
    """

    method = "profiler"

    def __init__(self, device_type: str = "cpu") -> None:
        self.device_type = device_type
        self._prof: Any = None
        self._mark: Any = None
        self._baseline = 0
        self._watched: list[weakref.ref[torch.Tensor]] = []

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
        self._watch_grads(module)
        self.set_phase(PHASES[0])

    def _watch_grads(self, module: nn.Module) -> None:
        seen: set[int] = set()
        for param in module.parameters():
            grad = param.grad
            if grad is None or grad.device.type != self.device_type or grad.layout is not torch.strided:
                continue
            storage = grad.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            self._watched.append(weakref.ref(grad, self._freed_marker(storage.nbytes())))

    def _freed_marker(self, nbytes: int) -> Any:
        def freed(_: Any) -> None:
            if self._prof is not None:
                with torch.autograd.profiler.record_function(f"{_FREE_MARK}{nbytes}"):
                    pass

        return freed

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
        self._watched = []
        events = prof.profiler.kineto_results.events()
        cpu = torch.autograd.DeviceType.CPU if self.device_type == "cpu" else None
        allocs = sorted(
            (e.start_ns(), int(e.nbytes()))
            for e in events
            if e.name() == "[memory]" and (cpu is None or e.device_type() == cpu)
        )
        allocs = _with_unreported_frees(allocs, events)
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
        self._watched = []
        self._close_mark()
        if self._prof is not None:
            prof, self._prof = self._prof, None
            with contextlib.suppress(Exception):
                prof.__exit__(None, None, None)
