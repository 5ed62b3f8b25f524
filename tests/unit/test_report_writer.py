"""The report writer (monitoring/writer.py): JSON and Markdown at every epoch end, the pictures on a thread
only when cheap, everything on disk and current after ``finish``; failures are warnings."""

from __future__ import annotations

import pickle
import threading
import warnings

import pytest

from lightning_memplan.monitoring.writer import PICTURE_DUTY, ReportWriter
from lightning_memplan.report.records import MemoryReport
from lightning_memplan.testing.reports import synthetic_report


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Recorder:
    """A ``write`` that records ``(report id, folder, pictures, thread)`` and can be made to fail or wait."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str, bool, str]] = []
        self.fail = False
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, report: MemoryReport, directory: str, pictures: bool, texts: bool) -> str:
        if pictures:
            self.gate.wait(5)
        if pictures and self.fail:
            raise OSError("no space left")
        self.calls.append((id(report), directory, pictures, threading.current_thread().name))
        self.texts.append(texts)
        return directory

    @property
    def texts(self) -> list[bool]:
        return self.__dict__.setdefault("_texts", [])


def test_a_short_run_writes_text_at_epoch_ends_and_the_pictures_once_at_the_end():
    clock, write = _Clock(), _Recorder()
    writer = ReportWriter(write, clock=clock)
    report = synthetic_report(epochs=1)
    for _ in range(3):  # three quick epochs: no drawing is cheap enough yet
        clock.now += 1.0
        assert writer.epoch_end(report, ["a", "b"]) == "a"
    assert [c[2] for c in write.calls] == [False] * 6 and {c[3] for c in write.calls} == {threading.current_thread().name}
    assert writer.finish(report, ["a", "b"]) == "a"
    assert [c[1:3] for c in write.calls[6:]] == [("a", True), ("b", True)]
    # the final pictures of the report whose JSON/Markdown the last epoch end wrote: those are not written again
    assert write.texts == [True] * 6 + [False, False]
    assert writer.finish(report, ["a", "b"]) is None  # the pictures of this report are on disk already
    later = synthetic_report(epochs=2)  # a report whose texts are not on disk: finish writes every file
    assert writer.finish(later, ["a"]) == "a" and write.texts[-1] is True


def test_a_long_run_draws_on_the_thread_and_finish_waits_for_it():
    clock, write = _Clock(), _Recorder()
    writer = ReportWriter(write, clock=clock)
    first, last = synthetic_report(epochs=1), synthetic_report(epochs=2)
    write.gate.clear()  # the drawing waits until released: the epoch end must not
    clock.now = 0.5 / PICTURE_DUTY + 1  # the run has gone on long enough for one drawing
    writer.epoch_end(first, ["a"])
    assert [c[2] for c in write.calls] == [False]
    write.gate.set()
    assert writer.finish(last, ["a"]) == "a"  # waits for the thread, then draws the newer report
    pictures = [c for c in write.calls if c[2]]
    assert [c[3] for c in pictures] == ["memplan-report-writer", threading.current_thread().name]
    assert pictures[-1][0] == id(last)


def test_a_failed_drawing_is_a_warning_and_the_run_goes_on():
    clock, write = _Clock(), _Recorder()
    write.fail = True
    writer = ReportWriter(write, clock=clock)
    clock.now = 100.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer.epoch_end(synthetic_report(epochs=1), ["a"])
        writer.wait()
    assert writer.failures == 1 and any("drawing the pictures failed" in str(w.message) for w in caught)


def _folder(report: MemoryReport, directory: str, pictures: bool, texts: bool) -> str:
    return directory


def test_the_writer_pickles_for_a_spawning_launcher():
    writer = ReportWriter(_folder)
    clone = pickle.loads(pickle.dumps(writer))
    clone.epoch_end(synthetic_report(epochs=1), ["a"])
    assert clone.finish(synthetic_report(epochs=1), ["a"]) == "a"


def test_the_session_writes_every_file_by_the_end_of_the_fit(tmp_path):
    from lightning_memplan.monitoring.options import MonitorOptions
    from lightning_memplan.monitoring.session import MemorySession

    session = MemorySession(MonitorOptions(print_report=False))
    session.report = synthetic_report(epochs=1)
    session.write_epoch([str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("memory_report")) == [
        "memory_report.json", "memory_report.md"]
    files = session.finish_writes([str(tmp_path)])
    assert files.html is not None and files.png is not None
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("memory_report")) == [
        "memory_report.html", "memory_report.json", "memory_report.md", "memory_report.png"]


@pytest.mark.parametrize("write_files", [False])
def test_nothing_is_written_when_files_are_off(tmp_path, write_files):
    from lightning_memplan.monitoring.options import MonitorOptions
    from lightning_memplan.monitoring.session import MemorySession

    session = MemorySession(MonitorOptions(write_files=write_files))
    session.report = synthetic_report(epochs=1)
    assert session.write_epoch([str(tmp_path)]) is None and session.finish_writes([str(tmp_path)]) is None
    assert list(tmp_path.iterdir()) == []
