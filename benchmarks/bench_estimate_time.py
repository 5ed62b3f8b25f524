"""Time per ``estimate_memory`` call of two trees, as a ratio (new / old), in paired alternating runs.

Each run is a fresh process with ``PYTHONPATH`` set to one tree, timing three things with public names
only (so any tree since the one-way-layers rework can be measured):

- ``cold``: one call for each of 768 cases (two presets x 6 layouts x 4 recompute x 2 attention x 2
  loss modes x 2 precisions x (the worst rank, the last rank)), in a fresh process: what the callback's
  first estimate and a CLI call pay, the caches filling as they go;
- ``warm``: the same cases again (the planner's repeated questions: the caches keyed by frozen specs hit);
- ``plan``: ``plan()`` of llama3-8b on 8 H100s (a search of many layouts), after one warm-up.

Times are CPU seconds of the measuring process (``time.process_time``), the least of 5 passes for
``warm`` and ``plan``. The trees alternate (old, new, old, new, ...) so a load change on the machine hits
both; the reported ratios are the median over pairs of new / old and the ratio of the two trees' least
times. No assertion: the numbers are for the closing note.

Run: ``python benchmarks/bench_estimate_time.py --old /tmp/tree_at_223c039 [--new .] [--pairs 5]``
(a tree is a folder holding ``lightning_memplan/``; e.g. ``git archive 223c039 lightning_memplan | tar -x
-C /tmp/tree_at_223c039``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _cases() -> list[tuple[Any, Any, Any, Any]]:
    from lightning_memplan import ModelSpec, ParallelPlan, TrainSpec

    layouts = (ParallelPlan(), ParallelPlan(dp=8), ParallelPlan(dp=8, zero=3), ParallelPlan(dp=2, tp=4, sp=True),
               ParallelPlan(pp=4, microbatches=8), ParallelPlan(dp=2, pp=2, zero=3, microbatches=2))
    out = []
    for preset, plan, recompute, attention, loss, precision in itertools.product(
        ("gpt2", "llama3-8b"), layouts, ("none", "selective", "selective_op", "full"), ("sdpa", "eager"),
        ("naive", "chunked"), ("bf16-mixed", "32-true")
    ):
        train = TrainSpec(micro_batch=2, seq_len=2048, precision=precision, recompute=recompute,
                          attention=attention, loss=loss)
        for rank in (None, plan.world_size - 1):
            out.append((ModelSpec.preset(preset), train, plan, rank))
    return out


def measure(repeats: int = 5) -> dict[str, float]:
    """CPU seconds (``time.process_time``: what this process ran, not what the machine's other work took)
    per call (cold; warm: the least of ``repeats`` passes) and per ``plan()`` (the least of ``repeats``)
    in this process (the tree on ``sys.path``)."""
    from lightning_memplan import HardwareSpec, ModelSpec, TrainSpec, estimate_memory, plan

    cases = _cases()
    start = time.process_time()
    for model, train, layout, rank in cases:
        estimate_memory(model, train, layout, rank=rank)
    cold = (time.process_time() - start) / len(cases)
    warm = math.inf
    for _ in range(repeats):
        start = time.process_time()
        for model, train, layout, rank in cases:
            estimate_memory(model, train, layout, rank=rank)
        warm = min(warm, (time.process_time() - start) / len(cases))
    args = (ModelSpec.preset("llama3-8b"), TrainSpec(micro_batch=2, seq_len=2048), HardwareSpec.preset("h100-sxm"))
    plan(*args, global_batch=64)
    planned = math.inf
    for _ in range(repeats):
        start = time.process_time()
        plan(*args, global_batch=64)
        planned = min(planned, time.process_time() - start)
    return {"cold": cold, "warm": warm, "plan": planned, "cases": len(cases)}


def _run(tree: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "OMP_NUM_THREADS": "1"}
    code = (f"import importlib.util, json; spec = importlib.util.spec_from_file_location('b', {str(Path(__file__).resolve())!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); print(json.dumps(m.measure()))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900, check=True)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True, help="the tree before (a folder holding lightning_memplan/)")
    parser.add_argument("--new", type=Path, default=Path(__file__).resolve().parents[1], help="the tree after")
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args(argv)
    ratios: dict[str, list[float]] = {"cold": [], "warm": [], "plan": []}
    seconds: dict[str, dict[str, list[float]]] = {"old": {k: [] for k in ratios}, "new": {k: [] for k in ratios}}
    for _ in range(args.pairs):
        old, new = _run(args.old), _run(args.new)
        for key in ratios:
            ratios[key].append(new[key] / old[key])
            seconds["old"][key].append(old[key])
            seconds["new"][key].append(new[key])
    print(f"{int(old['cases'])} cases per run, {args.pairs} pairs (old, new alternating); CPU time:")
    for key, values in ratios.items():
        o, n = statistics.median(seconds["old"][key]), statistics.median(seconds["new"][key])
        lo, ln = min(seconds["old"][key]), min(seconds["new"][key])
        unit = "s per plan()" if key == "plan" else "ms per call"
        scale = 1 if key == "plan" else 1e3
        print(f"  {key:5s} median old {o * scale:7.3f} new {n * scale:7.3f}, least old {lo * scale:7.3f} new "
              f"{ln * scale:7.3f} {unit}; new/old: median of pairs {statistics.median(values):.3f}, of the least "
              f"{ln / lo:.3f} (pairs: {', '.join(f'{v:.3f}' for v in values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
