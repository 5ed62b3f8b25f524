"""Atomic file writes, the one helper every file memplan writes goes through (the report's JSON, Markdown,
HTML and PNG, and memplan_auto's ``memplan_plan.json``).

Atomic means: write a temporary file ``.<name>.tmp<pid>`` in the same directory, flush and fsync it, then
``os.replace`` it over the target (POSIX ``rename(2)`` replaces the target in one step, see
https://docs.python.org/3/library/os.html#os.replace). A crash or ``SIGKILL`` in the middle leaves the
previous complete file, never a torn one; the temporary file it leaves behind is removed by the next
write to the same target (:func:`clean_stale_temps`), once the process that wrote it is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["STALE_TEMP_AGE_S", "atomic_target", "clean_stale_temps", "temp_path", "write_atomic"]

#: A temporary file this old (seconds) is stale even if a process with its PID exists (PIDs are reused,
#: and a file on a shared filesystem may come from another host).
STALE_TEMP_AGE_S = 3600.0


def temp_path(path: str | os.PathLike[str], pid: int | None = None) -> Path:
    """The temporary file a write of ``path`` by process ``pid`` (default: this one) goes through."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp{os.getpid() if pid is None else pid}")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists but is not ours (or cannot be asked): leave its file alone
    return True


def clean_stale_temps(path: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary files earlier writes of ``path`` left behind (their process died mid-write,
    or they are older than :data:`STALE_TEMP_AGE_S`). Returns the removed paths."""
    path = Path(path)
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.tmp(\d+)$")
    removed: list[Path] = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        match = pattern.match(entry.name)
        if match is None or int(match.group(1)) == os.getpid():
            continue
        try:
            old = now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_AGE_S
            if old or not _alive(int(match.group(1))):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except OSError:
            continue  # removed by someone else meanwhile
    return removed


@contextlib.contextmanager
def atomic_target(path: str | os.PathLike[str]) -> Iterator[Path]:
    """``with atomic_target(p) as tmp: <write tmp>``: on success ``tmp`` is fsynced and replaces ``p``;
    on an exception ``tmp`` is removed and ``p`` is untouched. Stale temporaries of ``p`` are cleaned first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(path)
    tmp = temp_path(path)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically (see the module docstring)."""
    with atomic_target(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
