"""Files memplan writes and reads: the one writer, the one JSON reader, the report folder's lock and path
components from names (CWE-59 and CWE-22 are what these habits prevent; CPython's ``tempfile``).

Writing (:func:`write_atomic`, :func:`atomic_file`): the data goes to a fresh temporary file made by
:func:`tempfile.mkstemp` in the target's folder (``O_CREAT | O_EXCL | O_NOFOLLOW``, a random name
``.<name>.tmp<pid>.<random>``: a link planted at a guessable name is never opened), is flushed and fsynced,
then ``os.replace``\\ d over the target (POSIX ``rename(2)`` swaps the directory entry, so a link at the
target is replaced, never followed; https://docs.python.org/3/library/os.html#os.replace). A crash or
``SIGKILL`` mid-write leaves the previous complete file, never a torn one; its temporary file is removed by
the next write to the same target (:func:`clean_stale_temps`) once the process that wrote it is gone. The
pattern is pip's ``adjacent_tmp_file`` (``pip/_internal/utils/filesystem.py``) and CPython's ``tempfile``.

Reading (:func:`read_json`): ``os.open(O_NONBLOCK [| O_NOFOLLOW])`` then ``fstat``: regular files only (a
FIFO or a device is refused at once, never waited on), at most ``max_bytes`` read, UTF-8 only, the bracket
depth checked before the parser can recurse, and only finite numbers (no ``NaN``/``Infinity``/``1e400``,
integers within 64 bits). Every refusal is a ``ValueError`` that names the argument and the path.

Locking (:func:`folder_lock`): ``fcntl.flock`` on a lock file in the folder (opened ``O_NOFOLLOW``), so
the writers of one report folder read, merge and write one at a time.

Names (:func:`safe_component`): a logger's name or version made into one harmless path component.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import json
import math
import os
import re
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "LOCK_TIMEOUT_S",
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "STALE_TEMP_AGE_S",
    "atomic_file",
    "clean_stale_temps",
    "folder_lock",
    "json_default",
    "json_depth",
    "read_json",
    "safe_component",
    "write_atomic",
]

#: A temporary file this old (seconds) is stale even if a process with its PID exists (PIDs are reused,
#: and a file on a shared filesystem may come from another host).
STALE_TEMP_AGE_S = 3600.0
#: Largest JSON file :func:`read_json` reads by default (a memory report of thousands of epochs is a few MB).
MAX_JSON_BYTES = 64 * 2**20
#: Deepest bracket nesting :func:`read_json` parses (a memory report nests about 8 deep, a config.json 4).
MAX_JSON_DEPTH = 200
#: Largest magnitude of a JSON integer (a byte count fits a signed 64-bit integer).
_MAX_JSON_INT = 2**63
#: How long (seconds) a writer waits for another writer's lock before it writes without it (a monitoring
#: write never hangs the run).
LOCK_TIMEOUT_S = 60.0

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_BINARY = getattr(os, "O_BINARY", 0)


# ------------------------------------------------------------------------------------------ writing
def _temp_pattern(name: str) -> re.Pattern[str]:
    # ".<name>.tmp<pid>.<mkstemp's random part>"; the older ".<name>.tmp<pid>" is matched too
    return re.compile(rf"^\.{re.escape(name)}\.tmp(\d+)(?:\.[A-Za-z0-9_]+)?$")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError, OverflowError):
        return True  # exists but is not ours (or cannot be asked): leave its file alone
    return True


def clean_stale_temps(path: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary files earlier writes of ``path`` left behind (their process died mid-write,
    or they are older than :data:`STALE_TEMP_AGE_S`). Returns the removed paths.

    Only regular files and links are removed, each by its own name (``unlink`` never follows a link, and
    their status is read with ``lstat``); a folder or anything else with a temporary's name is left alone.
    """
    path = Path(path)
    pattern = _temp_pattern(path.name)
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
            info = entry.stat(follow_symlinks=False)
            if not (stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)):
                continue
            if now - info.st_mtime > STALE_TEMP_AGE_S or not _alive(int(match.group(1))):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except OSError:
            continue  # removed by someone else meanwhile
    return removed


