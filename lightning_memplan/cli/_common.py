"""Argument groups shared by the ``estimate`` and ``plan`` subcommands: where the model comes from
and how it is trained. One place, so both commands accept the same flags with the same meaning."""

from __future__ import annotations

import argparse
import importlib
import os
import re
from typing import Any

from lightning_memplan.files import parse_json_text
from lightning_memplan.model.float8 import FLOAT8_RECIPES
from lightning_memplan.model.quantized import BASE_WEIGHT_FORMATS
from lightning_memplan.model.specs import (
    ATTENTION_KINDS,
    LOSS_MODES,
    NORM_IMPLS,
    OPTIMIZERS,
    PRECISIONS,
    RECOMPUTE_MODES,
    ModelSpec,
    TrainSpec,
)
from lightning_memplan.validation import read_json_file

__all__ = [
    "MAX_BYTES",
    "add_model_arguments",
    "add_train_arguments",
    "budget_arg",
    "check_outputs",
    "finite_float",
    "int_at_least",
    "model_from_args",
    "parse_bytes",
    "train_from_args",
    "write_output",
]


def int_at_least(minimum: int) -> Any:
    """An argparse ``type=``: a whole number ``>= minimum`` (argparse names the flag in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r:.60} is not a whole number; use e.g. {max(minimum, 1)}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be >= {minimum}")
        return value

    parse.__name__ = f"int>={minimum}"
    return parse


def finite_float(text: str) -> float:
    """An argparse ``type=``: a finite number (``nan``, ``inf`` and ``1e400`` are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r:.60} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number")
    return value


_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


#: Largest size a flag takes: 2**63 - 1 bytes (8 EiB, a signed 64-bit byte count; far beyond any device).
MAX_BYTES = 2**63 - 1


def parse_bytes(text: str, *, argument: str | None = "--memory-budget") -> int:
    """``"70GiB"``, ``"75 GB"``, ``"7.5e10"`` (bytes) or a bare number below 4096 read as GiB; at most
    :data:`MAX_BYTES` (``1e308TiB`` is refused by name, not an ``OverflowError``). ``argument`` names the
    flag in the message (``None``: argparse names it)."""
    shown = f"{argument}={str(text)[:60]!r}" if argument else repr(str(text)[:60])
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text)[:200])
    if not m:
        raise ValueError(f"{shown} is not a size; use e.g. 70GiB, 75GB or a byte count")
    value, unit = float(m.group(1)), m.group(2).lower()
    if unit and unit not in _UNITS:
        raise ValueError(f"{shown}: unknown unit {m.group(2)!r}; use one of B, KiB, MiB, GiB, TiB, KB, MB, GB, TB")
    size = value * (_UNITS[unit] if unit else 2**30 if value < 4096 else 1)
    if not size <= MAX_BYTES:  # inf and 1e308 * 2**40 included
        raise ValueError(f"{shown} is more than {MAX_BYTES:,d} bytes (8 EiB); use e.g. 70GiB")
    return int(size)


def budget_arg(text: str) -> int:
    """``--memory-budget``'s argparse type: :func:`parse_bytes`, its message shown by argparse (the range,
    >= 1 byte, is checked by ``plan`` and ``largest_fit``)."""
    try:
        return parse_bytes(text, argument=None)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def check_outputs(args: argparse.Namespace, *names: str) -> None:
    """Refuse an output flag's target (``--html``, ``--png``) before any work: a device, FIFO, folder, a
    file not writable by the caller ... (:func:`lightning_memplan.files.check_output_target`); ``-`` and
    ``/dev/stdout`` mean standard output. At most one output may go to standard output."""
    from lightning_memplan.files import check_output_target, is_stdout

    to_stdout = [name for name in names if is_stdout(getattr(args, name.lstrip("-").replace("-", "_"), None))]
    if len(to_stdout) > 1:
        raise ValueError(f"{' and '.join(to_stdout)} both name standard output; send one of them to a file")
    for name in names:
        target = getattr(args, name.lstrip("-").replace("-", "_"), None)
        if target is not None and not is_stdout(target):
            check_output_target(target, argument=name)


def write_output(argument: str, target: str, data: str | bytes) -> None:
    """Write ``data`` to an output flag's target: standard output for ``-`` or ``/dev/stdout``, else a file
    written atomically (:func:`lightning_memplan.files.write_atomic`, its refusals naming ``argument``)."""
    import sys

    from lightning_memplan.files import is_stdout, write_atomic

    if is_stdout(target):
        sys.stdout.flush()
        sys.stdout.buffer.write(data.encode("utf-8") if isinstance(data, str) else data)
        sys.stdout.buffer.flush()
        return
    write_atomic(target, data, argument=argument)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model",
        required=True,
        help="a preset (e.g. llama3-8b, gpt2), a Hugging Face config.json path, or pkg.module:Class "
        "(an nn.Module constructed with --model-kwargs). SECURITY: pkg.module:Class imports that module and "
        "calls that class, i.e. runs its code with your permissions; only name code you trust. A config.json "
        "is only parsed as JSON, never executed",
    )
    group.add_argument("--model-kwargs", default="{}", help="JSON keyword arguments for pkg.module:Class")


