"""The memory report: data model, renderers (rich, Markdown, PNG), atomic JSON persistence, and the
end-of-epoch gather across ranks. Written by :class:`~lightning_memplan.callbacks.MemoryPlanCallback`,
rendered again by ``lightning-memplan report PATH``."""

from lightning_memplan.report.gather import gather_objects, gather_summaries
from lightning_memplan.report.io import REPORT_BASENAME, WrittenFiles, load_report, report_paths, write_report
from lightning_memplan.report.plot import matplotlib_available, render_png
from lightning_memplan.report.records import (
    EpochReport,
    Incident,
    MemoryReport,
    RankAccumulator,
    RankSummary,
    Spread,
    StepRecord,
    summarize_rank,
)
from lightning_memplan.report.render import UNITS, check_units, format_bytes, render_markdown, render_rich

__all__ = [
    "REPORT_BASENAME",
    "UNITS",
    "EpochReport",
    "Incident",
    "MemoryReport",
    "RankAccumulator",
    "RankSummary",
    "Spread",
    "StepRecord",
    "WrittenFiles",
    "check_units",
    "format_bytes",
    "gather_objects",
    "gather_summaries",
    "load_report",
    "matplotlib_available",
    "render_markdown",
    "render_png",
    "render_rich",
    "report_paths",
    "summarize_rank",
    "write_report",
]
