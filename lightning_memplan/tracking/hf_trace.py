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
   at depth 1 and depth 2 (every per-layer list in the config truncated alike), in fp32
   (``model/hf_build.py``);
2. each copy is traced with :func:`~lightning_memplan.tracking.trace.calibrate` (one primed
   Lightning-order training step per batch shape under ``FakeTensorMode``: nothing is allocated,
   however large the width) at :data:`TRACE_SHAPES`, giving per phase and component
   ``c0 + c1*(b*s) + c2*(b*s^2)`` (``tracking/hf_calibrate.py``);
3. per-block cost = depth 2 - depth 1, fixed cost (embedding, head, loss) = depth 1 - per-block, and
   the full model is ``fixed + L * per_block``, evaluated at the requested ``(b, s)``;
4. the coefficients are cached in memory and on disk as JSON (atomic writes; by default under
   ``~/.cache/lightning_memplan/hf_trace``, :data:`CACHE_ENV` names another directory or ``"0"`` for
   memory only), keyed by the config JSON, the traced step, the torch and transformers versions and
   the tracer's source (``tracking/hf_cache.py``). A second process asking for the same config reads
   the entry instead of tracing.

This module is the entry point: when the path applies, which step ``T0`` is traced for a requested
step, and how the traced bytes are scaled to the requested step and plan.

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

Nothing here is a fallback to a real allocation: a config that cannot be built or traced raises
``ValueError`` naming the architecture and what to pass instead.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from dataclasses import replace

from lightning_memplan.model.hf_build import canonical_config_json, model_class, vision_tokens
from lightning_memplan.tracking.hf_cache import CACHE_ENV, cached, clear_cache, entry_key
from lightning_memplan.tracking.hf_calibrate import TRACE_SHAPES, DepthTraces, TracedStep, trace_depths
from lightning_memplan.model.result import COMPONENTS, PHASES, MemoryEstimate
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

#: Environment variable that, set to ``"0"``, turns the traced path off (the analytic terms are used).
DISABLE_ENV = "LIGHTNING_MEMPLAN_HF_TRACE"

_TRACED_OPTIMIZERS = ("adamw", "adam", "sgd", "sgd_momentum")
_TRACED_RECOMPUTE = ("none", "full")


def hf_trace_available() -> bool:
    """Whether the traced path can run: ``transformers`` is installed and :data:`DISABLE_ENV` is not ``"0"``."""
    if os.environ.get(DISABLE_ENV, "1").strip() == "0":
        return False
    return _transformers_installed()


@functools.lru_cache(maxsize=1)
def _transformers_installed() -> bool:
    return importlib.util.find_spec("transformers") is not None


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


@functools.lru_cache(maxsize=4096)  # the planner asks for the same (config, T0) under every plan
def _entry(config_json: str, t0: TrainSpec) -> tuple[str, TracedStep]:
    step = TracedStep.of(t0)
    return entry_key(config_json, step.to_json()), step


def _coefficients(spec: ModelSpec, t0: TrainSpec) -> DepthTraces:
    assert spec.hf_config is not None
    config_json = spec.hf_config
    key, step = _entry(config_json, t0)
    return cached(key, lambda: trace_depths(json.loads(config_json), step), DepthTraces.from_entry)


_ONE_DEVICE = ParallelPlan()


@functools.lru_cache(maxsize=4096)  # the planner asks for the same few steps under every plan
def _steps(train: TrainSpec) -> tuple[TrainSpec, TrainSpec]:
    """``(T0, T0 on train's device)``."""
    t0 = _traced_train(train)
    return t0, t0.replace(device=train.device)


@functools.lru_cache(maxsize=1024)
def _specs(model: ModelSpec, n_params: int) -> tuple[ModelSpec, ModelSpec]:
    """``(the spec with the traced parameter count, the same training every parameter)``: what the
    analytic terms see for the requested step and for the traced one."""
    base = replace(model, hf_config=None, n_params=n_params)
    return base, replace(base, n_trainable_params=None)


