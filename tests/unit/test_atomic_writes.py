"""Data on disk: atomic writes (files.py), stale temporaries, malformed reports, the plan file.

The kill loop forks a writer that rewrites the report files as fast as it can and SIGKILLs it 24 times,
half at random moments and half once a write is under way; after every kill the files on disk are
complete and valid (never torn), and after the next write no temporary file is left.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from test_report import _two_rank_epoch  # noqa: I001 - the report fixture of the report tests

from lightning_memplan.files import atomic_file, clean_stale_temps, write_atomic
from lightning_memplan.report import MemoryReport
from lightning_memplan.report.io import load_report, write_report

KILLS = 24


def temp_path(path: Path, pid: int) -> Path:
    """A temporary of ``path`` as a writer with ``pid`` makes it (``mkstemp``'s random part after the pid)."""
    return path.with_name(f".{path.name}.tmp{pid}.k3x_9q")


def _temps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp" in p.name)


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_stale_temporaries_of_dead_writers_are_removed_by_the_next_write(tmp_path):
    target = tmp_path / "memory_report.json"
    dead = _dead_pid()
    stale = [temp_path(target, dead), temp_path(tmp_path / "memory_report.md", dead), temp_path(tmp_path / "memory_report.png", dead)]
    for path in stale:
        path.write_text("torn")
    live = temp_path(target, os.getppid())  # a live process's write in flight is left alone
    live.write_text("in flight")
    write_atomic(target, "{}")
    assert not stale[0].exists() and live.exists() and target.read_text() == "{}"
    os.utime(live, (time.time() - 7200, time.time() - 7200))  # older than STALE_TEMP_AGE_S: stale whoever wrote it
    assert clean_stale_temps(target) == [live]
    # every target's own stale files go at its next write (the PNG's through atomic_file)
    write_atomic(tmp_path / "memory_report.md", "# r")
    with atomic_file(tmp_path / "memory_report.png") as fh:
        fh.write(b"png")
    assert _temps(tmp_path) == [] and (tmp_path / "memory_report.png").read_bytes() == b"png"


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    target = tmp_path / "memplan_plan.json"
    write_atomic(target, '{"ok": 1}')
    with pytest.raises(RuntimeError, match="boom"), atomic_file(target) as fh:
        fh.write(b'{"half')
        raise RuntimeError("boom")
    assert json.loads(target.read_text()) == {"ok": 1} and _temps(tmp_path) == []


@pytest.mark.parametrize(
    "content",
    [
        b'{"format_version": 1, "epochs": [{}]}',
        b'{"format_version": 1, "epochs": 5}',
        b'{"format_version": 1, "epochs": [{"epoch": "x", "ranks": 3}]}',
        b"[1, 2, 3]",
        b'{"epochs": [',
        b"\xff\xfe{}",
        b"[" * 100_000 + b"]" * 100_000,
    ],
    ids=["empty-epoch", "epochs-int", "wrong-types", "a-list", "torn", "not-utf8", "nested-100k"],
)
def test_a_file_that_is_not_a_report_is_moved_aside_with_a_warning(tmp_path, content):
    existing = tmp_path / "memory_report.json"
    existing.write_bytes(content)
    with pytest.raises(ValueError, match=r"path=.*memory_report\.json"):
        load_report(existing)  # the reader names the file
    with pytest.warns(UserWarning, match=r"memory_report\.json\.corrupt"):
        merged, files = write_report(MemoryReport(epochs=(_two_rank_epoch(0),)), tmp_path, png=False, html=False)
    assert (tmp_path / "memory_report.json.corrupt").exists()
    assert load_report(files.json).epochs == merged.epochs and len(merged.epochs) == 1


def test_the_plan_file_is_written_atomically():
    # memplan_auto (Trainer and Fabric: parallel/record.py's publish) writes memplan_plan.json through the
    # one atomic helper, not a plain open("w") (read as text: importing Lightning costs more than this whole
    # file; the fit tests check the file's content)
    text = (Path(__file__).resolve().parents[2] / "lightning_memplan" / "parallel" / "record.py").read_text()
    publish = text[text.index("def publish("):]
    publish = publish[: publish.index("\ndef ", 10)]
    assert "path = os.path.join(log_dir, PLAN_FILENAME)" in publish and "write_atomic(path" in publish
    assert "open(" not in publish


def _writer(directory: Path) -> None:
    report = MemoryReport(epochs=tuple(_two_rank_epoch(e) for e in range(40)))  # a ~100 kB JSON
    n = 0
    while True:
        write_report(report, directory, png=False, html=False)
        write_atomic(directory / "memplan_plan.json", json.dumps({"n": n, "pad": "x" * 20_000_000}))  # 20 MB: mostly inside a write
        n += 1


@pytest.mark.timeout(120)
def test_kill_during_write_leaves_only_valid_files(tmp_path):
    rng = random.Random(0)
    torn_seen = 0
    for i in range(KILLS):
        pid = os.fork()
        if pid == 0:  # the writer: never returns
            try:
                _writer(tmp_path)
            finally:
                os._exit(1)
        if i % 2:  # every other kill waits until a write is under way (a loaded machine may fork slowly)
            deadline = time.monotonic() + 10.0
            while not any(f".tmp{pid}." in p for p in _temps(tmp_path)) and time.monotonic() < deadline:
                time.sleep(0.0005)
        else:  # the others land at a random moment: before the first write, between writes, inside one
            time.sleep(rng.uniform(0.005, 0.12))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        torn_seen += any(f".tmp{pid}." in p for p in _temps(tmp_path))  # this writer's, killed mid-write
        for name in ("memory_report.json", "memplan_plan.json"):
            path = tmp_path / name
            if path.exists():  # absent only before the first complete write
                json.loads(path.read_text())  # complete: never a torn file
        if (tmp_path / "memory_report.json").exists():
            assert load_report(tmp_path).epochs
    # the next run's write removes what the killed writers left
    write_report(MemoryReport(epochs=(_two_rank_epoch(0),)), tmp_path, png=False, html=False)
    write_atomic(tmp_path / "memplan_plan.json", "{}")
    assert _temps(tmp_path) == []
    assert not (tmp_path / "memory_report.json.corrupt").exists()  # no kill ever left an unreadable report
    assert torn_seen > 0, "no kill landed mid-write: the loop did not test anything"
