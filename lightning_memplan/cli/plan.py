"""``lightning-memplan plan``: choose a parallel layout for a model on a cluster, and say why.

Example::

    lightning-memplan plan --model llama3-70b --hardware h100-80gb --gpus-per-node 8 --nodes 32 \\
        --seq-len 8192 --global-batch 1024

Prints the decision (plan, training changes, per-rank allocated and reserved peak against the budget,
predicted step time, tokens/s and MFU), the top alternatives and the rejected layouts with their
reasons. ``--json`` prints ``PlanDecision.to_dict()``. When nothing fits, prints the closest plan and the cheapest changes that
would make it fit, and exits with status 1.

``--allow`` restricts the search: a comma list of parallelisms (``--allow dp,fsdp,tp,pp``; names:
dp, ddp, zero1, zero2, zero3, zero, fsdp, tp, sp, pp, cp) and/or ``KEY=V1,V2`` entries, repeatable
(``--allow tp=1,2,4,8 --allow recompute=none,full``; keys: dp, tp, pp, cp, zero, sp, schedule,
virtual_stages, recompute, loss, micro_batch, offload).

When no layout fits on the devices, the planner may offload to host memory (FSDP2's CPUOffloadPolicy,
activation offloading; ``--allow offload=none`` never does) within ``--host-memory`` per node (default: the
detected host's memory; a preset has none, so nothing is offloaded without it), and says so::

    lightning-memplan plan --model llama-7b --hardware h100 --gpus-per-node 1 --seq-len 4096 --host-memory 1TiB
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lightning_memplan.cli._common import (
    add_model_arguments,
    add_train_arguments,
    budget_arg,
    check_outputs,
    finite_float,
    int_at_least,
    model_from_args,
    parse_bytes,
    train_from_args,
    write_output,
)

__all__ = ["add_arguments", "parse_allow", "parse_bytes", "run"]

_budget_arg = budget_arg  # ``--memory-budget``'s argparse type (cli._common, shared with ``estimate``)


def _typed(key: str, raw: str) -> Any:
    raw = raw.strip()
    if key in ("dp", "tp", "pp", "cp", "zero", "virtual_stages", "micro_batch"):
        try:
            return int(raw)
        except ValueError as exc:
            raise ValueError(f"--allow {key}={raw!r}: values of {key} must be integers") from exc
    if key == "sp":
        if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"--allow sp={raw!r}: use true/false")
        return raw.lower() in ("true", "1", "yes")
    return raw


def parse_allow(entries: list[str] | None) -> Any:
    """``--allow`` values -> the ``allow=`` argument of :func:`lightning_memplan.planning.plan`.

    Only names: a list (``("dp", "fsdp", "tp")``); any ``KEY=V,...``: a dict, where a names entry
    becomes the axis restriction it stands for (merged with the explicit keys, which win)."""
    if not entries:
        return None
    names: list[str] = []
    mapping: dict[str, list[Any]] = {}
    for entry in entries:
        if "=" in entry:
            key, _, values = entry.partition("=")
            key = key.strip().replace("-", "_")
            mapping[key] = [_typed(key, v) for v in values.split(",") if v.strip()]
        else:
            names += [n.strip() for n in entry.split(",") if n.strip()]
    if not mapping:
        return tuple(names)
    if names:
        from lightning_memplan.planning.space import Allow

        base = Allow.parse(tuple(names)).to_dict()
        base.update(mapping)
        return {k: v for k, v in base.items() if v is not None}
    return mapping


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``lightning-memplan plan`` to its subparser (made by ``cli.build_parser``)."""
    add_model_arguments(parser)
    add_train_arguments(parser)
    group = parser.add_argument_group("cluster")
    group.add_argument("--hardware", default=None,
                       help="a preset such as h100-80gb, a100-80gb, h200, l4 (default: detect the local device)")
    group.add_argument("--gpus-per-node", type=int_at_least(1), default=None, help="GPUs per node (default 8 for a preset)")
    group.add_argument("--nodes", type=int_at_least(1), default=1, help="number of nodes")
    group.add_argument("--inter-node-bw", type=finite_float, default=None, help="per-GPU network bytes/s (overrides the preset)")
    group.add_argument("--host-memory", type=_budget_arg, default=None,
                       help="host (CPU) memory per node, e.g. 1TiB: what offloading may use when nothing fits on "
                       "the devices (default: the detected host's; none for a preset)")
    search = parser.add_argument_group("search")
    search.add_argument("--global-batch", type=int_at_least(1), default=None,
                        help="sequences per optimizer step (default: micro-batch x grad-accumulation per replica)")
    search.add_argument("--memory-budget", type=_budget_arg, default=None,
                        help="per-device budget for the allocator's reserved bytes (e.g. 70GiB); replaces the derived budget")
    search.add_argument("--headroom", type=finite_float, default=0.1, help="fraction of device memory kept free")
    search.add_argument("--expandable-segments", action="store_true",
                        help="the run sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                        "(no block rounding in the reserved bytes)")
    search.add_argument("--allow", action="append", default=None, metavar="NAMES|KEY=V,...",
                        help="restrict the search (repeatable; see the description)")
    search.add_argument("--top", type=int_at_least(1), default=5, help="alternatives to show")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print PlanDecision.to_dict() as JSON")
    out.add_argument("--markdown", action="store_true", help="print the explanation as Markdown")
    parser.add_argument("--html", default=None, metavar="OUT.html",
                        help="also write the plan map (every evaluated layout, peak vs step time) as one self-contained HTML "
                        "file (- or /dev/stdout: to standard output, instead of the text)")


def _hardware(args: argparse.Namespace) -> Any:
    from lightning_memplan.hardware import HardwareSpec

    if args.hardware is None:
        hw = HardwareSpec.detect(num_nodes=args.nodes)
        if args.gpus_per_node is not None:
            hw = hw.replace(gpus_per_node=args.gpus_per_node)
    else:
        gpus = 8 if args.gpus_per_node is None else args.gpus_per_node
        hw = HardwareSpec.preset(args.hardware, gpus_per_node=gpus, num_nodes=args.nodes)
    if args.inter_node_bw is not None:
        hw = hw.replace(inter_node_bw=args.inter_node_bw)
    if args.host_memory is not None:
        hw = hw.replace(host_memory_bytes=args.host_memory)
    return hw


def _shown(decision: Any, escape: Any) -> Any:
    """``decision`` with the strings that come from the user's files (the model's name, e.g. a config.json
    ``model_type``, and the notes, which may quote it) passed through ``escape`` for the output medium;
    the planner's own words are left as they are."""
    import dataclasses

    model = dataclasses.replace(decision.model, name=escape(decision.model.name)) if decision.model.name else decision.model
    return dataclasses.replace(decision, model=model, notes=tuple(escape(n) for n in decision.notes))


def _markdown_inline(text: str) -> str:
    from lightning_memplan.report.escape import markdown_text

    return markdown_text(text).replace("\\|", "|")  # the plan's Markdown escapes "|" itself


#: Fitting candidates kept for ``--html``'s plan map (the printed table still lists ``--top``).
_PLAN_MAP_CANDIDATES = 40


def run(args: argparse.Namespace) -> int:
    from lightning_memplan.files import is_stdout
    from lightning_memplan.planning import plan

    check_outputs(args, "--html")
    model = model_from_args(args)
    train = train_from_args(args)
    hardware = _hardware(args)
    decision = plan(
        model, train, hardware,
        global_batch=args.global_batch, memory_budget=args.memory_budget, headroom=args.headroom,
        allow=parse_allow(args.allow), expandable_segments=args.expandable_segments,
        # the plan map shows every timed layout: keep more fitting candidates (the choice is the same)
        **({"top_k": max(args.top, _PLAN_MAP_CANDIDATES)} if args.html else {}),
    )
    if not is_stdout(args.html):  # a plan map on standard output goes there alone
        _print(decision, args)
    if args.html:
        from lightning_memplan.report.html import render_plan_html

        write_output("--html", args.html, render_plan_html(decision.to_dict()))
    return 0 if decision.fits else 1


def _print(decision: Any, args: argparse.Namespace) -> None:
    """The decision on standard output: JSON, Markdown or the rich explanation."""
    if args.json:
        print(json.dumps(decision.to_dict(), indent=1))
    elif args.markdown:
        print(_shown(decision, _markdown_inline).explain("markdown", top=args.top), end="")
    else:
        from rich.console import Console

        from lightning_memplan.planning.explain import rich_renderable
        from lightning_memplan.report.escape import terminal_text

        # rich_renderable builds Text objects (not markup): only the terminal's control characters matter
        shown = _shown(decision, lambda text: terminal_text(text, newlines=False))
        Console(file=sys.stdout, width=170).print(rich_renderable(shown, top=args.top))
