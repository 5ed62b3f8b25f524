"""The visual report: bounded timelines and series, format version 2 (reads version 1), the HTML page
(self-contained, every section, drawn from the JSON) and the PNG, for 1 and several ranks, several
epochs, a pipeline run and an out-of-memory incident; ``report --html`` and ``plan --html``."""

import dataclasses
import json
import random
from html.parser import HTMLParser

import pytest
import torch
from torch import nn

from lightning_memplan.cli import main
from lightning_memplan.model.result import COMPONENTS
from lightning_memplan.report.html import render_html, render_plan_html
from lightning_memplan.report.io import load_report, write_report
from lightning_memplan.report.plot import render_png
from lightning_memplan.report.records import REPORT_FORMAT_VERSION, MemoryReport, RankAccumulator
from lightning_memplan.report.views import plan_view
from lightning_memplan.testing.reports import synthetic_report, synthetic_step
from lightning_memplan.tracking import TensorTracker
from lightning_memplan.tracking.timeline import SeriesBuilder, TimelineBuilder

SHAPES = {
    "one_rank_one_epoch": dict(ranks=1, epochs=1, seq_change=False, warnings=False),
    "two_ranks_three_epochs": dict(ranks=2, epochs=3),
    "pipeline_4_ranks_pp2": dict(ranks=4, epochs=2, pp=2),
    "oom_incident": dict(ranks=2, epochs=2, oom=True),
}


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.ids, self.titles, self.options, self.views = [], set(), [], [], []
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "option":
            self.options.append(a["value"])
        if tag == "div" and a.get("class") == "view":
            self.views.append((a["data-group"], a["data-key"]))
        self._in_title = tag == "title"

    def handle_data(self, data):
        if self._in_title:
            self.titles.append(data)

    def handle_endtag(self, tag):
        self._in_title = False


def _parse(text):
    page = _Page()
    page.feed(text)
    return page


def _assert_self_contained(text, page):
    for tag, attrs in page.tags:
        assert tag not in ("link", "img", "iframe", "object", "embed"), tag
        assert "src" not in attrs, (tag, attrs)
        href = attrs.get("href")
        assert href is None or href.startswith("#"), href
    assert "url(" not in text and "@import" not in text and "http://" not in text and "https://" not in text


# ------------------------------------------------------------------------------------ bounded buffers
def test_timeline_builder_keeps_at_most_points_and_always_the_peak():
    rng = random.Random(0)
    for n, points in ((10, 8), (5000, 50), (20000, 200)):
        totals = [rng.randrange(1, 10**6) for _ in range(n)]
        tb = TimelineBuilder(points)
        for op, t in enumerate(totals, start=1):
            tb.sample(op, "forward", t, [t, 0, 0, 0, 0, 0, 0, 0, 0, 0])
        tl = tb.timeline(n)
        assert len(tl.ops) <= points
        assert max(tl.totals()) == max(totals)  # the peak is a point
        assert list(tl.ops) == sorted(tl.ops)
        # every kept sample is a real (op, total) pair
        assert all(totals[op - 1] == t for op, t in zip(tl.ops, tl.totals(), strict=True))


def test_series_builder_bounds_points_and_keeps_each_fields_max():
    rng = random.Random(1)
    rows = [(rng.randrange(100), rng.choice([None, rng.randrange(100)]), rng.randrange(100), 128) for _ in range(3000)]
    sb = SeriesBuilder(64)
    for step, row in enumerate(rows):
        sb.add(step, row)
    s = sb.series()
    assert len(s.steps) <= 64 and s.steps[0] == 0 and list(s.steps) == sorted(s.steps)
    assert max(v for v in s.estimated_peak if v is not None) == max(r[0] for r in rows)
    assert max(v for v in s.measured_peak if v is not None) == max(r[1] for r in rows if r[1] is not None)
    # each point is the max of exactly the steps of its bucket
    k = s.stride
    for i, first in enumerate(s.steps):
        assert s.reserved[i] == max(r[2] for r in rows[first : first + k])
    round_trip = SeriesBuilder.from_dict(json.loads(json.dumps(sb.to_dict())))
    assert round_trip.series() == s


