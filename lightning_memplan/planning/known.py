"""The layouts people know, planned on the same cluster next to the choice, so the explanation can say
how the choice compares with them in predicted time and memory.

Three families, each searched with the planner itself (restricted ``allow=``, best fitting options):

- ``FSDP only``: dp = world, ZeRO-3 (torchtitan's 1D default, ``docs/fsdp.md``);
- ``FSDP x TP inside the node``: tp = the largest size up to the node's GPU count that divides the
  heads, dp = world / tp, ZeRO-3 (torchtitan's 2D; Table 4 of ``benchmarks/llama3_h100_202412_torchtitan.md``);
- ``Megatron TP x PP x DP``: tp as above, pp > 1 (any schedule), no CP, ZeRO <= 1 (Narayanan et al. 2021,
  arXiv 2104.04473, section 3: TP inside a node, PP across nodes, the distributed optimizer); for
  ``TrainSpec(framework="llama3")`` instead ``Llama 3 TP x PP x FSDP``: the same with ZeRO 1-2 (Dubey et
  al. 2024, arXiv 2407.21783, section 3.3.2: FSDP shards optimizer states and gradients, parameters are
  not resharded after forward; CP only for long context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_memplan.model.result import readable_bytes
from lightning_memplan.planning.decision import Candidate
from lightning_memplan.planning.ranking import (
    SIMPLICITY_MARGIN,
    candidate_axes,
    faster_but_not_chosen,
    ranking_factor,
)
from lightning_memplan.planning.space import Allow

__all__ = ["KnownLayout", "axis_notes", "faster_but_not_chosen", "fastest_plan_note", "known_layouts", "known_layout_notes"]


@dataclass(frozen=True)
class KnownLayout:
    """One well-known family on this cluster: its best fitting candidate, or why there is none."""

    name: str
    candidate: Candidate | None
    reason: str = ""


def _node_tp(model: Any, hardware: Any) -> int:
    for t in range(min(hardware.gpus_per_node, hardware.world_size), 0, -1):
        if hardware.world_size % t == 0 and model.n_heads % t == 0 and model.kv_heads % t == 0:
            return t
    return 1


def _families(search: Any) -> list[tuple[str, dict[str, Any]]]:
    world = search.hardware.world_size
    t = _node_tp(search.model, search.hardware)
    out = [("FSDP only", {"dp": [world], "tp": [1], "pp": [1], "cp": [1], "zero": [3]})]
    if t > 1:
        out.append((f"FSDP x TP {t} inside the node", {"dp": [world // t], "tp": [t], "pp": [1], "cp": [1], "zero": [3]}))
        pps = [p for p in range(2, min(world // t, search.model.n_layers) + 1) if (world // t) % p == 0]
        if pps and search.train.framework == "llama3":
            # Llama 3's 4D at 8K context: TP in the node, PP, FSDP sharding optimizer states and gradients
            # without resharding after forward (zero 2); CP only for long context (arXiv 2407.21783 3.3.2)
            out.append((f"Llama 3 TP {t} x PP x FSDP", {"tp": [t], "pp": pps, "cp": [1], "zero": [1, 2]}))
        elif pps:
            out.append((f"Megatron TP {t} x PP x DP", {"tp": [t], "pp": pps, "cp": [1], "zero": [0, 1]}))
    return out


def _restrict(base: Allow, extra: dict[str, Any]) -> Allow:
    """``base`` with the family's axes; options the user allowed (recompute, loss, micro-batch) kept."""
    data = {k: v for k, v in base.to_dict().items() if v is not None}
    data.update(extra)
    if base.zero and "zero" in extra:
        data["zero"] = [z for z in extra["zero"] if z in base.zero] or extra["zero"]
    return Allow.parse(data)


def known_layouts(search: Any) -> list[KnownLayout]:
    """Plan each well-known family on ``search``'s cluster and global batch (one small search each)."""
    from lightning_memplan.planning.search import _Search

    out = []
    for name, extra in _families(search):
        sub = _Search(search.model, search.train, search.hardware, _restrict(search.allow, extra), search.global_batch,
                      search.headroom, search.explicit_budget, search.calibration, 1, share=search,
                      expandable_segments=search.expandable_segments)
        try:
            found = sub.run()
        except ValueError as exc:
            out.append(KnownLayout(name, None, f"not applicable: {str(exc).split('; ')[0]}"))
            continue
        search.evaluations += sub.evaluations
        if found["candidates"]:
            out.append(KnownLayout(name, found["candidates"][0]))
        else:
            closest = found["closest"]
            why = "does not fit"
            if closest is not None:
                why += (f": best {closest.describe()} needs {closest.need_text()} > "
                        f"{readable_bytes(closest.budget.budget)}")
            out.append(KnownLayout(name, None, why))
    return out


def _same(a: Candidate, b: Candidate) -> bool:
    return a.plan == b.plan and a.train == b.train


