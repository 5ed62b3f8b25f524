"""FSDP2's ``CPUOffloadPolicy`` and activation offloading (``save_on_cpu``): what stays on the device and
what lives in host memory, in bytes (``TrainSpec(offload="params")`` and ``TrainSpec(offload_activations=
True)`` under ``framework="torch"``, the layouts ``memplan_auto`` applies).

Every fact is read from torch 2.13 (files under ``site-packages/torch``):

[F2-API] ``distributed/fsdp/_fully_shard/_fsdp_api.py``, ``CPUOffloadPolicy``: "offloads parameters,
  gradients, and optimizer states to CPU. Sharded parameters are copied host-to-device before all-gather.
  The all-gathered parameters are freed according to ``reshard_after_forward``. Sharded gradients are
  copied device-to-host in backward, and the optimizer step runs on CPU with CPU optimizer states";
  ``pin_memory`` defaults to ``True``.
[F2-P] ``distributed/fsdp/_fully_shard/_fsdp_param.py``, ``FSDPParam._init_sharded_param``: the padded
  sharded parameter is moved ``.cpu()`` and ``.pin_memory()``-ed (one page-locked tensor per parameter);
  ``all_gather_inputs``: ``sharded_param_data.to(self.device, non_blocking=True)``, the host-to-device copy
  that is the all-gather's input (made on the all-gather copy-in stream, so it overlaps the previous
  unit's compute); the unsharded parameters are the same device buffers as without offload.
[F2-C] ``distributed/fsdp/_fully_shard/_fsdp_collectives.py``, ``foreach_reduce``: each reduce-scatter
  output (the unit's sharded gradient, on the device) is copied ``.to(torch.device("cpu"),
  non_blocking=pin_memory and not accumulating)`` on the post-reduce stream and the device copy is
  dropped; with gradient accumulation the copy is blocking and added into the host gradient.
[F2-G] ``distributed/fsdp/_fully_shard/_fsdp_param_group.py``, ``_validate_cpu_offload_params``: the
  sharded parameters must be on the CPU when the first forward runs (a later ``module.to("cuda")`` is
  refused).
[TC] PyTorch ``aten/src/ATen/native/TensorConversions.cpp``, ``_to_copy``: a ``non_blocking`` copy from an
  accelerator to the CPU allocates a pinned destination (``pin_out``), so the offloaded gradients are
  page-locked too.
[OPT] ``optim/optimizer.py``, ``_default_to_fused_or_foreach`` with ``utils/_foreach_utils.py``
  ``_get_foreach_kernels_supported_devices`` (cuda, xpu, mtia, privateuse1): with CPU parameters Adam runs
  its single-tensor loop, one parameter's temporaries at a time; states are ``zeros_like(param)``, not
  pinned.
[SOC] ``autograd/graph.py``, ``save_on_cpu``: every tensor an op saves for backward is packed into a new
  host tensor (``pin_memory=True``: ``torch.empty(..., pin_memory=True)`` then ``copy_(non_blocking=True)``
  on the current stream) and unpacked with ``.to(device)`` when its backward node runs. A tensor saved by
  several ops is packed once per op, a weight's ``t()`` view (what a matmul saves) is copied whole.
[OW] ``distributed/algorithms/_checkpoint/checkpoint_wrapper.py``, ``OffloadWrapper.forward``: ``with
  save_on_cpu(pin_memory=True)`` around the wrapped module (``offload_wrapper``).
[CK] ``utils/checkpoint.py``, ``_checkpoint_hook``: inside a non-reentrant checkpoint region the
  checkpoint's own saved-tensor hooks take every saved tensor (innermost hooks win), so offloading and
  checkpointing one block do not compose (``TrainSpec`` refuses the pair).
[CHA] ``include/ATen/core/CachingHostAllocator.h``, ``CachingHostAllocatorImpl::allocate``: "Round up the
  allocation to the nearest power of two" (``PowerOf2Ceil`` while the size is at most
  ``pinned_max_round_threshold``, default ``SIZE_MAX``, ``c10/core/AllocatorConfig.h``); freed blocks are
  cached, not returned. A pinned tensor of ``n`` bytes therefore holds less than ``2 n``.

Symbols as in docs/concepts.md; ``d`` the shard group (dp x cp), ``U`` one block's parameters on a rank
before sharding, ``e``/``g`` parameter and gradient bytes, ``w`` the bytes of a weight as a matmul saves it
(the autocast copy under mixed precision, else the parameter dtype).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from lightning_memplan.model import terms
from lightning_memplan.model.experts import is_moe
from lightning_memplan.model.sizes import FP32_BYTES, Kernels, OptimizerBytes, PrecisionBytes

if TYPE_CHECKING:
    from lightning_memplan.model.result import MemoryEstimate
    from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec

__all__ = [
    "HOST_PARTS",
    "PINNED_ROUNDING_BOUND",
    "HostLayout",
    "activation_host_bytes",
    "cpu_step_workspace_bytes",
    "describe_offload",
    "host_need_bytes",
    "offload_blocker",
    "offloads_activations",
    "offloads_params",
    "saved_again_bytes",
    "saved_weight_bytes",
    "transfer_bytes",
]

#: Host parts of an estimate (``details["host_<part>"]``): DeepSpeed's (``model/deepspeed.py``) and
#: ``"activations"`` (``save_on_cpu``).
HOST_PARTS = ("params", "grads", "optimizer", "master", "buffers", "activations")
#: A pinned host block holds less than this many times its bytes ([CHA]: rounded up to a power of two).
#: The planner's host check counts pinned bytes at this bound (``host_need_bytes``); the estimate's
#: ``host`` reports the tensor bytes.
PINNED_ROUNDING_BOUND = 2
#: RMSNorm statistics per token (one fp32 rstd), saved again by the composite norm's multiply.
_RSTD_BYTES = FP32_BYTES
#: Rotary tables packed per block: ``q * cos``, ``rotate_half(q) * sin`` and the same for k each save the
#: table they multiply by ([SOC]; the zoo GPT's ``apply_rope``).
_ROPE_TABLE_SAVES = 4


def offloads_params(train: TrainSpec) -> bool:
    """Whether ``train`` asks for FSDP2's ``CPUOffloadPolicy`` (``framework="torch"``, ``offload="params"``)."""
    return train.framework == "torch" and train.offload == "params"


