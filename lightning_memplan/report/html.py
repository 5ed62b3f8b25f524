"""The memory report as one self-contained HTML file (``memory_report.html``): the step timeline, the
run across epochs, the ranks side by side, the plan map and the tables, drawn as inline SVG from the
saved JSON (:mod:`~lightning_memplan.report.views`).

Self-contained: no stylesheet, script, font or image is loaded from anywhere (no CDN); the charts are
SVG written here, hover values are SVG ``<title>`` elements (no script needed), and a few lines of
inline JavaScript only switch which epoch or rank a chart shows. Without JavaScript every view is shown
one after the other, and the tables are plain HTML tables.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_memplan.model.result import COMPONENTS
from lightning_memplan.report.checkpoints import CHECKPOINT_HEADERS, checkpoint_rows
from lightning_memplan.report.escape import html_text as escape
from lightning_memplan.report.records import EpochReport, MemoryReport, representative_ranks
from lightning_memplan.report.render import (
    _PHASE_HEADERS,
    _RANK_HEADERS,
    CHECKPOINTS_CAPTION,
    PHASES_CAPTION,
    UNITS,
    _component_rows,
    _rank_row,
    component_ranks,
    format_bytes,
    late_release_lines,
    phase_rows,
    shown_note,
    table_ranks,
)
from lightning_memplan.report.svg import Chart
from lightning_memplan.report.views import (
    CHART_RANKS,
    COMPONENT_COLORS,
    PlanView,
    RunView,
    TimelineView,
    chart_ranks,
    labelled_families,
    plan_view,
    rank_view,
    run_view,
    timeline_record,
    timeline_view,
)

__all__ = ["auto_unit", "render_html", "render_plan_html"]

_WIDTH = 920
#: Colours of the non-component lines and marks.
_EST, _MEAS, _RES, _CAP, _WARN, _OOM, _GREY = "#1f4e9c", "#e8590c", "#868e96", "#c92a2a", "#f59f00", "#c92a2a", "#adb5bd"
#: A capacity line further than this factor above the data would squash the chart; it is named instead.
_CAPACITY_SCALE_LIMIT = 3.0
#: Log y axis when the largest value exceeds the smallest non-zero one by more than this factor.
_LOG_RATIO = 20.0
#: The same for the run chart, where reserved bytes (RSS on CPU) sit far above the tensor peaks.
_RUN_LOG_RATIO = 4.0

_NUMERIC = re.compile(r"^[-+]?[\d.,]+(e[-+]?\d+)?%?( [KMG]?i?B)?$|^-$")

_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:960px;color:#222;line-height:1.4}
h1{font-size:1.6em;margin-bottom:.2em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.6em 0;font-size:.85em}th,td{border:1px solid #ccc;padding:2px 6px;text-align:left}
th{background:#f3f3f3}td.num{text-align:right;white-space:nowrap}caption{text-align:left;font-weight:bold}
.note{color:#555;font-size:.9em}.warn{color:#9c5700}.oom{color:#c92a2a;font-weight:bold}
nav a{margin-right:1em}svg.chart{display:block;margin:.4em 0;background:#fff}
.view h3{font-size:1em;margin:.8em 0 .2em}select{font-size:1em}pre{background:#f6f6f6;padding:.5em;overflow:auto;font-size:.8em}
"""

_JS = """
document.querySelectorAll('select[data-group]').forEach(function(sel){
  function show(){document.querySelectorAll('.view[data-group="'+sel.dataset.group+'"]').forEach(function(v){
    v.style.display = v.dataset.key === sel.value ? '' : 'none';});}
  sel.addEventListener('change', show); show();
});
"""


def auto_unit(largest: float) -> str:
    """The binary unit (B, KiB, MiB, GiB) in which ``largest`` bytes reads between 1 and 1024."""
    for unit in ("GiB", "MiB", "KiB"):
        if largest >= UNITS[unit]:
            return unit
    return "B"


def _fmt(v: int | None, unit: str) -> str:
    if v is None:
        return "-"
    return f"{v / UNITS[unit]:.3g} {unit}"


