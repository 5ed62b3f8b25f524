"""Hardening III (issue 36): never replace what is not ours, never lose a report to a passing fault, never a
raw traceback from the CLI, bounded work for every size accepted, and the report reader's input rules.

Tests that need users other than the caller or device nodes run as root (this machine's and CI's user);
each forks a child that takes another uid with ``os.setgid``/``os.setuid`` (no account needed), and
skips with the reason when not root. A tiny tmpfs (``nr_inodes``) needs ``mount``: skipped when the
container may not mount.
"""

from __future__ import annotations

import contextlib
import encodings.utf_8_sig  # noqa: F401 - loaded here: a child running as another user cannot read root's folders
import errno
import json
import os
import resource
import signal
import socket
import stat
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lightning_memplan.cli import main
from lightning_memplan.files import LockState, check_output_target, folder_lock, read_json, write_atomic
from lightning_memplan.report import io as report_io
from lightning_memplan.report.escape import html_text
from lightning_memplan.report.io import load_report, write_report
from lightning_memplan.report.records import (
    MAX_EPOCH_RANKS,
    MemoryReport,
    RankSummary,
    representative_ranks,
)
from lightning_memplan.testing.reports import synthetic_report

pytestmark = pytest.mark.hf  # the deep-config tests build transformers classes

ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="needs root: other users' files, device nodes and setuid children")
OTHER, THIRD, GROUP = 4242, 4243, 4240  # uids/gid without accounts: setuid needs none
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A folder other users can reach (pytest's own tmp_path lies under a 0700 folder of root's)."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="memplan-users-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _start_as_user(uid: int, fn: Callable[..., Any], *args: Any, gid: int = GROUP,
                   umask: int = 0o002) -> tuple[int, int]:
    """Fork a child running ``fn(*args)`` as ``uid``/``gid`` (supplementary group ``GROUP``); ``(pid, the read
    end of its result pipe)`` for :func:`_result_of`. Fork from the main thread only (a fork from a thread
    while another holds the import or a logging lock would leave that lock held in the child), and the child
    ends by SIGALRM after 120 s whatever it waits for, so a stuck child fails the test instead of hanging it."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            signal.alarm(120)
            os.close(read)
            os.setgroups([GROUP])
            os.setgid(gid)
            os.setuid(uid)
            os.umask(umask)
            out = {"ok": fn(*args)}
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out, code = {"error": f"{type(exc).__name__}: {exc}"}, 1
        with os.fdopen(write, "w") as fh:
            json.dump(out, fh, default=str)
        os._exit(code)
    os.close(write)
    return pid, read


def _result_of(pid: int, read: int) -> Any:
    """The JSON-able result of a child of :func:`_start_as_user`, or RuntimeError with its exception."""
    with os.fdopen(read) as fh:
        data = fh.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        raise RuntimeError(f"the child ended without a result (wait status {status})")
    out = json.loads(data)
    if "error" in out:
        raise RuntimeError(out["error"])
    return out["ok"]


def _as_user(uid: int, fn: Callable[..., Any], *args: Any, gid: int = GROUP, umask: int = 0o002) -> Any:
    """``fn(*args)`` in a forked child running as ``uid``/``gid``; returns its JSON-able result, or raises
    RuntimeError with the child's exception."""
    return _result_of(*_start_as_user(uid, fn, *args, gid=gid, umask=umask))


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _report_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    write_report(synthetic_report(epochs=1), folder, png=False, html=False)
    return folder


def _temps(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".tmp" in p.name]


