"""Traced estimate: run one real training step of the user's module under fake tensors and measure it.

:func:`trace_memory` copies the module into a ``FakeTensorMode`` (``FakeCopyMode``: no real allocation;
shapes, dtypes and the autograd graph are real), runs forward + loss, ``zero_grad``, backward and the
optimizer step exactly as Lightning orders them (:func:`~lightning_memplan.tracking.step.run_training_step`)
with the precision plugin emulated, and measures live storages per component with
:class:`~lightning_memplan.tracking.tracker.TensorTracker`. Two steps by default, so the optimizer states
exist and the previous gradients are alive in the measured step's forward (the steady state).

:func:`calibrate` traces a few batch shapes and fits, per phase and per batch-dependent component,
``bytes = c0 + c1 * (b*s) + c2 * (b*s^2)`` (a :class:`~lightning_memplan.model.result.Calibration`).

Importing this module imports no Lightning; a LightningModule is recognised by its ``training_step``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_memplan.model.result import COMPONENTS, Calibration, MemoryEstimate
from lightning_memplan.tracking.fake_fidelity import (
    fake_scalars,
    real_kernel_sizes,
    real_step_branches,
)
from lightning_memplan.tracking.fake_params import fake_parameter_memo, holds_quantized_parameters
from lightning_memplan.tracking.isolation import preserved_run_state
from lightning_memplan.tracking.report import TrackerReport
from lightning_memplan.tracking.step import PrecisionEmulation, run_training_step
from lightning_memplan.tracking.trace_batch import (
    TraceBatches,
    batch_source,
    copy_module,
    map_tensors,
    move_module,
    token_batch,
    vocab_of,
)
from lightning_memplan.tracking.tracker import TensorTracker
from lightning_memplan.validation import check_bool, check_int, check_optional_int

__all__ = ["TraceResult", "calibrate", "default_loss", "make_optimizer", "trace_memory"]

_OPTIMIZER_IMPLS = (None, "foreach", "for_loop", "fused")
_OPTIMIZER_NAMES = ("adamw", "adam", "sgd", "sgd_momentum")


@dataclass(frozen=True, kw_only=True)
class TraceResult:
    """Measured bytes of one traced training step.

    Attributes:
        estimate: the measurement as a :class:`MemoryEstimate` (``source="traced"``): components at the
            overall peak, ``peak_phase`` and ``by_phase``.
        report: the tracker's full :class:`TrackerReport` (also the live bytes after the step).
        micro_batch: b of the traced batch (its first dimension).
        seq_len: s of the traced batch (``None`` when the input has no sequence dimension).
        precision: the Lightning precision string emulated.
        mode: ``"fake"`` (fake tensors, nothing allocated) or ``"real"`` (a real CPU step).
        fallback_reason: why a fake trace fell back to a real step (``None`` when it did not).
        n_params: parameters of the module (a shared parameter counted once).
        steps: training steps run (the last one is measured).
    """

    estimate: MemoryEstimate
    report: TrackerReport
    micro_batch: int
    seq_len: int | None
    precision: str
    mode: str
    fallback_reason: str | None = None
    n_params: int = 0
    steps: int = 2

    @property
    def total(self) -> int:
        """Peak live tensor bytes of the measured step."""
        return self.estimate.total

    @property
    def peak_phase(self) -> str:
        return self.estimate.peak_phase

    @property
    def by_phase(self) -> Mapping[str, Mapping[str, int]]:
        return self.estimate.by_phase

    def components(self) -> dict[str, int]:
        """``{component: bytes}`` at the peak."""
        return self.estimate.components()

    def phase_total(self, phase: str) -> int:
        return self.estimate.phase_total(phase)


def make_optimizer(
    optimizer: str | Callable[[Any], torch.optim.Optimizer],
    params: Any,
    *,
    optimizer_impl: str | None = None,
) -> torch.optim.Optimizer:
    """An optimizer from a TrainSpec-style name (``"adamw"``, ``"adam"``, ``"sgd"``, ``"sgd_momentum"``)
    or a factory ``params -> Optimizer``; ``optimizer_impl`` ``"foreach"``/``"for_loop"``/``"fused"``
    selects the kernel (``None``: PyTorch's default for the device: for-loop on CPU, foreach on CUDA)."""
    if optimizer_impl not in _OPTIMIZER_IMPLS:
        raise ValueError(f"optimizer_impl={optimizer_impl!r} must be one of {_OPTIMIZER_IMPLS}")
    if callable(optimizer):
        return optimizer(params)
    impl: dict[str, Any] = {}
    if optimizer_impl == "foreach":
        impl = {"foreach": True}
    elif optimizer_impl == "for_loop":
        impl = {"foreach": False}
    elif optimizer_impl == "fused":
        impl = {"fused": True}
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, **impl)
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=1e-3, **impl)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=1e-3, **impl)
    if optimizer == "sgd_momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, **impl)
    raise ValueError(
        f"optimizer={optimizer!r} is not traceable by name; use 'adamw', 'adam', 'sgd', 'sgd_momentum' or pass "
        "a factory such as `lambda params: bitsandbytes.optim.AdamW8bit(params)`"
    )


