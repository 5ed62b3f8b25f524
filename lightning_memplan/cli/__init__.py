"""The ``lightning-memplan`` console script: ``estimate``, ``plan`` and ``report`` subcommands.

Each subcommand lives in its own module (its docstring is the subcommand's description) exposing
``add_arguments(parser)`` and ``run(args)``; :func:`build_parser` makes the subparsers, so the entry point
stays small and every command is testable alone.

Errors: every fault of the input or of the machine (a bad flag or file, ``MemoryError`` under a low
``ulimit -v``, ``RecursionError``, an ``OSError`` of any errno: a full disk, no inodes left, a file-size
limit) is one line on standard error, ``lightning-memplan <command>: error: ...``, naming the argument and
its value where one is to blame and the fix, with exit status 2; never a traceback. ``--help`` and
``--version`` exit 0. Set ``LIGHTNING_MEMPLAN_TRACEBACK=1`` to see the traceback of an unexpected error.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["build_parser", "main"]

#: Subcommand -> its line in ``lightning-memplan --help``.
_SUBCOMMANDS: dict[str, str] = {
    "estimate": "per-rank memory breakdown for a model, training setup and parallel plan",
    "plan": "choose dp/fsdp/tp/pp/cp, recompute and loss mode for a model on a cluster",
    "report": "render a saved memory_report.json (from MemoryPlanCallback) again",
}


#: Environment variable that lets an unexpected error's traceback through (for a bug report).
TRACEBACK_ENV = "LIGHTNING_MEMPLAN_TRACEBACK"


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line (the flag, its value and what to do), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_one_line(message)}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    from lightning_memplan._version import __version__

    parser = _Parser(
        prog="lightning-memplan",
        description="Per-rank training memory: estimate, plan a parallel layout, render a saved report.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(_SUBCOMMANDS) + "}",
                                parser_class=_Parser)
    for name, summary in _SUBCOMMANDS.items():
        command = importlib.import_module(f"lightning_memplan.cli.{name}")
        parser_of = sub.add_parser(
            name, help=summary, description=command.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        command.add_arguments(parser_of)
        parser_of.set_defaults(func=command.run)
    return parser


def _one_line(text: object) -> str:
    """``text`` as one terminal-safe line (no control characters, no line breaks), at most 2,000 characters."""
    flat = " ".join(str(text).split())
    return "".join(c if c.isprintable() else "\ufffd" for c in flat)[:2000]


def _argument_of(args: argparse.Namespace | None, filename: object) -> str | None:
    """The flag whose value is ``filename`` or names its folder (a temporary written beside ``--html``)."""
    if args is None or not isinstance(filename, str):
        return None
    folder = os.path.dirname(os.path.abspath(filename))
    for key, flag in _PATH_FLAGS.items():
        value = getattr(args, key, None)
        if isinstance(value, str) and value and (value == filename or os.path.dirname(os.path.abspath(value)) == folder):
            return flag
    return None


#: The flags that name files, by their argparse destination.
_PATH_FLAGS = {"html": "--html", "png": "--png", "path": "PATH", "model": "--model"}


#: What to do about an ``OSError``, by errno (the rest: check the path and the permissions).
_OS_FIXES = {
    errno.ENOSPC: "free space (or inodes: df -i) on that filesystem, or write elsewhere",
    errno.EDQUOT: "free space within your quota, or write elsewhere",
    errno.EFBIG: "raise the file-size limit (ulimit -f) or write elsewhere",
    errno.EROFS: "the filesystem is read-only; write elsewhere",
    errno.EACCES: "check the permissions, or write elsewhere",
    errno.EPERM: "check the permissions and the owner, or write elsewhere",
    errno.EMFILE: "too many open files: raise ulimit -n or try again",
    errno.ENFILE: "too many open files on the system: try again",
    errno.ENOMEM: "not enough memory: raise the memory limit or try again",
    errno.EPIPE: "the output was closed early",
}


def _message(exc: BaseException, args: argparse.Namespace | None) -> str:
    """One line for a fault of the input or the machine."""
    if isinstance(exc, MemoryError):
        return ("out of memory (MemoryError); raise the memory or address-space limit (ulimit -v), or ask for less "
                "(a smaller model, --seq-len or --micro-batch)")
    if isinstance(exc, RecursionError):
        return "an input is nested too deeply (RecursionError); pass a flatter JSON or model"
    if isinstance(exc, ImportError):
        return (f"a module could not be imported ({type(exc).__name__}: {exc}); check --model's pkg.module:Class and "
                "the installation, and raise the memory or address-space limit (ulimit -v) if it is set low")
    if isinstance(exc, OSError) and exc.errno is not None:
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        where = _argument_of(args, exc.filename)
        named = exc.filename is not None and repr(exc.filename) in str(exc.strerror)  # our own message names it
        shown = "" if named else f"{where}={exc.filename!r}: " if where else f"{exc.filename!r}: " if exc.filename else ""
        fix = _OS_FIXES.get(exc.errno, "check the path and its permissions")
        return f"{shown}{exc.strerror or exc} ({name}); {fix}"
    if isinstance(exc, KeyError):  # its str() is the repr of the key alone
        return f"missing key {exc}"
    if isinstance(exc, (ValueError, TypeError, FileNotFoundError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the console script; returns the exit status (module docstring, "Errors")."""
    args: argparse.Namespace | None = None
    command = "lightning-memplan"
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        command = f"lightning-memplan {args.command}"
        return int(args.func(args) or 0)
    except SystemExit as exc:
        if exc.code in (0, None):
            raise  # --help, --version
        return 2 if exc.code == 2 else int(exc.code) if isinstance(exc.code, int) else 2
    except (Exception, MemoryError, RecursionError) as exc:  # noqa: BLE001 - every fault is one line, never a traceback
        if os.environ.get(TRACEBACK_ENV) == "1":
            raise
        try:
            print(f"{command}: error: {_one_line(_message(exc, args))}", file=sys.stderr)
        except Exception:  # noqa: BLE001 - stderr itself is gone: the status still says it
            pass
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
