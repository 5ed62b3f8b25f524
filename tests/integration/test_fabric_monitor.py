"""MemoryMonitor on a real Fabric loop (CPU, one process): the calibrated estimate against the measured
peak, the report files read back by the project's reader, the measurement against PyTorch's own
MemTracker on the same step, the OOM incident, and bad input refused with the fix."""

from __future__ import annotations

import csv
import glob
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger

from lightning_memplan import LinearCrossEntropy
from lightning_memplan.fabric import MemoryMonitor
from lightning_memplan.report.io import load_report
from lightning_memplan.testing.zoo import GPT, gpt2_style

CHUNKED = LinearCrossEntropy(shift=True, chunk_size=4096)  # one chunk at every traced shape


def loss_fn(model, batch):
    """The example's loss: next-token cross-entropy from the hidden states, without a logits output."""
    return CHUNKED(model(batch), model.lm_head.weight, batch)


def _setup(root: Path, **options):
    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1, loggers=CSVLogger(str(root), name="fabric"))
    fabric.launch()
    model = GPT(gpt2_style())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    model, optimizer = fabric.setup(model, optimizer)
    options = {"loss_fn": loss_fn, "print_report": False, "units": "MiB", **options}
    return fabric, model, optimizer, MemoryMonitor(fabric, model, optimizer, **options)


def _batch(step: int, b: int = 4, s: int = 128) -> torch.Tensor:
    return torch.randint(0, gpt2_style().vocab_size, (b, s), generator=torch.Generator().manual_seed(step))


def _train_step(fabric, model, optimizer, batch) -> None:
    loss = loss_fn(model, batch)
    fabric.backward(loss)
    del loss  # as litgpt's loop leaves it: the graph is freed before the optimizer step
    optimizer.step()
    optimizer.zero_grad()


def test_estimate_within_1_percent_of_the_measured_peak_and_files_valid(tmp_path):
    from torch.distributed._tools.mem_tracker import MemTracker

    fabric, model, optimizer, monitor = _setup(tmp_path, measure_every_n_steps=2, log_every_n_steps=1)
    for step in range(4):
        with monitor.step(_batch(step)):
            _train_step(fabric, model, optimizer, _batch(step))
    epoch = monitor.end_epoch()
    assert monitor.report.run["estimate_source"] == "calibrated", monitor.report.notes
    assert monitor.report.run["plan"]["dp"] == 1 and monitor.report.run["precision"] == "32-true"
    (rank,) = epoch.ranks
    steady = [t for t in rank.tracked if not t.warmup]
    assert [t.step for t in rank.tracked] == [0, 1, 3] and steady
    for t in steady:  # the calibrated estimate of this step's shape against the tensor tracker
        assert abs(t.measured_peak / t.estimated_peak - 1) <= 0.01, (t.measured_peak, t.estimated_peak)
    # The report files, read back by the project's own reader, hold what the monitor returned.
    files = monitor.files
    assert Path(monitor.log_dir) == Path(fabric.logger.log_dir) == files.json.parent
    loaded = load_report(files.json)
    assert loaded.epochs[-1].to_dict() == epoch.to_dict()
    assert files.markdown.read_text().count("| 0 |") >= 1
    # a short loop: the pictures are not drawn at the epoch end (monitoring/writer.py), but at close()
    assert files.png is None and not files.json.with_suffix(".png").exists()
    monitor.close()
    files = monitor.files
    assert files.html.stat().st_size > 0 and files.png is not None and files.png.stat().st_size > 10_000
    assert monitor.close() is None and monitor.files.png == files.png  # a second close does nothing
    # An independent measurement: PyTorch's MemTracker on the same step of the same model.
    tracker = MemTracker()
    tracker.track_external(model.module, optimizer.optimizer)
    with tracker:
        _train_step(fabric, model, optimizer, _batch(3))
    reference = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert abs(steady[-1].measured_peak / reference - 1) <= 0.01, (steady[-1].measured_peak, reference)
    # Metrics went to the Fabric's CSV logger under the callback's names, one row per optimizer step.
    fabric.logger.finalize("success")
    (metrics,) = glob.glob(str(Path(monitor.log_dir) / "metrics.csv"))
    with open(metrics, encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert {int(r["step"]) for r in rows if r.get("memplan/reserved")} == {0, 1, 2, 3}  # RSS every step
    assert {int(r["step"]) for r in rows if r.get("memplan/measured_peak")} == {0, 1, 3}  # the tracked steps
    assert any(r.get("memplan/epoch/ranks") == "1" for r in rows)
    assert "memplan/measured_peak_mib" in rows[0] and "memplan/params/measured" in rows[0]


def test_gradient_accumulation_logs_one_value_per_optimizer_step(tmp_path):
    fabric, model, optimizer, monitor = _setup(
        tmp_path, measure_every_n_steps=50, log_every_n_steps=1, accumulate_grad_batches=2, write_files=False
    )
    for step in range(4):
        with monitor.step(_batch(step)):
            with fabric.no_backward_sync(model, enabled=step % 2 == 0):
                fabric.backward(loss_fn(model, _batch(step)) / 2)
            if step % 2 == 1:
                optimizer.step()
                optimizer.zero_grad()
    epoch = monitor.end_epoch()
    assert epoch.ranks[0].steps == 4 and monitor.report.run["train_spec"]["grad_accumulation"] == 2
    assert monitor.state_dict()["optimizer_steps"] == 2


def test_an_out_of_memory_error_inside_the_step_writes_the_incident_and_propagates(tmp_path):
    fabric, model, optimizer, monitor = _setup(tmp_path)
    with monitor.step(_batch(0)):
        _train_step(fabric, model, optimizer, _batch(0))
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        with monitor.step(_batch(1)):
            model(_batch(1))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
    (incident,) = monitor.report.incidents
    assert incident.kind == "oom" and incident.step == 1 and incident.step_record is not None
    assert incident.step_record.estimated_peak is not None
    loaded = load_report(Path(monitor.log_dir) / "memory_report.json")
    assert loaded.incidents[0].error.startswith("OutOfMemoryError")
    # the loop's own objects are untouched: fabric.backward is Fabric's again, the optimizer has no hook
    assert "backward" not in vars(fabric) and not optimizer.optimizer._optimizer_step_pre_hooks


def test_bad_input_is_refused_with_the_fix(tmp_path):
    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1)
    raw = GPT(gpt2_style())
    raw_opt = torch.optim.AdamW(raw.parameters())
    with pytest.raises(ValueError, match=r"before fabric\.setup.*fabric\.setup\(model, optimizer\)"):
        MemoryMonitor(fabric, raw, raw_opt)
    with pytest.raises(TypeError, match="must be a lightning.fabric.Fabric"):
        MemoryMonitor(object(), raw, raw_opt)
    model, optimizer = fabric.setup(raw, raw_opt)
    with pytest.raises(TypeError, match="not a module set up by Fabric.*not the original"):
        MemoryMonitor(fabric, GPT(gpt2_style()), optimizer)
    with pytest.raises(TypeError, match="not an optimizer set up by Fabric"):
        MemoryMonitor(fabric, model, raw_opt)
    other = Fabric(accelerator="cpu", devices=1)
    with pytest.raises(ValueError, match="set up by another Fabric"):
        MemoryMonitor(other, model, optimizer)
    bad = [
        ({"tolerance": "10%"}, TypeError, "tolerance='10%' must be a real number"),
        ({"measure_every_n_steps": 0}, ValueError, "measure_every_n_steps=0"),
        ({"units": "gb"}, ValueError, "units='gb' is not a known unit"),
        ({"loss_fn": 3}, TypeError, "loss_fn=3 must be callable"),
        ({"accumulate_grad_batches": 0}, ValueError, "accumulate_grad_batches=0"),
        ({"grads_alive_in_forward": "no"}, TypeError, "grads_alive_in_forward='no'"),
        ({"dirpath": 5}, TypeError, "dirpath=5 must be a folder path"),
        ({"plan": "dp=2"}, TypeError, "plan='dp=2' must be a ParallelPlan"),
        ({"measure_every_n_step": 5}, TypeError, r"MemoryMonitor\(measure_every_n_step=5\): unknown option"),
    ]
    for options, error, message in bad:
        with pytest.raises(error, match=message):
            MemoryMonitor(fabric, model, optimizer, **options)
    monitor = MemoryMonitor(fabric, model, optimizer, dirpath=tmp_path, print_report=False, loss_fn=loss_fn)
    with pytest.raises(RuntimeError, match="inside another step"):
        with monitor.step(_batch(0)):
            with monitor.step(_batch(0)):
                pass
    with pytest.raises(RuntimeError, match="inside a step"):
        with monitor.step(_batch(1)):
            monitor.end_epoch()


