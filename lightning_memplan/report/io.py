"""Saving and loading the memory report: ``memory_report.json`` (the source of truth, merged with what
is already on disk and replaced atomically), ``memory_report.md``, ``memory_report.html`` (self-contained,
see :mod:`~lightning_memplan.report.html`) and ``memory_report.png``.

Atomic means: write a temporary file in the same directory, flush and fsync it, then ``os.replace``
it over the target. A crash in the middle leaves the previous complete file, never a torn one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from lightning_memplan.report.plot import matplotlib_available, render_png
from lightning_memplan.report.records import MemoryReport
from lightning_memplan.report.render import render_markdown

__all__ = ["REPORT_BASENAME", "WrittenFiles", "load_report", "report_paths", "write_atomic", "write_report"]

#: Stem of the report files in the run's log directory.
REPORT_BASENAME = "memory_report"


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


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load_report(path: str | os.PathLike[str]) -> MemoryReport:
    """Read a ``memory_report.json``.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: it is not JSON or not a memory report (the message names the path).
    """
    path = Path(path)
    if path.is_dir():
        path = path / f"{REPORT_BASENAME}.json"
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"path={str(path)!r} is not valid JSON ({exc}); pass a memory_report.json") from exc
    if not isinstance(data, dict) or "epochs" not in data:
        raise ValueError(
            f"path={str(path)!r} is not a memory report (no 'epochs'); pass a memory_report.json"
        )
    return MemoryReport.from_dict(data)


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
        except ValueError:
            # An unreadable older file is not silently merged into garbage: keep it beside the new one.
            os.replace(json_path, json_path.with_suffix(".json.corrupt"))
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
