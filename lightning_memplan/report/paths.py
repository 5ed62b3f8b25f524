"""The names of the files in a run's log folder (the memory report's, memplan_auto's plan record) and the
reading of that plan record for the HTML report's plan map.

Shared by :mod:`~lightning_memplan.report.io` (writes the report) and
:mod:`~lightning_memplan.report.html` (draws the plan map), so neither imports the other.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from lightning_memplan.files import read_json

__all__ = ["LOCK_FILENAME", "PLAN_FILENAME", "REPORT_BASENAME", "plan_decision_beside", "report_paths"]

#: Stem of the report files in the run's log directory.
REPORT_BASENAME = "memory_report"
#: memplan_auto's plan record, written by rank 0 into the same log directory (the HTML report's plan map).
PLAN_FILENAME = "memplan_plan.json"
#: The lock file the writers of one report folder take turns on (:func:`lightning_memplan.files.folder_lock`).
LOCK_FILENAME = ".memory_report.lock"
#: Largest plan record read (a decision with every candidate and rejection is well under a MB).
_MAX_PLAN_BYTES = 16 * 2**20


def report_paths(
    directory: str | os.PathLike[str], *, rank_suffix: int | None = None
) -> tuple[Path, Path, Path]:
    """``(json, md, png)`` paths in ``directory``; ``rank_suffix=r`` gives ``memory_report.rank{r}.*``
    (what a non-zero rank writes when it alone hits an exception)."""
    stem = REPORT_BASENAME if rank_suffix is None else f"{REPORT_BASENAME}.rank{rank_suffix}"
    d = Path(directory)
    return d / f"{stem}.json", d / f"{stem}.md", d / f"{stem}.png"


def plan_decision_beside(report_path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``"decision"`` of memplan_auto's ``memplan_plan.json`` in the directory of ``report_path``, or
    ``None`` when there is none. A file there that is not a usable plan record (a link, a FIFO, too large,
    nested too deep, not JSON, or a decision the plan map cannot draw, e.g. ``"candidates": ["x"]``) gives a
    ``UserWarning`` naming it and ``None``: the page then has no plan map, and the run goes on."""
    from lightning_memplan.report.views import plan_view

    path = Path(report_path)
    plan_file = (path if path.is_dir() else path.parent) / PLAN_FILENAME
    if not os.path.lexists(plan_file):
        return None
    try:
        data = read_json(plan_file, what="memplan_auto's plan record", argument="plan_file", max_bytes=_MAX_PLAN_BYTES)
        decision = data.get("decision") if isinstance(data, dict) else None
        if decision is None:
            return None  # a record without a decision (a plan given by hand): no map, nothing wrong
        if not isinstance(decision, dict) or not isinstance(decision.get("candidates"), list):
            raise ValueError("its 'decision' is not a plan decision (no 'candidates' list)")
        plan_view(decision)  # what the map draws: a record it cannot draw is refused here, not mid-page
    except FileNotFoundError:
        return None  # removed meanwhile
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError) as exc:
        warnings.warn(
            f"memory report: the plan record {str(plan_file)!r} is not used for the plan map ({type(exc).__name__}: "
            f"{str(exc)[:300]}); the report is written without it. A run with strategy='memplan_auto' writes a fresh "
            "one; otherwise delete the stale file",
            UserWarning,
            stacklevel=2,
        )
        return None
    return decision
