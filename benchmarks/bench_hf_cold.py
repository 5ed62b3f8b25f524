"""Benchmark: how long the config-only traced estimate of a 70B-class Hugging Face config takes.

Issue 15's "Speed" line: the config-only estimate of a 70B-class config returns in under 1 s cold and
under 10 ms warm, so ``plan()`` for 1024 GPUs stays under 1 s of CPU.

The config is Llama-3-70B's shape (h=8192, 80 layers, 64 heads, 8 KV heads, FFN 28672, V=128256) built
as ``transformers.LlamaConfig`` -- importing transformers and building the config is the user's cost
and is not timed. Each measurement runs in a fresh Python process, timed from after the config exists:

- ``cold, traced``: no cache entry for the config (an empty cache directory): the depth-1 and depth-2
  copies are built on the meta device and traced under fake tensors (this includes importing
  transformers' modeling code, which the config alone does not import);
- ``cold, disk hit``: a fresh process whose cache directory holds the entry the first run wrote
  (``tracking/hf_cache.py``: one JSON file, read and parsed);
- ``cold, traced, modeling imported``: as the first, with transformers' modeling modules imported
  before the timer (what the trace itself costs);
- ``warm``: the same process asking again (a different batch shape: the same cache entry, the
  per-shape evaluation is re-done);
- ``plan() CPU``: ``time.process_time()`` of ``plan(spec, train, 128 nodes x 8 H100-SXM)`` right after
  (1024 GPUs, global batch 1024; its recompute="full" trace is a disk hit too), then of a second call,
  and for scale the same planner on the hand-written terms (``hf_config=None``), also a second call.

Wall times on a shared machine swing with its load (printed with each run); ``--repeats`` takes the
median of the fresh-process runs.

Usage::

    python benchmarks/bench_hf_cold.py                 # 1 traced run, 3 disk-hit runs; prints a table
    python benchmarks/bench_hf_cold.py --write         # also writes benchmarks/results/cpu_<date>_hf_cold.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
_CHILD = r"""
import json, os, sys, time
import transformers
if "--preimport" in sys.argv:  # the modeling code a config alone does not import (sklearn comes with it)
    import transformers.models.auto.modeling_auto, transformers.models.llama.modeling_llama
cfg = transformers.LlamaConfig(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                               num_key_value_heads=8, intermediate_size=28672, vocab_size=128256,
                               max_position_embeddings=8192)
t0 = time.perf_counter()
from lightning_memplan.model.estimate import estimate_memory
from lightning_memplan.model.specs import ModelSpec, TrainSpec
spec = ModelSpec.from_hf_config(cfg)
train = TrainSpec(micro_batch=1, seq_len=8192, precision="bf16-mixed", device="cuda")
est = estimate_memory(spec, train)
t1 = time.perf_counter()
again = estimate_memory(spec, train.replace(micro_batch=2, seq_len=4096))
t2 = time.perf_counter()
from lightning_memplan.hardware.spec import HardwareSpec
from lightning_memplan.planning.planner import plan
hw = HardwareSpec.preset("h100-sxm", gpus_per_node=8, num_nodes=128)
c0 = time.process_time()
decision = plan(spec, train, hw, global_batch=1024)
c1 = time.process_time()
from dataclasses import replace
analytic = replace(spec, hf_config=None)  # the same planner on the hand-written terms, for scale
plan(analytic, train, hw, global_batch=1024)  # its first-call memos, as the traced run had them
a0 = time.process_time()
plan(analytic, train, hw, global_batch=1024)
a1 = time.process_time()
plan(spec, train, hw, global_batch=1024)
a2 = time.process_time()
print("RESULT " + json.dumps({
    "cold_s": t1 - t0, "warm_ms": 1000 * (t2 - t1), "plan_cpu_s": c1 - c0, "source": est.source,
    "plan_again_cpu_s": a2 - a1, "plan_analytic_cpu_s": a1 - a0,
    "total": est.total, "warm_source": again.source, "load": os.getloadavg()[0],
    "plan": decision.describe() if hasattr(decision, "describe") else str(getattr(decision, "plan", "")),
}))
"""


def _run_child(cache: Path, *flags: str) -> dict:
    env = {**os.environ, "LIGHTNING_MEMPLAN_HF_TRACE_CACHE": str(cache), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _CHILD, *flags], env=env, capture_output=True, text=True, timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"child failed (rc={out.returncode}):\n{out.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes with a disk hit (median)")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/cpu_<date>_hf_cold.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as tmp2:
        cache = Path(tmp)
        traced = _run_child(cache)
        hits = [_run_child(cache) for _ in range(args.repeats)]
        preimported = _run_child(Path(tmp2), "--preimport")
    assert traced["source"] == "hf_trace" and all(h["source"] == "hf_trace" for h in hits)
    assert all(h["total"] == traced["total"] for h in hits), "a disk hit must give the traced estimate"
    keys = ("cold_s", "warm_ms", "plan_cpu_s", "plan_again_cpu_s", "plan_analytic_cpu_s", "load")
    med = {k: statistics.median(h[k] for h in hits) for k in keys}
    rows = [
        ("cold, traced (no cache entry)", f"{traced['cold_s']:.2f} s", "< 1 s", f"{traced['load']:.1f}"),
        ("cold, traced, transformers modeling code imported before the timer", f"{preimported['cold_s']:.2f} s", "-",
         f"{preimported['load']:.1f}"),
        (f"cold, disk hit (median of {len(hits)})", f"{med['cold_s']:.3f} s", "< 1 s", f"{med['load']:.1f}"),
        ("warm (same process, another shape)", f"{med['warm_ms']:.2f} ms", "< 10 ms", f"{med['load']:.1f}"),
        ("plan() 1024 GPUs, CPU time (first call)", f"{med['plan_cpu_s']:.3f} s", "< 1 s", f"{med['load']:.1f}"),
        ("plan() 1024 GPUs, CPU time (again)", f"{med['plan_again_cpu_s']:.3f} s", "< 1 s", f"{med['load']:.1f}"),
        ("plan() 1024 GPUs on the analytic terms, CPU time (again)", f"{med['plan_analytic_cpu_s']:.3f} s", "-",
         f"{med['load']:.1f}"),
    ]
    lines = [
        "| measurement | time | target | load avg |",
        "|---|---|---|---|",
        *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows),
    ]
    header = (
        f"Llama-3-70B LlamaConfig, TrainSpec(b=1, s=8192, bf16-mixed, cuda); estimate {traced['total'] / 2**30:.1f} "
        f"GiB (source {traced['source']}); plan: {hits[-1]['plan']}\n"
        f"{platform.platform()}, Python {platform.python_version()}, {os.cpu_count()} CPUs, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    )
    text = header + "\n\n" + "\n".join(lines) + "\n"
    print(text)
    if args.write:
        sys.path.insert(0, str(_ROOT))
        from lightning_memplan.files import write_atomic

        path = _ROOT / "benchmarks" / "results" / f"cpu_{datetime.date.today():%Y-%m-%d}_hf_cold.md"
        write_atomic(path, "# Config-only HF trace: cold and warm speed (`benchmarks/bench_hf_cold.py`)\n\n" + text)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
