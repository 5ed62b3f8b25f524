"""The ``lightning-memplan`` console script: ``estimate``, ``plan`` and ``report`` subcommands.

Each subcommand lives in its own module (its docstring is the subcommand's description) exposing
``add_arguments(parser)`` and ``run(args)``; :func:`build_parser` makes the subparsers, so the entry point
stays small and every command is testable alone.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

#: Subcommand -> its line in ``lightning-memplan --help``.
_SUBCOMMANDS: dict[str, str] = {
    "estimate": "per-rank memory breakdown for a model, training setup and parallel plan",
    "plan": "choose dp/fsdp/tp/pp/cp, recompute and loss mode for a model on a cluster",
    "report": "render a saved memory_report.json (from MemoryPlanCallback) again",
}


def build_parser() -> argparse.ArgumentParser:
    from lightning_memplan._version import __version__

    parser = argparse.ArgumentParser(
        prog="lightning-memplan",
        description="Per-rank training memory: estimate, plan a parallel layout, render a saved report.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(_SUBCOMMANDS) + "}")
    for name, summary in _SUBCOMMANDS.items():
        command = importlib.import_module(f"lightning_memplan.cli.{name}")
        parser_of = sub.add_parser(
            name, help=summary, description=command.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        command.add_arguments(parser_of)
        parser_of.set_defaults(func=command.run)
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
