"""Validation, test and predict steps in the estimate / measure / report core.

:class:`~lightning_memplan.monitoring.session.MemorySession` measures an evaluation step as it measures
a training step (the same probe, the same tensor tracker, one :class:`StepRecord` with ``phase`` set) and
estimates it with :func:`~lightning_memplan.model.eval_estimate.estimate_eval_memory`. What the estimate
needs that the module and the optimizers say *now* (whether the last step's gradients and the optimizer
states exist, whether the forward keeps a KV cache) is read here, once per evaluation run or per shape.
The steps of each phase fold into their own :class:`RankAccumulator`, reported beside the training
steps in the epoch report (``EpochReport.phases``). A failure here is a warning: the user's run goes on.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_memplan.model.eval_estimate import EVAL_PHASES, estimate_eval_memory
from lightning_memplan.model.result import MemoryEstimate
from lightning_memplan.report.records import RankAccumulator, StepRecord

__all__ = ["EvalState", "eval_forward_style", "live_training_state"]

#: Per-(phase, b, s, grads, states) estimates kept.
_EVAL_CACHE_SIZE = 64
#: Sub-modules looked at to find a Hugging Face model (its config says whether a KV cache is built).
_MAX_MODULES_SCANNED = 64


def eval_forward_style(module: torch.nn.Module) -> tuple[bool, int]:
    """``(kv_cache, held_hidden)`` of the module's no-grad forward (:func:`estimate_eval_memory`): a
    Hugging Face ``PreTrainedModel`` inside it builds a ``DynamicCache`` in eval mode when its
    ``config.use_cache`` is true, and its outer forward keeps one more ``[b, s, h]`` tensor alive."""
    for i, sub in enumerate(module.modules()):
        if i >= _MAX_MODULES_SCANNED:
            break
        config = getattr(sub, "config", None)
        if config is not None and type(sub).__module__.startswith("transformers."):
            return bool(getattr(config, "use_cache", False)), 1
    return False, 0


def live_training_state(module: torch.nn.Module, optimizers: tuple[Any, ...]) -> tuple[bool, bool]:
    """``(grads_alive, optimizer_states)`` now: whether any parameter holds a ``.grad`` (Lightning releases
    them before the validation loop, ``on_validation_model_zero_grad``, unless validation interrupts
    gradient accumulation; a Fabric loop may not) and whether any optimizer holds a state."""
    grads = any(p.grad is not None for p in module.parameters())
    states = any(len(getattr(getattr(o, "optimizer", o), "state", ())) for o in optimizers)
    return grads, states


@dataclass
class EvalState:
    """The evaluation steps of one fit: accumulators per phase (folded into the epoch report), the
    records of the evaluation run under way (logged at its end), counters and cached estimates."""

    acc: dict[str, RankAccumulator] = field(default_factory=dict)
    window: dict[str, list[StepRecord]] = field(default_factory=dict)
    seen: dict[str, int] = field(default_factory=dict)  # evaluation batches per phase, from the fit's start
    tracked: set[str] = field(default_factory=set)  # phases with a tracked step this epoch
    live: tuple[bool, bool] | None = None  # (grads_alive, optimizer_states) of the run under way
    style: tuple[bool, int] | None = None  # eval_forward_style of the module
    estimates: OrderedDict[tuple[Any, ...], MemoryEstimate | None] = field(default_factory=OrderedDict)

    def should_track(self, phase: str, enabled: bool, every: int) -> bool:
        """The first evaluation step of each phase per epoch, and every ``every``-th one."""
        if not enabled:
            return False
        n = self.seen.get(phase, 0)
        return phase not in self.tracked or (n + 1) % every == 0

    def estimate(
        self, spec: Any, train: Any, plan: Any, rank: int | None, phase: str, b: int, s: int, module: torch.nn.Module,
        optimizers: tuple[Any, ...], generate_tokens: int = 0,
    ) -> MemoryEstimate:
        """:func:`estimate_eval_memory` for this step (cached), with a greedy ``generate`` of
        ``generate_tokens`` new tokens on its batch when > 0; raises what it raises."""
        if self.live is None:
            self.live = live_training_state(module, optimizers)
        if self.style is None:
            self.style = eval_forward_style(module)
        key = (phase, b, s, *self.live, *self.style, generate_tokens)
        if key in self.estimates:
            self.estimates.move_to_end(key)
            cached = self.estimates[key]
            assert cached is not None
            return cached
        est = estimate_eval_memory(
            spec, train, plan, phase=phase, micro_batch=b, seq_len=s, grads_alive=self.live[0],
            optimizer_states=self.live[1], kv_cache=self.style[0], held_hidden=self.style[1],
            generate_tokens=generate_tokens, rank=rank,
        )
        self.estimates[key] = est
        if len(self.estimates) > _EVAL_CACHE_SIZE:
            self.estimates.popitem(last=False)
        return est

    def add(self, record: StepRecord, *, epoch: int, rank: int, backend: str) -> None:
        acc = self.acc.get(record.phase)
        if acc is None or acc.epoch != epoch:
            acc = self.acc[record.phase] = RankAccumulator(rank=rank, epoch=epoch, backend=backend)
        acc.add(record)
        self.window.setdefault(record.phase, []).append(record)
        self.seen[record.phase] = self.seen.get(record.phase, 0) + 1
        if record.tracked:
            self.tracked.add(record.phase)

    def take_window(self, phase: str) -> list[StepRecord]:
        """The records of the ``phase`` run just finished; the next run reads the training state again."""
        self.live = None
        return self.window.pop(phase, [])

    def take_summaries(self) -> dict[str, dict[str, Any]]:
        """``{phase: RankSummary.to_dict()}`` of the phases that ran, emptying the accumulators."""
        out = {p: self.acc[p].summary().to_dict() for p in EVAL_PHASES if p in self.acc and self.acc[p].steps}
        self.acc.clear()
        self.tracked.clear()
        return out
