"""``TrainSpec(framework="deepspeed")`` against DeepSpeed's published figures (issue 27).

1. The ZeRO paper's Fig. 1 (Rajbhandari et al. 2019, arXiv 1910.02054): 7.5B parameters, 64 GPUs,
   mixed-precision Adam (K = 12): model states per device 120 / 31.4 / 16.6 / 1.9 GB for the baseline
   (stage 0) and stages 1 / 2 / 3 (GB = 1e9 bytes). Ours: ``details["zero_model_states_peak"]``, the
   largest params + grads + optimizer + master on the device over the step.
2. DeepSpeed's own estimators ``estimate_zero2_model_states_mem_needs`` (``deepspeed/runtime/zero/
   stage_1_and_2.py``) and ``estimate_zero3_model_states_mem_needs`` (``deepspeed/runtime/zero/stage3.py``),
   which ``estimate_zero2/3_model_states_mem_needs_all_cold`` print, at DeepSpeed commit
   ``edaa7221267243c7be7fb49c5d5f5c4fb97b4641`` (Apache-2.0): their published formulas are re-implemented
   below (only here, to make the comparison columns), for two model sizes x {no offload, offload
   optimizer, offload params} on one node of 4 GPUs, GPU and CPU columns, with where and why the project
   differs.

Run: ``python benchmarks/deepspeed_published.py`` (CPU, a second); writes
``benchmarks/results/deepspeed_published.md``. ``tests/unit/test_deepspeed.py`` asserts the same rows.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from lightning_memplan.model.estimate import estimate_memory
from lightning_memplan.model.frameworks import ZeroConfig
from lightning_memplan.model.result import MemoryEstimate
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec

RESULTS = Path(__file__).resolve().parent / "results" / "deepspeed_published.md"
#: The estimators' ``additional_buffer_factor`` default: their CPU column is multiplied by it.
BUFFER_FACTOR = 1.5
#: One node of this many GPUs for the helper table: the ZeRO-2 helper's offload CPU figure is
#: ``max(4 * gpus, 16) N``, the fp32 model every process loads at start-up when 4 x gpus > 16; at <= 4 GPUs
#: it is the steady-state 16 N, the quantity the project models.
GPUS_PER_NODE = 4

# ---------------------------------------------------------------------------------------------------
# 1. ZeRO paper Fig. 1
# ---------------------------------------------------------------------------------------------------

#: (stage, GB per device) of Fig. 1: Psi = 7.5B, N_d = 64, K = 12.
FIG1 = ((0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9))
FIG1_PARAMS = 7_500_000_000
FIG1_GPUS = 64


def fig1_model() -> ModelSpec:
    """A 7.5B-parameter transformer (``n_params`` exactly 7.5e9; the shape only places the tensors)."""
    return ModelSpec(n_layers=36, hidden=4096, n_heads=32, vocab_size=50_304, n_params=FIG1_PARAMS, name="zero-fig1-7.5b")


def fig1_rows() -> list[tuple[int, float, float]]:
    """``[(stage, ours GB, paper GB)]``: model states per device with fp16 mixed precision and Adam."""
    train = TrainSpec(micro_batch=1, seq_len=1024, precision="16-mixed", optimizer="adam", framework="deepspeed")
    rows = []
    for stage, paper in FIG1:
        est = estimate_memory(fig1_model(), train, ParallelPlan(dp=FIG1_GPUS, zero=stage))
        rows.append((stage, est.details["zero_model_states_peak"] / 1e9, paper))
    return rows


# ---------------------------------------------------------------------------------------------------
# 2. DeepSpeed's estimator formulas (re-implemented from their source, cited above; comparison only)
# ---------------------------------------------------------------------------------------------------


def ds_zero2_model_states(total_params: int, gpus_per_node: int, num_nodes: int, cpu_offload: bool,
                          buffer_factor: float = BUFFER_FACTOR) -> tuple[int, int]:
    """``(cpu, gpu)`` bytes: ``estimate_zero2_model_states_mem_needs``, stage_1_and_2.py at edaa722.
    GPU: ``2N`` with offload, else ``2N + 18N/gpus`` (2 grads16 + 4 grads32 + 4 params32 + 8 Adam); CPU per
    node: ``N max(4 gpus, 16) x factor`` with offload, else ``4N gpus_per_node x factor``."""
    gpus = gpus_per_node * num_nodes
    if cpu_offload:
        return int(total_params * max(4 * gpus, 16) * buffer_factor), 2 * total_params
    return int(total_params * 4 * gpus_per_node * buffer_factor), 2 * total_params + int(18 * total_params / gpus)


def ds_zero3_model_states(total_params: int, largest_layer_params: int, gpus_per_node: int, num_nodes: int,
                          cpu_offload: bool, cpu_offload_params: bool, zero_init: bool = True,
                          buffer_factor: float = BUFFER_FACTOR) -> tuple[int, int]:
    """``(cpu, gpu)`` bytes: ``estimate_zero3_model_states_mem_needs``, stage3.py at edaa722 (``zero_init``
    True, the helpers' first row). GPU: ``4 LL`` (+ ``2N/gpus`` offloading only the optimizer, + ``18N/gpus``
    without offload); CPU per node: ``18 N / nodes``, ``16 N / nodes``, or ``4 LL gpus_per_node`` without
    offload, x factor."""
    gpus = gpus_per_node * num_nodes
    per_node = 1 / num_nodes
    largest = 4 * largest_layer_params
    if cpu_offload and cpu_offload_params:
        cpu = total_params * 18 * per_node * buffer_factor if zero_init else total_params * max(4 * gpus_per_node, 18 * per_node) * buffer_factor
        return int(cpu), largest
    if cpu_offload:
        cpu = total_params * 16 * per_node * buffer_factor if zero_init else total_params * max(4 * gpus_per_node, 16 * per_node) * buffer_factor
        return int(cpu), largest + int(2 * total_params / gpus)
    cpu = largest_layer_params * 4 * gpus_per_node * buffer_factor if zero_init else total_params * 4 * gpus_per_node * buffer_factor
    return int(cpu), largest + int(18 * total_params / gpus)


# ---------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------


def table_models() -> dict[str, ModelSpec]:
    """Two sizes: GPT-3 XL's shape (1.3B; Brown et al. 2020 Table 2.1) and Llama 7B."""
    return {
        "1.3B (GPT-3 XL)": ModelSpec(n_layers=24, hidden=2048, n_heads=16, vocab_size=50_257, name="gpt3-xl"),
        "7B (Llama)": ModelSpec.preset("llama-7b"),
    }