def offloads_activations(train: TrainSpec) -> bool:
    """Whether ``train`` asks for activation offloading (``save_on_cpu`` around every block)."""
    return train.offload_activations


def describe_offload(train: TrainSpec) -> str:
    """``"params"``, ``"activations"``, ``"params+activations"`` or ``"none"`` (FSDP2's offloads only)."""
    parts = [name for name, on in (("params", offloads_params(train)), ("activations", offloads_activations(train))) if on]
    return "+".join(parts) or "none"


def offload_blocker(train: TrainSpec, plan: ParallelPlan) -> str | None:
    """Why ``plan`` cannot run ``train``'s FSDP2 offloads, or ``None``.

    ``CPUOffloadPolicy`` needs FSDP2 units: ZeRO-3 or ZeRO-2 over the shard group, FSDP2's replicate mesh
    (zero=0 without DDP buckets: ``grad_buckets=False``, what memplan_auto applies) or one data-parallel
    rank (memplan_auto then shards over a one-rank mesh, resharding after forward). ZeRO-1 has no FSDP2
    form and DDP (``grad_buckets=True``) no offload. Neither offload is modelled inside pipeline stages
    (the schedule keeps units unsharded and runs several micro-batches' blocks at once)."""
    if not (offloads_params(train) or offloads_activations(train)):
        return None
    what = describe_offload(train)
    if plan.pp > 1:
        return f"offload {what!r} is not modelled under pipeline parallelism (pp={plan.pp}); use pp=1"
    if not offloads_params(train):
        return None
    shard = plan.dp * plan.cp
    if shard > 1 and plan.zero == 1:
        return ("offload='params' needs FSDP2 units and zero=1 has no FSDP2 form; use zero=2 or zero=3 "
                "(CPUOffloadPolicy then keeps the shards, their gradients and the optimizer states on the host)")
    if shard > 1 and plan.zero == 0 and plan.grad_buckets:
        return ("offload='params' needs FSDP2 units, not DDP (zero=0 with grad_buckets=True); use zero=3, or "
                "ParallelPlan(..., grad_buckets=False) for FSDP2's replicate mesh")
    return None


