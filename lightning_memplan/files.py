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

What is replaced (:func:`check_output_target`, run by every write before its temporary is made and again
just before the rename): a new name, or a regular file the caller could open for writing itself (the
rule of ``open(path, "w")``: ``os.access(W_OK)`` on the effective ids; root passes it, as with ``open``).
Refused, with a ``ValueError`` naming the path and nothing made or replaced: a folder, a FIFO, a socket or
a device node (``--html /dev/null`` never replaces the system's ``/dev/null``), a file the caller cannot
write, a file or link of another user in a sticky folder (what ``rename(2)`` refuses to anyone but root,
and Linux's ``fs.protected_regular`` refuses to root's ``open``), a link of another user, and a path
under a file. A replaced file keeps its permission bits, as ``open(path, "w")`` keeps them, and (when
run as root) its owner and group; a non-root caller replacing a file another user let it write becomes
its owner (``rename`` cannot give a file away), with the same bits.

Reading (:func:`read_json`) refuses duplicate keys in an object (JSON leaves them undefined, Python keeps
the last). A fault of the moment while opening or reading (``EMFILE``, ``ENFILE``, ``EINTR``, ``EAGAIN``,
``ENOMEM``, ``ENOBUFS``) is an ``OSError`` (:func:`is_transient`), never a ``ValueError``: the file may be
perfectly good, and a caller that moves a bad file aside must not move it.

Locking (:func:`folder_lock`): ``fcntl.flock`` on a lock file in the folder, opened read-only
(``flock`` needs no write access, so every user who writes the folder takes turns on one file, whoever made
it) with ``O_NOFOLLOW | O_NONBLOCK`` and used only when it is a regular file. A new lock file is readable by
exactly the classes of users that can write the folder (``0o600``, plus ``g+r``/``o+r`` for a group- or
other-writable folder, whatever the umask), so a user who may only read the folder cannot take the lock
and stall the writers. The wait is bounded (:data:`LOCK_TIMEOUT_S`): on timeout the caller is told
(:attr:`LockState.BUSY`) and skips its write (the report is written again, whole, at its next write).

Names (:func:`safe_component`): a logger's name or version made into one harmless path component.
"""

from __future__ import annotations

import contextlib
import enum
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
    "STDOUT_NAMES",
    "TRANSIENT_ERRNOS",
    "LockState",
    "atomic_file",
    "check_output_target",
    "clean_stale_temps",
    "folder_lock",
    "is_stdout",
    "is_transient",
    "json_default",
    "json_depth",
    "parse_json_text",
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
#: How long (seconds) a writer waits for another writer's lock; then :func:`folder_lock` says
#: :attr:`LockState.BUSY` and the caller skips its write (a monitoring write never stalls the run for longer).
LOCK_TIMEOUT_S = 10.0
#: Output names that mean the process's standard output to the command line (``--html -``).
STDOUT_NAMES = ("-", "/dev/stdout")
#: ``errno`` values of a fault of the moment (no descriptor or memory left, an interrupted or would-block
#: call): the file may be good, so it is never judged by them (:func:`is_transient`).
TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.EINTR, errno.EAGAIN, errno.EWOULDBLOCK,
                              errno.ENOMEM, errno.ENOBUFS})

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


if hasattr(os, "register_at_fork"):  # a forked child (a worker that may set its own umask) reads it afresh
    os.register_at_fork(after_in_child=_umask.cache_clear)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a fault of the moment (:data:`TRANSIENT_ERRNOS`, or ``MemoryError``), not a
    verdict on the file."""
    return isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS)


def is_stdout(path: Any) -> bool:
    """Whether an output argument names standard output (:data:`STDOUT_NAMES`)."""
    return isinstance(path, str) and path in STDOUT_NAMES


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def _euid() -> int | None:
    return os.geteuid() if hasattr(os, "geteuid") else None


def _check_folder(path: Path, shown: str) -> os.stat_result | None:
    """The status of ``path``'s folder (``None`` when it does not exist yet: it will be made); a file
    where a folder of the path should be is refused."""
    for parent in (path.parent, *path.parent.parents):
        try:
            info = os.stat(parent)
        except FileNotFoundError:
            continue
        except NotADirectoryError:
            continue  # a file further up: the first existing component below says which
        if not stat.S_ISDIR(info.st_mode):
            raise ValueError(f"{shown} lies under {os.fspath(parent)!r}, which is a file, not a folder; pass a path in a "
                             "folder")
        return info if parent == path.parent else None
    return None


def _writable(path: Path) -> bool:
    effective = os.access in os.supports_effective_ids
    return os.access(path, os.W_OK, effective_ids=effective)


