"""Step-time model: compute per GEMM shape and GPU generation (:mod:`.efficiency`), communication per parallel axis
(exposed vs overlapped), the pipeline bubble, and the optimizer step.

``T_step = T_compute + T_bubble + T_comm,exposed + T_optimizer`` (the terms [N21] analyses: computation,
the pipeline bubble of its section 2.2 and each parallel axis's communication, section 3).
Per micro-batch "slot" on the bottleneck pipeline stage:
``slot = compute_mb + tp_mb + cp_exposed_mb + pp_mb + loss_mb``; a step runs ``m + (p-1)/v`` slots
(m slots of work plus the bubble [N21 section 2.2]); data-parallel gradient traffic is added once per
step minus what hides under backward compute.

Sources (besides those of :mod:`.flops` and :mod:`.comm`):
  [N21]  Narayanan et al. 2021, arXiv 2104.04473: section 2.2.1 bubble fraction (p-1)/m of the ideal
         time, i.e. (p-1)/(m+p-1) of the total; section 2.2.2 interleaved (p-1)/(v m) with v times the
         point-to-point messages; section 3.3: 2 all-reduces of b s h in the forward and 2 in the backward
         per layer under tensor parallelism; section 4.1 scatter/gather: pipeline messages / t.
  [K22]  Korthikanti et al. 2022, arXiv 2205.05198, section 4.2.2: sequence parallelism replaces each
         all-reduce by a reduce-scatter + all-gather of the same total volume.
  [R20]  Rajbhandari et al. 2020 (ZeRO), arXiv 1910.02054, section 7: ZeRO-1/2 move the same volume as
         data parallelism (reduce-scatter + all-gather = all-reduce), ZeRO-3 1.5x (parameters gathered
         in forward and again in backward).
  [Z23]  Zhao et al. 2023 (PyTorch FSDP), arXiv 2304.11277, section 3.3: all-gathers are prefetched and
         overlap the previous unit's compute; only the first unit's gather is exposed.
  [L20]  Li et al. 2020 (PyTorch DDP), arXiv 2006.15704, section 3.2.3: gradient buckets all-reduce
         while backward continues; only the tail is exposed.
  [L23]  Liu et al. 2023 (Ring Attention), arXiv 2310.01889: each of c ranks passes its K/V block
         around the ring, c-1 steps overlapped with the blockwise attention compute.
  [LK24] Hsu et al. 2024 (Liger Kernel), arXiv 2410.10989, section 3.3: a chunked linear cross-entropy
         computes the gradient in the forward, the same GEMM FLOPs as the naive loss.
  [TT-FSDP] torchtitan ``torchtitan/models/llama3/infra/parallelize.py`` ``apply_fsdp``:
         ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``; FSDP2 prefetches the
         next unit's all-gather during the current unit's compute.
  [TT-AC] torchtitan op-level selective AC (see :mod:`.flops`).
  [L3]   Dubey et al. 2024 (Llama 3), arXiv 2407.21783, section 3.3.2: 126 layers on 16 pipeline
         stages, the first and last stage one layer lighter; Table 4: 38-43 % BF16 MFU.
  [FA2]  Dao 2023, arXiv 2307.08691, section 3.1.1: causal masking skips the blocks above the diagonal.
  [P22]  Chowdhery et al. 2022 (PaLM), arXiv 2204.02311, Appendix B: MFU counts 12 L h s per token.
  [NCCL] NVIDIA nccl-tests (doc/PERFORMANCE.md, sendrecv_perf): point-to-point latency of tens of
         microseconds for small messages, launch and synchronisation included.
  [MFU]  Narayanan et al. 2021 Table 1: 44-52 % of A100 peak end to end (bubble and communication
         included); Dubey et al. 2024 (Llama 3), arXiv 2407.21783, Table 4: 38-43 % BF16 MFU on H100;
         Jiang et al. 2024 (MegaScale), arXiv 2402.15627: 55.2 % MFU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_memplan.hardware.spec import HardwareSpec
from lightning_memplan.model import frameworks, terms
from lightning_memplan.model.sizes import kernels_of, optimizer_bytes, precision_bytes
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.planning import efficiency as E
from lightning_memplan.planning import flops as F
from lightning_memplan.planning.comm import (
    all_gather_time,
    all_reduce_time,
    group_link,
    p2p_time,
    reduce_scatter_time,
)
from lightning_memplan.planning.space import Layout

__all__ = [
    "CAUSAL_KERNEL_SHARE",
    "CHUNK_OVERHEAD_S",
    "CP_RING_STEP_OVERHEAD_S",
    "FSDP_UNIT_OVERHEAD_S",
    "OVERLAP_EFFICIENCY",
    "TIME_MODEL_OFF",
    "Layout",
    "LayoutTimes",
    "StepTime",
    "bubble_fraction",
    "StepTimeModel",
    "bubble_overhead",
    "is_cpu_host",
    "predict_step_time",
    "time_model_applies",
    "topology_notes",
]

#: Fraction of a compute window that can hide concurrent communication (the rest is lost to SM
#: contention and the last bucket/unit that has nothing left to overlap with) [L20, Z23].
OVERLAP_EFFICIENCY = 0.9
#: Share of the s x s score square a causal fused attention kernel computes (FlashAttention skips the
#: blocks above the diagonal [FA2 section 3.1.1]); FLOP counts (and MFU) count the full square [P22].
CAUSAL_KERNEL_SHARE = 0.5
#: Fixed cost of one extra context-parallel ring step (a send/recv pair plus one more attention kernel
#: launch and its stream synchronisation), seconds: NCCL point-to-point operations cost 10-30 us even for
#: small messages [NCCL], the blockwise kernel's launch a few more [L23 section 3].
CP_RING_STEP_OVERHEAD_S = 40e-6
#: Placeholder seconds per token when the step is not modelled (a CPU host): equal for every layout,
#: so the ranking falls to the change cost; never shown (the explanation prints :data:`TIME_MODEL_OFF`).
UNMODELLED_S_PER_TOKEN = 1e-6
#: The one line the explanation prints instead of times when the step is not modelled.
TIME_MODEL_OFF = "step time not modelled on CPU (no accelerator figures); layouts ranked by fewest changes among those that fit"
#: Fixed critical-path cost per FSDP unit per collective: the copy-in before an all-gather, the
#: copy-out after it and the stream synchronisation [Z23 section 4.2 and 7.2, where FSDP trails DDP on
#: small models]; one unit per block plus the root (embedding/head).
FSDP_UNIT_OVERHEAD_S = 100e-6
#: Fixed cost per loss chunk (three GEMM launches plus the elementwise kernels), seconds [LK24].
CHUNK_OVERHEAD_S = 30e-6
def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Share of the step the pipeline idles: ``(p-1) / (v m + p - 1)`` [N21 2.2.1; v > 1: 2.2.2].

    For v = 1 this is the GPipe/1F1B ``(p-1)/(m+p-1)`` (Huang et al. 2019, GPipe, arXiv 1811.06965,
    section 2.2: ``O((K-1)/(M+K-1))`` for K partitions and M micro-batches)."""
    return (p - 1) / (v * m + p - 1) if p > 1 else 0.0


