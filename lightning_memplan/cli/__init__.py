"""The ``lightning-memplan`` console script: ``estimate``, ``plan`` and ``report`` subcommands.

Each subcommand lives in its own module exposing ``add_parser(subparsers)`` (which registers the
subcommand and sets ``func``) so the entry point stays small and every command is testable alone.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

_SUBCOMMANDS = ("estimate", "plan", "report")


def build_parser() -> argparse.ArgumentParser:
    from lightning_memplan._version import __version__

    parser = argparse.ArgumentParser(
        prog="lightning-memplan",
        description="Per-rank training memory: estimate, plan a parallel layout, render a saved report.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(_SUBCOMMANDS) + "}")
    for name in _SUBCOMMANDS:
        importlib.import_module(f"lightning_memplan.cli.{name}").add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code == 2:  # argparse printed "argument --flag: why" to stderr; the same status as below
            return 2
        raise  # --help, --version
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, KeyError) as exc:
        print(f"lightning-memplan {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
