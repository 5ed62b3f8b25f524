"""When nothing fits: the cheapest changes that would make the closest plan fit.

Tried in order of how cheap they are for the user, each checked with the memory model:
1. training settings the search was not allowed to use (chunked loss, full recompute, micro-batch 1,
   an 8-bit Adam);
2. a shorter sequence (the longest that fits, by bisection on multiples of 2 x cp x tp);
3. the fewest GPUs that fit (doubling, then bisecting in whole nodes; each a full re-plan);
4. a device with more memory from the hardware table (same plan), else the per-GPU memory that would fit.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from lightning_memplan.hardware.presets import CHIP_TABLE
from lightning_memplan.hardware.spec import HardwareSpec
from lightning_memplan.model import terms
from lightning_memplan.model.reserved import ReservedEstimate
from lightning_memplan.model.result import readable_bytes
from lightning_memplan.model.sizes import kernels_of
from lightning_memplan.planning.budget import need_text
from lightning_memplan.planning.decision import Candidate, Suggestion

__all__ = ["cluster_with", "device_memory_needed", "suggest"]

GiB = 2**30
#: Cluster growth factors tried, smallest first.
GROWTH_FACTORS = (2, 4, 8)
#: Largest cluster the nothing-fits suggestion searches (GPUs).
MAX_SUGGESTED_GPUS = 4096
#: GPUs per node assumed when a one-node cluster grows past its node (an HGX/DGX node).
NODE_GPUS = 8


def _fit_text(need: ReservedEstimate, budget: int) -> str:
    rel = "<=" if need.reserved <= budget else ">"
    return f"peak {need_text(need)} {rel} {readable_bytes(budget)} budget"


def _checked(search: Any, change: str, kind: str, plan: Any, train: Any, est: Any, where: str = "") -> Suggestion:
    """A suggestion whose ``(plan, train)`` was estimated: fits when its need is within its budget."""
    need, budget = search.need(plan, train, est), search.budget(plan).budget
    return Suggestion(change=change, kind=kind, fits=need.reserved <= budget,
                      detail=f"{plan.describe()}{where}: {_fit_text(need, budget)}",
                      peak_bytes=est.total, reserved_bytes=need.reserved, budget_bytes=budget)


def _train_changes(search: Any, closest: Candidate) -> list[Suggestion]:
    out = []
    tr, plan = closest.train, closest.plan
    changes: list[tuple[str, dict[str, Any]]] = []
    if tr.loss not in ("chunked", "vocab_parallel"):
        chunk = terms.planned_loss_chunk_tokens(search.model, kernels_of(tr), tr.micro_batch * tr.seq_len // plan.cp)
        changes.append(("loss='chunked'", {"loss": "chunked", "loss_chunk_size": chunk}))
    if tr.recompute != "full":
        changes.append(("recompute='full'", {"recompute": "full"}))
    if tr.micro_batch > 1:
        acc = tr.grad_accumulation * tr.micro_batch if plan.pp == 1 else tr.grad_accumulation
        changes.append(("micro_batch=1 (more accumulation)", {"micro_batch": 1, "grad_accumulation": acc}))
    if tr.optimizer in ("adam", "adamw") and tr.optimizer_bytes_per_param is None:
        changes.append(("optimizer='adamw8bit' (8-bit states)", {"optimizer": "adamw8bit"}))
    for text, kw in changes:
        new = tr.replace(**kw)
        new_plan = plan
        if plan.pp > 1 and "micro_batch" in kw:
            new_plan = replace(plan, microbatches=plan.microbatches * tr.micro_batch)
        try:
            est = search.worst(new_plan, new)
        except ValueError:
            continue
        out.append(_checked(search, text, "train", new_plan, new, est))
    return out


def _shorter_sequence(search: Any, closest: Candidate) -> list[Suggestion]:
    tr, plan = closest.train, closest.plan
    unit = 2 * plan.cp * plan.tp
    lo, hi = 0, tr.seq_len // unit  # multiples of unit; hi does not fit
    best: tuple[Any, Any] | None = None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        cand = tr.replace(seq_len=mid * unit)
        if cand.loss == "chunked" and cand.loss_chunk_size and cand.loss_chunk_size > cand.micro_batch * cand.seq_len:
            cand = cand.replace(loss_chunk_size=None)
        try:
            est = search.worst(plan, cand)
        except ValueError:
            hi = mid
            continue
        if search.fits(plan, cand, est):
            lo, best = mid, (cand, est)
        else:
            hi = mid
    if best is None:
        return [Suggestion(change="a shorter sequence", kind="sequence", fits=False,
                           detail=f"even seq_len={unit} does not fit {plan.describe()}")]
    return [_checked(search, f"seq_len <= {lo * unit}", "sequence", plan, *best, where=f" at seq_len={lo * unit}")]


def cluster_with(hardware: HardwareSpec, gpus: int) -> HardwareSpec:
    """``hardware`` resized to ``gpus`` GPUs: one node while they fit in a node of up to
    :data:`NODE_GPUS` (or the current node size), else whole nodes of the current node size (8 when the
    current node is smaller)."""
    per_node = max(hardware.gpus_per_node, NODE_GPUS)
    if gpus <= per_node and hardware.num_nodes == 1:
        return replace(hardware, gpus_per_node=gpus, num_nodes=1)
    per_node = hardware.gpus_per_node if hardware.num_nodes > 1 else per_node
    return replace(hardware, gpus_per_node=per_node, num_nodes=-(-gpus // per_node))


def _fits_on(search: Any, hw: HardwareSpec) -> Candidate | None:
    from lightning_memplan.planning.search import _Search

    sub = _Search(search.model, search.train, hw, search.allow, search.global_batch, search.headroom,
                  search.explicit_budget, search.calibration, 1, expandable_segments=search.expandable_segments)
    try:
        found = sub.run()
    except ValueError:
        return None
    search.evaluations += sub.evaluations
    return found["candidates"][0] if found["candidates"] else None


def _more_gpus(search: Any) -> list[Suggestion]:
    """The smallest cluster of this hardware that fits: GPU counts double from the current one up to
    :data:`MAX_SUGGESTED_GPUS`, then the gap to the last miss is bisected in whole nodes; the answer is
    a cluster the planner itself found a fitting plan on."""
    hw0 = search.hardware
    lo, hi, found = hw0.world_size, None, None
    n = hw0.world_size * 2
    while n <= MAX_SUGGESTED_GPUS:
        hw = cluster_with(hw0, n)
        c = _fits_on(search, hw)
        if c is not None:
            hi, found = hw, (hw, c)
            break
        lo = hw.world_size
        n = hw.world_size * 2
    if found is None:
        return [Suggestion(change=f"more GPUs (up to {MAX_SUGGESTED_GPUS})", kind="cluster", fits=False,
                           detail=f"no layout of up to {MAX_SUGGESTED_GPUS} x {hw0.name} fits either")]
    assert hi is not None
    per_node = hi.gpus_per_node
    lo_nodes, hi_nodes = max(1, lo // per_node), hi.num_nodes
    while hi.num_nodes > 1 and hi_nodes - lo_nodes > 1:  # bisect in whole nodes
        mid = (lo_nodes + hi_nodes) // 2
        hw = replace(hi, num_nodes=mid)
        c = _fits_on(search, hw)
        if c is not None:
            hi_nodes, found = mid, (hw, c)
        else:
            lo_nodes = mid
    hw, c = found
    nodes = f"{hw.num_nodes} node{'s' if hw.num_nodes > 1 else ''} of {hw.gpus_per_node}"
    return [Suggestion(change=f"{hw.world_size} GPUs ({nodes} x {hw.name}), the fewest that fit",
                       kind="cluster", fits=True,
                       detail=f"{c.describe()}: peak {c.need_text()} <= {readable_bytes(c.budget.budget)} budget",
                       peak_bytes=c.peak_bytes, reserved_bytes=c.reserved_bytes, budget_bytes=c.budget.budget)]


def device_memory_needed(search: Any, closest: Candidate) -> int:
    """Device bytes per GPU at which the closest plan's need (its reserved peak, which does not depend
    on the device's size) fits its budget: ``M (1 - headroom) - context - NCCL >= reserved``."""
    bud = closest.budget
    if bud.explicit:
        return closest.reserved_bytes
    fixed = bud.cuda_context + bud.nccl
    return math.ceil((closest.reserved_bytes + fixed) / (1 - search.headroom))


