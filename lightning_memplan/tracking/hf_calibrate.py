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

LoRA (``ModelSpec.with_lora``): each copy gets peft's own LoRA layers on the named modules
(:func:`with_lora_adapter`, ``peft.inject_adapter_in_model``: the model class stays what it is, its base
weights frozen as ``get_peft_model`` freezes them), so the trace measures what a LoRA step saves --
frozen linears keep no input, ``lora_A`` keeps the input it shares with the base layer, ``lora_B`` the
``[b*s, r]`` down-projection, GPT-2's ``Conv1D`` is wrapped with ``fan_in_fan_out`` -- instead of full
fine-tuning's (``lightning_memplan.model.lora``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
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
    "PROBE_SHAPE",
    "PROBE_TOLERANCE",
    "SCORE_DEVICES",
    "length_steps",
    "peft_available",
    "sdpa_keeps_scores",
    "trace_depths",
    "with_lora_adapter",
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


@functools.lru_cache(maxsize=1)
def peft_available() -> bool:
    """Whether ``peft`` is installed (``pip install peft``): a LoRA adapter is traced with its layers."""
    return importlib.util.find_spec("peft") is not None


def with_lora_adapter(model: Any, lora: Mapping[str, Any]) -> Any:
    """``model`` with peft's LoRA layers injected on ``lora["target_modules"]`` (``r``, ``lora_dropout``
    as :func:`~lightning_memplan.model.lora.lora_adapter` gives them) and only the adapters trainable.

    ``peft.inject_adapter_in_model`` builds the layers ``get_peft_model`` builds (``LoraModel``, which also
    freezes every base parameter and sets ``fan_in_fan_out`` for GPT-2's ``Conv1D``) and leaves the model's
    class as it is, so the traced step runs the forward a ``PeftModel`` runs around it.

    Raises:
        ValueError: peft is not installed, or no module of the model has one of the names (peft's own
            message, with the fix).
    """
    if not peft_available():
        raise ValueError("a LoRA adapter is traced with peft's layers; pip install peft (or drop with_lora)")
    import peft

    config = peft.LoraConfig(r=int(lora["r"]), target_modules=list(lora["target_modules"]),
                             lora_dropout=float(lora.get("lora_dropout", 0.0)))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "fan_in_fan_out is set to False but the target module is Conv1D"
            return peft.inject_adapter_in_model(config, model)
    except ValueError as exc:
        raise ValueError(
            f"LoRA target_modules={list(lora['target_modules'])!r} on {type(model).__name__}: "
            f"{str(exc).splitlines()[0][:200]}; pass with_lora(targets=...) names this model's linears have"
        ) from exc