def _page(title: str, body: list[str]) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>\n"
        + "\n".join(body)
        + f"\n<script>{_JS}</script>\n</body></html>\n"
    )


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, caption: str = "") -> str:
    cap = f"<caption>{escape(caption)}</caption>" if caption else ""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f'<td{" class=num" if _NUMERIC.match(c) else ""}>{escape(c)}</td>' for c in row) + "</tr>"
        for row in rows
    )
    return f"<table>{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _switcher(group: str, label: str, options: Sequence[tuple[str, str]]) -> str:
    if len(options) < 2:
        return ""
    opts = "".join(f'<option value="{escape(k)}">{escape(text)}</option>' for k, text in options)
    return f'<p><label>{escape(label)} <select data-group="{group}">{opts}</select></label></p>'


def _view(group: str, key: str, inner: str) -> str:
    return f'<div class="view" data-group="{group}" data-key="{escape(key)}">{inner}</div>'


# ------------------------------------------------------------------------------------ step timeline
def _timeline_svg(view: TimelineView) -> str:
    rec = view.record
    n = len(view.ops)
    totals = [sum(view.stacks[c][i] for c in view.stacks) for i in range(n)]
    est_totals = [sum(b[3].values()) for b in view.estimate]
    top = max([*totals, *est_totals, view.estimated_peak or 0, 1])
    cap = view.capacity
    show_cap = cap is not None and cap <= top * _CAPACITY_SCALE_LIMIT
    y_max = max(top, cap if show_cap and cap else 0) * 1.08
    unit = auto_unit(y_max)
    scale = UNITS[unit]
    x0, x1 = min(view.ops), max(max(view.ops), max((b[2] for b in view.estimate), default=0))
    yfmt = lambda v: f"{v / scale:.3g}"  # noqa: E731
    charts = []
    for kind in ("measured", "estimated"):
        title = (
            f"Measured live bytes over step {rec.step} (rank {rec.rank}, epoch {rec.epoch}, tensor tracker)"
            if kind == "measured"
            else "Estimated: each phase at its predicted peak"
        )
        ch = Chart(_WIDTH, 300, (x0, x1), (0, y_max), title=title, margins=(72, 16, 44, 44))
        for phase, a, b in view.spans:
            shade = {"forward": "#f1f8ff", "backward": "#fff6ee", "optimizer": "#f3fbf1"}.get(phase, "#fafafa")
            ch.rect(a, 0, max(b, a + 1), y_max, fill=shade, opacity=1.0, title=f"{phase}: operator calls {a}-{b}")
        comps_drawn = []
        if kind == "measured":
            lower = [0] * n
            for comp in COMPONENTS:
                if comp not in view.stacks:
                    continue
                vals = view.stacks[comp]
                upper = [lo + v for lo, v in zip(lower, vals, strict=True)]
                pts = [(view.ops[i], upper[i]) for i in range(n)] + [(view.ops[i], lower[i]) for i in reversed(range(n))]
                i_max = max(range(n), key=vals.__getitem__)
                ch.polygon(pts, fill=COMPONENT_COLORS[comp],
                           title=f"{comp}: up to {_fmt(vals[i_max], unit)} (operator call {view.ops[i_max]})")
                lower = upper
                comps_drawn.append(comp)
            step = max(1, n // 120)  # hover strips: the values at a sample, at most ~120 of them
            for i in range(0, n, step):
                a = view.ops[i]
                b = view.ops[i + step] if i + step < n else x1
                detail = ", ".join(f"{c} {_fmt(view.stacks[c][i], unit)}" for c in view.stacks if view.stacks[c][i])
                ch.rect(a, 0, b, y_max, fill="#000", opacity=0.0,
                        title=f"call {a} ({rec.timeline.phases[i] if rec.timeline else ''}): {_fmt(totals[i], unit)} live; {detail}")
            if view.peak is not None:
                ch.marker(view.peak[0], view.peak[1], fill=_MEAS, r=5,
                          title=f"measured peak {_fmt(view.peak[1], unit)} at operator call {view.peak[0]}")
                ch.text(ch.x(view.peak[0]) + 7, ch.y(view.peak[1]) - 6, f"peak {_fmt(view.peak[1], unit)}", size=11, weight="bold")
        else:
            for phase, a, b, comps in view.estimate:
                lo = 0
                for comp in COMPONENTS:
                    v = comps.get(comp, 0)
                    if not v:
                        continue
                    ch.rect(a, lo, b, lo + v, fill=COMPONENT_COLORS[comp], title=f"{phase}, {comp}: {_fmt(v, unit)}")
                    lo += v
                    if comp not in comps_drawn:
                        comps_drawn.append(comp)
                ch.text(ch.x((a + b) / 2), ch.y(lo) + 12, _fmt(lo, unit), anchor="middle", size=10, color="#fff", weight="bold")
            if not view.estimate:
                ch.text(_WIDTH / 2, 150, "no per-phase estimate for this step (no model spec, or a version 1 report)",
                        anchor="middle", color="#888")
        for phase, a, b in view.spans:  # on top of the stacks, in the bottom band
            ch.text(ch.x((a + b) / 2), ch.height - ch.bottom - 5, phase, anchor="middle", size=10, color="#fff", weight="bold")
        if view.estimated_peak:
            ch.hline(view.estimated_peak, stroke=_EST, label=f"estimated peak {_fmt(view.estimated_peak, unit)}",
                     label_at="start" if kind == "estimated" else "end")
        if show_cap and cap:
            ch.hline(cap, stroke=_CAP, label=f"capacity / budget {_fmt(cap, unit)}", dash="2 2")
        ch.legend([(c, COMPONENT_COLORS[c]) for c in COMPONENTS if c in comps_drawn], y=ch.top - 16)
        ch.axes(x_label="operator calls in the step", y_label=f"live bytes ({unit})", y_format=yfmt, y_scale=scale,
                x_format=lambda v: f"{v:.0f}")
        charts.append(ch.svg())
    note = ""
    if cap and not show_cap:
        note = f'<p class="note">Capacity / budget {_fmt(cap, auto_unit(cap))} is off the scale (more than {_CAPACITY_SCALE_LIMIT:g} x the peak).</p>'
    return "".join(charts) + note


def _epoch_key(epoch: EpochReport) -> str:
    """A view key per epoch: ``"3"``, or ``"1.3"`` for run 1's epoch 3 (a second fit of the callback)."""
    return f"{epoch.run}.{epoch.epoch}" if epoch.run else str(epoch.epoch)


def _timeline_section(report: MemoryReport) -> str:
    views = []
    for epoch in reversed(report.epochs):  # the latest epoch first (the default view)
        for r in representative_ranks(epoch.ranks, CHART_RANKS):
            rec = timeline_record(r)
            view = timeline_view(rec) if rec is not None else None
            if view is not None:
                views.append((f"e{_epoch_key(epoch)}r{r.rank}", f"{epoch.label}, rank {r.rank} (step {rec.step})", view))  # type: ignore[union-attr]
    for inc in report.incidents:
        if inc.step_record is not None:
            view = timeline_view(inc.step_record)
            if view is not None:
                views.append((f"inc{inc.rank}s{inc.step}", f"incident on rank {inc.rank}, step {inc.step}", view))
    out = ['<section id="timeline"><h2>Step timeline</h2>',
           '<p class="note">Live tensor bytes by component over one tracked training step (forward, loss, backward, '
           "optimizer step), measured by the tensor tracker at operator calls (bounded samples, peaks kept), above the "
           "estimate's per-phase peaks over the same phases. Hover for values.</p>"]
    if not views:
        out.append('<p class="note">No tracked step with a timeline in this report (the tensor tracker runs on CPU/MPS '
                   "by default, or with MemoryPlanCallback(track_tensors=True)).</p></section>")
        return "\n".join(out)
    out.append(_switcher("tl", "Step:", [(k, t) for k, t, _ in views]))
    out += [_view("tl", k, f"<h3>{escape(t)}</h3>" + _timeline_svg(v)) for k, t, v in views]
    out.append("</section>")
    return "\n".join(out)


# ------------------------------------------------------------------------------------ across the run
def _run_svg(view: RunView) -> str:
    values = [v for series in (view.estimated, view.measured, view.reserved) for v in series if v]
    if not view.steps or not values:
        return '<p class="note">No per-step figures for this rank.</p>'
    hi, lo = max(values), min(values)
    log_y = hi / max(lo, 1) > _RUN_LOG_RATIO
    unit = auto_unit(hi)
    scale = UNITS[unit]
    x0, x1 = min(view.steps), max(view.steps)
    y_range = (lo / 1.5, hi * 1.5) if log_y else (0, hi * 1.12)
    ch = Chart(_WIDTH, 330, (x0, x1 if x1 > x0 else x0 + 1), y_range, log_y=log_y,
               title=f"Rank {view.rank} across the run: per-step peaks", margins=(72, 16, 44, 44))
    for step, epoch in view.epoch_starts:
        ch.vline(step, stroke="#999", label=f"epoch {epoch}")
    for name, series, color, dash in (
        ("estimated peak", view.estimated, _EST, "6 3"),
        ("measured peak", view.measured, _MEAS, None),
        ("reserved", view.reserved, _RES, "2 2"),
    ):
        pts = [(s, v) for s, v in zip(view.steps, series, strict=True) if v]
        if not pts:
            continue
        ch.polyline(pts, stroke=color, dash=dash, title=name)
        if len(pts) <= 300:
            for s, v in pts:
                ch.marker(s, v, fill=color, r=2.5, stroke=color, title=f"step {s}: {name} {_fmt(v, unit)}")
    for step, seq in view.seq_changes:
        ch.marker(step, 0, fill="#5c940d", shape="diamond", r=5, px=(ch.x(step), ch.height - ch.bottom - 6),
                  title=f"sequence length changes to {seq} at step {step}")
        ch.text(ch.x(step) + 6, ch.height - ch.bottom - 10, f"s={seq}", size=10, color="#5c940d")
    for i, (step, text) in enumerate(view.warnings):
        ch.vline(step, stroke=_WARN, dash="1 3", title=f"warning at step {step}: {text}")
        ch.marker(step, 0, fill=_WARN, shape="diamond", r=6, px=(ch.x(step), ch.top + 24 + 12 * (i % 3)),
                  title=f"warning at step {step}: {text}")
    for step, text in view.incidents:
        ch.marker(step, 0, fill=_OOM, shape="cross", r=6, px=(ch.x(step), ch.top + 40), title=f"step {step}: {text}")
        ch.text(ch.x(step) - 6, ch.top + 58, "OOM" if text.startswith("oom") else "error", anchor="end", size=11,
                color=_OOM, weight="bold")
    ch.legend([("estimated peak", _EST), ("measured peak", _MEAS), ("reserved (allocator / RSS)", _RES),
               ("seq-len change", "#5c940d"), ("warning", _WARN), ("incident", _OOM)], y=ch.top - 16)
    ch.axes(x_label="training step", y_label=f"bytes ({unit}{', log scale' if log_y else ''})",
            y_format=lambda v: f"{v / scale:.3g}", y_scale=scale, x_format=lambda v: f"{v:.0f}")
    return ch.svg()


def _run_section(report: MemoryReport) -> str:
    ranks = chart_ranks(report)
    out = ['<section id="run"><h2>Across the run</h2>',
           '<p class="note">Per-step estimated and measured peak and reserved bytes over every epoch (at most a few hundred '
           "points per epoch; each keeps the largest value of the steps it stands for). Sequence-length changes, "
           "the epochs' warnings and incidents are marked; hover for the text.</p>"]
    out.append(_switcher("run", "Rank:", [(str(r), f"rank {r}") for r in ranks]))
    out += [_view("run", str(r), _run_svg(run_view(report, r))) for r in ranks]
    out.append("</section>")
    return "\n".join(out)


# ------------------------------------------------------------------------------------ across ranks
def _ranks_svg(epoch: EpochReport, run: Mapping[str, Any]) -> str:
    bars, spread = rank_view(epoch, run)
    totals = [sum(b.estimated.values()) for b in bars] + [sum(b.measured.values()) or (b.measured_total or 0) for b in bars]
    hi = max([*totals, 1])
    unit = auto_unit(hi)
    scale = UNITS[unit]
    n = len(bars)
    ch = Chart(max(640, min(_WIDTH, 140 + 110 * n)), 340, (-0.6, n - 0.4), (0, hi * 1.15),
               title=f"{epoch.label.capitalize()}: every rank at its peak (estimated | measured)", margins=(72, 16, 44, 52))
    for i, bar in enumerate(bars):
        for offset, comps, kind in ((-0.2, bar.estimated, "est."), (0.2, bar.measured, "meas.")):
            lo = 0
            for comp in COMPONENTS:
                v = comps.get(comp, 0)
                if v:
                    ch.rect(i + offset - 0.18, lo, i + offset + 0.18, lo + v, fill=COMPONENT_COLORS[comp],
                            title=f"rank {bar.rank} {kind} {comp}: {_fmt(v, unit)}")
                    lo += v
            if kind == "meas." and not comps and bar.measured_total:
                ch.rect(i + offset - 0.18, 0, i + offset + 0.18, bar.measured_total, fill=_GREY,
                        title=f"rank {bar.rank} measured peak (no breakdown): {_fmt(bar.measured_total, unit)}")
                lo = bar.measured_total
            if lo:
                ch.text(ch.x(i + offset), ch.y(lo) - 3, f"{lo / scale:.3g}", anchor="middle", size=9)
            ch.text(ch.x(i + offset), ch.height - ch.bottom + 12, kind, anchor="middle", size=9, color="#555")
        label = f"rank {bar.rank}" + (f" · stage {bar.stage}" if bar.stage is not None else "")
        ch.text(ch.x(i), ch.height - ch.bottom + 26, label, anchor="middle", size=11, weight="bold")
    if spread is not None and n > 1:
        mean = spread.max / (1 + spread.imbalance) if spread.imbalance > -1 else spread.max
        ch.hline(mean, stroke="#495057", label="mean", label_at="start")
        ch.text(ch.width - ch.right, ch.height - 6, f"mean peak {_fmt(int(mean), unit)}, max {_fmt(spread.max, unit)}: "
                f"imbalance (max / mean - 1) {spread.imbalance:.1%}", anchor="end", size=11, weight="bold", color="#495057")
    ch.legend([(c, COMPONENT_COLORS[c]) for c in COMPONENTS
               if any(b.estimated.get(c) or b.measured.get(c) for b in bars)] + [("measured, no breakdown", _GREY)],
              y=ch.top - 16)
    ch.axes(x_label="" if spread is not None and n > 1 else "ranks", y_label=f"bytes at the peak ({unit})", y_format=lambda v: f"{v / scale:.3g}", y_scale=scale, x_ticks=[])
    return ch.svg()


def _ranks_section(report: MemoryReport) -> str:
    out = ['<section id="ranks"><h2>Across ranks</h2>',
           '<p class="note">Each rank\'s components at its peak, the estimate next to the tensor tracker\'s measurement '
           "(a grey bar: the allocator's peak without a breakdown); pipeline stages are labelled, the line is the "
           "mean measured peak and the imbalance is max / mean - 1.</p>"]
    out.append(_switcher("ranks", "Epoch:", [(_epoch_key(e), e.label) for e in reversed(report.epochs)]))
    out += [_view("ranks", _epoch_key(e), _ranks_svg(e, report.run)) for e in reversed(report.epochs)]
    out.append("</section>")
    return "\n".join(out)


# ------------------------------------------------------------------------------------ plan map
#: What the plan map says instead of step times where the hardware has no time model (a CPU host).
_UNTIMED_NOTE = ("Step time is not modelled on this hardware (a CPU host has no accelerator speed figures), so the map "
                 "plots predicted peak memory only (no step time, throughput or utilisation figure), and the planner ranked "
                 "the layouts that fit by fewest changes.")


def _plan_memory_svg(view: PlanView) -> str:
    """The plan map without a time axis (:attr:`PlanView.timed` false): every layout's predicted peak, in order
    of peak, against the budget."""
    order = sorted(range(len(view.points)), key=lambda i: view.points[i].peak)
    peaks = [p.peak for p in view.points] + ([view.budget] if view.budget else [])
    hi, lo = max(peaks), min(peaks)
    log_y = hi / max(lo, 1) > _LOG_RATIO
    unit = auto_unit(hi)
    scale = UNITS[unit]
    n = len(order)
    ch = Chart(_WIDTH, 430, (-0.5, n - 0.5), (lo / 1.5, hi * 1.5) if log_y else (0, hi * 1.15), log_y=log_y,
               title=view.title + " (memory only)", margins=(72, 16, 44, 44))
    if view.budget:
        ch.hline(view.budget, stroke=_CAP, label=f"budget {_fmt(view.budget, unit)}", label_at="start")
    colors = {"chosen": "#2f9e44", "fits": _EST, "rejected": _GREY}
    for x, i in enumerate(order):
        p = view.points[i]
        hover = f"{p.status}: {p.label}: peak {_fmt(p.peak, unit)}; {p.reason}"
        ch.marker(x, p.peak, fill=colors[p.status], r=9 if p.status == "chosen" else 5,
                  shape="diamond" if p.status == "chosen" else "circle", title=hover)
        if p.status == "chosen":
            ch.text(ch.x(x), ch.y(p.peak) - 14, "chosen: " + p.label.split(" | ")[0], size=11, weight="bold",
                    color="#2b8a3e", anchor="middle")
    ch.legend([("chosen", "#2f9e44"), ("fits", _EST), ("rejected (hover: reason)", _GREY), ("budget", _CAP)], y=ch.top - 16)
    ch.axes(x_label="layouts in order of predicted peak (step time not modelled here)",
            y_label=f"predicted peak per device ({unit}{', log' if log_y else ''})",
            y_format=lambda v: f"{v / scale:.3g}", y_scale=scale, x_ticks=[], x_format=lambda v: "")
    return ch.svg()


def _plan_svg(view: PlanView) -> str:
    if view.points and not view.timed:
        return _plan_memory_svg(view)
    timed = [p for p in view.points if p.step_s is not None]
    peaks = [p.peak for p in view.points] + ([view.budget] if view.budget else [])
    if not peaks:
        return '<p class="note">The decision holds no evaluated layout.</p>'
    hi, lo = max(peaks), min(peaks)
    log_y = hi / max(lo, 1) > _LOG_RATIO
    unit = auto_unit(hi)
    scale = UNITS[unit]
    t_max = max([p.step_s or 0.0 for p in timed] + [1e-9])
    t_min = min([p.step_s or 0.0 for p in timed] + [t_max])
    pad = max(t_max - t_min, t_max * 0.05)
    x_lo = max(0.0, t_min - 0.15 * pad)
    has_untimed = any(p.step_s is None for p in view.points)
    x_hi = t_max + pad * (0.6 if has_untimed else 0.15)
    untimed_x = t_max + pad * 0.4
    ch = Chart(_WIDTH, 430, (x_lo, x_hi), (lo / 1.5, hi * 1.5) if log_y else (0, hi * 1.15), log_y=log_y,
               title=view.title, margins=(72, 16, 44, 44))
    if has_untimed:
        ch.rect(t_max + pad * 0.2, ch.y_range[0], x_hi, ch.y_range[1], fill="#f5f5f5", opacity=1.0,
                title="rejected for memory before any step time was predicted")
        ch.text(ch.x(untimed_x), ch.top + 12, "not timed (over budget)", anchor="middle", size=10, color="#666")
    if view.budget:
        ch.hline(view.budget, stroke=_CAP, label=f"budget {_fmt(view.budget, unit)}", label_at="start")
    labels = labelled_families(view.points)
    order = sorted(range(len(view.points)), key=lambda i: {"rejected": 0, "fits": 1, "chosen": 2}[view.points[i].status])
    for k, i in enumerate(order):
        p = view.points[i]
        hover = f"{p.label}: peak {_fmt(p.peak, unit)}" + (f", step {p.step_s:.3g} s" if p.step_s is not None else "")
        hover += f"; {p.reason}"
        if p.status == "rejected":
            jitter = ((k * 37) % 11 - 5) / 5 * (pad * 0.12)
            ch.marker(untimed_x + jitter, p.peak, fill=_GREY, r=4, stroke="#868e96", title="rejected: " + hover)
        elif p.status == "chosen":
            ch.marker(p.step_s or 0.0, p.peak, fill="#2f9e44", r=9, shape="diamond", title="chosen: " + hover)
            ch.text(ch.x(p.step_s or 0.0), ch.y(p.peak) - 30, "chosen: " + p.label.split(" | ")[0], size=11,
                    weight="bold", color="#2b8a3e", anchor="start")
            ch.text(ch.x(p.step_s or 0.0), ch.y(p.peak) - 17, p.label.split(" | ")[-1] + (f" ({p.family})" if p.family else ""),
                    size=10, color="#2b8a3e", anchor="start")
        else:
            ch.marker(p.step_s or 0.0, p.peak, fill=_EST, r=5, title="fits: " + hover)
        if i in labels and p.status != "chosen":
            n_label = sorted(labels).index(i)
            dy = -10 - 13 * (n_label % 3) if n_label % 2 == 0 else 16 + 13 * (n_label % 3)
            px, py = ch.x(p.step_s or 0.0), ch.y(p.peak)
            ch.parts.append(f'<line x1="{px:.1f}" y1="{py:.1f}" x2="{px + 6:.1f}" y2="{py + dy + (4 if dy < 0 else -10):.1f}" stroke="#1f4e9c" stroke-width="0.8"/>')
            ch.text(px + 7, py + dy, labels[i], size=10, color="#1f4e9c", weight="bold")
    ch.legend([("chosen", "#2f9e44"), ("fits", _EST), ("rejected (hover: reason)", _GREY), ("budget", _CAP)], y=ch.top - 16)
    ch.axes(x_label="predicted step time (s)", y_label=f"predicted peak per device ({unit}{', log' if log_y else ''})",
            y_format=lambda v: f"{v / scale:.3g}", y_scale=scale, x_format=lambda v: f"{v:.3g}")
    return ch.svg()


def _plan_section(decision: Mapping[str, Any]) -> str:
    view = plan_view(decision)
    unit = auto_unit(max([p.peak for p in view.points] + [1]))
    if view.timed:
        intro = ('<p class="note">Every layout the planner evaluated: predicted peak memory per device against predicted '
                 "step time. Fitting candidates in blue, the chosen one in green, layouts rejected for memory in grey "
                 "(hover for the reason); the fastest plan of each well-known layout (FSDP only, FSDP x TP, TP x PP x "
                 "DP, ...) is labelled.</p>")
    else:
        intro = (f'<p class="note">{escape(_UNTIMED_NOTE)} Fitting candidates in blue, the chosen one in green, layouts '
                 "rejected for memory in grey (hover for the reason).</p>")
    out = ['<section id="plan"><h2>Plan map</h2>', intro, _plan_svg(view)]
    if view.timed:
        rows = [[p.status, p.label, p.family, _fmt(p.peak, unit), f"{p.step_s:.4g}" if p.step_s is not None else "-",
                 p.reason] for p in view.points]
        headers = ["status", "layout", "family", "peak", "step (s)", "detail"]
    else:
        rows = [[p.status, p.label, p.family, _fmt(p.peak, unit), p.reason] for p in view.points]
        headers = ["status", "layout", "family", "peak", "detail"]
    out.append(_table(headers, rows, caption="Evaluated layouts"))
    if view.unplotted:
        out.append(_table(["layout", "kind", "reason"], [list(u) for u in view.unplotted],
                          caption="Rejected before any memory estimate"))
    out.append("</section>")
    return "\n".join(out)


# ------------------------------------------------------------------------------------ pages
def _tables_section(report: MemoryReport, units: str) -> str:
    out = ['<section id="tables"><h2>Tables</h2>', f'<p class="note">Sizes in {escape(units)}.</p>']
    for epoch in report.epochs:
        out.append(f"<h3>{escape(epoch.label.capitalize())}</h3>")
        out.append(_table(_RANK_HEADERS, [_rank_row(r, units) for r in table_ranks(epoch)], caption="Ranks"))
        if shown_note(epoch):
            out.append(f'<p class="note">{escape(shown_note(epoch))}.</p>')
        headers = ["component"]
        for r in component_ranks(epoch):
            headers += [f"rank {r.rank} est.", f"rank {r.rank} meas."]
        out.append(_table(headers, _component_rows(epoch, units), caption="Components at the peak"))
        out += [f'<p class="note">{escape(line)}</p>' for line in late_release_lines(epoch)]
        if epoch.phases:
            out.append(_table(_PHASE_HEADERS, phase_rows(epoch, units), caption=PHASES_CAPTION))
        if epoch.checkpoints:
            rows = checkpoint_rows(epoch.checkpoints, lambda v: format_bytes(v, units, suffix=False))
            out.append(_table(CHECKPOINT_HEADERS, rows, caption=CHECKPOINTS_CAPTION))
        for w in epoch.warnings:
            out.append(f'<p class="warn">warning: {escape(w)}</p>')
    out.append("</section>")
    return "\n".join(out)


def _incidents_section(report: MemoryReport, units: str) -> str:
    if not report.incidents:
        return ""
    out = ['<section id="incidents"><h2>Incidents</h2>']
    for inc in report.incidents:
        out.append(f'<p class="oom">Rank {inc.rank}, epoch {inc.epoch}, step {inc.step}: {escape(inc.kind)}</p>')
        out.append(f"<pre>{escape(inc.error)}</pre>")
        rec = inc.step_record
        rows = []
        if rec is not None:
            rows += [["batch", f"{rec.micro_batch} x {rec.seq_len}"], ["estimated peak", format_bytes(rec.estimated_peak, units)],
                     ["measured so far", format_bytes(rec.measured_peak, units)]]
        rows += [[str(k), str(v)] for k, v in inc.allocator.items() if k != "summary"]
        out.append(_table(["what", "value"], rows))
        if "summary" in inc.allocator:
            out.append(f"<pre>{escape(str(inc.allocator['summary']))}</pre>")
    out.append("</section>")
    return "\n".join(out)


def _peak_facts(report: MemoryReport, units: str) -> list[str]:
    """The header's figures: the run's peak, estimated and measured (the worst rank over every epoch, training
    and evaluation steps), and the smallest headroom to the capacity / budget; escaped ``<li>`` items."""
    rows = [(e, phase, r) for e in report.epochs for phase, rs in (("training", e.ranks), *e.phases.items()) for r in rs]

    def where(e: EpochReport, phase: str, rank: int) -> str:
        return f"rank {rank}, {e.label}" + ("" if phase == "training" else f", {phase} step")

    def worst(name: str) -> str:
        present = [(getattr(r, name), e, phase, r.rank) for e, phase, r in rows if getattr(r, name) is not None]
        if not present:
            return "-"
        value, e, phase, rank = max(present, key=lambda t: t[0])
        return f"{format_bytes(value, units)} ({where(e, phase, rank)})"

    out = [f"<li><b>peak (worst rank):</b> estimated {escape(worst('estimated_peak'))}; "
           f"measured {escape(worst('measured_peak'))}</li>"]
    room = [(r.headroom, r.device_memory, e, phase, r.rank) for e, phase, r in rows if r.headroom is not None]
    if room:
        headroom, capacity, e, phase, rank = min(room, key=lambda t: t[0])
        of = f" of {format_bytes(capacity, units)} capacity / budget" if capacity else ""
        out.append(f"<li><b>headroom (smallest):</b> {escape(format_bytes(headroom, units) + of)} "
                   f"({escape(where(e, phase, rank))})</li>")
    else:
        out.append("<li><b>headroom (smallest):</b> - (no capacity known)</li>")
    return out


def render_html(report: MemoryReport, *, units: str = "GiB", decision: Mapping[str, Any] | None = None) -> str:
    """The whole report as one self-contained HTML page (``decision``: a ``PlanDecision.to_dict()``, e.g.
    the ``"decision"`` of memplan_auto's ``memplan_plan.json``, adds the plan map)."""
    run = report.run
    body = ["<h1>Memory report</h1>"]
    facts = [f"<li><b>{escape(k)}:</b> {escape(str(run[k]))}</li>"
             for k in ("model", "plan_description", "precision", "accelerator", "world_size", "estimate_source") if k in run]
    facts += _peak_facts(report, units)
    facts += [f'<li class="note">note: {escape(n)}</li>' for n in report.notes]
    facts.append(f"<li><b>epochs:</b> {len(report.epochs)}; <b>incidents:</b> {len(report.incidents)}</li>")
    body.append("<ul>" + "".join(facts) + "</ul>")
    links = [("timeline", "Step timeline"), ("run", "Across the run"), ("ranks", "Across ranks")]
    if decision:
        links.append(("plan", "Plan map"))
    links.append(("tables", "Tables"))
    if report.incidents:
        links.append(("incidents", "Incidents"))
    body.append("<nav>" + "".join(f'<a href="#{a}">{escape(t)}</a>' for a, t in links) + "</nav>")
    body += [_timeline_section(report), _run_section(report)]
    if report.epochs:
        body.append(_ranks_section(report))
    if decision:
        body.append(_plan_section(decision))
    body += [_tables_section(report, units), _incidents_section(report, units)]
    return _page("Memory report", body)


def render_plan_html(decision: Mapping[str, Any]) -> str:
    """The plan map of ``lightning-memplan plan`` (a ``PlanDecision.to_dict()``) as one HTML page."""
    body = ["<h1>Parallel plan</h1>"]
    chosen = plan_view(decision)
    fits = "fits" if decision.get("fits") else "does not fit"
    body.append(f"<p>{escape(chosen.title)}; the chosen plan {fits} its budget.</p>")
    notes = [f'<li class="note">{escape(str(n))}</li>' for n in decision.get("notes", ())]
    if notes:
        body.append("<ul>" + "".join(notes) + "</ul>")
    body.append(_plan_section(decision))
    return _page("Parallel plan", body)