@functools.cache
def _umask() -> int:
    # Read once (os.umask can only be read by setting it); pip's filesystem helpers do the same.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], *, mode: int | None = None) -> Iterator[IO[bytes]]:
    """``with atomic_file(p) as fh: fh.write(...)``: ``fh`` is a binary file open on a fresh temporary in
    ``p``'s folder (see the module docstring); on success it is fsynced and replaces ``p``, on an exception
    it is removed and ``p`` is untouched. Stale temporaries of ``p`` are cleaned first.

    Args:
        path: the target file (its folder is created when missing).
        mode: the file's permission bits (default: ``0o666`` less the process umask, what ``open`` gives).

    Raises:
        OSError: the folder cannot be made or written, or the target is a folder.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp{os.getpid()}.", dir=path.parent)
    try:
        if hasattr(os, "fchmod"):  # mkstemp makes 0o600; a report is as readable as any file the run writes
            os.fchmod(fd, 0o666 & ~_umask() if mode is None else mode)
        with os.fdopen(fd, "wb") as fh:
            fd = -1  # owned by fh now
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: str | os.PathLike[str], data: str | bytes, *, mode: int | None = None) -> None:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically (see :func:`atomic_file`)."""
    with atomic_file(path, mode=mode) as fh:
        fh.write(data.encode("utf-8") if isinstance(data, str) else data)


@contextlib.contextmanager
def folder_lock(directory: str | os.PathLike[str], name: str, *, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[bool]:
    """Hold an exclusive ``fcntl.flock`` on ``<directory>/<name>`` (created ``O_NOFOLLOW``) for the
    ``with`` block; yields whether the lock is held. Without ``fcntl`` (Windows), when the lock file
    cannot be made (a read-only folder: the write that follows fails and says so) or after ``timeout_s``
    of waiting for another writer, the block runs without it (``False``): a monitoring write never hangs."""
    try:
        import fcntl
    except ImportError:
        yield False
        return
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(os.path.join(directory, name), os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o666 & ~_umask())
    except OSError:
        yield False
        return
    try:
        deadline = time.monotonic() + timeout_s
        held = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.01)
            except OSError:
                break  # a filesystem without locks
        yield held
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def json_default(value: Any) -> Any:
    """``json.dumps(..., default=json_default)``: a NumPy scalar or a one-element (0-d) torch tensor
    becomes its Python number (``np.int64(2)`` -> ``2``, exact); anything else is a ``TypeError``, as
    without ``default`` (never a silent ``str``)."""
    module = type(value).__module__.split(".", 1)[0]
    item = getattr(value, "item", None)
    if module in ("numpy", "torch") and callable(item) and getattr(value, "ndim", 0) == 0:
        number = item()
        if isinstance(number, (bool, int, float, str)) or number is None:
            return number
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# ------------------------------------------------------------------------------------------ reading
def _shown(argument: str, path: str | os.PathLike[str]) -> str:
    return f"{argument}={os.fspath(path)!r}"