def check_output_target(path: str | os.PathLike[str], *, argument: str = "path") -> os.stat_result | None:
    """Whether ``path`` may be (re)placed by a write (module docstring, "What is replaced"): ``None`` for a
    new name or the caller's own symbolic link (replaced, never followed), the file's status for a regular
    file the caller could open for writing itself.

    Raises:
        ValueError: a folder, device, FIFO or socket; a file the caller cannot write; another user's file or
            link in a sticky folder, or another user's link anywhere; a path under a file. The message names
            ``argument``, the path and the fix. Nothing is made or changed.
    """
    path = Path(path)
    shown = _shown(argument, path)
    folder = _check_folder(path, shown)
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    fix = "choose another file name"
    for test, kind in _KINDS:
        if test(info.st_mode):
            raise ValueError(f"{shown} is {kind}, not a regular file: only a regular file or a new name is written; {fix}")
    euid = _euid()
    foreign = euid is not None and info.st_uid != euid
    if foreign and folder is not None and folder.st_mode & stat.S_ISVTX and folder.st_uid != euid:
        raise ValueError(f"{shown} belongs to another user (uid {info.st_uid}) in a sticky folder, which only its owner "
                         f"may replace; {fix}")
    if stat.S_ISLNK(info.st_mode):
        if foreign:
            raise ValueError(f"{shown} is a symbolic link of another user (uid {info.st_uid}); it is neither followed "
                             f"nor replaced; {fix}")
        return None
    if not _writable(path):
        raise ValueError(f"{shown} is not writable by you (mode {stat.S_IMODE(info.st_mode):#o}, owner uid "
                         f"{info.st_uid}), so open(path, 'w') would refuse it too; {fix}, or make it writable")
    return info


def _keep_owner(fd: int, target: os.stat_result) -> None:
    """Give the new file ``target``'s owner and group where the caller may (root: both; others: the group
    when they belong to it), as writing the file in place would have kept them."""
    if not hasattr(os, "fchown"):
        return
    euid = _euid()
    with contextlib.suppress(OSError):
        if euid == 0:
            os.fchown(fd, target.st_uid, target.st_gid)
        elif target.st_gid != os.getegid():
            os.fchown(fd, -1, target.st_gid)


@contextlib.contextmanager
def atomic_file(
    path: str | os.PathLike[str], *, mode: int | None = None, argument: str = "path"
) -> Iterator[IO[bytes]]:
    """``with atomic_file(p) as fh: fh.write(...)``: ``fh`` is a binary file open on a fresh temporary in
    ``p``'s folder (see the module docstring); on success it is fsynced and replaces ``p``, on an exception
    it is removed and ``p`` is untouched. Stale temporaries of ``p`` are cleaned first.

    Args:
        path: the target file (its folder is created when missing): a new name or a file the caller may
            replace (:func:`check_output_target`, checked before the temporary is made and again before the
            rename).
        mode: the file's permission bits (default: the replaced file's, else ``0o666`` less the process
            umask, what ``open`` gives).
        argument: the name shown in a refusal's message.

    Raises:
        ValueError: the target is refused (:func:`check_output_target`); no temporary is left.
        OSError: the folder cannot be made or written.
    """
    path = Path(path)
    target = check_output_target(path, argument=argument)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp{os.getpid()}.", dir=path.parent)
    try:
        if target is not None and mode is None:
            _keep_owner(fd, target)
        if hasattr(os, "fchmod"):  # mkstemp makes 0o600; a report is as readable as any file the run writes
            bits = mode if mode is not None else stat.S_IMODE(target.st_mode) & 0o777 if target is not None else None
            os.fchmod(fd, 0o666 & ~_umask() if bits is None else bits)
        with os.fdopen(fd, "wb") as fh:
            fd = -1  # owned by fh now
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        check_output_target(path, argument=argument)  # what may have been put there meanwhile
        os.replace(tmp, path)
    except BaseException as exc:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename is None and exc.errno is not None:  # a write's EFBIG, ENOSPC
            raise type(exc)(exc.errno, exc.strerror, os.fspath(path)) from exc
        raise


