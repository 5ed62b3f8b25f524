"""Config-only estimate traced from the real Hugging Face model class (``MemoryEstimate.source == "hf_trace"``).

Why: the hand-written terms (``model/terms.py``) describe a generic decoder; real Hugging Face models
differ in ways a shape cannot say (GPT-2's training KV cache, ``gelu_new``'s saved tensors, Gemma-2's
softcaps, q/k norms, the fp32-upcast loss keeping the 16-bit logits referenced, mixture-of-experts
routing, T5's decoder, ViT's patches). So when ``transformers`` is importable and a
:class:`~lightning_memplan.model.specs.ModelSpec` came from a Hugging Face config
(:meth:`ModelSpec.from_hf_config` keeps the config JSON in ``ModelSpec.hf_config``), the estimate is
traced instead:

1. the real model class (``config.architectures[0]``, else the first of the causal-LM, seq2seq,
   masked-LM and image-classification auto classes that knows the config) is built on the meta device
   at depth 1 and depth 2 (every per-layer list in the config truncated alike), in fp32;
2. each copy is traced with :func:`~lightning_memplan.model.trace.calibrate` (one Lightning-order
   training step per batch shape under ``FakeTensorMode``: nothing is allocated, however large the
   width) at :data:`TRACE_SHAPES`, giving per phase and component ``c0 + c1*(b*s) + c2*(b*s^2)``;
   the step starts from a primed steady state (:func:`_primed_optimizer`: the previous step's
   gradients and the optimizer states exist), so one traced step measures what the second of two
   would, at half the cost;
3. per-block cost = depth 2 - depth 1, fixed cost (embedding, head, loss) = depth 1 - per-block, and
   the full model is ``fixed + L * per_block``, evaluated at the requested ``(b, s)``;
4. the coefficients are cached in memory and, when the environment variable
   :data:`CACHE_ENV` names a directory, on disk as JSON (atomic writes), keyed by the config JSON, the
   traced training knobs and the torch and transformers versions.

Parallel plans and knobs the trace does not run: the hand-written terms stay in charge of *how* a
component changes, the trace says *how big* it is. Each component of each phase is
``traced(T0, one rank) * analytic(train, plan) / analytic(T0, one rank)``, where ``T0`` is the step
that was traced (CPU, the requested precision, attention and recompute ``"none"``/``"full"``, an
optimizer PyTorch ships, the model's own loss, no byte overrides) and the analytic terms use the exact
traced parameter count. So ZeRO/FSDP sharding, tensor/pipeline/context parallelism, selective
recompute, a chunked or vocab-parallel loss, CUDA kernels (traced on CPU when no GPU is visible),
``grads_alive_in_forward=False``, master weights and byte overrides scale the traced bytes by the
analytic ratio, and with ``plan=None`` and a traced ``train`` the estimate *is* the trace. A component
the analytic terms put at zero on one rank but not on the plan (DDP buckets, p2p buffers) is added.

Mixture-of-experts: transformers' default expert kernel is ``aten._grouped_mm``, whose meta kernel
implements only CUDA's bf16 checks, so a fake CPU trace fails where the real CPU step runs. During
the trace a fake kernel for fp32/fp16 CPU ``_grouped_mm`` is registered (same output shape, dtype and
strides as the CPU kernel; removed afterwards), so routed experts are traced without allocating.

Nothing here is a fallback to a real allocation: a config that cannot be built or traced raises
``ValueError`` naming the architecture and what to pass instead.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import threading
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning_memplan.model.result import COMPONENTS, PHASES, Calibration, MemoryEstimate
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec

__all__ = [
    "CACHE_ENV",
    "DISABLE_ENV",
    "TRACE_SHAPES",
    "canonical_config_json",
    "clear_cache",
    "hf_trace_available",
    "hf_trace_estimate",
    "model_class",
    "vision_tokens",
]

#: Environment variable naming a directory for the on-disk coefficient cache (unset: memory only).
CACHE_ENV = "LIGHTNING_MEMPLAN_HF_TRACE_CACHE"
#: Environment variable that, set to ``"0"``, turns the traced path off (the analytic terms are used).
DISABLE_ENV = "LIGHTNING_MEMPLAN_HF_TRACE"
#: Batch shapes ``(b, s)`` traced per depth (eager attention adds a third to separate ``b*s^2``).
TRACE_SHAPES: tuple[tuple[int, int], ...] = ((1, 64), (2, 128))
#: Depths traced; their difference is one block.
TRACED_DEPTHS = (1, 2)
#: Bump when what is traced changes, so stale on-disk entries are not read.
_CACHE_VERSION = 2

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_DECODER_LAYER_KEYS = ("num_decoder_layers", "decoder_layers")
_ENCODER_LAYER_KEYS = ("encoder_layers",)
# Keys that describe a run, not the architecture: left out of the cache key.
_VOLATILE_KEYS = ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "_commit_hash")
# Non-uniform layer stacks a depth-1/depth-2 pair cannot represent.
_NON_UNIFORM = ("first_k_dense_replace", "moe_layer_freq", "mlp_only_layers")
_TRACED_OPTIMIZERS = ("adamw", "adam", "sgd", "sgd_momentum")
_TRACED_RECOMPUTE = ("none", "full")
_AUTO_CLASSES = (
    "AutoModelForCausalLM",
    "AutoModelForSeq2SeqLM",
    "AutoModelForMaskedLM",
    "AutoModelForImageClassification",
)

_MEMORY: dict[str, dict[str, Any]] = {}
_LOCK = threading.Lock()


def hf_trace_available() -> bool:
    """Whether the traced path can run: ``transformers`` is installed and :data:`DISABLE_ENV` is not ``"0"``."""
    if os.environ.get(DISABLE_ENV, "1").strip() == "0":
        return False
    return _transformers_installed()


@functools.lru_cache(maxsize=1)
def _transformers_installed() -> bool:
    return importlib.util.find_spec("transformers") is not None


def clear_cache() -> None:
    """Forget the in-memory coefficients (the on-disk cache is left alone)."""
    with _LOCK:
        _MEMORY.clear()
        _PARSED.clear()


def canonical_config_json(config: Mapping[str, Any]) -> str:
    """The config as sorted, compact JSON without run-specific keys (the cache key's config part)."""
    clean = {k: v for k, v in config.items() if k not in _VOLATILE_KEYS}
    return json.dumps(clean, sort_keys=True, separators=(",", ":"), default=str)


@functools.lru_cache(maxsize=1)
def _versions() -> tuple[str, str]:
    import torch

    try:
        tf = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        tf = "absent"
    return str(torch.__version__), tf


# ------------------------------------------------------------------------------------ the model
def _depth_of(cfg: Mapping[str, Any]) -> tuple[str, int]:
    for key in _LAYER_KEYS:
        if isinstance(cfg.get(key), int) and not isinstance(cfg.get(key), bool):
            return key, int(cfg[key])
    raise ValueError(
        f"config (model_type={cfg.get('model_type')!r}) has none of {_LAYER_KEYS}, so its depth is unknown; "
        "pass a config with num_hidden_layers or build ModelSpec(...) directly"
    )


def _reduced_config(cfg: Mapping[str, Any], depth: int) -> dict[str, Any]:
    """``cfg`` with ``depth`` blocks: the depth keys set and every per-layer list truncated alike."""
    key, full = _depth_of(cfg)
    out = dict(cfg)
    model_type = cfg.get("model_type")
    for name in _NON_UNIFORM:
        value = cfg.get(name)
        if value not in (None, 0, 1, [], ()):
            raise ValueError(
                f"{model_type!r} config has {name}={value!r}: its layers are not all alike, so a depth-1/depth-2 "
                "trace cannot be scaled to the full depth; trace the model itself with trace_memory(model, "
                "batch_shape=(b, s)) or pass ModelSpec(..., n_params=...)"
            )
    if cfg.get("decoder_sparse_step") not in (None, 1):
        raise ValueError(
            f"{model_type!r} config has decoder_sparse_step={cfg['decoder_sparse_step']!r} (experts only every "
            "k-th layer): not uniform; trace the model itself with trace_memory(model, batch_shape=(b, s))"
        )
    decoder = [k for k in _DECODER_LAYER_KEYS if isinstance(cfg.get(k), int)]
    for k in decoder:
        if cfg[k] != full:
            raise ValueError(
                f"{model_type!r} config has {key}={full!r} encoder blocks but {k}={cfg[k]!r} decoder blocks; "
                "the traced path scales one encoder+decoder pair and needs them equal; trace the model itself "
                "with trace_memory(model, batch_shape=(b, s))"
            )
        out[k] = depth
    for k in _ENCODER_LAYER_KEYS:
        if isinstance(cfg.get(k), int):
            out[k] = depth
    out[key] = depth
    for name, value in cfg.items():
        if isinstance(value, list) and len(value) == full and name not in ("architectures",):
            out[name] = value[:depth]
    return out


def _config_object(cfg: Mapping[str, Any]) -> Any:
    from transformers import CONFIG_MAPPING

    model_type = cfg.get("model_type")
    if not model_type or model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"config model_type={model_type!r} is not an architecture the installed transformers knows; pass a "
            "config.json with a known model_type, or ModelSpec(n_layers, hidden, n_heads, vocab_size, n_params=...)"
        )
    data = {k: v for k, v in cfg.items() if k not in _VOLATILE_KEYS}
    return CONFIG_MAPPING[model_type].from_dict(data)


