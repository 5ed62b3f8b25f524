"""Text renderings of a :class:`~lightning_memplan.report.records.MemoryReport`: a rich table for the
console, Markdown for ``memory_report.md`` (and loggers that take text), and unit handling.

Bytes stay integers everywhere else; only these renderers convert to a display unit.
Every string from the report (run facts, notes, warnings, component keys, incident texts) is escaped for
its medium by :mod:`~lightning_memplan.report.escape` (Markdown, rich markup, the terminal).
"""

from __future__ import annotations

import re
from typing import Any

from lightning_memplan.model.result import PHASES, shown_components
from lightning_memplan.report.checkpoints import CHECKPOINT_HEADERS, checkpoint_rows
from lightning_memplan.report.escape import (
    markdown_code,
    markdown_code_block,
    markdown_text,
    rich_text,
    terminal_text,
)
from lightning_memplan.report.margin import worst_cuda_summary
from lightning_memplan.report.records import (
    SUMMARY_RANKS,
    EpochReport,
    MemoryReport,
    RankSummary,
    representative_ranks,
)

__all__ = [
    "PHASES_CAPTION",
    "UNITS",
    "check_units",
    "epoch_markdown",
    "format_bytes",
    "late_release_lines",
    "phase_rows",
    "render_markdown",
    "render_rich",
    "report_units",
]

#: Display units and their size in bytes (GiB = 2**30, GB = 10**9; docs/concepts.md).
UNITS: dict[str, int] = {
    "B": 1,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
}


def check_units(units: Any, *, argument: str = "units") -> str:
    """Return ``units`` if it is one of :data:`UNITS`, else raise ``ValueError`` naming ``argument``."""
    if units not in UNITS:
        raise ValueError(
            f"{argument}={units!r} is not a known unit; use one of {', '.join(map(repr, UNITS))}"
        )
    return units


def report_units(report: MemoryReport, units: str = "auto") -> str:
    """The display unit for re-rendering ``report``: ``units`` itself unless it is ``"auto"``; then the unit
    the report was written with (``report.run["units"]``, the callback's ``units``), else, for a report that
    does not name one, the largest binary unit (B, KiB, MiB, GiB) in which the largest estimated or measured
    peak reads at least 1 (a MiB-scale run reads in MiB, not as rows of 0.000 GiB)."""
    if units != "auto":
        return check_units(units)
    stored = report.run.get("units")
    if isinstance(stored, str) and stored in UNITS:
        return stored
    peaks = [v for e in report.epochs for r in (*e.ranks, *(x for rs in e.phases.values() for x in rs))
             for v in (r.estimated_peak, r.measured_peak) if v]
    largest = max(peaks, default=0)
    for unit in ("GiB", "MiB", "KiB"):
        if largest >= UNITS[unit]:
            return unit
    return "B" if peaks else "GiB"


def format_bytes(value: int | None, units: str = "GiB", *, suffix: bool = True) -> str:
    """``value`` bytes in ``units`` with three decimals (``suffix`` appends the unit); ``"-"`` for ``None``."""
    if value is None:
        return "-"
    text = f"{value:,d}" if units == "B" else f"{value / UNITS[units]:.3f}"
    return f"{text} {units}" if suffix else text


def _ratio(r: RankSummary) -> str:
    return f"{r.ratio:.3f}" if r.ratio is not None else "-"


def _largest(components: dict[str, int] | None) -> str:
    if not components:
        return "-"
    return max(components, key=lambda k: components[k])


_RANK_HEADERS = (
    "rank",
    "steps",
    "b x s",
    "max s",
    "est. peak",
    "meas. peak",
    "meas/est",
    "reserved",
    "headroom",
    "largest",
)
_RICH_SHORT = {
    "rank": "rank",
    "b x s": "bxs",
    "est. peak": "est.",
    "meas. peak": "meas.",
    "meas/est": "m/e",
    "reserved": "reserved",
    "headroom": "headroom",
    "largest": "largest",
}


