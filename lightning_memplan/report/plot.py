"""The report chart for loggers (``memory_report.png``): the same pictures as the HTML page, drawn by
matplotlib from the same data (:mod:`~lightning_memplan.report.views`), one figure of three panels:

1. the step timeline of the largest tracked steady-state step (rank 0, latest epoch that has one):
   measured live bytes by component (stacked area), the estimate's per-phase peaks as steps, the
   measured peak marked, the capacity / budget line when it is on the scale;
2. across the run: every rank's measured peak per step over all epochs, rank 0's estimate and reserved
   bytes, the epoch starts, sequence-length changes, warnings and incidents;
3. across ranks: every rank's components at its peak in the latest epoch, estimated next to measured,
   pipeline stages labelled and the imbalance in the title.

matplotlib is a dependency of the main install (the main job promises this picture);
:func:`matplotlib_available` stays for environments that removed it. Drawn with the non-interactive
Agg backend so it works on headless training nodes.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from lightning_memplan.files import atomic_file
from lightning_memplan.model.result import COMPONENTS
from lightning_memplan.report.escape import terminal_text
from lightning_memplan.report.records import MemoryReport
from lightning_memplan.report.render import UNITS
from lightning_memplan.report.views import (
    COMPONENT_COLORS,
    TimelineView,
    chart_ranks,
    rank_view,
    report_ranks,
    run_view,
    timeline_record,
    timeline_view,
)

__all__ = ["matplotlib_available", "png_bytes", "render_png"]

#: The capacity line is drawn only when it is at most this factor above the panel's data.
_CAPACITY_SCALE_LIMIT = 3.0


def matplotlib_available() -> bool:
    """Whether matplotlib can be imported (the chart is skipped, and said so, when it cannot)."""
    return importlib.util.find_spec("matplotlib") is not None


def _auto_unit(largest: float) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        if largest >= UNITS[unit]:
            return unit
    return "B"


def _timeline_for(report: MemoryReport) -> TimelineView | None:
    for epoch in reversed(report.epochs):
        summary = next((r for r in epoch.ranks if r.rank == 0), epoch.ranks[0] if epoch.ranks else None)
        rec = timeline_record(summary) if summary is not None else None
        if rec is not None:
            return timeline_view(rec)
    for inc in report.incidents:  # a run that failed before its first epoch ended
        if inc.step_record is not None and inc.step_record.timeline is not None:
            return timeline_view(inc.step_record)
    return None


def _draw_timeline(ax: Any, view: TimelineView | None) -> None:
    if view is None:
        ax.text(0.5, 0.5, "no tracked step with a timeline", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    totals = [sum(v[i] for v in view.stacks.values()) for i in range(len(view.ops))]
    top = max([*totals, view.estimated_peak or 0, *(sum(b[3].values()) for b in view.estimate), 1])
    cap = view.capacity if view.capacity and view.capacity <= top * _CAPACITY_SCALE_LIMIT else None
    unit = _auto_unit(max(top, cap or 0))
    scale = UNITS[unit]
    comps = [c for c in COMPONENTS if c in view.stacks]
    if comps:  # a tracked step whose storages were all outside the tracked device has no stack
        ax.stackplot(view.ops, *[[v / scale for v in view.stacks[c]] for c in comps],
                     colors=[COMPONENT_COLORS[c] for c in comps], labels=comps, alpha=0.85)
    xs: list[float] = []
    ys: list[float] = []
    for _phase, a, b, block in view.estimate:
        total = sum(block.values()) / scale
        xs += [a, b]
        ys += [total, total]
    if xs:
        ax.plot(xs, ys, color="#1f4e9c", lw=2, ls="--", label="estimated (per-phase peak)")
    for phase, a, b in view.spans:
        ax.axvline(a, color="0.6", lw=0.8, ls=":")
        ax.text((a + b) / 2, 0.98, phase, transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=8, color="0.35")
    if view.peak is not None:
        ax.plot([view.peak[0]], [view.peak[1] / scale], "o", color="#e8590c", mec="k", zorder=5)
        ax.annotate(f"measured peak {view.peak[1] / scale:.3g} {unit}", (view.peak[0], view.peak[1] / scale),
                    xytext=(8, 4), textcoords="offset points", fontsize=8, weight="bold")
    if cap:
        ax.axhline(cap / scale, color="#c92a2a", ls="-.", lw=1.2, label=f"capacity / budget {cap / scale:.3g} {unit}")
    rec = view.record
    ax.set_title(f"Step timeline: step {rec.step}, rank {rec.rank}, epoch {rec.epoch} (measured vs estimated)", fontsize=10)
    ax.set_xlabel("operator calls in the step")
    ax.set_ylabel(f"live bytes ({unit})")
    ax.set_ylim(0, max(top, cap or 0) / scale * 1.12)
    _few_ticks(ax)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _few_ticks(ax: Any, *, y: bool = True) -> None:
    """At most about five labelled ticks per axis: each label is a text matplotlib lays out and rasterises
    (about 1.5 ms each on one loaded CPU core, most of a drawing's cost), and five read as well as ten."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
    if y:
        ax.yaxis.set_major_locator(MaxNLocator(nbins=5))


def _draw_run(ax: Any, report: MemoryReport) -> None:
    views = [run_view(report, r) for r in chart_ranks(report)]
    values = [v for view in views for s in (view.estimated, view.measured, view.reserved) for v in s if v]
    if not values:
        ax.text(0.5, 0.5, "no per-step figures", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    unit = _auto_unit(max(values))
    scale = UNITS[unit]
    first = views[0]
    for view in views:
        pts = [(s, v / scale) for s, v in zip(view.steps, view.measured, strict=True) if v]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=".", lw=1.5, label=f"measured peak, rank {view.rank}")
    for name, series, style in (("estimated peak", first.estimated, dict(color="#1f4e9c", ls="--")),
                                ("reserved", first.reserved, dict(color="0.55", ls=":"))):
        pts = [(s, v / scale) for s, v in zip(first.steps, series, strict=True) if v]
        if pts:
            ax.plot(*zip(*pts, strict=True), lw=1.5, marker=".", label=f"{name}, rank {first.rank}", **style)
    if max(values) / max(min(values), 1) > 4:
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, NullLocator

        ax.set_yscale("log")  # reserved (RSS on CPU) far above the tensor peaks
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=6))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_minor_locator(NullLocator())  # no unlabelled minor ticks: each is two lines and two texts
    for step, epoch in first.epoch_starts:
        ax.axvline(step, color="0.7", lw=0.8, ls=":")
        ax.text(step, 0.98, f" epoch {epoch}", transform=ax.get_xaxis_transform(), fontsize=8, va="top", color="0.4")
    for step, seq in first.seq_changes:
        ax.annotate(f"s={seq}", (step, 0.02), xycoords=("data", "axes fraction"), fontsize=8, color="#5c940d",
                    xytext=(3, 0), textcoords="offset points")
        ax.axvline(step, color="#5c940d", lw=0.8, ls="--")
    warned = {step for view in views for step, _ in view.warnings}
    for step in warned:
        ax.plot([step], [0.9], marker="D", color="#f59f00", transform=ax.get_xaxis_transform(), ms=7, ls="none")
    for view in views:
        for step, text in view.incidents:
            ax.plot([step], [0.8], marker="X", color="#c92a2a", transform=ax.get_xaxis_transform(), ms=10, ls="none")
            ax.text(step, 0.72, ("OOM" if text.startswith("oom") else "error") + f" r{view.rank}",
                    transform=ax.get_xaxis_transform(), color="#c92a2a", fontsize=8, ha="center", weight="bold")
    ax.set_title("Across the run: per-step peaks over all epochs (diamond: warning, X: incident)", fontsize=10)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"bytes ({unit})")
    _few_ticks(ax, y=ax.get_yscale() != "log")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _draw_ranks(ax: Any, report: MemoryReport, listed: frozenset[str] = frozenset()) -> None:
    """Every rank's components at its peak; the legend names only what ``listed`` (the components the
    timeline's legend already names, in the same colours) does not."""
    from matplotlib.ticker import MaxNLocator

    epoch = report.latest
    if epoch is None:
        ax.set_axis_off()
        return
    bars, spread = rank_view(epoch, report.run)
    hi = max([sum(b.estimated.values()) for b in bars] + [sum(b.measured.values()) or (b.measured_total or 0) for b in bars] + [1])
    unit = _auto_unit(hi)
    scale = UNITS[unit]
    used: set[str] = set()
    for i, bar in enumerate(bars):
        for offset, comps in ((-0.2, bar.estimated), (0.2, bar.measured)):
            bottom = 0.0
            for comp in COMPONENTS:
                v = comps.get(comp, 0) / scale
                if v:
                    ax.bar(i + offset, v, bottom=bottom, width=0.36, color=COMPONENT_COLORS[comp],
                           label=comp if comp not in used and comp not in listed else None)
                    used.add(comp)
                    bottom += v
            if comps is bar.measured and not comps and bar.measured_total:
                ax.bar(i + offset, bar.measured_total / scale, width=0.36, color="0.65",
                       label="measured (no breakdown)" if "none" not in used else None)
                used.add("none")
    ax.set_xticks([x for i in range(len(bars)) for x in (i - 0.2, i + 0.2)])
    ax.set_xticklabels([lab for b in bars for lab in (
        f"est.\nr{b.rank}" + (f" s{b.stage}" if b.stage is not None else ""),
        f"meas.\nr{b.rank}" + (f" s{b.stage}" if b.stage is not None else ""))], fontsize=8)
    imbalance = f"; imbalance (max/mean - 1) {spread.imbalance:.1%}" if spread is not None and len(bars) > 1 else ""
    stages = " (sN: pipeline stage)" if any(b.stage is not None for b in bars) else ""
    colours = " (colours as in the timeline)" if listed else ""
    ax.set_title(f"Across ranks, epoch {epoch.epoch}: components at the peak{colours}{stages}{imbalance}", fontsize=10)
    ax.set_ylabel(f"bytes at the peak ({unit})")
    ax.yaxis.set_major_locator(MaxNLocator(nbins=5))
    if used - listed:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def render_png(report: MemoryReport, path: str | os.PathLike[str], *, units: str = "GiB", argument: str = "path") -> None:
    """Draw ``report`` (every epoch; see the module docstring) to ``path`` (PNG), written atomically
    (:func:`~lightning_memplan.files.atomic_file`; ``argument`` names ``path`` in a refusal). ``units`` is
    accepted for symmetry with the text renderers; each panel picks the binary unit its numbers read best in.
    Text from the report (a model's class name, phase names) is drawn as it is: mathtext and TeX are off
    (``text.parse_math``/``text.usetex``), so a name like ``Net$\\undefinedmacro$`` is text, not a formula."""
    from lightning_memplan.files import check_output_target

    check_output_target(path, argument=argument)  # refused before anything is drawn
    data = png_bytes(report, units=units)
    with atomic_file(path, argument=argument) as fh:
        fh.write(data)