def default_loss(module: nn.Module, batch: Any) -> torch.Tensor:
    """The loss :func:`trace_memory` uses when none is given.

    - a LightningModule (has ``training_step`` and ``configure_optimizers``): ``training_step(batch, 0)``;
    - ``(x, y)``: ``module(x)`` (through ``module.logits`` when it has one, like the zoo's GPT; a Hugging
      Face output's ``.loss`` or ``.logits``), then ``F.cross_entropy`` for integer ``y``, else MSE;
    - an integer ``x`` alone (token ids): cross-entropy of the output against ``x`` (a next-token loss
      with the same memory); any other ``x``: the mean of the output.
    """
    if hasattr(module, "training_step") and hasattr(module, "configure_optimizers"):
        with warnings.catch_warnings():
            # The traced copy is not attached to a Trainer, so its self.log() calls only warn; say nothing.
            warnings.filterwarnings("ignore", message=r".*self\.trainer. reference is not registered.*")
            return getattr(module, "training_step")(batch, 0)  # noqa: B009 - nn.Module attributes type as Tensor
    x, y = (batch[0], batch[1]) if isinstance(batch, (tuple, list)) and len(batch) == 2 else (batch, None)
    out = module(**x) if isinstance(x, Mapping) else module(x)
    if getattr(out, "loss", None) is not None:
        return out.loss
    if isinstance(out, Mapping) and out.get("loss") is not None:
        return out["loss"]
    if getattr(out, "logits", None) is not None and isinstance(out.logits, torch.Tensor):
        out = out.logits
    elif callable(getattr(module, "logits", None)):
        out = getattr(module, "logits")(out)  # noqa: B009
    if y is None and isinstance(x, torch.Tensor) and not x.is_floating_point() and out.shape[:-1] == x.shape:
        y = x
    if y is not None and not y.is_floating_point():
        return F.cross_entropy(out.flatten(0, -2), y.flatten())
    if y is not None:
        return F.mse_loss(out, y)
    return out.mean()


#: Most training steps :func:`trace_memory` runs (the last is measured; 2 reach the steady state).
MAX_TRACE_STEPS = 64
#: Largest micro-batch or sequence length a traced batch may have: 2^31 - 1, the int32 index range of
#: the kernels (fake tensors would take more, the real fallback step could not).
MAX_TRACE_DIM = 2**31 - 1
#: Most shapes :func:`calibrate` traces (each is one trace; 2 or 3 separate the terms).
MAX_CALIBRATION_SHAPES = 16


def _check_shape(name: str, value: Any, module: Any) -> tuple[int, int]:
    """``value`` as a ``(micro_batch, seq_len)`` pair of plain positive ints; the error names ``name``,
    shows the value and says what shape ``module`` is traced with."""
    pair = tuple(value) if isinstance(value, (tuple, list)) else None
    if pair is None or len(pair) != 2:
        example = ("; a module without an nn.Embedding (such as "
                   f"{type(module).__name__}) takes example_input= (e.g. a [batch, features] tensor) or "
                   "input_fn=(b, s) -> batch") if vocab_of(module) is None else ""
        raise ValueError(
            f"{name}={value!r:.80} must be a pair (micro_batch, seq_len) of positive ints, e.g. {name}=(8, 2048): "
            f"it builds [micro_batch, seq_len] token ids{example}"
        )
    hint = f"{name} is (micro_batch, seq_len), each in [1, {MAX_TRACE_DIM}]"
    return (check_int(f"{name}[0] (micro_batch)", pair[0], maximum=MAX_TRACE_DIM, hint=hint),
            check_int(f"{name}[1] (seq_len)", pair[1], maximum=MAX_TRACE_DIM, hint=hint))