def test_accumulator_keeps_the_timeline_of_the_worst_and_latest_tracked_steps_only():
    acc = RankAccumulator(rank=0, epoch=0, backend="cpu")
    for step in range(10):
        acc.add(synthetic_step(step, epoch=0, rank=0, seq_len=128 + (64 if step == 3 else 0), params=2**20, acts=2**24))
    summary = acc.summary()
    with_tl = [r.step for r in summary.tracked if r.timeline is not None]
    assert sorted(with_tl) == [3, 9]  # step 3 has the largest activations (longest sequence), 9 is the latest
    assert summary.series is not None and list(summary.series.steps) == list(range(10))


def test_tensor_tracker_timeline_peak_equals_the_trackers_peak():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64)
    for _ in range(2):  # second step: optimizer states exist
        tracker = TensorTracker(model, [opt], timeline_points=16)
        with tracker:
            tracker.set_phase("forward")
            loss = model(x).square().mean()
            tracker.set_phase("backward")
            loss.backward()
            del loss
            tracker.set_phase("optimizer")
            opt.step()
            opt.zero_grad()
        rep = tracker.report()
    tl = rep.timeline
    assert tl is not None and 4 <= len(tl.ops) <= 16 and tl.n_ops == rep.n_ops
    assert max(tl.totals()) == rep.total  # the peak the tracker found independently is on the timeline
    assert set(tl.phases) == {"forward", "backward", "optimizer"}
    assert tl.components["params"][0] == sum(p.numel() * 4 for p in model.parameters())
    assert TensorTracker(model, [opt], timeline_points=None).report().timeline is None


# ------------------------------------------------------------------------------------ formats
def _as_version_1(data):
    data = json.loads(json.dumps(data))
    data["format_version"] = 1
    for epoch in data["epochs"]:
        epoch.pop("warning_steps")
        for r in epoch["ranks"]:
            r.pop("series")
            for t in r["tracked"]:
                t.pop("timeline"), t.pop("estimated_by_phase")
    for inc in data["incidents"]:
        if inc["step_record"]:
            inc["step_record"].pop("timeline"), inc["step_record"].pop("estimated_by_phase")
    return data


def test_version_3_round_trips_and_version_1_and_2_reports_still_read_and_render(tmp_path):
    assert REPORT_FORMAT_VERSION == 4  # version 4 added evaluation phases (EpochReport.phases, StepRecord.phase)
    report = synthetic_report(ranks=2, epochs=2, oom=True)
    data = report.to_dict()
    again = MemoryReport.from_dict(json.loads(json.dumps(data)))
    assert again == report
    v3 = json.loads(json.dumps(data))  # version 3: no evaluation phases (what this report has none of)
    v3["format_version"] = 3
    assert all("phases" not in e for e in v3["epochs"]) and MemoryReport.from_dict(v3) == report
    first = report.epochs[0]
    val = tuple(dataclasses.replace(r, shapes=((8, 32),)) for r in first.ranks)
    with_val = dataclasses.replace(report, epochs=(dataclasses.replace(first, phases={"val": val}), *report.epochs[1:]))
    assert MemoryReport.from_dict(json.loads(json.dumps(with_val.to_dict()))) == with_val
    assert "Validation, test and predict steps" in render_html(with_val)
    v2 = json.loads(json.dumps(data))  # version 2: no runs (every epoch is run 0)
    v2["format_version"] = 2
    del v2["current_run"]
    for epoch in v2["epochs"]:
        del epoch["run"]
    assert MemoryReport.from_dict(v2) == report
    old = MemoryReport.from_dict(_as_version_1(data))
    assert old.epochs[0].ranks[0].series is None and old.epochs[0].ranks[0].tracked[0].timeline is None
    page = _parse(render_html(old))
    assert {"timeline", "run", "ranks", "tables", "incidents"} <= page.ids
    render_png(old, tmp_path / "old.png")
    assert (tmp_path / "old.png").stat().st_size > 10_000


