"""Memory reports of known shape for the report renderers' tests: any number of ranks and epochs, a
pipeline plan, a sequence-length change, warnings and an out-of-memory incident.

The per-step numbers are made up but follow a training step's shape (parameters and optimizer states
constant, activations built up in forward and released in backward, gradients appearing in backward, a
workspace spike in the optimizer step), and go through the same :class:`RankAccumulator` and
:class:`TimelineBuilder` as a real run, so the records have exactly the structure the callback writes.
"""

from __future__ import annotations

from lightning_memplan.model.result import COMPONENTS, trim_optional
from lightning_memplan.report.records import EpochReport, Incident, MemoryReport, RankAccumulator, StepRecord
from lightning_memplan.tracking.timeline import TimelineBuilder

__all__ = ["synthetic_report", "synthetic_step"]

MIB = 2**20
#: Operator calls per phase of the synthetic step.
_OPS = {"forward": 300, "backward": 400, "optimizer": 60}


def _timeline_values(phase: str, i: int, n: int, *, params: int, acts: int, stage: int) -> dict[str, int]:
    act_scale = acts // (stage + 1)  # earlier pipeline stages hold more micro-batches in flight
    out = dict.fromkeys(COMPONENTS, 0)
    out["params"], out["optimizer"], out["other"] = params, 2 * params, MIB
    if phase == "forward":
        out["grads"] = params
        out["activations"] = act_scale * i // n
        out["logits"] = act_scale // 4 if i > 0.9 * n else 0
    elif phase == "backward":
        out["activations"] = act_scale * (n - i) // n
        out["grads"] = params * i // n
        out["workspace"] = act_scale // 8
    else:
        out["grads"] = params
        out["workspace"] = params // 2 if i < n // 2 else 0
    return out


def synthetic_step(
    step: int, *, epoch: int, rank: int, seq_len: int, params: int, acts: int, stage: int = 0, tracked: bool = True,
    warmup: bool = False, device_memory: int = 512 * MIB,
) -> StepRecord:
    """One step's record; with ``tracked`` it carries a measured timeline and a per-phase estimate."""
    builder = TimelineBuilder()
    op = 0
    peak: tuple[int, dict[str, int]] = (-1, {})
    by_phase_meas: dict[str, int] = {}
    for phase, n in _OPS.items():
        for i in range(n):
            op += 1
            vals = _timeline_values(phase, i, n, params=params, acts=acts * seq_len // 128, stage=stage)
            total = sum(vals.values())
            builder.sample(op, phase, total, [vals[c] for c in COMPONENTS])
            by_phase_meas[phase] = max(by_phase_meas.get(phase, 0), total)
            if total > peak[0]:
                peak = (total, vals)
    est_scale = 1.04  # the estimate a little above the measurement
    est_by_phase = {
        phase: {c: int(v * est_scale) for c, v in
                _timeline_values(phase, {"forward": n - 1, "backward": 0, "optimizer": 0}[phase], n,
                                 params=params, acts=acts * seq_len // 128, stage=stage).items() if v}
        for phase, n in _OPS.items()
    }
    est_totals = {p: sum(c.values()) for p, c in est_by_phase.items()}
    est_phase = max(est_totals, key=lambda p: est_totals[p])
    measured = peak[0]
    return StepRecord(
        step=step, epoch=epoch, rank=rank, micro_batch=4, seq_len=seq_len,
        estimated_peak=est_totals[est_phase], estimated_components=est_by_phase[est_phase],
        estimated_phase_peaks=est_totals, estimated_peak_phase=est_phase, estimated_by_phase=est_by_phase,
        measured_peak=measured, measured_components=trim_optional(peak[1]) if tracked else None,
        measured_phase_peaks=by_phase_meas, reserved=int(measured * 1.3), device_memory=device_memory,
        headroom=device_memory - int(measured * 1.3), tracked=tracked, warmup=warmup, backend="cpu",
        timeline=builder.timeline(op) if tracked else None,
    )


def synthetic_report(
    *, ranks: int = 1, epochs: int = 2, steps: int = 6, pp: int = 1, oom: bool = False, seq_change: bool = True,
    warnings: bool = True,
) -> MemoryReport:
    """A report of ``epochs`` epochs of ``steps`` steps on ``ranks`` ranks (``pp`` pipeline stages; the
    plan is ``dp = ranks / pp``); ``oom`` adds an out-of-memory incident on the last rank one step after
    the last epoch; ``seq_change`` doubles the sequence length in the second half of the run."""
    if ranks % pp:
        raise ValueError(f"ranks={ranks!r} must be a multiple of pp={pp!r}")
    run = {
        "model": "synthetic-gpt", "plan": {"dp": ranks // pp, "pp": pp, "microbatches": 2 * pp if pp > 1 else 1,
                                            "schedule": "1f1b"},
        "plan_description": f"dp={ranks // pp}" + (f" pp={pp}" if pp > 1 else ""), "precision": "32-true",
        "estimate_source": "calibrated", "accelerator": "cpu", "world_size": ranks,
    }
    report = MemoryReport(run=run, notes=("synthetic report for the renderers' tests",))
    total_steps = epochs * steps
    for epoch in range(epochs):
        summaries = []
        for rank in range(ranks):
            stage = rank // max(1, ranks // pp) if pp > 1 else 0
            acc = RankAccumulator(rank=rank, epoch=epoch, backend="cpu")
            for k in range(steps):
                step = epoch * steps + k
                seq = 256 if seq_change and step >= total_steps // 2 else 128
                acc.add(synthetic_step(
                    step, epoch=epoch, rank=rank, seq_len=seq, params=(8 + 2 * rank) * MIB, acts=24 * MIB,
                    stage=stage, tracked=step in (0, 1) or k == steps - 1, warmup=step == 0,
                ))
            summaries.append(acc.summary())
        texts = (f"epoch {epoch}: rank {ranks - 1} has the least headroom",) if warnings and epoch == epochs - 1 else ()
        report = report.with_epoch(EpochReport(
            epoch=epoch, ranks=tuple(summaries), warnings=texts, warning_steps=(epoch * steps + 1,) if texts else (),
        ))
    if oom:
        rank = ranks - 1
        record = synthetic_step(total_steps, epoch=epochs - 1, rank=rank, seq_len=512, params=(8 + 2 * rank) * MIB,
                                acts=24 * MIB)
        report = report.with_incident(Incident(
            kind="oom", error="OutOfMemoryError: CUDA out of memory. Tried to allocate 96.00 MiB", rank=rank,
            epoch=epochs - 1, step=total_steps, step_record=record,
            allocator={"allocated_bytes": record.measured_peak, "reserved_bytes": record.reserved},
        ))
    return report