def _check_callable(name: str, value: Any, what: str) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{name}={value!r:.80} must be a callable {what} or None")


def _run(
    module: nn.Module,
    make_batch: Callable[[], Any],
    *,
    loss_fn: Callable[[nn.Module, Any], Any],
    optimizer: Any,
    optimizer_impl: str | None,
    precision: PrecisionEmulation,
    steps: int,
    seq_len: int | None,
    vocab_size: int | None,
    fake: bool,
    pin: Mapping[str, str] | None,
    device: torch.device,
    grads_alive_in_forward: bool = True,
) -> TrackerReport:
    # ``module`` is already the caller's private copy (fake or real)
    model = precision.convert_module(move_module(module, device))
    model.train()
    made: Any = make_optimizer(optimizer, model.parameters(), optimizer_impl=optimizer_impl)
    # a factory may make several (a manually optimised module steps each in its training_step): the first is
    # the one the trace's own zero_grad/step use, every one's states are tracked
    optimizers = list(made) if isinstance(made, (list, tuple)) else [made]
    opt = optimizers[0]
    batch = precision.convert_input(map_tensors(make_batch(), lambda t: t.to(device)))
    scaler = precision.make_scaler(fake=fake)
    # The steps before the measured one run without the tracker (its dispatch mode costs every operator a
    # Python call: 40 % of a small model's real calibration): what they leave (optimizer states, gradients,
    # buffers) is registered when it starts, as the callback's tracker finds a running fit's.
    for _ in range(steps - 1):
        run_training_step(model, batch, loss_fn, opt, precision=precision, scaler=scaler,
                          grads_alive_in_forward=grads_alive_in_forward)
    tracker = TensorTracker(model, optimizers, seq_len=seq_len, vocab_size=vocab_size, device=device, pin=pin)
    with tracker:
        tracker.track(batch, "other")
        tracker.reset_peaks()
        run_training_step(
            model, batch, loss_fn, opt, precision=precision, scaler=scaler, on_phase=tracker.set_phase,
            grads_alive_in_forward=grads_alive_in_forward,
        )
    return tracker.report()


def _check_device(device: Any) -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device={device!r:.80} must be a device string such as 'cpu' or 'cuda', or a torch.device")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device={device!r:.80} is not a torch device; use 'cpu' or 'cuda'") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={str(device)!r} is not traceable; use 'cpu' or 'cuda'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' needs a CUDA build with a visible GPU to trace its kernels; use device='cpu'")
    return device


def _check_inputs(module: Any, example_input: Any, batch_shape: Any, input_fn: Any, loss_fn: Any,
                  optimizer: Any, optimizer_impl: Any, pin_moments: Any) -> tuple[int, int] | None:
    """The checks of :func:`trace_memory`'s module, batch and callables; the checked ``batch_shape``."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"module={module!r:.80} must be an nn.Module (a LightningModule or any torch module) to trace; "
            "e.g. trace_memory(model, example_input=batch)"
        )
    if (example_input is None) == (batch_shape is None):
        raise ValueError(
            "pass exactly one of example_input= (a batch) or batch_shape=(micro_batch, seq_len); got "
            f"example_input={'set' if example_input is not None else None}, batch_shape={batch_shape!r:.80}"
        )
    _check_callable("input_fn", input_fn, "(b, s) -> batch")
    _check_callable("loss_fn", loss_fn, "(module, batch) -> loss")
    if not isinstance(optimizer, str) and not callable(optimizer):
        raise TypeError(f"optimizer={optimizer!r:.80} must be a name such as 'adamw' or a factory params -> Optimizer")
    if pin_moments is not None and not isinstance(pin_moments, Mapping):
        raise TypeError(f"pin_moments={pin_moments!r:.80} must be a dict {{phase: '<operator>#<k>'}} or None")
    if isinstance(optimizer, str) and optimizer not in _OPTIMIZER_NAMES:
        make_optimizer(optimizer, [], optimizer_impl=optimizer_impl)  # raises the explanatory ValueError
    if optimizer_impl not in _OPTIMIZER_IMPLS:
        raise ValueError(f"optimizer_impl={optimizer_impl!r} must be one of {_OPTIMIZER_IMPLS}")
    if batch_shape is None:
        return None
    checked = _check_shape("batch_shape", batch_shape, module)
    if input_fn is None and vocab_of(module) is None:
        token_batch(module, *checked)  # raises: nothing to draw token ids from
    return checked


def _check_options(steps: Any, grads_alive_in_forward: Any, fake: Any, seq_len: Any,
                   vocab_size: Any) -> tuple[int, bool, bool, int | None, int | None]:
    """:func:`trace_memory`'s numbers and flags as plain Python values (the errors name each)."""
    return (
        check_int("steps", steps, maximum=MAX_TRACE_STEPS, hint=f"training steps to run, the last measured: 2 reach "
                  f"the steady state (at most {MAX_TRACE_STEPS})"),
        check_bool("grads_alive_in_forward", grads_alive_in_forward,
                   hint="True is Lightning's order, False a loop that zeroes gradients before the forward"),
        check_bool("fake", fake, hint="True traces under FakeTensorMode, False runs a real CPU step"),
        check_optional_int("seq_len", seq_len, hint="tokens per sequence, or None to infer it"),
        check_optional_int("vocab_size", vocab_size, hint="the vocabulary, or None to infer it"),
    )