# ------------------------------------------------------------------------------------ HTML
@pytest.mark.parametrize("shape", list(SHAPES))
def test_html_report_renders_every_section_self_contained(shape):
    report = synthetic_report(**SHAPES[shape])
    text = render_html(report)
    page = _parse(text)
    _assert_self_contained(text, page)
    assert {"timeline", "run", "ranks", "tables"} <= page.ids
    n_ranks, n_epochs = SHAPES[shape]["ranks"], SHAPES[shape]["epochs"]
    groups = [g for g, _ in page.views]
    assert groups.count("run") == n_ranks and groups.count("ranks") == n_epochs
    assert groups.count("tl") == n_ranks * n_epochs + (1 if report.incidents else 0)
    # each switcher's options are exactly its views' keys
    assert set(page.options) == {k for g, k in page.views if any(groups.count(g2) > 1 for g2 in [g])}
    titles = " | ".join(page.titles)
    peak = max(r.measured_peak for r in report.latest.ranks)
    assert f"{peak / 2**20:.3g} MiB" in text  # the largest measured peak is printed
    assert "measured peak" in titles and "activations: up to" in titles
    n_tables = text.count("<table>")
    assert n_tables == 2 * n_epochs + len(report.incidents)
    if SHAPES[shape].get("pp"):
        assert "rank 2 · stage 1" in text and "rank 1 · stage 0" in text
    if n_ranks > 1:
        spread = report.latest.spread("measured_peak")
        assert f"imbalance (max / mean - 1) {spread.imbalance:.1%}" in text
    if SHAPES[shape].get("oom"):
        assert "incidents" in page.ids and any(t.startswith("step 12: oom: OutOfMemoryError") for t in page.titles)
    if SHAPES[shape].get("seq_change", True):
        assert any(t.startswith("sequence length changes to 256") for t in page.titles)
    if SHAPES[shape].get("warnings", True):
        assert any("least headroom" in t for t in page.titles)


def test_html_is_drawn_from_the_json_alone(tmp_path):
    report = synthetic_report(ranks=2, epochs=2, pp=2, oom=True)
    _, files = write_report(report, tmp_path, units="MiB")
    assert files.html == tmp_path / "memory_report.html" and files.png is not None
    assert files.html.read_text(encoding="utf-8") == render_html(load_report(files.json), units="MiB")
    assert not list(tmp_path.glob(".*tmp*"))  # atomic writes leave no temporary file


def test_run_view_marks_warnings_where_raised_and_incidents_and_seq_changes():
    from lightning_memplan.report.views import run_view

    report = synthetic_report(ranks=2, epochs=3, steps=6, oom=True)
    view = run_view(report, rank=1)
    assert view.warnings == [(13, "epoch 2: rank 1 has the least headroom")]  # warning_steps=(13,)
    assert view.seq_changes == [(9, 256), (18, 512)]  # halfway, then the failing step's longer batch
    assert view.incidents == [(18, "oom: " + report.incidents[0].error)]
    assert view.epoch_starts == [(0, 0), (6, 1), (12, 2)] and view.steps == list(range(19))
    old = MemoryReport.from_dict(_as_version_1(report.to_dict()))  # no steps for warnings: the epoch start
    assert run_view(old, rank=1).warnings == [(12, "epoch 2: rank 1 has the least headroom")]


def test_timeline_estimate_blocks_span_the_measured_phases():
    from lightning_memplan.report.views import timeline_view

    rec = synthetic_step(5, epoch=0, rank=0, seq_len=128, params=2**20, acts=2**24)
    view = timeline_view(rec)
    assert [b[0] for b in view.estimate] == ["forward", "backward", "optimizer"]
    spans = {p: (a, b) for p, a, b in view.spans}
    assert view.estimate[0][1] == spans["forward"][0] and view.estimate[1][1] == spans["backward"][0]
    assert view.estimate[-1][2] == rec.timeline.n_ops
    for phase, _, _, comps in view.estimate:
        assert comps == {c: v for c, v in rec.estimated_by_phase[phase].items() if v}
    assert view.peak[1] == rec.measured_peak


