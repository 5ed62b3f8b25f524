"""One script that validates lightning_memplan on a real CUDA GPU in a few minutes.

Each check is a *section* registered with :func:`section`; later parts of the project (callback, loss,
strategy) add theirs the same way, so one run validates everything::

    @section("loss", "chunked loss peak vs naive on the GPU")
    def loss_section(ctx: Context) -> SectionResult: ...

Sections shipped here:

- ``estimate``: the model zoo (GPT-2 style, Llama style with GQA + SwiGLU + RMSNorm, tied embeddings)
  x precisions x attention kinds x loss kinds, run for real on the GPU: after two warm-up steps and
  with the peak statistics reset at each phase boundary, ``torch.cuda.max_memory_allocated`` per phase
  (forward, backward, optimizer step) is compared with the analytic estimate
  (``estimate_memory``), the traced estimate (``trace_memory(device="cuda")``: fake CUDA tensors) and
  the ``TensorTracker`` measuring the same step on the device.

Run: ``python benchmarks/gpu_check.py [--quick] [--sections estimate,...] [--out PATH]``. Without CUDA it
prints why and exits 0; ``--allow-cpu`` runs the sections on the CPU (peaks from ``TensorTracker``) to
exercise the script itself. Target: under 5 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_estimate_accuracy import PRECISIONS, TRANSFORMERS, Case, losses  # noqa: E402

from lightning_memplan.model.estimate import estimate_memory  # noqa: E402
from lightning_memplan.model.result import PHASES  # noqa: E402
from lightning_memplan.model.specs import ParallelPlan  # noqa: E402
from lightning_memplan.model.trace import trace_memory  # noqa: E402
from lightning_memplan.tracking import PrecisionEmulation, TensorTracker, run_training_step  # noqa: E402

MiB = 2**20
# GPU sizes: large enough that allocator rounding and cuBLAS workspaces are small next to the terms.
GPU_SIZES = {"vocab_size": 32768, "n_layers": 4, "hidden": 1024, "max_positions": 2048}
GPU_BATCH, GPU_SEQ, GPU_CHUNK = 4, 1024, 1024


@dataclass
class Context:
    """What every section gets: the device, the time budget and the command-line switches."""

    device: torch.device
    quick: bool
    deadline: float

    def time_left(self) -> float:
        return self.deadline - time.perf_counter()


@dataclass
class SectionResult:
    """A section's outcome: a markdown table, free-form notes, and whether its targets held."""

    name: str
    table: str = ""
    notes: list[str] = field(default_factory=list)
    ok: bool = True


SECTIONS: dict[str, tuple[str, Callable[[Context], SectionResult]]] = {}


def section(name: str, description: str) -> Callable[[Callable[[Context], SectionResult]], Callable[[Context], SectionResult]]:
    """Register ``fn(ctx) -> SectionResult`` as the GPU check section ``name``."""

    def register(fn: Callable[[Context], SectionResult]) -> Callable[[Context], SectionResult]:
        if name in SECTIONS:
            raise ValueError(f"section {name!r} is registered twice")
        SECTIONS[name] = (description, fn)
        return fn

    return register


# ------------------------------------------------------------------------------------------ helpers
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_phase_peaks(
    model: torch.nn.Module, batch: Any, loss_fn: Any, precision: str, device: torch.device, *, warmup: int = 2
) -> tuple[dict[str, int], dict[str, int]]:
    """Per-phase peak allocated bytes of one steady-state step: ``(allocator, tracker)``.

    On CUDA the allocator figures are ``torch.cuda.max_memory_allocated`` with the peak reset at each
    phase boundary; on CPU (``--allow-cpu``) both come from the tracker.
    """
    emulation = PrecisionEmulation(precision=precision, device_type=device.type)
    model = emulation.convert_module(model.to(device))
    batch = emulation.convert_input(tuple(t.to(device) for t in batch))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(warmup):
        run_training_step(model, batch, loss_fn, opt, precision=emulation)
    sync(device)
    allocator: dict[str, int] = {}
    current: list[str] = []

    def on_phase(phase: str) -> None:
        sync(device)
        if device.type == "cuda":
            if current:
                allocator[current[-1]] = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        current.append(phase)
        tracker.set_phase(phase)

    seq_len = batch[0].shape[1] if batch[0].dim() == 2 else None
    tracker = TensorTracker(model, opt, seq_len=seq_len, device=device)
    with tracker:
        tracker.track(batch, "other")
        run_training_step(model, batch, loss_fn, opt, precision=emulation, on_phase=on_phase)
    sync(device)
    report = tracker.report()
    tracked = {p: report.phase_total(p) for p in report.by_phase}
    if device.type == "cuda":
        allocator[current[-1]] = torch.cuda.max_memory_allocated(device)
    else:
        allocator = dict(tracked)
    return allocator, tracked


