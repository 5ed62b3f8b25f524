#!/usr/bin/env python3
"""The walk of ``estimate_memory``'s ``train`` argument through the package: which functions receive it,
in which files, and how often the walk returns to a file it had left.

Runs one ``estimate_memory(model, train, plan)`` call in this process under :func:`sys.setprofile` and
records every Python call that receives the very ``train`` object (by identity) as one of its
arguments: a *stop*. Consecutive stops in one file are one visit; the *walk* is the visits in order. A
*return* is a visit to a file the walk had already visited and left. Caches matter (an ``lru_cache`` hit
runs no Python frame), so the command always runs in a fresh process and counts the first call only.

Usage (from a checkout; ``PYTHONPATH`` picks the tree measured)::

    PYTHONPATH=$PWD python .ci/walk_param.py [--model llama3-8b] [--plan single|fsdp8|pp4]
        [--recompute selective_op] [--attention eager] [--loss chunked] [-v]

Prints ``stops``, ``files entered`` (distinct), ``visits`` and ``returns`` (``-v``: the walk itself).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

PLANS = {
    "single": {},
    "fsdp8": {"dp": 8, "zero": 3},
    "pp4": {"pp": 4, "microbatches": 8},
}


def _receives(frame: FrameType, target: object) -> bool:
    code = frame.f_code
    n_args = code.co_argcount + code.co_kwonlyargcount
    return any(frame.f_locals.get(name) is target for name in code.co_varnames[:n_args])


def walk(call: Callable[[], Any], target: object, package: str) -> list[tuple[str, str]]:
    """``[(file, function)]`` of every call under ``call()`` in ``package`` that receives ``target``."""
    stops: list[tuple[str, str]] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and package in frame.f_code.co_filename and _receives(frame, target):
            stops.append((frame.f_code.co_filename, frame.f_code.co_qualname))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return stops


def summary(stops: list[tuple[str, str]]) -> dict[str, int]:
    """``stops``, distinct ``files`` entered, ``visits`` (runs of stops in one file) and ``returns``
    (visits to a file the walk had left before)."""
    visits: list[str] = []
    for path, _ in stops:
        if not visits or visits[-1] != path:
            visits.append(path)
    returns = sum(1 for i, path in enumerate(visits) if path in visits[:i])
    return {"stops": len(stops), "files": len(set(visits)), "visits": len(visits), "returns": returns}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b", help="a ModelSpec preset")
    parser.add_argument("--plan", default="single", choices=sorted(PLANS))
    parser.add_argument("--recompute", default="selective_op", choices=("none", "selective", "selective_op", "full"))
    parser.add_argument("--attention", default="eager", choices=("sdpa", "eager"))
    parser.add_argument("--loss", default="chunked")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every stop of the walk")
    args = parser.parse_args(argv)

    import lightning_memplan
    from lightning_memplan import ModelSpec, ParallelPlan, TrainSpec, estimate_memory

    model = ModelSpec.preset(args.model)
    train = TrainSpec(micro_batch=2, seq_len=2048, precision="bf16-mixed", recompute=args.recompute,
                      attention=args.attention, loss=args.loss)
    plan = ParallelPlan(**PLANS[args.plan])
    root = str(Path(lightning_memplan.__file__).resolve().parent)
    stops = walk(lambda: estimate_memory(model, train, plan), train, root)
    if args.verbose:
        for path, name in stops:
            print(f"  {Path(path).relative_to(Path(root).parent)}  {name}")
    numbers = summary(stops)
    print(f"estimate_memory({args.model}, recompute={args.recompute!r}, attention={args.attention!r}, "
          f"loss={args.loss!r}, plan={args.plan}): "
          f"{numbers['stops']} calls receive train; {numbers['files']} files entered; {numbers['visits']} visits; "
          f"{numbers['returns']} returns to a file already left")
    return 0


if __name__ == "__main__":
    sys.exit(main())