#: (ZeRO stage, offload) rows per model: ZeRO-2 cannot offload parameters (offload_param is stage 3 only).
CASES = ((2, "none"), (2, "optimizer"), (3, "none"), (3, "optimizer"), (3, "params"))


@dataclass(frozen=True)
class Row:
    model: str
    stage: int
    offload: str
    n_params: int
    largest_layer: int
    gpu_ours: int  # device params + grads + optimizer + master at the step, + its fp32 gradient copy, + (ZeRO-3) one largest module gathered with its gradient
    gpu_helper: int
    gpu_named: int  # the named terms DeepSpeed allocates and its helper leaves out
    cpu_ours: int  # host params + grads + optimizer + master per node (per rank x GPUS_PER_NODE)
    cpu_helper: int  # as printed, x BUFFER_FACTOR
    cpu_named: int
    host_buffers: int  # host staging buffers per node (not in cpu_ours)
    device_peak: int  # the whole estimate (activations, buckets, gathered parameters ...)
    why: str


def _estimate(model: ModelSpec, stage: int, offload: str) -> MemoryEstimate:
    train = TrainSpec(micro_batch=1, seq_len=2048, precision="bf16-mixed", framework="deepspeed", offload=offload)
    return estimate_memory(model, train, ParallelPlan(dp=GPUS_PER_NODE, zero=stage))


