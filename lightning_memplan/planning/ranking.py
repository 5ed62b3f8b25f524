"""How the planner ranks fitting plans, and the words that explain a ranking: the change costs, the
simplicity margin per parallel dimension and the factor they put on predicted seconds per token.

Its own module below the search (``planning/search.py``), the decision's rendering
(``planning/explain.py``) and the known-layout notes (``planning/known.py``), which all read the same
rules: the search ranks with them and the text explains with them (before, the rendering reached up
into the search for the constants, a cycle decision -> explain -> known -> search -> decision).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    from lightning_memplan.planning.decision import Candidate

__all__ = [
    "CHANGE_COST",
    "CHANGE_PENALTY",
    "SIMPLICITY_MARGIN",
    "candidate_axes",
    "faster_but_not_chosen",
    "parallel_axes",
    "ranking_factor",
]

#: Relative step-time penalty per unit of change cost: with 1 %, a plan needing one more unit of
#: machinery must be predicted > 1 % faster to win. This is "the cheapest sufficient change wins when
#: the time model is close": within the model's accuracy, fewer moving parts are preferred.
CHANGE_PENALTY = 0.01
#: Units of change, relative to plain data parallelism with the user's TrainSpec.
CHANGE_COST: dict[str, float] = {
    "zero1": 0.5, "zero2": 1.0, "zero3": 1.5, "tp": 1.0, "sp": 0.5, "pp": 1.5, "cp": 1.5,
    "interleaved": 0.5, "gpipe": 0.25, "selective": 0.5, "full": 1.0, "chunked": 0.5,
    "vocab_parallel": 1.0, "micro_batch": 0.5,
}
#: The simplicity rule: each parallel dimension beyond data parallelism (tp, pp, cp) must be predicted
#: to buy more than this fraction of step time, or the layout without it is preferred. Rationale: a
#: gain smaller than the time model's own error does not justify one more axis to set up, debug and
#: tune. The model's error against published runs (benchmarks/planner_vs_published.md, the 16 pinned
#: rows) has a median |error| of 5.9 % and a spread of up to 14 points between layouts on one stack
#: (Megatron Table 1: -6.0 % .. +8.4 %); 5 % is below that median, so a dimension that wins by more is
#: rarely a model artefact. Applied only where the step is modelled (on CPU the change cost alone
#: ranks). Compounds per dimension: two more axes must buy > 10.25 %. Context parallelism needs no
#: special case: where the sequence does not fit without it, no layout without it is a candidate.
SIMPLICITY_MARGIN = 0.05


def parallel_axes(tp: int, pp: int, cp: int) -> tuple[str, ...]:
    """The parallel dimensions beyond data parallelism a layout uses (``("tp", "cp")``)."""
    return tuple(name for name, size in (("tp", tp), ("pp", pp), ("cp", cp)) if size > 1)


def ranking_factor(change_cost: float, axes: int, *, modelled: bool = True, margin: float = SIMPLICITY_MARGIN) -> float:
    """The factor on predicted seconds per token that ranks plans (one ranking for ``plan()`` and
    ``memplan_auto``): ``(1 + CHANGE_PENALTY * change_cost) * (1 + margin) ** axes``, the margin
    (:data:`SIMPLICITY_MARGIN`) only where the step is modelled."""
    factor = 1.0 + CHANGE_PENALTY * change_cost
    return factor * (1.0 + margin) ** axes if modelled else factor


def candidate_axes(c: Candidate) -> tuple[str, ...]:
    """:func:`parallel_axes` of a candidate's plan."""
    return parallel_axes(c.plan.tp, c.plan.pp, c.plan.cp)


def faster_but_not_chosen(other: Candidate, chosen: Candidate) -> str:
    """Why ``other``, predicted faster, is not the choice, in numbers: the parallel dimensions it adds
    against :data:`~lightning_memplan.planning.ranking.SIMPLICITY_MARGIN`, or its extra change cost
    (``"it is predicted 3.7% faster but adds pp and cp; each added parallel dimension must buy > 5% (the
    time model's error band), two > 10.2%: within that margin the simpler choice is kept"``)."""
    gain = other.step.tokens_per_s / chosen.step.tokens_per_s - 1
    added = [a for a in candidate_axes(other) if a not in candidate_axes(chosen)]
    head = f"it is predicted {100 * gain:.1f}% faster but "
    if len(candidate_axes(other)) > len(candidate_axes(chosen)) and added:
        n = len(candidate_axes(other)) - len(candidate_axes(chosen))
        need = (1 + SIMPLICITY_MARGIN) ** n - 1
        words = " and ".join(added)
        rule = f"each added parallel dimension must buy > {100 * SIMPLICITY_MARGIN:g}% (the time model's error band)"
        if n > 1:
            rule += f", {n} > {100 * need:.1f}%"
        return f"{head}adds {words}; {rule}: within that margin the simpler choice is kept"
    return (f"{head}needs more machinery (change cost {other.change_cost:g} vs {chosen.change_cost:g}; each unit "
            f"must buy > {100 * CHANGE_PENALTY:g}%)")
