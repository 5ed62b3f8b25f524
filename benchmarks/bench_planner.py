"""CPU time of ``plan()`` for the 1024-GPU case of the suite (llama3-70b, 8 x 128 H100, 8K sequences,
global batch 1024), cold and warm.

Each of ``--processes`` fresh interpreters times its first call (cold: the estimate's per-stage caches
empty) and then the least of ``--warm`` further calls, each after ``gc.collect()``; the medians over the
processes are printed. Timings are ``time.process_time`` (CPU seconds of this process). The same
interpreter then times (least of ``--warm``) the 8-GPU reference search (llama3-8b, one 8 x H100 node, 4K
sequences, global batch 64): the ratio "1024-GPU search / 8-GPU search" is measured in one process and
one run, so it carries over between machines where the seconds do not (house style 14). The suite
checks the 1024-GPU answer (``tests/unit/test_planner.py``) and times nothing; the former test bound was
1 s of CPU for the warm 1024-GPU call on a quiet machine. Machines are noisy: to compare two checkouts,
alternate them in one session, e.g.::

    for i in 1 2 3 4; do PYTHONPATH=old python benchmarks/bench_planner.py --processes 1; \
                         PYTHONPATH=.   python benchmarks/bench_planner.py --processes 1; done
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

_CHILD = """
import gc, json, sys, time
from lightning_memplan.hardware import HardwareSpec
from lightning_memplan.model.specs import ModelSpec, TrainSpec
from lightning_memplan.planning import plan
import lightning_memplan.planning.known, lightning_memplan.planning.suggest  # imports are not the planner's cost
model, train = ModelSpec.preset("llama3-70b"), TrainSpec(micro_batch=1, seq_len=8192)
hw = HardwareSpec.preset("h100-80gb", gpus_per_node=8, num_nodes=128)
times = []
for _ in range(1 + int(sys.argv[1])):
    gc.collect()
    t0 = time.process_time()
    d = plan(model, train, hw, global_batch=1024)
    times.append(time.process_time() - t0)
ref_model, ref_train = ModelSpec.preset("llama3-8b"), TrainSpec(micro_batch=1, seq_len=4096)
ref_hw = HardwareSpec.preset("h100-80gb", gpus_per_node=8, num_nodes=1)
ref_times = []
for _ in range(1 + int(sys.argv[1])):
    gc.collect()
    t0 = time.process_time()
    plan(ref_model, ref_train, ref_hw, global_batch=64)
    ref_times.append(time.process_time() - t0)
print(json.dumps({"cold": times[0], "warm": min(times[1:]), "layouts": d.stats["layouts"],
                  "evaluations": d.stats["memory_evaluations"], "plan": d.candidates[0].describe(),
                  "ref_warm": min(ref_times[1:])}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=5, help="fresh interpreters (default 5)")
    ap.add_argument("--warm", type=int, default=5, help="warm calls per interpreter, the least counts (default 5)")
    args = ap.parse_args(argv)
    if args.processes < 1 or args.warm < 1:
        ap.error(f"--processes={args.processes} and --warm={args.warm} must be >= 1")
    import lightning_memplan

    # the children import the checkout this process imported (PYTHONPATH=<checkout> selects it), from a
    # neutral working directory so "-c"'s sys.path[0] does not pick the current one
    root = pathlib.Path(lightning_memplan.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    runs = []
    for _ in range(args.processes):
        out = subprocess.run([sys.executable, "-c", _CHILD, str(args.warm)], check=True, capture_output=True, text=True,
                             env=env, cwd=tempfile.gettempdir())
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold = statistics.median(r["cold"] for r in runs)
    warm = statistics.median(r["warm"] for r in runs)
    print(f"checkout {root}")
    print(f"plan(): llama3-70b, 1024 H100 (8 x 128), seq 8192, global batch 1024: {runs[0]['layouts']} layouts, "
          f"{runs[0]['evaluations']} memory evaluations, choice {runs[0]['plan']}")
    print(f"CPU seconds, median of {args.processes} processes: cold {cold:.3f}, warm (least of {args.warm}) {warm:.3f}")
    ratios = [r["warm"] / r["ref_warm"] for r in runs if r["ref_warm"] > 0]
    ref = statistics.median(r["ref_warm"] for r in runs)
    ratio = f"{statistics.median(ratios):.1f}x" if ratios else "n/a (reference below the clock's resolution)"
    print(f"8-GPU reference search (llama3-8b, 8 H100, seq 4096, global batch 64): warm {ref:.3f} s; "
          f"1024-GPU warm / 8-GPU warm, median of per-process ratios: {ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