def _rank_row(r: RankSummary, units: str) -> list[str]:
    shape = f"{r.shapes[-1][0]}x{r.shapes[-1][1]}" if r.shapes else "-"
    return [
        str(r.rank),
        str(r.steps),
        shape,
        str(r.max_seq_len) if r.max_seq_len is not None else "-",
        format_bytes(r.estimated_peak, units, suffix=False),
        format_bytes(r.measured_peak, units, suffix=False),
        _ratio(r),
        format_bytes(r.reserved, units, suffix=False),
        format_bytes(r.headroom, units, suffix=False),
        _largest(r.measured_components or r.estimated_components),
    ]


#: Headers of the evaluation steps' table: the phase, then a rank row.
_PHASE_HEADERS = ("phase", *_RANK_HEADERS)
#: Caption of that table in every medium.
PHASES_CAPTION = "Validation, test and predict steps (no-grad forward)"
#: Caption of the checkpoint-save table (Markdown, terminal, HTML).
CHECKPOINTS_CAPTION = "Checkpoint saves (state dict built and written)"


#: Ranks given columns (two each) in the components table; the rank tables list :data:`SUMMARY_RANKS`.
COMPONENT_RANKS = 8


def table_ranks(epoch: EpochReport) -> tuple[RankSummary, ...]:
    """The rows of an epoch's rank table: every rank, or of a large run :data:`SUMMARY_RANKS` of them
    (:func:`~lightning_memplan.report.records.representative_ranks`)."""
    return representative_ranks(epoch.ranks, SUMMARY_RANKS)


def component_ranks(epoch: EpochReport) -> tuple[RankSummary, ...]:
    """The ranks of the components table (:data:`COMPONENT_RANKS` of a large run)."""
    return representative_ranks(epoch.ranks, COMPONENT_RANKS)


def shown_note(epoch: EpochReport) -> str:
    """What a table of a large run leaves out (``""`` when it lists every rank)."""
    n = len(epoch.ranks)
    if n <= SUMMARY_RANKS:
        return ""
    return (f"{SUMMARY_RANKS} of {n:,d} ranks listed (rank 0, the smallest headroom and the largest peaks; components "
            f"for {COMPONENT_RANKS}); the across-ranks line counts every rank")


def phase_rows(epoch: EpochReport, units: str) -> list[list[str]]:
    """One row per evaluation phase and rank (:attr:`EpochReport.phases`), columns :data:`_PHASE_HEADERS`."""
    return [[phase, *_rank_row(r, units)] for phase, ranks in epoch.phases.items()
            for r in representative_ranks(ranks, SUMMARY_RANKS)]


def _component_rows(epoch: EpochReport, units: str) -> list[list[str]]:
    shown = component_ranks(epoch)
    rows = []
    names = shown_components(*(c for r in epoch.ranks for c in (r.estimated_components, r.measured_components)))
    for name in names:
        row = [name]
        for r in shown:
            row.append(format_bytes((r.estimated_components or {}).get(name), units, suffix=False))
            row.append(format_bytes((r.measured_components or {}).get(name), units, suffix=False))
        rows.append(row)
    for phase in PHASES:
        row = [f"peak in {phase}"]
        for r in shown:
            row.append(format_bytes((r.estimated_phase_peaks or {}).get(phase), units, suffix=False))
            row.append(format_bytes((r.measured_phase_peaks or {}).get(phase), units, suffix=False))
        rows.append(row)
    if any(r.estimated_host for r in shown):  # DeepSpeed offload: host memory beside device memory
        row = ["host memory, offload"]
        for r in shown:
            row += [format_bytes(r.estimated_host, units, suffix=False), "-"]  # the tracker measures the device
        rows.append(row)
    return rows


def _across_line(epoch: EpochReport, units: str) -> str:
    parts = []
    for name in ("estimated_peak", "measured_peak", "headroom"):
        spread = epoch.spread(name)
        if spread is not None:
            parts.append(
                f"{name}: min {format_bytes(spread.min, units)}, max {format_bytes(spread.max, units)}, "
                f"imbalance {spread.imbalance:.1%}"
            )
    return "; ".join(parts)


