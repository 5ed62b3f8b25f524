"""Snapshot of ``estimate_memory``'s answers, as canonical JSON, to compare two trees byte for byte.

Two tables:

- ``analytic``: the hand-written terms on a fixed grid: presets gpt2, gpt2-medium, llama-7b, llama3-8b
  x ``TrainSpec.framework`` (torch, megatron, llama3) x ``recompute`` (none, selective, selective_op,
  full) x ``attention`` (sdpa, eager) x 6 layouts (one device; DDP; FSDP zero=3; TP+SP; a 1F1B-interleaved
  pipeline with TP; a GPipe pipeline with ZeRO-1) x 2 loss modes per layout x ``rank`` (None, 0):
  4 * 3 * 4 * 2 * 6 * 2 * 2 = 2,304 cases. A case the estimate refuses is recorded by its error text.
- ``hf``: the config-only estimates of the Hugging Face architecture grid of
  ``benchmarks/bench_hf_architectures.py`` (14 architectures x 2 precisions x sdpa/eager (T5: eager) x
  dropout 0/0.1 x HF checkpointing: 216 rows), ``estimate_memory(ModelSpec.from_hf_config(model.config),
  TrainSpec(...))`` exactly as that benchmark asks it (transformers needed; traced, so slow: every row
  traces its own config and step). ``--entries PATH`` also writes the traced coefficient entries the
  rows used (what the coefficient source returns, keyed by config JSON and traced step) for
  ``tests/unit/test_estimate_snapshot.py``, which replays them without tracing.

Only public names that exist before and after the package reorganisation are imported; moved internals
are looked up at both places.

Run: ``python benchmarks/estimate_snapshot.py [--tables analytic hf] [--out PATH] [--entries PATH]``
(``--out`` ending in ``.gz`` is gzip-compressed, with a fixed mtime, so equal tables give equal files).
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import itertools
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# Runnable from a checkout: the repository root after any installed copy (PYTHONPATH=<another tree> wins).
sys.path.append(str(Path(__file__).resolve().parents[1]))

from lightning_memplan import ModelSpec, ParallelPlan, TrainSpec, estimate_memory  # noqa: E402

PRESETS = ("gpt2", "gpt2-medium", "llama-7b", "llama3-8b")
FRAMEWORKS = ("torch", "megatron", "llama3")
RECOMPUTE = ("none", "selective", "selective_op", "full")
ATTENTION = ("sdpa", "eager")
#: (name, plan, the two loss modes it is paired with)
LAYOUTS: tuple[tuple[str, ParallelPlan, tuple[str, str]], ...] = (
    ("single", ParallelPlan(), ("naive", "fp32_upcast")),
    ("ddp8", ParallelPlan(dp=8), ("chunked", "naive")),
    ("fsdp8", ParallelPlan(dp=8, zero=3), ("fp32_upcast", "chunked")),
    ("tp4sp_dp2", ParallelPlan(dp=2, tp=4, sp=True), ("vocab_parallel", "loss_parallel")),
    ("pp4_interleaved_v2_tp2", ParallelPlan(tp=2, pp=4, microbatches=8, schedule="interleaved", virtual_stages=2),
     ("vocab_parallel", "chunked")),
    ("pp2_gpipe_dp2_zero1", ParallelPlan(dp=2, pp=2, microbatches=4, schedule="gpipe", zero=1),
     ("naive", "fp32_upcast")),
)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _answer(model: ModelSpec, train: TrainSpec, plan: ParallelPlan | None, rank: int | None) -> dict[str, Any]:
    try:
        return estimate_memory(model, train, plan, rank=rank).to_dict()
    except (ValueError, TypeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def analytic_table() -> dict[str, Any]:
    """``{case key: MemoryEstimate.to_dict() or {"error": ...}}`` for the 2,304-case grid."""
    out: dict[str, Any] = {}
    for preset, framework, recompute, attention, (layout, plan, losses), rank in itertools.product(
        PRESETS, FRAMEWORKS, RECOMPUTE, ATTENTION, LAYOUTS, (None, 0)
    ):
        model = ModelSpec.preset(preset)
        for loss in losses:
            train = TrainSpec(micro_batch=2, seq_len=2048, precision="bf16-mixed", recompute=recompute,
                              attention=attention, loss=loss, framework=framework)
            key = f"{preset}|{framework}|{recompute}|{attention}|{layout}|{loss}|rank={rank}"
            out[key] = _answer(model, train, plan, rank)
    return out


def _import_first(*names: str) -> Any:
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(f"none of {names} imports")


def hf_rows() -> list[tuple[str, str, str, float, bool]]:
    """The 216 rows of ``bench_hf_architectures.grid`` (full grid): every architecture x (dropout,
    checkpointing) x precision x its attention implementations."""
    from lightning_memplan.testing.hf_architectures import ARCHITECTURES

    return [
        (name, precision, attention, dropout, ckpt)
        for dropout, ckpt in ((0.0, False), (0.1, False), (0.0, True), (0.1, True))
        for precision in ("32-true", "bf16-mixed")
        for name, arch in ARCHITECTURES.items()
        for attention in arch.attentions
    ]


def hf_table(entries: dict[str, Any] | None) -> dict[str, Any]:
    """``{row key: MemoryEstimate.to_dict() or {"error": ...}}`` of the config-only HF grid; records the
    traced entries into ``entries`` (``{config JSON + traced step JSON: entry}``) when given."""
    from lightning_memplan.testing.hf_architectures import ARCHITECTURES, build_model

    hf_trace = _import_first("lightning_memplan.tracking.hf_trace", "lightning_memplan.model.hf_trace")
    if entries is not None:
        _record_entries(entries)
    out: dict[str, Any] = {}
    for name, precision, attention, dropout, ckpt in hf_rows():
        arch = ARCHITECTURES[name]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build_model(arch, dropout=dropout, attention=attention, checkpointing=ckpt)
            s = hf_trace.vision_tokens(model.config.to_dict()) if arch.vision else 128
            train = TrainSpec(micro_batch=2, seq_len=s, precision=precision, attention=attention,
                              recompute="full" if ckpt else "none", optimizer_impl="for_loop", device="cpu")
            spec = ModelSpec.from_hf_config(model.config)
            key = f"{name}|{precision}|{attention}|{dropout:g}|ckpt={ckpt}"
            out[key] = _answer(spec, train, None, None)
            out[key]["hf_config"] = spec.hf_config
            out[key]["train"] = train.to_dict()
    return out


def _record_entries(entries: dict[str, Any]) -> None:
    """Wrap ``trace_depths`` where the tracer calls it so each traced entry is kept (key: the config
    JSON and the traced step's JSON, what ``tests/unit/test_estimate_snapshot.py`` looks up)."""
    calibrate = _import_first("lightning_memplan.tracking.hf_calibrate", "lightning_memplan.model.hf_calibrate")
    original = calibrate.trace_depths

    def recording(cfg: Any, t0: Any) -> dict[str, Any]:
        entry = original(cfg, t0)
        from lightning_memplan.model.hf_build import canonical_config_json

        entries[canonical_config_json(dict(cfg)) + "\n" + t0.to_json()] = entry
        return entry

    calibrate.trace_depths = recording
    for name in ("lightning_memplan.tracking.hf_trace", "lightning_memplan.model.hf_trace"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "trace_depths"):
            module.trace_depths = recording


def _write(path: Path, text: str) -> None:
    data = text.encode()
    if path.suffix == ".gz":
        data = gzip.compress(data, mtime=0)
    path.write_bytes(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", nargs="*", default=["analytic", "hf"], choices=["analytic", "hf"])
    parser.add_argument("--out", default="estimate_snapshot.json", help="output path (.gz: gzip)")
    parser.add_argument("--entries", default=None, help="also write the traced entries the hf rows used here")
    args = parser.parse_args(argv)
    start = time.time()
    tables: dict[str, Any] = {}
    entries: dict[str, Any] | None = {} if args.entries else None
    if "analytic" in args.tables:
        tables["analytic"] = analytic_table()
        print(f"analytic: {len(tables['analytic'])} cases, "
              f"{sum('error' in v for v in tables['analytic'].values())} refused ({time.time() - start:.0f} s)")
    if "hf" in args.tables:
        tables["hf"] = hf_table(entries)
        print(f"hf: {len(tables['hf'])} rows, {sum('error' in v for v in tables['hf'].values())} refused "
              f"({time.time() - start:.0f} s)")
    _write(Path(args.out), _canonical(tables))
    if entries is not None and args.entries:
        _write(Path(args.entries), _canonical(entries))
        print(f"entries: {len(entries)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
