"""Element sizes and kernel choices of a training step, resolved once from a ``TrainSpec``.

The first stage of the estimate (``docs/architecture.md``, "The estimate's stages"): every byte term of
``model/terms.py`` takes the records made here, never the ``TrainSpec`` itself, so the precision rules are
worked out in one place.

- :class:`PrecisionBytes` (:func:`precision_bytes`): bytes per element of each tensor kind (parameters,
  gradients, master copies, optimizer states, activations, the residual stream, autocast's weight copies,
  logits) under Lightning's precision plugins and the explicit overrides.
- :class:`Kernels` (:func:`kernels_of`): those sizes with the kernel choices the activation, attention and
  loss terms depend on (attention kernel, recompute mode, device, RMSNorm implementation, the framework's
  sequence-parallel and SwiGLU kernels, the loss mode and chunk size).
- :class:`OptimizerBytes` (:func:`optimizer_bytes`): what the optimizer keeps per parameter and how its
  step runs (block-quantized and 16-bit states of ``model/quantized.py``; paged states).
- :class:`LowPrecision` (:func:`low_precision_of`): how the linears' weights are stored and multiplied
  beyond the precision plugin (QLoRA's quantized base weights, torchao's float8 linears); the bytes of
  one stage are worked out from it by ``model/low_precision.py`` in the resolve stage.

Sources: [PL] Lightning 2.6 precision plugins (``lightning/pytorch/plugins/precision``); [PT] PyTorch 2.13
``torch/amp/autocast_mode.py`` and ``torch/optim/adam.py``; [R20] Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", arXiv 1910.02054, section 3.1 (16N = 2 + 2 + 12
bytes per parameter with Adam); [D8] Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization", arXiv 2110.02861 (two 1-byte Adam states).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_memplan.model.frameworks import framework_facts
from lightning_memplan.model.quantized import LOW_BIT_OPTIMIZERS, PAGED_OPTIMIZERS, optimizer_state_rate

if TYPE_CHECKING:
    from lightning_memplan.model.specs import TrainSpec

__all__ = [
    "ADAM_STATE_COUNT",
    "BATCH_ID_TENSORS",
    "BF16_BYTES",
    "FP32_BYTES",
    "INT8_BYTES",
    "LAYERNORM_STAT_COUNT",
    "MASK_BYTES",
    "RMSNORM_STAT_COUNT",
    "SDPA_LSE_BYTES",
    "TOKEN_ID_BYTES",
    "Kernels",
    "LowPrecision",
    "OptimizerBytes",
    "PrecisionBytes",
    "kernels_of",
    "low_precision_of",
    "optimizer_bytes",
    "precision_bytes",
]

FP32_BYTES = 4
BF16_BYTES = 2
INT8_BYTES = 1
#: PyTorch's dropout mask is a bool tensor: one byte per element [PT].
MASK_BYTES = 1
#: Adam/AdamW keep two states per parameter, exp_avg (m) and exp_avg_sq (v) [R20].
ADAM_STATE_COUNT = 2
#: LayerNorm saves mean and rstd (fp32) per token; RMSNorm saves rstd only [PT].
LAYERNORM_STAT_COUNT = 2
RMSNORM_STAT_COUNT = 1
#: The flash/efficient SDPA kernels save one fp32 log-sum-exp per (token, head) [PT
#: ``tools/autograd/derivatives.yaml``, ``_scaled_dot_product_efficient_attention``]. The one definition:
#: ``model/terms.py`` and ``model/traced.py`` read it from here.
SDPA_LSE_BYTES = FP32_BYTES
#: Token ids, targets and position ids are int64 (``torch.long``): what ``nn.Embedding`` looks up and
#: ``F.cross_entropy`` takes as class indices [PT].
TOKEN_ID_BYTES = 8
#: A language model's batch holds two ``[b, s]`` id tensors: the inputs and the targets.
BATCH_ID_TENSORS = 2


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per element of each tensor family for one precision setting.

    Attributes:
        param: parameter storage. grad: gradient storage. master: fp32 master copy (0 when none).
        state: one optimizer state element. compute: matmul outputs (activations).
        residual: the residual stream and norm inputs (fp32 under autocast: embeddings and
            residual adds stay in the parameter dtype). autocast_copy: the low-precision weight copy
            autocast caches for each matmul weight (0 when autocast is off).
        logits: dtype the lm_head produces.
    """

    param: int
    grad: int
    master: int
    state: int
    compute: int
    residual: int
    autocast_copy: int
    logits: int