# ------------------------------------------------------------------------------------ 1. what is replaced
def _node(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"target-{kind}"
    if kind == "chardev":
        if not ROOT:
            pytest.skip("needs root: a device node (a copy of /dev/null)")
        os.mknod(path, 0o666 | stat.S_IFCHR, os.stat("/dev/null").st_rdev)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    else:
        path.mkdir()
    return path


@pytest.mark.parametrize("kind", ["chardev", "fifo", "socket", "folder"])
def test_a_device_fifo_socket_or_folder_is_refused_and_left_as_it_is(tmp_path, kind, capsys):
    target = _node(tmp_path, kind)
    before = os.lstat(target)
    with pytest.raises(ValueError, match=r"not a regular file.*choose another file name"):
        write_atomic(target, "<html>")
    code, _, err = _cli(["report", str(_report_dir(tmp_path)), "--html", str(target)], capsys)
    line = _one_error_line(err)
    assert code == 2 and "--html=" in line and str(target) in line
    after = os.lstat(target)
    assert stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode) and after.st_ino == before.st_ino
    assert _temps(tmp_path) == []  # no temporary beside it, on any refusal


def test_a_path_under_a_file_and_a_folder_target_are_one_line_errors(tmp_path, capsys):
    folder = _report_dir(tmp_path)
    (tmp_path / "plain").write_text("x")
    for target, rule in ((tmp_path / "plain" / "page.html", "which is a file, not a folder"), (tmp_path, "is a folder")):
        code, _, err = _cli(["report", str(folder), "--html", str(target)], capsys)
        assert code == 2 and rule in _one_error_line(err)
    assert (tmp_path / "plain").read_text() == "x" and _temps(tmp_path) == []


@needs_root
def test_another_users_read_only_file_is_refused_to_them_and_keeps_its_owner_under_root(open_tmp):
    open_tmp.chmod(0o777)
    target = open_tmp / "page.html"
    target.write_text("theirs")
    os.chown(target, OTHER, GROUP)
    target.chmod(0o444)
    # a third user who could not open it for writing is refused (before: the file was replaced and theirs)
    with pytest.raises(RuntimeError, match="not writable by you"):
        _as_user(THIRD, write_atomic, str(target), "mine")
    assert target.read_text() == "theirs" and target.stat().st_uid == OTHER
    # root may open it for writing (open(path, "w") would): the new file keeps the owner and the mode
    write_atomic(target, "root's")
    info = target.stat()
    assert target.read_text() == "root's" and (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (OTHER, GROUP, 0o444)


@needs_root
def test_a_sticky_folders_foreign_file_is_refused_to_everyone_but_its_owner(open_tmp, capsys):
    shared = open_tmp / "shared"
    shared.mkdir()
    os.chown(shared, 4244, GROUP)  # like /tmp: the folder's owner is neither the file's owner nor the writer
    shared.chmod(0o1777)
    target = shared / "page.html"
    target.write_text("theirs")
    os.chown(target, OTHER, GROUP)
    target.chmod(0o666)
    for who in (THIRD, None):  # another user, and root (fs.protected_regular's rule for a sticky folder)
        if who is None:
            code, _, err = _cli(["report", str(_report_dir(open_tmp)), "--html", str(target)], capsys)
            assert code == 2 and "sticky folder" in _one_error_line(err)
        else:
            with pytest.raises(RuntimeError, match="sticky folder"):
                _as_user(who, write_atomic, str(target), "mine")
    assert target.read_text() == "theirs" and target.stat().st_uid == OTHER
    assert _as_user(OTHER, write_atomic, str(target), "owner's") is None  # its owner may
    assert target.read_text() == "owner's"


def test_a_replaced_file_keeps_its_mode_and_a_new_one_follows_the_umask(tmp_path):
    target = tmp_path / "r.json"
    target.write_text("{}")
    target.chmod(0o640)
    write_atomic(target, "{}\n")
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # as open(path, "w") keeps it
    write_atomic(tmp_path / "new.json", "{}")
    mask = os.umask(0o022)
    os.umask(mask)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o666 & ~mask


@pytest.mark.parametrize("name", ["-", "/dev/stdout"])
def test_dash_and_dev_stdout_write_the_page_to_standard_output(tmp_path, name, capsys):
    code, out, _ = _cli(["report", str(_report_dir(tmp_path)), "--html", name], capsys)
    assert code == 0 and out.lstrip().lower().startswith("<!doctype html") and "Memory report," not in out
    with pytest.raises(ValueError, match="character device"):  # a device named any other way is refused
        check_output_target(os.devnull, argument="--html")


# ------------------------------------------------------------------------------------ 2. CLI: one line, exit 2
def _deep_kwargs() -> str:
    return "[" * 60_000 + "]" * 60_000


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["estimate", "--model", "llama-7b", "--seq-len", "512", "--max-micro-batch", "--memory-budget", "1e308TiB"],
         "--memory-budget: '1e308TiB' is more than"),
        (["plan", "--model", "llama-7b", "--seq-len", "512", "--hardware", "h100", "--host-memory", "1e308TiB"],
         "--host-memory: '1e308TiB' is more than"),
        (["estimate", "--model", "torch.nn:Linear", "--seq-len", "8", "--model-kwargs", _deep_kwargs()],
         "--model-kwargs="),
        (["estimate", "--model", "gpt2", "--seq-len", "4096"], "--seq-len=4096: seq_len=4096 exceeds the 1,024 learned"),
    ],
    ids=["budget-1e308TiB", "host-memory-1e308TiB", "model-kwargs-60000-deep", "gpt2-seq-4096"],
)
def test_cli_input_faults_are_one_line_naming_the_argument(argv, needle, capsys):
    code, _, err = _cli(argv, capsys)
    line = _one_error_line(err)
    assert code == 2 and needle in line, line


