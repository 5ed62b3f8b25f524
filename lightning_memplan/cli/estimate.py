"""``lightning-memplan estimate``: the per-rank memory breakdown of one training setup.

Example::

    lightning-memplan estimate --model llama-7b --micro-batch 1 --seq-len 4096 \\
        --precision bf16-mixed --dp 8 --zero 3

Prints a table of every component at the peak (and each phase's total); with ``--pp`` > 1 one
column per pipeline stage. ``--json`` prints the same numbers (integer bytes) for machines.

``--framework deepspeed`` estimates DeepSpeed's ZeRO engine (``--zero`` its stage, DeepSpeed's default
bucket sizes); ``--offload optimizer|params`` its ZeRO-Offload, with the host memory printed beside the
device memory (``params`` needs ``--zero 3``)::

    lightning-memplan estimate --model llama-7b --seq-len 2048 --dp 8 --zero 3 \\
        --framework deepspeed --offload optimizer

With ``--framework torch`` (memplan_auto's FSDP2; ``fsdp2`` is accepted as its name) ``--offload params`` is
FSDP2's ``CPUOffloadPolicy`` (sharded parameters, gradients and optimizer states on the host; ``--zero 2|3``
or ``--dp 1``), ``--offload activations`` activation offloading (``save_on_cpu`` around every block;
``--recompute none``) and ``--offload params+activations`` both::

    lightning-memplan estimate --model llama-7b --seq-len 4096 --dp 8 --zero 3 --offload params+activations

``--max-micro-batch`` / ``--max-seq-len`` also print the largest micro-batch (at ``--seq-len``) or
sequence length (at ``--micro-batch``) that fits ``--memory-budget`` (or ``--hardware``'s memory less
``--headroom``) with the planner's fit test, and the phase and component that bind it
(:func:`lightning_memplan.planning.fit.largest_fit`); ``--json`` adds them under ``"largest_fit"``::

    lightning-memplan estimate --model llama3-8b --seq-len 8192 --dp 8 --zero 3 \\
        --max-micro-batch --hardware h100-80gb
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
    finite_float,
    int_at_least,
    model_from_args,
    train_from_args,
)
from lightning_memplan.model.frameworks import DEEPSPEED_OFFLOADS
from lightning_memplan.model.specs import FRAMEWORK_NAMES

#: ``--offload`` values: DeepSpeed's (``DEEPSPEED_OFFLOADS``) and FSDP2's activation offloading, alone or
#: with ``params`` (CPUOffloadPolicy).
OFFLOAD_CHOICES = (*DEEPSPEED_OFFLOADS, "activations", "params+activations")

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
    group = parser.add_argument_group("training stack")
    group.add_argument("--framework", default="torch", choices=[*FRAMEWORK_NAMES, "fsdp2"],
                       help="the stack the step runs on: torch (memplan_auto, FSDP2; also spelled fsdp2), megatron, "
                       "llama3, fsdp1, or deepspeed (DeepSpeed's ZeRO engine; --zero is its stage)")
    group.add_argument("--offload", default="none", choices=list(OFFLOAD_CHOICES),
                       help="what lives in host memory. --framework deepspeed (ZeRO-Offload): optimizer (master "
                       "weights, optimizer states and fp32 gradients; --zero >= 1) or params (also the 16-bit "
                       "parameters; --zero 3). --framework torch (FSDP2): params (CPUOffloadPolicy: sharded "
                       "parameters, gradients and optimizer states; --zero 2|3 or --dp 1), activations "
                       "(save_on_cpu around every block; --recompute none) or params+activations. Host memory is "
                       "printed beside device memory")
    parser.add_argument("--rank", type=int_at_least(0), default=None, help="one global rank instead of every stage")
    parser.add_argument("--units", default="GiB", choices=["B", "KiB", "MiB", "GiB", "GB"])
    parser.add_argument("--json", action="store_true", help="print JSON (integer bytes)")
    fit = parser.add_argument_group("largest fit")
    fit.add_argument("--max-micro-batch", action="store_true",
                     help="also print the largest micro-batch (at --seq-len) that fits, and what binds it")
    fit.add_argument("--max-seq-len", action="store_true",
                     help="also print the largest sequence length (at --micro-batch) that fits, and what binds it")
    fit.add_argument("--hardware", default=None,
                     help="the device for --max-*: a preset such as h100-80gb (default: --memory-budget, else detect)")
    fit.add_argument("--memory-budget", type=budget_arg, default=None,
                     help="per-device budget for --max-* (e.g. 70GiB); replaces the device memory less --headroom")
    fit.add_argument("--headroom", type=finite_float, default=0.1, help="fraction of device memory kept free")
    fit.add_argument("--expandable-segments", action="store_true",
                     help="the run sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")


def run(args: argparse.Namespace) -> int:
    """Estimate every pipeline stage (or ``--rank``), then print JSON or the table and the summary lines."""
    model = model_from_args(args)
    train = train_from_args(args, **offload_fields(args.framework, args.offload))
    plan = _plan_from_args(args)
    estimates = _estimates(model, train, plan, args.rank)
    worst = max(estimates, key=lambda e: e.total)
    fits = _largest_fits(args, model, train, plan)
    if args.json:
        print(json.dumps(_payload(model, train, plan, estimates, worst, fits), indent=1))
        return 0
    from rich.console import Console

    console = Console(file=sys.stdout, width=max(100, 28 + 24 * len(estimates)))
    console.print(_title(model, train, plan, worst))
    console.print(_table(estimates, plan, args.units))
    _print_summary(console, worst, plan, args)
    for found in fits.values():
        console.print(found.describe())
    return 0


def _plan_from_args(args: argparse.Namespace) -> Any:
    from lightning_memplan.model import ParallelPlan

    return ParallelPlan(
        args.dp, args.tp, args.pp, args.cp,
        sp=args.sp, zero=args.zero,
        microbatches=args.microbatches if args.microbatches is not None else args.pp,
        schedule=args.schedule, virtual_stages=args.virtual_stages,
    )


def _estimates(model: Any, train: Any, plan: Any, rank: int | None) -> list[Any]:
    """``--rank``'s estimate, else the first rank of every pipeline stage."""
    from lightning_memplan.model import estimate_memory

    if rank is not None:
        return [estimate_memory(model, train, plan, rank=rank)]
    per_stage = plan.dp * plan.cp * plan.tp
    return [estimate_memory(model, train, plan, rank=stage * per_stage) for stage in range(plan.pp)]