def _head_dims(cfg: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """``(q/k head size, v head size)`` the config's attention runs with (MLA: ``qk_nope_head_dim +
    qk_rope_head_dim`` and ``v_head_dim``); ``None`` where the config does not say."""
    sub = cfg.get("text_config")
    text: Mapping[str, Any] = sub if isinstance(sub, Mapping) else cfg
    nope, rope, v = text.get("qk_nope_head_dim"), text.get("qk_rope_head_dim"), text.get("v_head_dim")
    if isinstance(nope, int) and isinstance(rope, int):
        return nope + rope, v if isinstance(v, int) else nope + rope
    head = text.get("head_dim")
    if not isinstance(head, int):
        hidden, heads = text.get("hidden_size"), text.get("num_attention_heads")
        head = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None
    return head, v if isinstance(v, int) else head


def sdpa_keeps_scores(cfg: Mapping[str, Any], *, device: str, precision: str) -> bool:
    """Whether ``torch.nn.functional.scaled_dot_product_attention`` on ``device`` takes the math path for
    this config's attention, which saves the ``[b, a, s, s]`` probabilities (quadratic in s); the fused
    kernels save the output and its log-sum-exp only (linear in s).

    The rule, from PyTorch's kernel selection (torch 2.x):

    - **CPU** (``aten/src/ATen/native/transformers/sdp_utils_cpp.cpp``, ``use_flash_attention_cpp``): the
      only fused kernel is flash attention, whose checks include ``check_for_dropout`` (no attention
      dropout in training) and ``check_head_dim_size_cpp`` (the query, key and value head sizes all
      equal); anything else runs ``_scaled_dot_product_attention_math``. So MLA (DeepSeek-V2/V3: q/k head
      size ``qk_nope_head_dim + qk_rope_head_dim`` = 192, v head size 128) and any attention-dropout
      training step keep the probabilities on the CPU.
    - **CUDA** (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``, ``select_sdp_backend``; priority
      flash, memory-efficient, math, with cuDNN where enabled): flash needs fp16/bf16, equal q/k/v head
      sizes (``check_head_dim_size_flash``) and no ``attn_mask``; the memory-efficient kernel takes fp32,
      fp16 and bf16, an additive ``attn_mask`` and dropout, and a value head size that differs from the
      query/key one (``check_head_dim_size_mem_efficient`` checks q == k and alignment only). So every
      attention of the families traced here runs fused on CUDA: no ``[s, s]`` tensor is kept.
    - Whatever PyTorch picks, transformers' eager attention (``attn_implementation="eager"``, and classes
      that only have it: GPT-OSS's attention sinks concatenate a sink logit to the ``[s, s]`` scores,
      ``eager_attention_forward`` of ``models/gpt_oss/modeling_gpt_oss.py``, ``_supports_sdpa = False``)
      always keeps them; ``ALL_ATTENTION_FUNCTIONS`` in ``transformers/modeling_utils.py`` maps "sdpa" to
      ``integrations/sdpa_attention.py::sdpa_attention_forward``, which passes ``is_causal=True`` and no
      mask when the mask can be skipped (``masking_utils``), and a boolean ``[b, 1, s, s]`` mask otherwise
      (sliding windows and chunked attention beyond their width: quadratic bytes, fitted separately by
      tracing at the requested length, :func:`trace_depths`).
    """
    drop = any(float(cfg.get(key) or 0.0) > 0.0 for key in _ATTENTION_DROPOUT_KEYS)
    qk, v = _head_dims(cfg)
    if device == "cuda":
        return False
    return drop or (qk is not None and v is not None and qk != v)


#: Devices whose SDPA kernel choice :func:`sdpa_keeps_scores` answers for (an entry's ``form`` records each).
SCORE_DEVICES = ("cpu", "cuda")


def _score_kernels(cfg: Mapping[str, Any], t0: TracedStep, attention_in_use: str) -> dict[str, bool] | None:
    """``{device: sdpa_keeps_scores(cfg, device, t0.precision)}`` for :data:`SCORE_DEVICES` when the copy
    runs SDPA (``None`` otherwise: eager attention keeps its scores on every device).

    Recorded in the entry's ``form["sdpa_keeps_scores"]``: where the trace device's kernel keeps the
    ``[b, a, s, s]`` probabilities and the requested device's does not, the model layer's device scaling
    (``model/traced.py``, ``_on_device``) drops the traced ``[s, s]`` tensors (the ``"attention"``
    component, the fit's ``b*s^2`` bytes) and adds the fused kernel's log-sum-exp instead."""
    if attention_in_use != "sdpa":
        return None
    return {device: sdpa_keeps_scores(cfg, device=device, precision=t0.precision) for device in SCORE_DEVICES}


def _quadratic_in_seq(cfg: Mapping[str, Any], t0: TracedStep, attention_in_use: str) -> bool | None:
    """Whether the traced step holds ``b*s^2`` bytes (``None``: let :func:`calibrate` decide from the
    traced attention bytes, for eager attention).

    A fused SDPA step saves no ``[s, s]`` tensor (only the output and its log-sum-exp, linear in
    ``b*s``). Fitting a third, quadratic term there extrapolates the small differences in *which*
    tensors are live at a phase's peak between the traced shapes (a few hundred bytes per ``b*s^2``, of
    opposite sign in two components) into terabytes at long context, so the two-term fit is forced.
    Where :func:`sdpa_keeps_scores` says SDPA takes the math path (MLA's unequal head sizes, dropout),
    the three-term fit is forced; eager attention keeps the quadratic term. (An entry traced at one
    length fits two terms: there the math path's bytes are the ``"attention"`` component, every tensor
    whose last two sizes are ``[s, s]``.)
    """
    kernels = _score_kernels(cfg, t0, attention_in_use)
    if kernels is None:
        return None
    return kernels.get(t0.device, False)


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


#: The held-out shape every fitted entry is checked at (a ``b = 1`` trace at twice the largest fitted length).
PROBE_SHAPE = (1, 256)
#: Largest relative difference, per traced copy and phase, between the fit and the probe trace for the
#: fit to be used at shapes that were not traced.
PROBE_TOLERANCE = 0.005
# Config keys whose value is a sequence length at which the bytes per token change step-wise: sliding
# windows and chunked attention (a boolean [b, 1, s, s] mask from there on under SDPA), SSM chunk padding
# (Mamba2 pads the sequence to whole chunk_size tokens).
_STEP_KEYS = ("sliding_window", "attention_chunk_size", "chunk_size", "window_size", "local_attention_window")


def length_steps(cfg: Mapping[str, Any]) -> list[int]:
    """The sequence lengths at which the config's per-token bytes may change step-wise (:data:`_STEP_KEYS`
    at the top level or in ``text_config``), sorted."""
    found: set[int] = set()
    for conf in (cfg, cfg.get("text_config")):
        if isinstance(conf, Mapping):
            for key in _STEP_KEYS:
                value = conf.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    found.add(value)
    return sorted(found)


def _stacks(cfg: Mapping[str, Any], t0: TracedStep,
            lora: Mapping[str, Any] | None = None) -> tuple[list[tuple[str, Any, tuple[int, ...]]], Any]:
    """``([(name, model, blocks)], plan)``: the copies to trace. Blocks all alike: the depth-1 and depth-2
    copies ``"1"``, ``"2"``. Mixed: ``"1"`` = [first block], ``"2"`` = [first, first] and, for every other
    kind ``k``, ``"k<k>"`` = [first block, first block of kind k] (model/hf_build.py ``build_stack``).
    With ``lora`` every copy carries the adapter (:func:`with_lora_adapter`)."""
    copies, plan = _plain_stacks(cfg, t0)
    if lora is None:
        return copies, plan
    return [(name, with_lora_adapter(model, lora), blocks) for name, model, blocks in copies], plan


def _plain_stacks(cfg: Mapping[str, Any], t0: TracedStep) -> tuple[list[tuple[str, Any, tuple[int, ...]]], Any]:
    """:func:`_stacks` without an adapter."""
    from lightning_memplan.model.hf_build import (
        FULL_BUILD_LAYERS,
        build_reduced,
        build_stack,
        deep_stack_check,
        depth_of,
        full_model,
        layer_plan,
    )

    full = None
    if (depth_of(cfg) or 0) > FULL_BUILD_LAYERS:  # bounded time: the kinds from a prefix, no full-depth build
        deep_stack_check(cfg, attention=t0.attention)
    else:
        with contextlib.suppress(ValueError, TypeError, IndexError, KeyError, AttributeError, RuntimeError):
            full = full_model(cfg, attention=t0.attention)
    plan = layer_plan(full, cfg) if full is not None else None
    if plan is None or not plan.mixed or plan.path is None:
        copies = [(str(d), build_reduced(cfg, d, attention=t0.attention, recompute=t0.recompute), (0,) * d)
                  for d in TRACED_DEPTHS]
        return copies, plan
    ref = plan.first(0)
    stacks = [("1", (ref,)), ("2", (ref, ref))] + [(f"k{k}", (ref, plan.first(k))) for k in range(1, len(plan.labels))]
    return [(name, build_stack(cfg, full, plan, blocks, attention=t0.attention, recompute=t0.recompute), blocks)
            for name, blocks in stacks], plan


def trace_depths(
    cfg: Mapping[str, Any], t0: TracedStep, *, seq_len: int | None = None, micro_batch: int | None = None,
    lora: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Calibrations and parameter counts of the traced copies of ``cfg`` (a JSON-ready cache entry).

    ``seq_len=None``: fitted at :data:`TRACE_SHAPES` (and a third shape where attention is quadratic) and
    checked at the held-out :data:`PROBE_SHAPE`; the entry's ``"form"`` records the fitted shapes, the
    probe's largest relative error and the config's :func:`length_steps`, from which
    :meth:`~lightning_memplan.model.traced.DepthTraces.untrusted_at` decides where the fit may be used.
    ``seq_len=s``: traced at ``(1, s)`` and ``(2, s)`` (exact at ``s``, linear in ``b``); with
    ``micro_batch=b`` (b > 2) at ``(1, s)`` and ``(b, s)``, exact at the requested shape (the bytes of a
    model whose fit was not trusted need not be linear in ``b`` either: Mamba's sequential scan on the CPU
    was 4.8% off at b=4 from a line through b=1 and b=2).

    Every copy run with SDPA: ``form["sdpa_keeps_scores"]`` is ``{device: bool}``, the rule's answer for
    :data:`SCORE_DEVICES` (absent for eager attention and in older entries).

    Blocks of more than one kind (model/hf_build.py ``layer_plan``) give one traced copy per kind
    (``"kinds"``: each with the count the config has), so every kind is counted as often as it occurs.

    ``lora``: peft ``LoraConfig`` keywords (``r``, ``target_modules``, ``lora_dropout``); every copy is
    traced with that adapter (:func:`with_lora_adapter`), its ``"n_trainable"`` the adapter's count.

    Raises:
        ValueError: the copy cannot be built, or its fake step fails (names the class and what to do).
    """
    from transformers.utils import logging as hf_logging

    from lightning_memplan.model.readers import norm_impl_of

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its notes about the traced copies (use_cache, loss_type) are not the user's
    out: dict[str, Any] = {"depths": {}}
    probe_error = 0.0
    kernels: list[dict[str, bool] | None] = []
    try:
        copies, plan = _stacks(cfg, t0, lora)
        for name, model, blocks in copies:
            record, error, kernel = _trace_copy(cfg, t0, model, blocks, seq_len=seq_len, micro_batch=micro_batch)
            probe_error = max(probe_error, error)
            kernels.append(kernel)
            if name in ("1", "2"):
                out["depths"][name] = record
            else:
                out.setdefault("stacks", {})[name] = record
            out["class"] = type(model).__name__
            # The class's RMSNorm implementation (composite fp32-upcast in most HF decoders): what a CPU
            # trace is scaled to another device with (hf_trace._on_device), since on CUDA the variants differ.
            out["norm_impl"] = norm_impl_of(model)
    finally:
        hf_logging.set_verbosity(verbosity)
    if plan is not None and plan.mixed and plan.path is not None:
        counts = plan.counts()
        out["kinds"] = [
            {"count": counts[k], "stack": "2" if k == 0 else f"k{k}", "label": plan.labels[k]}
            for k in range(len(plan.labels))
        ]
        out["n_params_full"] = plan.n_params
    if not out["depths"]["1"]["vision_tokens"]:
        out["form"] = _form(out, cfg, seq_len, probe_error, kernels)
    return out


def _trace_copy(cfg: Mapping[str, Any], t0: TracedStep, model: Any, blocks: tuple[int, ...], *, seq_len: int | None,
                micro_batch: int | None) -> tuple[dict[str, Any], float, dict[str, bool] | None]:
    """``(record, probe error, SDPA kernel rule)`` of one traced copy: its calibration at the fitted shapes
    (:func:`trace_depths`), the relative error of the fit at the held-out probe (0 without one), its
    parameter counts and blocks."""
    from lightning_memplan.model.hf_build import input_fn_for, vision_tokens
    from lightning_memplan.tracking.trace import calibrate, trace_memory

    input_fn, vision = input_fn_for(model, cfg)
    in_use = getattr(model.config, "_attn_implementation", t0.attention) or t0.attention
    shapes: tuple[tuple[int, int], ...] = TRACE_SHAPES
    extra: dict[str, Any] = {"quadratic": _quadratic_in_seq(cfg, t0, in_use)}
    probe: tuple[int, int] | None = PROBE_SHAPE
    kernel = _score_kernels(cfg, t0, in_use)
    if vision:
        s = vision_tokens(cfg)
        shapes, probe = ((1, s), (2, s)), None
        extra = {"quadratic": False, "seq_len": s}
    elif seq_len is not None:
        top = micro_batch if micro_batch is not None and micro_batch > 2 else 2
        shapes, probe = ((1, seq_len), (top, seq_len)), None
        extra = {"quadratic": False}
    kwargs: dict[str, Any] = {
        "input_fn": input_fn, "precision": t0.precision, "steps": 1, "device": t0.device,
        "optimizer": primed_optimizer(t0.optimizer, t0.optimizer_impl),
    }
    error = 0.0
    try:
        # A failed fake step cannot fall back to a real one: the copy's parameters are on the meta
        # device, so trace_memory raises instead of allocating.
        with fake_cpu_grouped_mm(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cal = calibrate(model, shapes, **kwargs, **extra)
            if probe is not None:
                held_out = trace_memory(model, batch_shape=probe, **kwargs)
                error = _probe_error(cal, held_out.by_phase, probe)
    except (ValueError, RuntimeError, TypeError, NotImplementedError, IndexError) as exc:
        raise ValueError(
            f"{type(model).__name__} (model_type={cfg.get('model_type')!r}) could not be traced under fake "
            f"tensors ({str(exc).splitlines()[0][:200]}); trace your model with trace_memory(model, "
            "batch_shape=(b, s)) or set LIGHTNING_MEMPLAN_HF_TRACE=0 for the analytic terms"
        ) from exc
    record = {
        "calibration": cal.to_dict(),
        "n_params": sum(p.numel() for p in model.parameters()),
        "n_trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "vision_tokens": extra.get("seq_len"),
        "blocks": list(blocks),
    }
    return record, error, kernel


def _form(out: Mapping[str, Any], cfg: Mapping[str, Any], seq_len: int | None, probe_error: float,
          kernels: list[dict[str, bool] | None]) -> dict[str, Any]:
    """The entry's ``"form"``: the fitted shapes, the probe and its error, the config's length steps, whether
    any coefficient is quadratic in s and, when every copy ran SDPA, its kernel rule per device."""
    form: dict[str, Any] = {
        "fitted": [list(shape) for shape in _fitted_shapes(out)],
        "probe": list(PROBE_SHAPE) if seq_len is None else None,
        "probe_error": probe_error if seq_len is None else None,
        "tolerance": PROBE_TOLERANCE,
        "steps": length_steps(cfg),
        "seq_len": seq_len,
        "quadratic": any(any(c[2] for comps in cal["calibration"]["coefficients"].values() for c in comps.values())
                         for cal in [out["depths"]["1"], out["depths"]["2"], *(out.get("stacks") or {}).values()]),
    }
    first = kernels[0] if kernels else None
    if first is not None and all(k == first for k in kernels):
        # Every copy ran SDPA: per device, whether its kernel keeps the [b, a, s, s] probabilities, so
        # whether the traced [s, s] tensors are the math path's (model/traced.py, _on_device).
        form["sdpa_keeps_scores"] = dict(first)
    return form


def _fitted_shapes(entry: Mapping[str, Any]) -> list[tuple[int, int]]:
    """The shapes the entry's depth-1 copy was fitted at."""
    return [tuple(s) for s in entry["depths"]["1"]["calibration"]["traced_shapes"]]  # type: ignore[misc]


def _probe_error(cal: Any, measured: Mapping[str, Mapping[str, int]], shape: tuple[int, int]) -> float:
    """Largest relative difference, over phases, between the fit at ``shape`` and the trace there."""
    worst = 0.0
    for phase, comps in measured.items():
        if phase not in cal.coefficients:
            continue
        actual = sum(comps.values())
        fitted = sum(cal.bytes_for(phase, comp, *shape) for comp in comps)
        if actual:
            worst = max(worst, abs(fitted - actual) / actual)
    return worst