@functools.lru_cache(maxsize=4096)  # specs are frozen (hashable); the planner asks many times per plan
def precision_bytes(train: TrainSpec) -> PrecisionBytes:
    """Element sizes for Lightning's precision plugins [PL], then the explicit overrides.

    - ``"32-true"``: everything fp32.
    - ``"16-mixed"``/``"bf16-mixed"``: fp32 params, grads and optimizer states; autocast runs the
      matmuls in 16 bit and caches a 16-bit copy of each weight from its first use in forward until
      backward frees it [PT]; norms, softmax and the loss run in fp32.
    - ``"16-true"``/``"bf16-true"``: params, grads, optimizer states (``zeros_like(param)``) and
      activations all in 16 bit.
    - ``master_weights=True``: an fp32 master copy of 16-bit params with fp32 optimizer states, the
      Megatron/DeepSpeed layout behind the 16N = 2 + 2 + 4 + 8 bytes per parameter of [R20] section 3.1.
    - ``framework="deepspeed"`` with any 16-bit precision: DeepSpeed's fp16/bf16 engine casts the module
      to 16 bit (no autocast, so no weight copies; activations and the residual stream in 16 bit) and its
      ZeRO optimizer keeps fp32 master weights and fp32 states, whatever ``master_weights`` says: the
      2 + 2 + 12 bytes of [R20] section 3.1 (``deepspeed/runtime/zero/stage_1_and_2.py``,
      ``single_partition_of_fp32_groups``; ``lightning_memplan.model.deepspeed``).
    """
    mixed = train.precision in ("16-mixed", "bf16-mixed")
    true16 = train.precision in ("16-true", "bf16-true")
    if train.framework == "deepspeed" and (mixed or true16):
        return PrecisionBytes(
            param=train.param_bytes or BF16_BYTES,
            grad=train.grad_bytes or (train.param_bytes or BF16_BYTES),
            master=train.master_bytes or FP32_BYTES,
            state=FP32_BYTES,
            compute=train.activation_bytes or BF16_BYTES,
            residual=train.activation_bytes or BF16_BYTES,
            autocast_copy=0,
            logits=train.activation_bytes or BF16_BYTES,
        )
    param = BF16_BYTES if true16 else FP32_BYTES
    master = FP32_BYTES if (train.master_weights and param < FP32_BYTES) else 0
    state = FP32_BYTES if master else param
    compute = BF16_BYTES if (mixed or true16) else FP32_BYTES
    residual = BF16_BYTES if true16 else FP32_BYTES
    return PrecisionBytes(
        param=train.param_bytes or param,
        grad=train.grad_bytes or (train.param_bytes or param),
        master=train.master_bytes or master,
        state=state,
        compute=train.activation_bytes or compute,
        residual=train.activation_bytes or residual,
        autocast_copy=BF16_BYTES if mixed else 0,
        logits=train.activation_bytes or compute,
    )


@dataclass(frozen=True, kw_only=True)
class OptimizerBytes:
    """What the optimizer keeps and allocates, per parameter and per step.

    Attributes:
        name: ``TrainSpec.optimizer``. impl: ``TrainSpec.optimizer_impl`` (``"foreach"``, ``"fused"``,
            ``"for_loop"``). state: bytes of one state element. per_param: state bytes per parameter.
        paged: the states live in CUDA unified memory (bitsandbytes' paged optimizers), outside the
            caching allocator: host bytes, not device bytes (``model/quantized.py`` ``PAGED_OPTIMIZERS``).
        low_bit: one of ``model/quantized.py``'s ``LOW_BIT_OPTIMIZERS`` (one fused or compiled kernel per
            tensor: no step temporaries the size of the states).
    """

    name: str
    impl: str
    state: int
    per_param: float
    paged: bool = False
    low_bit: bool = False


def _state_bytes_per_param(train: TrainSpec, state: int) -> float:
    """Adam/AdamW: 2 states x state bytes (8 with fp32 states) [R20]; 8-bit Adam: 2 x 1 byte [D8]; SGD
    with momentum and Lion: 1 state; SGD: 0; Adafactor: factored second moments, O(rows + cols) per
    matrix, counted as 0 per parameter; the block-quantized and 16-bit states of ``model/quantized.py``
    (``optimizer_state_rate``). ``optimizer_bytes_per_param`` overrides."""
    if train.optimizer_bytes_per_param is not None:
        return float(train.optimizer_bytes_per_param)
    if train.optimizer in LOW_BIT_OPTIMIZERS:
        return optimizer_state_rate(train.optimizer, state)
    return {
        "adamw": ADAM_STATE_COUNT * state,
        "adam": ADAM_STATE_COUNT * state,
        "adamw8bit": ADAM_STATE_COUNT * INT8_BYTES,
        "sgd": 0,
        "sgd_momentum": state,
        "lion": state,
        "adafactor": 0,
    }[train.optimizer]


@functools.lru_cache(maxsize=4096)
def optimizer_bytes(train: TrainSpec) -> OptimizerBytes:
    """The optimizer of ``train`` as :class:`OptimizerBytes` (state bytes from :func:`precision_bytes`)."""
    state = precision_bytes(train).state
    return OptimizerBytes(name=train.optimizer, impl=train.optimizer_impl, state=state,
                          per_param=_state_bytes_per_param(train, state), paged=train.optimizer in PAGED_OPTIMIZERS,
                          low_bit=train.optimizer in LOW_BIT_OPTIMIZERS)