_ERRNOS = sorted(errno.errorcode)


@pytest.mark.parametrize("fault", ["MemoryError", "RecursionError", *(f"errno-{e}" for e in _ERRNOS)])
def test_cli_resource_faults_are_one_line_for_every_errno(tmp_path, fault, capsys, monkeypatch):
    from lightning_memplan.cli import report as report_cli

    def broken(*_: Any, **__: Any) -> Any:
        if fault == "MemoryError":
            raise MemoryError
        if fault == "RecursionError":
            raise RecursionError("maximum recursion depth exceeded")
        number = int(fault.split("-")[1])
        raise OSError(number, os.strerror(number), str(tmp_path / "page.html"))

    monkeypatch.setattr(report_cli, "_print", broken)
    code, _, err = _cli(["report", str(_report_dir(tmp_path)), "--html", str(tmp_path / "page.html")], capsys)
    line = _one_error_line(err)
    assert code == 2 and line.startswith("lightning-memplan report: error: ")
    if fault.startswith("errno"):
        assert "--html=" in line and errno.errorcode[int(fault.split("-")[1])] in line


def _run_cli(argv: list[str], *, limits: dict[int, int] | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    def set_limits() -> None:  # pragma: no cover - the child
        for kind, value in (limits or {}).items():
            resource.setrlimit(kind, (value, value))

    code = "import sys; from lightning_memplan.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=timeout,
                          env=env, preexec_fn=set_limits, check=False)


def _last_line(err: str) -> str:
    # native libraries may print their own lines while importing (torchao's optional kernels); ours is the last
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and "Traceback" not in err, err
    return lines[-1]


def test_a_file_size_limit_is_one_line_naming_the_output(tmp_path):
    folder = _report_dir(tmp_path)
    done = _run_cli(["report", str(folder), "--html", str(tmp_path / "page.html")],
                    limits={resource.RLIMIT_FSIZE: 4096})
    line = _last_line(done.stderr)
    assert done.returncode == 2 and "EFBIG" in line and "--html=" in line and "ulimit -f" in line
    assert not (tmp_path / "page.html").exists() and _temps(tmp_path) == []


def test_a_low_address_space_limit_is_one_line():
    done = _run_cli(["estimate", "--model", "llama-7b", "--seq-len", "4096"], limits={resource.RLIMIT_AS: 300 * 2**20})
    line = _last_line(done.stderr)
    assert done.returncode == 2 and line.startswith("lightning-memplan") and "ulimit -v" in line


