"""Config-only and traced estimates against a real CPU training step, for real Hugging Face architectures.

For every architecture in :data:`lightning_memplan.testing.hf_architectures.ARCHITECTURES` (GPT-2,
Llama, Mistral, Qwen2, Qwen3, Gemma-2 with softcaps, OLMo-2, Phi-3, GPT-NeoX, Mixtral, Qwen2-MoE, BERT
MLM, T5, ViT; 4 blocks, width 256, V=32000) x precision {32-true, bf16-mixed} x attention {sdpa, eager}
x dropout {0, 0.1} x {without, with HF ``gradient_checkpointing_enable()``}: one steady-state CPU step
(AdamW, Lightning's order) is measured by PyTorch's ``MemTracker`` and compared with

- the config-only estimate ``estimate_memory(ModelSpec.from_hf_config(model.config), TrainSpec(...))``
  (``source`` says which path it took: ``hf_trace`` with transformers installed): target within 3%;
- the traced estimate ``trace_memory(model, example_input=batch)`` (fake tensors): target within 0.5%.

Run: ``python benchmarks/bench_hf_architectures.py [--quick] [--arch NAME ...] [--part NAME] [--resume]
[--out PATH]``. Writes ``benchmarks/results/cpu_<date>_hf_architectures[_<part>].md``; ``--resume`` keeps
the rows already in that file and measures the rest (the grid takes about a CPU-hour on 2 cores: bf16
matmuls on an AVX2-only CPU run ~20x slower than fp32).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

# Runnable from a checkout without installing: the repository root after any installed copy.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from lightning_memplan.model.estimate import estimate_memory  # noqa: E402
from lightning_memplan.model.specs import ModelSpec, TrainSpec  # noqa: E402
from lightning_memplan.testing.hf_architectures import (  # noqa: E402
    ARCHITECTURES,
    build_model,
    example_batch,
    loss_of,
    measure_step,
)
from lightning_memplan.tracking.hf_trace import vision_tokens  # noqa: E402
from lightning_memplan.tracking.trace import trace_memory  # noqa: E402

CONFIG_TARGET = 0.03
TRACED_TARGET = 0.005
QUICK = ("gpt2", "llama", "gemma2", "mixtral", "bert_mlm", "t5", "vit")


@dataclass(frozen=True)
class GridRow:
    """One configuration of the grid and its measured peak (what both kinds of row have)."""

    arch: str
    precision: str
    attention: str
    dropout: float
    checkpointing: bool
    measured: int

    @property
    def key(self) -> tuple[str, str, str, float, bool]:
        return (self.arch, self.precision, self.attention, self.dropout, self.checkpointing)


@dataclass(frozen=True)
class Row(GridRow):
    config_only: int
    source: str
    traced: int

    @property
    def config_error(self) -> float:
        return self.config_only / self.measured - 1

    @property
    def traced_error(self) -> float:
        return self.traced / self.measured - 1


def run_row(name: str, precision: str, attention: str, dropout: float, checkpointing: bool, *,
            micro_batch: int = 2, seq_len: int = 128) -> Row:
    """Measure one configuration and estimate it both ways."""
    arch = ARCHITECTURES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_model(arch, dropout=dropout, attention=attention, checkpointing=checkpointing)
        batch = example_batch(model, micro_batch, seq_len)
        s = vision_tokens(model.config.to_dict()) if arch.vision else seq_len
        train = TrainSpec(micro_batch=micro_batch, seq_len=s, precision=precision, attention=attention,
                          recompute="full" if checkpointing else "none", optimizer_impl="for_loop", device="cpu")
        estimate = estimate_memory(ModelSpec.from_hf_config(model.config), train)
        traced = trace_memory(model, example_input=batch, loss_fn=loss_of, precision=precision, seq_len=s)
        measured = measure_step(model, batch, precision=precision)
    return Row(name, precision, attention, dropout, checkpointing, measured, estimate.total, estimate.source,
               traced.total)


@dataclass(frozen=True)
class KeptRow(GridRow):
    """A row of an earlier run's results file, kept as it was printed (``--resume``): not re-measured."""

    config_text: str
    source: str
    traced_text: str

    @property
    def config_error(self) -> float:
        return float(self.config_text.rstrip("%")) / 100

    @property
    def traced_error(self) -> float:
        return float(self.traced_text.rstrip("%")) / 100


def read_rows(path: Path) -> list[KeptRow]:
    """The rows of a results file this script wrote (both column layouts it has used), in file order."""
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) not in (9, 10) or cells[0] in ("model", "---") or not cells[-1].endswith("%"):
            continue
        if len(cells) == 10:
            del cells[5]  # the reference column (always MemTracker)
        arch, precision, attention, dropout, ckpt, measured, config_text, source, traced_text = cells
        rows.append(KeptRow(arch, precision, attention, float(dropout), ckpt == "yes", int(measured.replace(",", "")),
                            config_text, source, traced_text))
    return rows


#: Parts of the grid, each a (dropout, HF checkpointing) variant with its own results file, so the
#: grid can run in pieces on a shared machine: ``--part dropout`` writes ``..._hf_architectures_dropout.md``.
PARTS: dict[str, tuple[float, bool]] = {
    "base": (0.0, False),
    "dropout": (0.1, False),
    "checkpointing": (0.0, True),
    "dropout_checkpointing": (0.1, True),
}
#: What the measured column is: the reference the estimates are compared with.
REFERENCE = "MemTracker peak `Total` (real CPU step, live tensor bytes)"


