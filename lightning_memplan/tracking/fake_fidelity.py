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

The patched function keeps every other answer of the original: ``torch.compile``/``torch.export``
(``is_torchdynamo_compiling``), ``torch.jit`` tracing and CUDA stream capture still count as tracing.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["FAKE_METHODS", "FAKE_SENSITIVE", "real_step_branches"]


def _is_tracing_real(original: Callable[..., bool]) -> Callable[..., bool]:
    def is_tracing(tensor: Any = None) -> bool:  # the tensor is fake only because the step is traced
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


#: ``{"module:Class.method" or "module:function": wrapper(original) -> the real step's method}``: methods that read a tensor's
#: value the real training step knows (see the module docstring).
FAKE_METHODS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "transformers.models.jamba.modeling_jamba:JambaModel._update_mamba_mask": _mask_none_without_mask,
    "transformers.masking_utils:find_packed_sequence_indices": lambda original: _unpacked(original),
}


@contextlib.contextmanager
def real_step_branches() -> Iterator[list[str]]:
    """While the block runs, every imported module of a package in :data:`FAKE_SENSITIVE` sees that
    package's listed functions as the real step does; yields the ``module.function`` names patched.

    Only modules already imported are patched (a traced model's modules are imported when it is built);
    the originals are restored on exit, also after an exception.
    """
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