def test_fabric_save_is_measured_and_joins_the_latest_epoch(tmp_path):
    """``fabric.save`` is wrapped on the instance: the save is estimated and measured (tensor tracker), its
    record joins the epoch, the file is what ``fabric.save`` writes without the monitor."""
    fabric, model, optimizer, monitor = _setup(tmp_path, calibrate=False)
    with monitor.step(_batch(0)):
        _train_step(fabric, model, optimizer, _batch(0))
    monitor.end_epoch()
    fabric.save(tmp_path / "state.ckpt", {"model": model, "optimizer": optimizer})
    (record,) = monitor.report.latest.checkpoints
    assert record.mode == "plain" and record.measurement == "tensor_tracker"
    assert abs(record.estimated_peak - record.measured_peak) <= 0.10 * record.measured_peak
    monitor.close()
    assert "save" not in vars(fabric)
    fabric.save(tmp_path / "plain.ckpt", {"model": model, "optimizer": optimizer})
    a = torch.load(tmp_path / "state.ckpt", weights_only=True)
    b = torch.load(tmp_path / "plain.ckpt", weights_only=True)
    for key in ("model",):
        assert a[key].keys() == b[key].keys() and all(torch.equal(a[key][k], b[key][k]) for k in a[key])


_NEVER_CLOSED = """
import sys, torch
sys.path.insert(0, {tests!r})
from integration.test_fabric_monitor import _setup, _batch, _train_step
from pathlib import Path
fabric, model, optimizer, monitor = _setup(Path({root!r}), calibrate=False)
for step in range(2):
    with monitor.step(_batch(step)):
        _train_step(fabric, model, optimizer, _batch(step))
monitor.end_epoch()
print("PNG_AT_END_EPOCH", Path(monitor.log_dir, "memory_report.png").exists(), monitor.log_dir)
"""


def test_a_loop_that_never_closes_gets_its_pictures_at_interpreter_exit(tmp_path):
    """The pictures wait for close(); a script that never calls it finds them on disk after it exits (the
    weakref'd finalizer's atexit), drawn from the final report."""
    import subprocess
    import sys

    code = _NEVER_CLOSED.format(tests=str(Path(__file__).resolve().parents[1]), root=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("PNG_AT_END_EPOCH"))
    _, before, log_dir = line.split(" ", 2)
    assert before == "False"
    png, html = Path(log_dir, "memory_report.png"), Path(log_dir, "memory_report.html")
    assert png.stat().st_size > 10_000 and html.stat().st_size > 0
    assert load_report(Path(log_dir, "memory_report.json")).latest is not None