def margin_line(epoch: EpochReport, units: str) -> str:
    """``"reserved - allocated: 1.250 GiB (rank 1, 8.3% of its allocated peak)"``: the CUDA caching
    allocator's measured margin at the epoch's worst rank (``report.margin``); ``""`` without CUDA ranks."""
    worst = worst_cuda_summary(epoch.ranks)
    if worst is None or worst.reserved is None or worst.measured_peak is None:
        return ""
    overhead = max(0, worst.reserved - worst.measured_peak)
    return (f"reserved - allocated: {format_bytes(overhead, units)} (rank {worst.rank}, "
            f"{overhead / worst.measured_peak:.1%} of its allocated peak)")


def late_release_lines(epoch: EpochReport) -> list[str]:
    """One line per rank (of the rank table) whose measured peak holds buffers released late:
    ``"rank 1: 262,144 B of the measured peak were collective buffers gloo's thread released late"``
    (:attr:`~lightning_memplan.report.records.RankSummary.released_late`, the part of a peak that varies
    between identical runs); ``[]`` when no rank has any."""
    return [f"rank {r.rank}: {r.released_late:,d} B of the measured peak were collective buffers gloo's thread "
            "released late (freed after the step let them go; this part varies between identical runs)"
            for r in table_ranks(epoch) if r.released_late]


def render_rich(report: MemoryReport, *, epoch: int | None = None, units: str = "GiB") -> Any:
    """A ``rich`` renderable (a group of two tables) for one epoch (the latest by default)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    chosen = _pick_epoch(report, epoch)
    if chosen is None:
        return Text("memory report: no finished epoch yet")
    source = rich_text(report.run.get("estimate_source", "no"), newlines=False)
    ranks = Table(title=f"Memory report, {chosen.label}, {units} ({source} estimate)")
    keep = [i for i, h in enumerate(_RANK_HEADERS) if h in _RICH_SHORT]  # fit an 80-column console
    for i in keep:
        header = _RANK_HEADERS[i]
        ranks.add_column(_RICH_SHORT[header], justify="left" if header in ("largest", "b x s") else "right")
    for r in table_ranks(chosen):
        row = _rank_row(r, units)
        ranks.add_row(*(rich_text(row[i], newlines=False) for i in keep))
    comps = Table(title=f"Components at the peak, {units} (estimated / measured by the tensor tracker)")
    comps.add_column("component")
    for r in component_ranks(chosen):
        comps.add_column(f"rank {r.rank} est.", justify="right")
        comps.add_column(f"rank {r.rank} meas.", justify="right")
    for row in _component_rows(chosen, units):
        comps.add_row(*(rich_text(c, newlines=False) for c in row))
    parts: list[Any] = [ranks, comps]
    if shown_note(chosen):
        parts.append(Text(shown_note(chosen)))
    if chosen.phases:
        evals = Table(title=f"{PHASES_CAPTION}, {units}")
        for i in [0, *(k + 1 for k in keep)]:
            header = _PHASE_HEADERS[i]
            evals.add_column(_RICH_SHORT.get(header, header), justify="left" if header in ("phase", "largest", "b x s") else "right")
        for row in phase_rows(chosen, units):
            evals.add_row(*(rich_text(row[i], newlines=False) for i in [0, *(k + 1 for k in keep)]))
        parts.append(evals)
    if chosen.checkpoints:
        saves = Table(title=f"{CHECKPOINTS_CAPTION}, {units}")
        for header in CHECKPOINT_HEADERS:
            saves.add_column(header, justify="left" if header in ("save", "mode", "measured by") else "right")
        for row in checkpoint_rows(chosen.checkpoints, lambda v: format_bytes(v, units, suffix=False)):
            saves.add_row(*(rich_text(c, newlines=False) for c in row))
        parts.append(saves)
    across = _across_line(chosen, units)
    if across:
        parts.append(Text("across ranks: " + across))
    margin = margin_line(chosen, units)
    if margin:
        parts.append(Text(margin))
    parts += [Text(line) for line in late_release_lines(chosen)]
    for warning in chosen.warnings:  # Text is not markup: only the terminal's controls need escaping
        parts.append(Text("warning: " + terminal_text(warning), style="yellow"))
    return Group(*parts)


def _pick_epoch(report: MemoryReport, epoch: int | None) -> EpochReport | None:
    if epoch is None:
        return report.latest
    for e in reversed(report.epochs):  # the latest run holding that epoch number
        if e.epoch == epoch:
            return e
    known = sorted({e.epoch for e in report.epochs})
    raise ValueError(f"epoch={epoch!r} is not in the report; it holds epochs {known}")


#: A table cell made only of figures (``1.234``, ``2x512``, ``-``) needs no Markdown escaping.
_FIGURES = re.compile(r"^[0-9.,x -]*$")


def _md_cell(text: str) -> str:
    return text if _FIGURES.match(text) else markdown_text(text)


def _md_table(headers: list[str] | tuple[str, ...], rows: list[list[str]]) -> str:
    """A Markdown table; ``headers`` are this module's own words, every cell is escaped (:func:`_md_cell`)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(map(_md_cell, row)) + " |" for row in rows]
    return "\n".join(lines)