@contextlib.contextmanager
def _tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "tiny"
    mount.mkdir()
    if not ROOT:
        pytest.skip("needs root: mounting a tmpfs")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,nr_inodes=4", "tmpfs", str(mount)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_an_inode_exhausted_disk_is_one_line(tmp_path, capsys):
    folder = _report_dir(tmp_path)
    with _tiny_tmpfs(tmp_path) as mount:
        for i in range(10):  # use up the inodes (the root folder holds one)
            with contextlib.suppress(OSError):
                (mount / f"f{i}").write_text("")
        code, _, err = _cli(["report", str(folder), "--html", str(mount / "page.html")], capsys)
        line = _one_error_line(err)
        assert code == 2 and "ENOSPC" in line and "--html=" in line and "df -i" in line


# ------------------------------------------------------------------------------------ 3. passing faults
@pytest.mark.parametrize("number", [errno.EMFILE, errno.EINTR, errno.EAGAIN, errno.ENOMEM])
def test_a_transient_error_never_moves_a_valid_report_aside(tmp_path, number, monkeypatch):
    from lightning_memplan import files

    write_report(synthetic_report(epochs=1), tmp_path, png=False, html=False)
    before = (tmp_path / "memory_report.json").read_bytes()
    real_open = os.open

    def flaky(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        if str(path).endswith("memory_report.json") and not flags & os.O_CREAT:
            raise OSError(number, os.strerror(number), str(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(files.os, "open", flaky)
    with pytest.warns(UserWarning, match="cannot be read now.*this write is skipped"):
        merged, written = write_report(synthetic_report(epochs=2), tmp_path, png=False, html=False, errors="warn")
    assert written.json is None and (tmp_path / "memory_report.json").read_bytes() == before
    assert not list(tmp_path.glob("*.corrupt*"))
    monkeypatch.setattr(files.os, "open", real_open)  # the fault passes: the next write keeps every epoch
    write_report(synthetic_report(epochs=2), tmp_path, png=False, html=False)
    assert len(load_report(tmp_path).epochs) == 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_real_emfile_in_a_child_leaves_the_report_in_place(tmp_path):
    write_report(synthetic_report(epochs=1), tmp_path, png=False, html=False)
    before = (tmp_path / "memory_report.json").read_bytes()

    def child() -> str:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        fds = []
        with contextlib.suppress(OSError):
            while True:
                fds.append(os.open(os.devnull, os.O_RDONLY))
        for fd in fds[-1:]:  # one descriptor free: the lock takes it, the read finds none
            os.close(fd)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            write_report(synthetic_report(epochs=2), tmp_path, png=False, html=False, errors="warn")
        return " | ".join(str(w.message) for w in caught)

    assert "this write is skipped" in _as_user(0, child, gid=0, umask=0o022)
    assert (tmp_path / "memory_report.json").read_bytes() == before and not list(tmp_path.glob("*.corrupt*"))


def test_corrupt_copies_are_kept_under_unique_names(tmp_path):
    contents = [b"{not json", b'{"format_version": 1, "epochs": 5}', b"[1, 2]"]
    for content in contents:
        (tmp_path / "memory_report.json").write_bytes(content)
        with pytest.warns(UserWarning, match="it was moved to"):
            write_report(synthetic_report(epochs=1), tmp_path, png=False, html=False)
    kept = sorted(p.read_bytes() for p in tmp_path.glob("memory_report.json.corrupt*"))
    assert kept == sorted(contents)  # every bad file, none overwritten


def test_run_numbers_stay_inside_what_the_reader_accepts(tmp_path):
    last = synthetic_report(epochs=1)
    epoch = last.epochs[0]
    at_the_top = MemoryReport(run=last.run, epochs=(epoch.__class__(**{**epoch.__dict__, "run": 2**63 - 1, "run_id": "old"}),),
                              current_run=2**63 - 1, current_run_id="old")
    write_report(at_the_top, tmp_path, png=False, html=False)
    restored = load_report(tmp_path)  # what a resumed callback holds
    assert restored.current_run == 2**63 - 1
    nxt = restored.new_run().with_epoch(epoch)  # the next fit of that callback: run 2**63 before the fix
    write_report(nxt, tmp_path, png=False, html=False)
    again = load_report(tmp_path)  # readable (before: run 2**63, which the reader refuses), both fits kept
    assert len(again.epochs) == 2 and {e.run_id for e in again.epochs} == {"old", nxt.current_run_id}
    assert max(e.run for e in again.epochs) < 2**63 and nxt.current_run < 2**63


def test_a_busy_lock_skips_the_write_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(report_io, "LOCK_TIMEOUT_S", 0.2)
    monkeypatch.setattr(report_io, "folder_lock",
                        lambda d, n: folder_lock(d, n, timeout_s=0.2))
    write_report(synthetic_report(epochs=1), tmp_path, png=False, html=False)
    before = (tmp_path / "memory_report.json").read_bytes()
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with folder_lock(tmp_path, ".memory_report.lock") as state:
            assert state is LockState.HELD
            held.set()
            release.wait(30)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(30)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            write_report(synthetic_report(epochs=2), tmp_path, png=False, html=False, errors="warn")
    finally:
        release.set()
        thread.join()
    assert len(caught) == 1 and "held the folder's lock" in str(caught[0].message)
    assert (tmp_path / "memory_report.json").read_bytes() == before


# ------------------------------------------------------------------------------------ 4. locks between users
def _write_epochs(folder: str, epochs: list[int]) -> int:
    from lightning_memplan.report.records import EpochReport, StepRecord, summarize_rank

    report = MemoryReport()
    for epoch in epochs:
        summary = summarize_rank([StepRecord(step=epoch, epoch=epoch, rank=0, measured_peak=1000 + epoch)], rank=0,
                                 epoch=epoch, backend="cpu")
        report = report.with_epoch(EpochReport(epoch=epoch, ranks=(summary,)))
        write_report(report, folder, png=False, html=False)
    return len(epochs)


@needs_root
def test_two_users_writing_one_shared_folder_keep_every_epoch(open_tmp):
    shared = open_tmp / "shared"
    shared.mkdir()
    os.chown(shared, 0, GROUP)
    shared.chmod(0o2770)  # a group's folder: both users write it (umask 002: the report files are group-writable)
    lock = shared / ".memory_report.lock"  # left by an earlier writer whose umask was 022 (what the package made)
    lock.touch()
    os.chown(lock, OTHER, GROUP)
    lock.chmod(0o644)
    children = [_start_as_user(uid, _write_epochs, str(shared), list(range(k, 80, 2)))
                for k, uid in enumerate((OTHER, THIRD))]  # both write at once
    assert [_result_of(*child) for child in children] == [40, 40]
    assert [e.epoch for e in load_report(shared).epochs] == list(range(80))  # both took turns on one lock


@needs_root
def test_a_user_who_may_only_read_the_folder_cannot_stall_its_writer(open_tmp):
    folder = open_tmp / "private"
    folder.mkdir()
    os.chown(folder, OTHER, GROUP)
    folder.chmod(0o755)  # others may read, only its owner writes
    open_tmp.chmod(0o755)
    assert _as_user(OTHER, _write_epochs, str(folder), [0]) == 1

    def hold_lock() -> str:
        import fcntl

        try:
            fd = os.open(folder / ".memory_report.lock", os.O_RDONLY)
        except PermissionError:
            return "refused"
        fcntl.flock(fd, fcntl.LOCK_EX)
        return "held"

    assert _as_user(THIRD, hold_lock) == "refused"  # the lock is 0600: only those who write may take turns


# ------------------------------------------------------------------------------------ 5. input rules on read
def _report_json(tmp_path: Path, mutate: Callable[[dict[str, Any]], Any] | None = None, text: str | None = None) -> Path:
    path = tmp_path / "memory_report.json"
    if text is None:
        data = synthetic_report(ranks=2, epochs=2).to_dict()
        if mutate is not None:
            mutate(data)
        text = json.dumps(data)
    path.write_text(text)
    return path


def _series(data: dict[str, Any], value: Any) -> None:
    data["epochs"][0]["ranks"][0]["series"]["measured_peak"][0] = value


def _component(data: dict[str, Any], name: str) -> None:
    comps = data["epochs"][0]["ranks"][0]["estimated_components"]
    comps[name] = comps.pop("params")


BAD_READS: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "duplicate-rank": (lambda d: d["epochs"][0]["ranks"].append(d["epochs"][0]["ranks"][0]), "ranks (by rank) holds 0 twice"),
    "duplicate-epoch": (lambda d: d["epochs"].append(d["epochs"][0]), "epochs (by run and epoch) holds (0, 0) twice"),
    "format-version-0": (lambda d: d.update(format_version=0), "format_version=0"),
    "format-version--1": (lambda d: d.update(format_version=-1), "format_version=-1"),
    "format-version-newer": (lambda d: d.update(format_version=99), "format_version=99"),
    "series-string": (lambda d: _series(d, "123"), "measured_peak[0]='123' must be an integer"),
    "series-negative": (lambda d: _series(d, -3), "measured_peak[0]=-3 must be in [0, 2**63)"),
    "component-Params": (lambda d: _component(d, "Params"), "has the key 'Params'"),
    "component-zero-width": (lambda d: _component(d, "params\u200b"), "has the key 'params\\u200b'"),
    "component-rtl": (lambda d: _component(d, "par\u202eams"), "has the key 'par\\u202eams'"),
    "component-markup": (lambda d: _component(d, "[bold]params"), "has the key '[bold]params'"),
}


@pytest.mark.parametrize("case", list(BAD_READS))
def test_the_reader_refuses_with_the_file_and_the_field(tmp_path, case):
    mutate, needle = BAD_READS[case]
    path = _report_json(tmp_path, mutate)
    with pytest.raises(ValueError) as info:
        load_report(path)
    assert str(path) in str(info.value) and needle in str(info.value), str(info.value)


@pytest.mark.parametrize("text", ['{"format_version": 4, "epochs": [], "epochs": []}', '{"a": {"b": 1, "b": 2}}'])
def test_duplicate_json_keys_are_refused(tmp_path, text):
    (tmp_path / "x.json").write_text(text)
    with pytest.raises(ValueError, match="appears twice"):
        read_json(tmp_path / "x.json")


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 10**30])
def test_non_finite_numbers_anywhere_in_a_restored_report_are_refused(value):
    data = synthetic_report(epochs=1).to_dict()
    data["run"]["anything"] = {"deep": [value]}
    with pytest.raises(ValueError, match="run holds"):
        MemoryReport.from_dict(data)