@dataclass(frozen=True)
class HostLayout:
    """What one rank keeps in host memory, and what moves each step.

    Attributes:
        host: ``{part: bytes}`` (:data:`HOST_PARTS`).
        pinned: the bytes among them in page-locked buffers (sharded parameters and gradients under
            ``CPUOffloadPolicy(pin_memory=True)``, offloaded activations under ``offload_wrapper``).
        h2d: bytes copied host to device per optimizer step.
        d2h: bytes copied device to host per optimizer step.
    """

    host: Mapping[str, int]
    pinned: int
    h2d: int
    d2h: int

    @property
    def total(self) -> int:
        return sum(self.host.values())


def cpu_step_workspace_bytes(optimizer: OptimizerBytes, opt_params: int, largest_param: int) -> int:
    """Host temporaries of the optimizer step under ``CPUOffloadPolicy``: the step runs on the host
    parameters, where torch's default is the single-tensor loop [OPT], so ``"foreach"`` is counted as
    ``"for_loop"`` (``2 * largest * state`` for Adam, :func:`~lightning_memplan.model.terms.
    optimizer_workspace_bytes`); ``"fused"`` stays fused."""
    step = replace(optimizer, impl="for_loop") if optimizer.impl == "foreach" else optimizer
    return terms.optimizer_workspace_bytes(step, opt_params, largest_param)


def saved_again_bytes(model: ModelSpec, kernels: Kernels, b: int, s: int, *, t: int = 1, sp: bool = False) -> int:
    """Bytes ``save_on_cpu`` packs for one block of a ``b x s`` micro-batch (``tokens = b s``) beyond the block's distinct saved tensors
    (:func:`~lightning_memplan.model.terms.layer_activation_bytes`), since every save is one pack [SOC]:

    - the attention input, saved by each of q, k and v: ``(3 - copies) * tokens * h * c`` with separate
      projections (``copies`` = 3 under autocast, which casts per linear; 1 otherwise), 0 fused;
    - the SwiGLU input, saved by gate and up: ``(2 - copies) * tokens * h * c``;
    - the attention output, saved by sdpa and by the output projection (the reshape is a view): ``tokens
      * (a/t) * d_h * c`` (eager: the output projection alone saves it);
    - a composite RMSNorm (every RMSNorm but CUDA's fused one) saves its fp32 input twice (``pow`` and the
      ``rsqrt`` multiply) and its rstd twice (``rsqrt`` and the multiply): ``tokens * (4h + 4)`` per norm,
      ``/ t`` with sequence parallelism;
    - rotary position tables: ``q * cos``, ``rotate_half(q) * sin`` and the same for k each save their
      ``s x d_h`` table: ``4 s d_h`` in the residual dtype (Hugging Face's per-sequence ``[b, s, d_h]``
      tables are b times that; not counted).

    Measured with a counting pack hook on the zoo GPT (h=64, s=128, b=4; tests/unit/test_fsdp2_offload.py):
    exact under ``"32-true"`` and ``"bf16-mixed"``."""
    pb = kernels.sizes
    h, dh, a = model.hidden, model.dim_head, model.n_heads // t
    tokens = b * s
    cast = bool(pb.autocast_copy)
    out = 0
    if not model.qkv_fused:
        out += (3 - (3 if cast else 1)) * tokens * h * pb.compute
    if model.ffn_kind == "swiglu":
        out += (2 - (2 if cast else 1)) * tokens * h * pb.compute
    if kernels.attention == "sdpa":
        out += tokens * a * dh * pb.compute
    if model.norm == "rmsnorm" and not kernels.fused_rms_norm:
        out += 2 * tokens * (model.hidden * FP32_BYTES + _RSTD_BYTES) // (t if sp else 1)
    if model.position_embedding == "rope":
        out += _ROPE_TABLE_SAVES * s * dh * pb.residual
    return out