def epoch_markdown(epoch: EpochReport, units: str = "GiB") -> str:
    """Markdown section for one epoch: ranks table, component table, spread, warnings."""
    out = [
        f"## {epoch.label.capitalize()}",
        "",
        f"Sizes in {units}.",
        "",
        _md_table(_RANK_HEADERS, [_rank_row(r, units) for r in table_ranks(epoch)]),
        "",
    ]
    if shown_note(epoch):
        out += [shown_note(epoch) + ".", ""]
    headers = ["component"]
    for r in component_ranks(epoch):
        headers += [f"rank {r.rank} est.", f"rank {r.rank} meas."]
    out += [_md_table(headers, _component_rows(epoch, units)), ""]
    if epoch.phases:
        out += [f"{PHASES_CAPTION}:", "", _md_table(list(_PHASE_HEADERS), phase_rows(epoch, units)), ""]
    if epoch.checkpoints:
        rows = checkpoint_rows(epoch.checkpoints, lambda v: format_bytes(v, units, suffix=False))
        out += [f"{CHECKPOINTS_CAPTION}, {units}:", "", _md_table(list(CHECKPOINT_HEADERS), rows), ""]
    across = _across_line(epoch, units)
    if across:
        out += [f"Across ranks: {across}", ""]
    margin = margin_line(epoch, units)
    if margin:  # what MemoryPlanCallback.reserved_margin hands to MemoryPlanBatchSizeFinder(reserved_margin=)
        out += [f"CUDA caching allocator, {margin}", ""]
    late = late_release_lines(epoch)
    if late:
        out += [*(f"- {line}" for line in late), ""]
    for warning in epoch.warnings:
        out.append(f"- **warning:** {markdown_text(warning)}")
    if epoch.warnings:
        out.append("")
    return "\n".join(out)


def render_markdown(report: MemoryReport, *, units: str = "GiB") -> str:
    """The whole report as Markdown (what ``memory_report.md`` holds)."""
    out = ["# Memory report", ""]
    run = report.run
    for key in ("estimate_source", "accelerator", "world_size", "precision", "plan_description", "model"):
        if key in run:
            out.append(f"- **{key}:** {markdown_text(run[key])}")
    for note in report.notes:
        out.append(f"- **note:** {markdown_text(note)}")
    out.append("")
    for epoch in report.epochs:
        out.append(epoch_markdown(epoch, units))
    for inc in report.incidents:
        out += [
            f"## Incident on rank {inc.rank}, epoch {inc.epoch}, step {inc.step}: {markdown_text(inc.kind)}",
            "",
            markdown_code(inc.error),
            "",
        ]
        rec = inc.step_record
        if rec is not None:
            out.append(
                f"- batch {rec.micro_batch} x {rec.seq_len}: estimated peak "
                f"{format_bytes(rec.estimated_peak, units)}, measured so far {format_bytes(rec.measured_peak, units)}"
            )
        for key, value in inc.allocator.items():
            if key != "summary":
                out.append(f"- {markdown_text(key)}: {markdown_text(value)}")
        if "summary" in inc.allocator:
            out += ["", markdown_code_block(inc.allocator["summary"])]
        out.append("")
    return "\n".join(out).rstrip() + "\n"
