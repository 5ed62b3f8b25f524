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

This module is the tracer's side of the traced path: :class:`HFTraceSource`, the
:class:`~lightning_memplan.model.traced.CoefficientSource` that ``ModelSpec.from_hf_config`` attaches
(``calibration="auto"``; the package root registers :func:`auto_source` as the ``"hf_config"`` factory).
``estimate_memory`` asks it for the coefficients of the step ``T0`` it traces
(:func:`~lightning_memplan.model.traced.traced_train`) and scales them with the hand-written terms
(``model/traced.py``, where the scaling rules are described): the model layer imports nothing from here.

Nothing here is a fallback to a real allocation: a config that cannot be built or traced raises
``ValueError`` naming the architecture and what to pass instead.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import warnings
from dataclasses import dataclass

from lightning_memplan.model.estimate import estimate_stage
from lightning_memplan.model.hf_build import canonical_config_json, model_class, vision_tokens
from lightning_memplan.model.lora import lora_adapter
from lightning_memplan.model.result import MemoryEstimate
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.model.traced import DepthTraces, TracedStep, traced_estimate
from lightning_memplan.tracking.hf_cache import CACHE_ENV, cached, clear_cache, entry_key
from lightning_memplan.tracking.hf_calibrate import TRACE_SHAPES, peft_available, trace_depths
from lightning_memplan.tracking.isolation import preserved_run_state

__all__ = [
    "CACHE_ENV",
    "DISABLE_ENV",
    "TRACE_SHAPES",
    "HFTraceSource",
    "auto_source",
    "canonical_config_json",
    "clear_cache",
    "hf_trace_available",
    "hf_trace_estimate",
    "model_class",
    "vision_tokens",
]

#: Environment variable that, set to ``"0"``, turns the traced path off (the analytic terms are used).
DISABLE_ENV = "LIGHTNING_MEMPLAN_HF_TRACE"


def hf_trace_available() -> bool:
    """Whether the traced path can run: ``transformers`` is installed and :data:`DISABLE_ENV` is not ``"0"``."""
    if os.environ.get(DISABLE_ENV, "1").strip() == "0":
        return False
    return _transformers_installed()


@functools.lru_cache(maxsize=1)
def _transformers_installed() -> bool:
    return importlib.util.find_spec("transformers") is not None


def _cuda_ok() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@functools.lru_cache(maxsize=4096)  # the planner asks for the same (config, T0) under every plan
def _entry(config_json: str, t0: TrainSpec, adapter_json: str | None) -> tuple[str, TracedStep, str]:
    """``(cache key, traced step, the step's key part)``; a LoRA adapter (its peft keywords as JSON) is
    part of what is traced, so of the key."""
    step = TracedStep.of(t0)
    knobs = step.to_json() + (f"\nlora={adapter_json}" if adapter_json is not None else "")
    return entry_key(config_json, knobs), step, knobs


def _adapter_json(model: ModelSpec) -> str | None:
    """The spec's LoRA adapter as sorted JSON (``None`` without one). Without peft installed the adapter
    cannot be traced: the base model is, with a warning (its frozen linears then keep full fine-tuning's
    saved inputs, a few percent high)."""
    adapter = lora_adapter(model)
    if adapter is None:
        return None
    if not peft_available():
        warnings.warn(
            "the spec carries a LoRA adapter (with_lora) but peft is not installed, so the config-only estimate "
            "traces the model without it: frozen layers are counted with full fine-tuning's saved inputs (a few "
            "percent high); pip install peft",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    return json.dumps(adapter, sort_keys=True)


@dataclass(frozen=True)
class HFTraceSource:
    """The traced coefficients of a spec's Hugging Face config (``ModelSpec.hf_config``): the real class
    built at depths 1 and 2 on the meta device and traced under fake tensors
    (:func:`~lightning_memplan.tracking.hf_calibrate.trace_depths`), through the memory and disk cache
    (``tracking/hf_cache.py``). Stateless: the config is the spec's own field (a spec whose ``hf_config``
    is replaced by ``None`` gets the analytic terms), so two sources are equal and hash alike."""

    def available(self) -> bool:
        """:func:`hf_trace_available`, asked when estimating (so :data:`DISABLE_ENV` applies then)."""
        return hf_trace_available()

    def trace_device(self, device: str) -> str:
        """``"cuda"`` for a CUDA step when a GPU is visible, else ``"cpu"`` (a fake step on the CPU)."""
        return "cuda" if device == "cuda" and _cuda_ok() else "cpu"

    def depth_traces(self, model: ModelSpec, t0: TrainSpec) -> DepthTraces | None:
        """The cached or freshly traced coefficients of ``model.hf_config`` at ``t0`` (``None`` without one).

        Raises:
            ValueError: the architecture cannot be built or traced (names it and what to pass instead).
        """
        config_json = model.hf_config
        if config_json is None:
            return None
        adapter_json = _adapter_json(model)
        lora = json.loads(adapter_json) if adapter_json is not None else None
        key, step, knobs = _entry(config_json, t0, adapter_json)
        with preserved_run_state():  # building and tracing the copies draws nothing from the run's streams
            return self._traces(config_json, t0, key, step, knobs, lora)

    @staticmethod
    def _traces(config_json: str, t0: TrainSpec, key: str, step: TracedStep, knobs: str,
                lora: dict[str, object] | None) -> DepthTraces:
        fitted = cached(key, lambda: trace_depths(json.loads(config_json), step, lora=lora), DepthTraces.from_entry)
        if fitted.untrusted_at(t0.micro_batch, t0.seq_len) is None:
            return fitted
        # The fit cannot be trusted at this shape (DepthTraces.untrusted_at says why): trace at the
        # requested shape (fake tensors: no memory, whatever b and s): (1, s) and (2, s), or (1, s) and
        # (b, s) for b > 2, so the answer is exact at the (b, s) asked for.
        s, b = t0.seq_len, t0.micro_batch
        wide = b if b > 2 else None
        at_s = entry_key(config_json, f"{knobs}\nseq_len={s}" + (f"\nmicro_batch={b}" if wide else ""))
        return cached(at_s, lambda: trace_depths(json.loads(config_json), step, seq_len=s, micro_batch=wide, lora=lora),
                      DepthTraces.from_entry)


def auto_source() -> HFTraceSource | None:
    """The source ``calibration="auto"`` attaches: :class:`HFTraceSource` when transformers is installed."""
    return HFTraceSource() if _transformers_installed() else None


def hf_trace_estimate(
    model: ModelSpec, train: TrainSpec, plan: ParallelPlan | None = None, *, rank: int | None = None
) -> MemoryEstimate | None:
    """The traced config-only estimate of a spec with an ``hf_config``, whatever source it carries.

    Returns ``None`` when the traced path does not apply (no ``hf_config`` on the spec, transformers not
    installed, :data:`DISABLE_ENV` is ``"0"``, or the spec's exact ``n_params`` -- from a live module --
    differs from the traced class's): the analytic terms then apply. ``estimate_memory`` does the same
    for a spec carrying :class:`HFTraceSource`.

    Raises:
        ValueError: the architecture cannot be built or traced (names it and what to pass instead).
    """
    if model.hf_config is None or not hf_trace_available():
        return None
    return traced_estimate(model, train, plan if plan is not None else ParallelPlan(), rank=rank,
                           source=HFTraceSource(), stage_estimate=estimate_stage)
