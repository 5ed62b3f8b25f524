"""Traced coefficients as data: what a coefficient source hands ``estimate_memory``, and how it is scaled.

A :class:`~lightning_memplan.model.specs.ModelSpec` may carry a :class:`CoefficientSource`
(``ModelSpec.calibration_source``), chosen by whoever built the spec (``ModelSpec.from_hf_config``,
``from_module``, ``from_dict``: the Hugging Face tracer of ``tracking/hf_trace.py`` when transformers
is importable). :func:`~lightning_memplan.model.estimate.estimate_memory` asks the source for the
coefficients of the step it traces (:class:`DepthTraces`, plain data) and scales them here; the model
layer imports no tracer and no transformers code (``tests/unit/test_estimate_snapshot.py`` checks it).

The data: :func:`trace_depths <lightning_memplan.tracking.hf_calibrate.trace_depths>` traces the
depth-1 and depth-2 copies of a model at :data:`TRACE_SHAPES`, giving per phase and component
``c0 + c1*(b*s) + c2*(b*s^2)``; :class:`DepthTraces` is that entry parsed, and
:meth:`DepthTraces.full_depth` the full model: per-block cost = depth 2 - depth 1, fixed cost
(embedding, head, loss) = depth 1 - per-block, so ``bytes(L) = bytes(1) + (L - 1) * (bytes(2) -
bytes(1))`` at the requested ``(b, s)``.

The scaling (:func:`traced_estimate`): the hand-written terms stay in charge of *how* a component
changes, the trace says *how big* it is. Each component of each phase is ``traced(T0, one rank) *
analytic(train, plan) / analytic(T0, one rank)``, where ``T0`` (:func:`traced_train`) is the step that
was traced (the source's device, the requested precision, attention and recompute ``"none"``/``"full"``,
an optimizer PyTorch ships, the model's own loss, no byte overrides) and the analytic terms use the exact
traced parameter count. So ZeRO/FSDP sharding, tensor/pipeline/context parallelism, selective recompute,
a chunked or vocab-parallel loss, CUDA kernels (traced on CPU when no GPU is visible),
``grads_alive_in_forward=False``, master weights and byte overrides scale the traced bytes by the
analytic ratio, and with ``plan=None`` and a traced ``train`` the estimate *is* the trace. A component
the analytic terms put at zero on one rank but not on the plan (DDP buckets, p2p buffers) is added.

The attention kernel is not a ratio: it decides whether the step keeps ``[b, a, s, s]`` probabilities
at all. The tracer records, per device, whether SDPA keeps them for this config
(``form["sdpa_keeps_scores"]``, from :func:`~lightning_memplan.tracking.hf_calibrate.sdpa_keeps_scores`:
on the CPU the math path for MLA's unequal head sizes and for attention dropout; on CUDA the
memory-efficient kernel for both). Where the trace device keeps them and the requested one does not, the
fitted ``"attention"`` component (the tensors whose last two sizes are ``[s, s]``: all of the math path's
``b*s^2`` bytes) is dropped before the device ratio, and the fused kernel's fp32 log-sum-exp
(:data:`~lightning_memplan.model.sizes.SDPA_LSE_BYTES` per token, head and block) is added to the activations
(:meth:`DepthTraces.drops_scores`, :func:`_on_device`; docs/concepts.md, "Which attention kernel").
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from lightning_memplan.model.result import COMPONENTS, PHASES, Calibration, MemoryEstimate
from lightning_memplan.model.sizes import SDPA_LSE_BYTES

if TYPE_CHECKING:  # annotations only: specs imports this module (the registry), not the other way round
    from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec

__all__ = [
    "CALIBRATION_CHOICES",
    "TRACED_DEPTHS",
    "TRACE_SHAPES",
    "CoefficientSource",
    "DepthTraces",
    "TracedStep",
    "coefficient_source",
    "register_coefficient_source",
    "traced_estimate",
    "traced_train",
]

#: Batch shapes ``(b, s)`` traced per depth (eager attention adds a third to separate ``b*s^2``).
TRACE_SHAPES: tuple[tuple[int, int], ...] = ((1, 64), (2, 128))
#: Depths traced; their difference is one block.
TRACED_DEPTHS = (1, 2)
#: What ``ModelSpec.from_hf_config(..., calibration=...)`` accepts besides a :class:`CoefficientSource`.
CALIBRATION_CHOICES = ("auto", "analytic")

#: The memory-efficient SDPA kernel allocates its logsumexp with the sequence padded to this multiple.
_LSE_ALIGN = 32

_TRACED_OPTIMIZERS = ("adamw", "adam", "sgd", "sgd_momentum")
_TRACED_RECOMPUTE = ("none", "full")


@dataclass(frozen=True, kw_only=True)
class TracedStep:
    """What of a training step the trace runs, and nothing else (so, with the config, the cache key).

    Everything else a :class:`~lightning_memplan.model.specs.TrainSpec` says (batch shape, loss mode,
    parallel plan, byte overrides ...) is applied by scaling the traced bytes, never traced; two
    steps that differ only there share one trace.

    Attributes:
        precision: the Lightning precision string emulated.
        attention: ``attn_implementation`` the copy is built with (``"sdpa"``, ``"eager"`` ...).
        recompute: ``"none"`` or ``"full"`` (HF ``gradient_checkpointing_enable()``).
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"`` or ``"sgd_momentum"``.
        optimizer_impl: ``None``, ``"foreach"``, ``"for_loop"`` or ``"fused"``.
        device: ``"cpu"`` or ``"cuda"`` (the device the fake step pretends to run on).
    """

    precision: str
    attention: str
    recompute: str
    optimizer: str
    optimizer_impl: str | None
    device: str

    @classmethod
    def of(cls, train: TrainSpec) -> TracedStep:
        """The traced fields of ``train`` (already a traced step ``T0``, :func:`traced_train`)."""
        return cls(precision=train.precision, attention=train.attention, recompute=train.recompute,
                   optimizer=train.optimizer, optimizer_impl=train.optimizer_impl, device=train.device)

    def to_json(self) -> str:
        """Sorted JSON of the fields and :data:`TRACE_SHAPES` (the cache key's step part)."""
        return json.dumps({**asdict(self), "trace_shapes": TRACE_SHAPES}, sort_keys=True)


@dataclass(frozen=True, kw_only=True)
class DepthTraces:
    """A parsed traced entry: the depth-1 and depth-2 calibrations of one config and traced step.

    Attributes:
        class_name: the class traced (``"LlamaForCausalLM"``).
        one, two: calibrations of the depth-1 and depth-2 copies.
        n_params_one, n_params_two: their parameter counts.
        vision_tokens: the sequence length a vision model's image fixes (``None`` for token inputs).
        norm_impl: the traced class's RMSNorm implementation (``TrainSpec.norm_impl``; ``"native"`` when
            it has none), detected by :func:`~lightning_memplan.model.readers.norm_impl_of`.
        n_trainable_one, n_trainable_two: trainable parameters of the two copies (``None``: every
            parameter trains, or an entry that does not say); fewer than their parameter counts when the
            copies carry a LoRA adapter (``ModelSpec.lora_rank``), whose frozen base weights the traced step
            gives no gradients or optimizer states.
    """

    class_name: str
    one: Calibration
    two: Calibration
    n_params_one: int
    n_params_two: int
    vision_tokens: int | None = None
    norm_impl: str = "native"
    #: Blocks of more than one kind: ``(count, calibration of [first block, first block of the kind],
    #: its parameter count)`` per kind, the first kind's copy being ``two``; empty when all are alike.
    kinds: tuple[tuple[int, Calibration, int], ...] = ()
    n_trainable_one: int | None = None
    n_trainable_two: int | None = None
    #: Trainable parameters of each kind's copy, in the order of ``kinds`` (empty: as ``n_trainable_two``).
    kinds_trainable: tuple[int, ...] = ()
    #: What the fit was made on and checked at (``None``: an entry of an older tracer, used everywhere as
    #: before): ``fitted`` shapes, held-out ``probe`` shape and its relative ``probe_error``, the probe
    #: ``tolerance``, the config's step ``steps`` (windows, chunks), and ``seq_len`` for an entry traced
    #: at one sequence length.
    form: Mapping[str, Any] | None = None
    #: This process's answers derived from the entry (:meth:`full_depth`, and the device scaling of
    #: :func:`traced_estimate`), keyed by what they depend on: a planner asks for the same ones under
    #: hundreds of plans. Read-only for callers; it goes with the entry when a cache drops it.
    memo: dict[tuple[Any, ...], Any] = field(default_factory=dict, init=False, compare=False, repr=False)

    @classmethod
    def from_entry(cls, data: Mapping[str, Any]) -> DepthTraces:
        """Parse a traced entry (``trace_depths``'s JSON; ``KeyError``/``TypeError``/``ValueError`` if malformed)."""
        one, two = (data["depths"][str(d)] for d in TRACED_DEPTHS)
        tokens = one.get("vision_tokens")
        kinds: list[tuple[int, Calibration, int]] = []
        kinds_trainable: list[int] = []
        for kind in data.get("kinds") or ():
            stack = two if kind["stack"] == "2" else data["stacks"][kind["stack"]]
            kinds.append((int(kind["count"]), Calibration.from_dict(stack["calibration"]), int(stack["n_params"])))
            kinds_trainable.append(int(stack.get("n_trainable", stack["n_params"])))
        form = data.get("form")
        return cls(
            class_name=str(data["class"]),
            one=Calibration.from_dict(one["calibration"]),
            two=Calibration.from_dict(two["calibration"]),
            n_params_one=int(one["n_params"]),
            n_params_two=int(two["n_params"]),
            vision_tokens=int(tokens) if tokens else None,
            norm_impl=str(data["norm_impl"]),
            kinds=tuple(kinds),
            form=dict(form) if isinstance(form, Mapping) else None,
            n_trainable_one=_trainable(one),
            n_trainable_two=_trainable(two),
            kinds_trainable=tuple(kinds_trainable),
        )

    def n_params(self, n_layers: int) -> int:
        """Parameters of the full-depth model: ``P(1) + (L - 1) * (P(2) - P(1))``; blocks of several kinds:
        ``P(1) - (P(2) - P(1)) + sum_k n_k * (P([first, k]) - P(1))`` (each kind as often as the config has it)."""
        if self.kinds:
            fixed = self.n_params_one - (self.n_params_two - self.n_params_one)
            return fixed + sum(n * (p - self.n_params_one) for n, _, p in self.kinds)
        return self.n_params_one + (n_layers - 1) * (self.n_params_two - self.n_params_one)

    def n_trainable(self, n_layers: int) -> int | None:
        """Trainable parameters of the full-depth model, by :meth:`n_params`'s rule over the copies'
        trainable counts; ``None`` when every traced parameter trains (no adapter)."""
        one, two = self.n_trainable_one, self.n_trainable_two
        if one is None or two is None or (one == self.n_params_one and two == self.n_params_two):
            return None
        if self.kinds:
            per_kind = self.kinds_trainable or tuple(two for _ in self.kinds)
            return one - (two - one) + sum(n * (t - one) for (n, _, _), t in zip(self.kinds, per_kind, strict=True))
        return one + (n_layers - 1) * (two - one)

    def untrusted_at(self, micro_batch: int, seq_len: int) -> str | None:
        """Why the fitted coefficients may not be used at ``(b, s)`` (``None``: they may).

        - an entry traced at one sequence length answers for that length only;
        - at a fitted shape the fit is exact;
        - when the held-out probe trace disagreed with the fit by more than the tolerance, the per-token
          bytes are not of the fitted form (chunk padding, a window crossed between traced shapes), so
          only the fitted shapes are answered;
        - a step of the config (sliding window, attention chunk, SSM chunk) at or past every checked
          length and below ``s`` may change the bytes per token where nothing was traced.
        """
        form = self.form
        if form is None or self.vision_tokens:
            return None
        if form.get("seq_len") is not None:
            return None if seq_len == form["seq_len"] else f"this entry was traced at s={form['seq_len']} only"
        fitted = [tuple(x) for x in form.get("fitted") or ()]
        if (micro_batch, seq_len) in fitted:
            return None
        error, tolerance = form.get("probe_error"), float(form.get("tolerance") or 0.0)
        probe = form.get("probe")
        if error is None or float(error) > tolerance:
            return (f"the held-out trace at (b, s)={tuple(probe or ())} differs from the fit at {fitted} by "
                    f"{float(error or 0.0):.2%} (> {tolerance:.2%}): the bytes per token are not of the fitted form")
        checked = max([s for _, s in fitted] + ([int(probe[1])] if probe else []))
        if form.get("quadratic") and seq_len > checked:
            # a b*s^2 term fitted at s <= checked is not extrapolated: its small-s error grows with s^2
            return f"s={seq_len} is beyond the traced s<={checked} of a fit with a b*s^2 term"
        steps = [int(x) for x in form.get("steps") or () if checked <= int(x) < seq_len]
        if steps:
            return f"s={seq_len} is past the config's step at s={steps[0]} (window/chunk), beyond the traced s<={checked}"
        return None

    def drops_scores(self, traced_on: str, device: str, seq_len: int, *, vocab_size: int | None = None) -> bool:
        """Whether the traced ``[s, s]`` tensors are attention probabilities the trace device's SDPA kernel
        keeps (its math path) and ``device``'s fused kernel does not, at ``seq_len``.

        ``form["sdpa_keeps_scores"]`` (``{device: bool}``, recorded by the tracer from
        :func:`~lightning_memplan.tracking.hf_calibrate.sdpa_keeps_scores`) says which device keeps them;
        an entry without it (eager attention, an older tracer) drops nothing. Nothing is dropped either
        past a window or chunk step of the config (``form["steps"]`` below ``seq_len``: transformers passes
        SDPA a ``[b, 1, s, s]`` mask, which CUDA's memory-efficient kernel keeps as its ``attn_bias``), or
        at ``seq_len == vocab_size``, where the tracker cannot tell ``[..., s, V]`` logits from
        ``[..., s, s]`` scores by their shape (the CPU's bytes are kept: an over-estimate).
        """
        form = self.form or {}
        keeps = form.get("sdpa_keeps_scores")
        if not isinstance(keeps, Mapping) or keeps.get(traced_on) is not True or keeps.get(device) is not False:
            return False
        if vocab_size is not None and seq_len == vocab_size:
            return False
        return not any(int(x) < seq_len for x in form.get("steps") or ())

    def without_scores(self) -> DepthTraces:
        """The same entry as a kernel that keeps no ``[s, s]`` tensor runs it (:meth:`drops_scores`): the
        ``"attention"`` component -- every tensor the tracker saw with last two sizes ``[s, s]``: the math
        path's probabilities, their gradients, dropout masks; all of the fit's math-path ``b*s^2`` bytes,
        and in an entry traced at one length (``form["seq_len"]``, fitted as ``c0 + c1*(b*s)``) the same
        bytes in its ``c1`` -- set to zero in every copy and phase. The other components keep their
        coefficients, ``b*s^2`` ones included: what they hold is no score tensor and stays with a fused
        kernel (DeepSeek-V3's fitted ``0.25*b*s^2`` activation bytes are measured in the fused-kernel step
        too, ``tests/unit/test_sdpa_kernel_scaling.py``). Memoised."""
        hit = self.memo.get(("without_scores",))
        if hit is not None:
            return hit  # type: ignore[no-any-return]

        def fused(cal: Calibration) -> Calibration:
            coefficients = {phase: {comp: (0.0, 0.0, 0.0) if comp == "attention" else c for comp, c in comps.items()}
                            for phase, comps in cal.coefficients.items()}
            return replace(cal, coefficients=coefficients)

        out = replace(self, one=fused(self.one), two=fused(self.two),
                      kinds=tuple((n, fused(cal), p) for n, cal, p in self.kinds))
        self.memo[("without_scores",)] = out
        return out

    def full_depth(self, n_layers: int, b: int, s: int) -> dict[str, dict[str, int]]:
        """``{phase: {component: bytes}}`` of the full-depth model at ``(b, s)`` (a vision model's ``s``
        is its image's token count whatever is passed). Memoised: the caller must not modify it.

        Blocks all alike: ``bytes(1) + (L - 1) * (bytes(2) - bytes(1))``. Blocks of several kinds: the
        fixed part ``bytes(1) - (bytes(2) - bytes(1))`` plus, per kind, its count times its block's bytes
        ``bytes([first, k]) - bytes(1)``."""
        if self.vision_tokens:
            s = self.vision_tokens  # the image fixes the sequence: only b scales
        hit = self.memo.get(("full_depth", n_layers, b, s))
        if hit is not None:
            return hit  # type: ignore[no-any-return]
        by_phase: dict[str, dict[str, int]] = {}
        for phase in PHASES:
            by_phase[phase] = {}
            for comp in COMPONENTS:
                v1, v2 = self.one.bytes_for(phase, comp, b, s), self.two.bytes_for(phase, comp, b, s)
                if self.kinds:
                    total = v1 - (v2 - v1) + sum(n * (cal.bytes_for(phase, comp, b, s) - v1) for n, cal, _ in self.kinds)
                else:
                    total = v1 + (n_layers - 1) * (v2 - v1)
                by_phase[phase][comp] = max(0, total)
        if len(self.memo) < 8192:
            self.memo[("full_depth", n_layers, b, s)] = by_phase
        return by_phase


def _trainable(record: Mapping[str, Any]) -> int | None:
    """A traced copy's trainable count (``None`` in an entry that does not record it)."""
    value = record.get("n_trainable")
    return None if value is None else int(value)


@runtime_checkable
class CoefficientSource(Protocol):
    """Where a spec's traced coefficients come from (``ModelSpec.calibration_source``).

    An implementation is hashable and compares by value (a frozen dataclass), since specs are cache keys.
    ``tracking/hf_trace.py``'s ``HFTraceSource`` traces the Hugging Face class of ``ModelSpec.hf_config``;
    a test may hand stored entries back (``tests/unit/test_estimate_snapshot.py``).
    """

    def available(self) -> bool:
        """Whether the source can answer now (``False``: the analytic terms are used)."""
        ...

    def trace_device(self, device: str) -> str:
        """The device a step requested on ``device`` is traced on (``"cuda"`` only where one is visible)."""
        ...

    def depth_traces(self, model: ModelSpec, t0: TrainSpec) -> DepthTraces | None:
        """The coefficients of ``model`` traced with the step ``t0`` (:func:`traced_train`); ``None``
        when the source has nothing for this spec (e.g. it carries no ``hf_config``).

        Raises:
            ValueError: the model cannot be traced (names it and what to pass instead).
        """
        ...


SourceFactory = Callable[[], "CoefficientSource | None"]
_FACTORIES: dict[str, SourceFactory] = {}


def register_coefficient_source(kind: str, factory: SourceFactory) -> None:
    """Register the factory of the default source for specs read from ``kind`` (``"hf_config"``).

    ``factory()`` returns a :class:`CoefficientSource`, or ``None`` when it cannot trace in this
    environment (e.g. transformers is not installed). The package's composition root
    (``lightning_memplan/__init__.py``) registers the Hugging Face tracer, since the model layer may not
    import it.

    Raises:
        TypeError: ``kind`` is not a string or ``factory`` is not callable.
    """
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"kind={kind!r} must be a non-empty string naming what specs are read from, e.g. 'hf_config'")
    if not callable(factory):
        raise TypeError(f"factory={factory!r} must be a callable returning a CoefficientSource or None")
    _FACTORIES[kind] = factory