def fastest_plan_note(search: Any, chosen: Candidate) -> list[str]:
    """The fastest fitting plan without the simplicity margin, when the margin passed it over: one line
    with both predicted step times (one more search, ranked with ``margin=0``).

    Only a plan with more parallel dimensions than the choice can win it: with ``a`` axes and a score
    ``x`` without the margin, one with ``a' <= a`` axes that scored less would have scored
    ``x' (1 + margin)^a' < x (1 + margin)^a`` in the search itself. So the second search covers the
    layouts with more axes and the scores below the choice's, and finds nothing when the choice is
    also the fastest."""
    from lightning_memplan.planning.search import _Search

    axes = len(candidate_axes(chosen))
    if not chosen.step.modelled or search.margin == 0 or axes == 3:
        return []
    own = chosen.score / ranking_factor(0.0, axes, margin=search.margin)  # the choice's score without the margin
    sub = _Search(search.model, search.train, search.hardware, search.allow, search.global_batch, search.headroom,
                  search.explicit_budget, search.calibration, 1, margin=0.0, share=search,
                  expandable_segments=search.expandable_segments, min_axes=axes + 1, cutoff=own * (1 - 1e-12))
    found = sub.run()
    search.evaluations += sub.evaluations
    if not found["candidates"]:
        return []
    fast = found["candidates"][0]
    if _same(fast, chosen) or fast.step.tokens_per_s <= chosen.step.tokens_per_s * 1.0005:
        return []
    return [f"fastest predicted plan {fast.describe()}: {fast.step.total_s:.3g} s/step vs the choice's "
            f"{chosen.step.total_s:.3g} s, {fast.need_text()} peak; " + faster_but_not_chosen(fast, chosen)]


def axis_notes(search: Any, chosen: Candidate) -> list[str]:
    """For each parallel dimension the choice uses (tp, pp, cp): the best plan without it, in numbers,
    so every extra axis is justified by memory (nothing fits without it) or by a predicted gain above
    :data:`~lightning_memplan.planning.ranking.SIMPLICITY_MARGIN` (one restricted search per axis)."""
    from lightning_memplan.planning.search import _Search

    if not chosen.step.modelled:
        return []
    lines = []
    for axis in candidate_axes(chosen):
        sub = _Search(search.model, search.train, search.hardware, _restrict(search.allow, {axis: [1]}), search.global_batch,
                      search.headroom, search.explicit_budget, search.calibration, 1, margin=search.margin, share=search,
                      expandable_segments=search.expandable_segments)
        try:
            found = sub.run()
        except ValueError as exc:
            lines.append(f"without {axis}: no layout ({str(exc).split('; ')[0]})")
            continue
        search.evaluations += sub.evaluations
        if not found["candidates"]:
            closest = found["closest"]
            miss = (f": the closest, {closest.describe()}, needs {closest.need_text()} > "
                    f"{readable_bytes(closest.budget.budget)}") if closest is not None else ""
            lines.append(f"without {axis} nothing fits{miss}")
            continue
        alt = found["candidates"][0]
        gain = chosen.step.tokens_per_s / alt.step.tokens_per_s - 1
        lines.append(
            f"without {axis}: best {alt.describe()}: {alt.step.total_s:.3g} s/step, {alt.need_text()} "
            f"peak; the choice is predicted {100 * gain:.1f}% faster (a parallel dimension must buy > "
            f"{100 * SIMPLICITY_MARGIN:g}%, the time model's error band)")
    return lines


def known_layout_notes(search: Any, chosen: Candidate, fits: bool) -> list[str]:
    """One line per well-known family: its best plan, predicted time and memory, and how the choice
    compares (``"the choice is 12.3 % faster (2.41 s vs 2.71 s per step, 61.2 vs 58.0 GiB)"``)."""
    if not fits:
        return []
    lines = fastest_plan_note(search, chosen) + axis_notes(search, chosen)
    for k in known_layouts(search):
        if k.candidate is None:
            lines.append(f"well-known layout {k.name}: {k.reason}")
            continue
        c = k.candidate
        if _same(c, chosen):
            lines.append(f"well-known layout {k.name}: {c.describe()} is the choice")
            continue
        mem = f"{c.need_text()} peak vs the choice's {chosen.need_text()}"
        if not chosen.step.modelled:
            lines.append(f"well-known layout {k.name}: {c.describe()} fits ({mem}); step time not modelled here")
            continue
        gain = chosen.step.tokens_per_s / c.step.tokens_per_s - 1
        if gain >= 0.0005:
            verdict = f"the choice is predicted {100 * gain:.1f}% faster"
        elif gain > -0.0005:
            verdict = "the same predicted speed; the choice needs fewer changes"
        else:
            verdict = faster_but_not_chosen(c, chosen)
        terms = ", ".join(f"{key} {v:.3g} s" for key, v in c.step.exposed_s.items() if v > 0.01 * c.step.total_s)
        lines.append(
            f"well-known layout {k.name}: {c.describe()}: {c.step.total_s:.3g} s/step "
            f"({c.step.tokens_per_s:,.0f} tokens/s; bubble {c.step.bubble_s:.3g} s"
            f"{'; exposed ' + terms if terms else ''}), {mem}; {verdict}"
        )
    return lines
