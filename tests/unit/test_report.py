"""The memory report: records fold as worked by hand, JSON round-trips, merging never loses an epoch,
files are written atomically, and ``lightning-memplan report`` renders a saved file again."""

from __future__ import annotations

import json
import os

import pytest

from lightning_memplan.cli import main
from lightning_memplan.report import (
    EpochReport,
    Incident,
    MemoryReport,
    RankAccumulator,
    Spread,
    StepRecord,
    format_bytes,
    load_report,
    render_markdown,
    summarize_rank,
    write_report,
)
from lightning_memplan.report.io import write_atomic
from lightning_memplan.report.plot import matplotlib_available

MIB = 2**20


def _rec(
    step,
    *,
    est,
    meas=None,
    tracked=False,
    seq=16,
    headroom=None,
    reserved=None,
    phases=None,
    comps=None,
    rank=0,
    epoch=0,
):
    return StepRecord(
        step=step,
        epoch=epoch,
        rank=rank,
        micro_batch=2,
        seq_len=seq,
        estimated_peak=est,
        estimated_components={"params": est // 2, "activations": est - est // 2},
        estimated_phase_peaks={"forward": est, "backward": est - 1, "optimizer": est // 2},
        measured_peak=meas,
        measured_components=comps,
        measured_phase_peaks=phases,
        reserved=reserved,
        device_memory=100 * MIB,
        headroom=headroom,
        tracked=tracked,
    )


def _two_rank_epoch(epoch: int = 0) -> EpochReport:
    r0 = summarize_rank(
        [_rec(0, est=10 * MIB, meas=9 * MIB, reserved=20 * MIB, headroom=80 * MIB)],
        rank=0,
        epoch=epoch,
        backend="cpu",
    )
    r1 = summarize_rank(
        [_rec(0, est=14 * MIB, meas=15 * MIB, reserved=30 * MIB, headroom=70 * MIB, rank=1)],
        rank=1,
        epoch=epoch,
        backend="cpu",
    )
    return EpochReport(epoch=epoch, ranks=(r0, r1), warnings=("w",))


def test_rank_summary_folds_steps_as_worked_by_hand():
    comps = {"params": 4 * MIB, "activations": 7 * MIB}
    records = [
        _rec(
            0,
            est=10 * MIB,
            meas=11 * MIB,
            tracked=True,
            seq=16,
            headroom=50 * MIB,
            reserved=40 * MIB,
            phases={"forward": 11 * MIB, "backward": 9 * MIB},
            comps=comps,
        ),
        _rec(
            1,
            est=12 * MIB,
            seq=32,
            headroom=45 * MIB,
            reserved=44 * MIB,
            phases={"forward": 8 * MIB, "optimizer": 6 * MIB},
        ),
        _rec(
            2,
            est=8 * MIB,
            meas=13 * MIB,
            seq=8,
            headroom=60 * MIB,
            reserved=30 * MIB,
            phases={"backward": 13 * MIB},
        ),
    ]
    s = summarize_rank(records, rank=0, epoch=3, backend="cpu")
    assert s.steps == 3
    assert s.estimated_peak == 12 * MIB  # step 1 has the largest estimate
    assert s.estimated_components == records[1].estimated_components
    assert s.measured_peak == 13 * MIB and s.worst_step == 2  # step 2 has the largest measurement
    assert s.measured_components == comps  # breakdown from the (only) tracked step
    assert s.measured_phase_peaks == {"forward": 11 * MIB, "backward": 13 * MIB, "optimizer": 6 * MIB}
    assert (s.reserved, s.headroom, s.max_seq_len) == (44 * MIB, 45 * MIB, 32)
    assert s.shapes == ((2, 16), (2, 32), (2, 8))
    assert s.ratio == pytest.approx(13 / 8)  # the steady-state step with the largest measurement: step 2
    warm = summarize_rank(
        [StepRecord(step=0, epoch=0, rank=0, estimated_peak=10, measured_peak=7, warmup=True)],
        rank=0,
        epoch=0,
        backend="cpu",
    )
    assert warm.measured_peak == 7 and warm.ratio is None  # a warm-up step is not compared
    assert [r.step for r in s.tracked] == [0]


def test_accumulator_state_round_trips_mid_epoch():
    acc = RankAccumulator(rank=1, epoch=2, backend="cuda")
    acc.add(_rec(0, est=5 * MIB, meas=6 * MIB, tracked=True, comps={"params": 6 * MIB}, rank=1))
    restored = RankAccumulator.from_dict(json.loads(json.dumps(acc.to_dict())))
    later = _rec(1, est=7 * MIB, meas=4 * MIB, rank=1)
    acc.add(later)
    restored.add(later)
    assert restored.summary() == acc.summary()


def test_spread_imbalance_is_max_over_mean_minus_one():
    spread = Spread.of([9, None, 15, 12])
    assert (spread.min, spread.max) == (9, 15)
    assert spread.imbalance == pytest.approx(15 / 12 - 1)  # mean of 9, 15, 12 is 12
    assert Spread.of([None]) is None


def test_report_json_round_trip_and_across_ranks():
    report = MemoryReport(run={"estimate_source": "analytic"}, notes=("n",), epochs=(_two_rank_epoch(),))
    report = report.with_incident(
        Incident(
            kind="oom", error="E", rank=1, epoch=0, step=3, step_record=_rec(3, est=1), allocator={"rss": 5}
        )
    )
    data = json.loads(json.dumps(report.to_dict()))
    assert MemoryReport.from_dict(data) == report
    across = data["epochs"][0]["across_ranks"]["measured_peak"]
    assert (across["min"], across["max"]) == (9 * MIB, 15 * MIB)
    assert across["imbalance"] == pytest.approx(15 / 12 - 1)


def test_newer_format_version_is_refused():
    with pytest.raises(ValueError, match="format_version=99"):
        MemoryReport.from_dict({"format_version": 99, "epochs": []})


def test_write_report_merges_with_the_file_on_disk(tmp_path):
    first = MemoryReport(epochs=(_two_rank_epoch(0),))
    write_report(first, tmp_path, png=False)
    # A later writer (e.g. a resumed run that lost its in-memory state) holds only epoch 1.
    second = MemoryReport(epochs=(_two_rank_epoch(1),))
    merged, files = write_report(second, tmp_path, png=False)
    on_disk = load_report(files.json)
    assert [e.epoch for e in on_disk.epochs] == [0, 1] == [e.epoch for e in merged.epochs]
    assert on_disk.epochs[0] == first.epochs[0]
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]  # no temporary file left behind
    md = files.markdown.read_text()
    assert "## Epoch 0" in md and "## Epoch 1" in md and "0.014" in md  # 14 MiB estimate in GiB


def test_corrupt_report_is_set_aside_not_merged(tmp_path):
    (tmp_path / "memory_report.json").write_text("{not json")
    write_report(MemoryReport(epochs=(_two_rank_epoch(0),)), tmp_path, png=False)
    assert (tmp_path / "memory_report.json.corrupt").read_text() == "{not json"
    assert [e.epoch for e in load_report(tmp_path).epochs] == [0]


def test_write_atomic_replaces_whole_file(tmp_path):
    path = tmp_path / "f.txt"
    write_atomic(path, "a" * 1000)
    write_atomic(path, "b")
    assert path.read_text() == "b"


@pytest.mark.skipif(not matplotlib_available(), reason="needs matplotlib")
def test_png_chart_is_written(tmp_path):
    _, files = write_report(MemoryReport(epochs=(_two_rank_epoch(0),)), tmp_path)
    assert files.png is not None and files.png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_format_bytes_units():
    assert format_bytes(3 * 2**30) == "3.000 GiB"
    assert format_bytes(1536, "KiB") == "1.500 KiB"
    assert format_bytes(2_500_000_000, "GB", suffix=False) == "2.500"
    assert format_bytes(1234, "B") == "1,234 B"
    assert format_bytes(None) == "-"


def test_markdown_lists_incidents_with_allocator_summary():
    report = MemoryReport(epochs=(_two_rank_epoch(0),)).with_incident(
        Incident(
            kind="oom",
            error="OutOfMemoryError: x",
            rank=0,
            epoch=1,
            step=7,
            step_record=_rec(7, est=3 * 2**30, meas=2 * 2**30),
            allocator={"rss": 11, "summary": "ALLOC TABLE"},
        )
    )
    md = render_markdown(report)
    assert "Incident on rank 0, epoch 1, step 7: oom" in md
    assert "estimated peak 3.000 GiB, measured so far 2.000 GiB" in md and "ALLOC TABLE" in md


def test_cli_report_renders_a_saved_report(tmp_path, capsys):
    write_report(
        MemoryReport(run={"estimate_source": "calibrated"}, epochs=(_two_rank_epoch(0), _two_rank_epoch(1))),
        tmp_path,
        png=False,
    )
    assert main(["report", str(tmp_path), "--units", "MiB"]) == 0
    out = capsys.readouterr().out
    assert "epoch 1" in out and "14.000" in out and "15.000" in out  # rank 1's estimate and measurement
    assert main(["report", str(tmp_path / "memory_report.json"), "--epoch", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["epochs"][0]["epoch"] == 0
    assert main(["report", str(tmp_path), "--markdown"]) == 0
    assert capsys.readouterr().out.startswith("# Memory report")


def test_cli_report_errors_name_the_problem(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hello": 1}))
    assert main(["report", str(bad)]) == 2
    assert "not a memory report" in capsys.readouterr().err
    write_report(MemoryReport(epochs=(_two_rank_epoch(0),)), tmp_path, png=False)
    assert main(["report", str(tmp_path), "--epoch", "5"]) == 2
    assert "epoch=5" in capsys.readouterr().err
