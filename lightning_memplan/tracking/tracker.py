"""A live-storage tensor tracker that attributes every byte of a training step to a memory-model component.

Why not just PyTorch's ``torch.distributed._tools.mem_tracker.MemTracker``: it does the hard part the same
way (a ``TorchDispatchMode`` that keeps a weak reference to each ``UntypedStorage``, so views share one
entry and a storage is subtracted the moment it is freed; it works under ``FakeTensorMode``) and we check
our totals against it in the tests. But it falls short for the memory model in four ways:

1. its categories (Parameter, Buffer, Gradient, Activation, Temp, Optstate, Other) do not separate the
   [b, a, s, s] attention scores and the [b, s, V] logits, which are the terms the estimate is about;
2. every tensor created inside ``optimizer.step`` is an optimizer state to it, so foreach temporaries
   are counted as states; and under Lightning, whose ``optimizer.step(closure)`` runs forward and
   backward *inside* the step, the whole step would be "optimizer";
3. it keeps one overall peak (plus per-module forward/backward peaks), not a peak per phase
   (forward, backward, optimizer step);
4. it hooks every module and walks all module statistics after every operator, which is too slow for
   sampled steps of a real Trainer run.

:class:`TensorTracker` therefore re-implements the small storage-accounting core with the project's
classification. Usage::

    tracker = TensorTracker(model, [optimizer], seq_len=s, vocab_size=V)
    with tracker:
        tracker.set_phase("forward"); loss = step(batch)
        tracker.set_phase("backward"); loss.backward()
        tracker.set_phase("optimizer"); optimizer.step(); optimizer.zero_grad()
    report = tracker.report()          # a TrackerReport: bytes per component at each peak

Classification of a storage when it is first created (inside the tracker):

- ``params`` / ``grads`` / ``optimizer``: parameter storages, ``.grad`` storages (re-classified by a
  post-accumulate-grad hook) and ``optimizer.state`` tensors (re-classified after ``optimizer.step``).
- a copy (``clone``, ``_to_copy``) of a tracked activation/attention/logits/workspace storage: the
  component of its source (so ``logits.float()`` is logits and a contiguous copy of ``q`` stays an
  activation even when ``head_dim == s``).
- ``attention``: shaped ``[..., s, s]`` with >= 4 dims (eager scores, probabilities, dropout masks and
  their gradients) or a 2-d bool ``[s, s]`` (the causal mask); ``[b, s, h]`` and weight-shaped
  ``[h, h]`` tensors with ``h == s`` are deliberately not matched. When
  ``head_dim == s``, ``[b, a, s, d]`` tensors produced by matmuls (e.g. gradients of q in backward) are
  indistinguishable by shape and are counted as attention.
- ``logits``: at least 2 dims and last dim ``V`` (logits, fp32 copies, log-softmax, gradient of logits).
- ``averaged``: the parameters and buffers of a weight-averaging copy: a
  ``torch.optim.swa_utils.AveragedModel`` inside the module, or a copy registered with
  :meth:`~TensorTracker.track_copy` (Lightning's SWA and EMA callbacks keep theirs beside the module).
  They are not the trained module's parameters, whatever ``module.parameters()`` yields.
- ``other``: casts of parameters (autocast's low-precision weight copies), buffers, storages first seen
  through a view or in-place op (created before the tracker started, e.g. the batch), tensors passed to
  :meth:`track` without a component.
- ``activations``: anything else created in the forward phase (alive until backward frees it).
- ``workspace``: anything else created in backward or in the optimizer step (activation gradients in
  flight, foreach temporaries).

A storage created in backward or in the optimizer step that later becomes a ``.grad`` or an optimizer
state is reported in its final component at the peaks too (the peak snapshot remembers those storages
and is resolved when the report is taken).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from lightning_memplan.model.result import COMPONENTS, PHASES, trim_optional
from lightning_memplan.tracking.report import TrackerReport
from lightning_memplan.tracking.timeline import DEFAULT_TIMELINE_POINTS, TimelineBuilder

__all__ = ["TensorTracker", "quantization_constants"]

# Components a storage can move *into* after its creation; only these re-classifications are applied to
# peak snapshots taken before the move (a gradient or an optimizer state is what the bytes are).
_FINAL_COMPONENTS = frozenset({"grads", "optimizer"})
# Ops whose output is a copy of their first input: the copy belongs to the input's component (a
# contiguous copy of q is an activation even when head_dim == s makes it look like [b, a, s, s]; a
# ``logits.float()`` copy is logits), except copies of parameters (autocast's weight copies: other)
# and of "other" storages (a cast of the batch is an activation, by the rules below).
_COPY_OPS = frozenset(
    {
        torch.ops.aten._to_copy.default,
        torch.ops.aten.clone.default,
        torch.ops.aten._to_copy.out,
        torch.ops.aten.clone.out,
    }
)
_INHERITED = frozenset({"activations", "attention", "logits", "workspace"})
#: Operations whose live totals :class:`_StepView` keeps to move a late release back (a late release is
#: drained within a few hundred operations of its last use; an older one makes the view a bound).
_VIEW_OPS = 8192


class _StepView:
    """The step's own live bytes per operation, with each storage another thread released late counted
    only up to its last use by the step: ``total - released`` over the operations in between.

    A ring of the last :data:`_VIEW_OPS` operations' totals; an operation leaving it is final (folded into
    :attr:`folded`). :meth:`peak` is the step's peak without the late releases.
    """

    __slots__ = ("exact", "folded", "ops", "totals")

    def __init__(self) -> None:
        self.ops = [-1] * _VIEW_OPS
        self.totals = [0] * _VIEW_OPS
        self.folded = 0
        self.exact = True

    def note(self, op: int, total: int) -> None:
        i = op % _VIEW_OPS
        if self.ops[i] == op:
            self.totals[i] = max(self.totals[i], total)
            return
        if self.ops[i] >= 0:
            self.folded = max(self.folded, self.totals[i])
        self.ops[i], self.totals[i] = op, total

    def release(self, last: int, released: int, nbytes: int) -> None:
        """A storage last used at operation ``last`` and released (by another thread) after ``released``."""
        start = max(last + 1, released - _VIEW_OPS + 1)
        self.exact = self.exact and start == last + 1
        for op in range(start, released + 1):
            i = op % _VIEW_OPS
            if self.ops[i] == op:
                self.totals[i] -= nbytes

    def peak(self) -> int:
        return max(self.folded, max((t for o, t in zip(self.ops, self.totals, strict=True) if o >= 0), default=0))


class _Info:
    __slots__ = ("component", "last", "nbytes")

    def __init__(self, nbytes: int, component: str, last: int = 0) -> None:
        self.nbytes = nbytes
        self.component = component
        self.last = last  # the tracker's operation count when the storage was last an operation's output


_DTENSOR: Any
try:
    from torch.distributed.tensor import DTensor as _DTENSOR
except ImportError:  # torch built without distributed
    _DTENSOR = None


def _fake_mode() -> Any:
    # The innermost FakeTensorMode on the dispatch-mode stack (what ``torch._guards.active_fake_mode``
    # finds outside a tracing context, without its per-call overhead).
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


def _moment_name(moment: tuple[Any, int]) -> str:
    func, k = moment
    return "start" if func == "start" else f"{func}#{k}"


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    if is_traceable_wrapper_subclass(t):
        from torch.distributed._tools.common_utils import get_untyped_storages

        return list(get_untyped_storages(t))
    if t.layout is not torch.strided:
        return []
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):  # e.g. tensors without storage (functional wrappers)
        return []


def quantization_constants(param: torch.Tensor | nn.Module) -> list[torch.Tensor]:
    """The tensors a quantized parameter keeps beside its storage, which ``module.parameters()`` does not
    reach: a bitsandbytes ``Params4bit``'s ``quant_state`` (``absmax``, ``code``, ``offset`` and, under
    double quantisation, ``state2.absmax`` / ``state2.code``) and an ``Int8Params``' fp32 row scales
    ``SCB`` (bitsandbytes 0.50.2 ``bitsandbytes/functional.py`` ``QuantState``, ``nn/modules.py``).
    Read by attribute, so bitsandbytes is never imported here; ``[]`` for any other parameter. A
    ``Linear4bit`` layer passed instead gives its own ``quant_state`` (the same object its weight holds;
    under FSDP2 the sharded weight is a new parameter without it)."""
    found: list[torch.Tensor] = []
    state = getattr(param, "quant_state", None)
    for holder in (state, getattr(state, "state2", None)):
        for name in ("absmax", "code", "offset"):
            value = getattr(holder, name, None)
            if isinstance(value, torch.Tensor):
                found.append(value)
    scb = getattr(param, "SCB", None)
    if isinstance(scb, torch.Tensor):
        found.append(scb)
    return found


def _flat_tensors(out: Any) -> Iterable[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _flat_tensors(item)]
    return ()


class TensorTracker(TorchDispatchMode):
    """Measures live tensor bytes per memory component at the peak of each phase of a training step.

    Args:
        module: the model; its parameters (``params``), buffers (``other``) and existing ``.grad``
            (``grads``) are registered on entry and post-accumulate-grad hooks classify new gradients.
        optimizers: optimizers whose states are ``optimizer`` (states of any optimizer stepped inside
            the tracker are classified after its step as well).
        seq_len: s, to recognise ``[..., s, s]`` attention tensors; ``None`` disables that rule
            (settable between steps through :attr:`seq_len`, sequence length may change per batch).
        vocab_size: V, to recognise ``[..., V]`` logits tensors; ``None`` means the largest
            ``nn.Embedding`` of ``module`` if it has one, else the rule is disabled.
        device: count only storages on this device type (``"cpu"``, ``"cuda"``); ``None`` means the
            device of the module's first parameter (all devices when there is none).
        pin: ``{phase: moment}``: also snapshot the components at that moment of the phase
            (:attr:`TrackerReport.pinned`); a moment is ``"<operator>#<k>"``, right after the k-th call
            of that operator in the phase, as :attr:`TrackerReport.peak_ops` names the peaks. Used to
            compare batch shapes at the same point of the step (counting calls of one operator is robust
            to the few view ops whose presence depends on the shape, e.g. matmul folding for b == 1).
        timeline_points: keep live bytes per component over the step as at most this many samples
            (:attr:`TrackerReport.timeline`, max-preserving decimation, O(1) per operator); ``None``
            turns the timeline off.

    Raises:
        ValueError: ``seq_len``/``vocab_size`` not a positive int, or a phase name not in ``PHASES``.
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        optimizers: Iterable[torch.optim.Optimizer] | torch.optim.Optimizer = (),
        *,
        seq_len: int | None = None,
        vocab_size: int | None = None,
        device: str | torch.device | None = None,
        pin: Mapping[str, str] | None = None,
        timeline_points: int | None = DEFAULT_TIMELINE_POINTS,
    ) -> None:
        super().__init__()
        self._timeline = TimelineBuilder(timeline_points) if timeline_points is not None else None
        self.module = module
        self.optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        self.seq_len = seq_len
        if vocab_size is None and module is not None:
            sizes = [m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)]
            vocab_size = max(sizes) if sizes else None
        self.vocab_size = vocab_size
        for name, value in (("seq_len", seq_len), ("vocab_size", vocab_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive int or None")
        if device is None and module is not None:
            first = next(iter(module.parameters()), None)
            device = first.device if first is not None else None
        self.device_type: str | None = torch.device(device).type if device is not None else None
        self._live: dict[int, tuple[weakref.ref, _Info]] = {}
        self._cur = dict.fromkeys(COMPONENTS, 0)
        self._total = 0
        self._fresh: dict[int, _Info] = {}
        self._phase = "forward"
        self._peak: tuple[int, str, dict[str, int], tuple] = (-1, "forward", dict(self._cur), ())
        self._phase_peaks: dict[str, tuple[int, dict[str, int], tuple, tuple[Any, int]]] = {}
        self._phase_ops: dict[str, dict[Any, int]] = {p: {} for p in PHASES}
        # moment = (operator, k): right after the k-th call of that operator in the phase
        self._moment: dict[str, tuple[Any, int]] = dict.fromkeys(PHASES, ("start", 0))
        for phase, moment in (pin or {}).items():
            if phase not in PHASES or not isinstance(moment, str):
                raise ValueError(f"pin={pin!r} must map phases {PHASES} to moments such as 'aten.mm.default#3'")
        self._pin = dict(pin or {})
        self._pinned: dict[str, tuple[dict[str, int], tuple]] = {}
        self._aliasing: dict[Any, bool] = {}
        self._handles: list[Any] = []
        self._orig_resize: Any = None
        self._fake_on_entry: Any = None
        self._active = False
        self.n_ops = 0
        # Frees reported on another thread (gloo's worker dropping a finished collective's buffers): queued,
        # applied by the tracker's own thread at its next operation (no counter is updated from two threads)
        self._owner: int | None = None
        self._deferred: deque[tuple[int, weakref.ref]] = deque()
        self._view: _StepView | None = None  # under torch.distributed only (its threads release late)
        self._late = False

    # ----------------------------------------------------------------------------------- control
    @property
    def phase(self) -> str:
        """The phase set by :meth:`set_phase` (backward is also detected inside the autograd engine)."""
        return self._phase

    def set_phase(self, phase: str) -> None:
        """Mark the start of ``phase`` (``"forward"``, ``"backward"`` or ``"optimizer"``)."""
        if phase not in PHASES:
            raise ValueError(f"phase={phase!r} must be one of {PHASES}")
        self._phase = phase
        self._fresh.clear()
        self._start_moment(phase)

    def reset_peaks(self) -> None:
        """Forget the peaks so far (call at the start of each measured step); live storages stay.

        Moments count from here: every phase's operator counts restart, and the phase in progress is at
        its ``"start"``, so a moment named after the measured step never points into the step before.
        """
        self._peak = (-1, self._phase, dict(self._cur), ())
        if self._view is not None:
            self._view, self._late = _StepView(), False
        self._phase_peaks.clear()
        self._pinned.clear()
        for phase in PHASES:
            self._phase_ops[phase] = {}
            self._moment[phase] = ("start", 0)
        self._start_moment(self._phase)

    def _start_moment(self, phase: str) -> None:
        # The "start" moment of a phase: a peak there is named "start", so a pin on it is taken here
        # (no operator runs at this moment, so __torch_dispatch__ never sees it).
        self._phase_ops[phase] = {}
        self._moment[phase] = ("start", 0)
        self._check_peak(phase)
        if self._pin.get(phase) == "start":
            self._pinned[phase] = self._snapshot()

    def track(self, obj: Any, component: str = "other") -> None:
        """Register tensors created outside the tracker (a batch, a master copy, a comm bucket).

        ``obj`` may be a tensor, a module (its parameters, grads and buffers), an optimizer (its states)
        or a (nested) list/tuple/dict of those; ``component`` applies to plain tensors.
        """
        if component not in COMPONENTS:
            raise ValueError(f"component={component!r} must be one of {COMPONENTS}")
        if isinstance(obj, torch.Tensor):
            self._classify_existing(obj, component)
        elif isinstance(obj, nn.Module):
            self._register_module(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            self._register_optimizer_states(obj)
        elif isinstance(obj, dict):
            for value in obj.values():
                self.track(value, component)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                self.track(value, component)

    def track_copy(self, module: nn.Module, component: str = "averaged") -> None:
        """Register a copy of the weights the run keeps beside the trained module (a weight-averaging copy):
        every parameter and buffer of ``module`` counts as ``component``, from now until it is freed."""
        if component not in COMPONENTS:
            raise ValueError(f"component={component!r} must be one of {COMPONENTS}")
        for t in (*module.parameters(), *module.buffers()):
            self._classify_existing(t, component)

    def hold(self, nbytes: int, component: str = "comm") -> None:
        """Count ``nbytes`` as live in ``component`` from now until the tracker stops: storages no tensor
        reachable from Python holds (DDP's gradient buckets, which its C++ ``Reducer`` owns), registered by
        size because :meth:`track` cannot reach them.

        Raises:
            ValueError: an unknown component or a negative size.
        """
        if component not in COMPONENTS:
            raise ValueError(f"component={component!r} must be one of {COMPONENTS}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes={nbytes!r} must be a non-negative int of bytes")
        self._cur[component] += nbytes
        self._total += nbytes
        if self._active:
            self._check_peak(self._effective_phase())

    def report(self) -> TrackerReport:
        """Bytes per component at the overall peak and at each phase's peak so far."""
        for opt in self.optimizers:
            self._register_optimizer_states(opt)
        for p in self._params():
            if p.grad is not None:
                self._classify_existing(p.grad, "grads")
        self._drain()
        total, phase, comps, fresh = self._peak
        return TrackerReport(  # a weight-averaging copy ("averaged") only where it held bytes
            peak=trim_optional(self._resolve(comps, fresh)),
            peak_phase=phase,
            by_phase={p: trim_optional(self._resolve(c, f)) for p, (_, c, f, _) in self._phase_peaks.items()},
            peak_ops={p: _moment_name(k) for p, (_, _, _, k) in self._phase_peaks.items()},
            pinned={p: trim_optional(self._resolve(c, f)) for p, (c, f) in self._pinned.items()},
            current=trim_optional(self._cur),
            released_late=self._released_late(),
            n_ops=self.n_ops,
            device=self.device_type or "any",
            timeline=self._timeline.timeline(self.n_ops) if self._timeline is not None else None,
        )

    @property
    def live_bytes(self) -> int:
        """Bytes of all storages alive now."""
        return self._total

    def start(self) -> TensorTracker:
        """Enter the tracker without a ``with`` block (pair with :meth:`stop`)."""
        return self.__enter__()

    def stop(self) -> None:
        self.__exit__(None, None, None)

    # ------------------------------------------------------------------------------- enter / exit
    def __enter__(self) -> TensorTracker:
        if self._active:
            raise RuntimeError("this TensorTracker is already active; create a second tracker instead")
        self._active = True
        self._owner = threading.get_ident()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self._view = _StepView()
        self._fake_on_entry = _fake_mode()
        if self.module is not None:
            self._register_module(self.module)
        for opt in self.optimizers:
            self._register_optimizer_states(opt)
        for p in self._params():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        from torch.optim.optimizer import register_optimizer_step_post_hook

        # States of any optimizer stepped inside the tracker are classified after its step. (Not a
        # phase marker: Lightning's ``optimizer.step(closure)`` runs forward and backward inside it.)
        self._handles.append(register_optimizer_step_post_hook(self._on_step_post))
        self._patch_resize()
        self._check_peak(self._phase)
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        try:
            super().__exit__(*args)
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            if self._orig_resize is not None:
                torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
                self._orig_resize = None
            self._active = False

    def _patch_resize(self) -> None:
        # ``UntypedStorage.resize_`` (FSDP2 frees/re-allocates unsharded parameters with it) bypasses the
        # dispatcher, so, like MemTracker, wrap it while the tracker is active.
        orig = torch.UntypedStorage.resize_
        self._orig_resize = orig

        @functools.wraps(orig)
        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = orig(st, size)
            entry = self._live.get(id(st))
            if entry is not None and entry[0]() is st and entry[1].nbytes != st.nbytes():
                info = entry[1]
                delta = st.nbytes() - info.nbytes
                info.nbytes += delta
                self._cur[info.component] += delta
                self._total += delta
                self._check_peak(self._effective_phase())
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]

    # ----------------------------------------------------------------------------- registration
    def _params(self) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}
        if self.module is not None:
            for p in self.module.parameters():
                seen[id(p)] = p
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    seen[id(p)] = p
        return list(seen.values())

    def _register_module(self, module: nn.Module) -> None:
        for p in module.parameters():
            self._classify_existing(p, "params")
            for constant in quantization_constants(p):  # bitsandbytes' absmaxes, codes, row scales
                self._classify_existing(constant, "params")
            if p.grad is not None:
                self._classify_existing(p.grad, "grads")
        for sub in module.modules():  # a layer whose weight FSDP2 replaced keeps the QuantState itself
            if getattr(getattr(sub, "weight", None), "quant_state", None) is None:
                for constant in quantization_constants(sub):
                    self._classify_existing(constant, "params")
        for b in module.buffers():
            self._classify_existing(b, "other")
        for sub in module.modules():  # an AveragedModel kept as a submodule: its weights are a copy
            if isinstance(sub, AveragedModel) and sub is not module:
                self.track_copy(sub)
        self._register_fsdp2_buffers(module)

    def _register_fsdp2_buffers(self, module: nn.Module) -> None:
        # FSDP2 holds storages that ``module.parameters()`` does not reach (torch 2.13
        # ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``, ``FSDPParam``): the unsharded buffers
        # (``all_gather_outputs``, which ``_unsharded_param`` views; freed and re-grown with
        # ``UntypedStorage.resize_``, kept even on a shard group of size 1: ``FSDPParamGroup.
        # wait_for_unshard``) and the unsharded gradients a ``set_requires_gradient_sync(False)``
        # backward leaves for the next micro-batch (``_unsharded_param.grad``,
        # ``unsharded_accumulated_grad``). A tracker entered between two micro-batches, or whose
        # resize_ hook must see a buffer re-grow, registers them here: buffers as comm (size 0 while
        # resharded), gradients as grads.
        try:
            from torch.distributed.fsdp import FSDPModule
        except ImportError:  # torch built without distributed
            return
        for mod in module.modules():
            if not isinstance(mod, FSDPModule):
                continue
            group = getattr(mod._get_fsdp_state(), "_fsdp_param_group", None)
            for fsdp_param in getattr(group, "fsdp_params", ()):
                sharded = getattr(fsdp_param, "sharded_param", None)
                if isinstance(sharded, torch.Tensor):  # module.parameters() may be the unsharded ones
                    self._classify_existing(sharded, "params")
                for out in getattr(fsdp_param, "all_gather_outputs", ()):
                    self._classify_existing(out, "comm")
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                for grad in (getattr(unsharded, "grad", None), getattr(fsdp_param, "unsharded_accumulated_grad", None)):
                    if isinstance(grad, torch.Tensor):
                        self._classify_existing(grad, "grads")

    def _register_optimizer_states(self, opt: torch.optim.Optimizer) -> None:
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self._classify_existing(value, "optimizer")

    def _on_grad(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self._classify_existing(param.grad, "grads")

    def _on_step_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._register_optimizer_states(opt)

    def _classify_existing(self, t: torch.Tensor, component: str) -> None:
        if not self._counted(t):
            return
        for st in _storages(t):
            entry = self._live.get(id(st))
            if entry is not None and entry[0]() is st:
                info = entry[1]
                if info.component != component:
                    self._cur[info.component] -= info.nbytes
                    self._cur[component] += info.nbytes
                    info.component = component
            else:
                self._add(st, component, fresh=False)

    def _counted(self, t: torch.Tensor) -> bool:
        return self.device_type is None or t.device.type == self.device_type

    def _add(self, st: torch.UntypedStorage, component: str, *, fresh: bool) -> None:
        key = id(st)
        old = self._live.get(key)
        if old is not None and old[0]() is None:  # a storage freed on another thread, its id reused already
            self._release(key, old)
        info = _Info(st.nbytes(), component, self.n_ops)
        ref = weakref.ref(st, functools.partial(self._on_free, key))
        self._live[key] = (ref, info)
        self._cur[component] += info.nbytes
        self._total += info.nbytes
        if fresh:
            self._fresh[key] = info

    def _on_free(self, key: int, ref: weakref.ref) -> None:
        if self._owner is not None and threading.get_ident() != self._owner:
            self._deferred.append((key, ref))  # applied by the tracker's thread (_drain)
            return
        entry = self._live.get(key)
        if entry is None or entry[0] is not ref:
            return
        self._release(key, entry)

    def _release(self, key: int, entry: tuple[weakref.ref, _Info]) -> None:
        del self._live[key]
        info = entry[1]
        self._fresh.pop(key, None)
        self._cur[info.component] -= info.nbytes
        self._total -= info.nbytes

    def _drain(self) -> None:
        """Apply the frees another thread reported, on the tracker's thread; each is recorded as released
        late (:meth:`_released_late`)."""
        while self._deferred:
            key, ref = self._deferred.popleft()
            entry = self._live.get(key)
            if entry is None or entry[0] is not ref:
                continue
            if self._view is not None:
                self._view.release(entry[1].last, self.n_ops, entry[1].nbytes)
                self._late = True
            self._release(key, entry)

    def _released_late(self) -> int:
        """How much of the overall peak is storages the step no longer used, released late by another
        thread: the peak minus the step's peak with each such storage counted only up to its last use as an
        operation's input or output (:class:`_StepView`; a storage the step held longer without using it
        is named too, so this is never less than what the late releases added). Under gloo that is a finished collective's buffers: its worker thread keeps
        them (its ``Work`` holds them) after ``wait()`` has returned, until the scheduler lets it take the
        GIL to drop them, so how long depends on the machine's load, not on the step."""
        if self._view is None or not self._late:
            return 0
        return max(0, self._peak[0] - self._view.peak())

    # ---------------------------------------------------------------------------------- dispatch
    def _effective_phase(self) -> str:
        if self._phase != "optimizer" and torch._C._current_graph_task_id() != -1:
            return "backward"
        return self._phase

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _DTENSOR is not None and any(t is _DTENSOR for t in types):
            # Let DTensor desugar into local ops first, then track those (as MemTracker does).
            return NotImplemented
        if self._deferred:
            self._drain()
        out = func(*args, **(kwargs or {}))
        if _fake_mode() is not self._fake_on_entry:
            # Shape propagation inside a nested fake mode (DTensor) allocates nothing real.
            return out
        self.n_ops += 1
        phase = self._effective_phase()
        counts = self._phase_ops[phase]
        counts[func] = counts.get(func, 0) + 1
        self._moment[phase] = (func, counts[func])
        aliasing = self._aliasing.get(func)
        if aliasing is None:
            aliasing = any(r.alias_info is not None for r in func._schema.returns)
            self._aliasing[func] = aliasing
        for t in _flat_tensors(out):
            if not self._counted(t):
                continue
            for st in _storages(t):
                entry = self._live.get(id(st))
                if entry is not None and entry[0]() is st:
                    info = entry[1]
                    info.last = self.n_ops
                    nbytes = st.nbytes()
                    if nbytes != info.nbytes:  # e.g. an out= op resized its output
                        self._cur[info.component] += nbytes - info.nbytes
                        self._total += nbytes - info.nbytes
                        info.nbytes = nbytes
                    continue
                if aliasing:
                    # A view or in-place result whose storage the tracker has not seen: created before it
                    # started (the batch) or outside the dispatcher (``torch.tensor(0.0)`` lifted by
                    # ``lift_fresh``, as Adam's step counters are).
                    self._add(st, "other", fresh=phase != "forward")
                else:
                    component = self._classify_new(t, func, args, phase)
                    self._add(st, component, fresh=phase != "forward")
        if self._view is not None:
            self._touch(args, kwargs)
        self._check_peak(phase)
        if self._timeline is not None:
            self._timeline.sample(self.n_ops, phase, self._total, self._cur.values())
        if self._pin and self._pin.get(phase) == _moment_name(self._moment[phase]):
            self._pinned[phase] = self._snapshot()
        return out

    def _touch(self, args: Any, kwargs: Any) -> None:
        """The operation's inputs were used now (:attr:`_Info.last`): a storage another thread releases late
        counts in the step's own view up to its last use as an input or an output (:class:`_StepView`)."""
        for t in (*_flat_tensors(args), *_flat_tensors(list((kwargs or {}).values()))):
            if not self._counted(t):
                continue
            for st in _storages(t):
                entry = self._live.get(id(st))
                if entry is not None and entry[0]() is st:
                    entry[1].last = self.n_ops

    def _classify_new(self, t: torch.Tensor, func: Any, args: Any, phase: str) -> str:
        if func in _COPY_OPS and args and isinstance(args[0], torch.Tensor):
            src = self._live.get(id(args[0].untyped_storage()))
            if src is not None:
                if src[1].component == "params":
                    return "other"  # a low-precision copy of a weight (autocast)
                if src[1].component in _INHERITED:
                    return src[1].component
        shape = t.shape
        s = self.seq_len
        if (
            s is not None
            and (len(shape) >= 4 or (len(shape) == 2 and t.dtype == torch.bool))
            and shape[-1] == s
            and shape[-2] == s
        ):
            return "attention"
        if self.vocab_size is not None and len(shape) >= 2 and shape[-1] == self.vocab_size:
            return "logits"
        return "activations" if phase == "forward" else "workspace"

    # ------------------------------------------------------------------------------------- peaks
    def _check_peak(self, phase: str) -> None:
        total = self._total
        if self._view is not None:
            self._view.note(self.n_ops, total)
        current = self._phase_peaks.get(phase)
        new_phase_peak = current is None or total > current[0]
        new_peak = total > self._peak[0]
        if not (new_phase_peak or new_peak):
            return
        comps, fresh = self._snapshot()
        if new_phase_peak:
            self._phase_peaks[phase] = (total, comps, fresh, self._moment[phase])
        if new_peak:
            self._peak = (total, phase, comps, fresh)

    def _snapshot(self) -> tuple[dict[str, int], tuple]:
        fresh = tuple((info, info.component, info.nbytes) for info in self._fresh.values()) if self._fresh else ()
        return dict(self._cur), fresh

    @staticmethod
    def _resolve(comps: dict[str, int], fresh: tuple) -> dict[str, int]:
        out = dict(comps)
        for info, component, nbytes in fresh:
            if info.component != component and info.component in _FINAL_COMPONENTS:
                out[component] -= nbytes
                out[info.component] += nbytes
        return out