@functools.lru_cache(maxsize=4096)  # the same reference step under every plan a planner tries
def _one_rank_terms(spec: ModelSpec, train: TrainSpec) -> MemoryEstimate:
    """The analytic terms of ``train`` on one rank (the denominators of the scaling)."""
    from lightning_memplan.model.estimate import estimate_memory

    return estimate_memory(spec, train, _ONE_DEVICE)


def _on_device(data: DepthTraces, model: ModelSpec, train: TrainSpec, traced_spec: ModelSpec) -> dict[str, dict[str, int]]:
    """The traced bytes at the full depth and ``train``'s batch shape, on ``train``'s device: a step
    traced on the CPU for a CUDA one is scaled by the analytic CUDA/CPU ratio per component."""
    t0, t0_dev = _steps(train)
    memo_key = ("on_device", model.n_layers, train.micro_batch, train.seq_len, t0_dev, traced_spec)
    hit = data.memo.get(memo_key)
    if hit is not None:
        return hit  # type: ignore[no-any-return]
    traced = data.full_depth(model.n_layers, train.micro_batch, train.seq_len)
    if t0.device != train.device:
        cpu_ref, dev_ref = _one_rank_terms(traced_spec, t0), _one_rank_terms(traced_spec, t0_dev)
        out: dict[str, dict[str, int]] = {}
        for phase in PHASES:
            out[phase] = {}
            for comp in COMPONENTS:
                value, den = traced[phase][comp], cpu_ref.by_phase[phase].get(comp, 0)
                num = dev_ref.by_phase[phase].get(comp, 0)
                out[phase][comp] = round(value * num / den) if den else value + num
        traced = out
    if len(data.memo) < 8192:
        data.memo[memo_key] = traced
    return traced


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
    from lightning_memplan.model.estimate import _estimate_stage

    if model.hf_config is None or not hf_trace_available():
        return None
    plan = plan if plan is not None else _ONE_DEVICE
    t0, t0_dev = _steps(train)
    data = _coefficients(model, t0)
    if train.norm_impl != data.norm_impl:
        # The config names a class, and its norms are what they are: the traced class's implementation
        # scales the CPU trace to CUDA (where fused and composite RMSNorms save different bytes).
        train = train.replace(norm_impl=data.norm_impl)
        t0, t0_dev = _steps(train)
    n_params = data.n_params(model.n_layers)
    if model.n_params is not None and model.n_params != n_params:
        return None  # a live module that differs from its config (resized embeddings ...): not this trace
    if model.n_trainable_params is not None and model.n_trainable_params > n_params:
        raise ValueError(
            f"n_trainable_params={model.n_trainable_params!r} exceeds the {n_params} parameters traced for "
            f"{data.class_name!r}; pass at most {n_params}"
        )
    base, traced_spec = _specs(model, n_params)
    traced = _on_device(data, model, train, traced_spec)
    # The trace is the answer on one rank of the traced step; anything else scales it by the analytic
    # ratio requested/traced per component (a component the traced step lacks is added).
    reference = None if (t0_dev == train and plan == _ONE_DEVICE and base == traced_spec) else (
        _one_rank_terms(traced_spec, t0_dev).by_phase
    )
    stages = [plan.stage_of_rank(rank)] if rank is not None else list(range(plan.pp))
    best: MemoryEstimate | None = None
    per_stage = plan.dp * plan.cp * plan.tp
    for stage in stages:
        r = rank if rank is not None else stage * per_stage
        target = _estimate_stage(base, train, plan, stage, r, None)  # check_compatible ran on the caller's spec
        by_phase: dict[str, dict[str, int]] = {}
        for phase in PHASES:
            values = traced[phase]
            if reference is not None:
                den_phase, num_phase = reference[phase], target.by_phase[phase]
                values = {}
                for comp in COMPONENTS:
                    value, den, num = traced[phase][comp], den_phase.get(comp, 0), num_phase.get(comp, 0)
                    values[comp] = round(value * num / den) if den else value + num
            by_phase[phase] = {comp: max(0, int(v)) for comp, v in values.items()}
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