def coefficient_source(calibration: Any, kind: str) -> CoefficientSource | None:
    """The source a spec read from ``kind`` carries for ``calibration``: ``"auto"`` (the registered
    factory's source, ``None`` when none is registered or it cannot trace here), ``"analytic"``
    (``None``: the hand-written terms) or a :class:`CoefficientSource` instance (itself).

    Raises:
        TypeError: ``calibration`` is neither one of :data:`CALIBRATION_CHOICES` nor a source.
    """
    if isinstance(calibration, str):
        if calibration == "auto":
            factory = _FACTORIES.get(kind)
            return factory() if factory is not None else None
        if calibration == "analytic":
            return None
    elif isinstance(calibration, CoefficientSource):
        return calibration
    raise TypeError(
        f"calibration={calibration!r:.80} must be 'auto' (trace the real class when transformers is installed), "
        "'analytic' (the hand-written terms) or a CoefficientSource (available(), trace_device(device), "
        "depth_traces(model, t0))"
    )


@functools.lru_cache(maxsize=4096)  # frozen input; the planner asks for the same few steps many times
def traced_train(train: TrainSpec, device: str) -> TrainSpec:
    """T0: the step a trace runs for ``train`` on ``device`` (see the module docstring)."""
    return train.replace(
        device=device,
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
        # the trace is a plain step: FSDP2's offloads are scaled in by the analytic terms
        offload=train.offload if train.framework == "deepspeed" else "none",
        offload_activations=False,
        # low precision: the trace runs the unquantized bf16/fp32 copy; quantized base weights and float8
        # linears are scaled in by the analytic terms (model/low_precision.py)
        base_weights=None,
        quantized_head=False,
        float8=None,
    )


