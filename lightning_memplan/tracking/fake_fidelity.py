"""Code that behaves differently under fake tensors: the maintained list, and the trace's correction.

A fake-tensor trace (``trace_memory``, and the config-only path of ``tracking/hf_calibrate.py``) is only
worth its bytes if the traced step runs the same code as the real one. Some library code asks whether
its input is being *traced* and takes another branch when it is; a ``FakeTensor`` answers yes. Such
checks are listed in :data:`FAKE_SENSITIVE` (module-level functions, found by name in every imported
module of the package) with the real step's answer; :func:`real_step_branches` makes them give that
answer while a fake step runs, and puts them back afterwards.

Known cases (transformers 5.x, ``transformers/utils/import_utils.py::is_tracing``, which is true for a
``FakeTensor`` argument):

- Mamba (v1) ``MambaMixer.slow_forward`` runs ``torch._higher_order_ops.associative_scan`` over the whole
  sequence when ``is_tracing(hidden_states)``, and the sequential per-token loop otherwise (the real CPU
  step without the CUDA kernels): traced unpatched, a 4-block Mamba step reads +34.5% (fp32), +24.1%
  (bf16) of the real one; patched, the traced step is the real one's to the byte.
- ``transformers/masking_utils.py`` (``sdpa_mask``, ``_ignore_causal_mask_sdpa``, packed sequences) keeps or
  skips the ``[b, 1, s, s]`` boolean mask by ``is_tracing(padding_mask)``: under fake tensors it always
  builds it, where the real SDPA step passes ``is_causal=True`` and no mask.
- ``PreTrainedModel.warn_if_padding_and_no_attention_mask`` skips its check when ``is_tracing`` (no bytes).

Methods that read a tensor's *value* where the real step knows it (a fake tensor has none, so the trace
stops with ``DataDependentOutputException``) are listed in :data:`FAKE_METHODS` with the real step's
answer for a training batch (no KV cache, positions from 0):

- Jamba ``JambaModel._update_mamba_mask`` tests ``cache_position[0] > 0``; with ``attention_mask=None``
  it returns ``None`` either way.
- ``transformers/masking_utils.py::find_packed_sequence_indices`` (with :func:`is_tracing` answering as
  for the real step) reads whether ``position_ids`` restart inside a row. The traced batches are one
  sequence per row (positions ``0 .. s-1``, what the model makes when none are passed), for which it
  returns ``None``; a fake step returns ``None`` too (unpatched it returned the all-zero index tensor,
  and the masks were built for packed sequences, as the real step does not).

Functions that read whether an attention mask holds padding (``padding_mask.all()``, a value a fake
tensor does not have: ``DataDependentOutputException``, so BERT, RoBERTa, T5, BART, wav2vec2 or Whisper
with an ``attention_mask`` could not be traced) are answered from the *real* batch, which the tracer reads
before it makes the fake one: :func:`mask_padding` gives ``{(rows, length): padded}`` for the batch's
masks (mapping keys :data:`MASK_KEYS`; in a tuple or list, 2-d integer or bool tensors of 0s and 1s), and
``real_step_branches(padding=...)`` answers a fake mask of that shape with it. A mask of a shape the batch
does not hold was made by the model from shapes alone (an encoder-decoder's decoder mask when the batch
gives none: all ones), so it is answered as unpadded.

- ``transformers/masking_utils.py`` ``_ignore_causal_mask_sdpa`` and ``_ignore_bidirectional_mask_sdpa``
  (and their XPU variants): a padded mask is needed (the real step returns ``False``: no skip); an
  unpadded one is answered as for ``padding_mask=None`` (what an all-ones mask gives: the mask is skipped
  where the shapes allow);
- ``create_recurrent_attention_mask`` (transformers >= 5.2x): the 2-D mask sliced to the local sequence
  when padded, ``None`` when not.

The patched function keeps every other answer of the original: ``torch.compile``/``torch.export``
(``is_torchdynamo_compiling``), ``torch.jit`` tracing and CUDA stream capture still count as tracing.

Kernels whose *fake* output differs in size from the real one are listed in :data:`FAKE_KERNELS` and
corrected while a fake step runs (:func:`real_kernel_sizes`):

- ``aten.mkldnn_rnn_layer`` (the oneDNN LSTM layer of a CPU ``nn.LSTM`` in training): the real kernel
  (``aten/src/ATen/native/mkldnn/RNN.cpp``, ``mkldnn_rnn_layer``) allocates a byte tensor of
  ``pd.workspace_desc().get_size()`` -- oneDNN's training workspace (gates, layer and iteration states,
  each section rounded up to a 4096-byte page: ``src/cpu/rnn/rnn_utils.cpp``, ``set_offsets``) -- and
  returns it to be saved for backward; the meta kernel (``torch/_meta_registrations.py``) returns 0 bytes,
  so a traced 2-layer LSTM step read 25% under the real one. The size depends on oneDNN's version and
  the CPU's kernels (leading dimensions padded per ISA), so it is *measured*: the same call is run on
  zero tensors of the real kernel (:func:`mkldnn_rnn_workspace_bytes`), at the requested shape when that
  costs at most :data:`RNN_PROBE_BYTES`, else at three smaller shapes fitted as ``c0 + c1*T*B + c2*B``
  (every section is a multiple of T*B or (T+1)*B).
- ``aten.mse_loss`` and ``aten.smooth_l1_loss`` with a ``"mean"`` or ``"sum"`` reduction: the structured
  kernel's meta function (``aten/src/ATen/native/Loss.cpp``, ``TORCH_META_FUNC(mse_loss)``) builds the
  output at the broadcast input size and then ``resize_({})`` it, so the real 0-d loss keeps the whole
  unreduced buffer's storage alive as long as the loss lives (a UNet's MSE step: +1.2%); the fake kernel
  allocates 4 bytes. The corrected fake result is a 0-d tensor on a storage of the unreduced size.
- a 0-d ``aten.rand`` (LayerDrop in wav2vec2, Whisper, BART: ``if torch.rand([]) < layerdrop``) is read by
  a Python branch, which a fake tensor cannot answer (``DataDependentOutputException``): it is drawn as a
  constant just below 1, so no layer is dropped -- the largest step (a real step that drops layers holds
  less).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = [
    "FAKE_KERNELS",
    "FAKE_METHODS",
    "FAKE_SENSITIVE",
    "RNN_PROBE_BYTES",
    "fake_batch_tensor",
    "fake_scalars",
    "mask_padding",
    "mkldnn_rnn_workspace_bytes",
    "real_kernel_sizes",
    "readable_scalars",
    "real_step_branches",
]

#: ``{(rows, length): padded}`` of the real batch's attention masks (:func:`mask_padding`).
_PADDING: contextvars.ContextVar[Mapping[tuple[int, int], bool] | None] = contextvars.ContextVar(
    "memplan_padding", default=None)
#: While a padded batch's mask function runs: ``is_tracing(fake)`` answers True, so the original takes the
#: branch that never reads the mask's values -- the branch the real padded step takes.
_TRACED_ANSWER: contextvars.ContextVar[bool] = contextvars.ContextVar("memplan_traced_answer", default=False)

#: Mapping keys of a batch that hold an attention (padding) mask: 1 keeps a position, 0 pads it.
MASK_KEYS = ("attention_mask", "decoder_attention_mask", "padding_mask")


def _is_fake(value: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


def _is_tracing_real(original: Callable[..., bool]) -> Callable[..., bool]:
    def is_tracing(tensor: Any = None) -> bool:  # the tensor is fake only because the step is traced
        if _TRACED_ANSWER.get() and _is_fake(tensor):
            return True
        return bool(original())

    is_tracing.__wrapped__ = original  # type: ignore[attr-defined]
    return is_tracing


#: ``{package: {function name: wrapper(original) -> the real step's function}}``: checks that answer
#: differently for a ``FakeTensor`` than for the real tensor it stands for (see the module docstring).
FAKE_SENSITIVE: dict[str, dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]]] = {
    "transformers": {"is_tracing": _is_tracing_real},
}


def _mask_none_without_mask(original: Callable[..., Any]) -> Callable[..., Any]:
    def update(self: Any, attention_mask: Any, cache_position: Any) -> Any:
        if attention_mask is None:
            return None  # what the original returns for any cache_position
        return original(self, attention_mask, cache_position)

    update.__wrapped__ = original  # type: ignore[attr-defined]
    return update


def _unpacked(original: Callable[..., Any]) -> Callable[..., Any]:
    def find_packed_sequence_indices(position_ids: Any) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(position_ids, FakeTensor):
            return None  # one sequence per row: what the real step finds for the traced batches
        return original(position_ids)

    find_packed_sequence_indices.__wrapped__ = original  # type: ignore[attr-defined]
    return find_packed_sequence_indices


def _padding_answer(parameter: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A wrapper for a function whose branch depends on whether its ``parameter`` (a padding mask) is all
    ones: for a fake mask, the real batch's mask of its shape decides (:data:`_PADDING`, module docstring)."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def answer(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            mask = bound.arguments.get(parameter)
            if not _is_fake(mask):
                return original(*args, **kwargs)
            shape = tuple(getattr(mask, "shape", ())[-2:])
            if not (_PADDING.get() or {}).get(shape, False):  # all ones: the answer for no mask
                bound.arguments[parameter] = None
                return original(*bound.args, **bound.kwargs)
            token = _TRACED_ANSWER.set(True)
            try:
                return original(*args, **kwargs)
            finally:
                _TRACED_ANSWER.reset(token)

        answer.__wrapped__ = original  # type: ignore[attr-defined]
        return answer

    return wrap


#: ``{"module:Class.method" or "module:function": wrapper(original) -> the real step's method}``: methods that read a tensor's
#: value the real training step knows (see the module docstring).
FAKE_METHODS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "transformers.models.jamba.modeling_jamba:JambaModel._update_mamba_mask": _mask_none_without_mask,
    "transformers.masking_utils:find_packed_sequence_indices": lambda original: _unpacked(original),
    "transformers.masking_utils:_ignore_causal_mask_sdpa": _padding_answer("padding_mask"),
    "transformers.masking_utils:_ignore_bidirectional_mask_sdpa": _padding_answer("padding_mask"),
    "transformers.masking_utils:_can_skip_causal_mask_xpu": _padding_answer("padding_mask"),
    "transformers.masking_utils:_can_skip_bidirectional_mask_xpu": _padding_answer("padding_mask"),
    "transformers.masking_utils:create_recurrent_attention_mask": _padding_answer("attention_mask"),
}


def _mask_like(t: Any, in_mapping: bool, key: Any) -> bool:
    import torch

    if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.ndim != 2:
        return False
    if _is_fake(t) or t.device.type == "meta":
        return False
    if in_mapping:
        return key in MASK_KEYS
    return t.dtype == torch.bool or bool(((t == 0) | (t == 1)).all())


def mask_padding(batch: Any, depth: int = 4) -> dict[tuple[int, int], bool]:
    """``{(rows, length): padded}`` of a real batch's attention masks: the 2-d integer or bool tensors
    under a :data:`MASK_KEYS` key of a mapping, or of 0s and 1s in a tuple or list; ``padded`` when one of
    that shape holds a 0. Empty when the batch holds none."""
    found: dict[tuple[int, int], bool] = {}

    def visit(obj: Any, level: int) -> None:
        if level > depth:
            return
        items = list(obj.items()) if isinstance(obj, Mapping) else (
            list(enumerate(obj)) if isinstance(obj, (list, tuple)) else [])
        for key, value in items:
            if _mask_like(value, isinstance(obj, Mapping), key):
                shape = (int(value.shape[0]), int(value.shape[1]))
                found[shape] = found.get(shape, False) or bool((value == 0).any())
            else:
                visit(value, level + 1)

    visit(batch, 0)
    return found


def fake_batch_tensor(fake_mode: Any, t: Any) -> Any:
    """The fake tensor of one real batch tensor: an integer or bool tensor (token ids, labels, masks) keeps
    its values as the fake tensor's *constant*, so a check of the step that reads a value computed from it
    alone (``labels.max() >= vocab_size`` in wav2vec2's CTC head) is answered as in the real step (the fake
    mode runs an operator on constants when every input has one and the result has one element);
    floating-point tensors have no values (``fake_mode.from_tensor``). A view (``x, y = ids[:, :-1],
    ids[:, 1:]``, a next-token batch sharing one storage) has no values either: the fake converter makes a
    constant of a whole storage only (torch 2.13 ``torch/_subclasses/fake_tensor.py``,
    ``FakeTensorConverter.add_constant_storage_mapping`` asserts a constant for a view's second alias), and
    the views keep their one shared storage, as the real step's memory does."""

    if (t.is_floating_point() or t.is_complex() or t.requires_grad or _is_fake(t) or t.device.type == "meta"
            or t._is_view()):
        return fake_mode.from_tensor(t)
    return fake_mode.fake_tensor_converter.from_real_tensor(fake_mode, t, make_constant=True)


@contextlib.contextmanager
def real_step_branches(padding: Mapping[tuple[int, int], bool] | None = None) -> Iterator[list[str]]:
    """While the block runs, every imported module of a package in :data:`FAKE_SENSITIVE` sees that
    package's listed functions as the real step does; yields the ``module.function`` names patched.

    ``padding``: ``{(rows, length): padded}`` of the real batch's attention masks (:func:`mask_padding`);
    a fake mask of another shape is answered as unpadded. Only modules already imported are patched (a
    traced model's modules are imported when it is built); the originals are restored on exit, also
    after an exception.
    """
    token = _PADDING.set(dict(padding or {}))
    try:
        with _patched() as names:
            yield names
    finally:
        _PADDING.reset(token)


def _targets() -> list[tuple[Any, str, Any]]:
    """``(owner, name, original)`` of every function :func:`real_step_branches` patches now."""
    patched: list[tuple[Any, str, Any]] = []
    for package, functions in FAKE_SENSITIVE.items():
        if package not in sys.modules:
            continue
        for name, module in list(sys.modules.items()):
            if module is None or not (name == package or name.startswith(package + ".")):
                continue
            for fn_name in functions:
                original = getattr(module, fn_name, None)
                if callable(original) and not hasattr(original, "__wrapped__") and getattr(
                    original, "__module__", "").startswith(package):
                    patched.append((module, fn_name, original))
    for target in FAKE_METHODS:
        module_name, _, qualname = target.partition(":")
        cls_name, _, method = qualname.partition(".")
        owner_module = sys.modules.get(module_name)
        if not method:  # a module-level function
            original = getattr(owner_module, cls_name, None) if owner_module is not None else None
            if callable(original) and not hasattr(original, "__wrapped__"):
                patched.append((owner_module, cls_name, original))
            continue
        cls = getattr(owner_module, cls_name, None)
        original = cls.__dict__.get(method) if isinstance(cls, type) else None
        if original is not None and not hasattr(original, "__wrapped__"):
            patched.append((cls, method, original))
    return patched


@contextlib.contextmanager
def _patched() -> Iterator[list[str]]:
    patched = _targets()
    replaced: dict[int, Any] = {}
    try:
        for owner, fn_name, original in patched:
            if isinstance(owner, type):
                wrap = FAKE_METHODS[f"{owner.__module__}:{owner.__name__}.{fn_name}"]
            elif f"{owner.__name__}:{fn_name}" in FAKE_METHODS:
                wrap = FAKE_METHODS[f"{owner.__name__}:{fn_name}"]
            else:
                wrap = FAKE_SENSITIVE[owner.__name__.split(".")[0]][fn_name]
            new = replaced.setdefault(id(original), wrap(original))
            setattr(owner, fn_name, new)
        yield [f"{m.__module__ + '.' if isinstance(m, type) else ''}{m.__name__}.{f}" for m, f, _ in patched]
    finally:
        for module, fn_name, original in patched:
            setattr(module, fn_name, original)


# ---------------------------------------------------------------------------------------------- kernels
#: Most bytes a probe of a real kernel may allocate (input, outputs and the workspace together); above it
#: the size is fitted from smaller probes.
RNN_PROBE_BYTES = 32 * 2**20


def _rnn_probe(dims: tuple[int, int], template: tuple[Any, ...]) -> int:
    """Workspace bytes of the real ``mkldnn_rnn_layer`` called like ``template`` with its input's first
    two dimensions set to ``dims`` (zeros; no dispatch mode sees it; with grad mode on, as in training)."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    (x_shape, dtype, weight_shapes, hidden, flags) = template
    with _disable_current_modes(), torch.enable_grad():
        x = torch.zeros((*dims, x_shape[2]), dtype=dtype)
        weights = [torch.zeros(shape, dtype=dtype) for shape in weight_shapes]
        state = torch.zeros((1, dims[1], hidden), dtype=dtype)
        args = [list(a) if isinstance(a, tuple) else a for a in flags]  # batch_sizes travels as a tuple
        out = torch.ops.aten.mkldnn_rnn_layer.default(x, *weights, state, state.clone(), *args)
        return int(out[3].numel() * out[3].element_size())


@functools.lru_cache(maxsize=256)
def mkldnn_rnn_workspace_bytes(template: tuple[Any, ...], seq: int, batch: int) -> int:
    """Bytes of the oneDNN training workspace the real ``aten.mkldnn_rnn_layer`` returns for an input of
    ``[seq, batch, input_size]`` (module docstring). ``template`` is ``(input shape, dtype, the four weight
    shapes, hidden size, the call's trailing flags)``. Measured at the shape itself when a probe costs at
    most :data:`RNN_PROBE_BYTES`; else fitted as ``c0 + c1*seq*batch + c2*batch`` from three probes."""
    x_shape, dtype, weight_shapes, hidden, _ = template
    import torch

    element = torch.empty((), dtype=dtype).element_size()
    per_cell = element * (x_shape[2] + 16 * hidden)  # input, output and a generous workspace per (t, b)
    if seq * batch * per_cell <= RNN_PROBE_BYTES:
        return _rnn_probe((seq, batch), template)
    cells = max(8, RNN_PROBE_BYTES // (2 * per_cell))  # (t, b) cells of the largest probe, halved
    b1 = max(1, min(batch, math.isqrt(cells // 2)))
    t1 = max(1, min(seq, cells // (2 * b1)))
    points = [(t1, b1), (2 * t1, b1), (t1, 2 * b1)]
    rows = torch.tensor([[1.0, float(t * b), float(b)] for t, b in points], dtype=torch.float64)
    sizes = torch.tensor([[float(_rnn_probe(p, template))] for p in points], dtype=torch.float64)
    c = torch.linalg.lstsq(rows, sizes).solution.flatten().tolist()
    return max(0, round(c[0] + c[1] * seq * batch + c[2] * batch))


def _fake(fake_mode: Any, meta: Any, device: Any) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor(fake_mode, meta, device)


def _meta(t: Any) -> Any:
    import torch

    if isinstance(t, torch.Tensor):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return t


def _mkldnn_rnn_layer_fake(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """The meta kernel's outputs, with the workspace at the real kernel's size (module docstring)."""
    import torch

    x = args[0]
    outputs = func(*(_meta(a) for a in args), **{k: _meta(v) for k, v in kwargs.items()})
    wrapped = [_fake(fake_mode, o, x.device) for o in outputs]
    if x.device.type == "cpu" and torch.is_grad_enabled() and x.dim() == 3:
        weights = tuple(tuple(w.shape) for w in args[1:5])
        flags = tuple(tuple(a) if isinstance(a, list) else a for a in args[7:])  # hashable for the cache
        template = (tuple(x.shape), x.dtype, weights, int(args[10]), flags)
        try:
            nbytes = mkldnn_rnn_workspace_bytes(template, int(x.shape[0]), int(x.shape[1]))
        except RuntimeError:  # the real kernel refuses this dtype on this CPU: the meta kernel's answer
            nbytes = 0
        wrapped[3] = _fake(fake_mode, torch.empty(nbytes, dtype=torch.uint8, device="meta"), x.device)
    return tuple(wrapped)


def _unreduced_storage_fake(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """A reduced ``mse_loss`` / ``smooth_l1_loss``: the 0-d result on a storage of the unreduced loss
    (module docstring), as the real structured kernel leaves it."""
    import torch

    x, target = args[0], args[1]
    reduction = args[2] if len(args) > 2 else kwargs.get("reduction", 1)
    beta = args[3] if len(args) > 3 else kwargs.get("beta", 1.0)
    if reduction == 0 or (func is torch.ops.aten.smooth_l1_loss.default and beta == 0):
        return NotImplemented  # unreduced (or l1_loss's path): the meta kernel's answer is the real one
    shape = torch.broadcast_shapes(x.shape, target.shape)
    full = torch.empty(shape, dtype=torch.result_type(x, target), device="meta")
    full.resize_(())  # what the kernel's meta function does to its full-size output
    return _fake(fake_mode, full, x.device)


def _scalar_draw_fake(fake_mode: Any, func: Any, size: Any, *args: Any, **kwargs: Any) -> Any:
    """A 0-d ``torch.rand`` that a branch reads (LayerDrop's ``if torch.rand([]) < layerdrop``): a fake
    tensor holding the constant ``1 - 2**-24`` (the largest float32 below 1), so the branch is taken as in
    a step that drops no layer -- the largest step, the one the estimate must cover."""
    import torch

    device = kwargs.get("device")
    if tuple(size) != () or (device is not None and torch.device(device).type != "cpu"):
        return NotImplemented
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    value = torch.tensor(1.0 - 2.0**-24, dtype=dtype)
    return fake_mode.fake_tensor_converter.from_real_tensor(fake_mode, value, make_constant=True)


#: ``{op name: fake kernel (fake_mode, func, *args) -> outputs or NotImplemented}``: kernels whose fake
#: outputs differ from the real ones (module docstring), answered while a fake step runs
#: (:func:`real_kernel_sizes`); ``NotImplemented`` leaves a call to the fake mode.
FAKE_KERNELS: dict[str, Callable[..., Any]] = {
    "aten.mkldnn_rnn_layer.default": _mkldnn_rnn_layer_fake,
    "aten.mse_loss.default": _unreduced_storage_fake,
    "aten.smooth_l1_loss.default": _unreduced_storage_fake,
    "aten.rand.default": _scalar_draw_fake,
}


def _kernel_mode() -> Any:
    """A dispatch mode over the fake mode that answers the operators of :data:`FAKE_KERNELS` (a mode, not
    the fake mode's own registry: the fake mode runs Python decompositions, such as ``mse_loss``'s, before
    consulting that registry)."""
    import torch
    from torch._guards import active_fake_mode
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    kernels = {}
    for name, impl in FAKE_KERNELS.items():
        namespace, op, overload = name.split(".")
        kernels[getattr(getattr(getattr(torch.ops, namespace), op), overload)] = impl

    class RealKernelSizes(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            impl = kernels.get(func)
            fake_mode = active_fake_mode() if impl is not None else None
            if impl is not None and fake_mode is not None:
                with _disable_current_modes():
                    out = impl(fake_mode, func, *args, **(kwargs or {}))
                if out is not NotImplemented:
                    return out
            return func(*args, **(kwargs or {}))

    return RealKernelSizes()


@contextlib.contextmanager
def real_kernel_sizes() -> Iterator[None]:
    """While the block runs (entered inside the fake mode), the operators of :data:`FAKE_KERNELS` answer
    with the real kernels' sizes (module docstring)."""
    with _kernel_mode():
        yield



def _scalar_reader() -> Any:
    """A dispatch mode in which reading a fake tensor's value (``loss.item()``, ``float(loss)`` in a
    ``training_step`` that logs it) gives 0 (0.0, ``False``) instead of ``DataDependentOutputException``: a
    value read for logging changes no tensor's memory. A fake tensor that carries its real value
    (``FakeTensor.constant``: the batch's integer tensors, :func:`fake_batch_tensor`) keeps answering with it.
    A step that branches on a value read this way traces the branch of 0."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class FakeScalars(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.ops.aten._local_scalar_dense.default and args and _is_fake(args[0]) and (
                getattr(args[0], "constant", None) is None
            ):
                dtype = args[0].dtype
                return False if dtype == torch.bool else 0.0 if dtype.is_floating_point or dtype.is_complex else 0
            return func(*args, **(kwargs or {}))

    return FakeScalars()


@contextlib.contextmanager
def fake_scalars() -> Iterator[None]:
    """While open (inside a ``FakeTensorMode``): a fake tensor's value read on the host is 0
    (:func:`_scalar_reader`); :func:`~lightning_memplan.tracking.trace.trace_memory` opens it for its fake step."""
    with _scalar_reader():
        yield

def readable_scalars(loss_fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``loss_fn`` with fake tensors' values readable as 0 while it runs (:func:`fake_scalars`), for a fake step
    run outside :func:`~lightning_memplan.tracking.trace.trace_memory` (which opens it itself)."""

    def run(module: Any, batch: Any) -> Any:
        with fake_scalars():
            return loss_fn(module, batch)

    return run
