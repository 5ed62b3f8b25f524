"""Saving and loading the memory report: ``memory_report.json`` (the source of truth, merged with what
is already on disk and replaced atomically), ``memory_report.md``, ``memory_report.html`` (self-contained,
see :mod:`~lightning_memplan.report.html`) and ``memory_report.png``.

Every file goes through :func:`~lightning_memplan.files.atomic_file` (a fresh ``mkstemp`` temporary in the
folder, fsync, ``os.replace``; never through a planted link; stale temporaries of a killed writer are
removed by the next write). The writers of one folder take turns (``fcntl.flock`` on
``.memory_report.lock``, :func:`~lightning_memplan.files.folder_lock`: one lock for every user who writes
the folder): each reads, merges and writes while holding it, so two processes writing one folder keep every
epoch. A writer that waits longer than :data:`~lightning_memplan.files.LOCK_TIMEOUT_S` for the lock skips
this write with a warning (the report is cumulative: the next write holds every epoch).

A file already there whose *content* is not a report (a link, invalid JSON, or valid JSON that is not a
report) is moved aside with a warning, never merged and never a crash: to ``memory_report.json.corrupt``,
or, when that name is taken, to ``memory_report.json.corrupt-<time>-<random>`` (linked there with
``os.link``, which never replaces a name, then unlinked), so no earlier copy is overwritten. A file that
cannot be read *now* (no descriptor left, ``EINTR``, ``EAGAIN``, no memory: :func:`~lightning_memplan.files.
is_transient`) or not by this user (no read permission) says nothing about its content: it is left where it
is, and this write is skipped (its earlier epochs would be lost otherwise).

With ``errors="warn"`` (what the callback and the Fabric monitor use: a monitoring feature never ends the
run) a file that cannot be written (a full or read-only disk, a folder in its place, a title matplotlib
cannot draw) becomes one ``UserWarning`` naming each path and its error; every file on disk stays whole
(its previous version) or absent, never partial.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lightning_memplan.files import (
    LOCK_TIMEOUT_S,
    LockState,
    folder_lock,
    json_default,
    read_json,
    write_atomic,
)
from lightning_memplan.report.paths import (
    LOCK_FILENAME,
    PLAN_FILENAME,
    REPORT_BASENAME,
    plan_decision_beside,
    report_paths,
)
from lightning_memplan.report.plot import matplotlib_available, render_png
from lightning_memplan.report.records import MemoryReport
from lightning_memplan.report.render import render_markdown

__all__ = [
    "PLAN_FILENAME",
    "REPORT_BASENAME",
    "WrittenFiles",
    "load_report",
    "report_paths",
    "report_text",
    "write_atomic",
    "write_report",
]

#: What ``write_report(errors=...)`` accepts.
_ERRORS = ("raise", "warn")


@dataclass(frozen=True, kw_only=True)
class WrittenFiles:
    """Paths written by :func:`write_report`: ``None`` for a file that was not written (``png``: matplotlib
    missing or ``png=False``; ``html``: ``html=False``; any of them: its write failed under
    ``errors="warn"``)."""

    json: Path | None
    markdown: Path | None
    png: Path | None
    html: Path | None = None


def _parse(path: Path, *, follow_links: bool) -> MemoryReport:
    data = read_json(path, what="a memory_report.json written by MemoryPlanCallback", follow_links=follow_links)
    if not isinstance(data, dict) or not isinstance(data.get("epochs"), list):
        raise ValueError(
            f"path={str(path)!r} is not a memory report (no 'epochs' list); pass a memory_report.json"
        )
    try:
        return MemoryReport.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        detail = f"missing key {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        raise ValueError(
            f"path={str(path)!r} is not a valid memory report ({detail:.400}); pass a memory_report.json "
            "written by MemoryPlanCallback, or delete the file"
        ) from None


def load_report(path: str | os.PathLike[str]) -> MemoryReport:
    """Read a ``memory_report.json`` (or the one in the folder ``path``), checked field by field.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: not a regular file, too large, not JSON, or not a memory report: a field of the wrong
            type or out of range (a string, negative or 10**400 peak, a note that is not a string); the
            message names the path and the field.
    """
    path = Path(path)
    if path.is_dir():
        path = path / f"{REPORT_BASENAME}.json"
    return _parse(path, follow_links=True)  # a file the user named (a link to a report is fine)


def report_text(report: MemoryReport) -> str:
    """The JSON text of ``report`` (NumPy/torch scalars that reached it as numbers are written as numbers)."""
    return json.dumps(report.to_dict(), indent=1, sort_keys=False, default=json_default, allow_nan=False) + "\n"


class _Deferred(Exception):
    """The report on disk cannot be merged now (module docstring): this write is skipped."""


def _aside_name(json_path: Path) -> Path:
    plain = json_path.with_suffix(".json.corrupt")
    if not os.path.lexists(plain):
        return plain
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    return json_path.with_suffix(f".json.corrupt-{stamp}-{secrets.token_hex(4)}")


def _move_aside(json_path: Path) -> Path:
    """Move the unreadable report to a name that holds nothing yet (module docstring); returns it."""
    for _ in range(8):
        aside = _aside_name(json_path)
        try:
            os.link(json_path, aside, follow_symlinks=False)  # fails on an existing name: never overwrites
        except FileExistsError:
            continue
        except OSError:  # a filesystem without hard links: rename to the name just found free
            if os.path.lexists(aside):
                continue
            os.replace(json_path, aside)  # renames a link itself, never its target
            return aside
        os.unlink(json_path)
        return aside
    raise FileExistsError(f"no free name to move {str(json_path)!r} aside")


def _merged_with_disk(report: MemoryReport, json_path: Path) -> MemoryReport:
    """``report`` merged with the report already at ``json_path`` (read without following a link). A file
    whose content is not a report, the caller's own regular file or link, is moved aside with a warning; one
    that cannot be read now or by this user raises :class:`_Deferred` (a folder, device or another user's
    file is left for the write to refuse)."""
    try:
        info = os.lstat(json_path)
    except FileNotFoundError:
        return report
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)):
        return report  # the write refuses it and says so
    try:
        return report.merged_with(_parse(json_path, follow_links=False))
    except FileNotFoundError:
        return report
    except (OSError, MemoryError) as exc:  # is_transient: read_json says nothing about the file
        raise _Deferred(f"{str(json_path)!r} cannot be read now ({type(exc).__name__}: {exc})") from None
    except ValueError as exc:
        if stat.S_ISREG(info.st_mode) and not os.access(json_path, os.R_OK):
            raise _Deferred(f"{str(json_path)!r} is not readable by this user, so its epochs cannot be kept") from None
        if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
            raise _Deferred(f"{exc}; it belongs to another user (uid {info.st_uid}) and is left as it is") from None
        aside = _move_aside(json_path)
        warnings.warn(f"{exc}; it was moved to {str(aside)!r} and a new report started", UserWarning, stacklevel=3)
        return report


def _skipped(report: MemoryReport, errors: str, why: str, json_path: Path) -> tuple[MemoryReport, WrittenFiles]:
    """This write skipped (a busy lock, a report that cannot be read now): raised under ``errors="raise"``,
    else one warning; nothing on disk changes."""
    text = (f"memory report: {why}; the files in {str(json_path.parent)!r} are left as they are and this write is "
            "skipped (the next one writes every epoch)")
    if errors == "raise":
        raise OSError(text)
    warnings.warn(text, UserWarning, stacklevel=3)
    return report, WrittenFiles(json=None, markdown=None, png=None, html=None)


def _warn_unusable_lock(lock: LockState, folder: Path) -> None:
    """One warning when the folder has a lock file this user cannot use (another user's, not readable)."""
    path = folder / LOCK_FILENAME
    if lock is LockState.UNAVAILABLE and os.path.lexists(path) and not os.path.islink(path) \
            and not os.access(path, os.R_OK):
        warnings.warn(
            f"memory report: the lock file {str(path)!r} is not readable by this user, so the writers of this folder "
            "cannot take turns (one of two writing at once may lose epochs); make it readable by every writer "
            "(chmod a+r) or delete it", UserWarning, stacklevel=3)


def write_report(
    report: MemoryReport,
    directory: str | os.PathLike[str],
    *,
    units: str = "GiB",
    png: bool = True,
    html: bool = True,
    text: bool = True,
    rank_suffix: int | None = None,
    errors: str = "raise",
) -> tuple[MemoryReport, WrittenFiles]:
    """Merge ``report`` with the JSON already in ``directory`` (earlier epochs and runs are kept) and write
    the JSON, Markdown, HTML (with ``html``; it holds the plan map when memplan_auto's ``memplan_plan.json``
    is in ``directory``) and (when matplotlib is installed and ``png``) PNG files, holding the folder's
    lock (module docstring).

    Args:
        text: write the JSON and the Markdown (``False``: only the pictures asked for, drawn from the report
            merged with the one on disk, when the JSON of this report is already there).
        errors: ``"raise"``: the first file that cannot be written raises its error (``OSError``,
            ``ValueError``, ...). ``"warn"``: every file is tried, and the ones that failed make one
            ``UserWarning`` naming each path and its error; nothing is raised.

    Returns:
        the merged report, and the paths written.
    """
    if errors not in _ERRORS:
        raise ValueError(f"errors={errors!r} is not supported; use one of {', '.join(map(repr, _ERRORS))}")
    json_path, md_path, png_path = report_paths(directory, rank_suffix=rank_suffix)
    html_path = json_path.with_suffix(".html")
    failures: list[str] = []
    merged = report

    def attempt(path: Path, write: Callable[[], None]) -> Path | None:
        try:
            write()
        except Exception as exc:  # noqa: BLE001 - under errors="warn" no report write ends the run
            if errors == "raise":
                raise
            failures.append(f"{str(path)!r}: {type(exc).__name__}: {str(exc)[:300]}")
            return None
        return path

    with folder_lock(json_path.parent, LOCK_FILENAME) as lock:
        if lock is LockState.BUSY:
            return _skipped(report, errors, f"another writer held the folder's lock {LOCK_FILENAME!r} for "
                            f"{LOCK_TIMEOUT_S:g} s", json_path)
        _warn_unusable_lock(lock, json_path.parent)
        try:
            merged = _merged_with_disk(report, json_path)
        except _Deferred as exc:
            return _skipped(report, errors, str(exc), json_path)
        except OSError as exc:  # moving an unreadable file aside failed (a read-only folder)
            if errors == "raise":
                raise
            failures.append(f"{str(json_path)!r}: {type(exc).__name__}: {str(exc)[:300]}")
        written_json = written_md = None
        if text:
            written_json = attempt(json_path, lambda: write_atomic(json_path, report_text(merged)))
            written_md = attempt(md_path, lambda: write_atomic(md_path, render_markdown(merged, units=units)))
        written_html: Path | None = None
        if html:
            from lightning_memplan.report.html import render_html

            written_html = attempt(html_path, lambda: write_atomic(
                html_path, render_html(merged, units=units, decision=plan_decision_beside(json_path))))
        written_png: Path | None = None
        if png and matplotlib_available() and merged.latest is not None:
            written_png = attempt(png_path, lambda: render_png(merged, png_path, units=units))
    if failures:
        warnings.warn(
            f"memory report: {len(failures)} file(s) could not be written, the run goes on (each file on disk is "
            f"its previous version or absent, never partial): {'; '.join(failures)}. Free space or make the folder "
            "writable, or log to another folder (the Trainer's default_root_dir, MemoryMonitor(dirpath=...))",
            UserWarning,
            stacklevel=2,
        )
    return merged, WrittenFiles(json=written_json, markdown=written_md, png=written_png, html=written_html)