def _payload(model: Any, train: Any, plan: Any, estimates: list[Any], worst: Any, fits: dict[str, Any]) -> dict[str, Any]:
    """``--json``'s object: the inputs, every estimate (integer bytes) and the largest fits asked for."""
    payload = {
        "model": model.to_dict(),
        "n_params": worst.details.get("traced_params", model.num_params),
        "source": worst.source,
        "train": train.to_dict(),
        "plan": plan.to_dict(),
        "worst_rank": worst.rank,
        "estimates": [e.to_dict() for e in estimates],
    }
    if fits:
        payload["largest_fit"] = {axis: found.to_dict() for axis, found in fits.items()}
    return payload


def _title(model: Any, train: Any, plan: Any, worst: Any) -> str:
    from lightning_memplan.report.escape import rich_text

    # the name may come from a config.json: escaped for rich markup and the terminal
    return (
        f"{rich_text(model.name or 'model', newlines=False)} ({worst.details.get('traced_params', model.num_params) / 1e9:.2f}B "
        f"params) | b={train.micro_batch} s={train.seq_len} {train.precision} {train.optimizer}"
        + (f" base_weights={train.base_weights}" if train.base_weights else "")  # low precision
        + (" quantized_head" if train.quantized_head else "")
        + (f" float8={train.float8}" if train.float8 else "")
        + f" | {plan.describe()}"
    )


