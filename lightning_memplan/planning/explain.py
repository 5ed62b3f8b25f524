"""Rendering a :class:`~lightning_memplan.planning.decision.PlanDecision` as text, markdown or rich."""

from __future__ import annotations

import io
from collections import Counter
from typing import Any

from lightning_memplan.model.result import COMPONENTS
from lightning_memplan.planning.ranking import faster_but_not_chosen
from lightning_memplan.planning.timing import TIME_MODEL_OFF

__all__ = ["FORMATS", "render", "rich_renderable"]

FORMATS = ("text", "markdown", "rich")
GiB = 2**30


def _gib(n: int | float | None) -> str:
    if n is None:
        return "-"
    return f"{n / GiB:.1f}" if abs(n) >= 0.1 * GiB or n == 0 else f"{n / GiB:.2g}"  # 50 MiB: 0.049, not 0.0


def _fmt_s(x: float) -> str:
    return f"{x:.3g} s" if x >= 1e-3 else f"{x * 1e3:.3g} ms"


def _header(d: Any) -> list[str]:
    hw = d.hardware
    gb = d.global_batch if d.global_batch is not None else f"per replica {d.base_train.micro_batch * d.base_train.grad_accumulation}"
    status = "FITS" if d.fits else f"DOES NOT FIT (short by {_gib(d.shortfall_bytes)} GiB)"
    lines = [
        f"model {d.model.name or 'custom'} (N={d.model.num_params / 1e9:.3g}B, L={d.model.n_layers}, h={d.model.hidden}), "
        f"seq_len={d.base_train.seq_len}, global batch {gb}, precision {d.base_train.precision}, optimizer {d.base_train.optimizer}",
        f"hardware {hw.describe()}; world size {hw.world_size}",
        f"chosen: {d.plan.describe()}  [{status}]",
        f"budget per device: {d.budget.describe()}",
        f"predicted peak (worst rank, stage {d.estimate.stage}, {d.estimate.peak_phase}{_source(d)}): {_peak_text(d.reserved)}",
    ]
    if d.estimate.host:
        from lightning_memplan.model.offload import host_need_bytes

        budget = getattr(d, "host_budget_bytes", None)
        lines.append(
            f"host memory per rank (offload): {_gib(d.estimate.host)} GiB, {_gib(host_need_bytes(d.estimate))} GiB with "
            "pinned blocks rounded up" + (f"; host budget per rank {_gib(budget)} GiB" if budget else "")
        )
    changes = d.train_changes()
    lines.append("training changes: " + (", ".join(changes) if changes else "none"))
    st = d.step
    if not st.modelled:
        lines.append(TIME_MODEL_OFF)
    else:
        exposed = ", ".join(f"{k} {_fmt_s(v)}" for k, v in st.exposed_s.items()) or "none"
        hidden = ", ".join(f"{k} {_fmt_s(v)}" for k, v in st.overlapped_s.items()) or "none"
        lines.append(
            f"predicted step {_fmt_s(st.total_s)}: compute {_fmt_s(st.compute_s)}, bubble {_fmt_s(st.bubble_s)}, "
            f"optimizer {_fmt_s(st.optimizer_s)}; exposed comm: {exposed}; overlapped comm: {hidden}"
        )
        lines.append(f"throughput {st.tokens_per_s:,.0f} tokens/s, MFU {100 * st.mfu:.1f}%")
    why = _why_not_runner_up(d)
    if why:
        lines.append(why)
    for note in d.notes:
        lines.append(f"note: {note}")
    s = d.stats
    if s:
        lines.append(
            f"search: {int(s.get('layouts', 0))} layouts, {int(s.get('memory_evaluations', 0))} memory evaluations, "
            f"{1000 * float(s.get('seconds', 0.0)):.0f} ms"
        )
    return lines


def _source(d: Any) -> str:
    """``", calibrated"`` when the peak is the module's calibrated estimate (memplan_auto's check)."""
    return ", calibrated" if d.estimate.source == "calibrated" else ""


def _peak_text(need: Any) -> str:
    """``"68.0 GiB allocated, 81.4 GiB reserved (default stream 66.0 + ...)"`` on CUDA; the allocated
    GiB alone where nothing is modelled above them (CPU: no caching allocator)."""
    if need.reserved == need.allocated and not need.overhead:
        return f"{_gib(need.allocated)} GiB"
    terms = [("default stream", need.default_stream_peak), ("all-gather pool", need.all_gather_pool),
             ("reduce-scatter pool", need.reduce_scatter_pool), ("loss segment", need.loss_segment),
             ("rounding", need.rounding)]
    shown = " + ".join(f"{name} {_gib(v)}" for name, v in terms if v)
    return f"{_gib(need.allocated)} GiB allocated, {_gib(need.reserved)} GiB reserved ({shown}); the reserved bytes must fit"


