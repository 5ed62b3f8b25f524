"""The memory report: data model, renderers (rich, Markdown, HTML, PNG; every string escaped for its medium by
``report.escape``), atomic JSON persistence under a folder lock, and the
end-of-epoch gather across ranks. Written by :class:`~lightning_memplan.callbacks.MemoryPlanCallback`,
rendered again by ``lightning-memplan report PATH``."""

from lightning_memplan.report.gather import gather_objects, gather_summaries
from lightning_memplan.report.io import WrittenFiles, load_report, write_report
from lightning_memplan.report.margin import measured_reserved_margin
from lightning_memplan.report.paths import REPORT_BASENAME, report_paths
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
    "measured_reserved_margin",
    "render_markdown",
    "render_png",
    "render_rich",
    "report_paths",
    "summarize_rank",
    "write_report",
]