def saved_weight_bytes(model: ModelSpec, sizes: PrecisionBytes, matmul_params: int, n_layers: int) -> int:
    """Bytes of the weights the blocks' ops save, each packed to the host once per micro-batch [SOC]: a
    matmul saves its weight's ``t()`` view (the autocast copy under mixed precision, the parameter itself
    otherwise; under FSDP2 the unsharded parameter): ``N_matmul * w``; each norm saves its weight (and
    LayerNorm's ``native_layer_norm`` its bias): ``2 L n_norm e`` (``n_norm`` = h for RMSNorm, 2h for
    LayerNorm)."""
    w = sizes.autocast_copy or sizes.param
    return matmul_params * w + 2 * n_layers * terms.norm_param_count(model) * sizes.param


def activation_host_bytes(
    model: ModelSpec,
    kernels: Kernels,
    *,
    b: int,
    s: int,
    n_layers: int,
    saved_layer: int,
    attn_layer: int,
    matmul_params: int,
    t: int = 1,
    sp: bool = False,
) -> int:
    """Host bytes of activation offloading for one rank and one ``b x s`` micro-batch (``s`` the rank's
    slice under context parallelism): every block's saves, packed [SOC], ``L (saved + eager scores +
    saved again) + saved weights`` (:func:`saved_again_bytes`, :func:`saved_weight_bytes`); the embedding,
    the final norm, the head and the loss run outside the wrapped blocks and keep theirs on the device
    [OW].

    ``matmul_params``: the blocks' matmul weights on this rank (after tensor parallelism). MoE blocks are
    counted with what ``saved_layer`` holds (the router's and experts' repeated saves are not added)."""
    if n_layers == 0:
        return 0
    again = 0 if is_moe(model) else saved_again_bytes(model, kernels, b, s, t=t, sp=sp)
    return n_layers * (saved_layer + attn_layer + again) + saved_weight_bytes(model, kernels.sizes, matmul_params, n_layers)


def params_host_layout(
    *,
    params: int,
    grads: int,
    optimizer: int,
    master: int,
    step_workspace: int,
    gathers: int,
    accumulation: int,
) -> HostLayout:
    """Host bytes under ``CPUOffloadPolicy`` [F2-API]: the sharded parameters and gradients (pinned,
    [F2-P], [TC]), the optimizer states and master copies (pageable [OPT]) and the CPU step's temporaries
    (``buffers``). ``gathers``: all-gathers per micro-batch that copy the shards to the device (2 under
    ZeRO-3: forward and backward; 1 when they stay gathered); ``accumulation``: micro-batches per step,
    each reduce-scatter copied back [F2-C]."""
    host = dict.fromkeys(HOST_PARTS, 0)
    host.update(params=params, grads=grads, optimizer=optimizer, master=master, buffers=step_workspace)
    return HostLayout(host=host, pinned=params + grads, h2d=gathers * accumulation * params,
                      d2h=accumulation * grads)


def transfer_bytes(estimate: MemoryEstimate) -> tuple[int, int]:
    """``(host-to-device, device-to-host)`` bytes per optimizer step recorded in an estimate's details."""
    return int(estimate.details.get("offload_h2d_bytes", 0)), int(estimate.details.get("offload_d2h_bytes", 0))


def host_need_bytes(estimate: MemoryEstimate) -> int:
    """What one rank's offloads need of the host for the planner's check: ``host`` with the pinned bytes
    counted at :data:`PINNED_ROUNDING_BOUND` ([CHA]: each pinned block is rounded up to a power of two,
    less than twice its size; DeepSpeed's buffers are counted as they are, their ``pin_memory`` is
    config-dependent)."""
    pinned = int(estimate.details.get("host_pinned", 0))
    return estimate.host + (PINNED_ROUNDING_BOUND - 1) * pinned


def unit_shard_params(unit_params: int, plan: ParallelPlan) -> int:
    """One block unit's parameters on a rank after sharding, ``ceil(U / d)`` (what an all-gather's
    host-to-device input and a reduce-scatter's output hold [F2-P], [F2-C])."""
    return math.ceil(unit_params / max(1, plan.dp * plan.cp))