def _why_not_runner_up(d: Any) -> str | None:
    """One line on the best candidate that differs from the choice in words (never the choice itself)."""
    if not d.fits or len(d.candidates) < 2:
        return None
    best = d.candidates[0]
    shown = best.describe()
    second = next((c for c in d.candidates[1:] if c.describe() != shown), None)
    if second is None:
        return None
    if not best.step.modelled:
        return (f"why not the runner-up ({second.describe()}): more machinery (change cost {second.change_cost:g} "
                f"vs {best.change_cost:g}); step time is not modelled here")
    gain = second.step.tokens_per_s / best.step.tokens_per_s - 1
    if gain > 0.0005:
        return f"why not the runner-up ({second.describe()}): " + faster_but_not_chosen(second, best)
    if gain > -0.0005:
        return (f"why not the runner-up ({second.describe()}): the same predicted tokens/s with more machinery "
                f"(change cost {second.change_cost:g} vs {best.change_cost:g})")
    return f"why not the runner-up ({second.describe()}): {100 * -gain:.1f}% fewer tokens/s predicted"


def _breakdown_rows(d: Any) -> list[tuple[str, str]]:
    comps = d.estimate.components()
    return [(c, _gib(comps[c])) for c in COMPONENTS if comps.get(c, 0) > 0]


def _candidate_rows(d: Any, top: int) -> list[list[str]]:
    rows = []
    # tokens/s, not step time: without a global batch the layouts' steps carry different token counts
    best = d.candidates[0].step.tokens_per_s if d.candidates else None
    for i, c in enumerate(d.candidates[:top], 1):
        if not c.step.modelled:
            rows.append([str(i), c.describe(), _gib(c.peak_bytes), _gib(c.reserved_bytes), _gib(c.budget.budget),
                         "-", "-", "-", "-", "; ".join(c.notes)])
            continue
        delta = f"{100 * (c.step.tokens_per_s / best - 1):+.1f}% tokens/s" if best else "-"
        rows.append([
            str(i), c.describe(), _gib(c.peak_bytes), _gib(c.reserved_bytes), _gib(c.budget.budget), _fmt_s(c.step.total_s),
            f"{c.step.tokens_per_s:,.0f}", f"{100 * c.step.mfu:.1f}%", delta, "; ".join(c.notes),
        ])
    return rows


_CAND_HEAD = ["#", "plan | training", "alloc GiB", "reserved GiB", "budget GiB", "step", "tokens/s", "MFU", "vs best",
              "notes"]
_NUMERIC = frozenset(_CAND_HEAD[2:-1])


_CHECK_HEAD = ["#", "plan | training (as applied)", "analytic", "calibrated", "budget", "decided by", "result", "note"]
_CHECK_NUMERIC = frozenset({"analytic", "calibrated", "budget"})


def _size(n: int | None) -> str:
    """Bytes with three decimals in MiB (GiB from 1 GiB): the analytic and calibrated peaks differ by a few %."""
    if n is None:
        return "-"
    return f"{n / GiB:.3f} GiB" if abs(n) >= GiB else f"{n / 2**20:.3f} MiB"


def _checked_rows(d: Any) -> list[list[str]]:
    """The candidates checked against the module's calibrated estimate, analytic and calibrated peaks side
    by side and which one decided (``PlanDecision.checked``; a decision from ``plan()`` alone has none)."""
    return [
        [str(i), c.layout, _size(c.analytic_bytes), _size(c.calibrated_bytes), _size(c.budget_bytes), c.decided_by,
         "fits" if c.fits else "misses", c.note]
        for i, c in enumerate(getattr(d, "checked", ()), 1)
    ]


_CHECK_TITLE = "checked against the calibrated estimate of the module (worst rank, in rank order)"


def _checked_text(d: Any) -> list[str]:
    rows = _checked_rows(d)
    if not rows:
        return []
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(_CHECK_HEAD)]
    lines = [f"{_CHECK_TITLE}:", "  " + "  ".join(h.ljust(w) for h, w in zip(_CHECK_HEAD, widths, strict=True)).rstrip()]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return lines


def _rejected_lines(d: Any, max_rejected: int) -> list[str]:
    by_kind = Counter(r.kind for r in d.rejected)
    if not d.rejected:
        return ["rejected: none (every layout the search visited fits)"]
    lines = [f"rejected: {len(d.rejected)} (" + ", ".join(f"{k} {n}" for k, n in sorted(by_kind.items())) + ")"]
    for kind in ("divisibility", "batch", "allow", "memory", "slower"):
        items = [r for r in d.rejected if r.kind == kind]
        if kind == "memory":  # estimated misses first, then the ones proven by a bound
            items.sort(key=lambda r: r.peak_bytes is None)
        for r in items[:max_rejected]:
            lines.append(f"  [{kind}] {r.layout}: {r.reason}")
        if len(items) > max_rejected:
            lines.append(f"  [{kind}] ... and {len(items) - max_rejected} more")
    return lines


def _suggestion_lines(d: Any) -> list[str]:
    if d.fits or not d.suggestions:
        return []
    lines = ["changes that would make it fit (cheapest first):"]
    for s in d.suggestions:
        mark = "fits" if s.fits else "not enough"
        lines.append(f"  - {s.change} [{s.kind}, {mark}]: {s.detail}")
    return lines


