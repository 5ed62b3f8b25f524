"""Which training stack runs the step (``TrainSpec.framework``), and the facts of it the memory and time
models depend on: what sequence-parallel linears save, when gradients inside pipeline stages are
reduce-scattered, and how blocks are split over pipeline stages.

The default, ``"torch"``, is what ``memplan_auto`` runs (DTensor tensor/sequence parallelism,
``torch.distributed.pipelining``, FSDP2). The others describe published runs made with other stacks, so
that a published row is checked against the facts of the stack it ran on:

- ``"megatron"``: Megatron-LM (Narayanan et al. 2021, arXiv 2104.04473; Korthikanti et al. 2022, arXiv
  2205.05198). Sequence-parallel linears save their 1/t sequence shard and all-gather it again in the
  backward [K22 section 4.2.2 and Table 2: ``34sbh/t``; Megatron-LM ``megatron/core/tensor_parallel/
  layers.py``, ``LinearWithGradAccumulationAndAsyncCommunication`` saves the un-gathered input when
  ``sequence_parallel``]; the fused SwiGLU saves only its input (``megatron/core/fusions/
  fused_bias_swiglu.py``, ``SwiGLUFunction`` saves the fc1 output); blocks split evenly over the stages.
- ``"llama3"``: the stack of Dubey et al. 2024 (Llama 3, arXiv 2407.21783) section 3.3.2: Megatron-style
  tensor parallelism (it cites Shoeybi et al. and Korthikanti et al.), so the same saved tensors as
  ``"megatron"``; FSDP that "shards optimizer states and gradients, but for model shards we do not
  reshard after forward computation" (FSDP ``SHARD_GRAD_OP``: each micro-batch's gradients are
  reduce-scattered into a sharded fp32 accumulator, "reduce-scatter gradients in FP32"), where
  ``torch.distributed.pipelining`` instead accumulates unsharded gradients until one reduce-scatter per
  step; and the stage split "we reduce one Transformer layer each from the first and the last stages
  ... the first model chunk on the first stage has only the embedding, and the last model chunk on the
  last stage has only output projection and loss calculation": the embedding and the output layer each
  count as one block when the blocks are split (torchtitan's ``generate_llm_fqn_per_model_part(...,
  input_weight=1, output_weight=1)``, ``torchtitan/distributed/pipeline_parallel.py`` at
  ``1ce7f761d76bc408c9e6f32e2bbd2cf9f2ac25ae``, implements the same rule); and context parallelism that
  all-gathers K and V, "exposed in the critical path", where torch's ring overlaps the attention.
- ``"deepspeed"``: DeepSpeed's ZeRO engine as Lightning's ``DeepSpeedStrategy`` runs it (Rajbhandari et al.
  2019, arXiv 1910.02054, [R20]; ZeRO-Offload, Ren et al. 2021, arXiv 2101.06840). Its kernels are
  torch's (no sequence-parallel shards, no fused SwiGLU, blocks only); what differs is where the model
  states live, which :class:`ZeroConfig` describes and ``lightning_memplan.model.deepspeed`` counts:
  16-bit precisions cast the model to 16 bit (no autocast copies) and keep an fp32 master copy and fp32
  optimizer states in the ZeRO optimizer; stages 1/2 keep every 16-bit parameter on every rank in one
  flat buffer; stage 3 partitions them and gathers each module's for its forward and backward. Sources
  (DeepSpeed at commit ``edaa7221267243c7be7fb49c5d5f5c4fb97b4641``, Apache-2.0, facts only):
  ``deepspeed/runtime/zero/config.py`` (``DeepSpeedZeroConfig``: the defaults below),
  ``deepspeed/runtime/zero/offload_config.py`` (``pin_memory`` defaults to True),
  ``deepspeed/runtime/zero/stage_1_and_2.py``, ``deepspeed/runtime/zero/stage3.py``,
  ``deepspeed/runtime/zero/partitioned_param_coordinator.py`` and ``docs/_pages/config-json.md``
  ("offload_param ... Valid only with stage 3", "offload_optimizer ... Valid for ZeRO stage 1, 2, 3").
- ``"fsdp1"``: torch's kernels with FSDP1, ``FullyShardedDataParallel`` as Lightning's ``FSDPStrategy`` runs it
  (``ParallelPlan.zero`` from its ``ShardingStrategy``: FULL_SHARD and HYBRID_SHARD 3, SHARD_GRAD_OP 2,
  NO_SHARD 0 without DDP buckets). Sources, torch 2.13 ``torch/distributed/fsdp/``: ``_flat_param.py``
  (``FlatParamHandle._init_flat_param_and_metadata``: one ``FlatParameter`` per wrapped unit, each
  original parameter aligned to 16 bytes under ``use_orig_params`` (``_get_aligned_numel``) and the whole
  padded to a multiple of the world size "to avoid a copy for the post-backward reduce-scatter";
  ``_get_shard``: each rank keeps ``padded / d``; ``_all_gather_flat_param``: the gather writes into the
  unit's ``_full_param_padded``, the unsharded flat parameter, freed by ``_free_unsharded_flat_param``),
  ``_runtime_utils.py`` (``_post_forward_reshard``: FULL_SHARD frees a unit after its forward except the
  root's, "with the intention that they are immediately used for backward"; SHARD_GRAD_OP keeps every
  unit; ``_should_free_in_backward``; ``_prefetch_handle`` with ``BackwardPrefetch.BACKWARD_PRE``, the
  default: the next unit is gathered before the current unit's backward; ``_reduce_grad``: the unsharded
  flat gradient is reduce-scattered into a new sharded gradient, for HYBRID_SHARD then all-reduced in
  place across the replicas; ``_reduce_grad_no_shard``: NO_SHARD all-reduces the flat gradient in
  place), ``_limiter_utils.py`` (``_FreeEventQueue``: ``limit_all_gathers`` lets at most two freed
  units' all-gathers run ahead, so with ``forward_prefetch`` at most two units beyond the one computing;
  without prefetch one unit is gathered at a time) and ``fully_sharded_data_parallel.py`` (``CPUOffload``:
  sharded parameters and gradients in host memory, the optimizer step on the CPU).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from lightning_memplan.validation import check_bool, check_int

__all__ = [
    "DEEPSPEED_OFFLOADS",
    "FRAMEWORKS",
    "FSDP2_OFFLOADS",
    "FrameworkFacts",
    "ZeroConfig",
    "framework_facts",
    "pipeline_units",
    "rank_block_counts",
    "stage_block_counts",
    "zero_settings_from_deepspeed_config",
]


@dataclass(frozen=True, kw_only=True)
class FrameworkFacts:
    """What one training stack does where the models depend on it.

    Attributes:
        sp_saves_shard: sequence-parallel linears save their 1/t input shard (and gather it again in
            backward) instead of the gathered input (DTensor's ``ColwiseParallel`` keeps the gathered one).
        fused_swiglu: the SwiGLU saves only its input (the fc1 output), not silu's output and the product.
        grads_per_microbatch: FSDP inside pipeline stages reduce-scatters every micro-batch's gradients
            into a sharded accumulator (False: unsharded accumulation, one reduce-scatter per step).
        embedding_head_weight: blocks the embedding and the output layer each count as when blocks are
            split over pipeline stages (0: only blocks are split).
        cp_all_gather: context parallelism all-gathers K and V before the attention, on the critical path
            (Llama 3: "the all-gather communication latency is exposed"), instead of a ring that overlaps
            the blockwise attention (torch's ``context_parallel``).
        fsdp_flat_params: data parallelism is FSDP1 (``FullyShardedDataParallel``): one ``FlatParameter``
            per unit, padded to a multiple of the shard group, all-gathered straight into the unit's
            unsharded flat buffer (no copy-out, nothing kept from the previous unit), the root unit kept
            unsharded from its forward to its backward, ``NO_SHARD`` computing on the flat parameter itself
            (``False``: FSDP2's per-parameter sharding, ``lightning_memplan.model.estimate``).
    """

    sp_saves_shard: bool
    fused_swiglu: bool
    grads_per_microbatch: bool
    embedding_head_weight: int
    cp_all_gather: bool = False
    fsdp_flat_params: bool = False


FRAMEWORKS: dict[str, FrameworkFacts] = {
    "torch": FrameworkFacts(sp_saves_shard=False, fused_swiglu=False, grads_per_microbatch=False, embedding_head_weight=0),
    "megatron": FrameworkFacts(sp_saves_shard=True, fused_swiglu=True, grads_per_microbatch=False, embedding_head_weight=0),
    "llama3": FrameworkFacts(sp_saves_shard=True, fused_swiglu=True, grads_per_microbatch=True, embedding_head_weight=1,
                             cp_all_gather=True),
    "deepspeed": FrameworkFacts(sp_saves_shard=False, fused_swiglu=False, grads_per_microbatch=False,
                                embedding_head_weight=0),
    "fsdp1": FrameworkFacts(sp_saves_shard=False, fused_swiglu=False, grads_per_microbatch=False,
                            embedding_head_weight=0, fsdp_flat_params=True),
}


def framework_facts(name: str) -> FrameworkFacts:
    """The facts of ``name`` (one of :data:`FRAMEWORKS`; ``TrainSpec`` validates the name)."""
    return FRAMEWORKS[name]


def pipeline_units(n_layers: int, framework: str) -> int:
    """Units split over the pipeline's stages: the L blocks, plus the embedding and the output layer
    weighted as blocks where the stack does so (``"llama3"``: L + 2)."""
    return n_layers + 2 * framework_facts(framework).embedding_head_weight


def stage_block_counts(n_layers: int, n_stages: int, framework: str = "torch") -> list[int]:
    """Blocks on each of ``n_stages`` consecutive stages (``p * v`` when interleaved).

    The units (:func:`pipeline_units`) are split evenly, the first ``units mod n_stages`` stages taking one
    more (``torch.distributed.pipelining``'s and :func:`lightning_memplan.parallel.pipeline.split_blocks`'s
    rule, torchtitan's too); the first stage then gives up the embedding's weight and the last the output
    layer's. Llama 3 405B, 126 blocks on 16 x 8 stages: stage 0 and stage 127 hold 0 blocks, the rest 1."""
    w = framework_facts(framework).embedding_head_weight
    base, extra = divmod(n_layers + 2 * w, n_stages)
    counts = [base + (1 if i < extra else 0) for i in range(n_stages)]
    if n_stages > 1:
        counts[0] -= w
        counts[-1] -= w
    else:
        counts[0] -= 2 * w
    return counts


def rank_block_counts(n_layers: int, p: int, v: int = 1, framework: str = "torch") -> list[int]:
    """Blocks held by each of the ``p`` pipeline ranks, rank r holding stages r, r + p, ..., r + (v-1) p
    (looped placement, Narayanan et al. 2021 section 2.2.2; :func:`lightning_memplan.parallel.pipeline.
    stage_indices`)."""
    counts = stage_block_counts(n_layers, p * v, framework)
    return [sum(counts[r + k * p] for k in range(v)) for r in range(p)]


#: ``TrainSpec.offload`` values: where DeepSpeed keeps what ZeRO-Offload moves to the host. ``"optimizer"``
#: is ``zero_optimization.offload_optimizer.device="cpu"`` (fp32 master weights, optimizer states and fp32
#: gradients on the host, the step on the CPU; ZeRO stage 1, 2 or 3); ``"params"`` adds
#: ``offload_param.device="cpu"`` (the 16-bit parameter partitions on the host; ZeRO-3 only, so it implies
#: ``"optimizer"`` here).
DEEPSPEED_OFFLOADS = ("none", "optimizer", "params")

#: ``TrainSpec.offload`` values under ``framework="torch"`` (memplan_auto's FSDP2): ``"params"`` is
#: ``fully_shard(offload_policy=CPUOffloadPolicy())``, which moves the sharded parameters, their gradients
#: and the optimizer states to the host together (torch 2.13 ``torch/distributed/fsdp/_fully_shard/
#: _fsdp_api.py``, ``CPUOffloadPolicy``); there is no optimizer-only form. ``lightning_memplan.model.offload``
#: counts it.
FSDP2_OFFLOADS = ("none", "params")

_E8 = 100_000_000


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """DeepSpeed's ``zero_optimization`` settings that size memory, in elements, with DeepSpeed's defaults
    (``deepspeed/runtime/zero/config.py``, ``DeepSpeedZeroConfig``, at commit
    ``edaa7221267243c7be7fb49c5d5f5c4fb97b4641``). Lightning's ``DeepSpeedStrategy(...)`` without a
    ``config`` writes its own: ``reduce_bucket_size=allgather_bucket_size=2e8``, ``overlap_comm=True``,
    ``sub_group_size=1e12``, offload ``pin_memory=False``; :func:`zero_settings_from_deepspeed_config`
    reads whatever the strategy holds.

    Attributes:
        reduce_bucket_size: elements per gradient reduce bucket (``5e8``). Stages 1/2 allocate one 16-bit
            bucket of this size (two with ``overlap_comm``) for each backward (``stage_1_and_2.py``,
            ``setup_buckets``); stage 3 one for the whole run (``stage3.py``, the IPG buffer).
        allgather_bucket_size: elements per all-gather of the updated parameters after a stage 1/2 step
            (``5e8``); read for completeness, 0 bytes: ``all_gather_into_tensor`` writes straight into the
            flat 16-bit parameter buffer (``deepspeed/runtime/utils.py``, ``all_gather_dp_groups``).
        contiguous_gradients: copy each reduced gradient into one contiguous partition buffer (``True``);
            the reduce buckets exist only with it.
        overlap_comm: overlap the reduction with the backward (``None``: DeepSpeed's rule, True for stage 3
            only; ``overlap_comm_valid``). Stages 1/2 then keep two reduce buckets.
        prefetch_bucket_size: ``stage3_prefetch_bucket_size``, elements ZeRO-3 gathers ahead of use
            (``5e7``; ``partitioned_param_coordinator.py``, ``fetch_sub_module``).
        max_live_parameters: ``stage3_max_live_parameters``, the most gathered elements the prefetch may
            bring the total to (``1e9``).
        max_reuse_distance: ``stage3_max_reuse_distance``, a gathered parameter whose next use comes within
            this many elements of other parameters is kept (``1e9``; ``__params_to_release``): at the loss
            the last ``max_reuse_distance / 2`` elements of the forward are still gathered.
        param_persistence_threshold: ``stage3_param_persistence_threshold``, tensors of at most this many
            elements are never partitioned (``1e5``; ``partition_parameters.py``, ``ds_persist``).
        sub_group_size: elements of the fp32 partition the ZeRO-3 step converts at a time (``1e9``).
        pin_memory: offloaded host buffers are page-locked (``offload_config.py`` default ``True``;
            Lightning's default config passes ``False``). The host bytes are the same either way.
    """

    reduce_bucket_size: int = 5 * _E8
    allgather_bucket_size: int = 5 * _E8
    contiguous_gradients: bool = True
    overlap_comm: bool | None = None
    prefetch_bucket_size: int = _E8 // 2
    max_live_parameters: int = 10 * _E8
    max_reuse_distance: int = 10 * _E8
    param_persistence_threshold: int = 100_000
    sub_group_size: int = 10 * _E8
    pin_memory: bool = True

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if spec.name in ("contiguous_gradients", "pin_memory"):
                checked: Any = check_bool(f"ZeroConfig.{spec.name}", value)
            elif spec.name == "overlap_comm":
                checked = None if value is None else check_bool("ZeroConfig.overlap_comm", value)
            else:
                checked = check_int(f"ZeroConfig.{spec.name}", value, minimum=0, maximum=2**62,
                                    hint="a number of elements, e.g. 500000000 (DeepSpeed's 5e8)")
            object.__setattr__(self, spec.name, checked)

    def overlaps(self, stage: int) -> bool:
        """Whether the reduction overlaps the backward at ``stage`` (DeepSpeed's default: stage 3 only)."""
        return self.overlap_comm if self.overlap_comm is not None else stage == 3

    def to_dict(self) -> dict[str, Any]:
        return {spec.name: getattr(self, spec.name) for spec in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ZeroConfig:
        known = {spec.name for spec in fields(cls)}
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise TypeError(f"ZeroConfig got unknown keys {unknown}; known: {sorted(known)}")
        return cls(**dict(data))


#: DeepSpeed config keys (``zero_optimization``) read into :class:`ZeroConfig`: ``(field, key, alias)``.
_ZERO_KEYS = (
    ("reduce_bucket_size", "reduce_bucket_size", None),
    ("allgather_bucket_size", "allgather_bucket_size", None),
    ("contiguous_gradients", "contiguous_gradients", None),
    ("overlap_comm", "overlap_comm", None),
    ("prefetch_bucket_size", "stage3_prefetch_bucket_size", "prefetch_bucket_size"),
    ("max_live_parameters", "stage3_max_live_parameters", "max_live_parameters"),
    ("max_reuse_distance", "stage3_max_reuse_distance", "max_reuse_distance"),
    ("param_persistence_threshold", "stage3_param_persistence_threshold", "param_persistence_threshold"),
    ("sub_group_size", "sub_group_size", None),
)


def _config_value(name: str, value: Any, *, flag: bool) -> Any:
    """A DeepSpeed config value as an int (``5e8`` written as a float in JSON is 500000000) or a bool."""
    if flag:
        return check_bool(f"zero_optimization.{name}", value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return check_int(f"zero_optimization.{name}", value, minimum=0, maximum=2**62,
                     hint="a number of elements, e.g. 5e8")


def _offload_device(section: Any, name: str) -> str:
    if section is None or section is False:
        return "none"
    if section is True:  # the deprecated boolean form
        return "cpu"
    if not isinstance(section, Mapping):
        raise TypeError(f"zero_optimization.{name}={section!r} must be a mapping such as {{'device': 'cpu'}}")
    device = str(section.get("device", "none") or "none").lower()
    if device not in ("none", "cpu", "nvme"):
        raise ValueError(f"zero_optimization.{name}.device={device!r} must be 'none', 'cpu' or 'nvme'")
    return device


def zero_settings_from_deepspeed_config(config: Mapping[str, Any] | None) -> tuple[int, str, ZeroConfig]:
    """``(stage, offload, ZeroConfig)`` from a DeepSpeed config dict (``DeepSpeedStrategy.config``).

    Reads ``zero_optimization``: ``stage``, the bucket and stage-3 sizes of :class:`ZeroConfig` (DeepSpeed's
    names, ``stage3_`` prefixed or not; ``"auto"`` means DeepSpeed's default), ``offload_optimizer.device``
    / ``offload_param.device`` (and the deprecated ``cpu_offload`` / ``cpu_offload_param`` booleans) and
    their ``pin_memory``. ``"nvme"`` offload is read as ``"cpu"``: the host figure is then an upper bound
    (DeepSpeed keeps only swap buffers in host memory).

    Raises:
        TypeError, ValueError: a value DeepSpeed would refuse, or an ``offload_param`` without
            ``offload_optimizer`` (not modelled; the message says what to pass instead).
    """
    zero = (config or {}).get("zero_optimization") if isinstance(config, Mapping) else None
    if zero is None or zero is False:
        return 0, "none", ZeroConfig()
    if zero is True:
        zero = {}
    if not isinstance(zero, Mapping):
        raise TypeError(f"zero_optimization={zero!r} must be a mapping (DeepSpeed's config section)")
    stage = check_int("zero_optimization.stage", zero.get("stage", 0), minimum=0, maximum=3,
                      hint="DeepSpeed's ZeRO stages are 0, 1, 2 and 3")
    values: dict[str, Any] = {}
    for field_name, key, alias in _ZERO_KEYS:
        raw = zero.get(key, zero.get(alias) if alias else None)
        if raw is None or raw == "auto":
            continue
        values[field_name] = _config_value(key, raw, flag=field_name in ("contiguous_gradients", "overlap_comm"))
    optimizer_device = _offload_device(zero.get("offload_optimizer"), "offload_optimizer")
    param_device = _offload_device(zero.get("offload_param"), "offload_param")
    if optimizer_device == "none" and zero.get("cpu_offload") is True:
        optimizer_device = "cpu"
    if param_device == "none" and zero.get("cpu_offload_param") is True:
        param_device = "cpu"
    if param_device != "none" and optimizer_device == "none":
        raise ValueError(
            "zero_optimization.offload_param without offload_optimizer is not modelled (TrainSpec.offload='params' "
            "offloads both); add offload_optimizer={'device': 'cpu'} or pass an explicit TrainSpec"
        )
    offload = "params" if param_device != "none" else "optimizer" if optimizer_device != "none" else "none"
    for name in ("offload_param", "offload_optimizer"):
        section = zero.get(name)
        if isinstance(section, Mapping) and "pin_memory" in section and section.get("device", "none") != "none":
            values["pin_memory"] = check_bool(f"zero_optimization.{name}.pin_memory", section["pin_memory"])
    return stage, offload, ZeroConfig(**values)