def grid(names: list[str], quick: bool, parts: tuple[str, ...] = tuple(PARTS)) -> list[tuple[str, str, str, float, bool]]:
    """Every architecture at each variant before the next variant (a cut-short run still covers them all)."""
    out = []
    variants = [
        (dropout, ckpt, which, precision)
        for dropout, ckpt in ((PARTS["base"],) if quick else [PARTS[p] for p in parts])
        for which, precision in itertools.product((0,) if quick else (0, 1), ("32-true", "bf16-mixed"))
    ]
    for dropout, ckpt, which, precision in variants:
        for name in names:
            attentions = ARCHITECTURES[name].attentions
            if which < len(attentions):  # its first implementation, then its second where it has one
                out.append((name, precision, attentions[which], dropout, ckpt))
    return out


def render(rows: list[Row | KeptRow], failures: list[str], seconds: float, command: str = "") -> str:
    lines = [
        f"# Hugging Face architectures: config-only and traced estimates vs MemTracker ({datetime.date.today()})",
        "",
        "One steady-state CPU training step (AdamW for-loop, Lightning's order), b=2, s=128 (ViT: 64x64 "
        "images, 65 tokens), 4 blocks, width 256, V=32000, measured by `torch.distributed._tools.mem_tracker."
        "MemTracker`. Config-only: `estimate_memory(ModelSpec.from_hf_config(model.config), TrainSpec(...))`; "
        "traced: `trace_memory(model, example_input=batch)`. Targets: config-only within 3%, traced within 0.5%.",
        "",
        f"Generated by `python benchmarks/bench_hf_architectures.py{command}` in {seconds:.0f} s"
        + (f" ({kept} rows kept from the earlier run of this file, as printed then; {len(rows) - kept} measured "
           "in this run)." if (kept := sum(isinstance(r, KeptRow) for r in rows)) else "."),
        "",
        f"Reference (the `measured` column of every row): {REFERENCE}, measured by "
        "`lightning_memplan.testing.hf_architectures.measure_step`.",
        "",
        "| model | precision | attention | dropout | HF checkpointing | reference | measured (B) | config-only | "
        "source | traced |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        config_text, traced_text = ((r.config_text, r.traced_text) if isinstance(r, KeptRow)
                                    else (f"{r.config_error:+.3%}", f"{r.traced_error:+.3%}"))
        lines.append(
            f"| {r.arch} | {r.precision} | {r.attention} | {r.dropout:g} | {'yes' if r.checkpointing else 'no'} | "
            f"MemTracker | {r.measured:,} | {config_text} | {r.source} | {traced_text} |"
        )
    misses = [r for r in rows if abs(r.config_error) > CONFIG_TARGET or abs(r.traced_error) > TRACED_TARGET]
    worst_c = max((abs(r.config_error) for r in rows), default=0.0)
    worst_t = max((abs(r.traced_error) for r in rows), default=0.0)
    lines += ["", f"Rows: {len(rows)}; worst config-only error {worst_c:.2%}, worst traced error {worst_t:.2%}.", ""]
    lines += ["## Misses", ""]
    if not misses and not failures:
        lines.append("None: every row meets both targets.")
    for r in misses:
        lines.append(f"- {r.arch} {r.precision} {r.attention} dropout={r.dropout:g} ckpt={r.checkpointing}: "
                     f"config-only {r.config_error:+.2%}, traced {r.traced_error:+.2%}")
    lines += [f"- {f}" for f in failures]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few architectures, sdpa, no dropout/checkpointing")
    parser.add_argument("--arch", nargs="*", default=None, choices=sorted(ARCHITECTURES))
    parser.add_argument("--part", default=None, choices=sorted(PARTS),
                        help="one (dropout, checkpointing) variant only, written to its own results file")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows already in the results file (as printed) and measure only the others")
    parser.add_argument("--out", default=None, help="markdown path (default benchmarks/results/cpu_<date>_hf_architectures.md)")
    args = parser.parse_args(argv)
    parts = (args.part,) if args.part else tuple(PARTS)
    suffix = f"_{args.part}" if args.part else ""
    names = args.arch or (list(QUICK) if args.quick else list(ARCHITECTURES))
    start = time.time()
    rows: list[Row | KeptRow] = []
    failures: list[str] = []
    out = Path(args.out) if args.out else (
        Path(__file__).resolve().parent / "results" / f"cpu_{datetime.date.today()}_hf_architectures{suffix}.md")
    if args.resume:
        if not out.exists():
            parser.error(f"--resume: no results file {out} to resume (pass --out PATH of an earlier run)")
        rows = list(read_rows(out))
    done = {r.key for r in rows if isinstance(r, KeptRow)}
    write = not args.quick or args.out
    command = "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    from lightning_memplan.report.io import write_atomic

    specs = grid(names, args.quick, parts)
    order = {spec: i for i, spec in enumerate(specs)}
    for spec in specs:
        if spec in done:
            continue
        try:
            row = run_row(*spec)
        except Exception as exc:  # noqa: BLE001 - a benchmark reports every failure and goes on
            failures.append(f"{spec}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            print("FAILED", spec, failures[-1], flush=True)
            continue
        rows.append(row)
        rows.sort(key=lambda r: order.get(r.key, len(order)))  # grid order, whichever run measured a row
        print(f"{row.arch:10s} {row.precision:10s} {row.attention:5s} p={row.dropout:g} ckpt={row.checkpointing!s:5s} "
              f"config {row.config_error:+.2%} ({row.source}) traced {row.traced_error:+.2%}", flush=True)
        if write:  # after every row, so an interrupted run keeps what it measured
            write_atomic(out, render(rows, failures, time.time() - start, command))
    text = render(rows, failures, time.time() - start, command)
    if write:
        write_atomic(out, text)
        print(f"wrote {out}")
    print(text)
    return 0 if not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