def _text(d: Any, top: int, max_rejected: int) -> str:
    lines = _header(d)
    lines.append("memory at the peak (GiB): " + ", ".join(f"{k} {v}" for k, v in _breakdown_rows(d)))
    lines += _suggestion_lines(d)
    if d.candidates:
        lines.append(f"top {min(top, len(d.candidates))} of {len(d.candidates)} ranked candidates:")
        widths = [max(len(h), *(len(r[i]) for r in _candidate_rows(d, top))) for i, h in enumerate(_CAND_HEAD)]
        lines.append("  " + "  ".join(h.ljust(w) for h, w in zip(_CAND_HEAD, widths, strict=True)))
        for row in _candidate_rows(d, top):
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    lines += _checked_text(d)
    lines += _rejected_lines(d, max_rejected)
    return "\n".join(lines)


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|")


def _markdown(d: Any, top: int, max_rejected: int) -> str:
    out = ["## Parallel plan", ""]
    out += [f"- {_md_escape(x)}" for x in _header(d)]
    out += ["", "### Memory at the peak (worst rank)", "", "| component | GiB |", "| --- | ---: |"]
    out += [f"| {k} | {v} |" for k, v in _breakdown_rows(d)]
    out.append(f"| **total** | **{_gib(d.estimate.total)}** |")
    if d.reserved.overhead:
        out.append(f"| reserved (CUDA caching allocator; must fit the budget) | {_gib(d.reserved.reserved)} |")
    sugg = _suggestion_lines(d)
    if sugg:
        out += ["", "### Changes that would make it fit", ""] + [f"- {_md_escape(s.strip()[2:])}" for s in sugg[1:]]
    if d.candidates:
        out += ["", "### Ranked candidates", "", "| " + " | ".join(_CAND_HEAD) + " |",
                "| " + " | ".join("---" for _ in _CAND_HEAD) + " |"]
        out += ["| " + " | ".join(_md_escape(c) for c in row) + " |" for row in _candidate_rows(d, top)]
    checked = _checked_rows(d)
    if checked:
        out += ["", f"### {_CHECK_TITLE[0].upper()}{_CHECK_TITLE[1:]}", "",
                "| " + " | ".join(_md_escape(h) for h in _CHECK_HEAD) + " |",
                "| " + " | ".join("---" for _ in _CHECK_HEAD) + " |"]
        out += ["| " + " | ".join(_md_escape(c) for c in row) + " |" for row in checked]
    out += ["", "### Rejected", ""] + [f"- {_md_escape(x.strip())}" for x in _rejected_lines(d, max_rejected)]
    return "\n".join(out) + "\n"


def rich_renderable(d: Any, *, top: int = 5, max_rejected: int = 12) -> Any:
    """A rich ``Group`` (header, breakdown table, candidates table, rejections) for ``console.print``."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = [Text("\n".join(_header(d)))]
    mem = Table(title="memory at the peak (worst rank)")
    mem.add_column("component")
    mem.add_column("GiB", justify="right")
    for k, v in _breakdown_rows(d):
        mem.add_row(k, v)
    mem.add_row("total", _gib(d.estimate.total), style="bold")
    if d.reserved.overhead:
        mem.add_row("reserved", _gib(d.reserved.reserved))
    parts.append(mem)
    sugg = _suggestion_lines(d)
    if sugg:
        parts.append(Text("\n".join(sugg), style="yellow"))
    if d.candidates:
        tab = Table(title=f"top {min(top, len(d.candidates))} of {len(d.candidates)} ranked candidates")
        for h in _CAND_HEAD:
            tab.add_column(h, justify="right" if h in _NUMERIC else "left")
        for row in _candidate_rows(d, top):
            tab.add_row(*row)
        parts.append(tab)
    checked = _checked_rows(d)
    if checked:
        tab = Table(title=_CHECK_TITLE)
        for h in _CHECK_HEAD:
            tab.add_column(h, justify="right" if h in _CHECK_NUMERIC else "left")
        for row in checked:
            tab.add_row(*row)
        parts.append(tab)
    parts.append(Text("\n".join(_rejected_lines(d, max_rejected))))
    return Group(*parts)


def render(d: Any, *, format: str = "text", top: int = 5, max_rejected: int = 12) -> str:
    """``d`` as ``"text"``, ``"markdown"`` or ``"rich"`` (rich tables rendered to plain text, 160 columns)."""
    if format == "text":
        return _text(d, top, max_rejected)
    if format == "markdown":
        return _markdown(d, top, max_rejected)
    if format == "rich":
        from rich.console import Console

        buf = io.StringIO()
        Console(file=buf, width=160, force_terminal=False, color_system=None).print(rich_renderable(d, top=top, max_rejected=max_rejected))
        return buf.getvalue()
    raise ValueError(f"format={format!r} must be one of {', '.join(map(repr, FORMATS))}")