def _fake_report(module: nn.Module, batches: TraceBatches, device: torch.device,
                 run_kwargs: dict[str, Any]) -> tuple[TrackerReport | None, str | None]:
    """The fake-tensor step's report, or ``(None, why it failed)``."""
    from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    try:
        with FakeCopyMode(fake_mode), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
            fake_module = copy_module(module, fake_parameter_memo(module, fake_mode))  # bitsandbytes' params
        # real_step_branches: library code that branches on "is this a FakeTensor" (or on a mask's values)
        # takes the real step's branch; real_kernel_sizes: kernels whose fake outputs are sized otherwise
        # (tracking/fake_fidelity.py: Mamba's scan, transformers' SDPA masks, oneDNN's LSTM workspace);
        # fake_scalars: a value read for logging (float(loss)) is 0, not DataDependentOutputException
        with fake_mode, real_step_branches(batches.padding), real_kernel_sizes(), fake_scalars():
            fake_batch = batches.fake(fake_mode)  # inside the mode: a factory's tensors are made fake
            report = _run(fake_module, lambda: fake_batch, fake=True, device=device, **run_kwargs)
        return report, None
    except Exception as err:  # noqa: BLE001 - any fake-mode failure falls back to a real step
        reason = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        warnings.warn(
            f"trace_memory: the fake-tensor step failed ({reason}); measuring a real CPU step instead",
            RuntimeWarning,
            stacklevel=3,
        )
        return None, reason


def _real_report(module: nn.Module, batches: TraceBatches, reason: str | None,
                 run_kwargs: dict[str, Any]) -> TrackerReport:
    """A real CPU step of a private copy of ``module`` (the user's module is never stepped)."""
    if any(p.is_meta for p in module.parameters()):
        raise ValueError(
            "module has parameters on the meta device, so a real step cannot run"
            + (f" (the fake trace failed: {reason})" if reason else "; use fake=True")
        )
    cpu_module = copy_module(module).to("cpu")
    return _run(cpu_module, batches.real, fake=False, device=torch.device("cpu"), **run_kwargs)


