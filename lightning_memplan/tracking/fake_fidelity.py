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

Functions that read whether a batch's attention mask holds padding (``padding_mask.all()``, a value a
fake tensor does not have: ``DataDependentOutputException``, so BERT, RoBERTa, T5, BART, wav2vec2 or
Whisper with an ``attention_mask`` could not be traced) are answered from the *real* batch, which the
tracer reads before it makes the fake one (:func:`masks_padded`; ``real_step_branches(padded=...)``):

- ``transformers/masking_utils.py`` ``_ignore_causal_mask_sdpa`` and ``_ignore_bidirectional_mask_sdpa``
  (and their XPU variants): a padded batch needs the ``[b, 1, q, kv]`` mask (the real step returns
  ``False``: no skip); an unpadded one is answered as for ``padding_mask=None`` (what an all-ones mask
  gives: the mask is skipped where the shapes allow);
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
    "masks_padded",
    "mkldnn_rnn_workspace_bytes",
    "real_kernel_sizes",
    "real_step_branches",
]

#: Whether the real batch's attention masks hold padding (``None``: unknown, answered as padded).
_PADDED: contextvars.ContextVar[bool | None] = contextvars.ContextVar("memplan_padded", default=None)
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
    ones: for a fake mask, the real batch's answer (:data:`_PADDED`) decides (module docstring)."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def answer(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            if not _is_fake(bound.arguments.get(parameter)):
                return original(*args, **kwargs)
            if _PADDED.get() is False:  # all ones in the real step: the same answer as no mask at all
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


def masks_padded(batch: Any, depth: int = 4) -> bool | None:
    """Whether a real batch's attention masks (mapping keys :data:`MASK_KEYS`, integer or bool) hold a 0
    (padding): ``True``/``False``, or ``None`` when the batch has no such key (a tuple batch, or no mask)."""
    import torch

    found: list[bool] = []

    def visit(obj: Any, level: int) -> None:
        if level > depth:
            return
        if isinstance(obj, Mapping):
            for key, value in obj.items():
                if key in MASK_KEYS and isinstance(value, torch.Tensor) and not value.is_floating_point():
                    if not _is_fake(value) and value.device.type != "meta":
                        found.append(bool((value == 0).any()))
                else:
                    visit(value, level + 1)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                visit(value, level + 1)

    visit(batch, 0)
    return any(found) if found else None


@contextlib.contextmanager
def real_step_branches(padded: bool | None = None) -> Iterator[list[str]]:
    """While the block runs, every imported module of a package in :data:`FAKE_SENSITIVE` sees that
    package's listed functions as the real step does; yields the ``module.function`` names patched.

    ``padded``: whether the real batch's attention masks hold padding (:func:`masks_padded`); ``None``
    (unknown) is answered as padded, the case where the real step builds the mask. Only modules already
    imported are patched (a traced model's modules are imported when it is built); the originals are
    restored on exit, also after an exception.
    """
    token = _PADDED.set(padded)
    try:
        with _patched() as names:
            yield names
    finally:
        _PADDED.reset(token)


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


def _mkldnn_rnn_layer_fake(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """The meta kernel's outputs, with the workspace at the real kernel's size (module docstring)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    def meta(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return t

    x = args[0]
    outputs = func(*(meta(a) for a in args), **{k: meta(v) for k, v in kwargs.items()})
    device = x.device
    wrapped = [FakeTensor(fake_mode, o, device) for o in outputs]
    if device.type == "cpu" and torch.is_grad_enabled() and x.dim() == 3:
        weights = tuple(tuple(w.shape) for w in args[1:5])
        flags = tuple(tuple(a) if isinstance(a, list) else a for a in args[7:])  # hashable for the cache
        template = (tuple(x.shape), x.dtype, weights, int(args[10]), flags)
        try:
            nbytes = mkldnn_rnn_workspace_bytes(template, int(x.shape[0]), int(x.shape[1]))
        except RuntimeError:  # the real kernel refuses this dtype on this CPU: the meta kernel's answer
            nbytes = 0
        wrapped[3] = FakeTensor(fake_mode, torch.empty(nbytes, dtype=torch.uint8, device="meta"), device)
    return tuple(wrapped)


#: ``{op name: fake kernel (fake_mode, func, *args) -> outputs}``: kernels whose fake outputs are sized
#: differently from the real ones (module docstring); registered while a fake step runs.
FAKE_KERNELS: dict[str, Callable[..., Any]] = {
    "aten.mkldnn_rnn_layer.default": _mkldnn_rnn_layer_fake,
}


@contextlib.contextmanager
def real_kernel_sizes() -> Iterator[None]:
    """While the block runs, the fake tensor mode uses :data:`FAKE_KERNELS` for their operators."""
    import torch
    from torch._subclasses import fake_impls

    entries = []
    for name, impl in FAKE_KERNELS.items():
        namespace, op, overload = name.split(".")
        target = getattr(getattr(getattr(torch.ops, namespace), op), overload)
        entries.append(((lambda func, target=target: func is target), impl))
    for entry in entries:
        fake_impls.op_implementations_checks.insert(0, entry)
    try:
        yield
    finally:
        for entry in entries:
            fake_impls.op_implementations_checks.remove(entry)