def model_class(config: Any) -> Any:
    """The transformers class a config is trained as: ``config.architectures[0]``, else the first auto
    class (causal LM, seq2seq, masked LM, image classification) that maps the config.

    Raises:
        ValueError: no class builds it (names the model type and what to pass instead).
    """
    import transformers

    for arch in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, str(arch), None)
        if isinstance(cls, type):
            return cls
    for auto in _AUTO_CLASSES:
        mapping = getattr(transformers, auto)._model_mapping
        with contextlib.suppress(KeyError, ValueError, AttributeError):
            if type(config) in mapping:
                return mapping[type(config)]
    raise ValueError(
        f"model_type={config.model_type!r}: no causal-LM, seq2seq, masked-LM or image-classification class in "
        "transformers builds it, so a config-only estimate cannot trace it; trace your model with "
        "trace_memory(model, example_input=batch) or pass ModelSpec(..., n_params=...)"
    )


def _build(cfg: Mapping[str, Any], depth: int, train: TrainSpec) -> Any:
    import torch

    config = _config_object(_reduced_config(cfg, depth))
    cls = model_class(config)
    kwargs: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": train.attention}
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = cls._from_config(config, **kwargs)
        except (ValueError, ImportError) as exc:
            if train.attention != "sdpa":
                raise ValueError(
                    f"{type(config).__name__} cannot be built with attn_implementation={train.attention!r} ({exc}); "
                    "use attention='sdpa'"
                ) from exc
            kwargs["attn_implementation"] = "eager"  # the model has no SDPA path: HF runs it eager
            model = cls._from_config(config, **kwargs)
    if train.recompute == "full":
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ValueError(
                f"{cls.__name__} does not support gradient_checkpointing_enable(), so recompute='full' is not "
                "how it trains; use recompute='none' or wrap its blocks and trace the model with trace_memory"
            )
        model.gradient_checkpointing_enable()
    return model


