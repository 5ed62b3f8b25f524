#!/usr/bin/env python3
"""List the package's functions longer than a limit, longest first; exit 1 if any is over the hard limit.

Reads every ``*.py`` under the package with :mod:`ast` (nothing is imported or run). A function's length
is its ``def`` line (decorators excluded) to its last line, blank lines and its docstring included; a
nested function or a method counts apart, and its lines count in the enclosing function too (the
enclosing one is as long as it reads).

Usage: ``python .ci/long_functions.py lightning_memplan [--list N] [--max M]``: prints the functions over
``N`` lines (default 80, the aim), exits 1 when any is over ``M`` (default 100, the hard limit).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path


def function_lengths(root: Path) -> list[tuple[int, str]]:
    """``(lines, "path:line name")`` of every function and method under ``root``, longest first."""
    rows = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                rows.append((lines, f"{path}:{node.lineno} {node.name}"))
    return sorted(rows, key=lambda row: (-row[0], row[1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", type=Path)
    parser.add_argument("--list", type=int, default=80, help="print the functions over this many lines")
    parser.add_argument("--max", type=int, default=100, help="exit 1 when a function is over this many lines")
    args = parser.parse_args(argv)
    rows = function_lengths(args.package)
    listed = [row for row in rows if row[0] > args.list]
    for lines, where in listed:
        print(f"  {lines:4d} lines  {where}")
    over = [row for row in rows if row[0] > args.max]
    longest = f"; the longest: {rows[0][0]} lines, {rows[0][1]}" if rows else ""
    print(f"functions over {args.list} lines: {len(listed)}; over {args.max}: {len(over)}{longest}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
