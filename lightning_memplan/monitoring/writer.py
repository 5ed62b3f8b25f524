"""The report files off the training thread: what an epoch end costs the run.

Writing ``memory_report.json`` and ``.md`` takes milliseconds; drawing ``memory_report.png`` (matplotlib)
and ``.html`` takes about half a second for a small report, which a run with short epochs would pay at
every epoch end (and after every checkpoint save). :class:`ReportWriter` therefore splits the files:

- the JSON and the Markdown are written at once, by the caller, every time (the source of truth is never
  behind the epochs that ended);
- the pictures (HTML and PNG, drawn from the same report) are drawn by one background thread, the newest
  report replacing any that waits, and at an epoch end only while that costs at most
  :data:`PICTURE_DUTY` of the run's time since the previous drawing started (drawing is Python work that
  shares the interpreter with the training step);
- :meth:`ReportWriter.finish` (the end of the fit, an exception, a teardown) waits for the thread and
  draws the final report if the last drawing is older, so every file is on disk, whole and current, when
  ``trainer.fit`` returns.

Every file goes through :func:`~lightning_memplan.report.io.write_report` with ``errors="warn"``: a file
that cannot be written is a warning, never the end of the run; so is any failure of the thread itself.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from lightning_memplan.report.records import MemoryReport

__all__ = ["PICTURE_DUTY", "ReportWriter"]

#: Largest share of the run's wall time that drawing the pictures at epoch ends may take (the end of the fit
#: always draws).
PICTURE_DUTY = 0.05
#: What one drawing is taken to cost before the first one was timed, seconds (a small report's HTML and PNG
#: took 0.4-0.9 s on a loaded 2-core CPU): a run draws at an epoch end once it has run 20x this long.
_FIRST_DRAWING_S = 0.5


def _texts_on_disk(written: Any) -> bool:
    """Whether a write put the JSON on disk: a ``WrittenFiles`` names its path (``None``: it failed or was
    skipped); any other answer of the ``write`` callable counts as written."""
    return written is not None and getattr(written, "json", True) is not None


def _frozen(report: MemoryReport) -> MemoryReport:
    """``report`` safe to hand to another thread: its records are frozen, its ``run`` dict is copied."""
    return replace(report, run=dict(report.run))


class ReportWriter:
    """Writes a :class:`MemoryReport` to report folders, the pictures on a background thread (module
    docstring).

    Args:
        write: ``(report, directory, pictures, texts) -> WrittenFiles | None``: one folder's files, the JSON and
            the Markdown with ``texts``, the HTML and the PNG with ``pictures`` (a wrapper of
            :func:`~lightning_memplan.report.io.write_report` that warns instead of raising). The pictures of a
            report whose JSON and Markdown were just written are drawn without writing those again.
        clock: seconds, monotonic (a parameter for tests).
    """

    def __init__(self, write: Callable[[MemoryReport, str, bool, bool], Any],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._write = write
        self._texts: MemoryReport | None = None  # the last report (as given) whose JSON and Markdown are on disk
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: tuple[MemoryReport, MemoryReport, tuple[str, ...]] | None = None  # (given, copy, folders)
        self._thread: threading.Thread | None = None
        self._drawn: MemoryReport | None = None  # the last report (as given) whose pictures are on disk
        self._started_at = clock()  # when the run (or the last drawing) started
        self._last_cost = _FIRST_DRAWING_S  # seconds the last drawing took
        self.failures = 0

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (a spawning launcher sends the callback to its processes): without the lock, the thread
        and what waits for it, which a process starts afresh."""
        self.wait()
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_thread", "_pending")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock(), _thread=None, _pending=None)

    # ------------------------------------------------------------------------------------ the caller
    def write_now(self, report: MemoryReport, directories: list[str], *, pictures: bool, texts: bool = True) -> Any:
        """Write ``report`` to every folder on this thread (the JSON and Markdown with ``texts``; the pictures
        with ``pictures``), after the thread's drawing in progress; the first folder's files."""
        self.wait()
        first, on_disk = None, True
        for directory in directories:
            written = self._write(report, directory, pictures, texts)
            first = first or written
            on_disk = on_disk and _texts_on_disk(written)
        if pictures:
            self._drawn = report
        if texts:
            self._texts = report if on_disk else None
        return first

    def epoch_end(self, report: MemoryReport, directories: list[str]) -> Any:
        """At an epoch end (or after a checkpoint save): the JSON and Markdown now; the pictures on the thread
        when the duty rule allows (module docstring). The first folder's files of the JSON/Markdown write."""
        first, on_disk = None, True
        for directory in directories:
            written = self._write(report, directory, False, True)
            first = first or written
            on_disk = on_disk and _texts_on_disk(written)
        self._texts = report if on_disk else None  # a failed JSON write is tried again by finish()
        if self._last_cost <= PICTURE_DUTY * max(self._clock() - self._started_at, 0.0):
            self._draw_later(report, tuple(directories))
        return first

    def finish(self, report: MemoryReport, directories: list[str]) -> Any:
        """Wait for the thread, then draw ``report``'s pictures unless they are on disk already (the end of
        the fit), and write its JSON and Markdown unless an epoch end did (again after a failed write); the
        first folder's files, or ``None`` when nothing new was written."""
        self.wait()
        if not directories or (self._drawn is report and self._texts is report):
            return None
        return self.write_now(report, directories, pictures=self._drawn is not report, texts=self._texts is not report)

    def wait(self) -> None:
        """Block until the thread has drawn what was given to it (nothing to wait for: returns at once)."""
        thread = self._thread
        if thread is not None:
            thread.join()

    # ------------------------------------------------------------------------------------ the thread
    def _draw_later(self, report: MemoryReport, directories: tuple[str, ...]) -> None:
        with self._lock:
            self._pending = (report, _frozen(report), directories)
            self._started_at = self._clock()  # no second drawing is asked for until this one's cost is known
            if self._thread is not None and self._thread.is_alive():
                return  # the running thread takes the newest report when it is done
            self._thread = threading.Thread(target=self._run, name="memplan-report-writer", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                job, self._pending = self._pending, None
            if job is None:
                return
            report, copy, directories = job
            started = self._clock()
            try:
                for directory in directories:
                    self._write(copy, directory, True, False)  # its JSON and Markdown went at the epoch end
                self._drawn = report
            except Exception as exc:  # noqa: BLE001 - the writer never ends the run
                self.failures += 1
                warnings.warn(f"memory report: drawing the pictures failed ({type(exc).__name__}: {exc}); the "
                              "JSON and Markdown reports are written; the run goes on", UserWarning, stacklevel=1)
            self._last_cost = self._clock() - started
            self._started_at = started
