"""Saving and loading the memory report: ``memory_report.json`` (the source of truth, merged with what
is already on disk and replaced atomically), ``memory_report.md``, ``memory_report.html`` (self-contained,
see :mod:`~lightning_memplan.report.html`) and ``memory_report.png``.

Every file goes through :func:`~lightning_memplan.files.write_atomic` (temporary file, fsync,
``os.replace``; stale temporaries of a killed writer are removed by the next write). A file already there
that is not a readable report (invalid JSON, or valid JSON that is not a report) is moved aside to
``memory_report.json.corrupt`` with a warning, never merged and never a crash.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from lightning_memplan.files import write_atomic
from lightning_memplan.report.plot import matplotlib_available, render_png
from lightning_memplan.report.records import MemoryReport
from lightning_memplan.report.render import render_markdown
from lightning_memplan.validation import read_json_file

__all__ = ["REPORT_BASENAME", "WrittenFiles", "load_report", "report_paths", "write_atomic", "write_report"]

#: Stem of the report files in the run's log directory.
REPORT_BASENAME = "memory_report"
#: memplan_auto's plan record, written by rank 0 into the same log directory (the HTML report's plan map).
PLAN_FILENAME = "memplan_plan.json"


@dataclass(frozen=True, kw_only=True)
class WrittenFiles:
    """Paths written by :func:`write_report` (``png`` is ``None`` when matplotlib is missing or ``png=False``;
    ``html`` is ``None`` with ``html=False``)."""

    json: Path
    markdown: Path
    png: Path | None
    html: Path | None = None


def report_paths(
    directory: str | os.PathLike[str], *, rank_suffix: int | None = None
) -> tuple[Path, Path, Path]:
    """``(json, md, png)`` paths in ``directory``; ``rank_suffix=r`` gives ``memory_report.rank{r}.*``
    (what a non-zero rank writes when it alone hits an exception)."""
    stem = REPORT_BASENAME if rank_suffix is None else f"{REPORT_BASENAME}.rank{rank_suffix}"
    d = Path(directory)
    return d / f"{stem}.json", d / f"{stem}.md", d / f"{stem}.png"


def load_report(path: str | os.PathLike[str]) -> MemoryReport:
    """Read a ``memory_report.json``.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: it is not JSON or not a memory report (the message names the path).
    """
    path = Path(path)
    if path.is_dir():
        path = path / f"{REPORT_BASENAME}.json"
    data = read_json_file(path, what="a memory_report.json written by MemoryPlanCallback")
    if not isinstance(data, dict) or not isinstance(data.get("epochs"), list):
        raise ValueError(
            f"path={str(path)!r} is not a memory report (no 'epochs' list); pass a memory_report.json"
        )
    try:
        return MemoryReport.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        detail = f"missing key {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        raise ValueError(
            f"path={str(path)!r} is not a valid memory report ({detail:.300}); pass a memory_report.json "
            "written by MemoryPlanCallback, or delete the file"
        ) from None


def write_report(
    report: MemoryReport,
    directory: str | os.PathLike[str],
    *,
    units: str = "GiB",
    png: bool = True,
    html: bool = True,
    rank_suffix: int | None = None,
) -> tuple[MemoryReport, WrittenFiles]:
    """Merge ``report`` with the JSON already in ``directory`` (earlier epochs are kept) and write the
    JSON, Markdown, HTML (with ``html``; it holds the plan map when memplan_auto's ``memplan_plan.json`` is in
    ``directory``) and (when matplotlib is installed and ``png``) PNG files.

    Returns:
        the merged report that was written, and the paths.
    """
    json_path, md_path, png_path = report_paths(directory, rank_suffix=rank_suffix)
    merged = report
    if json_path.exists():
        try:
            merged = report.merged_with(load_report(json_path))
        except ValueError as exc:
            # An unreadable older file is not silently merged into garbage: keep it beside the new one.
            aside = json_path.with_suffix(".json.corrupt")
            os.replace(json_path, aside)
            warnings.warn(f"{exc}; it was moved to {str(aside)!r} and a new report started", UserWarning, stacklevel=2)
    write_atomic(json_path, json.dumps(merged.to_dict(), indent=1, sort_keys=False) + "\n")
    write_atomic(md_path, render_markdown(merged, units=units))
    written_html: Path | None = None
    if html:
        from lightning_memplan.report.html import plan_decision_beside, render_html

        written_html = json_path.with_suffix(".html")
        write_atomic(written_html, render_html(merged, units=units, decision=plan_decision_beside(json_path)))
    written_png: Path | None = None
    if png and matplotlib_available() and merged.latest is not None:
        render_png(merged, png_path, units=units)
        written_png = png_path
    return merged, WrittenFiles(json=json_path, markdown=md_path, png=written_png, html=written_html)
