"""Config-only and traced estimates against a real CPU training step, for real Hugging Face architectures.

For every architecture in :data:`lightning_memplan.testing.hf_architectures.ARCHITECTURES` (GPT-2,
Llama, Mistral, Qwen2, Qwen3, Gemma-2 with softcaps, OLMo-2, Phi-3, GPT-NeoX, Mixtral, Qwen2-MoE, BERT
MLM, T5, ViT; 4 blocks, width 256, V=32000) x precision {32-true, bf16-mixed} x attention {sdpa, eager}
x dropout {0, 0.1} x {without, with HF ``gradient_checkpointing_enable()``}: one steady-state CPU step
(AdamW, Lightning's order) is measured by PyTorch's ``MemTracker`` and compared with

- the config-only estimate ``estimate_memory(ModelSpec.from_hf_config(model.config), TrainSpec(...))``
  (``source`` says which path it took: ``hf_trace`` with transformers installed): target within 3%;
- the traced estimate ``trace_memory(model, example_input=batch)`` (fake tensors): target within 0.5%.

Shapes and layer mixes (``--shapes``, issue 25): the families of
:data:`~lightning_memplan.testing.hf_architectures.SHAPE_ARCHITECTURES` (DeepSeek-V3 with MLA and
``first_k_dense_replace``, Llama-4 Scout and Maverick layouts, Gemma-3 sliding/global, GPT-OSS sinks and
sliding/full alternation, Jamba, Mamba, Mamba2; width 64, 4 blocks, V=2048, fp32, sdpa where the class has
it) at b in {1, 2, 4} and s in {64, 128, 512, 2048} (and b=1, s=8192 for Gemma-3 and Mamba2; Mamba and
Jamba at (1, 64), (2, 128), (4, 128) only: their real CPU step scans token by token), written to
``benchmarks/results/hf_architectures_shapes.md``. Each row says which path the config-only estimate took:
``fit`` (the coefficients fitted at (1, 64), (2, 128) [+ (2, 64) where attention is quadratic] and checked
at the held-out (1, 256)) or ``traced at s`` (the fit was not trusted there, so the copies were traced at
(1, s) and (2, s)); every other shape is held out of what the estimate was fitted on.

Run: ``python benchmarks/bench_hf_architectures.py [--quick] [--shapes] [--arch NAME ...] [--part NAME] [--resume]
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
    SHAPE_ARCHITECTURES,
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


#: ``{family: [(b, s), ...]}`` of ``--shapes``. Mamba and Jamba run transformers' sequential per-token scan
#: on the CPU (no mamba-ssm kernels), ~0.3-0.6 s per token of a real step on 2 shared cores: b in {1, 2, 4}
#: up to s=512, and s=2048 at b=1 (their rows are in results/hf_architectures_shapes_ssm.md, run with
#: ``--shapes --arch mamba jamba --out benchmarks/results/hf_architectures_shapes_ssm.md``).
SHAPE_GRID: dict[str, list[tuple[int, int]]] = {
    **{name: [(b, s) for s in (64, 128, 512, 2048) for b in (1, 2, 4)]
       for name in ("deepseek_v3", "llama4_scout", "llama4_maverick", "gemma3", "gpt_oss", "mamba2")},
    **{name: [(b, s) for s in (64, 128, 512) for b in (1, 2, 4)] + [(1, 2048)] for name in ("mamba", "jamba")},
}
for _name in ("gemma3", "mamba2"):
    SHAPE_GRID[_name] += [(1, 8192)]


@dataclass(frozen=True)
class ShapeRow:
    """One (family, b, s) of ``--shapes``: the measured peak, the config-only answer (or its refusal)
    and which path it took, and the traced estimate."""

    arch: str
    micro_batch: int
    seq_len: int
    measured: int
    config_only: int | None
    path: str
    traced: int

    @property
    def config_error(self) -> float | None:
        return None if self.config_only is None else self.config_only / self.measured - 1

    @property
    def traced_error(self) -> float:
        return self.traced / self.measured - 1


def config_only_path(spec: ModelSpec, train: TrainSpec) -> str:
    """``"fit"`` or ``"traced at s"``: what the config-only estimate of ``spec`` at ``train`` was made from."""
    from lightning_memplan.model.traced import traced_train

    source = spec.calibration_source
    data = source.depth_traces(spec, traced_train(train, "cpu")) if source is not None else None
    if data is None:
        return "analytic"
    if data.form is not None and data.form.get("seq_len") is not None:
        return "traced at s"
    return "fit" if (train.micro_batch, train.seq_len) not in {tuple(x) for x in (data.form or {}).get("fitted", ())} \
        else "fit (fitted shape)"


def run_shape_row(name: str, micro_batch: int, seq_len: int) -> ShapeRow:
    """Measure one (family, b, s) of ``--shapes`` (fp32, the family's first attention) and estimate it."""
    arch = SHAPE_ARCHITECTURES[name]
    attention = arch.attentions[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_model(arch, dropout=0.0, attention=attention, checkpointing=False)
        batch = example_batch(model, micro_batch, seq_len)
        train = TrainSpec(micro_batch=micro_batch, seq_len=seq_len, precision="32-true", attention=attention,
                          optimizer_impl="for_loop", device="cpu")
        config_only: int | None
        try:
            spec = ModelSpec.from_hf_config(model.config)
            config_only = estimate_memory(spec, train).total
            path = config_only_path(spec, train)
        except ValueError as exc:  # a refusal: the row shows it
            config_only, path = None, f"refused: {str(exc).splitlines()[0][:160]}"
        traced = trace_memory(model, example_input=batch, loss_fn=loss_of, precision="32-true", seq_len=seq_len)
        measured = measure_step(model, batch, precision="32-true")
    return ShapeRow(name, micro_batch, seq_len, measured, config_only, path, traced.total)


def render_shapes(rows: list[ShapeRow], failures: list[str], seconds: float, command: str) -> str:
    lines = [
        "# Shapes and layer mixes: config-only and traced estimates vs MemTracker (issue 25)",
        "",
        "One steady-state CPU training step (fp32, AdamW for-loop, Lightning's order), 4 blocks, width 64, "
        "V=2048, measured by `torch.distributed._tools.mem_tracker.MemTracker` "
        "(`lightning_memplan.testing.hf_architectures.measure_step`). Config-only: "
        "`estimate_memory(ModelSpec.from_hf_config(model.config), TrainSpec(b, s, ...))`; traced: "
        "`trace_memory(model, example_input=batch)`. Targets: config-only within 3%, traced within 0.5%.",
        "",
        "Fitted shapes: the config-only fit is made at (b, s) = (1, 64) and (2, 128) (and (2, 64) where "
        "attention keeps [s, s] scores) and checked at the held-out (1, 256); rows marked `fit (fitted shape)` "
        "are those shapes, every other `fit` row is held out. `traced at s`: the fit was not trusted at that s "
        "(probe disagreed, a window/chunk step beyond the traced lengths, or a b*s^2 fit past its traced "
        "lengths), so the copies were traced at (1, s) and (2, s) (b=4 is then held out).",
        "",
        f"Generated by `python benchmarks/bench_hf_architectures.py{command}` in {seconds:.0f} s.",
        "",
        "| family | b | s | measured (B) | config-only | path | traced |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cfg = "refused" if r.config_error is None else f"{r.config_error:+.3%}"
        lines.append(f"| {r.arch} | {r.micro_batch} | {r.seq_len} | {r.measured:,} | {cfg} | {r.path} | "
                     f"{r.traced_error:+.3%} |")
    lines += ["", "## Worst error per family", "", "| family | rows | worst config-only | worst traced | refusals |",
              "|---|---|---|---|---|"]
    for name in dict.fromkeys(r.arch for r in rows):
        mine = [r for r in rows if r.arch == name]
        errs = [abs(r.config_error) for r in mine if r.config_error is not None]
        lines.append(f"| {name} | {len(mine)} | {max(errs):.2%} |" if errs else f"| {name} | {len(mine)} | - |")
        lines[-1] += f" {max(abs(r.traced_error) for r in mine):.2%} | {sum(r.config_error is None for r in mine)} |"
    misses = [r for r in rows if (r.config_error is not None and abs(r.config_error) > CONFIG_TARGET)
              or abs(r.traced_error) > TRACED_TARGET]
    lines += ["", "## Misses and refusals", ""]
    if not misses and not failures and all(r.config_error is not None for r in rows):
        lines.append("None: every row meets both targets.")
    for r in misses:
        lines.append(f"- {r.arch} b={r.micro_batch} s={r.seq_len}: config-only "
                     f"{'refused' if r.config_error is None else f'{r.config_error:+.2%}'}, traced {r.traced_error:+.2%}")
    refusals = {r.path for r in rows if r.config_error is None}
    lines += [f"- refusal: {p}" for p in sorted(refusals)]
    lines += [f"- {f}" for f in failures]
    return "\n".join(lines) + "\n"


def main_shapes(names: list[str], out: Path, command: str) -> int:
    from lightning_memplan.report.io import write_atomic

    start = time.time()
    rows: list[ShapeRow] = []
    failures: list[str] = []
    for name in names:
        for b, s in SHAPE_GRID[name]:
            try:
                row = run_shape_row(name, b, s)
            except Exception as exc:  # noqa: BLE001 - a benchmark reports every failure and goes on
                failures.append(f"{name} b={b} s={s}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                print("FAILED", failures[-1], flush=True)
                continue
            rows.append(row)
            cfg = "refused" if row.config_error is None else f"{row.config_error:+.2%}"
            print(f"{name:16s} b={b} s={s:5d} config {cfg} ({row.path}) traced {row.traced_error:+.2%} "
                  f"[{time.time() - start:.0f} s]", flush=True)
            write_atomic(out, render_shapes(rows, failures, time.time() - start, command))
    text = render_shapes(rows, failures, time.time() - start, command)
    write_atomic(out, text)
    print(text)
    return 0 if not failures else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few architectures, sdpa, no dropout/checkpointing")
    parser.add_argument("--shapes", action="store_true",
                        help="issue 25's families at b in {1, 2, 4} and s in {64, 128, 512, 2048} (8192 for two)")
    parser.add_argument("--arch", nargs="*", default=None, choices=sorted({*ARCHITECTURES, *SHAPE_ARCHITECTURES}))
    parser.add_argument("--part", default=None, choices=sorted(PARTS),
                        help="one (dropout, checkpointing) variant only, written to its own results file")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows already in the results file (as printed) and measure only the others")
    parser.add_argument("--out", default=None, help="markdown path (default benchmarks/results/cpu_<date>_hf_architectures.md)")
    args = parser.parse_args(argv)
    if args.shapes:
        out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / "hf_architectures_shapes.md"
        shape_names = args.arch or list(SHAPE_ARCHITECTURES)
        return main_shapes(shape_names, out, "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])))
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