def test_a_right_to_left_override_never_reaches_the_page():
    from lightning_memplan.report.html import render_html

    report = synthetic_report(epochs=1)
    report = MemoryReport(run={**report.run, "model": "Net\u202egnp.exe"}, epochs=report.epochs)
    page = render_html(report)
    assert "\u202e" not in page and "Net\ufffdgnp.exe" in page
    assert html_text("a\u2066b\u2069") == "a\ufffdb\ufffd"


# ------------------------------------------------------------------------------------ 6. bounded work
def test_a_report_of_a_million_ranks_is_refused_before_any_summary_is_built(tmp_path, monkeypatch):
    text = json.dumps({"format_version": 4, "epochs": [{"epoch": 0, "ranks": [{"rank": i, "epoch": 0} for i in range(10**6)]}]})
    (tmp_path / "memory_report.json").write_text(text)
    built = []
    monkeypatch.setattr(RankSummary, "from_dict", classmethod(lambda cls, d: built.append(d)))
    with pytest.raises(ValueError, match=r"1,000,000 rank summaries, more than the"):
        load_report(tmp_path)
    assert built == []


def test_a_large_epoch_is_kept_within_the_caps_and_its_tables_summarised(tmp_path):
    from lightning_memplan.report.records import EpochReport
    from lightning_memplan.report.render import render_markdown

    ranks = tuple(RankSummary(rank=i, epoch=0, measured_peak=10_000 + (i * 7919) % 65_537, headroom=10**6 - i)
                  for i in range(MAX_EPOCH_RANKS + 100))
    report = MemoryReport().with_epoch(EpochReport(epoch=0, ranks=ranks))
    kept = report.epochs[0].ranks
    assert len(kept) == MAX_EPOCH_RANKS and kept[0].rank == 0 and any("left out" in n for n in report.notes)
    largest = max(ranks, key=lambda r: r.measured_peak or 0)
    assert largest in kept and min(ranks, key=lambda r: r.headroom or 0) in kept
    shown = representative_ranks(ranks, 64)
    assert len(shown) == 64 and largest in shown
    md = render_markdown(MemoryReport().with_epoch(EpochReport(epoch=0, ranks=ranks[:1000])))
    assert "64 of 1,000 ranks listed" in md and md.count("\n| ") < 200


