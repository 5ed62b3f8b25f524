"""Bring :class:`~lightning_memplan.callbacks.MemoryPlanCallback`'s report back to the process that
called ``trainer.fit`` when Lightning ran the fit in child processes (``strategy="ddp_spawn"``,
``"ddp_notebook"``: the ``_MultiProcessingLauncher``).

There, every callback hook runs in the children, on pickled copies of the callback; the parent's
callback object never sees a hook, so its ``report`` stayed empty. Lightning sends back only the
trainer state, the weights and ``callback_metrics`` (``_WorkerOutput``,
``lightning/pytorch/strategies/launchers/multiprocessing.py``), none of which reaches a callback. So
rank 0 of the children writes the report as JSON, after each epoch and on an exception, to a file
named by a random token the parent's callback and its copies share (made in ``__init__``), in a
per-user private folder of the temporary directory; the parent's callback reads it the first time its
``report`` is asked for after the fit. JSON only, written atomically, read without executing
anything.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from lightning_memplan.files import read_json, write_atomic
from lightning_memplan.report.io import report_text
from lightning_memplan.report.records import MemoryReport

__all__ = ["handoff_path", "load_handoff", "runs_in_children", "save_handoff"]

#: The folder's mode: only this user reads the reports in it.
_PRIVATE = 0o700


def runs_in_children(trainer: Any) -> bool:
    """Whether this fit runs in processes Lightning started for it, the caller's objects being copies
    (the multiprocessing launcher of ``ddp_spawn``/``ddp_notebook``)."""
    try:
        from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
    except ImportError:  # a Lightning without it
        return False
    return isinstance(getattr(trainer.strategy, "launcher", None), _MultiProcessingLauncher)


def handoff_path(token: str) -> Path:
    """``<tmp>/lightning_memplan-<uid>/report-<token>.json``."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"lightning_memplan-{uid}" / f"report-{token}.json"


def _private_folder(path: Path) -> bool:
    """Whether ``path`` is a real folder (not a link) that this user owns and no one else can write: a
    folder someone else made first in the shared temporary directory is never used."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_mode & 0o022:
        return False
    return not hasattr(os, "getuid") or info.st_uid == os.getuid()


def save_handoff(token: str, report: MemoryReport) -> None:
    """Write ``report`` for the parent process (mode 0600, in a private folder; see the module docstring).
    Never raises: a folder that is not private (someone else's, a link, writable by others) or a failed
    write (a full temporary directory) is a warning, and the parent's ``report`` stays empty."""
    path = handoff_path(token)
    try:
        with contextlib.suppress(FileExistsError):
            path.parent.mkdir(mode=_PRIVATE)
        if not _private_folder(path.parent):
            raise PermissionError(f"{str(path.parent)!r} is not a private folder of this user (a link, another "
                                  "user's, or writable by others)")
        write_atomic(path, report_text(report), mode=0o600)
    except (OSError, ValueError, TypeError) as exc:
        from lightning.fabric.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(f"MemoryPlanCallback could not hand the report to the calling process through {str(path)!r} "
                       f"({type(exc).__name__}: {exc}); the report files in the log folder are not affected")


def load_handoff(token: str) -> MemoryReport | None:
    """The report a child wrote for ``token`` (the file is removed once read), or ``None``; a folder
    another user owns (or a link) is never read, nor a file there that is not a regular file."""
    path = handoff_path(token)
    if not _private_folder(path.parent):
        return None
    try:
        data = read_json(path, what="a memory report", argument="handoff")
    except FileNotFoundError:
        return None
    report = MemoryReport.from_dict(data)
    path.unlink(missing_ok=True)
    return report
