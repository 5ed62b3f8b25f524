"""The true largest fit of a small model on CPU, found by measuring real steps: the reference that
``tests/unit/test_max_fit.py`` and ``benchmarks/bench_max_fit.py`` hold
:func:`~lightning_memplan.planning.fit.max_micro_batch` / ``max_seq_len`` against.

:func:`measured_peak` runs, at one (b, s), a steady-state training step in Lightning's order (the
previous step's gradients alive in the forward, AdamW states created by one step on zero gradients, as
:func:`~lightning_memplan.testing.hf_architectures.measure_step`) and a validation step under
``torch.no_grad`` after it (the gradients and optimizer states still alive, as between Lightning's
training and validation), each measured by PyTorch's own
``torch.distributed._tools.mem_tracker.MemTracker`` with the batch created inside the measured region
(a dataloader's batch is live during the step); the larger peak is the run's. :func:`measured_largest`
sweeps one axis: doubling, then bisection, then the answer and its successor measured once more, so
the value is exactly the largest whose measured peak fits (the measured peak is non-decreasing in b
and s). Everything runs fp32 on the CPU; nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_memplan.planning.fit import largest_true
from lightning_memplan.tracking.step import run_training_step

__all__ = ["Case", "hf_llama_case", "measured_largest", "measured_peak", "zoo_gpt_case"]


@dataclass
class Case:
    """A model and how to feed it: ``batch(b, s)`` builds a batch, ``loss(model, batch)`` its loss."""

    name: str
    model: torch.nn.Module
    batch: Callable[[int, int], Any]
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    max_positions: int


def zoo_gpt_case(max_positions: int = 256) -> Case:
    """The zoo's GPT-2 layout (2 blocks, h=64, V=512), next-token cross-entropy."""
    from lightning_memplan.testing.zoo import GPT, causal_lm_loss, gpt2_style, random_tokens

    torch.manual_seed(0)
    config = gpt2_style(max_positions=max_positions)
    return Case("zoo gpt2-style", GPT(config), lambda b, s: random_tokens(config, b, s),
                lambda model, batch: causal_lm_loss(model, *batch), max_positions)  # type: ignore[arg-type]


def hf_llama_case(max_positions: int = 512) -> Case:
    """A tiny Hugging Face ``LlamaForCausalLM`` built from a config (2 blocks, h=64, 4 heads, 2 kv-heads,
    V=512, SDPA), its own loss."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=172, vocab_size=512, max_position_embeddings=max_positions)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")

    def batch(b: int, s: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, int(config.vocab_size or 0), (b, s), generator=torch.Generator().manual_seed(1))
        return {"input_ids": ids, "labels": ids.clone()}

    return Case("hf llama", model, batch, lambda model, data: model(**data).loss, max_positions)


def _peak(tracker: Any) -> int:
    return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def measured_peak(case: Case, micro_batch: int, seq_len: int) -> tuple[int, int]:
    """``(training step peak, validation step peak)`` in bytes at (b, s), by MemTracker (module docstring)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model = case.model
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()  # steady state: AdamW states exist, the previous gradients are alive
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        batch = case.batch(micro_batch, seq_len)
        run_training_step(model, batch, case.loss, optimizer)
        del batch
    train = _peak(tracker)
    model.eval()
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker, torch.no_grad():
        batch = case.batch(micro_batch, seq_len)
        case.loss(model, batch)
        del batch
    val = _peak(tracker)
    model.train()
    for param in model.parameters():
        param.grad = None
    return train, val


def measured_largest(case: Case, budget: int, *, axis: str, other: int, bound: int) -> tuple[int, dict[int, int]]:
    """The largest b (``axis="micro_batch"``, s = ``other``) or s (``axis="seq_len"``, b = ``other``) up to
    ``bound`` whose measured peak (training and validation) is at most ``budget``; and every measured
    ``{value: peak}``."""
    peaks: dict[int, int] = {}

    def fits(value: int) -> bool:
        if value not in peaks:
            b, s = (value, other) if axis == "micro_batch" else (other, value)
            peaks[value] = max(measured_peak(case, b, s))
        return peaks[value] <= budget

    # the search is the planner's (doubling, then bisection); what is compared is the predicate: measured
    # peaks here, the estimate in planning/fit.py
    return largest_true(fits, bound), peaks
