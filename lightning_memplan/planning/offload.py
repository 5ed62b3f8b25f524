"""Offloading to host memory when nothing fits on the devices: FSDP2's ``CPUOffloadPolicy``
(``TrainSpec(offload="params")``) and activation offloading (``offload_activations=True``), within a
host-memory budget, with the PCIe transfers they add to the step.

:func:`plan <lightning_memplan.planning.plan>` calls :func:`offload_fallback` only when its on-device
search found no candidate. Each allowed offload (:data:`OFFLOAD_CHOICES` in ``Allow.offload``) is searched
with the planner's own best-first search, its TrainSpec carrying the offload and ``allow`` narrowed to what
the memory model covers (pp = 1; ZeRO 2/3 or one data-parallel rank for ``CPUOffloadPolicy``; no
activation checkpointing next to activation offloading). A candidate must also fit the host:

``host need per rank = host + (PINNED_ROUNDING_BOUND - 1) * pinned``  (``model.offload.host_need_bytes``)
``host budget per rank = host_memory_bytes * (1 - headroom) / gpus_per_node``

(the ``gpus_per_node`` ranks of a node share its host memory). Among the offloads that fit, the one with
the shortest predicted step is chosen, the transfers priced on the GPU's host link
(``HardwareSpec.host_link_bw``, half the datasheet's bidirectional PCIe figure; ``hardware/presets.py``):

- activation offloading copies every packed tensor to the host in the forward and back in the backward
  on the *compute* stream (``torch/autograd/graph.py``, ``save_on_cpu``: ``copy_(tensor, non_blocking=
  True)`` and ``.to(device, non_blocking=True)`` run on the current stream), so ``2 m A / bw`` is exposed
  (A the host activation bytes per micro-batch, m micro-batches per step);
- ``CPUOffloadPolicy`` copies the shards host-to-device on the all-gather copy-in stream and the gradients
  device-to-host on the reduce-scatter stream (``_fsdp_param.py`` ``all_gather_inputs``,
  ``_fsdp_collectives.py`` ``foreach_reduce``), which overlap compute: the larger direction's time less
  ``OVERLAP_EFFICIENCY`` of the compute is exposed. Its optimizer step runs on the CPU, whose time is not
  modelled (the device step's is kept; the explanation says so).

Offloading is never tried on a CPU host or for a ``device="cpu"`` step (host and device memory are one).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lightning_memplan.hardware.spec import HardwareSpec
from lightning_memplan.model.offload import host_need_bytes, transfer_bytes
from lightning_memplan.model.result import MemoryEstimate, readable_bytes
from lightning_memplan.model.specs import TrainSpec
from lightning_memplan.planning.decision import Candidate
from lightning_memplan.planning.space import OFFLOAD_CHOICES, Allow
from lightning_memplan.planning.timing import OVERLAP_EFFICIENCY, StepTime, time_model_applies

__all__ = [
    "OFFLOAD_CHOICES",
    "OffloadOutcome",
    "host_budget_per_rank",
    "offload_allow",
    "offload_fallback",
    "offload_step_time",
    "offload_train",
]


def offload_train(train: TrainSpec, choice: str) -> TrainSpec:
    """``train`` with the offload ``choice`` (``"activations"``, ``"params"``, ``"params+activations"``)."""
    parts = choice.split("+")
    return train.replace(offload="params" if "params" in parts else "none",
                         offload_activations="activations" in parts)


def offload_allow(allow: Allow, choice: str) -> Allow | None:
    """``allow`` narrowed to what ``choice`` can run with (the rules of ``model.offload.offload_blocker``
    and ``TrainSpec``): pp = 1; ``"params"``: ZeRO 2/3 (a one-rank layout is enumerated with zero=0 and
    sharded over a one-rank mesh); activations: recompute ``"none"``. ``None`` when nothing is left."""
    if allow.pp is not None and 1 not in allow.pp:
        return None
    changes: dict[str, Any] = {"pp": (1,), "schedule": ("1f1b",), "virtual_stages": None}
    if "params" in choice:
        zeros = tuple(z for z in allow.zero if z in (2, 3))
        if not zeros:
            return None
        changes["zero"] = zeros
    if "activations" in choice:
        if "none" not in allow.recompute:
            return None
        changes["recompute"] = ("none",)
    return dataclasses.replace(allow, **changes)


def host_budget_per_rank(hardware: HardwareSpec, headroom: float, explicit: int | None = None) -> int | None:
    """Host bytes one rank may hold: ``explicit`` (bytes per node) or ``host_memory_bytes * (1 - headroom)``,
    divided by the node's ``gpus_per_node`` ranks; ``None`` when the host memory is unknown."""
    per_node = explicit if explicit is not None else (
        None if hardware.host_memory_bytes is None else round(hardware.host_memory_bytes * (1.0 - headroom)))
    if per_node is None:
        return None
    return per_node // max(1, min(hardware.gpus_per_node, hardware.world_size))


def offload_step_time(step: StepTime, estimate: MemoryEstimate, train: TrainSpec, hardware: HardwareSpec) -> StepTime:
    """``step`` with the PCIe transfers of ``estimate``'s offloads (see the module docstring); unchanged
    when the step is not modelled or nothing is offloaded."""
    h2d, d2h = transfer_bytes(estimate)
    if not step.modelled or not (h2d or d2h):
        return step
    bw = hardware.resolved("host_link_bw")
    m = train.grad_accumulation
    acts = m * int(estimate.details.get("host_activations", 0))
    exposed = dict(step.exposed_s)
    overlapped = dict(step.overlapped_s)
    acts_s = 2 * acts / bw  # down in the forward, up in the backward, on the compute stream
    states_s = max(h2d - acts, d2h - acts) / bw  # the two copy engines run side by side
    states_exposed = max(0.0, states_s - OVERLAP_EFFICIENCY * step.compute_s)
    if acts_s + states_exposed > 0:
        exposed["offload"] = acts_s + states_exposed
    if states_s - states_exposed > 0:
        overlapped["offload"] = states_s - states_exposed
    total = step.total_s + acts_s + states_exposed
    return dataclasses.replace(
        step, total_s=total, exposed_s=exposed, overlapped_s=overlapped,
        tokens_per_s=step.tokens / total if total > 0 else 0.0,
        mfu=step.mfu * step.total_s / total if total > 0 else 0.0,
    )