def _table(estimates: list[Any], plan: Any, units: str) -> Any:
    """Every component, the peak and each phase's total per estimate (and the host memory under offload)."""
    from rich.table import Table

    from lightning_memplan.model.offload import HOST_PARTS
    from lightning_memplan.model.result import PHASES, shown_components
    from lightning_memplan.report.render import format_bytes

    table = Table()
    table.add_column("component")
    for e in estimates:
        table.add_column(f"stage {e.stage} (rank {e.rank})" if plan.pp > 1 else f"rank {e.rank}", justify="right")
    for comp in shown_components(*(e.components() for e in estimates)):
        table.add_row(comp, *(format_bytes(getattr(e, comp), units) for e in estimates))
    table.add_section()
    table.add_row("[bold]peak[/bold]", *(f"[bold]{format_bytes(e.total, units)}[/bold]" for e in estimates))
    table.add_row("peak phase", *(e.peak_phase for e in estimates))
    for phase in PHASES:
        table.add_row(f"{phase} peak", *(format_bytes(e.phase_total(phase), units) for e in estimates))
    if any(e.host for e in estimates):  # ZeRO-Offload: what lives in host memory, not in the device total
        table.add_section()
        table.add_row("[bold]host memory[/bold]", *(f"[bold]{format_bytes(e.host, units)}[/bold]" for e in estimates))
        for part in HOST_PARTS:
            if any(e.details.get(f"host_{part}", 0) for e in estimates):
                table.add_row(f"host {part}", *(format_bytes(e.details.get(f"host_{part}", 0), units) for e in estimates))
    return table


def _print_summary(console: Any, worst: Any, plan: Any, args: argparse.Namespace) -> None:
    """The worst rank's line, and its host memory under offload."""
    from lightning_memplan.model.offload import host_need_bytes
    from lightning_memplan.report.render import format_bytes

    units = args.units
    console.print(
        f"worst rank: {worst.rank} (stage {worst.stage}), {format_bytes(worst.total, units)} at the "
        f"{worst.peak_phase} peak; largest component: {worst.largest_component()}; estimate: {worst.source}"
        + (" (traced from the Hugging Face class)" if worst.source == "hf_trace" else "")
    )
    if not worst.host:
        return
    console.print(
        f"host memory (offload={args.offload}): {format_bytes(worst.host, units)} per rank, "
        f"{format_bytes(worst.host * plan.world_size, units)} over the {plan.world_size} ranks"
    )
    pinned = int(worst.details.get("host_pinned", 0))
    if pinned:
        console.print(
            f"  of which {format_bytes(pinned, units)} page-locked (pinned blocks are rounded up to a power "
            f"of two: up to {format_bytes(host_need_bytes(worst), units)} per rank); "
            f"{format_bytes(worst.details.get('offload_h2d_bytes', 0), units)} host-to-device and "
            f"{format_bytes(worst.details.get('offload_d2h_bytes', 0), units)} device-to-host per step"
        )


def offload_fields(framework: str, offload: str) -> dict[str, Any]:
    """The TrainSpec fields of ``--framework`` and ``--offload`` (``fsdp2`` is ``torch``; ``activations`` is
    ``offload_activations=True``); what no stack supports is refused by ``TrainSpec`` with its reason."""
    framework = "torch" if framework == "fsdp2" else framework
    parts = offload.split("+")
    activations = "activations" in parts
    rest = [p for p in parts if p != "activations"]
    return {"framework": framework, "offload": rest[0] if rest else "none", "offload_activations": activations}


def _largest_fits(args: argparse.Namespace, model: Any, train: Any, plan: Any) -> dict[str, Any]:
    """``{"micro_batch": LargestFit, "seq_len": LargestFit}`` for the ``--max-*`` flags given."""
    axes = [axis for axis, on in (("micro_batch", args.max_micro_batch), ("seq_len", args.max_seq_len)) if on]
    if not axes:
        return {}
    from lightning_memplan.hardware import HardwareSpec
    from lightning_memplan.planning.fit import largest_fit

    hardware = None
    if args.hardware is not None:
        hardware = HardwareSpec.preset(args.hardware)
    elif args.memory_budget is None:
        hardware = HardwareSpec.detect()
    return {axis: largest_fit(model, train, plan, axis=axis, memory_budget=args.memory_budget, hardware=hardware,
                              headroom=args.headroom, expandable_segments=args.expandable_segments)
            for axis in axes}
