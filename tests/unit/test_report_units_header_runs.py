"""Re-rendered reports keep their units; the HTML header names the peak and the headroom; the plan map of a
host without a time model plots memory only; two fits writing one folder are both kept."""

from __future__ import annotations

import dataclasses
import json
import re
from html.parser import HTMLParser

from lightning_memplan.cli import main
from lightning_memplan.report.html import render_html, render_plan_html
from lightning_memplan.report.io import load_report, write_report
from lightning_memplan.report.records import MemoryReport
from lightning_memplan.report.render import format_bytes, report_units
from lightning_memplan.report.views import plan_view
from lightning_memplan.testing.reports import synthetic_report


def _with_run(report: MemoryReport, **run) -> MemoryReport:
    return dataclasses.replace(report, run={**report.run, **run})


# ------------------------------------------------------------------------------------ units
def test_report_units_keeps_the_written_units_else_reads_the_magnitudes():
    report = synthetic_report(ranks=1, epochs=1)  # peaks of ~100 MiB
    assert "units" not in report.run
    assert report_units(report) == "MiB"  # not GiB: a MiB-scale run would read 0.0xx
    assert report_units(_with_run(report, units="KiB")) == "KiB"
    assert report_units(_with_run(report, units="KiB"), "GB") == "GB"  # an explicit --units wins
    assert report_units(MemoryReport()) == "GiB"