def _read_regular(path: str | os.PathLike[str], *, max_bytes: int, follow_links: bool, shown: str, what: str) -> bytes:
    flags = os.O_RDONLY | _NONBLOCK | _CLOEXEC | _BINARY | (0 if follow_links else _NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"{shown}: no such file; pass {what}", os.fspath(path)) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_links:
            raise ValueError(f"{shown} is a symbolic link, which is not followed here; pass {what} (a regular file)") from None
        raise ValueError(f"{shown} cannot be opened ({exc.strerror or exc}); pass {what}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file (a FIFO, socket or device)"
            raise ValueError(f"{shown} is {kind}; pass {what} (a regular file)")
        if info.st_size > max_bytes:
            raise ValueError(f"{shown} holds {info.st_size:,d} bytes, more than the {max_bytes:,d} read here; pass {what}")
        chunks: list[bytes] = []
        left = max_bytes + 1  # one byte more than allowed tells a file that grew while being read
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise ValueError(f"{shown} cannot be read ({exc.strerror or exc}); pass {what}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise ValueError(f"{shown} holds more than the {max_bytes:,d} bytes read here; pass {what}")
    return data


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_depth(text: str) -> int:
    """The deepest bracket nesting of JSON ``text`` (brackets inside strings do not count); linear time and
    no recursion, so it can run before ``json.loads`` (whose C parser recurses once per level)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(itertools.accumulate(_STEP[c] for c in brackets), default=0)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"the JSON constant {name} is not a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} exceeds the float range")
    return value


def _bounded_int(text: str) -> int:
    if len(text) > 20:  # 2**63 has 19 digits: longer is out of range (and never parsed digit by digit)
        raise ValueError(f"the integer {text[:20]}... exceeds 64 bits")
    value = int(text)
    if abs(value) >= _MAX_JSON_INT:
        raise ValueError(f"the integer {text} exceeds 64 bits")
    return value


def read_json(
    path: str | os.PathLike[str],
    *,
    what: str = "a JSON file",
    argument: str = "path",
    max_bytes: int = MAX_JSON_BYTES,
    max_depth: int = MAX_JSON_DEPTH,
    follow_links: bool = False,
) -> Any:
    """Parse the JSON file at ``path``: data only, nothing in it is executed (module docstring).

    Args:
        path: the file.
        what, argument: for the messages (``"{argument}={path!r} ...; pass {what}"``).
        max_bytes: the largest file read (checked on ``fstat`` first, so a huge or sparse file is not read).
        max_depth: the deepest bracket nesting parsed.
        follow_links: whether a symbolic link at ``path`` is followed (a user-named file such as a
            Hugging Face config.json, whose snapshot entries are links); files memplan wrote itself are
            read without following (``O_NOFOLLOW``).

    Raises:
        FileNotFoundError: no such file (the message names the path).
        ValueError: a link (unless followed), not a regular file, larger than ``max_bytes``, not UTF-8,
            not JSON, nested deeper than ``max_depth``, a non-finite number or an integer beyond 64 bits;
            the message names ``argument``, the path and ``what`` was expected.
    """
    shown = _shown(argument, path)
    data = _read_regular(path, max_bytes=max_bytes, follow_links=follow_links, shown=shown, what=what)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{shown} is not UTF-8 text ({exc.reason} at byte {exc.start}); pass {what}") from None
    depth = json_depth(text)
    if depth > max_depth:
        raise ValueError(f"{shown} is nested {depth} deep, more than the {max_depth} parsed here; pass {what}")
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_bounded_int)
    except RecursionError:  # cannot happen below max_depth; kept for a tiny recursion limit
        raise ValueError(f"{shown} is nested too deeply to parse; pass {what}") from None
    except ValueError as exc:  # JSONDecodeError is a ValueError, as is a refused number
        raise ValueError(f"{shown} is not valid JSON ({str(exc)[:200]}); pass {what}") from None


# ------------------------------------------------------------------------------------------ names
_UNSAFE = re.compile(r"[^A-Za-z0-9._+=@-]")
#: Longest component :func:`safe_component` returns (file systems allow 255 bytes).
_MAX_COMPONENT = 128


def safe_component(name: Any) -> str:
    """``name`` (a logger's name, version or run id) as one path component that stays inside its folder:
    every character outside ``[A-Za-z0-9._+=@-]`` (separators, NUL, controls, spaces) becomes ``_``,
    a leading dot becomes ``_`` (so no ``"."``, ``".."`` or hidden name), ``""`` becomes ``"_"``, at most 128
    characters. ``"../../outside"`` gives ``"_._.._outside"``; ``"version_3"`` is kept as it is."""
    text = _UNSAFE.sub("_", str(name))[:_MAX_COMPONENT]
    if text.startswith("."):
        text = "_" + text[1:]
    return text or "_"
