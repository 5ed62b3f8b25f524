"""Warnings with remedies: which component explains a measurement above the estimate, and the cheapest
change that cuts the component that dominates the peak.

The remedy table follows which parallelism cuts which tensor: ZeRO/FSDP cut model states only
(Rajbhandari et al. 2020, arXiv 1910.02054, section 5); TP cuts hidden/heads and, with a vocab-parallel
loss, the logits (Shoeybi et al. 2019, arXiv 1909.08053, section 3); SP/CP cut the sequence dimension of
activations (Korthikanti et al. 2022, arXiv 2205.05198, section 4.2.2; Liu et al. 2023, Ring Attention,
arXiv 2310.01889); chunked cross-entropy removes the [b, s, V] logits (Wijmans et al. 2024, "Cut Your
Losses in Large-Vocabulary Language Models", arXiv 2411.09009); recompute trades step time for
activations (Chen et al. 2016, arXiv 1604.06174; Korthikanti et al. 2022, section 5).
Options are listed cheapest first (no extra GPUs, no extra compute before more of either); the first one
the current plan does not already use is the advice.
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning_memplan.model.specs import ParallelPlan, TrainSpec
from lightning_memplan.report.records import RankSummary, StepRecord
from lightning_memplan.report.render import format_bytes

__all__ = [
    "REMEDIES",
    "culprit",
    "eval_phase_message",
    "eval_remedy",
    "forecast_message",
    "headroom_message",
    "mismatch_message",
    "remedy",
]

_MODEL_STATES = ("params", "grads", "optimizer", "master")


def _remedies_for(component: str, plan: ParallelPlan, train: TrainSpec | None) -> list[tuple[bool, str]]:
    """``(already_applied, advice)`` options for ``component``, cheapest first."""
    t = train
    if component == "logits":
        return [
            (
                t is not None and t.loss in ("chunked", "vocab_parallel"),
                "compute the loss in chunks "
                "(lightning_memplan.LinearCrossEntropy / linear_cross_entropy: the [b, s, V] logits are never "
                "materialised)",
            ),
            (
                t is not None and t.loss == "vocab_parallel",
                "use a vocab-parallel loss over tensor-parallel ranks (each rank holds V/t logit columns)",
            ),
            (False, "reduce the micro-batch (logits scale with b*s) and raise accumulate_grad_batches"),
        ]
    if component == "attention":
        return [
            (
                t is not None and t.attention == "sdpa",
                "use fused attention (F.scaled_dot_product_attention / "
                "FlashAttention) so the [b, a, s, s] scores are not stored",
            ),
            (
                t is not None and t.recompute != "none",
                "recompute the attention core in backward (selective activation checkpointing)",
            ),
            (plan.cp > 1, "split the sequence with context parallelism"),
        ]
    if component in ("activations", "workspace"):
        return [
            (
                t is not None and t.recompute != "none",
                "enable activation checkpointing (selective first, full if needed; costs ~20-40% step time)",
            ),
            (
                t is not None and t.micro_batch == 1,
                "reduce the micro-batch and raise accumulate_grad_batches to keep the global batch",
            ),
            (
                plan.sp,
                "use sequence parallelism with tensor parallelism (norm/dropout activations split over t)",
            ),
            (plan.cp > 1, "split the sequence with context parallelism"),
        ]
    if component in _MODEL_STATES or component == "other":
        if plan.dp == 1:
            # Sharding needs data-parallel peers; on one device the cheapest cut is the state format.
            return [
                (
                    t is not None and t.optimizer in ("adamw8bit", "sgd", "adafactor"),
                    "use an 8-bit optimizer (adamw8bit: 2 bytes of state per parameter instead of 8)",
                ),
                (
                    False,
                    "shard the model states over more GPUs with FSDP / ZeRO-3 (strategy='fsdp' or "
                    "strategy='memplan_auto')",
                ),
                (plan.tp > 1, "add tensor parallelism (splits every layer's matrices over t ranks)"),
            ]
        return [
            (plan.zero >= 1, "shard optimizer states over data-parallel ranks (ZeRO-1)"),
            (plan.zero >= 2, "shard gradients too (ZeRO-2 / FSDP SHARD_GRAD_OP)"),
            (plan.zero >= 3, "shard parameters too (ZeRO-3 / FSDP FULL_SHARD, or strategy='memplan_auto')"),
            (plan.tp > 1, "add tensor parallelism (splits every layer's matrices over t ranks)"),
        ]
    if component == "comm":
        return [
            (
                plan.tp > 1,
                "a single layer's all-gathered weights dominate: split layers with tensor "
                "parallelism, or wrap smaller FSDP units",
            ),
        ]
    return []


#: Component -> the options considered for it (for documentation and tests).
REMEDIES: Mapping[str, tuple[str, ...]] = {
    c: tuple(text for _, text in _remedies_for(c, ParallelPlan(dp=2), None))
    for c in (
        "params",
        "grads",
        "optimizer",
        "master",
        "activations",
        "attention",
        "logits",
        "comm",
        "workspace",
        "other",
    )
}


def remedy(component: str, plan: ParallelPlan, train: TrainSpec | None) -> str:
    """The cheapest option for ``component`` the current ``plan``/``train`` does not already use."""
    options = _remedies_for(component, plan, train)
    for applied, text in options:
        if not applied:
            return text
    return "every cheap option is already in use; add devices (data or tensor parallel) or a larger GPU"


def _largest(components: Mapping[str, int] | None) -> str | None:
    if not components:
        return None
    return max(components, key=lambda k: components[k])


def culprit(record: StepRecord, units: str = "MiB") -> tuple[str, str]:
    """``(component, reason)`` most likely responsible for a measurement above the estimate.

    With a tensor-tracker breakdown, the component whose measured bytes exceed its estimate the most.
    Without one (CUDA allocator peak only), the phase whose measured peak exceeds its estimated peak the
    most, blaming the component the estimate says dominates the peak.
    """
    est = record.estimated_components or {}
    meas = record.measured_components
    if meas:
        excess = {c: meas.get(c, 0) - est.get(c, 0) for c in set(meas) | set(est)}
        comp = max(excess, key=lambda c: excess[c])
        return comp, f"measured {comp} exceeds its estimate by {format_bytes(excess[comp], units)}"
    est_ph = record.estimated_phase_peaks or {}
    meas_ph = record.measured_phase_peaks or {}
    if meas_ph and est_ph:
        phase = max(meas_ph, key=lambda p: meas_ph[p] - est_ph.get(p, 0))
        return (
            _largest(est) or "other",
            f"the {phase} phase exceeds its estimate the most; this is the largest estimated component",
        )
    return _largest(est) or "other", "no per-component measurement on this backend"


#: What to check after a mismatch, by how the estimate was made (``report.run["estimate_source"]`` and
#: whether calibration was asked for): never "keep calibrate=True" when no calibration ran.
_MISMATCH_ADVICE = {
    "calibrated": "check that model_spec=, train_spec= and plan= describe the run",
    "off": "check that model_spec=, train_spec= and plan= describe the run, or pass calibrate=True to fit the "
    "estimate to the model with a traced step",
    "skipped": "calibration did not run (the report's notes say why), so the estimate is the analytic model's; "
    "check that model_spec=, train_spec= and plan= describe the run",
}


def mismatch_message(
    record: StepRecord, tolerance: float, *, units: str = "GiB", calibration: str = "calibrated"
) -> str | None:
    """Warning text when ``record.measured_peak`` exceeds the estimate by more than ``tolerance``, with
    byte figures in ``units``; ``calibration`` is ``"calibrated"``, ``"off"`` (``calibrate=False``) or
    ``"skipped"`` (asked for, but it did not run), and picks the advice."""
    ratio = record.ratio
    if ratio is None or record.warmup or ratio <= 1.0 + tolerance:
        return None
    comp, why = culprit(record, units)
    advice = _MISMATCH_ADVICE.get(calibration, _MISMATCH_ADVICE["calibrated"])
    return (
        f"measured peak {format_bytes(record.measured_peak, units)} is {ratio - 1.0:.1%} above the estimate "
        f"{format_bytes(record.estimated_peak, units)} (tolerance {tolerance:.0%}) at step {record.step}, batch "
        f"{record.micro_batch} x {record.seq_len} on rank {record.rank}; most likely component: {comp} ({why}); "
        f"{advice}"
    )


def headroom_message(
    record: StepRecord, min_headroom: float, plan: ParallelPlan, train: TrainSpec | None, *, units: str = "GiB"
) -> str | None:
    """Warning text when the step left less than ``min_headroom`` (a fraction of device memory) free,
    with byte figures in ``units``."""
    if record.headroom is None or not record.device_memory:
        return None
    if record.headroom >= min_headroom * record.device_memory:
        return None
    comp = _largest(record.measured_components or record.estimated_components) or "activations"
    return (
        f"headroom {format_bytes(record.headroom, units)} on rank {record.rank} is below min_headroom="
        f"{min_headroom:.0%} of {format_bytes(record.device_memory, units)}; the largest component at the peak is "
        f"{comp}: {remedy(comp, plan, train)}"
    )


def forecast_message(
    seq_len: int,
    estimated_peak: int,
    capacity: int,
    components: Mapping[str, int],
    plan: ParallelPlan,
    train: TrainSpec | None,
    *,
    rank: int,
    units: str = "GiB",
) -> str | None:
    """Warning text when the estimate at ``seq_len`` would not fit in ``capacity`` bytes (figures in ``units``)."""
    if estimated_peak <= capacity:
        return None
    comp = _largest(components) or "activations"
    return (
        f"forecast: at seq_len={seq_len} rank {rank} would need {format_bytes(estimated_peak, units)} but only "
        f"{format_bytes(capacity, units)} is usable, so it would run out of memory; the largest component would "
        f"be {comp}: {remedy(comp, plan, train)}"
    )


#: How the report names the evaluation phases in prose.
_PHASE_NAMES = {"val": "validation", "test": "test", "predict": "predict"}
#: Hooks where the user frees what the training step left before the evaluation phase runs.
_PHASE_HOOKS = {"val": "on_validation_start", "test": "on_test_start", "predict": "on_predict_start"}


def eval_remedy(record: StepRecord, loss: str | None) -> str:
    """The cheapest change that lowers an evaluation step's peak, by the component that dominates it
    (no-grad steps save nothing, so the batch-dependent part is one block's working set or the logits)."""
    comps = record.measured_components or record.estimated_components or {}
    comp = _largest({c: v for c, v in comps.items() if c != "params"}) or "activations"
    b, name = record.micro_batch, _PHASE_NAMES.get(record.phase, record.phase)
    smaller = f"lower the {name} batch size (the {name} dataloader's batch_size, now {b}): the step's transient bytes scale with b x s"
    if comp == "logits":
        chunked = loss in ("chunked", "vocab_parallel")
        return (smaller if chunked else
                "compute the evaluation loss in chunks (lightning_memplan.LinearCrossEntropy / linear_cross_entropy: "
                f"the [b, s, V] logits are never materialised), or {smaller}")
    if comp in ("grads", "optimizer"):
        hook = _PHASE_HOOKS.get(record.phase, "on_validation_start")
        return (
            f"the training run's {comp} are alive during the {name} steps; free the gradients before them "
            f"(optimizer.zero_grad(set_to_none=True) in {hook}, as Lightning's on_validation_model_zero_grad does unless "
            f"validation interrupts gradient accumulation), or {smaller}"
        )
    return f"{smaller}; run the step under torch.inference_mode() / torch.no_grad() if it builds a graph"


def eval_phase_message(
    record: StepRecord, train: RankSummary | None, *, min_headroom: float, units: str = "GiB", loss: str | None = None
) -> str | None:
    """Warning text when an evaluation step (``record.phase`` != ``"train"``) would not fit the capacity
    (its estimate or measurement above it, or headroom under ``min_headroom``) or peaks above the training
    steps of the epoch so far (``train``: measured against measured, else estimated against estimated)."""
    name = _PHASE_NAMES.get(record.phase, record.phase)
    shape = f"batch {record.micro_batch} x {record.seq_len}"
    peak = record.measured_peak if record.measured_peak is not None else record.estimated_peak
    capacity = record.device_memory
    if peak is not None and capacity:
        short = record.headroom is not None and record.headroom < min_headroom * capacity
        if peak > capacity or (record.estimated_peak or 0) > capacity or short:
            return (
                f"the {name} step ({shape}) peaks at {format_bytes(peak, units)} (estimated "
                f"{format_bytes(record.estimated_peak, units)}) on rank {record.rank}, which does not fit "
                f"{format_bytes(capacity, units)} with min_headroom={min_headroom:.0%}: {eval_remedy(record, loss)}"
            )
    if train is None:
        return None
    pairs = ((record.measured_peak, train.measured_peak, "measured"), (record.estimated_peak, train.estimated_peak, "estimated"))
    for mine, theirs, kind in pairs:
        if mine is not None and theirs is not None:
            if mine <= theirs:
                return None
            return (
                f"the {name} step is the run's memory peak: {kind} {format_bytes(mine, units)} ({shape}) on rank "
                f"{record.rank}, above the training step's {format_bytes(theirs, units)}; plan the device for it: "
                f"{eval_remedy(record, loss)}"
            )
    return None