def test_cli_report_rerenders_a_mib_run_in_mib_everywhere(tmp_path, capsys):
    report = _with_run(synthetic_report(ranks=2, epochs=1), units="MiB")
    write_report(report, tmp_path, units="MiB", png=False)
    assert main(["report", str(tmp_path), "--markdown", "--html", str(tmp_path / "again.html")]) == 0
    markdown = capsys.readouterr().out
    assert "Sizes in MiB." in markdown and "GiB" not in markdown
    assert markdown == (tmp_path / "memory_report.md").read_text(encoding="utf-8")  # as the run wrote it
    assert "Sizes in MiB." in (tmp_path / "again.html").read_text(encoding="utf-8")
    assert main(["report", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    peak = report.latest.ranks[0].measured_peak
    assert "epoch 0, MiB" in table and format_bytes(peak, "MiB", suffix=False) in table
    assert main(["report", str(tmp_path), "--markdown", "--units", "GiB"]) == 0
    assert "Sizes in GiB." in capsys.readouterr().out


# ------------------------------------------------------------------------------------ HTML header
class _Header(HTMLParser):
    """The text of the first ``<ul>`` (the header's facts), outside any script."""

    def __init__(self) -> None:
        super().__init__()
        self.depth, self.done, self.text = 0, False, []

    def handle_starttag(self, tag, attrs):
        if tag == "ul" and not self.done:
            self.depth += 1

    def handle_endtag(self, tag):
        if tag == "ul" and self.depth:
            self.depth -= 1
            self.done = True

    def handle_data(self, data):
        if self.depth:
            self.text.append(data)


def test_html_header_gives_the_peak_and_the_headroom_without_javascript():
    report = synthetic_report(ranks=2, epochs=2)
    page = render_html(report, units="MiB")
    parser = _Header()
    parser.feed(page)
    header = "".join(parser.text)
    rows = [(e, r) for e in report.epochs for r in e.ranks]
    est_e, est = max(rows, key=lambda t: t[1].estimated_peak)
    meas_e, meas = max(rows, key=lambda t: t[1].measured_peak)
    room_e, room = min(rows, key=lambda t: t[1].headroom)
    assert (f"estimated {format_bytes(est.estimated_peak, 'MiB')} (rank {est.rank}, {est_e.label})") in header
    assert (f"measured {format_bytes(meas.measured_peak, 'MiB')} (rank {meas.rank}, {meas_e.label})") in header
    assert (f"headroom (smallest): {format_bytes(room.headroom, 'MiB')} of "
            f"{format_bytes(room.device_memory, 'MiB')} capacity / budget (rank {room.rank}, {room_e.label})") in header
    assert page.index("peak (worst rank)") < page.index("<script>")


# ------------------------------------------------------------------------------------ plan map on a CPU host
def _cpu_decision() -> dict:
    from lightning_memplan.hardware import HardwareSpec
    from lightning_memplan.model.specs import ModelSpec, TrainSpec
    from lightning_memplan.planning import plan

    model = ModelSpec(n_layers=2, hidden=64, n_heads=4, vocab_size=256, ffn_hidden=256)
    hw = HardwareSpec("cpu (x86_64, 2 cores)", 8 * 2**30, gpus_per_node=2)  # what detect_hardware gives a CPU host
    return json.loads(json.dumps(plan(model, TrainSpec(micro_batch=2, seq_len=64), hw).to_dict()))


def test_plan_map_without_a_time_model_shows_memory_only():
    decision = _cpu_decision()
    assert decision["step"]["modelled"] is False  # the console prints TIME_MODEL_OFF for it
    view = plan_view(decision)
    assert not view.timed and all(p.step_s is None for p in view.points)
    assert any(p.status == "chosen" for p in view.points)
    for page in (render_plan_html(decision), render_html(synthetic_report(epochs=1), decision=decision)):
        plan = page[page.index('<section id="plan">'):]
        plan = plan[: plan.index("</section>")]
        assert "Step time is not modelled on this hardware" in plan and "memory only" in plan
        for shown in ("tokens/s", "MFU", "step (s)", "predicted step time", "1,000,000"):
            assert shown not in plan, shown
        assert re.search(r"\d%", plan) is None  # no utilisation percentage anywhere
        assert "chosen: " in plan and "<svg" in plan


# ------------------------------------------------------------------------------------ two fits, one folder
def _fit(epochs: int, seq: int) -> MemoryReport:
    """What one fit's callback holds: a fresh report (a new run id), then its epochs."""
    base = synthetic_report(ranks=1, epochs=epochs)
    report = MemoryReport(run=base.run).new_run()
    for e in base.epochs:
        report = report.with_epoch(dataclasses.replace(e, warnings=(f"seq {seq}",)))
    return report


def test_two_fits_in_one_folder_are_both_kept_in_every_order(tmp_path):
    a, b = _fit(1, 16), _fit(2, 24)  # two processes: each numbers its own run 0
    assert a.current_run == b.current_run == 0 and a.current_run_id != b.current_run_id
    write_report(a, tmp_path, png=False, html=False)
    write_report(b, tmp_path, png=False, html=False)
    on_disk = load_report(tmp_path)
    assert [e.key for e in on_disk.epochs] == [(0, 0), (1, 0), (1, 1)]
    assert [e.warnings for e in on_disk.epochs] == [("seq 16",), ("seq 24",), ("seq 24",)]
    # each writes again (a later epoch, an incident): the numbering holds, nothing is replaced or doubled
    write_report(a, tmp_path, png=False, html=False)
    write_report(b, tmp_path, png=False, html=False)
    assert [(e.key, e.run_id) for e in load_report(tmp_path).epochs] == [(e.key, e.run_id) for e in on_disk.epochs]
    # a second fit of the first callback (new_run) takes the next free number
    a2 = a.new_run().with_epoch(a.epochs[0])
    write_report(a2, tmp_path, png=False, html=False)
    assert [e.key for e in load_report(tmp_path).epochs] == [(0, 0), (1, 0), (1, 1), (2, 0)]


def test_a_report_written_before_run_ids_is_kept_beside_a_new_fit(tmp_path):
    old = _fit(1, 16).to_dict()
    old.pop("current_run_id")
    for e in old["epochs"]:
        e.pop("run_id")
    (tmp_path / "memory_report.json").write_text(json.dumps(old), encoding="utf-8")
    write_report(_fit(1, 24), tmp_path, png=False, html=False)
    on_disk = load_report(tmp_path)
    assert [(e.key, e.warnings) for e in on_disk.epochs] == [((0, 0), ("seq 16",)), ((1, 0), ("seq 24",))]