def test_a_deep_config_is_answered_without_building_every_block(monkeypatch):
    pytest.importorskip("transformers")
    from lightning_memplan.model import estimate_memory, hf_build
    from lightning_memplan.model.specs import ModelSpec, TrainSpec

    def no_full_build(*_: Any, **__: Any) -> Any:
        raise AssertionError("the full-depth model was built")

    cfg = {"model_type": "gpt2", "n_layer": 65_536, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 64}
    monkeypatch.setenv("LIGHTNING_MEMPLAN_HF_TRACE_CACHE", "0")
    monkeypatch.setattr(hf_build, "full_model", no_full_build)
    est = estimate_memory(ModelSpec.from_hf_config(cfg), TrainSpec(micro_batch=1, seq_len=16, precision="32-true"))
    one, two = (ModelSpec.from_hf_config({**cfg, "n_layer": n}).num_params for n in (1, 2))
    assert est.source == "hf_trace" and est.details["traced_params"] == one + (65_536 - 1) * (two - one)


def test_a_deep_config_of_mixed_blocks_is_refused_naming_the_bound():
    pytest.importorskip("transformers")
    from lightning_memplan.model.hf_build import FULL_BUILD_LAYERS, deep_stack_check

    cfg = {"model_type": "gemma3_text", "num_hidden_layers": 65_536, "hidden_size": 32, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 64, "intermediate_size": 64, "sliding_window": 8,
           "sliding_window_pattern": 6, "max_position_embeddings": 128}
    with pytest.raises(ValueError, match=rf"deeper than the {FULL_BUILD_LAYERS} blocks.*2 kinds"):
        deep_stack_check(cfg, attention="sdpa")


# ------------------------------------------------------------------------------------ 7. sequence length
def test_a_sequence_beyond_learned_positions_is_warned_and_rope_is_not_bound():
    from lightning_memplan.model import estimate_memory
    from lightning_memplan.model.specs import ModelSpec, TrainSpec

    with pytest.warns(UserWarning, match=r"seq_len=4096 exceeds the 1,024 learned positions of gpt2.*seq_len <= 1024"):
        estimate_memory(ModelSpec.preset("gpt2"), TrainSpec(micro_batch=1, seq_len=4096))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no word at the table's length, nor for RoPE at any length
        assert estimate_memory(ModelSpec.preset("gpt2"), TrainSpec(micro_batch=1, seq_len=1024)).total > 0
        llama = ModelSpec.preset("llama-7b")
        assert estimate_memory(llama, TrainSpec(micro_batch=1, seq_len=8 * (llama.max_positions or 4096))).total > 0