def png_bytes(report: MemoryReport, *, units: str = "GiB") -> bytes:
    """:func:`render_png`'s picture as PNG bytes (for standard output). Drawn on a
    ``matplotlib.figure.Figure`` with its own Agg canvas, never through pyplot's global figure manager, so the
    report writer may draw on a thread of its own (monitoring/writer.py; matplotlib's "Embedding in a web
    application server" guide)."""
    import io

    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if report.latest is None and not report.incidents:
        raise ValueError("report has no finished epoch to draw; render_png needs at least one epoch")
    with matplotlib.rc_context({"text.parse_math": False, "text.usetex": False}):
        fig = Figure(figsize=(11, 12))
        FigureCanvasAgg(fig)
        axes = fig.subplots(3, 1)
        # fixed margins, the legends in the right fifth: matplotlib's constrained layout measures every text
        # first, which took 40 % of the drawing (0.25 of 0.65 s, one CPU core)
        fig.subplots_adjust(left=0.07, right=0.78, top=0.95, bottom=0.05, hspace=0.3)
        model = terminal_text(report.run.get("model", ""), newlines=False)
        n_epochs, n_ranks = len(report.epochs), len(report_ranks(report))
        fig.suptitle(f"Memory report{f': {model}' if model else ''} ({n_epochs} epoch{'s' if n_epochs != 1 else ''}, "
                     f"{n_ranks} rank{'s' if n_ranks != 1 else ''})", fontsize=12, weight="bold")
        view = _timeline_for(report)
        _draw_timeline(axes[0], view)
        _draw_run(axes[1], report)
        _draw_ranks(axes[2], report, frozenset(c for c in COMPONENTS if view is not None and c in view.stacks))
        out = io.BytesIO()
        fig.savefig(out, format="png", dpi=80)
        return out.getvalue()