def bubble_overhead(p: int, m: int, v: int = 1) -> float:
    """Bubble time relative to the ideal time: ``(p-1) / (v m)`` [N21 eq. in 2.2.2]."""
    return (p - 1) / (v * m) if p > 1 else 0.0


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Predicted time of one optimizer step, and where it goes.

    Attributes:
        total_s: predicted step time, seconds.
        compute_s: m micro-batches of forward/backward/recompute on the bottleneck stage.
        bubble_s: pipeline fill and drain.
        exposed_s: ``{axis: seconds}`` communication on the critical path (tp, cp, pp, dp, loss).
        overlapped_s: ``{axis: seconds}`` communication hidden under compute.
        optimizer_s: the optimizer step (memory bound).
        tokens: tokens per optimizer step (all replicas).
        model_flops: FLOPs of the step without recomputation (for MFU).
        hardware_flops: FLOPs actually executed, recomputation included.
        tokens_per_s: tokens / total_s.
        mfu: model_flops / (total_s * world * peak).
        modelled: False on a CPU host (:func:`time_model_applies`): the times are only a ranking aid.
    """

    total_s: float
    compute_s: float
    bubble_s: float
    exposed_s: Mapping[str, float] = field(default_factory=dict)
    overlapped_s: Mapping[str, float] = field(default_factory=dict)
    optimizer_s: float = 0.0
    tokens: int = 0
    model_flops: float = 0.0
    hardware_flops: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    modelled: bool = True

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("total_s", "compute_s", "bubble_s", "optimizer_s", "tokens",
                                              "model_flops", "hardware_flops", "tokens_per_s", "mfu", "modelled")}
        out["exposed_s"] = dict(self.exposed_s)
        out["overlapped_s"] = dict(self.overlapped_s)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepTime:
        return cls(**{**data, "exposed_s": dict(data.get("exposed_s", {})), "overlapped_s": dict(data.get("overlapped_s", {}))})


def is_cpu_host(hardware: HardwareSpec) -> bool:
    """Whether ``hardware`` is :func:`~lightning_memplan.hardware.spec.detect_hardware`'s description of
    a host without CUDA (named ``"cpu (...)"``): no CUDA context, no NCCL, no accelerator speeds."""
    return hardware.name.startswith("cpu")


def time_model_applies(hardware: HardwareSpec, train: TrainSpec) -> bool:
    """Whether step times mean anything here: not for a CPU host (``train.device == "cpu"`` or a
    :func:`~lightning_memplan.hardware.spec.detect_hardware` CPU description, which has no speed
    figures); there the planner ranks by memory and change cost and says so (:data:`TIME_MODEL_OFF`)."""
    return train.device != "cpu" and not is_cpu_host(hardware)


class LayoutTimes:
    """All time terms of one :class:`Layout`, precomputed once so that each of the (recompute, zero,
    loss) combinations costs a few float operations (:meth:`total`), and expanded into a
    :class:`StepTime` only for the candidates that are kept (:meth:`step_time`)."""

    __slots__ = (
        "layout", "world", "slots", "compute_mb", "tp_mb", "cp_mb", "cp_hidden_mb", "pp_mb", "loss_mb",
        "dp_exposed", "dp_overlapped", "opt_s", "tokens", "model_flops", "recompute_flops", "peak", "notes", "modelled",
    )

    # Filled in by :meth:`StepTimeModel.layout` (declared here for type checkers; ``__slots__`` holds them).
    layout: Layout
    world: int
    slots: float
    compute_mb: dict[str, float]
    tp_mb: dict[str, float]
    cp_mb: float
    cp_hidden_mb: float
    pp_mb: float
    loss_mb: dict[str, float]
    dp_exposed: dict[tuple[int, str], float]
    dp_overlapped: dict[tuple[int, str], float]
    opt_s: dict[int, float]
    tokens: int
    model_flops: float
    recompute_flops: dict[str, float]
    peak: float
    notes: tuple[str, ...]
    modelled: bool

    def total(self, recompute: str, zero: int, loss: str) -> float:
        slot = self.compute_mb[recompute] + self.tp_mb[recompute] + self.cp_mb + self.pp_mb + self.loss_mb[loss]
        return self.slots * slot + self.dp_exposed[(zero, recompute)] + self.opt_s[zero]

    def step_time(self, recompute: str, zero: int, loss: str) -> StepTime:
        lay = self.layout
        m, bubble_slots = lay.m, self.slots - lay.m
        slot = self.compute_mb[recompute] + self.tp_mb[recompute] + self.cp_mb + self.pp_mb + self.loss_mb[loss]
        exposed = {
            "tp": m * self.tp_mb[recompute],
            "cp": m * self.cp_mb,
            "pp": m * self.pp_mb,
            "loss": m * self.loss_mb[loss],
            "dp": self.dp_exposed[(zero, recompute)],
        }
        overlapped = {"cp": m * self.cp_hidden_mb, "dp": self.dp_overlapped[(zero, recompute)]}
        total = self.total(recompute, zero, loss)
        hw = self.model_flops + self.recompute_flops[recompute]
        return StepTime(
            total_s=total,
            compute_s=m * self.compute_mb[recompute],
            bubble_s=bubble_slots * slot,
            exposed_s={k: v for k, v in exposed.items() if v > 0},
            overlapped_s={k: v for k, v in overlapped.items() if v > 0},
            optimizer_s=self.opt_s[zero],
            tokens=self.tokens,
            model_flops=self.model_flops,
            hardware_flops=hw,
            tokens_per_s=self.tokens / total if total > 0 else 0.0,
            mfu=self.model_flops / (total * self.world * self.peak) if total > 0 else 0.0,
            modelled=self.modelled,
        )


def topology_notes(hardware: HardwareSpec, dp: int, tp: int, pp: int, cp: int) -> list[str]:
    """Which parallel groups cross the node boundary (their traffic then runs on the network)."""
    notes = []
    if group_link(hardware, 1, tp).inter_node:
        notes.append(f"tp={tp} crosses nodes (TP all-reduces on the {hardware.resolved('inter_node_bw') / 1e9:.1f} GB/s network)")
    if cp > 1 and group_link(hardware, tp, cp).inter_node:
        notes.append(f"cp={cp} crosses nodes")
    return notes


class StepTimeModel:
    """The step-time model for one (model, base train, hardware): model-level constants are computed
    once here, so :meth:`layout` costs only arithmetic per layout (the planner calls it thousands of
    times).

    Per micro-batch, one block on one rank costs (see :mod:`.efficiency`)
    ``GEMM FLOPs / (peak e_gemm(M, N)) + c attention FLOPs / (peak e_attn) + element-wise bytes / HBM``,
    all divided by t, with ``M = b s / c`` tokens and ``N`` the narrowest TP-split output width.
    Recomputation re-runs the forward of what it drops: ``"selective"`` the attention core,
    ``"selective_op"`` every second matmul and the element-wise ops, ``"full"`` the whole block.

    Args:
        model, train, hardware: the specs; ``train`` supplies seq_len, precision, optimizer and an
            explicit ``loss_chunk_size`` (micro-batch, recompute and loss vary per call).
        recomputes, zeros, losses: option values :class:`LayoutTimes` precomputes.
    """

    def __init__(
        self,
        model: ModelSpec,
        train: TrainSpec,
        hardware: HardwareSpec,
        *,
        recomputes: tuple[str, ...] = ("none", "selective", "full"),
        zeros: tuple[int, ...] = (0, 1, 2, 3),
        losses: tuple[str, ...] = ("naive", "chunked", "vocab_parallel"),
    ) -> None:
        self.model, self.train, self.hardware = model, train, hardware
        self.recomputes, self.zeros, self.losses = recomputes, zeros, losses
        s = train.seq_len
        self.pb = precision_bytes(train)
        self.peak = hardware.flops_for(train.precision)
        self.modelled = time_model_applies(hardware, train)
        self.gemm_f = F.layer_matmul_flops_per_token(model)
        self.attn_f = F.attention_flops_per_token(model, s)
        self.layer_f = self.gemm_f + self.attn_f
        self.head_f = F.head_flops_per_token(model)
        self.rec_layer_f = {rc: F.recompute_flops_per_token(model, s, rc, layers=1) for rc in recomputes}
        self.model_f = F.model_flops_per_token(model, s)
        self.eager = train.attention == "eager"
        self.elem_b = E.elementwise_bytes_per_token(model, s, eager_attention=False)
        self.score_b = E.elementwise_bytes_per_token(model, s, eager_attention=True) - self.elem_b
        self.e_attn = E.gemm_efficiency(hardware, s, model.dim_head) if self.eager else E.attention_efficiency(hardware, s)
        self.attn_share = 1.0 if self.eager else CAUSAL_KERNEL_SHARE
        scale = F.param_scale(model)
        self.layer_p = terms.blocks_param_count(model) / model.n_layers * scale  # mean block (MoE stacks differ)
        self.emb_p = terms.embedding_param_count(model) * scale
        self.head_p = terms.head_param_count(model) * scale
        self.tied_extra = model.vocab_size * model.hidden * scale if model.tied_embeddings else 0.0
        self.total_p = terms.param_count(model) * scale
        state_b = optimizer_bytes(train).per_param
        # read + write of params, states and master, read of grads
        self.traffic = 2 * (self.pb.param + state_b + self.pb.master) + self.pb.grad
        self.mem_bw = hardware.resolved("memory_bw") * E.MEMORY_BW_EFFICIENCY
        # FSDP2 with a MixedPrecisionPolicy gathers the 16-bit compute copy (param_dtype=bf16) and
        # reduce-scatters in the gradient dtype (torchtitan: reduce_dtype=float32) [TT-FSDP]; the
        # memory model assumes the same gathered dtype.
        self.gather_b = self.pb.compute if self.pb.autocast_copy else self.pb.param
        # FSDP inside pipeline stages reduce-scatters per micro-batch (Llama 3) or once per step (torch)
        self.grads_per_mb = frameworks.framework_facts(train.framework).grads_per_microbatch
        self.cp_exposed = frameworks.framework_facts(train.framework).cp_all_gather
        self._links: dict[tuple[int, int], Any] = {}
        self._block: dict[tuple[float, int, int], tuple[float, dict[str, float], float]] = {}
        self._ranks: dict[tuple[int, int], tuple[int, int, int]] = {}

    def block_seconds(self, tokens: float, t: int, c: int = 1) -> tuple[float, dict[str, float], float]:
        """(one block's forward + backward seconds on a rank for ``tokens`` tokens, ``{recompute: extra
        seconds}``, the lm_head's seconds), tensor-parallel size ``t``, context-parallel size ``c`` (the
        ring's attention kernels see key blocks of ``s / c``; each of its ``c - 1`` extra steps per pass
        costs :data:`CP_RING_STEP_OVERHEAD_S`)."""
        key = (tokens, t, c)
        hit = self._block.get(key)
        if hit is not None:
            return hit
        model, hw, peak = self.model, self.hardware, self.peak
        width = min(model.hidden, model.ffn / t, model.n_heads * model.dim_head / t)
        e = E.gemm_efficiency(hw, tokens, width)
        gemm = tokens * self.gemm_f / t / (peak * e)
        # load-balanced causal CP: each rank holds 2 chunks of s / (2c), each ring kernel runs on one
        # chunk pair [L3 section 3.3.2]
        e_attn = self.e_attn if (self.eager or c == 1) else E.attention_efficiency(hw, self.train.seq_len / (2 * c))
        attn = tokens * self.attn_f * self.attn_share / t / (peak * e_attn)
        # ring steps: forward, backward and (recomputed) forward each run c - 1 extra kernel + send/recv pairs
        ring = (c - 1) * CP_RING_STEP_OVERHEAD_S
        elem = tokens * self.elem_b / t / self.mem_bw
        score = tokens * self.score_b / t / self.mem_bw if self.eager else 0.0
        fwd = 1.0 / (1 + F.BACKWARD_TO_FORWARD)
        extra = {}
        for rc in self.recomputes:
            if rc == "none":
                extra[rc] = 0.0
            elif rc == "selective":  # the attention core's forward again [K22]
                extra[rc] = fwd * (attn + score) + ring
            elif rc == "selective_op":  # every second matmul and the element-wise ops again [TT-AC]
                extra[rc] = tokens * self.rec_layer_f[rc] / t / (peak * e) + fwd * elem
            else:  # the whole block's forward again
                extra[rc] = fwd * (gemm + attn + elem + score) + ring
        head = tokens * self.head_f / t / (peak * E.gemm_efficiency(hw, tokens, model.vocab_size / t))
        out = self._block[key] = (gemm + attn + elem + score + 2 * ring, extra, head)
        return out

    def rank_layers(self, p: int, v: int) -> tuple[int, int, int]:
        """(blocks on the first pipeline rank, on the last, on the busiest) when L blocks are split into
        ``p * v`` stages as ``train.framework`` splits them
        (:func:`lightning_memplan.model.frameworks.rank_block_counts`, the memory model's split): the
        first ``L mod (p v)`` take one more (torch.distributed.pipelining's and
        :mod:`lightning_memplan.parallel.pipeline`'s split), rank r holding stages r, r + p, ...; Llama
        3's stack counts the embedding and the output layer as one block each, so its first and last
        rank hold one block fewer [L3 section 3.3.2]."""
        key = (p, v)
        hit = self._ranks.get(key)
        if hit is None:
            counts = frameworks.rank_block_counts(self.model.n_layers, p, v, self.train.framework)
            hit = self._ranks[key] = (counts[0], counts[-1], max(counts))
        return hit

    def stage_compute(self, lay: Layout, rc: str) -> float:
        """Seconds of one micro-batch's forward + backward (+ recompute) on the bottleneck pipeline rank."""
        _, last, most = self.rank_layers(lay.pp, lay.v if lay.pp > 1 else 1)
        block, extra, head = self.block_seconds(lay.b * self.train.seq_len / lay.cp, lay.tp, lay.cp)
        per = block + extra[rc]
        return max(most * per, last * per + head)

    def compute_lower_bound(self, lay: Layout) -> float:
        """A cheap lower bound of every option's step time for ``lay``: the bottleneck stage's compute
        with the least recompute allowed, over ``m + (p-1)/v`` slots, no communication."""
        if not self.modelled:
            return lay.m * lay.dp * lay.b * self.train.seq_len * UNMODELLED_S_PER_TOKEN
        _, last, most = self.rank_layers(lay.pp, lay.v if lay.pp > 1 else 1)
        slots = lay.m + (lay.pp - 1) / lay.v if lay.pp > 1 else float(lay.m)
        block, extra, head = self.block_seconds(lay.b * self.train.seq_len / lay.cp, lay.tp, lay.cp)
        per = block + min(extra.values())
        compute = max(most * per, last * per + head)
        tp = 0.0
        if lay.tp > 1:  # the 4 TP all-reduces per layer are never hidden
            msg = lay.b * (self.train.seq_len // lay.cp) * self.model.hidden * self.pb.compute
            tp = most * 4 * all_reduce_time(msg, lay.tp, self._link(1, lay.tp))
        return slots * (compute + tp)

    def _link(self, stride: int, size: int):
        key = (stride, size)
        link = self._links.get(key)
        if link is None:
            link = self._links[key] = group_link(self.hardware, stride, size)
        return link

    def layout(self, lay: Layout) -> LayoutTimes:
        """Every time term of ``lay`` (see :class:`LayoutTimes`): compute on the bottleneck stage, tensor-,
        context- and pipeline-parallel communication per micro-batch, the loss's, data parallelism's per
        ZeRO stage and recompute mode, and the optimizer step."""
        d, t, p, c, b, m, v = lay.dp, lay.tp, lay.pp, lay.cp, lay.b, lay.m, lay.v
        s = self.train.seq_len
        tokens_mb = b * s  # tokens of one micro-batch of one replica (before the cp split)
        # compute on the bottleneck stage, per micro-batch (the last stage also runs the lm_head)
        first_layers, last_layers, most_layers = self.rank_layers(p, v if p > 1 else 1)
        block_s, extra_s, head_s = self.block_seconds(b * s / c, t, c)
        compute_mb = {rc: max(most_layers * (block_s + extra_s[rc]), last_layers * (block_s + extra_s[rc]) + head_s)
                      for rc in self.recomputes}
        tp_link = self._link(1, t)
        out = LayoutTimes()
        out.layout = lay
        out.world = d * t * p * c
        out.slots = m + (p - 1) / v if p > 1 else float(m)
        out.compute_mb = compute_mb
        out.tp_mb = self._tp_times(lay, most_layers, tp_link)
        out.cp_mb, out.cp_hidden_mb = self._cp_times(lay, most_layers)
        out.pp_mb = self._pp_time(lay)
        out.loss_mb = self._loss_times(lay, tp_link)
        out.dp_exposed, out.dp_overlapped, out.opt_s = self._dp_times(lay, (first_layers, last_layers, most_layers),
                                                                      compute_mb)
        tokens_step = d * m * tokens_mb
        out.tokens = tokens_step
        out.model_flops = self.model_f * tokens_step
        out.recompute_flops = {rc: self.rec_layer_f[rc] * self.model.n_layers * tokens_step for rc in self.recomputes}
        out.peak = self.peak
        out.notes = tuple(topology_notes(self.hardware, d, t, p, c))
        out.modelled = self.modelled
        if not self.modelled:  # every term flat: the score is the change cost alone (TIME_MODEL_OFF)
            _flatten(out, d * tokens_mb * UNMODELLED_S_PER_TOKEN, m)
        return out

    def _tp_times(self, lay: Layout, layers: int, tp_link: Any) -> dict[str, float]:
        """Tensor parallel: 4 all-reduces of b (s/c) h per layer per micro-batch, 6 with full recompute (the
        recomputed forward repeats its 2); sequence parallelism moves the same volume [N21, K22]."""
        s, t = self.train.seq_len, lay.tp
        per_ar = all_reduce_time(lay.b * (s // lay.cp) * self.model.hidden * self.pb.compute, t, tp_link)
        return {rc: layers * (6 if rc == "full" else 4) * per_ar for rc in self.recomputes}

    def _cp_times(self, lay: Layout, layers: int) -> tuple[float, float]:
        """Context parallel ``(exposed, hidden)`` per micro-batch: the ring's K/V exchange hidden under the
        attention compute [L23]."""
        model, b, s, t, c = self.model, lay.b, self.train.seq_len, lay.tp, lay.cp
        if c == 1:
            return 0.0, 0.0
        cp_link = self._link(t, c)
        kv_block = 2 * b * (s // c) * max(1, model.kv_heads // t) * model.dim_head * self.pb.compute
        cp_total = layers * 3 * (c - 1) * p2p_time(kv_block, cp_link)  # fwd K,V; bwd K,V,dK,dV
        # hidden under each block's attention kernel only (the ring steps interleave with it) [L23]
        attn = layers * b * (s / c) * self.attn_f * self.attn_share / t / (self.peak * E.attention_efficiency(self.hardware, s / (2 * c)))
        cp_mb = max(0.0, cp_total - OVERLAP_EFFICIENCY * attn)
        if self.cp_exposed:  # Llama 3's all-gather CP: "the all-gather communication latency is exposed
            cp_mb = cp_total  # in the critical path" [L3 section 3.3.2]: the same K/V volume, not hidden
        return cp_mb, cp_total - cp_mb

    def _pp_time(self, lay: Layout) -> float:
        """Pipeline: activation forward + gradient backward per micro-batch per virtual stage [N21 4.1]."""
        if lay.pp == 1:
            return 0.0
        pp_link = self._link(lay.dp * lay.cp * lay.tp, lay.pp)
        s = self.train.seq_len
        return 2 * lay.v * p2p_time(lay.b * (s // lay.cp) * self.model.hidden * self.pb.residual / lay.tp, pp_link)

    def _loss_times(self, lay: Layout, tp_link: Any) -> dict[str, float]:
        """Loss: logits all-gather (+ reduce-scatter of their gradient) when tp > 1 without vocab
        parallelism; three b*s all-reduces with it; a fixed cost per chunk when chunked."""
        train, t = self.train, lay.tp
        tok_rank = lay.b * train.seq_len // lay.cp
        loss_mb = {}
        for lm in self.losses:
            cost = 0.0
            if lm in terms.VOCAB_SHARDED_LOSSES:  # all-reduces of per-token statistics, no logits gather
                cost += 3 * all_reduce_time(tok_rank * terms.FP32_BYTES, t, tp_link)
            elif t > 1:
                logits = tok_rank * self.model.vocab_size * self.pb.logits
                cost += all_gather_time(logits, t, tp_link) + reduce_scatter_time(logits, t, tp_link)
            if lm == "chunked":
                chunk = train.loss_chunk_size or terms.planned_loss_chunk_tokens(self.model, kernels_of(train), tok_rank)
                cost += math.ceil(tok_rank / chunk) * CHUNK_OVERHEAD_S
            loss_mb[lm] = cost
        return loss_mb

    def _dp_times(self, lay: Layout, layers: tuple[int, int, int], compute_mb: dict[str, float]) -> tuple[
            dict[tuple[int, str], float], dict[tuple[int, str], float], dict[int, float]]:
        """Data parallelism over the d*c replicas of each parameter: ``(exposed, overlapped)`` seconds per
        (ZeRO stage, recompute mode) and the optimizer step per ZeRO stage."""
        first_layers, last_layers, most_layers = layers
        d, t, p, c = lay.dp, lay.tp, lay.pp, lay.cp
        n_rep = d * c
        if p > 1:
            stage0 = first_layers * self.layer_p + self.emb_p
            stage_last = last_layers * self.layer_p + self.head_p + self.tied_extra
            local = max(stage0, stage_last, most_layers * self.layer_p) / t
        else:
            local = self.total_p / t
        pb = self.pb
        grad_bytes, param_bytes, gather_bytes = local * pb.grad, local * pb.param, local * self.gather_b
        dp_exposed: dict[tuple[int, str], float] = {}
        dp_overlapped: dict[tuple[int, str], float] = {}
        opt_s: dict[int, float] = {}
        colls = None
        if n_rep > 1:
            dp_link = self._link(t, n_rep)
            colls = _Collectives(
                ar=all_reduce_time(grad_bytes, n_rep, dp_link),
                rs=reduce_scatter_time(grad_bytes, n_rep, dp_link),
                ag=all_gather_time(param_bytes, n_rep, dp_link),  # ZeRO-1: the updated parameters
                fsdp_ag=all_gather_time(gather_bytes, n_rep, dp_link),  # FSDP: the 16-bit compute copy
            )
        for z in self.zeros:
            shard = n_rep if z >= 1 else 1
            opt_s[z] = local / shard * self.traffic / self.mem_bw
            for rc in self.recomputes:
                if colls is None:
                    comm = hidden = 0.0
                else:
                    comm, hidden = self._dp_comm(z, p, lay.m, most_layers, compute_mb[rc], colls)
                dp_exposed[(z, rc)] = comm
                dp_overlapped[(z, rc)] = hidden
        return dp_exposed, dp_overlapped, opt_s

    def _dp_comm(self, z: int, p: int, m: int, layers_b: int, compute: float, colls: _Collectives) -> tuple[float, float]:
        """``(exposed, hidden)`` data-parallel seconds per step at ZeRO stage ``z`` for one micro-batch's
        compute of ``compute`` seconds."""
        ar, rs, ag, fsdp_ag = colls.ar, colls.rs, colls.ag, colls.fsdp_ag
        bwd_window = OVERLAP_EFFICIENCY * compute * 2 / 3  # backward = 2/3 of fwd+bwd
        if z == 0:  # DDP: all-reduce under the last micro-batch's backward [L20]
            comm = max(0.0, ar - bwd_window)
            return comm, ar - comm
        if z == 1:  # reduce-scatter under backward; the updated-parameter all-gather runs
            # after the optimizer step, on the critical path [R20 section 5.1; DeepSpeed stage 1]
            return max(0.0, rs - bwd_window) + ag, rs - max(0.0, rs - bwd_window)
        if p > 1:
            return self._pipelined_fsdp_comm(z, m, layers_b, compute, colls)
        # FSDP: per micro-batch gathers (x2 when fully sharded) + reduce-scatter [R20, Z23]
        collectives = (2 if z == 3 else 1) + 1
        per_mb = (collectives - 1) * fsdp_ag + rs
        # the first unit's gather and the last unit's reduce-scatter have no compute to hide under
        exposed_mb = max(0.0, per_mb - OVERLAP_EFFICIENCY * compute) + (fsdp_ag + rs) / max(1, layers_b + 1)
        exposed_mb += collectives * (layers_b + 1) * FSDP_UNIT_OVERHEAD_S
        comm = m * exposed_mb
        return comm, max(0.0, m * per_mb - comm)

    def _pipelined_fsdp_comm(self, z: int, m: int, layers_b: int, compute: float,
                             colls: _Collectives) -> tuple[float, float]:
        """FSDP inside pipeline stages: one reduce-scatter per step, not per micro-batch.

        torch.distributed.pipelining runs every micro-batch's backward with set_requires_gradient_sync(False)
        and set_reshard_after_backward(False), then one reduce-scatter per unit after the last backward
        (torch 2.13 pipelining/stage.py, backward_maybe_with_nosync / perform_reduce_grad): exposed, nothing
        left to hide it. ZeRO-2 gathers once per step (never resharded before that reduce); ZeRO-3 still
        reshards after each forward, so each micro-batch's forward and backward gather."""
        rs, fsdp_ag = colls.rs, colls.fsdp_ag
        gathers_mb = 2 if z == 3 else 0
        per_mb = gathers_mb * fsdp_ag
        once = rs + (fsdp_ag if z == 2 else 0.0)
        if self.grads_per_mb:
            # Llama 3's FSDP reduce-scatters every micro-batch's gradients asynchronously [L3 section 3.3.2:
            # DP "can tolerate longer network latency by asynchronously prefetching sharded model weights and
            # reducing gradients"]: a reduce-scatter issued after a chunk's backward runs on while the
            # schedule's next slot (one forward and one backward in the steady state) computes, on the same
            # link as the gathers; only the last unit's is left at the end of the step
            per_mb += rs
            once = rs / max(1, layers_b + 1) + (fsdp_ag if z == 2 else 0.0)
        exposed_mb = max(0.0, per_mb - OVERLAP_EFFICIENCY * compute)
        exposed_mb += gathers_mb * (fsdp_ag / max(1, layers_b + 1) + (layers_b + 1) * FSDP_UNIT_OVERHEAD_S)
        comm = m * exposed_mb + once + (2 if z == 2 else 1) * (layers_b + 1) * FSDP_UNIT_OVERHEAD_S
        return comm, max(0.0, m * per_mb - m * exposed_mb)


@dataclass(frozen=True)
class _Collectives:
    """Seconds of one data-parallel all-reduce, reduce-scatter and all-gathers of a rank's parameters."""

    ar: float
    rs: float
    ag: float
    fsdp_ag: float


def _flatten(out: LayoutTimes, flat: float, m: int) -> None:
    """Every time term of ``out`` flat (a host the time model does not apply to: ``TIME_MODEL_OFF``)."""
    out.slots = float(m)
    out.compute_mb = {rc: flat for rc in out.compute_mb}
    out.tp_mb = {rc: 0.0 for rc in out.tp_mb}
    out.cp_mb = out.cp_hidden_mb = out.pp_mb = 0.0
    out.loss_mb = {lm: 0.0 for lm in out.loss_mb}
    out.dp_exposed = {k: 0.0 for k in out.dp_exposed}
    out.dp_overlapped = {k: 0.0 for k in out.dp_overlapped}
    out.opt_s = {z: 0.0 for z in out.opt_s}


def predict_step_time(
    model: ModelSpec, train: TrainSpec, hardware: HardwareSpec, plan: ParallelPlan
) -> StepTime:
    """Predicted :class:`StepTime` of one plan with ``train``'s recompute, loss and micro-batch.

    Micro-batches per step: ``plan.microbatches`` under pipeline parallelism, else
    ``train.grad_accumulation``."""
    m = plan.microbatches if plan.pp > 1 else train.grad_accumulation
    lay = Layout(plan.dp, plan.tp, plan.pp, plan.cp, train.micro_batch, m, plan.schedule, plan.virtual_stages)
    tm = StepTimeModel(model, train, hardware, recomputes=(train.recompute,), zeros=(plan.zero,), losses=(train.loss,))
    return tm.layout(lay).step_time(train.recompute, plan.zero, train.loss)
