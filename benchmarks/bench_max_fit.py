"""The largest fit: ``max_micro_batch`` / ``max_seq_len`` against the true largest fit, measured.

For a small Hugging Face Llama (built from a config, no download) and the zoo's GPT-2 layout, fp32 on the
CPU, under several budgets: the true largest micro-batch (at s=128) and sequence length (at b=4), found by
a measured sweep (:func:`lightning_memplan.testing.fit_sweep.measured_largest`: PyTorch's MemTracker on a
real steady-state training step and a validation step under ``no_grad``, the batch live; doubling, then
bisection), next to the prediction (:func:`lightning_memplan.planning.fit.largest_fit`, the planner's fit
test). Target: equal or one below, never above. Nothing here was fitted: every row is held out (the
analytic terms and the Hugging Face trace were written and calibrated on other shapes).

Run: ``python benchmarks/bench_max_fit.py [--quick] [--out PATH]``; writes ``benchmarks/results/max_fit.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

# Runnable from a checkout without installing: the repository root after any installed copy.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from lightning_memplan.model.specs import ModelSpec, TrainSpec  # noqa: E402
from lightning_memplan.planning.fit import largest_fit  # noqa: E402
from lightning_memplan.testing.fit_sweep import hf_llama_case, measured_largest, zoo_gpt_case  # noqa: E402

MiB = 2**20
#: (axis, the other batch dimension, budgets in MiB)
SWEEPS = (("micro_batch", 128, (12, 20, 30)), ("seq_len", 4, (10, 14, 18)))
QUICK = (("micro_batch", 128, (20,)), ("seq_len", 4, (14,)))


def rows(quick: bool = False) -> list[dict]:
    out = []
    for make in (hf_llama_case, zoo_gpt_case):
        case = make()
        spec = ModelSpec.from_module(case.model)
        for axis, other, budgets in QUICK if quick else SWEEPS:
            for mib in budgets:
                t0 = time.perf_counter()
                b, s = (1, other) if axis == "micro_batch" else (other, 1)
                train = TrainSpec(micro_batch=b, seq_len=s, precision="32-true", optimizer_impl="for_loop",
                                  device="cpu")
                found = largest_fit(spec, train, axis=axis, memory_budget=mib * MiB)
                bound = case.max_positions if axis == "seq_len" else 1024
                true, peaks = measured_largest(case, mib * MiB, axis=axis, other=other, bound=bound)
                out.append({
                    "model": case.name, "axis": axis, "other": other, "budget_mib": mib, "predicted": found.value,
                    "measured": true, "delta": found.value - true, "phase": found.binding_phase,
                    "component": found.binding_component, "source": found.estimate.source if found.estimate else "-",
                    "measured_peak": peaks.get(true, 0), "steps": len(peaks), "seconds": time.perf_counter() - t0,
                })
                print(out[-1], flush=True)
    return out


def markdown(table: list[dict]) -> str:
    lines = [
        "# The largest fit: predicted vs measured (CPU, fp32, AdamW)",
        "",
        "`python benchmarks/bench_max_fit.py`. Measured: the largest value whose MemTracker peak (steady-state",
        "training step and validation step under `no_grad`, the batch live) is within the budget, by a measured",
        "sweep; predicted: `max_micro_batch` / `max_seq_len` (`planning/fit.py`, the planner's fit test).",
        "Target: predicted == measured or measured - 1, never above. Every row is held out (nothing was fitted to it).",
        "",
        "| model | searched | at | budget | predicted | measured | predicted - measured | binds (phase, component) "
        "| estimate | measured peak at measured | real steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table:
        at = f"s={r['other']}" if r["axis"] == "micro_batch" else f"b={r['other']}"
        verdict = "" if r["delta"] in (0, -1) else (" **above**" if r["delta"] > 0 else " **below**")
        lines.append(
            f"| {r['model']} | {r['axis']} | {at} | {r['budget_mib']} MiB | {r['predicted']} | {r['measured']} | "
            f"{r['delta']:+d}{verdict} | {r['phase']}, {r['component']} | {r['source']} | "
            f"{r['measured_peak'] / MiB:.3f} MiB | {r['steps']} |"
        )
    misses = [r for r in table if r["delta"] > 0]
    lines += ["", "## Where and why it misses", ""]
    if not misses:
        lines.append("No row is above the measured largest fit.")
    for r in misses:
        lines.append(
            f"- {r['model']} {r['axis']} at {r['budget_mib']} MiB: predicted {r['predicted']}, measured "
            f"{r['measured']}: the estimate at the predicted value is below the measured peak there (a term the "
            "memory model misses; before issue 26 it was the batch's int64 token ids and targets, 16 B per token)."
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one budget per axis")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "max_fit.md")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    text = markdown(rows(args.quick))
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
