"""The HTML report in a real headless browser (Debian's ``chromium``; ``.ci/run`` installs it): every
section renders, the epoch/rank switches run, no console message and no network request, a screenshot.

Skips, saying why, when no Chromium is installed."""

import pytest

from lightning_memplan.report.html import render_html, render_plan_html
from lightning_memplan.report.io import write_atomic
from lightning_memplan.testing.browser import (
    REPORT_SECTIONS,
    check_report_page,
    find_chromium,
    open_in_browser,
)
from lightning_memplan.testing.reports import synthetic_report

pytestmark = pytest.mark.skipif(
    find_chromium() is None, reason="no chromium on PATH (apt-get install chromium; .ci/run installs it)"
)

SECTIONS = REPORT_SECTIONS
check_page = check_report_page


@pytest.mark.parametrize(
    "shape",
    [dict(ranks=1, epochs=1), dict(ranks=2, epochs=3), dict(ranks=4, epochs=2, pp=2), dict(ranks=2, epochs=2, oom=True)],
    ids=["1rank", "2ranks-3epochs", "pipeline", "oom"],
)
def test_report_renders_in_chromium(tmp_path, shape):
    path = tmp_path / "memory_report.html"
    write_atomic(path, render_html(synthetic_report(**shape)))
    sections = SECTIONS + (("Incidents",) if shape.get("oom") else ())
    run = check_page(path, tmp_path / "shot.png", sections=sections)
    assert "peak (worst rank):" in run.dom and "headroom (smallest):" in run.dom  # the header's figures


def test_plan_map_renders_in_chromium(tmp_path):
    from lightning_memplan.hardware import HardwareSpec
    from lightning_memplan.model.specs import ModelSpec, TrainSpec
    from lightning_memplan.planning import plan

    decision = plan(ModelSpec.preset("llama3-8b"), TrainSpec(micro_batch=1, seq_len=8192),
                    HardwareSpec.preset("h100-80gb", gpus_per_node=8, num_nodes=8), global_batch=512, top_k=40)
    path = tmp_path / "plan.html"
    write_atomic(path, render_plan_html(decision.to_dict()))
    run = check_page(path, tmp_path / "plan.png", sections=("Plan map",))
    assert "chosen: " in run.dom and "not timed (over budget)" in run.dom


def test_plan_map_of_a_cpu_host_renders_memory_only_in_chromium(tmp_path):
    from lightning_memplan.hardware import HardwareSpec
    from lightning_memplan.model.specs import ModelSpec, TrainSpec
    from lightning_memplan.planning import plan

    hw = HardwareSpec("cpu (x86_64, 2 cores)", 8 * 2**30, gpus_per_node=2)  # no time model on a CPU host
    decision = plan(ModelSpec.preset("gpt2"), TrainSpec(micro_batch=2, seq_len=64), hw)
    path = tmp_path / "plan.html"
    write_atomic(path, render_plan_html(decision.to_dict()))
    run = check_page(path, tmp_path / "plan.png", sections=("Plan map",))
    assert "memory only" in run.dom and "chosen: " in run.dom
    assert "tokens/s" not in run.dom and "MFU" not in run.dom and "predicted step time" not in run.dom


def test_the_check_sees_console_errors_and_network_requests(tmp_path):
    """The browser check can fail: a page that logs an error and loads a remote image is caught."""
    path = tmp_path / "bad.html"
    path.write_text('<!DOCTYPE html><html><body><img src="http://example.invalid/a.png">'
                    '<script>console.error("boom"); missingFunction();</script></body></html>', encoding="utf-8")
    run = open_in_browser(path)
    assert any("boom" in m for m in run.console) and any("missingFunction" in m for m in run.console)
    assert run.requests == ("http://example.invalid/a.png",)
