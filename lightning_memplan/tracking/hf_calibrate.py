"""Tracing the depth-reduced Hugging Face copies and scaling their coefficients to the full depth.

:func:`trace_depths` builds the depth-1 and depth-2 copies (:func:`~lightning_memplan.model.hf_build.
build_reduced`) and traces each with :func:`~lightning_memplan.tracking.trace.calibrate` at
:data:`TRACE_SHAPES`: one Lightning-order training step per shape under ``FakeTensorMode`` (nothing
is allocated, however wide the model), giving per phase and component ``c0 + c1*(b*s) + c2*(b*s^2)``.
The step starts from a primed steady state (:func:`primed_optimizer`), so one traced step measures
what the second of two would, at half the cost. The result is a JSON-ready entry for
``tracking/hf_cache.py``; :class:`~lightning_memplan.model.traced.DepthTraces` (the model layer's
data class, re-exported here with :class:`TracedStep`) is its parsed form, and
:meth:`DepthTraces.full_depth` the full model: per-block cost = depth 2 - depth 1, fixed cost
(embedding, head, loss) = depth 1 - per-block, so ``bytes(L) = bytes(1) + (L - 1) * (bytes(2) - bytes(1))`` at the requested ``(b, s)``.

Mixture-of-experts: transformers' default expert kernel is ``aten._grouped_mm``, whose meta kernel
implements only CUDA's bf16 checks, so a fake CPU trace fails where the real CPU step runs. During
the trace a fake kernel for fp32/fp16 CPU ``_grouped_mm`` is registered (:func:`fake_cpu_grouped_mm`:
same output shape, dtype and strides as the CPU kernel; removed afterwards), so routed experts are
traced without allocating.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from lightning_memplan.model.traced import TRACE_SHAPES, TRACED_DEPTHS, DepthTraces, TracedStep

__all__ = [
    "TRACED_DEPTHS",
    "TRACE_SHAPES",
    "DepthTraces",
    "TracedStep",
    "fake_cpu_grouped_mm",
    "primed_optimizer",
    "trace_depths",
]

# Config keys of attention-probability dropout: CPU SDPA with dropout runs the math path, which saves the
# [b, a, s, s] probabilities, so those steps do grow with b*s^2.
_ATTENTION_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "dropout_rate")


@contextlib.contextmanager
def fake_cpu_grouped_mm() -> Iterator[None]:
    """Register a fake kernel for fp32/fp16 CPU ``aten._grouped_mm`` while tracing (see module doc)."""
    import torch
    from torch._meta_registrations import _create_grouped_mm_output_tensor
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import FakeTensor

    op = torch.ops.aten._grouped_mm.default

    def check(func: Any) -> bool:
        return func is op

    def impl(fake_mode: Any, func: Any, mat_a: Any, mat_b: Any, offs: Any = None, bias: Any = None,
             out_dtype: Any = None) -> Any:
        if mat_a.device.type != "cpu" or mat_a.dtype == torch.bfloat16:
            return NotImplemented  # the registered meta kernel is right here

        def meta(t: Any) -> Any:
            return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

        out = _create_grouped_mm_output_tensor(meta(mat_a), meta(mat_b), meta(offs), out_dtype or mat_a.dtype)
        return FakeTensor(fake_mode, out, mat_a.device)

    entry = (check, impl)
    fake_impls.op_implementations_checks.insert(0, entry)
    try:
        yield
    finally:
        fake_impls.op_implementations_checks.remove(entry)


def _quadratic_in_seq(cfg: Mapping[str, Any], t0: TracedStep) -> bool | None:
    """Whether the traced step may hold ``b*s^2`` bytes (``None``: let :func:`calibrate` decide).

    A fused SDPA step without attention dropout saves no ``[s, s]`` tensor (only the output and its
    log-sum-exp, linear in ``b*s``). Fitting a third, quadratic term there extrapolates the small
    differences in *which* tensors are live at a phase's peak between the traced shapes (a few hundred
    bytes per ``b*s^2``, of opposite sign in two components) into terabytes at long context, so the
    two-term fit is forced. Eager attention and dropout keep the quadratic term.
    """
    if t0.attention != "sdpa":
        return None
    if any(float(cfg.get(key) or 0.0) > 0.0 for key in _ATTENTION_DROPOUT_KEYS):
        return None
    return False


def primed_optimizer(name: str, impl: str | None) -> Any:
    """A factory ``params -> optimizer`` whose optimizer is already in the steady state of step 2.

    Lightning-order step 2 starts with step 1's gradients (``zero_grad`` runs after the forward) and
    the optimizer states alive. Instead of tracing step 1 to get there (half the trace time), every
    trainable parameter gets a zero ``.grad`` (same shape, dtype and strides as autograd's
    ``AccumulateGrad`` gives it) and the optimizer is stepped once by torch's own code, which creates
    its states. :class:`~lightning_memplan.tracking.tracker.TensorTracker` registers existing
    ``.grad`` and optimizer states on entry, so the one traced step measures what step 2 of two
    measures, byte for byte (``tests/unit/test_hf_trace.py`` checks it against ``steps=2``).
    """
    import torch

    from lightning_memplan.tracking.trace import make_optimizer

    def make(params: Any) -> Any:
        params = list(params)
        opt = make_optimizer(name, params, optimizer_impl=impl)
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        opt.step()
        return opt

    return make


def trace_depths(cfg: Mapping[str, Any], t0: TracedStep) -> dict[str, Any]:
    """Calibrations and parameter counts of the depth-1 and depth-2 copies of ``cfg`` traced with ``t0``
    (a JSON-ready cache entry).

    Raises:
        ValueError: the copy cannot be built, or its fake step fails (names the class and what to do).
    """
    from transformers.utils import logging as hf_logging

    from lightning_memplan.model.hf_build import build_reduced, input_fn_for, vision_tokens
    from lightning_memplan.model.readers import norm_impl_of
    from lightning_memplan.tracking.trace import calibrate

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its notes about the traced copies (use_cache, loss_type) are not the user's
    out: dict[str, Any] = {"depths": {}}
    try:
        for depth in TRACED_DEPTHS:
            model = build_reduced(cfg, depth, attention=t0.attention, recompute=t0.recompute)
            input_fn, vision = input_fn_for(model, cfg)
            shapes = TRACE_SHAPES
            extra: dict[str, Any] = {"quadratic": _quadratic_in_seq(cfg, t0)}
            if vision:
                s = vision_tokens(cfg)
                shapes = ((1, s), (2, s))
                extra = {"quadratic": False, "seq_len": s}
            try:
                # A failed fake step cannot fall back to a real one: the copy's parameters are on the meta
                # device, so trace_memory raises instead of allocating.
                with fake_cpu_grouped_mm(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    cal = calibrate(
                        model, shapes, input_fn=input_fn, precision=t0.precision, steps=1,
                        optimizer=primed_optimizer(t0.optimizer, t0.optimizer_impl), device=t0.device, **extra,
                    )
            except (ValueError, RuntimeError, TypeError, NotImplementedError) as exc:
                raise ValueError(
                    f"{type(model).__name__} (model_type={cfg.get('model_type')!r}) could not be traced under fake "
                    f"tensors ({str(exc).splitlines()[0][:200]}); trace your model with trace_memory(model, "
                    "batch_shape=(b, s)) or set LIGHTNING_MEMPLAN_HF_TRACE=0 for the analytic terms"
                ) from exc
            out["depths"][str(depth)] = {
                "calibration": cal.to_dict(),
                "n_params": sum(p.numel() for p in model.parameters()),
                "n_trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "vision_tokens": extra.get("seq_len"),
            }
            out["class"] = type(model).__name__
            # The class's RMSNorm implementation (composite fp32-upcast in most HF decoders): what a CPU
            # trace is scaled to another device with (hf_trace._on_device), since on CUDA the variants differ.
            out["norm_impl"] = norm_impl_of(model)
    finally:
        hf_logging.set_verbosity(verbosity)
    return out
