"""Inputs of the memory model: what the model is, how it is trained, how it is laid out.

All three are frozen, keyword-only dataclasses validated in ``__post_init__`` (as torchtitan's
``ParallelismConfig``, ``torchtitan/config/job_config.py``). Symbols follow docs/concepts.md: b micro-batch, s sequence length, h hidden, a heads, k kv-heads, L layers,
V vocab, f ffn hidden, N parameters, t/p/d/c tensor/pipeline/data/context parallel, m microbatches,
v virtual stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lightning_memplan.model import presets, readers
from lightning_memplan.model.experts import check_expert_fields
from lightning_memplan.model.float8 import FLOAT8_RECIPES
from lightning_memplan.model.frameworks import DEEPSPEED_OFFLOADS, FSDP2_OFFLOADS, ZeroConfig
from lightning_memplan.model.lora import check_lora_fields, lora_trainable_params
from lightning_memplan.model.param_counts import param_count
from lightning_memplan.model.quantized import BASE_WEIGHT_FORMATS, LOW_BIT_OPTIMIZERS
from lightning_memplan.model.traced import CoefficientSource, coefficient_source
from lightning_memplan.validation import MAX_WORLD_SIZE, divisor_hint, divisors, plain_scalar
from lightning_memplan.validation import check_bool as _check_bool
from lightning_memplan.validation import check_choice as _check_choice
from lightning_memplan.validation import check_int as _check_int
from lightning_memplan.validation import check_number as _check_number
from lightning_memplan.validation import check_str as _check_str

__all__ = [
    "ATTENTION_KINDS",
    "FFN_KINDS",
    "LOSS_MODES",
    "NORM_IMPLS",
    "NORM_KINDS",
    "OWN_UNITS",
    "OPTIMIZERS",
    "POSITION_KINDS",
    "PRECISIONS",
    "RECOMPUTE_MODES",
    "SCHEDULES",
    "DEVICES",
    "MAX_PIPELINE_CHUNKS",
    "ModelSpec",
    "ParallelPlan",
    "TrainSpec",
    "canonical_precision",
]

FFN_KINDS = ("gelu", "swiglu", "relu")
NORM_KINDS = ("layernorm", "rmsnorm")
#: How an RMSNorm is implemented (what autograd saves differs; ``lightning_memplan.model.terms.norm_saved_bytes``).
NORM_IMPLS = ("native", "composite", "composite_fp32")
POSITION_KINDS = ("learned", "rope", "none")
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
OPTIMIZERS = ("adamw", "adam", "adamw8bit", "sgd", "sgd_momentum", "adafactor", "lion", *LOW_BIT_OPTIMIZERS)
OPTIMIZER_IMPLS = ("foreach", "fused", "for_loop")
RECOMPUTE_MODES = ("none", "selective", "selective_op", "full")
ATTENTION_KINDS = ("sdpa", "eager")
LOSS_MODES = ("naive", "fp32_upcast", "chunked", "vocab_parallel", "loss_parallel")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
#: Parts besides the blocks that may be FSDP2 units of their own (``ParallelPlan.own_units``).
OWN_UNITS = ("embedding", "head")
DEVICES = ("cuda", "cpu")
#: Training stacks whose kernel and schedule facts the estimate knows (``lightning_memplan.model.frameworks``).
FRAMEWORK_NAMES = ("torch", "megatron", "llama3", "deepspeed", "fsdp1")

# Lightning accepts a few aliases for the same precision plugin; normalise to the canonical string.
_PRECISION_ALIASES = {
    "32": "32-true",
    "32-true": "32-true",
    "16": "16-mixed",
    "16-mixed": "16-mixed",
    "bf16": "bf16-mixed",
    "bf16-mixed": "bf16-mixed",
    "16-true": "16-true",
    "bf16-true": "bf16-true",
}


def canonical_precision(value: Any) -> str:
    """Lightning's canonical precision string for ``value`` (``"bf16"`` -> ``"bf16-mixed"``, ...).

    Raises:
        ValueError: ``value`` is not one of Lightning's precision strings or aliases.
    """
    canonical = _PRECISION_ALIASES.get(str(value))
    if canonical is None:
        raise ValueError(
            f"precision={value!r} is not a Lightning precision; use one of {', '.join(map(repr, PRECISIONS))}"
        )
    return canonical




#: Most pipeline chunks (``pp * virtual_stages``) a :class:`ParallelPlan` accepts: 8x the deepest published
#: pipeline (Megatron-LM's 1T-parameter run, 64 stages; Narayanan et al. 2021 Table 1), so the per-stage
#: estimate (each rank's schedule replayed, ``O(p v)`` steps; ``model/pipeline_timeline.py``) stays bounded.
MAX_PIPELINE_CHUNKS = 512


def _keep(spec: Any, name: str, value: Any) -> None:
    """Store a checked (plain) value on a frozen spec: what its ``__post_init__`` checks, it keeps."""
    object.__setattr__(spec, name, value)


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer (or, with ``n_params``, any model) for the memory model.

    Args:
        n_layers: L, number of transformer blocks.
        hidden: h, model width.
        n_heads: a, query heads.
        vocab_size: V, rows of the embedding / columns of the logits.
        n_kv_heads: k, key/value heads (GQA/MQA); ``None`` means ``n_heads`` (multi-head attention).
        head_dim: per-head width; ``None`` means ``hidden // n_heads``.
        ffn_hidden: f, inner width of the MLP; ``None`` means 4h for gelu/relu and Llama's
            ``256 * ceil((2/3 * 4h) / 256)`` for swiglu.
        ffn_kind: ``"gelu"`` (GPT-2: two matrices), ``"relu"`` or ``"swiglu"`` (Llama: three matrices).
        norm: ``"layernorm"`` (weight and bias) or ``"rmsnorm"`` (weight only).
        bias: whether the linear layers carry biases (GPT-2 yes, Llama no).
        tied_embeddings: the lm_head shares the embedding matrix (GPT-2, Gemma).
        position_embedding: ``"learned"`` adds a ``max_positions x h`` table, ``"rope"`` and ``"none"``
            add no parameters.
        max_positions: rows of a learned position table (required when it is ``"learned"``).
        dropout: dropout probability inside blocks; > 0 stores one byte-mask per dropped tensor.
        qkv_fused: q, k and v come from one fused projection (GPT-2's ``c_attn``) instead of three
            linears (Llama's ``q_proj``/``k_proj``/``v_proj``). Under autocast each linear saves its
            own 16-bit copy of its input, so three projections save the attention input three times.
        n_params: total parameter count override (e.g. for a non-transformer model or a module whose
            count is known exactly); ``None`` derives N from the shape (:func:`param_count`).
        name: free-form label shown in reports.
        hf_config: the Hugging Face config this spec was read from, as sorted JSON
            (:meth:`from_hf_config` sets it); with a ``calibration_source`` (what
            :meth:`from_hf_config` attaches when ``transformers`` is installed), :func:`estimate_memory`
            then traces the real model class (``tracking/hf_trace.py``, ``source="hf_trace"``) instead of
            using the hand-written activation terms. ``None``: the analytic terms.
        n_trainable_params: parameters that train (``requires_grad``); the rest are frozen (peft LoRA's
            base weights, frozen embeddings) and have no gradients, optimizer states or master copy.
            ``None`` means all of them train. :meth:`from_module` counts them; for a config-only
            LoRA estimate pass the adapter's count (peft's ``print_trainable_parameters()``) or use
            :meth:`with_lora`.
        frozen_layers, frozen_embedding, frozen_head: a frozen backbone without an adapter
            (``requires_grad=False`` set by hand): the leading blocks whose parameters are all frozen, and
            whether the embedding tables and the head (final norm and lm_head) are. Blocks no gradient
            reaches (the frozen ones when the embedding is frozen too) save no activations, and a frozen
            head or embedding has no gradient (``lightning_memplan.model.frozen``). :meth:`from_module`
            reads them; 0/False/False (the default): nothing frozen by layout.
        lora_rank, lora_targets, lora_dropout: the LoRA adapter :meth:`with_lora` describes (peft's ``r``,
            ``target_modules`` as a tuple, ``lora_dropout``); ``None``/``()``/``0.0`` without one. A spec
            with an ``hf_config`` is traced with peft's LoRA layers on those modules, so what the adapted
            and frozen linears save for backward is measured, not full fine-tuning's
            (``lightning_memplan.model.lora``). Not the MLA ranks ``q_lora_rank``/``kv_lora_rank`` below.
        qkv_bias: only the q/k/v projections carry biases (Qwen2); ``bias=True`` means every linear.
        extra_layer_params: parameters per block beyond the linears, their biases and two norms (Gemma-2's
            four norms per block, OLMo-2's and Qwen3's q/k norms); the config reader counts them.
        n_experts: E, routed experts per MoE block (Mixtral 8, DeepSeek-V3 256); 0 (default) is a dense
            model and every expert field below keeps its default. See ``lightning_memplan.model.experts``.
        experts_per_token: k, the router's top-k (Mixtral 2, DeepSeek-V3 8); required with ``n_experts``.
        expert_ffn_hidden: f_e, inner width of one routed expert; ``None`` means ``ffn`` (Mixtral). Dense
            blocks of an MoE stack use ``ffn_hidden`` (DeepSeek-V3 18432 dense, 2048 per expert).
        n_shared_experts: experts every token goes through besides its k routed ones (DeepSeek-V3 1,
            Qwen2-MoE and Llama-4 1, Mixtral 0).
        shared_expert_ffn_hidden: inner width of one shared expert; ``None`` means ``expert_ffn_hidden``.
        shared_expert_gate: the shared expert's output is scaled by a sigmoid gate, an ``[1, h]`` linear
            (Qwen2-MoE ``shared_expert_gate``).
        first_dense_layers: the first blocks are dense (DeepSeek-V3 ``first_k_dense_replace=3``).
        moe_layer_step: block i is MoE when ``(i + 1) % step == 0`` (Llama-4-Maverick
            ``interleave_moe_layer_step=2``, Qwen ``decoder_sparse_step``); 1: every block.
        dense_layers: explicit block indices that are dense (Qwen ``mlp_only_layers``), as a tuple.
            The router is an ``[E, h]`` linear (with a bias when ``bias=True``, as GPT-OSS's; its routed
            experts then carry biases too). Tensor parallelism splits each expert's width by t; expert
            parallelism is not modelled yet (a later ``ParallelPlan(ep=...)``).
        q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: multi-head latent
            attention (DeepSeek-V2/V3; set ``kv_lora_rank`` to turn it on): queries through a
            ``q_lora_rank`` bottleneck (``None``: one ``[a*(d_nope+d_rope), h]`` projection), keys and
            values through a ``kv_lora_rank`` latent plus a shared ``d_rope`` key; q/k heads are
            ``d_nope + d_rope`` wide (``head_dim`` is that when given), value heads ``v_head_dim``.
        buffer_bytes: bytes of the module's buffers (litgpt's RoPE ``cos``/``sin`` tables: ``2 x block_size
            x rope_n_elem`` values, built for the whole context whatever the batch's length), counted in
            ``other`` in every phase. Tensor parallelism and FSDP shard parameters, not buffers, so every
            rank holds all of them (every pipeline stage too: such tables live on the model's root, which each
            stage keeps). :meth:`from_module` reads them from a litgpt ``GPT`` as the module holds them; 0
            (default) for the other readers, whose models compute their rotary tables per step.
        calibration_source: where :func:`estimate_memory` takes traced coefficients from
            (:class:`~lightning_memplan.model.traced.CoefficientSource`, data handed over: the model
            layer runs no tracer). Whoever builds the spec chooses it: :meth:`from_hf_config`,
            :meth:`from_module` and :meth:`from_dict` attach the Hugging Face tracer (``calibration="auto"``)
            when transformers is installed; a spec built directly has none (the analytic terms). Not part
            of :meth:`to_dict` (JSON); ``dataclasses.replace`` keeps it.
    """

    n_layers: int
    hidden: int
    n_heads: int
    vocab_size: int
    n_kv_heads: int | None = field(default=None, kw_only=True)
    head_dim: int | None = field(default=None, kw_only=True)
    ffn_hidden: int | None = field(default=None, kw_only=True)
    ffn_kind: str = field(default="gelu", kw_only=True)
    norm: str = field(default="layernorm", kw_only=True)
    bias: bool = field(default=False, kw_only=True)
    tied_embeddings: bool = field(default=False, kw_only=True)
    position_embedding: str = field(default="rope", kw_only=True)
    max_positions: int | None = field(default=None, kw_only=True)
    dropout: float = field(default=0.0, kw_only=True)
    qkv_fused: bool = field(default=False, kw_only=True)
    n_params: int | None = field(default=None, kw_only=True)
    name: str | None = field(default=None, kw_only=True)
    hf_config: str | None = field(default=None, kw_only=True, repr=False)
    n_trainable_params: int | None = field(default=None, kw_only=True)
    frozen_layers: int = field(default=0, kw_only=True)
    frozen_embedding: bool = field(default=False, kw_only=True)
    frozen_head: bool = field(default=False, kw_only=True)
    lora_rank: int | None = field(default=None, kw_only=True)
    lora_targets: tuple[str, ...] = field(default=(), kw_only=True)
    lora_dropout: float = field(default=0.0, kw_only=True)
    qkv_bias: bool = field(default=False, kw_only=True)
    extra_layer_params: int = field(default=0, kw_only=True)
    n_experts: int = field(default=0, kw_only=True)
    experts_per_token: int | None = field(default=None, kw_only=True)
    expert_ffn_hidden: int | None = field(default=None, kw_only=True)
    n_shared_experts: int = field(default=0, kw_only=True)
    shared_expert_ffn_hidden: int | None = field(default=None, kw_only=True)
    shared_expert_gate: bool = field(default=False, kw_only=True)
    first_dense_layers: int = field(default=0, kw_only=True)
    moe_layer_step: int = field(default=1, kw_only=True)
    dense_layers: tuple[int, ...] = field(default=(), kw_only=True)
    q_lora_rank: int | None = field(default=None, kw_only=True)
    kv_lora_rank: int | None = field(default=None, kw_only=True)
    qk_nope_head_dim: int | None = field(default=None, kw_only=True)
    qk_rope_head_dim: int | None = field(default=None, kw_only=True)
    v_head_dim: int | None = field(default=None, kw_only=True)
    buffer_bytes: int = field(default=0, kw_only=True)
    calibration_source: CoefficientSource | None = field(default=None, kw_only=True, repr=False)

    def __post_init__(self) -> None:
        # every check returns the plain value (np.int64(2) -> 2, a 0-d tensor -> its item), stored back so
        # to_dict() is plain JSON with exact ints
        for name, hint in (("n_layers", "a transformer has at least one block"), ("hidden", ""), ("n_heads", ""),
                           ("vocab_size", "")):
            _keep(self, name, _check_int(name, getattr(self, name), hint=hint))
        _keep(self, "ffn_kind", _check_choice("ffn_kind", self.ffn_kind, FFN_KINDS))
        _keep(self, "norm", _check_choice("norm", self.norm, NORM_KINDS))
        _keep(self, "position_embedding", _check_choice("position_embedding", self.position_embedding, POSITION_KINDS))
        _keep(self, "name", _check_str("name", self.name, optional=True, hint="a label shown in reports, e.g. 'llama3-8b'"))
        if self.n_kv_heads is not None:
            _keep(self, "n_kv_heads", _check_int("n_kv_heads", self.n_kv_heads))
            if self.n_heads % self.n_kv_heads:
                raise ValueError(
                    f"n_kv_heads={self.n_kv_heads!r} must divide n_heads={self.n_heads!r} (GQA groups "
                    f"queries evenly); use {divisor_hint(self.n_heads)}"
                )
        if self.head_dim is not None:
            _keep(self, "head_dim", _check_int("head_dim", self.head_dim))
        elif self.hidden % self.n_heads and self.kv_lora_rank is None:  # MLA: dim_head is d_nope + d_rope
            raise ValueError(
                f"n_heads={self.n_heads!r} does not divide hidden={self.hidden!r}; pass head_dim= "
                f"explicitly or use n_heads {divisor_hint(self.hidden)}"
            )
        if self.ffn_hidden is not None:
            _keep(self, "ffn_hidden", _check_int("ffn_hidden", self.ffn_hidden))
        if self.position_embedding == "learned" and self.max_positions is None:
            raise ValueError(
                "max_positions=None but position_embedding='learned' needs the table size; pass "
                "max_positions= (e.g. 1024 for GPT-2) or position_embedding='rope'"
            )
        if self.max_positions is not None:
            _keep(self, "max_positions", _check_int("max_positions", self.max_positions))
        _keep(self, "dropout", _check_number("dropout", self.dropout, minimum=0.0, maximum=1.0, max_inclusive=False,
                                             hint="a probability in [0, 1), e.g. dropout=0.1"))
        _keep(self, "extra_layer_params", _check_int(
            "extra_layer_params", self.extra_layer_params, minimum=0,
            hint="parameters per block beyond the linears and two norms (0 for most models)"))
        _keep(self, "buffer_bytes", _check_int(
            "buffer_bytes", self.buffer_bytes, minimum=0,
            hint="bytes of the module's buffers, e.g. sum(b.nbytes for b in module.buffers()) (0: none)"))
        for name in ("bias", "tied_embeddings", "qkv_fused", "qkv_bias"):
            _keep(self, name, _check_bool(name, getattr(self, name)))
        for name, value in check_expert_fields(self).items():  # MoE / MLA (model/experts.py); dense: nothing
            _keep(self, name, value)
        if self.n_params is not None:
            _keep(self, "n_params", _check_int("n_params", self.n_params, hint="the total number of parameters"))
        if self.n_trainable_params is not None:
            _keep(self, "n_trainable_params", _check_int(
                "n_trainable_params", self.n_trainable_params, minimum=0,
                hint="the number of parameters with requires_grad=True"))
            if self.n_trainable_params > self.num_params:
                raise ValueError(
                    f"n_trainable_params={self.n_trainable_params!r} exceeds the {self.num_params} parameters of "
                    "the model; pass at most n_params (or None when everything trains)"
                )
        self._check_frozen()
        for name, value in check_lora_fields(self).items():  # the adapter with_lora describes; none: nothing
            _keep(self, name, value)
        if self.hf_config is not None and (not isinstance(self.hf_config, str) or not self.hf_config.startswith("{")):
            raise TypeError(
                f"hf_config={self.hf_config!r:.80} must be a Hugging Face config as a JSON object string (what "
                "ModelSpec.from_hf_config sets) or None"
            )
        self._check_calibration_source()

    def _check_frozen(self) -> None:
        """The frozen layout (``frozen_layers``, ``frozen_embedding``, ``frozen_head``): plain values, at
        most ``n_layers`` blocks, and something left to train."""
        _keep(self, "frozen_layers", _check_int(
            "frozen_layers", self.frozen_layers, minimum=0, maximum=self.n_layers,
            hint=f"the leading blocks whose parameters are all frozen, 0..n_layers={self.n_layers}"))
        for name in ("frozen_embedding", "frozen_head"):
            _keep(self, name, _check_bool(name, getattr(self, name)))
        if self.frozen_layers == self.n_layers and self.frozen_embedding and self.frozen_head:
            raise ValueError(
                f"frozen_layers={self.frozen_layers!r} with frozen_embedding=True and frozen_head=True freezes the "
                "whole model, which then does not train; leave the trained part out of the frozen fields"
            )

    def _check_calibration_source(self) -> None:
        source = self.calibration_source
        if source is None:
            return
        if not isinstance(source, CoefficientSource):
            raise TypeError(
                f"calibration_source={source!r:.80} must be a CoefficientSource (available(), trace_device(device), "
                "depth_traces(model, t0)) or None; ModelSpec.from_hf_config(config) attaches the traced one"
            )
        try:
            hash(source)
        except TypeError as exc:
            raise TypeError(
                f"calibration_source={source!r:.80} must be hashable (specs are cache keys); make it a frozen "
                "dataclass"
            ) from exc

    # Derived sizes -----------------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        """k: key/value heads (``n_heads`` without GQA)."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def dim_head(self) -> int:
        """Per-head width (of queries and keys: ``qk_nope_head_dim + qk_rope_head_dim`` under MLA)."""
        if self.head_dim is not None:
            return self.head_dim
        if self.kv_lora_rank is not None and self.qk_nope_head_dim is not None and self.qk_rope_head_dim is not None:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.hidden // self.n_heads

    @property
    def ffn(self) -> int:
        """f: inner MLP width (see ``ffn_hidden``)."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.ffn_kind == "swiglu":
            # Llama (Touvron et al. 2023, model.py FeedForward): 2/3 * 4h rounded up to a multiple of 256.
            return 256 * math.ceil(int(2 * 4 * self.hidden / 3) / 256)
        return 4 * self.hidden

    @property
    def expert_ffn(self) -> int:
        """f_e: inner width of one routed expert (``expert_ffn_hidden``, else ``ffn``)."""
        return self.expert_ffn_hidden if self.expert_ffn_hidden is not None else self.ffn

    @property
    def shared_expert_ffn(self) -> int:
        """f_s: inner width of one shared expert (``shared_expert_ffn_hidden``, else :attr:`expert_ffn`)."""
        return self.shared_expert_ffn_hidden if self.shared_expert_ffn_hidden is not None else self.expert_ffn

    @property
    def num_params(self) -> int:
        """N: total parameters (``n_params`` when given, else :func:`param_count`)."""
        if self.n_params is not None:
            return self.n_params
        return param_count(self)

    @property
    def trainable_fraction(self) -> float:
        """Share of the parameters that train: ``n_trainable_params / N`` (1.0 when it is ``None``)."""
        if self.n_trainable_params is None:
            return 1.0
        return self.n_trainable_params / self.num_params

    def with_lora(self, *, rank: int, targets: tuple[str, ...] = ("q_proj", "v_proj"),
                  dropout: float = 0.0) -> ModelSpec:
        """This spec with a LoRA adapter: ``rank`` r on the block linears named in ``targets`` (Hugging
        Face names, as peft's ``target_modules``), ``dropout`` peft's ``lora_dropout``.

        The trainable count (``n_trainable_params``) needs no peft (see
        :func:`~lightning_memplan.model.lora.lora_trainable_params`): the base weights become frozen (no
        gradients, optimizer states or master copy); the adapter's own weights (the same count, under 1%
        of N for usual ranks) are not added to N. The adapter is recorded (``lora_rank``,
        ``lora_targets``, ``lora_dropout``), so a spec from :meth:`from_hf_config` is traced with peft's
        LoRA layers (frozen linears save no input; ``lightning_memplan.model.lora``).
        """
        from dataclasses import replace

        return replace(self, n_trainable_params=lora_trainable_params(self, rank, targets), lora_rank=rank,
                       lora_targets=tuple(targets), lora_dropout=dropout)

    # Constructors --------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> ModelSpec:
        """A published architecture by name (``ModelSpec.preset("llama3-8b")``); see ``model.presets``.

        Raises:
            ValueError: unknown name, listing the known ones and the closest match.
        """
        return cls(**presets.preset_fields(name))

    @classmethod
    def from_hf_config(cls, config: Any, *, calibration: Any = "auto") -> ModelSpec:
        """From a Hugging Face ``PretrainedConfig`` or its ``config.json`` dict (Llama, Mistral, Qwen2,
        GPT-2, GPT-NeoX, Gemma, Phi, ... field names; :func:`~lightning_memplan.model.readers.hf_config_fields`).

        Args:
            config: the config object or dict.
            calibration: where :func:`estimate_memory` takes traced coefficients from (the spec's
                ``calibration_source``): ``"auto"`` (the Hugging Face tracer, ``tracking/hf_trace.py``,
                when transformers is installed; :data:`~lightning_memplan.tracking.hf_trace.DISABLE_ENV`
                set to ``"0"`` turns it off when estimating), ``"analytic"`` (none: the hand-written
                terms) or a :class:`~lightning_memplan.model.traced.CoefficientSource`.

        Raises:
            TypeError: ``config`` is not a mapping or config object, or ``calibration`` is not one of the above.
            ValueError: a required field is missing; or the architecture is one the analytic terms cannot
                model (mixture-of-experts, encoder-decoder, vision) and nothing traces it.
        """
        source = coefficient_source(calibration, "hf_config")
        reading = readers.hf_config_fields(config)
        if reading.analytic_gap is not None and (source is None or not source.available()):
            raise ValueError(
                f"model_type={reading.model_type!r} is {reading.analytic_gap}, which the analytic terms cannot model; "
                "install transformers (pip install transformers) for the traced config-only estimate, trace the model "
                "with trace_memory(model, example_input=batch), or pass ModelSpec(..., n_params=N) with the exact count"
            )
        if reading.fields.get("hf_config") is None:
            source = None  # nothing to trace (a nested text_config): the analytic terms
        elif reading.mixed_stack is not None and reading.analytic_gap is None:
            source = None  # blocks that differ (DeepSeek-V3's first dense ones): the analytic terms count each kind
        return cls(**reading.fields, calibration_source=source)

    @classmethod
    def from_module(cls, module: Any, *, calibration: Any = "auto") -> ModelSpec:
        """From a live ``nn.Module`` (a transformer is recognised by its repeated blocks, embedding and
        output head; anything else gets an exact ``n_params`` and needs :func:`trace_memory`); see
        :func:`~lightning_memplan.model.readers.module_fields`. A module carrying a Hugging Face config
        is read through :meth:`from_hf_config` (``calibration`` as there); its traced source is kept only
        when the config describes what runs (the bare transformers class, nothing frozen, no checkpointing).

        Raises:
            TypeError: ``module`` is not an ``nn.Module``.
            ValueError: it has no parameters.
        """
        from dataclasses import replace

        reading = readers.module_fields(module)
        if reading.config is None:
            return cls(**reading.fields)
        from_config = cls.from_hf_config(reading.config, calibration=calibration)
        keep = reading.config_describes_run
        return replace(from_config, hf_config=from_config.hf_config if keep else None,
                       calibration_source=from_config.calibration_source if keep else None, **reading.fields)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready values (``calibration_source`` left out: it is code, not data)."""
        from dataclasses import fields

        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "calibration_source"}
        for name in ("frozen_layers", "frozen_embedding", "frozen_head"):  # only a frozen layout has them
            if not out[name]:
                del out[name]
        out["dense_layers"] = list(self.dense_layers)  # JSON has lists; from_dict takes it back as a tuple
        out["lora_targets"] = list(self.lora_targets)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, calibration: Any = "auto") -> ModelSpec:
        """The inverse of :meth:`to_dict`; a spec that keeps an ``hf_config`` gets the source
        ``calibration`` names (as :meth:`from_hf_config`), so a JSON round trip estimates the same."""
        spec = cls(**data)
        if spec.hf_config is None or spec.calibration_source is not None:
            return spec
        from dataclasses import replace

        source = coefficient_source(calibration, "hf_config")
        return spec if source is None else replace(spec, calibration_source=source)


