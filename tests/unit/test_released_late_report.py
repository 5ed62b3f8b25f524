"""The part of a measured peak that gloo's worker thread released late (issue 33) is carried from the
tracker into the memory report: ``StepRecord.released_late`` (monitoring/step_record.py), the rank summary
of the step that measured the rank's peak, its JSON (written only when not 0, so a report without late
releases keeps its keys and an older report reads as before; the strict reader refuses a bad value), the
terminal / Markdown / HTML report (one line per rank that has some) and the ``memplan/released_late`` metric.

The reference is a real :class:`~lightning_memplan.tracking.TensorTracker` measurement of a storage another
thread frees after the peak (the deterministic thread of ``test_tracker_late_release.py``), not a number
written into the record by hand.
"""

from __future__ import annotations

import io
import threading

import pytest
import torch
from test_tracker_late_release import N, _run, one_rank_group  # noqa: F401 - the fixture is used by name

from lightning_memplan.monitoring.emit import step_metrics
from lightning_memplan.monitoring.step_record import build_step_record
from lightning_memplan.report.escape import html_text
from lightning_memplan.report.html import render_html
from lightning_memplan.report.records import EpochReport, MemoryReport, RankAccumulator, StepRecord
from lightning_memplan.report.render import late_release_lines, render_markdown, render_rich
from lightning_memplan.tracking import TensorTracker

LINE = "B of the measured peak were collective buffers gloo's thread released late"


def _tracked_report(late: bool):
    """The tracker's real report of a step whose collective buffer ``a`` another thread holds past the peak
    and frees late (``late``), or frees at once (the case of ``test_tracker_late_release._run``)."""
    holder: list[torch.Tensor] = []
    with TensorTracker() as tracker:
        a = torch.ones(N)
        holder.append(a)
        b = a.clone()
        del a
        if not late:
            holder.clear()
        c = torch.ones(2 * N)
        d = c.clone()  # the peak: b, c, d (and a while the other thread holds it)
        del b, c, d
        torch.zeros(1)
        if late:
            releaser = threading.Thread(target=holder.clear)
            releaser.start()
            releaser.join()
        torch.zeros(1)
    return tracker.report()


def _record(tracker_report, step: int = 3) -> StepRecord:
    return build_step_record({"step": step, "shape": (2, 8), "tracked": True}, None, tracker_report, rank=1, default_step=step,
                             memory_budget=None, backend="cpu", measurement="tensor_tracker")


def _report(*records: StepRecord) -> MemoryReport:
    acc = RankAccumulator(rank=1, epoch=0, backend="cpu")
    for r in records:
        acc.add(r)
    return MemoryReport().with_epoch(EpochReport(epoch=0, ranks=(acc.summary(),)))


def test_the_step_record_carries_what_the_tracker_named(one_rank_group):  # noqa: F811
    total, released = _run(late=True, used_at_peak=False)
    quiet, none = _run(late=False, used_at_peak=False)
    assert none == 0 and total - released <= quiet < total  # the tracker's own rule (test_tracker_late_release)
    late = _record(_tracked_report(late=True))
    assert late.measured_peak == total and late.released_late == released
    assert _record(_tracked_report(late=False)).released_late == 0


def test_json_keeps_old_keys_round_trips_and_is_checked(one_rank_group):  # noqa: F811
    late = _record(_tracked_report(late=True))
    plain = _record(_tracked_report(late=False), step=4)
    assert "released_late" not in plain.to_dict()  # a run without late releases writes what it always wrote
    assert late.to_dict()["released_late"] == late.released_late
    report = _report(plain, late)
    summary = report.epochs[0].ranks[0]
    assert summary.measured_peak == late.measured_peak and summary.released_late == late.released_late
    again = MemoryReport.from_dict(report.to_dict())
    assert again.epochs[0].ranks[0].released_late == late.released_late
    assert again.epochs[0].ranks[0].tracked[-1].released_late == late.released_late
    old = plain.to_dict()
    assert StepRecord.from_dict(old).released_late == 0  # a record written before the field
    for bad, error in ((-1, ValueError), ("262144", TypeError), (True, TypeError), (2.5, ValueError)):
        with pytest.raises(error, match="released_late"):
            StepRecord.from_dict({**old, "released_late": bad})
    acc = RankAccumulator.from_dict(RankAccumulator(rank=1, epoch=0, backend="cpu").to_dict() | {
        "worst_meas": late.to_dict(), "steps": 1})
    assert acc.summary().released_late == late.released_late  # a checkpointed accumulator keeps it


def test_every_medium_names_it_only_when_there_is_some(one_rank_group):  # noqa: F811
    late = _record(_tracked_report(late=True))
    report = _report(late)
    (line,) = late_release_lines(report.epochs[0])
    assert line.startswith(f"rank 1: {late.released_late:,d} {LINE}")
    assert line in render_markdown(report, units="B")
    assert html_text(line) in render_html(report, units="B")
    from rich.console import Console

    console = Console(file=io.StringIO(), width=400)
    console.print(render_rich(report, units="B"))
    assert LINE in console.file.getvalue()
    quiet = _report(_record(_tracked_report(late=False)))
    assert not late_release_lines(quiet.epochs[0])
    assert LINE not in render_markdown(quiet) and "released late" not in render_html(quiet)


def test_the_metric_is_logged_only_with_late_bytes(one_rank_group):  # noqa: F811
    late = _record(_tracked_report(late=True))
    metrics = step_metrics(late, "KiB")
    assert metrics["memplan/released_late"] == late.released_late
    assert metrics["memplan/released_late_kib"] == late.released_late / 1024
    assert "memplan/released_late" not in step_metrics(_record(_tracked_report(late=False)), "KiB")
    assert late.released_late >= N * 4  # at least the one 4 KiB buffer the other thread held
