"""``lightning-memplan report PATH``: render a saved ``memory_report.json`` again.

PATH is the JSON file or the log directory holding it. Sizes are in ``--units`` (default ``auto``: the
units the report was written with, else chosen from its peaks: see
:func:`~lightning_memplan.report.render.report_units`). Prints the rich table of the latest epoch (or
``--epoch N``), or the whole report as Markdown (``--markdown``) or JSON (``--json``); ``--png OUT``
redraws the chart; ``--html OUT`` writes the self-contained HTML report (with the plan map when
memplan_auto's ``memplan_plan.json`` lies beside the JSON). ``OUT`` is a new name or a regular file you can
write (a device, FIFO, folder or another user's read-only file is refused before anything is drawn); ``-``
(or ``/dev/stdout``) writes the page or the picture to standard output instead of the table.

The file may come from someone else: every string from it is escaped for the terminal and rich markup
(:mod:`~lightning_memplan.report.escape`), so no escape sequence (window title, clipboard, clear screen)
reaches the terminal and ``[/bogus]`` prints as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``lightning-memplan report`` to its subparser (made by ``cli.build_parser``)."""
    from lightning_memplan.cli._common import int_at_least
    from lightning_memplan.report.render import UNITS

    parser.add_argument("path", help="memory_report.json, or the log directory that holds it")
    parser.add_argument("--epoch", type=int_at_least(0), default=None, help="epoch to show (default: the latest)")
    parser.add_argument(
        "--units", default="auto", choices=["auto", *UNITS],
        help="display unit (default auto: the units the report was written with, else the largest binary unit in "
             "which the largest peak reads at least 1)",
    )
    fmt = parser.add_mutually_exclusive_group()
    fmt.add_argument("--markdown", action="store_true", help="print the whole report as Markdown")
    fmt.add_argument("--json", action="store_true", help="print the (validated) report as JSON")
    parser.add_argument(
        "--png", default=None, metavar="OUT", help="also draw the chart to OUT (needs matplotlib)"
    )
    parser.add_argument(
        "--html", default=None, metavar="OUT", help="also write the self-contained HTML report to OUT"
    )


def run(args: argparse.Namespace) -> int:
    from lightning_memplan.cli._common import check_outputs
    from lightning_memplan.files import is_stdout
    from lightning_memplan.report.io import load_report
    from lightning_memplan.report.render import report_units

    check_outputs(args, "--html", "--png")
    report = load_report(args.path)
    args.units = report_units(report, args.units)  # "auto": the report's own units (or its magnitudes)
    if not (is_stdout(args.html) or is_stdout(args.png)):  # a page on standard output goes there alone
        _print(report, args)
    if args.png:
        _write_png(report, args)
    if args.html:
        from lightning_memplan.cli._common import write_output
        from lightning_memplan.report.html import render_html
        from lightning_memplan.report.paths import plan_decision_beside

        write_output("--html", args.html, render_html(report, units=args.units, decision=plan_decision_beside(args.path)))
    return 0


def _print(report: Any, args: argparse.Namespace) -> None:
    """The report on standard output: JSON, Markdown, or the rich table with the notes and incidents."""
    from lightning_memplan.report.escape import terminal_text
    from lightning_memplan.report.render import render_markdown, render_rich

    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    elif args.markdown:
        print(render_markdown(report, units=args.units), end="")
    else:
        from rich.console import Console

        Console(file=sys.stdout, width=160).print(render_rich(report, epoch=args.epoch, units=args.units))
        for note in report.notes:
            print(f"note: {terminal_text(note)}")
        for inc in report.incidents:
            print(f"incident: rank {inc.rank}, epoch {inc.epoch}, step {inc.step}: {terminal_text(inc.kind)}: "
                  f"{terminal_text(inc.error)}")


def _write_png(report: Any, args: argparse.Namespace) -> None:
    from lightning_memplan.cli._common import write_output
    from lightning_memplan.files import is_stdout
    from lightning_memplan.report.plot import matplotlib_available, png_bytes, render_png

    if not matplotlib_available():
        raise ValueError(f"--png={args.png!r} needs matplotlib; pip install 'lightning-memplan[plot]'")
    if is_stdout(args.png):
        write_output("--png", args.png, png_bytes(report, units=args.units))
    else:
        render_png(report, args.png, units=args.units, argument="--png")
