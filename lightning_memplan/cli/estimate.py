"""``lightning-memplan estimate``: the per-rank memory breakdown of one training setup.

Example::

    lightning-memplan estimate --model llama-7b --micro-batch 1 --seq-len 4096 \\
        --precision bf16-mixed --dp 8 --zero 3

Prints a table of every component at the peak (and each phase's total); with ``--pp`` > 1 one
column per pipeline stage. ``--json`` prints the same numbers (integer bytes) for machines.
"""

from __future__ import annotations

import argparse
import json
import sys

from lightning_memplan.cli._common import (
    add_model_arguments,
    add_train_arguments,
    int_at_least,
    model_from_args,
    train_from_args,
)

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``lightning-memplan estimate`` to its subparser (made by ``cli.build_parser``)."""
    add_model_arguments(parser)
    add_train_arguments(parser)
    group = parser.add_argument_group("parallel plan")
    for axis, text in (("dp", "data parallel"), ("tp", "tensor parallel"), ("pp", "pipeline stages"), ("cp", "context parallel")):
        group.add_argument(f"--{axis}", type=int_at_least(1), default=1, help=text)
    group.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    group.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage / FSDP sharding")
    group.add_argument("--microbatches", type=int_at_least(1), default=None, help="m per step (default: pp)")
    group.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"])
    group.add_argument("--virtual-stages", type=int_at_least(1), default=1)
    parser.add_argument("--rank", type=int_at_least(0), default=None, help="one global rank instead of every stage")
    parser.add_argument("--units", default="GiB", choices=["B", "KiB", "MiB", "GiB", "GB"])
    parser.add_argument("--json", action="store_true", help="print JSON (integer bytes)")


def run(args: argparse.Namespace) -> int:
    from lightning_memplan.model import ParallelPlan, estimate_memory
    from lightning_memplan.model.result import COMPONENTS, PHASES

    model = model_from_args(args)
    train = train_from_args(args)
    plan = ParallelPlan(
        args.dp, args.tp, args.pp, args.cp,
        sp=args.sp, zero=args.zero,
        microbatches=args.microbatches if args.microbatches is not None else args.pp,
        schedule=args.schedule, virtual_stages=args.virtual_stages,
    )
    if args.rank is not None:
        estimates = [estimate_memory(model, train, plan, rank=args.rank)]
    else:
        per_stage = plan.dp * plan.cp * plan.tp
        estimates = [estimate_memory(model, train, plan, rank=stage * per_stage) for stage in range(plan.pp)]
    worst = max(estimates, key=lambda e: e.total)
    if args.json:
        payload = {
            "model": model.to_dict(),
            "n_params": worst.details.get("traced_params", model.num_params),
            "source": worst.source,
            "train": train.to_dict(),
            "plan": plan.to_dict(),
            "worst_rank": worst.rank,
            "estimates": [e.to_dict() for e in estimates],
        }
        print(json.dumps(payload, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    from lightning_memplan.report.escape import rich_text
    from lightning_memplan.report.render import format_bytes

    title = (  # the name may come from a config.json: escaped for rich markup and the terminal
        f"{rich_text(model.name or 'model', newlines=False)} ({worst.details.get('traced_params', model.num_params) / 1e9:.2f}B params) | "
        f"b={train.micro_batch} "
        f"s={train.seq_len} {train.precision} {train.optimizer} | {plan.describe()}"
    )
    table = Table()
    table.add_column("component")
    for e in estimates:
        table.add_column(f"stage {e.stage} (rank {e.rank})" if plan.pp > 1 else f"rank {e.rank}", justify="right")
    for comp in COMPONENTS:
        table.add_row(comp, *(format_bytes(getattr(e, comp), args.units) for e in estimates))
    table.add_section()
    table.add_row("[bold]peak[/bold]", *(f"[bold]{format_bytes(e.total, args.units)}[/bold]" for e in estimates))
    table.add_row("peak phase", *(e.peak_phase for e in estimates))
    for phase in PHASES:
        table.add_row(f"{phase} peak", *(format_bytes(e.phase_total(phase), args.units) for e in estimates))
    console = Console(file=sys.stdout, width=max(100, 28 + 24 * len(estimates)))
    console.print(title)
    console.print(table)
    console.print(
        f"worst rank: {worst.rank} (stage {worst.stage}), {format_bytes(worst.total, args.units)} at the "
        f"{worst.peak_phase} peak; largest component: {worst.largest_component()}; estimate: {worst.source}"
        + (" (traced from the Hugging Face class)" if worst.source == "hf_trace" else "")
    )
    return 0