#: ``TrainSpec`` fields :meth:`TrainSpec.to_dict` leaves out at their defaults (``None`` / ``False``).
_LOW_PRECISION_FIELDS = ("base_weights", "float8", "quantized_head")


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """How one optimizer step runs: batch shape, precision, optimizer, recompute, attention and loss.

    Args:
        micro_batch: b, sequences per micro-batch on one data-parallel rank.
        seq_len: s, tokens per sequence.
        precision: Lightning's precision string: ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``,
            ``"16-true"``, ``"bf16-true"`` (aliases ``"32"``, ``"16"``, ``"bf16"`` accepted).
        optimizer: ``"adamw"``/``"adam"`` (2 states), ``"adamw8bit"`` (2 one-byte states),
            ``"sgd"`` (none), ``"sgd_momentum"`` (1 state), ``"adafactor"`` (factored, ~0 per param),
            ``"lion"`` (1 state); block-quantized and 16-bit Adam states as libraries keep them
            (``lightning_memplan.model.quantized``): ``"adamw4bit"`` (torchao ``AdamW4bit``: 4-bit states,
            a fp32 scale per 128 values), ``"adamw_fp8"`` (torchao ``AdamWFp8``: float8 states, a scale per
            256), ``"adamw_bf16"`` (two bf16 states: torchao ``_AdamW(bf16_stochastic_round=True)`` on bf16
            parameters), ``"paged_adamw8bit"`` / ``"paged_adamw"`` (bitsandbytes' paged optimizers: 8-bit
            / fp32 states in CUDA unified memory, counted in :attr:`MemoryEstimate.host`, not the device).
        optimizer_impl: ``"foreach"`` (PyTorch's default on CUDA: temporaries the size of the states),
            ``"fused"`` (no temporaries) or ``"for_loop"`` (one parameter's temporaries at a time; the
            default for CPU tensors).
        master_weights: keep an fp32 master copy of low-precision params (Megatron/DeepSpeed style).
        recompute: activation checkpointing: ``"none"``, ``"selective"`` (attention core recomputed;
            Korthikanti et al. 2022 section 5), ``"selective_op"`` (torchtitan's op-level policy: every
            second matmul output, attention outputs and collectives kept, the rest recomputed; see
            ``model/checkpointing.py``) or ``"full"`` (each block's input only).
        attention: ``"sdpa"`` (fused kernel: no [b, a, s, s] scores stored) or ``"eager"``
            (softmax scores stored: the 5as/h term).
        loss: ``"naive"`` (logits in the compute dtype, ``F.cross_entropy`` upcasts internally),
            ``"fp32_upcast"`` (an explicit ``logits.float()`` copy, as Hugging Face models do),
            ``"chunked"`` (only ``loss_chunk_size`` tokens of logits at a time), ``"vocab_parallel"``
            (each tensor-parallel rank holds V/t columns) or ``"loss_parallel"`` (PyTorch's
            ``loss_parallel()`` on DTensor logits sharded over the vocab, as torchtitan runs it).
        loss_chunk_size: tokens per chunk for ``loss="chunked"``; ``None`` means this project's
            ``chunk_size="auto"`` rule.
        grad_accumulation: micro-batches accumulated per optimizer step (gradients persist across them).
        param_bytes, grad_bytes, master_bytes: bytes per element overriding the precision plugin's.
        optimizer_bytes_per_param: bytes of optimizer state per parameter overriding ``optimizer``.
        activation_bytes: bytes per activation element overriding the precision's compute dtype.
        grads_alive_in_forward: whether the previous step's gradients still exist during forward.
            Lightning's automatic optimisation calls ``zero_grad(set_to_none=True)`` after
            ``training_step`` and before ``backward``, so they do (``True``); a loop that zeroes grads
            before the forward should pass ``False``.
        device: the device type the step runs on (a description, not a query). Kernels differ:
            ``"cuda"`` has a fused RMSNorm (saves its input and rstd) and autocast runs softmax in
            fp32; on ``"cpu"`` RMSNorm is composite (saves an fp32 copy of its input and the fp32
            normalised tensor) and autocast leaves softmax in bf16.
        norm_impl: how the RMSNorms are implemented (LayerNorm is always ``native_layer_norm``):
            ``"native"`` (``torch.nn.RMSNorm``/``F.rms_norm``: what ``device`` runs, see above),
            ``"composite"`` (a Python RMSNorm that upcasts to fp32 and casts the normalised tensor back
            to the input dtype before the weight multiply, as Hugging Face's ``LlamaRMSNorm`` and its
            ~100 copies and torchtune's ``RMSNorm`` do: saves an fp32 copy of its input, the fp32 rstd
            and the normalised tensor in the input dtype) or ``"composite_fp32"`` (one that multiplies
            by the weight in fp32, as Gemma's, OLMo-2's and litgpt's do: the fp32 input copy, rstd and
            the fp32 normalised tensor). ``spec_from_module``'s companion
            :func:`~lightning_memplan.model.introspect.norm_impl_of` detects it from a module.
        framework: the training stack the step runs on (a description): ``"torch"`` (what memplan_auto
            runs: DTensor TP/SP, torch.distributed.pipelining, FSDP2), ``"megatron"`` (Megatron-LM's
            kernels: sequence-parallel linears save their 1/t shard) or ``"llama3"`` (Llama 3's stack,
            arXiv 2407.21783 section 3.3.2: Megatron-style SP, FSDP reduce-scattering every
            micro-batch's gradients, first and last pipeline stage one block lighter) or ``"deepspeed"``
            (DeepSpeed's ZeRO engine, ``ParallelPlan.zero`` its stage: 16-bit parameters and gradients,
            fp32 master weights and optimizer states, its buckets; ``lightning_memplan.model.deepspeed``)
            or ``"fsdp1"`` (torch's kernels under FSDP1, Lightning's ``FSDPStrategy``: one padded
            ``FlatParameter`` per unit); see ``lightning_memplan.model.frameworks``.
        offload: what moves to host memory. ``framework="deepspeed"``: ZeRO-Offload, ``"none"``,
            ``"optimizer"`` (``offload_optimizer.device="cpu"``: fp32 master weights, optimizer states and
            fp32 gradients in host memory, the step on the CPU; ZeRO stage >= 1) or ``"params"`` (also
            ``offload_param``: the 16-bit parameter partitions in host memory; ZeRO-3 only).
            ``framework="torch"`` (memplan_auto's FSDP2): ``"none"`` or ``"params"``, FSDP2's
            ``fully_shard(offload_policy=CPUOffloadPolicy())``: sharded parameters, gradients and
            optimizer states in pinned host memory, the optimizer step on the CPU (ZeRO 2/3, or one
            data-parallel rank; ``lightning_memplan.model.offload``). The host bytes are
            :attr:`MemoryEstimate.host`, not part of the device total.
        offload_activations: activation offloading (``framework="torch"``, ``recompute="none"``): every
            block runs under ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` (torch's
            ``offload_wrapper``), so the tensors the blocks save for backward live in host memory and the
            device keeps one block's working set (``lightning_memplan.model.offload``).
        zero_config: DeepSpeed's bucket and stage-3 sizes (:class:`~lightning_memplan.model.frameworks.
            ZeroConfig`; a mapping of its fields is accepted); ``None`` means DeepSpeed's defaults.
            ``framework="deepspeed"`` only.
        base_weights: how the frozen base weights of a LoRA model are stored (QLoRA): ``None`` (in the
            parameter dtype), ``"nf4"``/``"fp4"`` (bitsandbytes 4-bit: half a byte per value and a fp32
            absmax per 64), ``"nf4-dq"``/``"fp4-dq"`` (double quantisation: the absmaxes in 8 bits, a fp32
            scale per 256 of them) or ``"int8"`` (bitsandbytes ``Linear8bitLt``: int8 values, a fp32 scale
            per row), Lightning's ``BitsandbytesPrecision`` modes. The blocks' linears are quantized;
            embeddings, norms and the lm_head are not (transformers' ``BitsAndBytesConfig``); each
            quantized linear rebuilds its weight while it runs (``lightning_memplan.model.quantized``).
            Needs ``framework="torch"`` and no tensor parallelism; DDP and FSDP2 (``zero`` 2 or 3: the
            packed 4-bit values stored in the parameter dtype, bitsandbytes' ``quant_storage``, are sharded;
            each layer's ``QuantState`` stays whole on every rank) are modelled; ``"int8"`` is not sharded.
        quantized_head: the lm_head is quantized too (``base_weights`` needed): Lightning's
            ``BitsandbytesPrecision`` replaces every ``nn.Linear`` not in its ``ignore_modules``, the head
            included (``lightning/fabric/plugins/precision/bitsandbytes.py`` ``_convert_layers``);
            transformers' ``BitsAndBytesConfig`` and peft leave it unquantized (the default, ``False``).
        float8: torchao float8 training of the blocks' linears, as torchtitan runs it (compiled casts):
            ``None``, ``"tensorwise"`` (one scale per tensor; under FSDP2 the weights are all-gathered in
            float8) or ``"rowwise"`` (one scale per row). The linears save their bf16 inputs as a bf16 step
            does; the float8 copies are transients (``lightning_memplan.model.float8``). Needs a bf16
            precision and ``framework="torch"``.
    """

    micro_batch: int
    seq_len: int
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    optimizer_impl: str = "foreach"
    master_weights: bool = False
    recompute: str = "none"
    attention: str = "sdpa"
    loss: str = "naive"
    loss_chunk_size: int | None = None
    grad_accumulation: int = 1
    param_bytes: int | None = None
    grad_bytes: int | None = None
    master_bytes: int | None = None
    optimizer_bytes_per_param: float | None = None
    activation_bytes: int | None = None
    grads_alive_in_forward: bool = True
    device: str = "cuda"
    framework: str = "torch"
    norm_impl: str = "native"
    offload: str = "none"
    zero_config: ZeroConfig | None = None
    offload_activations: bool = False
    base_weights: str | None = None
    float8: str | None = None
    quantized_head: bool = False

    def __post_init__(self) -> None:
        # checked values stored back plain (np.int64 -> int), so to_dict() is JSON with exact ints
        choices: tuple[str, ...]
        for name, choices in (("device", DEVICES), ("norm_impl", NORM_IMPLS), ("framework", FRAMEWORK_NAMES)):
            _keep(self, name, _check_choice(name, getattr(self, name), choices))
        _keep(self, "micro_batch", _check_int("micro_batch", self.micro_batch))
        _keep(self, "seq_len", _check_int("seq_len", self.seq_len))
        _keep(self, "precision", canonical_precision(self.precision))
        for name, choices in (("optimizer", OPTIMIZERS), ("optimizer_impl", OPTIMIZER_IMPLS),
                              ("recompute", RECOMPUTE_MODES), ("attention", ATTENTION_KINDS), ("loss", LOSS_MODES)):
            _keep(self, name, _check_choice(name, getattr(self, name), choices))
        if self.loss_chunk_size is not None:
            _keep(self, "loss_chunk_size",
                  _check_int("loss_chunk_size", self.loss_chunk_size, hint="tokens per loss chunk, e.g. 1024"))
        _keep(self, "grad_accumulation", _check_int("grad_accumulation", self.grad_accumulation))
        for name in ("param_bytes", "grad_bytes", "master_bytes", "activation_bytes"):
            value = getattr(self, name)
            if value is not None:
                _keep(self, name, _check_int(name, value, hint="bytes per element, e.g. 2 for bf16 or 4 for fp32"))
        if self.optimizer_bytes_per_param is not None:
            _keep(self, "optimizer_bytes_per_param", _check_number(
                "optimizer_bytes_per_param", self.optimizer_bytes_per_param, minimum=0.0, min_inclusive=False,
                hint="e.g. 8 for Adam's two fp32 states; use optimizer='sgd' for a stateless optimizer",
            ))
        for name in ("master_weights", "grads_alive_in_forward", "offload_activations", "quantized_head"):
            _keep(self, name, _check_bool(name, getattr(self, name)))
        self._check_deepspeed()
        self._check_torch_offload()
        self._check_low_precision()

    def _check_low_precision(self) -> None:
        """``base_weights`` (QLoRA) and ``float8`` (torchao): one of the known formats, on the stack they
        are modelled for (``framework="torch"``), float8 under a bf16 precision, not both at once."""
        for name, choices in (("base_weights", BASE_WEIGHT_FORMATS), ("float8", FLOAT8_RECIPES)):
            value = getattr(self, name)
            if value is not None:
                _keep(self, name, _check_choice(name, value, choices))
                if self.framework != "torch":
                    raise ValueError(
                        f"{name}={value!r} needs framework='torch' (got framework={self.framework!r}): it is "
                        f"modelled as bitsandbytes / torchao run under PyTorch; pass framework='torch' or {name}=None"
                    )
        if self.base_weights is not None and self.float8 is not None:
            raise ValueError(
                f"base_weights={self.base_weights!r} and float8={self.float8!r} together are not modelled "
                "(quantized frozen weights and float8 matmuls); choose one of them"
            )
        if self.quantized_head and self.base_weights is None:
            raise ValueError(
                "quantized_head=True needs base_weights (got base_weights=None): it says the lm_head is stored "
                "quantized like the blocks' linears; pass base_weights='nf4' (or another format) or quantized_head=False"
            )
        if self.float8 is not None and self.precision not in ("bf16-mixed", "bf16-true"):
            raise ValueError(
                f"float8={self.float8!r} needs a bf16 precision (got precision={self.precision!r}): torchao's "
                "float8 linears cast from bf16 activations; use precision='bf16-mixed' or 'bf16-true'"
            )

    def _check_torch_offload(self) -> None:
        """FSDP2's offloads (``framework="torch"``): ``offload`` ``"none"``/``"params"``; activation offloading
        without activation checkpointing (inside a non-reentrant checkpoint region torch's own
        saved-tensor hooks take the saved tensors, so ``save_on_cpu`` around it would move nothing:
        ``torch/utils/checkpoint.py``, ``_checkpoint_hook``)."""
        if self.framework == "torch" and self.offload not in FSDP2_OFFLOADS:
            raise ValueError(
                f"offload={self.offload!r} needs framework='deepspeed' (got framework='torch'): FSDP2's "
                "CPUOffloadPolicy moves parameters, gradients and optimizer states together; use offload='params' "
                "for it, or framework='deepspeed' for ZeRO-Offload of the optimizer alone"
            )
        if not self.offload_activations:
            return
        if self.framework != "torch":
            raise ValueError(
                f"offload_activations=True needs framework='torch' (got framework={self.framework!r}): activation "
                "offloading is modelled as memplan_auto applies it (torch's save_on_cpu around every block); "
                "pass framework='torch' or offload_activations=False"
            )
        if self.recompute != "none":
            raise ValueError(
                f"offload_activations=True needs recompute='none' (got recompute={self.recompute!r}): inside a "
                "checkpointed block torch's checkpoint hooks take the saved tensors, so nothing would be "
                "offloaded; choose one: recompute='none' with offload_activations=True, or offload_activations=False"
            )

    def _check_deepspeed(self) -> None:
        """``offload`` and ``zero_config`` describe DeepSpeed's engine (``offload="params"`` is also FSDP2's
        CPUOffloadPolicy under ``framework="torch"``): refused for any other framework."""
        _keep(self, "offload", _check_choice("offload", self.offload, DEEPSPEED_OFFLOADS))
        config = self.zero_config
        if config is not None and not isinstance(config, ZeroConfig):
            if not isinstance(config, dict):
                raise TypeError(
                    f"zero_config={config!r} must be a ZeroConfig (lightning_memplan.model.frameworks) or a dict "
                    "of its fields, or None for DeepSpeed's defaults"
                )
            _keep(self, "zero_config", ZeroConfig.from_dict(config))
        if self.framework != "deepspeed":
            if self.offload != "none" and self.framework != "torch":  # torch: FSDP2's, _check_torch_offload
                raise ValueError(
                    f"offload={self.offload!r} needs framework='deepspeed' (got framework={self.framework!r}): "
                    "ZeRO-Offload is modelled for DeepSpeed's engine and CPUOffloadPolicy for FSDP2 "
                    "(framework='torch'); pass one of them or offload='none'"
                )
            if self.zero_config is not None:
                raise ValueError(
                    f"zero_config is DeepSpeed's (got framework={self.framework!r}); pass framework='deepspeed' "
                    "or zero_config=None"
                )

    @property
    def tokens(self) -> int:
        """b * s: tokens per micro-batch."""
        return self.micro_batch * self.seq_len

    def replace(self, **changes: Any) -> TrainSpec:
        from dataclasses import replace

        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready values; the low-precision fields (``base_weights``, ``float8``,
        ``quantized_head``) only when set, so a plain step's JSON is what it was before them."""
        from dataclasses import asdict

        out = asdict(self)
        for name in _LOW_PRECISION_FIELDS:
            if not out[name]:
                del out[name]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainSpec:
        return cls(**data)


