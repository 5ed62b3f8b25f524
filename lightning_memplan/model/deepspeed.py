"""DeepSpeed's ZeRO as DeepSpeed allocates it: where each model state lives, on the device or the host,
at each moment of a training step (``TrainSpec(framework="deepspeed")``, ``ParallelPlan.zero`` the stage).

Every fact below is read from DeepSpeed at commit ``edaa7221267243c7be7fb49c5d5f5c4fb97b4641`` (Apache-2.0;
facts and formulas carried over with a citation, no code), files under ``deepspeed/runtime/zero/``:

[Z12] ``stage_1_and_2.py`` (``DeepSpeedZeroOptimizer``):
  - the 16-bit parameters of each group live in one flat buffer on every rank (``bit16_groups_flat``);
    the fp32 master partition, N/d per rank, is ``single_partition_of_fp32_groups`` (page-locked on the
    host with ``offload_optimizer``); the optimizer's states are built on it;
  - stage 2 with ``contiguous_gradients`` copies each reduced gradient this rank owns into one 16-bit
    buffer of N/d elements (``copy_grads_in_partition``: ``grads_in_partition``) and frees the others;
    stage 1 keeps every ``param.grad`` until the accumulation boundary;
  - ``setup_buckets``: one ``reduce_bucket_size`` 16-bit reduce bucket per backward, a second with
    ``overlap_comm``; released at the end of the backward (``_release_ipg_buffers``);
  - ``step`` without offload: the rank's gradient partition is converted to an fp32 copy (N/d x 4 bytes,
    ``single_grad_partition``) next to the 16-bit one, freed after that group's step;
  - ``offload_optimizer``: an fp32 gradient partition on the host (``single_partition_of_fp32_groups[i]
    .grad``, ``initialize_optimizer_states``), a 16-bit host staging copy of the parameter partition
    (``param_buffer_of_bit16_for_cpu_offload_groups``), a largest-parameter 16-bit buffer on each side
    (``temp_grad_buffer_for_cpu_offload`` / ``_for_gpu_offload``) and, when accumulating, a 16-bit host
    accumulator per owned parameter (``accumulated_grads_in_cpu``);
  - the all-gather after the step writes into the flat buffer itself (``deepspeed/runtime/utils.py``,
    ``all_gather_dp_groups`` -> ``all_gather_into_tensor``): ``allgather_bucket_size`` costs no bytes.
[Z3] ``stage3.py`` (``DeepSpeedZeroOptimizer_Stage3``) and ``partition_parameters.py``:
  - each parameter's 16-bit partition (N/d; on the host with ``offload_param``, ``param_groups_fp16_flat
    _cpu_memory``); tensors of at most ``param_persistence_threshold`` elements are never partitioned
    (``ds_persist``) and stay whole on the device;
  - one ``reduce_bucket_size`` 16-bit bucket for the whole run (the IPG buffer) and a 16-bit gradient
    partition buffer of N/d elements (``grad_partitions_flat_buffer``) allocated at start-up, on the
    optimizer's device (the host with ``offload_optimizer``);
  - the step converts ``sub_group_size`` elements at a time: a 16-bit flat copy and its fp32 copy
    (``_prepare_fp32_grad_for_sub_group``); with ``offload_optimizer`` an fp32 gradient buffer per
    sub-group lives on the host instead (``initialize_optimizer_states``).
[ZC] ``partitioned_param_coordinator.py``: a module's parameters are gathered for its forward and
  backward; a gathered parameter whose next use comes within ``max_reuse_distance`` elements is kept
  (``__params_to_release``), so at the loss the last ``max_reuse_distance / 2`` elements of the forward
  are still gathered (their next use, the backward, is twice the parameters after them away); the
  prefetch gathers up to ``prefetch_bucket_size`` more, no further than ``max_live_parameters``.
[R20] Rajbhandari et al. 2019, arXiv 1910.02054, section 3.1 and Fig. 1: 2N + 2N + K N with K = 12
  (fp32 master 4 + Adam 8), stage 1 shards the K N, stage 2 also the 2N gradients, stage 3 the 2N
  parameters.

Symbols: N the rank's parameters before ZeRO (after tensor parallelism), d the data-parallel ranks,
Nd = ceil(N / d), e the 16-bit parameter bytes (4 under ``"32-true"``), g the gradient bytes, K the fp32
optimizer state bytes per parameter, L the largest module's parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_memplan.model import terms
from lightning_memplan.model.frameworks import ZeroConfig
from lightning_memplan.model.sizes import FP32_BYTES, PrecisionBytes
from lightning_memplan.model.specs import ModelSpec

__all__ = ["HOST_PARTS", "POINTS", "ZeroInputs", "ZeroLayout", "persistent_param_count", "zero_layout"]

#: Names of the host parts, in :attr:`ZeroLayout.host` order (``details["host_<part>"]`` of an estimate).
HOST_PARTS = ("params", "grads", "optimizer", "master", "buffers")
#: Points of the step a :class:`ZeroLayout` gives device bytes for (the activation timeline's points,
#: ``model/activations.py``).
POINTS = ("forward", "backward_start", "backward_layer", "backward_end", "optimizer")


@dataclass(frozen=True)
class ZeroLayout:
    """One rank's model states and ZeRO buffers under DeepSpeed, in bytes.

    Attributes:
        params, optimizer, master: device bytes, the same at every point of the step.
        grads: device gradient bytes at each of :data:`POINTS`.
        comm: device bytes of reduce buckets and gathered stage-3 parameters at each point.
        workspace: device bytes of the step's gradient conversion (16-bit flat and fp32 copies), added to
            the optimizer point's workspace.
        host: ``{part: bytes}`` in host memory (:data:`HOST_PARTS`); all 0 without offload.
        model_states_peak: the largest params + grads + optimizer + master on the device over the step
            (the quantity of [R20] Fig. 1).
        fp32_grad_partition: the fp32 gradient copy the device step makes (in ``workspace``).
        gathered_largest: one largest module gathered with its 16-bit gradient, ``L (e + g)``: the
            "largest layer" term of DeepSpeed's ``estimate_zero3_model_states_mem_needs`` (in ``comm``).
    """

    params: int
    optimizer: int
    master: int
    grads: dict[str, int]
    comm: dict[str, int]
    workspace: int
    host: dict[str, int]
    model_states_peak: int
    fp32_grad_partition: int
    gathered_largest: int


def persistent_param_count(model: ModelSpec, config: ZeroConfig, t: int = 1) -> int:
    """Parameters ZeRO-3 keeps whole on every rank: the norms' weights and the blocks' biases when each such
    vector has at most ``param_persistence_threshold`` elements [Z3 ``ds_persist``] (the widest is ``f / t``
    or ``h``); matrices and embeddings are far larger and always partitioned. Counted from the shapes:
    ``L (layer params - matmul params) + final norm``."""
    widest = max(model.hidden, math.ceil(model.ffn / t))
    if widest > config.param_persistence_threshold:
        return 0
    per_layer = terms.layer_param_count(model) - terms.layer_matmul_param_count(model)
    return model.n_layers * per_layer + terms.norm_param_count(model)


@dataclass(frozen=True, kw_only=True)
class ZeroInputs:
    """What :func:`zero_layout` needs of a DeepSpeed step, resolved (no ``TrainSpec``).

    Attributes:
        sizes: element sizes (:func:`~lightning_memplan.model.sizes.precision_bytes` under
            ``framework="deepspeed"``). optimizer_per_param: K, the optimizer's state bytes per parameter.
        config: the ZeRO settings. offload: ``"none"``, ``"optimizer"`` or ``"params"``.
        accumulating: gradients accumulate over several micro-batches per step.
        stage: the ZeRO stage (``ParallelPlan.zero``). d: data-parallel ranks the states are partitioned over.
        local: N, the rank's parameters before ZeRO partitioning. trainable: the trainable ones among them
            (gradients, master and optimizer states). largest: L, the largest module's parameters (stage 3
            gathers one module at a time). persistent: stage-3 parameters kept whole
            (:func:`persistent_param_count`).
    """

    sizes: PrecisionBytes
    optimizer_per_param: float
    config: ZeroConfig
    offload: str
    accumulating: bool
    stage: int
    d: int
    local: int
    trainable: int
    largest: int
    persistent: int


@dataclass(frozen=True)
class _Partitions:
    """The per-rank sizes every stage starts from (``Nd``, ``Nd_t`` = ``ceil(N_t / d)`` from stage 1 on)."""

    nd: int
    nd_t: int
    bucket: int
    master: int
    optimizer: int
    fp32_grads: int
    offload_opt: bool


@dataclass(frozen=True)
class _Placed:
    """One stage's device bytes: parameters, gradients and buffers per point, the step's workspace."""

    params: int
    grads: dict[str, int]
    comm: dict[str, int]
    workspace: int
    fp32_grads: int
    gathered_largest: int


def zero_layout(inputs: ZeroInputs) -> ZeroLayout:
    """Where one rank's model states live at each point of a DeepSpeed step (see the module docstring).

    Device bytes per stage, offload ``"none"`` (``Nd = ceil(N/d)``, ``B`` the reduce bucket's bytes):

    - stage 0: ``e N`` params, ``g N`` grads from the backward to the step, ``4 N`` master, ``K N`` states
      (the [R20] baseline, 16 N); the step's fp32 gradient copy ``4 N``.
    - stage 1: ``e N`` params, ``g N`` grads at the backward's end, ``(4 + K) Nd`` master and states;
      ``B`` (``2B`` with ``overlap_comm``) at the reduction; the step: ``g Nd`` + fp32 copy ``4 Nd``.
    - stage 2: as stage 1 but ``g Nd`` grads (the contiguous partition) and the buckets all backward.
    - stage 3: ``e (Nd + persistent)`` params, ``g Nd`` grads always, ``(4 + K) Nd``; ``B`` always; at the
      loss ``min(N, max(L, R/2))`` gathered elements (``R = max_reuse_distance``), in the backward those
      plus the prefetch (``min(P, M - kept)``, ``P`` the prefetch bucket, ``M`` max live) and one module's
      gradient ``g L``; the step converts ``min(S, Nd)`` elements at a time (``S = sub_group_size``):
      ``(g + 4) min(S, Nd)``.

    ``offload="optimizer"`` moves master, states and the fp32 gradients to the host (stage 3 also its
    16-bit gradient partition; stages 1/2 add a 16-bit staging copy of the partition and the
    largest-parameter buffers); ``"params"`` (stage 3) moves the 16-bit parameter partitions too.
    """
    parts = _partitions(inputs)
    host = dict.fromkeys(HOST_PARTS, 0)
    master, optimizer = parts.master, parts.optimizer
    if parts.offload_opt:
        host["master"], host["optimizer"] = master, optimizer
        master = optimizer = 0
    placed = _stage12(inputs, parts, host) if inputs.stage <= 2 else _stage3(inputs, parts, host)
    static = placed.params + optimizer + master
    return ZeroLayout(
        params=placed.params,
        optimizer=optimizer,
        master=master,
        grads=placed.grads,
        comm=placed.comm,
        workspace=placed.workspace,
        host=host,
        model_states_peak=static + max(placed.grads.values()),
        fp32_grad_partition=placed.fp32_grads,
        gathered_largest=placed.gathered_largest,
    )


def _partitions(inputs: ZeroInputs) -> _Partitions:
    n, n_t, config = inputs.local, inputs.trainable, inputs.config
    shard = inputs.d if inputs.stage >= 1 else 1
    nd, nd_t = math.ceil(n / inputs.d), math.ceil(n_t / shard)
    return _Partitions(
        nd=nd,
        nd_t=nd_t,
        bucket=config.reduce_bucket_size * inputs.sizes.grad if config.contiguous_gradients else 0,
        master=nd_t * inputs.sizes.master,
        optimizer=round(nd_t * inputs.optimizer_per_param),
        fp32_grads=nd_t * FP32_BYTES,  # the step's fp32 gradient partition [Z12 step, Z3 sub-groups]
        offload_opt=inputs.offload in ("optimizer", "params"),
    )


def _stage12(inputs: ZeroInputs, parts: _Partitions, host: dict[str, int]) -> _Placed:
    """Stages 0, 1 and 2 [Z12]: every rank keeps the whole 16-bit parameters; ``host`` gets the offloaded
    gradient partition and buffers."""
    e, g, config, stage = inputs.sizes.param, inputs.sizes.grad, inputs.config, inputs.stage
    n_t, nd_t, bucket, offload_opt = inputs.trainable, parts.nd_t, parts.bucket, parts.offload_opt
    zero = dict.fromkeys(POINTS, 0)
    if stage == 2:
        grads_end = 0 if offload_opt else nd_t * g
        buckets = bucket * (2 if config.overlaps(stage) else 1)
        comm = {**zero, "backward_start": buckets, "backward_layer": buckets, "backward_end": buckets}
    else:  # stages 0 and 1 keep every param.grad until the boundary, then reduce through the buckets
        grads_end = n_t * g
        buckets = bucket * (2 if config.overlaps(stage) else 1) if stage == 1 else min(n_t, config.reduce_bucket_size) * g
        comm = {**zero, "backward_layer": buckets if stage == 1 and config.overlaps(stage) else 0,
                "backward_end": buckets}
    grads_step = grads_end if (stage == 0 or offload_opt) else nd_t * g
    during = grads_end if inputs.accumulating else 0
    grads = {"forward": during, "backward_start": during, "backward_layer": during, "backward_end": grads_end,
             "optimizer": grads_step}
    if offload_opt:
        # fp32 gradient partition on the host, the 16-bit staging copy of the parameters, the
        # largest-parameter buffers, the accumulator when accumulating [Z12]
        host["grads"] = parts.fp32_grads
        host["buffers"] = nd_t * e + inputs.largest * e + (nd_t * e if inputs.accumulating else 0)
        comm = {key: value + inputs.largest * e for key, value in comm.items()}
        workspace = fp32_grads = 0
    else:
        workspace = parts.fp32_grads if stage >= 1 else n_t * FP32_BYTES
        fp32_grads = workspace
    return _Placed(params=inputs.local * e, grads=grads, comm=comm, workspace=workspace, fp32_grads=fp32_grads,
                   gathered_largest=0)


def _stage3(inputs: ZeroInputs, parts: _Partitions, host: dict[str, int]) -> _Placed:
    """Stage 3 [Z3], [ZC]: partitioned 16-bit parameters gathered per module; ``host`` gets the offloaded
    parameter and gradient partitions."""
    e, g, config, largest = inputs.sizes.param, inputs.sizes.grad, inputs.config, inputs.largest
    n, nd, nd_t, bucket = inputs.local, parts.nd, parts.nd_t, parts.bucket
    offload_params = inputs.offload == "params"
    params = (0 if offload_params else nd * e) + inputs.persistent * e
    if offload_params:
        host["params"] = nd * e
    grad_partition = nd_t * g
    if parts.offload_opt:
        host["grads"] = grad_partition + parts.fp32_grads  # both on the optimizer's device [Z3]
        grad_partition = 0
    kept = min(n, max(largest, config.max_reuse_distance // 2))
    prefetch = max(0, min(n - kept, config.prefetch_bucket_size, config.max_live_parameters - kept))
    gathered_largest = largest * (e + g)
    comm = {
        "forward": bucket + kept * e,
        "backward_start": bucket + kept * e,
        "backward_layer": bucket + (kept + prefetch) * e + largest * g,
        "backward_end": bucket + gathered_largest,
        "optimizer": bucket,
    }
    if parts.offload_opt:
        workspace = fp32_grads = 0
    else:
        chunk = min(config.sub_group_size, nd_t)
        workspace = chunk * (g + FP32_BYTES)
        fp32_grads = chunk * FP32_BYTES
    return _Placed(params=params, grads=dict.fromkeys(POINTS, grad_partition), comm=comm, workspace=workspace,
                   fp32_grads=fp32_grads, gathered_largest=gathered_largest)