def write_atomic(
    path: str | os.PathLike[str], data: str | bytes, *, mode: int | None = None, argument: str = "path"
) -> None:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically (see :func:`atomic_file`)."""
    with atomic_file(path, mode=mode, argument=argument) as fh:
        fh.write(data.encode("utf-8") if isinstance(data, str) else data)


class LockState(enum.Enum):
    """What :func:`folder_lock` got: ``HELD`` (the only truthy state), ``BUSY`` (another writer held it for the
    whole wait: the caller skips its write) or ``UNAVAILABLE`` (no locking here: no ``fcntl``, a filesystem
    without ``flock``, a lock name that is not a regular file or that this user cannot open; the caller
    writes without it, each file still replaced atomically)."""

    HELD = "held"
    BUSY = "busy"
    UNAVAILABLE = "unavailable"

    def __bool__(self) -> bool:
        return self is LockState.HELD


def _lock_mode(folder: os.stat_result) -> int:
    # Readable by exactly the classes of users that can write the folder (flock needs read access only).
    return 0o600 | (0o040 if folder.st_mode & 0o020 else 0) | (0o004 if folder.st_mode & 0o002 else 0)


def _open_lock(directory: str | os.PathLike[str], name: str) -> int | None:
    """A read-only descriptor on the folder's lock file (made when missing), or ``None`` when it cannot be
    used (module docstring). Never opened through a link, never waited on (``O_NONBLOCK``)."""
    path = os.path.join(directory, name)
    flags = os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC
    try:
        os.makedirs(directory, exist_ok=True)
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
            with contextlib.suppress(OSError, AttributeError):
                os.fchmod(fd, _lock_mode(os.stat(directory)))
        except FileExistsError:
            fd = os.open(path, flags)  # someone's lock (no O_CREAT: fs.protected_regular allows it)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


@contextlib.contextmanager
def folder_lock(
    directory: str | os.PathLike[str], name: str, *, timeout_s: float = LOCK_TIMEOUT_S
) -> Iterator[LockState]:
    """Hold an exclusive ``fcntl.flock`` on ``<directory>/<name>`` for the ``with`` block (module docstring,
    "Locking"); yields a :class:`LockState`, truthy only when the lock is held. The wait for another writer is
    at most ``timeout_s`` seconds; then the block runs with :attr:`LockState.BUSY`, and the caller should skip
    its write. Without a usable lock it runs with :attr:`LockState.UNAVAILABLE`: a write never hangs."""
    try:
        import fcntl
    except ImportError:
        yield LockState.UNAVAILABLE
        return
    fd = _open_lock(directory, name)
    if fd is None:
        yield LockState.UNAVAILABLE
        return
    try:
        deadline = time.monotonic() + timeout_s
        state = LockState.BUSY
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                state = LockState.HELD
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.01)
            except OSError:
                state = LockState.UNAVAILABLE  # a filesystem without locks
                break
        yield state
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
        if is_transient(exc):  # the file may be good: the caller must not judge it by this
            raise OSError(exc.errno, f"{shown} cannot be opened now ({exc.strerror or exc}); try again", os.fspath(path)) from None
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
        if is_transient(exc):
            raise OSError(exc.errno, f"{shown} cannot be read now ({exc.strerror or exc}); try again", os.fspath(path)) from None
        raise ValueError(f"{shown} cannot be read ({exc.strerror or exc}); pass {what}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise ValueError(f"{shown} holds more than the {max_bytes:,d} bytes read here; pass {what}")
    return data


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # unrolled: no alternation per character
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_depth(text: str) -> int:
    """The deepest bracket nesting of JSON ``text`` (brackets inside strings do not count); linear time and
    no recursion, so it can run before ``json.loads`` (whose C parser recurses once per level)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0)


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


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"the key {key[:80]!r} appears twice in one object (which one counts is undefined)")
            seen.add(key)
    return out


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
            not JSON, nested deeper than ``max_depth``, a non-finite number, an integer beyond 64 bits or a
            key twice in one object; the message names ``argument``, the path and ``what`` was expected.
        OSError: a fault of the moment (:func:`is_transient`) while opening or reading: says nothing about
            the file.
    """
    shown = _shown(argument, path)
    data = _read_regular(path, max_bytes=max_bytes, follow_links=follow_links, shown=shown, what=what)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{shown} is not UTF-8 text ({exc.reason} at byte {exc.start}); pass {what}") from None
    return _loads(text, shown=shown, what=what, max_depth=max_depth)


def parse_json_text(text: str, *, argument: str, what: str = "JSON", max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(text)`` under :func:`read_json`'s rules (depth checked before parsing, finite numbers,
    64-bit integers, no key twice): for JSON given on the command line (``--model-kwargs``).

    Raises:
        ValueError: names ``argument``, a prefix of ``text`` and the rule broken.
    """
    return _loads(text, shown=f"{argument}={text[:60]!r}{'...' if len(text) > 60 else ''}", what=what, max_depth=max_depth)


def _loads(text: str, *, shown: str, what: str, max_depth: int) -> Any:
    depth = json_depth(text)
    if depth > max_depth:
        raise ValueError(f"{shown} is nested {depth} deep, more than the {max_depth} parsed here; pass {what}")
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_bounded_int,
                          object_pairs_hook=_unique_keys)
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