def _bigger_device(search: Any, closest: Candidate) -> list[Suggestion]:
    hw = search.hardware
    for chip in sorted(CHIP_TABLE.values(), key=lambda c: c.memory_bytes):
        if chip.memory_bytes <= hw.memory_bytes:
            continue
        other = HardwareSpec.from_chip(chip, gpus_per_node=hw.gpus_per_node, num_nodes=hw.num_nodes)
        from lightning_memplan.planning.budget import memory_budget

        bud = memory_budget(other, closest.plan, headroom=search.headroom, explicit=search.explicit_budget)
        if closest.reserved_bytes <= bud.budget:
            return [Suggestion(change=f"a {chip.memory_bytes / GiB:.0f} GiB device such as {chip.key}", kind="hardware",
                               fits=True, detail=f"{closest.plan.describe()}: peak {closest.need_text()} <= "
                               f"{readable_bytes(bud.budget)} budget",
                               peak_bytes=closest.peak_bytes, reserved_bytes=closest.reserved_bytes,
                               budget_bytes=bud.budget)]
    return []


def _device_memory(search: Any, closest: Candidate) -> list[Suggestion]:
    need = device_memory_needed(search, closest)
    size = f"{need / GiB:.0f} GiB" if need >= GiB else readable_bytes(need)
    return [Suggestion(change=f"{size} per GPU (same {search.hardware.world_size} GPUs)", kind="hardware",
                       fits=True, detail=f"{closest.plan.describe()} needs {closest.need_text()}; with "
                       f"{size} devices its budget covers it", peak_bytes=closest.peak_bytes,
                       reserved_bytes=closest.reserved_bytes, budget_bytes=None)]


def suggest(search: Any, closest: Candidate) -> list[Suggestion]:
    """Suggestions for a search that found no fitting plan, cheapest kind first, fitting ones first
    within a kind."""
    out = _train_changes(search, closest)
    out += _shorter_sequence(search, closest)
    out += _more_gpus(search)
    out += _bigger_device(search, closest) or _device_memory(search, closest)
    order = {"train": 0, "sequence": 1, "cluster": 2, "hardware": 3}
    return sorted(out, key=lambda s: (not s.fits, order[s.kind]))
