"""Wall time of the ``lightning-memplan estimate`` command, against the interpreter's own start-up.

A user types ``lightning-memplan estimate ...`` and waits for a fresh interpreter to start, import the
package and print the breakdown. This script times, in one session and alternating the three so that a
machine's load hits them alike (house style 14: ratios measured in the same run):

* ``python``: ``python -c pass``, the interpreter alone;
* ``import``: ``python -c "import lightning_memplan.cli"``, start-up plus the CLI's imports;
* ``estimate``: ``lightning_memplan.cli:main`` run as the console script runs it, with ``sys.argv`` =
  ``estimate <ARGS>``: the whole command, checked to exit 0 and print a ``peak`` line;

and then ``main(ARGS)`` in this process (imports done, the estimate's caches warm). It prints the median
wall seconds of ``--repeats`` runs of each and the ratios ``estimate / python`` and ``estimate / import``
(how much the command costs above a bare start-up, and above its imports). The suite checks what the
command prints (``tests/unit/test_estimate.py``) and times nothing; the former test bound was 2 s for the
in-process call.

Usage::

    python benchmarks/bench_cli.py                 # 5 repeats of the default command
    python benchmarks/bench_cli.py --repeats 9 -- estimate --model llama3-8b --seq-len 2048 --pp 2 --tp 2
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

_DEFAULT = "estimate --model llama-7b --micro-batch 1 --seq-len 4096 --precision bf16-mixed --dp 8 --zero 3"


# what the ``lightning-memplan`` console script (pyproject's [project.scripts]) executes
_ENTRY_POINT = "import sys; from lightning_memplan.cli import main; sys.exit(main())"


def _wall(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    return time.perf_counter() - t0, out.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="runs of each command, the median counts (default 5)")
    ap.add_argument("command", nargs="*", help=f"the CLI arguments after --, default: {_DEFAULT}")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats={args.repeats} must be >= 1")
    cli_args = args.command or _DEFAULT.split()
    import lightning_memplan
    from lightning_memplan.cli import main as cli_main

    # the children import the checkout this process imported, from a neutral working directory
    root = pathlib.Path(lightning_memplan.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    commands = {
        "python": [sys.executable, "-c", "pass"],
        "import": [sys.executable, "-c", "import lightning_memplan.cli"],
        "estimate": [sys.executable, "-c", _ENTRY_POINT, *cli_args],
    }
    walls: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.repeats):
        for name, cmd in commands.items():
            seconds, out = _wall(cmd, env)
            if name == "estimate" and "peak" not in out:
                raise SystemExit(f"the command printed no 'peak' line:\n{out}")
            walls[name].append(seconds)
    in_process = []
    for _ in range(args.repeats):
        with contextlib.redirect_stdout(io.StringIO()):
            t0 = time.perf_counter()
            code = cli_main(cli_args)
            in_process.append(time.perf_counter() - t0)
        if code != 0:
            raise SystemExit(f"main({cli_args!r}) returned {code}")
    med = {name: statistics.median(v) for name, v in walls.items()}
    print(f"checkout {root}; lightning-memplan {' '.join(cli_args)}")
    print(f"wall seconds, median of {args.repeats}: python {med['python']:.3f}, import {med['import']:.3f}, "
          f"estimate {med['estimate']:.3f}, main() in process {statistics.median(in_process):.4f}")
    print(f"ratios: estimate / python {med['estimate'] / med['python']:.1f}x, "
          f"estimate / import {med['estimate'] / med['import']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
