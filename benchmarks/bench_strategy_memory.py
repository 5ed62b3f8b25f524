"""Benchmark: memplan_auto's recorded per-rank estimate against the tensor-level measurement, for the
sharded layouts on 2 and 4 gloo processes (CPU), one table.

Model and batch are those of ``tests/distributed/test_strategy_memory_tp.py`` (Llama-style zoo GPT,
2 layers, h=64, V=512, s=128, b=4 per data-parallel rank, fp32, AdamW); the measurement is that test's
(``TensorTracker`` over the steady-state steps, the smallest step peak). The tests assert 5 % for the
layouts they cover; this script also prints the ones they do not (ZeRO-3 with ``LinearCrossEntropy``,
TP+FSDP and PP+FSDP on 4 processes), so the closing numbers can be re-measured with one command.

Usage::

    python benchmarks/bench_strategy_memory.py            # about 1 minute on 2 cores
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runnable from a checkout without installing: the repository root (after any installed copy) and the tests.
sys.path.append(str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))

from test_strategy_memory_tp import memory_worker  # noqa: E402

from lightning_memplan.model.specs import ParallelPlan  # noqa: E402
from lightning_memplan.testing import run_distributed  # noqa: E402

CASES = {
    2: [(ParallelPlan(dp=2, zero=3), "naive"), (ParallelPlan(dp=2, zero=3), "lce"), (ParallelPlan(dp=2, zero=2), "lce")],
    4: [(ParallelPlan(dp=2, tp=2, zero=3), "lce"), (ParallelPlan(dp=2, pp=2, zero=3, microbatches=2), "naive")],
}


def main() -> int:
    print("| plan | loss | rank | estimate (B) | measured (B) | error |")
    print("| --- | --- | --- | --- | --- | --- |")
    for world, cases in CASES.items():
        results = run_distributed(memory_worker, world, cases)
        for rank, per_case in enumerate(results):
            for (plan, kind), r in zip(cases, per_case, strict=True):
                err = (r["estimate"] - r["measured"]) / r["measured"]
                print(f"| {plan.describe()} | {kind} | {rank} | {r['estimate']:,} | {r['measured']:,} | {err:+.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