def add_train_arguments(parser: argparse.ArgumentParser, *, micro_batch_default: int | None = 1) -> None:
    group = parser.add_argument_group("training")
    group.add_argument("--micro-batch", type=int_at_least(1), default=micro_batch_default,
                       help="b: sequences per micro-batch")
    group.add_argument("--seq-len", type=int_at_least(1), required=True, help="s: tokens per sequence")
    group.add_argument("--precision", default="bf16-mixed", choices=list(PRECISIONS) + ["32", "16", "bf16"])
    group.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS))
    group.add_argument("--optimizer-impl", default="foreach", choices=["foreach", "fused", "for_loop"])
    group.add_argument("--master-weights", action="store_true", help="keep fp32 master weights (Megatron style)")
    group.add_argument("--recompute", default="none", choices=list(RECOMPUTE_MODES))
    group.add_argument("--attention", default="sdpa", choices=list(ATTENTION_KINDS))
    group.add_argument("--loss", default="naive", choices=list(LOSS_MODES))
    group.add_argument("--loss-chunk-size", type=int_at_least(1), default=None, help="tokens per chunk for --loss chunked")
    group.add_argument("--grad-accumulation", type=int_at_least(1), default=1)
    group.add_argument("--norm-impl", default="native", choices=list(NORM_IMPLS),
                       help="RMSNorm implementation: composite for Hugging Face's LlamaRMSNorm family and torchtune's")
    # low precision (docs/quantized.md): QLoRA base weights need a LoRA adapter (--lora-rank)
    group.add_argument("--base-weights", default=None, choices=list(BASE_WEIGHT_FORMATS),
                       help="frozen base weights stored quantized (bitsandbytes; QLoRA); needs --lora-rank")
    group.add_argument("--quantized-head", action="store_true",
                       help="the lm_head is quantized too (Lightning's BitsandbytesPrecision converts every "
                       "nn.Linear, the head included); needs --base-weights")
    group.add_argument("--float8", default=None, choices=list(FLOAT8_RECIPES),
                       help="torchao float8 training of the blocks' linears, as torchtitan runs it")
    group.add_argument("--lora-rank", type=int_at_least(1), default=None, help="a LoRA adapter of rank r (peft's r)")
    group.add_argument("--lora-targets", default="q_proj,v_proj",
                       help="comma-separated module names the adapter targets (peft's target_modules)")


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    """Resolve ``--model``: a preset name, a config.json path, or ``pkg.module:Class``, with the LoRA adapter
    of ``--lora-rank`` / ``--lora-targets`` when given (:meth:`ModelSpec.with_lora`); a ``--seq-len`` longer
    than its learned position table is refused (model/positions.py)."""
    from lightning_memplan.model.positions import learned_positions_blocker

    model = _with_lora(args, _model_from_args(args))
    seq_len = getattr(args, "seq_len", None)
    blocker = learned_positions_blocker(model, seq_len) if isinstance(seq_len, int) else None
    if blocker is not None:
        raise ValueError(f"--seq-len={seq_len}: {blocker.replace('use seq_len <= ', 'use --seq-len <= ')}")
    return model


def _with_lora(args: argparse.Namespace, spec: ModelSpec) -> ModelSpec:
    """``spec`` with the LoRA adapter of ``--lora-rank`` / ``--lora-targets``, or as it is without one."""
    rank = getattr(args, "lora_rank", None)
    if rank is None:
        return spec
    targets = tuple(t.strip() for t in str(args.lora_targets).split(",") if t.strip())
    try:
        return spec.with_lora(rank=rank, targets=targets)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"--lora-rank={rank} --lora-targets={args.lora_targets!r}: {exc}") from None


def _model_from_args(args: argparse.Namespace) -> ModelSpec:
    source: str = args.model
    if source.endswith(".json") or os.path.isfile(source):
        if not os.path.isfile(source):
            raise FileNotFoundError(f"--model={source!r}: no such config file")
        config = read_json_file(source, what="a Hugging Face config.json (a JSON object)", argument="--model")
        if not isinstance(config, dict):
            raise ValueError(f"--model={source!r} holds a JSON {type(config).__name__}, not an object; pass a config.json")
        try:
            return ModelSpec.from_hf_config(config)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"--model={source!r}: {exc}") from None
    if ":" in source:
        module_name, _, attr = source.partition(":")
        try:
            cls: Any = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"--model={source!r} could not be imported ({exc}); use pkg.module:Class") from exc
        kwargs = parse_json_text(args.model_kwargs, argument="--model-kwargs", what="a JSON object of keyword arguments")
        if not isinstance(kwargs, dict):
            raise TypeError(f"--model-kwargs={args.model_kwargs[:60]!r} is a JSON {type(kwargs).__name__}, not an object; "
                            'pass e.g. {"n_layers": 2}')
        import torch

        with torch.device("meta"):  # shapes only: no real allocation for a large model
            module = cls(**kwargs)
        return ModelSpec.from_module(module)
    return ModelSpec.preset(source)


def train_from_args(args: argparse.Namespace, **overrides: Any) -> TrainSpec:
    """Build the :class:`TrainSpec` from the training flags."""
    fields: dict[str, Any] = dict(
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        precision=args.precision,
        optimizer=args.optimizer,
        optimizer_impl=args.optimizer_impl,
        master_weights=args.master_weights,
        recompute=args.recompute,
        attention=args.attention,
        loss=args.loss,
        loss_chunk_size=args.loss_chunk_size,
        grad_accumulation=args.grad_accumulation,
        norm_impl=args.norm_impl,
        base_weights=getattr(args, "base_weights", None),
        quantized_head=bool(getattr(args, "quantized_head", False)),
        float8=getattr(args, "float8", None),
    )
    fields.update(overrides)
    return TrainSpec(**fields)
