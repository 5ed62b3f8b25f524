"""The report chart: one stacked bar per rank and kind (estimated, measured), one colour per component.

Needs matplotlib (the ``plot`` extra); :func:`matplotlib_available` says whether it is installed, and
:func:`render_png` is only called when it is. Drawn with the non-interactive Agg backend so it works on
headless training nodes.
"""

from __future__ import annotations

import importlib.util
import os

from lightning_memplan.model.result import COMPONENTS
from lightning_memplan.report.records import EpochReport, MemoryReport
from lightning_memplan.report.render import UNITS

__all__ = ["matplotlib_available", "render_png"]


def matplotlib_available() -> bool:
    """Whether matplotlib can be imported (the chart is skipped, and said so, when it cannot)."""
    return importlib.util.find_spec("matplotlib") is not None


def _bars(epoch: EpochReport) -> list[tuple[str, dict[str, int], int | None]]:
    """``(label, components, total_if_no_breakdown)`` per bar: estimated then measured for each rank.

    A measurement without a component breakdown (CUDA allocator peak, no tracker) is drawn as one grey
    segment of its total so it still stands next to the estimate.
    """
    bars: list[tuple[str, dict[str, int], int | None]] = []
    for r in epoch.ranks:
        bars.append((f"r{r.rank}\nest.", dict(r.estimated_components or {}), None))
        if r.measured_components:
            bars.append((f"r{r.rank}\nmeas.", dict(r.measured_components), None))
        else:
            bars.append((f"r{r.rank}\nmeas.", {}, r.measured_peak))
    return bars


def render_png(report: MemoryReport, path: str | os.PathLike[str], *, units: str = "GiB") -> None:
    """Draw the latest epoch of ``report`` to ``path`` (PNG), written atomically (temp file + replace)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    epoch = report.latest
    if epoch is None:
        raise ValueError("report has no finished epoch to draw; render_png needs at least one epoch")
    scale = UNITS[units]
    bars = _bars(epoch)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(bars) + 2.5), 4.5))
    try:
        cmap = plt.get_cmap("tab10")
        xs = range(len(bars))
        bottoms = [0.0] * len(bars)
        for ci, comp in enumerate(COMPONENTS):
            heights = [b[1].get(comp, 0) / scale for b in bars]
            if any(heights):
                ax.bar(xs, heights, bottom=bottoms, color=cmap(ci % 10), label=comp, width=0.7)
                bottoms = [lo + h for lo, h in zip(bottoms, heights, strict=True)]
        totals_only = [(b[2] or 0) / scale for b in bars]
        if any(totals_only):
            ax.bar(xs, totals_only, bottom=bottoms, color="0.6", label="measured (no breakdown)", width=0.7)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([b[0] for b in bars])
        ax.set_ylabel(f"bytes at the peak ({units})")
        ax.set_title(f"Memory per rank, epoch {epoch.epoch}: estimated vs measured")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
