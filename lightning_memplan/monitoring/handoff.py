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

import os
import tempfile
from pathlib import Path
from typing import Any

from lightning_memplan.files import write_atomic
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


def save_handoff(token: str, report: MemoryReport) -> None:
    import json

    path = handoff_path(token)
    path.parent.mkdir(mode=_PRIVATE, exist_ok=True)
    write_atomic(path, json.dumps(report.to_dict()))


def load_handoff(token: str) -> MemoryReport | None:
    """The report a child wrote for ``token`` (the file is removed once read), or ``None``; a folder
    another user owns is never read."""
    from lightning_memplan.validation import read_json_file

    path = handoff_path(token)
    if not path.is_file():
        return None
    if hasattr(os, "getuid") and path.parent.stat().st_uid != os.getuid():
        return None
    report = MemoryReport.from_dict(read_json_file(path, what="a memory report", argument="handoff"))
    path.unlink(missing_ok=True)
    return report