def trace_memory(
    module: nn.Module,
    example_input: Any = None,
    *,
    batch_shape: tuple[int, int] | None = None,
    input_fn: Callable[[int, int], Any] | None = None,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
    optimizer: str | Callable[[Any], torch.optim.Optimizer] = "adamw",
    optimizer_impl: str | None = None,
    precision: str = "32-true",
    steps: int = 2,
    fake: bool = True,
    seq_len: int | None = None,
    vocab_size: int | None = None,
    pin_moments: Mapping[str, str] | None = None,
    device: str | torch.device = "cpu",
    grads_alive_in_forward: bool = True,
) -> TraceResult:
    """Measure one training step of ``module`` per memory component, under fake tensors by default.

    Args:
        module: any ``nn.Module`` (a LightningModule runs its ``training_step``); it is copied, never
            modified or stepped, and the global random states (CPU, CUDA, Python, NumPy) are as they were
            after the call (:func:`~lightning_memplan.tracking.isolation.preserved_run_state`).
        example_input: a batch (tensor, tuple, list or dict of tensors) as the loss function takes it.
        batch_shape: ``(b, s)`` instead of ``example_input``: random token ids ``[b, s]`` from the
            module's largest ``nn.Embedding`` (or ``input_fn(b, s)`` when given). Made directly as fake
            tensors, so a batch that would not fit anywhere can be traced.
        input_fn: ``(b, s) -> batch`` used with ``batch_shape`` (its ``padding_at(b, s)``, when it has one,
            says which attention masks hold padding, as ``live.batch_factory`` answers for a real batch resized).
        loss_fn: ``(module, batch) -> scalar loss`` (or a dict with ``"loss"``); default
            :func:`default_loss`.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"``, ``"sgd_momentum"`` or a factory ``params -> Optimizer``
            (or ``params -> [Optimizer, ...]`` for a module whose ``training_step`` steps several: the first
            is the one the trace zeroes and steps after it, every one's states are tracked).
        optimizer_impl: ``None`` (PyTorch's default for the device), ``"foreach"``, ``"for_loop"``, ``"fused"``.
        precision: Lightning precision string, emulated as Lightning's precision plugins do
            (:class:`~lightning_memplan.tracking.step.PrecisionEmulation`).
        steps: training steps to run; the last is measured (2: optimizer states exist, steady state), those
            before it without the tracker (what they leave is registered when it starts).
        fake: trace under ``FakeTensorMode`` (no allocation); if the fake run fails (an operator without a
            fake kernel, a data-dependent shape), a real CPU step runs instead and
            :attr:`TraceResult.fallback_reason` says why. ``False`` always runs a real CPU step.
        seq_len, vocab_size: hints for the ``attention`` / ``logits`` classification (default: from the
            batch shape or a 2-d integer input, and the largest ``nn.Embedding``).
        pin_moments: ``{phase: "<operator>#<k>"}``: also report the components at that moment of each
            phase (``result.report.pinned``); :func:`calibrate` uses it to compare shapes at one moment.
        device: the device the fake step pretends to run on (``"cpu"``, or ``"cuda"`` with a GPU: CUDA's
            autocast lists, attention kernels and foreach optimizer, nothing allocated); a real step is CPU.
        grads_alive_in_forward: ``True`` (Lightning's order: the previous step's gradients are alive in
            the forward) or ``False`` (``zero_grad(set_to_none=True)`` before the forward), as ``TrainSpec``.

    Raises:
        ValueError: neither or both of ``example_input`` and ``batch_shape``; non-positive sizes or ``steps``;
            an unknown precision or optimizer.
    """
    batch_shape = _check_inputs(module, example_input, batch_shape, input_fn, loss_fn, optimizer, optimizer_impl,
                                pin_moments)
    steps, grads_alive_in_forward, fake, seq_len, vocab_size = _check_options(steps, grads_alive_in_forward, fake,
                                                                              seq_len, vocab_size)
    device = _check_device(device)
    emulation = PrecisionEmulation(precision=precision, device_type=device.type)
    batches = batch_source(module, example_input, batch_shape, input_fn)
    seq_len = seq_len if seq_len is not None else batches.seq
    run_kwargs: dict[str, Any] = dict(
        loss_fn=loss_fn or default_loss, optimizer=optimizer, optimizer_impl=optimizer_impl, precision=emulation,
        steps=steps, seq_len=seq_len, vocab_size=vocab_size if vocab_size is not None else vocab_of(module),
        pin=pin_moments, grads_alive_in_forward=grads_alive_in_forward)
    with preserved_run_state(module):
        report, reason = _fake_report(module, batches, device, run_kwargs) if fake else (None, None)
        mode = "fake" if report is not None else "real"
        if report is None:
            if device.type != "cpu":
                run_kwargs["precision"] = emulation = PrecisionEmulation(precision=precision, device_type="cpu")
            report = _real_report(module, batches, reason, run_kwargs)
    return TraceResult(
        estimate=report.to_estimate(source="traced"), report=report, micro_batch=batches.micro_batch,
        seq_len=seq_len, precision=emulation.precision, mode=mode,
        fallback_reason=reason, n_params=sum(p.numel() for p in module.parameters()), steps=steps,
    )