@dataclass(frozen=True)
class ParallelPlan:
    """How the world is split: ``world = dp * tp * pp * cp``.

    Args:
        dp: d, data-parallel replicas (each sees its own micro-batches).
        tp: t, tensor-parallel width (Megatron column/row split of attention heads and the MLP).
        pp: p, pipeline stages (layers split by depth).
        cp: c, context-parallel width (the sequence split across ranks, attention exchanged in a ring).
        sp: sequence parallelism on top of TP (norm/dropout activations split by t; needs tp > 1).
        zero: 0 none, 1 optimizer states sharded over dp, 2 + gradients (FSDP ``SHARD_GRAD_OP``),
            3 + parameters (FSDP ``FULL_SHARD``: one unit all-gathered at a time).
        microbatches: m, micro-batches per optimizer step through the pipeline (>= pp for 1F1B).
        schedule: ``"gpipe"`` (all m forwards, then all backwards), ``"1f1b"`` or ``"interleaved"``.
        virtual_stages: v, model chunks per pipeline rank for the interleaved schedule.
        grad_buckets: with zero <= 1, gradients are all-reduced through DDP's flat buckets, a second
            copy of the gradients (``torch.nn.parallel.DistributedDataParallel``, Lightning's
            ``DDPStrategy``); ``False`` for replication that reduces the gradients in place (FSDP2's
            replicate mesh dimension, which ``memplan_auto`` uses for its data-parallel ranks).
        reshard_after_forward: FSDP2 ``fully_shard(reshard_after_forward=...)`` for the per-block units.
            ``None`` (default) follows ``zero``: ``True`` for zero=3, ``False`` for zero=2. ``True``
            only with zero=3 and ``False`` only with zero=2 (they *are* those stages). An int ``n``
            (zero=3 only, 1 < n < dp*cp, dividing dp*cp, tp=1) reshards each block to ``n`` ranks
            after its forward: it keeps ``1/n`` of its gathered parameters until its backward, whose
            all-gather then runs over ``n`` ranks (torch 2.13
            ``torch/distributed/fsdp/_fully_shard/_fully_shard.py``, ``fully_shard`` docstring;
            ``FSDPParam.to_sharded_post_forward``, which refuses DTensor (TP) parameters). The
            planner does not search over ints; it only estimates a plan that sets one.
        own_units: FSDP2 (zero=2/3, or replication without ``grad_buckets``): the parts besides the blocks
            that are units of their own instead of being in the root unit, from :data:`OWN_UNITS`:
            ``"embedding"`` (the untied input embedding), ``"head"`` (the untied lm_head). Such a unit
            is copied into its unsharded buffer for its forward and again for its backward, as a block
            (``reshard_after_forward`` as the blocks', ``True`` under replication); the root unit's stay
            gathered from the forward to the end of the backward. ``memplan_auto`` gives each untied part
            that trains a unit of its own unless a ``LinearCrossEntropy`` reads ``lm_head.weight`` outside
            the module (``lightning_memplan.parallel.fsdp.own_units``); ``()`` (default): both in the root.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sp: bool = field(default=False, kw_only=True)
    zero: int = field(default=0, kw_only=True)
    microbatches: int = field(default=1, kw_only=True)
    schedule: str = field(default="1f1b", kw_only=True)
    virtual_stages: int = field(default=1, kw_only=True)
    grad_buckets: bool = field(default=True, kw_only=True)
    reshard_after_forward: bool | int | None = field(default=None, kw_only=True)
    own_units: tuple[str, ...] = field(default=(), kw_only=True)

    def __post_init__(self) -> None:
        # checked values stored back plain (np.int64 -> int), so to_dict() is JSON with exact ints
        for name in ("dp", "tp", "pp", "cp"):
            _keep(self, name, _check_int(name, getattr(self, name), maximum=MAX_WORLD_SIZE,
                                         hint=f"at most {MAX_WORLD_SIZE} devices (MAX_WORLD_SIZE)"))
        for name in ("microbatches", "virtual_stages"):
            _keep(self, name, _check_int(name, getattr(self, name)))
        if self.world_size > MAX_WORLD_SIZE:
            raise ValueError(
                f"dp*tp*pp*cp={self.world_size} (dp={self.dp}, tp={self.tp}, pp={self.pp}, cp={self.cp}) exceeds "
                f"MAX_WORLD_SIZE={MAX_WORLD_SIZE} devices (over ten times the largest cluster announced; the bound "
                "keeps every per-rank loop bounded); use smaller axes"
            )
        if self.pp * self.virtual_stages > MAX_PIPELINE_CHUNKS:
            raise ValueError(
                f"pp={self.pp} x virtual_stages={self.virtual_stages} = {self.pp * self.virtual_stages} pipeline "
                f"chunks exceeds MAX_PIPELINE_CHUNKS={MAX_PIPELINE_CHUNKS} (8x the deepest published pipeline, "
                "Megatron-LM's 64 stages; the per-stage estimate replays each rank's schedule); use fewer stages"
            )
        zero = plain_scalar(self.zero)
        if isinstance(zero, bool) or not isinstance(zero, int) or zero not in (0, 1, 2, 3):
            raise ValueError(
                f"zero={self.zero!r} must be 0 (none), 1 (optimizer states), 2 (+grads) or 3 (+params)"
            )
        _keep(self, "zero", zero)
        self._check_reshard_after_forward()
        self._check_own_units()
        _keep(self, "schedule", _check_choice("schedule", self.schedule, SCHEDULES))
        for name in ("sp", "grad_buckets"):
            _keep(self, name, _check_bool(name, getattr(self, name)))
        if self.sp and self.tp == 1:
            raise ValueError("sp=True needs tp > 1 (sequence parallelism splits over the TP group); set tp")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ValueError(
                f"virtual_stages={self.virtual_stages!r} needs schedule='interleaved' (got "
                f"{self.schedule!r}); set schedule='interleaved' or virtual_stages=1"
            )
        if self.schedule == "interleaved" and self.pp == 1:
            raise ValueError(
                f"schedule='interleaved' needs pp > 1 (got pp={self.pp}, virtual_stages={self.virtual_stages}): "
                "it interleaves model chunks across pipeline ranks; set pp >= 2 or schedule='1f1b'"
            )
        if self.schedule == "interleaved" and self.microbatches % self.pp:
            # Megatron-LM's interleaved schedule (schedules.py, forward_backward_pipelining_with_interleaving):
            # "number of microbatches is not divisible by pipeline-model-parallel-size".
            raise ValueError(
                f"microbatches={self.microbatches!r} must be a multiple of pp={self.pp} for "
                f"schedule='interleaved' (Megatron-LM's interleaved 1F1B); use microbatches={self.pp * max(1, self.microbatches // self.pp)} "
                "or schedule='1f1b'"
            )

    def _check_reshard_after_forward(self) -> None:
        raf = plain_scalar(self.reshard_after_forward)
        if raf is None:
            return
        _keep(self, "reshard_after_forward", raf if isinstance(raf, bool) else self.reshard_after_forward)
        if isinstance(raf, bool):
            wanted = 3 if raf else 2
            if self.zero != wanted:
                raise ValueError(
                    f"reshard_after_forward={raf!r} is zero={wanted} (got zero={self.zero!r}); set "
                    f"zero={wanted}, or leave reshard_after_forward=None to follow zero"
                )
            return
        shard = self.dp * self.cp
        raf = _check_int("reshard_after_forward", self.reshard_after_forward, minimum=2,
                         hint="an int is the world size each block reshards to after forward; use True, False or None")
        _keep(self, "reshard_after_forward", raf)
        if self.zero != 3:
            raise ValueError(
                f"reshard_after_forward={raf!r} (an int) needs zero=3 (got zero={self.zero!r}): it reshards "
                "the parameters FSDP2 frees after forward; set zero=3 or reshard_after_forward=None"
            )
        if self.tp > 1:
            raise ValueError(
                f"reshard_after_forward={raf!r} (an int) needs tp=1 (got tp={self.tp!r}): FSDP2 cannot reshard "
                "DTensor (tensor-parallel) parameters to a smaller mesh (torch FSDPParam.to_sharded_post_forward); "
                "use reshard_after_forward=True or tp=1"
            )
        if raf >= shard or shard % raf:
            choices = [n for n in divisors(shard) or () if 1 < n < shard]  # shard <= MAX_WORLD_SIZE: factored
            fix = f"use one of {choices}" if choices else "use True (there is no non-trivial divisor)"
            raise ValueError(
                f"reshard_after_forward={raf!r} must divide the data-parallel shard size dp*cp={shard} and be "
                f"smaller than it (FSDP2 fully_shard: a non-trivial divisor); {fix}"
            )

    def _check_own_units(self) -> None:
        units = self.own_units
        if isinstance(units, str) or not isinstance(units, (tuple, list)):
            raise TypeError(
                f"own_units={units!r:.80} must be a tuple of part names from {OWN_UNITS!r}, e.g. ('embedding', 'head'), "
                "or () for both in the root unit"
            )
        names = [_check_choice(f"own_units[{i}]", name, OWN_UNITS) for i, name in enumerate(units)]
        _keep(self, "own_units", tuple(name for name in OWN_UNITS if name in names))  # canonical order, no repeats

    @property
    def reshard_to(self) -> int:
        """Ranks a ZeRO-3 block stays sharded over between its forward and backward: the int
        ``reshard_after_forward``, else the whole shard group dp*cp (``True``); 1 (whole) otherwise."""
        if isinstance(self.reshard_after_forward, int) and not isinstance(self.reshard_after_forward, bool):
            return self.reshard_after_forward
        return self.dp * self.cp if self.zero == 3 else 1

    @property
    def world_size(self) -> int:
        """dp * tp * pp * cp."""
        return self.dp * self.tp * self.pp * self.cp

    def stage_of_rank(self, rank: int) -> int:
        """Pipeline stage of a global rank, for the mesh order (pp, dp, cp, tp) with tp fastest."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r} must be in [0, {self.world_size}) for this plan")
        return rank // (self.dp * self.cp * self.tp)

    def describe(self) -> str:
        parts = [f"dp={self.dp}"]
        if self.zero:
            parts.append(f"zero={self.zero}")
        if isinstance(self.reshard_after_forward, int) and not isinstance(self.reshard_after_forward, bool):
            parts.append(f"raf={self.reshard_after_forward}")
        if self.tp > 1:
            parts.append(f"tp={self.tp}" + ("+sp" if self.sp else ""))
        if self.pp > 1:
            sched = self.schedule + (f"(v={self.virtual_stages})" if self.virtual_stages > 1 else "")
            parts.append(f"pp={self.pp} {sched} m={self.microbatches}")
        if self.cp > 1:
            parts.append(f"cp={self.cp}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        out = asdict(self)
        out["own_units"] = list(self.own_units)  # JSON has lists; __post_init__ takes it back as a tuple
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelPlan:
        return cls(**data)