@dataclass(frozen=True)
class LowPrecision:
    """How the linears' weights are stored and multiplied beyond the precision plugin.

    Attributes:
        base_weights: ``TrainSpec.base_weights``: the frozen base linears' bitsandbytes format (QLoRA),
            ``None`` for weights in the parameter dtype.
        float8: ``TrainSpec.float8``: torchao's float8 recipe of the blocks' linears, or ``None``.
        quantized_head: ``TrainSpec.quantized_head``: the lm_head is quantized too (Lightning's
            ``BitsandbytesPrecision`` converts every ``nn.Linear``; transformers' ``BitsAndBytesConfig``
            leaves the output embedding in the parameter dtype).
        fp16: the activations are float16 (``"16-true"``): bitsandbytes' int8 matmul casts any other input
            to float16 first.
    """

    base_weights: str | None = None
    float8: str | None = None
    quantized_head: bool = False
    fp16: bool = False

    @property
    def active(self) -> bool:
        """Some linears are quantized or run in float8."""
        return self.base_weights is not None or self.float8 is not None


#: Neither quantized weights nor float8 linears.
NO_LOW_PRECISION = LowPrecision()


def low_precision_of(train: TrainSpec) -> LowPrecision:
    """The :class:`LowPrecision` of ``train`` (:data:`NO_LOW_PRECISION` for a plain step)."""
    if train.base_weights is None and train.float8 is None:
        return NO_LOW_PRECISION
    return LowPrecision(base_weights=train.base_weights, float8=train.float8, quantized_head=train.quantized_head,
                        fp16=train.precision == "16-true")


@dataclass(frozen=True, kw_only=True)
class Kernels:
    """Element sizes and kernel choices of one training step: what the activation, attention and loss
    terms need of a ``TrainSpec``, resolved once (:func:`kernels_of`).

    Attributes:
        sizes: :class:`PrecisionBytes`.
        attention: ``"sdpa"`` (a fused kernel) or ``"eager"`` (materialised ``[b, a, s, s]`` scores).
        recompute: ``"none"``, ``"selective"``, ``"selective_op"`` or ``"full"``.
        device: the device type the step runs on (kernels differ on ``"cuda"`` and ``"cpu"``).
        norm_impl: how RMSNorms are implemented (``TrainSpec.norm_impl``).
        fused_rms_norm: the RMSNorms run CUDA's fused kernel (``norm_impl="native"`` on ``"cuda"``).
        fp32_softmax: eager attention's softmax runs in fp32 under a 16-bit compute dtype (CUDA autocast:
            softmax is on autocast's fp32 list [PT]).
        softmax: bytes per element of the eager softmax's output and of the gradients its backward takes
            and returns: 4 under :attr:`fp32_softmax`, else the compute dtype's.
        sp_saves_shard, fused_swiglu: the framework's kernels
            (:class:`~lightning_memplan.model.frameworks.FrameworkFacts`).
        loss: ``TrainSpec.loss``. loss_chunk_size: ``TrainSpec.loss_chunk_size``.
        low_precision: quantized base weights and float8 linears (:class:`LowPrecision`).
    """

    sizes: PrecisionBytes
    attention: str
    recompute: str
    device: str
    norm_impl: str
    fused_rms_norm: bool
    fp32_softmax: bool
    softmax: int
    sp_saves_shard: bool
    fused_swiglu: bool
    loss: str
    loss_chunk_size: int | None
    low_precision: LowPrecision = NO_LOW_PRECISION

    @property
    def eager(self) -> bool:
        """Eager attention without recompute: the ``[b, a, s, s]`` probabilities are saved for backward."""
        return self.attention == "eager" and self.recompute == "none"


@functools.lru_cache(maxsize=4096)
def kernels_of(train: TrainSpec) -> Kernels:
    """The :class:`Kernels` of ``train`` (the one place the terms' element sizes and kernels are read)."""
    sizes = precision_bytes(train)
    facts = framework_facts(train.framework)
    fp32_softmax = bool(sizes.autocast_copy) and train.device == "cuda"
    return Kernels(
        sizes=sizes,
        attention=train.attention,
        recompute=train.recompute,
        device=train.device,
        norm_impl=train.norm_impl,
        fused_rms_norm=train.norm_impl == "native" and train.device == "cuda",
        fp32_softmax=fp32_softmax,
        softmax=FP32_BYTES if fp32_softmax else sizes.compute,
        sp_saves_shard=facts.sp_saves_shard,
        fused_swiglu=facts.fused_swiglu,
        loss=train.loss,
        loss_chunk_size=train.loss_chunk_size,
        low_precision=low_precision_of(train),
    )