def _input_fn(model: Any, cfg: Mapping[str, Any]) -> tuple[Any, bool]:
    """``(input_fn(b, s) -> batch dict, is_vision)`` for the model's forward."""
    import torch

    params = inspect.signature(model.forward).parameters
    if "pixel_values" in params and "input_ids" not in params:
        size = cfg.get("image_size", 224)
        size = tuple(size) if isinstance(size, (list, tuple)) else (int(size), int(size))
        channels = int(cfg.get("num_channels", 3))
        labels = max(int(cfg.get("num_labels", len(cfg.get("id2label") or {}) or 2)), 1)

        def vision(b: int, s: int) -> dict[str, Any]:
            return {"pixel_values": torch.randn(b, channels, *size), "labels": torch.randint(0, labels, (b,))}

        return vision, True
    vocab = cfg.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise ValueError(
            f"{cfg.get('model_type')!r} config has vocab_size={vocab!r}; token ids cannot be drawn; pass a config "
            "with vocab_size or trace the model with trace_memory(model, example_input=batch)"
        )

    def tokens(b: int, s: int) -> dict[str, Any]:
        ids = torch.randint(0, vocab, (b, s))
        return {"input_ids": ids, "labels": ids}

    return tokens, False


def vision_tokens(cfg: Mapping[str, Any]) -> int:
    """Patches + 1 (the class token) of a ViT-style config: the sequence length its attention sees."""
    size = cfg.get("image_size", 224)
    patch = cfg.get("patch_size", 16)
    h, w = (size, size) if not isinstance(size, (list, tuple)) else size
    ph, pw = (patch, patch) if not isinstance(patch, (list, tuple)) else patch
    return (int(h) // int(ph)) * (int(w) // int(pw)) + 1


@contextlib.contextmanager
def _fake_cpu_grouped_mm() -> Iterator[None]:
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


# ------------------------------------------------------------------------------- tracing + cache
@functools.lru_cache(maxsize=4096)  # frozen input; the planner asks for the same few steps many times
def _traced_train(train: TrainSpec) -> TrainSpec:
    """T0: the step the trace runs for ``train`` (see the module docstring)."""
    return train.replace(
        device="cuda" if train.device == "cuda" and _cuda_ok() else "cpu",
        recompute=train.recompute if train.recompute in _TRACED_RECOMPUTE else "none",
        optimizer=train.optimizer if train.optimizer in _TRACED_OPTIMIZERS else "adamw",
        # "naive"/"fp32_upcast": the model computes its own loss, as traced; a replaced loss is scaled
        loss=train.loss if train.loss in ("naive", "fp32_upcast") else "fp32_upcast",
        master_weights=False,
        param_bytes=None,
        grad_bytes=None,
        master_bytes=None,
        optimizer_bytes_per_param=None,
        activation_bytes=None,
        grads_alive_in_forward=True,
        grad_accumulation=1,
    )


def _cuda_ok() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@functools.lru_cache(maxsize=1024)  # hashing the config JSON once per (config, traced step)
def _trace_key(config_json: str, t0: TrainSpec) -> str:
    torch_v, tf_v = _versions()
    knobs = {
        "v": _CACHE_VERSION,
        "torch": torch_v,
        "transformers": tf_v,
        "precision": t0.precision,
        "attention": t0.attention,
        "recompute": t0.recompute,
        "optimizer": t0.optimizer,
        "optimizer_impl": t0.optimizer_impl,
        "device": t0.device,
        "shapes": TRACE_SHAPES,
    }
    payload = json.dumps(knobs, sort_keys=True) + "\n" + config_json
    return hashlib.sha256(payload.encode()).hexdigest()


def _disk_path(key: str) -> Path | None:
    directory = os.environ.get(CACHE_ENV)
    return Path(directory) / f"hf_trace_{key}.json" if directory else None


def _read_disk(key: str) -> dict[str, Any] | None:
    path = _disk_path(key)
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("key") == key else None


def _write_disk(key: str, data: dict[str, Any]) -> None:
    path = _disk_path(key)
    if path is None:
        return
    from lightning_memplan.report.io import write_atomic

    with contextlib.suppress(OSError):
        write_atomic(path, json.dumps(data, sort_keys=True))


def _trace_depths(cfg: Mapping[str, Any], t0: TrainSpec) -> dict[str, Any]:
    """Calibrations and parameter counts of the depth-1 and depth-2 copies (JSON-ready)."""
    from transformers.utils import logging as hf_logging

    from lightning_memplan.model.trace import calibrate

    model_type = cfg.get("model_type")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its notes about the traced copies (use_cache, loss_type) are not the user's
    try:
        return _trace_each_depth(cfg, t0, calibrate, model_type)
    finally:
        hf_logging.set_verbosity(verbosity)


# Config keys of attention-probability dropout: CPU SDPA with dropout runs the math path, which saves the
# [b, a, s, s] probabilities, so those steps do grow with b*s^2.
_ATTENTION_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "dropout_rate")