def test_png_has_its_title_inside_and_every_epoch(tmp_path):
    import matplotlib.image as mpimg

    report = synthetic_report(ranks=2, epochs=3, oom=True)
    render_png(report, tmp_path / "r.png")
    img = mpimg.imread(tmp_path / "r.png")
    dark = (img[..., :3].mean(axis=2) < 0.5)
    assert not dark[:3].any() and not dark[:, :3].any() and not dark[:, -3:].any()  # nothing cut at the edges
    assert dark[3:30].any()  # the title is there
    assert img.shape[0] > 800 and img.shape[1] > 800


# ------------------------------------------------------------------------------------ plan map
def test_plan_map_from_the_cli_labels_the_chosen_and_well_known_layouts(tmp_path, capsys):
    out = tmp_path / "plan.html"
    code = main(["plan", "--model", "llama3-8b", "--hardware", "h100-80gb", "--gpus-per-node", "8", "--nodes", "8",
                 "--seq-len", "8192", "--global-batch", "512", "--html", str(out), "--json"])
    decision = json.loads(capsys.readouterr().out)
    assert code == 0 and decision["fits"]
    text = out.read_text(encoding="utf-8")
    page = _parse(text)
    _assert_self_contained(text, page)
    view = plan_view(decision)
    chosen = [p for p in view.points if p.status == "chosen"]
    assert len(chosen) == 1 and chosen[0].step_s == pytest.approx(decision["step"]["total_s"])
    rejected = [r for r in decision["rejected"] if r["peak_bytes"] is not None]
    assert sum(t.startswith("rejected: ") for t in page.titles) == len(rejected) > 0
    assert any(rejected[0]["reason"] in t for t in page.titles)  # the reason is on hover
    assert f"budget {decision['budget']['budget'] / 2**30:.3g} GiB" in text
    assert ">TP x PP x DP</text>" in text
    # the fastest tensor-parallel layout inside the node is labelled by its data-parallel kind
    # (ZeRO-3: "FSDP x TP"; ZeRO-0/1/2: "DP x TP")
    assert ">FSDP x TP</text>" in text or ">DP x TP</text>" in text
    chosen_plan = decision["plan"]
    assert chosen_plan["tp"] == 1 and chosen_plan["pp"] == 1  # sharded data parallelism is the choice here
    assert f"chosen: dp=64 zero={chosen_plan['zero']}" in text


def test_cli_report_writes_html_with_the_plan_map_beside(tmp_path, capsys):
    report = synthetic_report(ranks=1, epochs=2)
    write_report(report, tmp_path, html=False)
    assert not (tmp_path / "memory_report.html").exists()
    decision = json.loads(json.dumps(_tiny_decision()))
    (tmp_path / "memplan_plan.json").write_text(json.dumps({"plan": {}, "decision": decision}), encoding="utf-8")
    out = tmp_path / "out.html"
    assert main(["report", str(tmp_path / "memory_report.json"), "--html", str(out)]) == 0
    page = _parse(out.read_text(encoding="utf-8"))
    assert {"timeline", "run", "ranks", "plan", "tables"} <= page.ids
    assert render_plan_html(decision).count("<svg") == 1


def _tiny_decision():
    from lightning_memplan.hardware import HardwareSpec
    from lightning_memplan.model.specs import ModelSpec, TrainSpec
    from lightning_memplan.planning import plan

    model = ModelSpec(n_layers=2, hidden=64, n_heads=4, vocab_size=256, ffn_hidden=256)
    hw = HardwareSpec.preset("h100-80gb", gpus_per_node=2, num_nodes=1)
    return plan(model, TrainSpec(micro_batch=2, seq_len=64), hw).to_dict()


def test_component_colours_cover_every_component():
    from lightning_memplan.report.views import COMPONENT_COLORS

    assert list(COMPONENT_COLORS) == list(COMPONENTS) and len(set(COMPONENT_COLORS.values())) == len(COMPONENTS)