def gpu_cases(quick: bool, on_gpu: bool = True) -> list[Case]:
    precisions = ("bf16-mixed", "32-true") if quick else PRECISIONS
    kinds = ("naive", "chunked") if quick else losses()
    shape = {"micro_batch": GPU_BATCH, "seq_len": GPU_SEQ} if on_gpu else {}
    return [
        Case(name, precision, attention, loss, **shape)
        for name in TRANSFORMERS
        for precision in precisions
        for attention in ("sdpa", "eager")
        for loss in kinds
        if loss in losses()
    ]


def _err(estimate: int, measured: int) -> str:
    return f"{(estimate - measured) / measured:+.1%}" if measured else "n/a"


# ------------------------------------------------------------------------------------------ sections
@section("estimate", "zoo: analytic / traced / tracker vs torch.cuda.max_memory_allocated per phase")
def estimate_section(ctx: Context) -> SectionResult:
    import bench_estimate_accuracy as bench

    saved = (bench.GPT_SIZES, bench.CHUNK)
    on_gpu = ctx.device.type == "cuda"
    if on_gpu:  # on the CPU (--allow-cpu) keep the CPU benchmark's small sizes
        bench.GPT_SIZES, bench.CHUNK = GPU_SIZES, GPU_CHUNK
    chunk = bench.CHUNK
    result = SectionResult("estimate")
    lines = [
        "| case | phase | allocator (MiB) | tracker | analytic | err | traced | err |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    worst = {"analytic": 0.0, "traced": 0.0}
    skipped = 0
    try:
        for case in gpu_cases(ctx.quick, on_gpu):
            if ctx.time_left() < 20:
                skipped += 1
                continue
            model, batch, loss_fn = case.build()
            train = case.train_spec().replace(
                optimizer_impl="foreach" if ctx.device.type == "cuda" else "for_loop",
                device=ctx.device.type,
                loss_chunk_size=chunk if case.loss == "chunked" else None,
            )
            analytic = estimate_memory(model.spec(), train, ParallelPlan())
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                traced = trace_memory(model, batch, loss_fn=loss_fn, precision=case.precision, seq_len=case.seq_len,
                                      device=ctx.device)
            allocator, tracked = measure_phase_peaks(model, batch, loss_fn, case.precision, ctx.device)
            for phase in PHASES:
                measured = allocator.get(phase, 0)
                a, t = analytic.phase_total(phase), traced.phase_total(phase)
                for key, value in (("analytic", a), ("traced", t)):
                    if measured:
                        worst[key] = max(worst[key], abs(value - measured) / measured)
                lines.append(
                    f"| {case.label} | {phase} | {measured / MiB:.1f} | {tracked.get(phase, 0) / MiB:.1f} | "
                    f"{a / MiB:.1f} | {_err(a, measured)} | {t / MiB:.1f}{'' if traced.mode == 'fake' else '*'} | "
                    f"{_err(t, measured)} |"
                )
            del model, batch
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        bench.GPT_SIZES, bench.CHUNK = saved
    result.table = "\n".join(lines)
    result.notes.append(
        f"worst per-phase |error|: analytic {worst['analytic']:.1%} (target 10%), traced {worst['traced']:.1%} "
        "(target 2%; * = the fake trace fell back to a real CPU step)"
    )
    if skipped:
        result.notes.append(f"{skipped} cases skipped to stay within the time budget")
    result.ok = worst["analytic"] <= 0.10 and worst["traced"] <= 0.02
    return result


# ------------------------------------------------------------------------------------------ driver
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {list(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="fewer cases per section")
    parser.add_argument("--budget", type=float, default=270.0, help="seconds for all sections (default 270)")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU when there is no GPU")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as markdown")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.sections.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; available: {list(SECTIONS)}")
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        where = torch.cuda.get_device_name(device)
    elif args.allow_cpu:
        device, where = torch.device("cpu"), "CPU (--allow-cpu: allocator figures are the tracker's)"
    else:
        print("gpu_check: no CUDA device is available; nothing to check (sections: " + ", ".join(SECTIONS) + ").")
        print("Run it on a machine with a CUDA GPU, or pass --allow-cpu to exercise the script on the CPU.")
        return 0
    ctx = Context(device=device, quick=args.quick, deadline=time.perf_counter() + args.budget)
    out = [f"# GPU check ({datetime.date.today().isoformat()}) on {where}", ""]
    status = 0
    for name in names:
        description, fn = SECTIONS[name]
        start = time.perf_counter()
        print(f"== {name}: {description}", flush=True)
        try:
            res = fn(ctx)
        except Exception:  # noqa: BLE001 - report the section's failure and run the others
            status = 1
            text = traceback.format_exc()
            print(text)
            out += [f"## {name}: ERROR", "", "```", text, "```", ""]
            continue
        took = time.perf_counter() - start
        print(res.table)
        for note in res.notes:
            print(note)
        print(f"-- {name}: {'ok' if res.ok else 'MISSES TARGET'} ({took:.0f} s)\n", flush=True)
        out += [f"## {name}: {'ok' if res.ok else 'misses target'} ({took:.0f} s)", "", description, "", res.table, ""]
        out += [f"- {note}" for note in res.notes] + [""]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(out))
        print(f"wrote {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