def _steps(train: TrainSpec, source: CoefficientSource) -> tuple[TrainSpec, TrainSpec]:
    """``(T0, T0 on train's device)``."""
    return _steps_on(train, source.trace_device(train.device))


@functools.lru_cache(maxsize=4096)  # the planner asks for the same few steps under every plan
def _steps_on(train: TrainSpec, device: str) -> tuple[TrainSpec, TrainSpec]:
    t0 = traced_train(train, device)
    return t0, t0.replace(device=train.device)


@functools.lru_cache(maxsize=1024)
def _specs(model: ModelSpec, n_params: int, n_trainable: int | None) -> tuple[ModelSpec, ModelSpec]:
    """``(the spec with the traced parameter count, the same training what the trace trained)``: what
    the analytic terms see for the requested step and for the traced one (``n_trainable``: the traced
    copies' trainable count, ``None`` when every parameter trained; a LoRA trace's frozen base)."""
    base = replace(model, hf_config=None, n_params=n_params, calibration_source=None)
    return base, replace(base, n_trainable_params=n_trainable)


#: ``estimate_stage(model, train, plan, stage, rank, calibration)`` of ``model/estimate.py``: the
#: analytic terms of one pipeline stage (passed in, so that this module does not import the estimate).
StageEstimate = Callable[["ModelSpec", "TrainSpec", "ParallelPlan", int, int, "Calibration | None"], MemoryEstimate]