def _third_shape(shapes: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    (b1, s1), (b2, s2) = shapes[0], shapes[1]
    for b, s in ((2 * b1, s1), (2 * b2, s2), (b1, max(1, s1 // 2)), (b2, max(1, s2 // 2))):
        if (b, s) not in shapes and _rank(list(shapes) + [(b, s)], 3) == 3:
            return b, s
    return None


def _design(shapes: Sequence[tuple[int, int]], terms: int) -> torch.Tensor:
    rows = [[1.0, float(b * s), float(b * s * s)][:terms] for b, s in shapes]
    return torch.tensor(rows, dtype=torch.float64)


def _rank(shapes: Sequence[tuple[int, int]], terms: int) -> int:
    x = _design(shapes, terms)
    return int(torch.linalg.matrix_rank(x / x.abs().amax(dim=0).clamp_min(1.0)))


def _check_shapes(module: Any, shapes: Any, quadratic: Any) -> tuple[list[tuple[int, int]], bool | None]:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module={module!r:.80} must be an nn.Module to calibrate; e.g. calibrate(model)")
    if not isinstance(shapes, (tuple, list)) or not 1 <= len(shapes) <= MAX_CALIBRATION_SHAPES:
        raise ValueError(
            f"shapes={shapes!r:.80} must be a list of one to {MAX_CALIBRATION_SHAPES} (micro_batch, seq_len) "
            "pairs (one trace each; two or three separate the terms), e.g. ((1, 64), (2, 128))"
        )
    checked = [_check_shape(f"shapes[{i}]", pair, module) for i, pair in enumerate(shapes)]
    if quadratic is not None:
        quadratic = check_bool("quadratic", quadratic, hint="or None to decide from the attention")
    if len(set(checked)) != len(checked):
        raise ValueError(f"shapes={checked!r} repeats a shape; give distinct (micro_batch, seq_len) pairs")
    return checked, quadratic


def _pinned_tracer(module: nn.Module, reference: tuple[int, int], ref: TraceResult,
                   input_fn: Callable[[int, int], Any] | None,
                   trace_kwargs: Mapping[str, Any]) -> Callable[[tuple[int, int]], Mapping[str, Mapping[str, int]]]:
    """``shape -> {phase: {component: bytes}}`` at the moments where the ``reference`` shape peaks."""
    pin = dict(ref.report.peak_ops)

    def at_moment(shape: tuple[int, int]) -> Mapping[str, Mapping[str, int]]:
        if shape == reference:
            return ref.by_phase
        pinned = trace_memory(module, batch_shape=shape, input_fn=input_fn, pin_moments=pin, **trace_kwargs).report.pinned
        missing = [p for p in pin if p not in pinned]
        if missing:
            raise ValueError(
                f"the step for shape {shape} never reaches the moment(s) {[pin[p] for p in missing]} where "
                f"{reference} peaks in phase(s) {missing}: its op sequence depends on the batch shape, so shapes "
                "cannot be compared at one moment; calibrate with shapes closer to each other"
            )
        return pinned

    return at_moment


def _fit(shapes: Sequence[tuple[int, int]], measured: Sequence[Mapping[str, Mapping[str, int]]],
         phases: Sequence[str], terms: int) -> dict[str, dict[str, tuple[float, float, float]]]:
    """``{phase: {component: (c0, c1, c2)}}``: solved exactly with as many shapes as terms, else by least
    squares (columns scaled first: they span 1 .. b*s^2)."""
    x = _design(shapes, terms)
    scale = x.abs().amax(dim=0).clamp_min(1.0)
    coefficients: dict[str, dict[str, tuple[float, float, float]]] = {}
    for phase in phases:
        coefficients[phase] = {}
        for component in COMPONENTS:
            y = torch.tensor([[float(m[phase].get(component, 0))] for m in measured], dtype=torch.float64)
            if len(shapes) == terms:
                sol = (torch.linalg.solve(x / scale, y).flatten() / scale).tolist()
            else:
                sol = (torch.linalg.lstsq(x / scale, y, driver="gelsd").solution.flatten() / scale).tolist()
            c = (sol + [0.0, 0.0, 0.0])[:3]
            coefficients[phase][component] = (float(c[0]), float(c[1]), float(c[2]))
    return coefficients


def calibrate(
    module: nn.Module,
    shapes: Sequence[tuple[int, int]] = ((1, 64), (2, 128)),
    *,
    input_fn: Callable[[int, int], Any] | None = None,
    quadratic: bool | None = None,
    exact_at: tuple[int, int] | None = None,
    **trace_kwargs: Any,
) -> Calibration:
    """Fit ``bytes = c0 + c1*(b*s) + c2*(b*s^2)`` per phase and component from traced steps.

    Each ``(b, s)`` in ``shapes`` is traced with :func:`trace_memory` (``batch_shape=(b, s)``; pass
    ``input_fn`` for inputs other than token ids; other keywords go to :func:`trace_memory`).

    A phase's peak may fall at different moments for different shapes (for a tiny batch the end of
    backward, when all gradients exist; for a large one its start, when all activations do), and a
    fit across different moments is meaningless. So the largest shape is traced first, and every
    other shape is measured at the *same* moment as the largest one's phase peaks (the k-th call of
    the same operator in the phase; ``pin_moments``), which is the moment that decides memory at scale. Every component
    is fitted (params, grads, optimizer come out constant and say what is live at that moment).

    The b*s^2 term is fitted only when attention is materialised (eager attention): then, with two
    shapes, a third is traced (b doubled or s halved) to separate the three terms. The fit is exact at
    the traced shapes (as many shapes as terms). ``quadratic=False`` forces the two-term fit (an input
    whose sequence length is fixed by the model, such as a vision transformer's patch count, where the
    b*s^2 term cannot be separated); ``True`` forces the three-term fit; ``None`` decides as above.
    One shape is a measurement, not a fit: c0 is its bytes and c1 = c2 = 0, exact at that shape only
    (for a batch none of whose tensors can be resized). ``exact_at``: one of ``shapes`` (the real batch's)
    where the least-squares fit must reproduce each phase's traced peak within
    :data:`EXACT_TOLERANCE`; where it does not, the memory is not a function of b*s (and b*s^2) for this
    batch, and a ``ValueError`` says by how much.

    Raises:
        ValueError: no shape or more than :data:`MAX_CALIBRATION_SHAPES`, a non-positive size, shapes
            that cannot separate the terms (e.g. the same b*s twice), or a fit that misses ``exact_at``.
    """
    shapes, quadratic = _check_shapes(module, shapes, quadratic)
    reference = max(shapes, key=lambda bs: (bs[0] * bs[1] * bs[1], bs[0] * bs[1]))
    ref = trace_memory(module, batch_shape=reference, input_fn=input_fn, **trace_kwargs)
    at_moment = _pinned_tracer(module, reference, ref, input_fn, trace_kwargs)
    measured = [at_moment(shape) for shape in shapes]
    if len(shapes) == 1:
        terms = 1
    else:
        if quadratic is None:  # at s = 1, b*s^2 is b*s (and every [.., 1, 1] tensor looks like scores)
            quadratic = any(s > 1 for _, s in shapes) and any(
                p.get("attention", 0) for m in measured for p in m.values())
        terms = 3 if quadratic else 2
    if terms == 3 and _rank(shapes, 3) < 3:
        third = _third_shape(shapes)
        if third is None:
            raise ValueError(f"shapes={shapes!r} cannot separate the b*s and b*s^2 terms; add a third (b, s)")
        shapes.append(third)
        measured.append(at_moment(third))
    if _rank(shapes, terms) < terms:
        raise ValueError(
            f"shapes={shapes!r} do not separate the fitted terms (need different b*s"
            + (" and b*s^2" if terms == 3 else "") + "); use shapes such as ((1, 64), (2, 128))"
        )
    calibration = Calibration(
        coefficients=_fit(shapes, measured, list(ref.report.peak_ops), terms),
        traced_shapes=tuple(shapes),
        precision=ref.precision,
        n_params=ref.n_params,
        quantized=holds_quantized_parameters(module),
    )
    if exact_at is not None and tuple(exact_at) in shapes:
        _check_exact(calibration, tuple(exact_at), measured[shapes.index(tuple(exact_at))])  # type: ignore[arg-type]
    return calibration


#: Largest miss of a calibration fit at the real batch's shape (``calibrate(exact_at=...)``), a fraction.
EXACT_TOLERANCE = 0.01


def _check_exact(calibration: Calibration, shape: tuple[int, int], measured: Mapping[str, Mapping[str, int]]) -> None:
    for phase, components in measured.items():
        traced = sum(components.get(c, 0) for c in COMPONENTS)
        fitted = sum(calibration.bytes_for(phase, c, *shape) for c in COMPONENTS)
        if traced and abs(fitted / traced - 1) > EXACT_TOLERANCE:
            raise ValueError(
                f"the fit through {list(calibration.traced_shapes)} misses the traced {phase} peak at {shape} by "
                f"{100 * (fitted / traced - 1):+.1f}%: this batch's memory is not a function of b*s, so the shapes "
                "cannot share one fit; calibrate along one axis"
            )
