"""Stage 1 of the estimate: resolve one pipeline stage of a step once (``docs/architecture.md``, "The
estimate's stages").

:func:`resolve_stage` reads the ``TrainSpec`` and the ``ParallelPlan`` for one stage and returns a
:class:`ResolvedStage`: the element sizes and kernels (``model/sizes.py``), the optimizer's bytes, the
stage's blocks and parameter counts (``model/stage_layout.py``), the tokens of one micro-batch on this
rank, the micro-batches in flight and the step's flags (accumulation, offloads, the framework's FSDP
kind). The later stages (``model/states.py``, ``model/comm_buffers.py``, ``model/activations.py``,
``model/assemble.py``) take this record and the plan, never the ``TrainSpec``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

from lightning_memplan.model import frameworks, offload, terms
from lightning_memplan.model.frameworks import ZeroConfig
from lightning_memplan.model.low_precision import LowPrecisionStage, stage_low_precision
from lightning_memplan.model.sizes import Kernels, OptimizerBytes, PrecisionBytes, kernels_of, optimizer_bytes
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.model.stage_layout import StageLayout, StageParams, stage_layout, stage_params

__all__ = ["ResolvedStage", "resolve_stage"]


@dataclass(frozen=True, kw_only=True)
class ResolvedStage:
    """One pipeline stage of one step, resolved: what every later stage of the estimate reads.

    Attributes:
        kernels: element sizes and kernel choices (:class:`~lightning_memplan.model.sizes.Kernels`).
        optimizer: the optimizer's state bytes and step kind (:class:`~lightning_memplan.model.sizes.
            OptimizerBytes`).
        layout: the stage's blocks, embedding and head. params: their parameter counts on this rank.
        b: sequences per micro-batch. s: tokens per sequence on this rank (``seq_len / cp``). seq_len: the
            whole sequence. tokens: ``b s``. t, sp: tensor parallelism and sequence parallelism.
        shard: ranks ZeRO/FSDP shards over (``dp * cp``).
        inflight: micro-batches this stage holds at its forward peak (``terms.pipeline_inflight_microbatches``).
        batch_tokens: tokens of the dataloader batch the rank holds during the step (``b s``, times m
            under a pipeline: every stage receives the step's m micro-batches).
        accumulation: micro-batches accumulated per optimizer step. grads_alive_in_forward: the previous
            step's gradients exist during the forward.
        framework: ``TrainSpec.framework``. flat_params: FSDP1's flat parameters (``framework="fsdp1"``).
            grads_per_microbatch: FSDP inside a pipeline reduce-scatters every micro-batch (Llama 3).
        offload: ``TrainSpec.offload``. offload_params: FSDP2's ``CPUOffloadPolicy``.
            offload_activations: ``save_on_cpu`` around every block. zero_config: DeepSpeed's settings.
        low: the stage's quantized base weights or float8 linears as numbers (``model/low_precision.py``),
            ``None`` without them.
    """

    kernels: Kernels
    optimizer: OptimizerBytes
    layout: StageLayout
    params: StageParams
    b: int
    s: int
    seq_len: int
    tokens: int
    t: int
    sp: bool
    shard: int
    inflight: float
    batch_tokens: int
    accumulation: int
    grads_alive_in_forward: bool
    framework: str
    flat_params: bool
    grads_per_microbatch: bool
    offload: str
    offload_params: bool
    offload_activations: bool
    zero_config: ZeroConfig
    low: LowPrecisionStage | None = None

    def __hash__(self) -> int:
        # computed once: the record is the cache key of the later stages (model/activations.py), looked up
        # on every estimate the planner asks for
        cached: int | None = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(self.__dict__[name] for name in _FIELDS))
            object.__setattr__(self, "_hash", cached)
        return cached

    @property
    def sizes(self) -> PrecisionBytes:
        """Bytes per element of each tensor kind (``kernels.sizes``)."""
        return self.kernels.sizes

    @property
    def accumulating(self) -> bool:
        """Gradients accumulate over several micro-batches of one optimizer step."""
        return self.accumulation > 1

    @property
    def device(self) -> str:
        return self.kernels.device


#: The fields of :class:`ResolvedStage`, in order (its cached hash reads them).
_FIELDS = tuple(f.name for f in fields(ResolvedStage))


@functools.lru_cache(maxsize=4096)
def _step(train: TrainSpec) -> tuple[Kernels, OptimizerBytes, frameworks.FrameworkFacts, bool, ZeroConfig]:
    """What every stage of one step shares, read from ``train`` once: kernels, optimizer, framework facts,
    whether FSDP2's ``CPUOffloadPolicy`` is on, the ZeRO settings."""
    return (kernels_of(train), optimizer_bytes(train), frameworks.framework_facts(train.framework),
            offload.offloads_params(train), train.zero_config or ZeroConfig())


@functools.lru_cache(maxsize=8192)  # frozen specs; the planner asks the same stage under many layouts
def resolve_stage(model: ModelSpec, train: TrainSpec, plan: ParallelPlan, stage: int) -> ResolvedStage:
    """Resolve ``stage`` of ``plan`` for ``train`` (stage 1 of the estimate; the module docstring)."""
    kernels, optimizer, facts, offload_params, zero_config = _step(train)
    layout = stage_layout(model, plan, stage, train.framework)
    b, s = train.micro_batch, train.seq_len // plan.cp
    inflight = terms.pipeline_inflight_microbatches(stage, plan.pp, plan.microbatches, plan.schedule, plan.virtual_stages)
    return ResolvedStage(
        kernels=kernels,
        optimizer=optimizer,
        layout=layout,
        params=stage_params(model, plan.tp, plan.pp > 1, layout),
        b=b,
        s=s,
        seq_len=train.seq_len,
        tokens=b * s,
        t=plan.tp,
        sp=plan.sp,
        shard=plan.dp * plan.cp,
        inflight=inflight,
        batch_tokens=train.micro_batch * train.seq_len * (plan.microbatches if plan.pp > 1 else 1),
        accumulation=train.grad_accumulation,
        grads_alive_in_forward=train.grads_alive_in_forward,
        framework=train.framework,
        flat_params=facts.fsdp_flat_params,
        grads_per_microbatch=facts.grads_per_microbatch,
        offload=train.offload,
        offload_params=offload_params,
        offload_activations=train.offload_activations,
        zero_config=zero_config,
        low=stage_low_precision(model, kernels, plan, layout, b * s, inflight),
    )