@functools.lru_cache(maxsize=4096)  # the same reference step under every plan a planner tries
def _one_rank_terms(spec: ModelSpec, train: TrainSpec, one_device: ParallelPlan,
                    stage_estimate: StageEstimate) -> MemoryEstimate:
    """The analytic terms of ``train`` on one rank (the denominators of the scaling): what
    ``estimate_memory(spec, train)`` returns for a spec without a source (one stage, rank 0)."""
    return stage_estimate(spec, train, one_device, 0, 0, None)


def _on_device(data: DepthTraces, model: ModelSpec, train: TrainSpec, traced_spec: ModelSpec,
               steps: tuple[TrainSpec, TrainSpec], one_device: ParallelPlan,
               stage_estimate: StageEstimate) -> dict[str, dict[str, int]]:
    """The traced bytes at the full depth and ``train``'s batch shape, on ``train``'s device: a step
    traced on the CPU for a CUDA one is scaled by the analytic CUDA/CPU ratio per component.

    Where the trace device's SDPA kernel keeps the ``[b, a, s, s]`` probabilities and ``train``'s does not
    (:meth:`DepthTraces.drops_scores`: MLA or attention dropout traced on the CPU for CUDA), the traced
    ``[s, s]`` tensors (the ``"attention"`` component, its ``b*s^2`` terms) are dropped first
    (:meth:`DepthTraces.without_scores`) and, after the ratio scaling, the fused kernel's fp32 log-sum-exp
    per (token, head) and block is added to the activations of the forward and backward phases."""
    t0, t0_dev = steps
    memo_key = ("on_device", model.n_layers, train.micro_batch, train.seq_len, t0_dev, traced_spec)
    hit = data.memo.get(memo_key)
    if hit is not None:
        return hit  # type: ignore[no-any-return]
    b, s = train.micro_batch, train.seq_len
    drop = t0.device != train.device and data.drops_scores(t0.device, train.device, s, vocab_size=model.vocab_size)
    traced = (data.without_scores() if drop else data).full_depth(model.n_layers, b, s)
    if t0.device != train.device:
        cpu_ref = _one_rank_terms(traced_spec, t0, one_device, stage_estimate)
        dev_ref = _one_rank_terms(traced_spec, t0_dev, one_device, stage_estimate)
        out: dict[str, dict[str, int]] = {}
        for phase in PHASES:
            out[phase] = {}
            for comp in COMPONENTS:
                value, den = traced[phase][comp], cpu_ref.by_phase[phase].get(comp, 0)
                num = dev_ref.by_phase[phase].get(comp, 0)
                out[phase][comp] = round(value * num / den) if den else value + num
        if drop:
            # What the fused kernel saves instead of the probabilities: q, k, v and the output, which the
            # math path's saved copies already counted, and one fp32 log-sum-exp per (token, head) per block
            # (tools/autograd/derivatives.yaml: _scaled_dot_product_efficient_attention), its sequence
            # padded to a multiple of 32 by the memory-efficient kernel (kAlignLSE, cuda/attention.cu;
            # flash's is unpadded: at most 31 tokens more). Every block is counted.
            lse = b * -(-s // _LSE_ALIGN) * _LSE_ALIGN * model.n_heads * SDPA_LSE_BYTES * model.n_layers
            for phase in ("forward", "backward"):
                out[phase]["activations"] = out[phase].get("activations", 0) + lse
        traced = out
    if len(data.memo) < 8192:
        data.memo[memo_key] = traced
    return traced


#: The phase whose traced / analytic ratio scales each component of a pipeline stage's backward: the
#: batch-dependent ones at the forward's peak (every activation and the logits alive, the same moment in the
#: trace and in the analytic terms), the states at the optimizer step (all of them exist then); the rest (the
#: block-backward workspace, communication buffers) are the stage's analytic bytes.
_PIPELINE_RATIO_PHASE = {"activations": "forward", "attention": "forward", "logits": "forward",
                         "params": "optimizer", "grads": "optimizer", "optimizer": "optimizer",
                         "master": "optimizer", "other": "optimizer"}


def _per_phase(traced: Mapping[str, Mapping[str, int]], reference: Mapping[str, Mapping[str, int]],
               target: Mapping[str, int], phase: str) -> dict[str, float]:
    """``traced * target / reference`` per component of ``phase`` (a component the reference lacks: added)."""
    out: dict[str, float] = {}
    for comp in COMPONENTS:
        value, den, num = traced[phase][comp], reference[phase].get(comp, 0), target.get(comp, 0)
        out[comp] = round(value * num / den) if den else value + num
    return out


def _pipeline_stage_scaled(traced: Mapping[str, Mapping[str, int]], reference: Mapping[str, Mapping[str, int]],
                           target: Mapping[str, int], phase: str) -> dict[str, float]:
    """One phase of a pipeline stage (``target``: its analytic components at that phase's peak) scaled by the
    trace. The forward and the optimizer step peak at the same moment in the trace, its analytic reference
    and a stage (the forward's end, the step), so they scale per phase (:func:`_per_phase`). The backward
    does not: the trace is one rank's whole step, whose backward peaks as the loss's backward starts, the
    analytic reference's at a block's backward beside every gradient, and a 1F1B stage's at a backward that
    holds several micro-batches; a ratio of those compares different moments (at pp=4 a stage's in-flight
    activations were scaled by the single rank's loss-time / end-of-backward activations, x4, and the head's
    logits were added to stages without a head: the traced estimate was 32-125 % over every stage of a
    Hugging Face Llama, 225-360 % interleaved). Each backward component is scaled instead by its ratio at
    the phase where the trace and the analytic terms hold the same tensors (:data:`_PIPELINE_RATIO_PHASE`);
    a component without one keeps the stage's analytic bytes."""
    if phase != "backward":
        return _per_phase(traced, reference, target, phase)
    out: dict[str, float] = {}
    for comp in COMPONENTS:
        num = target.get(comp, 0)
        at = _PIPELINE_RATIO_PHASE.get(comp)
        den = reference[at].get(comp, 0) if at is not None else 0
        out[comp] = round(num * traced[at][comp] / den) if at is not None and den else num
    return out


def _add_int8_kept_inputs(by_phase: dict[str, dict[str, int]], model: ModelSpec, target: MemoryEstimate) -> None:
    """A LoRA spec is traced with frozen linears that keep no input (``model/lora.py``); bitsandbytes' int8
    linears keep theirs (``MatMul8bitLt``: ``ctx.tensors = (CAt, subA, A)``), so the inputs no adapter
    keeps (``details["int8_kept_inputs"]``, ``model/quantized.int8_kept_inputs_bytes``) are added to the
    traced activations from the forward to the backward (in place)."""
    kept = target.details.get("int8_kept_inputs", 0) if model.lora_rank is not None else 0
    for phase in ("forward", "backward"):
        by_phase[phase]["activations"] += kept


def traced_estimate(
    model: ModelSpec,
    train: TrainSpec,
    plan: ParallelPlan,
    *,
    rank: int | None,
    source: CoefficientSource,
    stage_estimate: StageEstimate,
) -> MemoryEstimate | None:
    """The estimate of ``model`` scaled from ``source``'s traced coefficients (``source="hf_trace"``).

    The caller (``estimate_memory``) has validated the arguments and checked the plan against the spec.
    Returns ``None`` when the source has nothing for this spec, or the spec's exact ``n_params`` -- from
    a live module -- differs from the traced class's: the caller then uses the analytic terms.

    Raises:
        ValueError: the source cannot trace the model, or ``n_trainable_params`` exceeds the traced count.
    """
    steps = _steps(train, source)
    data = source.depth_traces(model, steps[0])
    if data is None:
        return None
    if train.norm_impl != data.norm_impl:
        # The config names a class, and its norms are what they are: the traced class's implementation
        # scales the CPU trace to CUDA (where fused and composite RMSNorms save different bytes).
        train = train.replace(norm_impl=data.norm_impl)
        steps = _steps(train, source)
    t0_dev = steps[1]
    n_params = data.n_params(model.n_layers)
    if model.n_params is not None and model.n_params != n_params:
        return None  # a live module that differs from its config (resized embeddings ...): not this trace
    if model.n_trainable_params is not None and model.n_trainable_params > n_params:
        raise ValueError(
            f"n_trainable_params={model.n_trainable_params!r} exceeds the {n_params} parameters traced for "
            f"{data.class_name!r}; pass at most {n_params}"
        )
    one_device = type(plan)()  # the default plan: one device (this module does not import specs)
    base, traced_spec = _specs(model, n_params, data.n_trainable(model.n_layers))
    traced = _on_device(data, model, train, traced_spec, steps, one_device, stage_estimate)
    # The trace is the answer on one rank of the traced step; anything else scales it by the analytic
    # ratio requested/traced per component (a component the traced step lacks is added).
    reference = None if (t0_dev == train and plan == one_device and base == traced_spec) else (
        _one_rank_terms(traced_spec, t0_dev, one_device, stage_estimate).by_phase
    )
    stages = [plan.stage_of_rank(rank)] if rank is not None else list(range(plan.pp))
    best: MemoryEstimate | None = None
    per_stage = plan.dp * plan.cp * plan.tp
    for stage in stages:
        r = rank if rank is not None else stage * per_stage
        target = stage_estimate(base, train, plan, stage, r, None)
        by_phase: dict[str, dict[str, int]] = {}
        for phase in PHASES:
            values: Mapping[str, float] = traced[phase]
            if reference is not None and plan.pp > 1:
                values = _pipeline_stage_scaled(traced, reference, target.by_phase[phase], phase)
            elif reference is not None:
                values = _per_phase(traced, reference, target.by_phase[phase], phase)
            by_phase[phase] = {comp: max(0, int(v)) for comp, v in values.items()}
        _add_int8_kept_inputs(by_phase, model, target)
        peak = max(PHASES, key=lambda p: sum(by_phase[p].values()))
        est = MemoryEstimate(
            **by_phase[peak],
            peak_phase=peak,
            rank=r,
            stage=stage,
            by_phase=by_phase,
            details={**target.details, "traced_params": n_params},
            source="hf_trace",
            host=target.host,  # offloaded bytes: the analytic terms' (model/offload.py, model/deepspeed.py)
        )
        if best is None or est.total > best.total:
            best = est
    return best