@dataclass(frozen=True)
class OffloadOutcome:
    """What :func:`offload_fallback` found: ranked fitting candidates (offload included in their
    ``train``), the host budget per rank it used, and notes for the explanation."""

    candidates: tuple[Candidate, ...] = ()
    host_budget: int | None = None
    notes: tuple[str, ...] = field(default=())


def offload_fallback(search: Any, *, host_memory_budget: int | None, make_search: Any) -> OffloadOutcome:
    """Search the allowed offloads after the on-device ``search`` found nothing (see the module docstring).

    Args:
        search: the planner's on-device ``_Search`` (its model, train, hardware, allow, headroom).
        host_memory_budget: bytes per node replacing ``hardware.host_memory_bytes * (1 - headroom)``.
        make_search: ``callable(train, allow, host_budget) -> _Search`` (the planner's constructor, so this
            module does not build searches itself).
    """
    hardware, train = search.hardware, search.train
    choices = [c for c in search.allow.offload if c != "none"]
    if not choices:
        return OffloadOutcome()
    if not time_model_applies(hardware, train):
        return OffloadOutcome(notes=("nothing fits on the devices; offloading to host memory is not tried on a CPU "
                                     "step (host and device memory are the same)",))
    if train.framework != "torch" or train.offload != "none" or train.offload_activations:
        return OffloadOutcome()  # the user chose the stack's offload (or another stack): nothing to add
    budget = host_budget_per_rank(hardware, search.headroom, host_memory_budget)
    if budget is None:
        return OffloadOutcome(notes=(
            "nothing fits on the devices; offloading to host memory was not tried: the host memory is unknown "
            "(pass HardwareSpec(..., host_memory_bytes=...) or plan(host_memory_budget=...))",))
    found: list[tuple[str, Candidate]] = []
    missed: list[str] = []
    for choice in choices:
        allow = offload_allow(search.allow, choice)
        if allow is None:
            missed.append(f"{choice}: not allowed with allow=")
            continue
        sub = make_search(offload_train(train, choice), allow, budget)
        try:
            result = sub.run()
        except ValueError as exc:
            missed.append(f"{choice}: {exc}")
            continue
        kept = [dataclasses.replace(c, step=offload_step_time(c.step, c.estimate, c.train, hardware))
                for c in result["candidates"]]
        if not kept:
            closest = result["closest"]
            missed.append(f"{choice}: " + (_miss_text(sub, closest) if closest is not None else "no layout evaluated"))
            continue
        found += [(choice, c) for c in kept]
    if not found:
        return OffloadOutcome(host_budget=budget, notes=(
            "nothing fits on the devices, nor with offloading to host memory (host budget "
            f"{readable_bytes(budget)} per rank): " + "; ".join(missed),))
    found.sort(key=lambda item: item[1].step.total_s)
    choice, best = found[0]
    need = host_need_bytes(best.estimate)
    ranks = max(1, min(hardware.gpus_per_node, hardware.world_size))
    notes = [
        f"nothing fits on the devices without offloading, so the plan offloads {_what(choice)} to host memory: "
        f"{readable_bytes(best.estimate.host)} per rank ({readable_bytes(need)} counting pinned blocks rounded up "
        f"to a power of two), {readable_bytes(need * ranks)} for the node's {ranks} rank{'s' if ranks > 1 else ''} "
        f"<= host budget {readable_bytes(budget * ranks)} per node",
    ]
    h2d, d2h = transfer_bytes(best.estimate)
    notes.append(
        f"offload transfers per step: {readable_bytes(h2d)} host-to-device, {readable_bytes(d2h)} device-to-host at "
        f"{hardware.resolved('host_link_bw') / 1e9:.0f} GB/s per direction; "
        + ("the CPU optimizer step's time is not modelled (the device step's is counted)"
           if "params" in choice else "exposed on the compute stream (save_on_cpu)")
    )
    others = sorted({c for c, _ in found if c != choice})
    if others or missed:
        notes.append("other offloads: " + "; ".join(
            [f"{c} fits but is predicted slower" for c in others] + missed))
    return OffloadOutcome(candidates=tuple(c for _, c in found), host_budget=budget, notes=tuple(notes))


def _what(choice: str) -> str:
    return {
        "activations": "the blocks' saved activations (save_on_cpu)",
        "params": "parameters, gradients and optimizer states (FSDP2 CPUOffloadPolicy)",
        "params+activations": "parameters, gradients, optimizer states (FSDP2 CPUOffloadPolicy) and the blocks' "
                              "saved activations (save_on_cpu)",
    }[choice]


def _miss_text(search: Any, closest: Candidate) -> str:
    est = closest.estimate
    if not search.device_fits(closest.plan, closest.train, est):
        return f"closest {closest.describe()} needs {closest.need_text()} on the device > {readable_bytes(closest.budget.budget)}"
    return (f"closest {closest.describe()} fits the device but needs {readable_bytes(host_need_bytes(est))} of host "
            "memory per rank")