def helper_rows() -> list[Row]:
    rows = []
    d = GPUS_PER_NODE
    for label, model in table_models().items():
        n = model.num_params
        for stage, offload in CASES:
            est = _estimate(model, stage, offload)
            opt = est.by_phase["optimizer"]
            details = est.details
            largest = details["zero_gathered_largest"] // 4 if stage == 3 else 0
            gpu_ours = (opt["params"] + opt["grads"] + opt["optimizer"] + opt["master"]
                        + details["zero_fp32_grad_partition"] + details["zero_gathered_largest"])
            host = sum(details[f"host_{part}"] for part in ("params", "grads", "optimizer", "master"))
            nd = -(-n // d)
            persistent = 2 * details["zero_persistent_params"]
            if stage == 2:
                cpu_helper, gpu_helper = ds_zero2_model_states(n, d, 1, cpu_offload=offload != "none")
                gpu_named, cpu_named = 0, 0
                why = ("same terms: 2N 16-bit params + (2 grads16 + 4 grads32 + 4 master + 8 Adam) N/d"
                       if offload == "none" else
                       "same terms: 2N params on the GPU; 16N/d (4 master + 8 Adam + 4 fp32 grads) on the host")
            else:
                cpu_helper, gpu_helper = ds_zero3_model_states(
                    n, largest, d, 1, cpu_offload=offload != "none", cpu_offload_params=offload == "params")
                grad_partition = 2 * nd  # grad_partitions_flat_buffer (stage3.py), 16-bit, N/d
                # the step converts sub_group_size elements to fp32 at a time (stage3.py, sub-groups)
                sub_group = min(ZeroConfig().sub_group_size, nd)
                gpu_named = persistent + (grad_partition - 4 * (nd - sub_group) if offload == "none" else 0)
                cpu_named = 0 if offload == "none" else grad_partition * d
                why = ("+2N/d: the 16-bit gradient partition buffer ZeRO-3 allocates (grad_partitions_flat_buffer), "
                       "which the helper's 18N/d leaves out"
                       if offload == "none" else
                       "+2N/d on the host: that 16-bit gradient partition lives on the optimizer's device (CPU)")
                if offload == "none" and sub_group < nd:
                    why += (f"; -4(N/d - sub_group_size) = -{4 * (nd - sub_group) / 2**30:.2f} GiB: the step converts "
                            "sub_group_size (1e9) elements to fp32 at a time, the helper all N/d")
                why += f"; +{persistent / 2**20:.1f} MiB persistent (unpartitioned) norm weights"
            if offload == "none":
                why += "; CPU: the helper's figure is the fp32 load at start-up, the step keeps nothing on the host"
            rows.append(Row(
                model=label, stage=stage, offload=offload, n_params=n, largest_layer=largest,
                gpu_ours=gpu_ours, gpu_helper=gpu_helper, gpu_named=gpu_named,
                cpu_ours=host * d, cpu_helper=cpu_helper, cpu_named=cpu_named,
                host_buffers=details["host_buffers"] * d, device_peak=est.total, why=why,
            ))
    return rows


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def render() -> str:
    lines = [
        "# `framework=\"deepspeed\"` against DeepSpeed's published figures",
        "",
        "Written by `python benchmarks/deepspeed_published.py`; asserted by `tests/unit/test_deepspeed.py`.",
        "DeepSpeed sources at commit `edaa7221267243c7be7fb49c5d5f5c4fb97b4641`.",
        "",
        "## ZeRO paper Fig. 1 (arXiv 1910.02054): 7.5B parameters, 64 GPUs, K = 12, GB = 1e9 bytes",
        "",
        "| stage | ours (GB) | paper (GB) | ours / paper - 1 |",
        "|---|---:|---:|---:|",
    ]
    for stage, ours, paper in fig1_rows():
        name = "baseline (0)" if stage == 0 else f"ZeRO-{stage}"
        lines.append(f"| {name} | {ours:.2f} | {paper:.1f} | {ours / paper - 1:+.2%} |")
    lines += [
        "",
        "Ours is `details[\"zero_model_states_peak\"]`: the largest params + grads + optimizer + master on the",
        "device over the step (stage 1 at the backward's end, when every 16-bit gradient exists). The paper",
        "rounds; stage 3 also keeps the norm weights whole (`stage3_param_persistence_threshold`).",
        "",
        f"## Next to DeepSpeed's `estimate_zero2/3_model_states_mem_needs` (1 node x {GPUS_PER_NODE} GPUs, bf16, Adam), GiB",
        "",
        "GPU ours: device params + grads + optimizer + master at the step, its fp32 gradient copy and, for ZeRO-3,",
        "one largest module gathered with its 16-bit gradient (the helper's `4 * largest_layer_params`). CPU ours:",
        f"host params + grads + optimizer + master per node (per rank x {GPUS_PER_NODE}); the helper's CPU column",
        f"is printed x{BUFFER_FACTOR} (`additional_buffer_factor`), shown here divided by it. Named: what DeepSpeed",
        "allocates and the helper leaves out (the test asserts ours - named = helper within 0.1%).",
        "",
        "| model | ZeRO | offload | GPU ours | GPU helper | GPU named | CPU ours | CPU helper / 1.5 | CPU named | host buffers | device peak (ours, b=1 s=2048) | where and why |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in helper_rows():
        lines.append(
            f"| {r.model} | {r.stage} | {r.offload} | {_gib(r.gpu_ours)} | {_gib(r.gpu_helper)} | {_gib(r.gpu_named)} | "
            f"{_gib(r.cpu_ours)} | {_gib(r.cpu_helper / BUFFER_FACTOR)} | {_gib(r.cpu_named)} | {_gib(r.host_buffers)} | "
            f"{_gib(r.device_peak)} | {r.why} |"
        )
    lines += [
        "",
        "Where the project's whole estimate differs from the helpers (both columns above leave these out):",
        "",
        "- The helpers count model states only. The estimate adds activations, logits and attention (same terms",
        "  as every framework; DeepSpeed casts the module to 16 bit, so no autocast copies), the reduce buckets",
        "  (`reduce_bucket_size` 16-bit elements: one per backward at ZeRO-1/2, two with `overlap_comm`; one for",
        "  the whole run at ZeRO-3), the parameters ZeRO-3 keeps gathered (at the loss the last",
        "  `stage3_max_reuse_distance / 2` elements of the forward; in the backward also the prefetch, up to",
        "  `stage3_prefetch_bucket_size` and `stage3_max_live_parameters`) and the step's 16-bit flat copy of a",
        "  sub-group's gradients (ZeRO-3).",
        "- Host buffers: ZeRO-1/2 offload keeps a 16-bit staging copy of the parameter partition and a",
        "  largest-parameter buffer in host memory (`param_buffer_of_bit16_for_cpu_offload_groups`,",
        "  `temp_grad_buffer_for_cpu_offload`); `MemoryEstimate.host` includes them (column 'host buffers').",
        "- The helpers' CPU column without offload, and with ZeRO-2 offload on more than 4 GPUs per node",
        "  (`max(4 * gpus, 16)`), is the fp32 model each process loads at start-up; the estimate is the steady",
        "  step, with nothing on the host without offload.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    text = render()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text, encoding="utf-8")
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