def _quadratic_in_seq(cfg: Mapping[str, Any], t0: TrainSpec) -> bool | None:
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


def _primed_optimizer(name: str, impl: str | None) -> Any:
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

    from lightning_memplan.model.trace import make_optimizer

    def make(params: Any) -> Any:
        params = list(params)
        opt = make_optimizer(name, params, optimizer_impl=impl)
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        opt.step()
        return opt

    return make


def _trace_each_depth(cfg: Mapping[str, Any], t0: TrainSpec, calibrate: Any, model_type: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"depths": {}}
    for depth in TRACED_DEPTHS:
        model = _build(cfg, depth, t0)
        input_fn, vision = _input_fn(model, cfg)
        shapes = TRACE_SHAPES
        extra: dict[str, Any] = {"quadratic": _quadratic_in_seq(cfg, t0)}
        if vision:
            s = vision_tokens(cfg)
            shapes = ((1, s), (2, s))
            extra = {"quadratic": False, "seq_len": s}
        n_params = sum(p.numel() for p in model.parameters())
        n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        try:
            # A failed fake step cannot fall back to a real one: the copy's parameters are on the meta
            # device, so trace_memory raises instead of allocating.
            with _fake_cpu_grouped_mm(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                common = {"input_fn": input_fn, "precision": t0.precision, "device": t0.device, **extra}
                try:
                    cal = calibrate(
                        model, shapes, steps=1, optimizer=_primed_optimizer(t0.optimizer, t0.optimizer_impl),
                        **common,
                    )
                except ValueError:
                    # The primed step can put a shape's peak at a moment the other shape's step lacks
                    # (a tiny model whose optimizer phase peaks at its start); the two-step trace it
                    # shortcuts measures the same steady step without that shortcut.
                    cal = calibrate(
                        model, shapes, optimizer=t0.optimizer, optimizer_impl=t0.optimizer_impl, **common
                    )
        except (ValueError, RuntimeError, TypeError, NotImplementedError) as exc:
            raise ValueError(
                f"{type(model).__name__} (model_type={model_type!r}) could not be traced under fake tensors "
                f"({str(exc).splitlines()[0][:200]}); trace your model with trace_memory(model, batch_shape=(b, s)) "
                "or set LIGHTNING_MEMPLAN_HF_TRACE=0 for the analytic terms"
            ) from exc
        out["depths"][str(depth)] = {
            "calibration": cal.to_dict(),
            "n_params": n_params,
            "n_trainable": n_trainable,
            "vision_tokens": extra.get("seq_len"),
        }
        out["class"] = type(model).__name__
    return out


def _coefficients(spec: ModelSpec, t0: TrainSpec) -> dict[str, Any]:
    assert spec.hf_config is not None
    key = _trace_key(spec.hf_config, t0)
    with _LOCK:
        hit = _MEMORY.get(key)
    if hit is not None:
        return hit
    data = _read_disk(key)
    if data is None:
        cfg = json.loads(spec.hf_config)
        data = {"key": key, **_trace_depths(cfg, t0)}
        _write_disk(key, data)
    with _LOCK:
        _MEMORY[key] = data
    return data


_PARSED: dict[str, tuple[Calibration, Calibration]] = {}


def _calibrations(data: Mapping[str, Any]) -> tuple[Calibration, Calibration]:
    """The depth-1 and depth-2 :class:`Calibration` of a cache entry, parsed once."""
    key = str(data["key"])
    parsed = _PARSED.get(key)
    if parsed is None:
        one, two = (Calibration.from_dict(data["depths"][str(d)]["calibration"]) for d in TRACED_DEPTHS)
        parsed = _PARSED[key] = (one, two)
    return parsed


def _full_depth(data: Mapping[str, Any], n_layers: int, b: int, s: int) -> tuple[dict[str, dict[str, int]], int]:
    """``{phase: {component: bytes}}`` of the full-depth model at ``(b, s)``, and its parameter count."""
    one, two = (data["depths"][str(d)] for d in TRACED_DEPTHS)
    c1, c2 = _calibrations(data)
    if one.get("vision_tokens"):
        s = int(one["vision_tokens"])  # the image fixes the sequence: only b scales
    by_phase: dict[str, dict[str, int]] = {}
    for phase in PHASES:
        by_phase[phase] = {}
        for comp in COMPONENTS:
            v1, v2 = c1.bytes_for(phase, comp, b, s), c2.bytes_for(phase, comp, b, s)
            by_phase[phase][comp] = max(0, v1 + (n_layers - 1) * (v2 - v1))
    n_params = int(one["n_params"]) + (n_layers - 1) * (int(two["n_params"]) - int(one["n_params"]))
    return by_phase, n_params


def hf_trace_estimate(
    model: ModelSpec, train: TrainSpec, plan: ParallelPlan | None = None, *, rank: int | None = None
) -> MemoryEstimate | None:
    """The traced config-only estimate of a spec built by :meth:`ModelSpec.from_hf_config`.

    Returns ``None`` when the traced path does not apply (no ``hf_config`` on the spec, transformers not
    installed, :data:`DISABLE_ENV` is ``"0"``, or the spec's exact ``n_params`` -- from a live module --
    differs from the traced class's): the caller then uses the analytic terms.

    Raises:
        ValueError: the architecture cannot be built or traced (names it and what to pass instead).
    """
    from lightning_memplan.model.estimate import estimate_memory

    if model.hf_config is None or not hf_trace_available():
        return None
    plan = plan if plan is not None else ParallelPlan()
    t0 = _traced_train(train)
    data = _coefficients(model, t0)
    traced, n_params = _full_depth(data, model.n_layers, train.micro_batch, train.seq_len)
    if model.n_params is not None and model.n_params != n_params:
        return None  # a live module that differs from its config (resized embeddings ...): not this trace
    base = replace(model, hf_config=None, n_params=n_params)
    if base.n_trainable_params is not None and base.n_trainable_params > n_params:
        raise ValueError(
            f"n_trainable_params={base.n_trainable_params!r} exceeds the {n_params} parameters traced for "
            f"{data.get('class')!r}; pass at most {n_params}"
        )
    traced_spec = replace(base, n_trainable_params=None)  # the traced copy trains every parameter
    reference = estimate_memory(traced_spec, t0.replace(device=train.device), ParallelPlan())
    one_rank = t0.replace(device=train.device) == train and plan == ParallelPlan() and base == traced_spec
    cpu_ref = None
    if t0.device != train.device:  # traced on the CPU for a CUDA step: scale by the CUDA/CPU terms too
        cpu_ref = estimate_memory(traced_spec, t0, ParallelPlan())

    def scaled(target: MemoryEstimate) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for phase in PHASES:
            out[phase] = {}
            for comp in COMPONENTS:
                value = traced[phase][comp]
                if cpu_ref is not None:
                    den_cpu = cpu_ref.by_phase[phase].get(comp, 0)
                    num_dev = reference.by_phase[phase].get(comp, 0)
                    value = round(value * num_dev / den_cpu) if den_cpu else value + num_dev
                if not one_rank:
                    den = reference.by_phase[phase].get(comp, 0)
                    num = target.by_phase[phase].get(comp, 0)
                    value = round(value * num / den) if den else value + num
                out[phase][comp] = max(0, int(value))
        return out

    plan_obj = plan
    stages = [plan_obj.stage_of_rank(rank)] if rank is not None else list(range(plan_obj.pp))
    best: MemoryEstimate | None = None
    per_stage = plan_obj.dp * plan_obj.cp * plan_obj.tp
    for stage in stages:
        r = rank if rank is not None else stage * per_stage
        target = estimate_memory(base, train, plan_obj, rank=r)
        by_phase = scaled(target)
        peak = max(PHASES, key=lambda p: sum(by_phase[p].values()))
        est = MemoryEstimate(
            **by_phase[peak],
            peak_phase=peak,
            rank=r,
            stage=stage,
            by_phase=by_phase,
            details={**target.details, "traced_params": n_params},
            source="hf_trace",
        )
        if best is None or est.total > best.total:
            best = est
    return best
