"""MemoryPlanCallback with torch.compile: the model stays compiled, and estimate and measurement are
still reported (the calibration trace and the tensor tracker are dispatch modes, which make dynamo skip
a frame for good: ``torch/_dynamo/convert_frame.py``, "non-infra torch dispatch mode present")."""

from __future__ import annotations

import torch
from test_callback_helpers import LitGPT, make_trainer, token_loader
from torch._dynamo.utils import counters

from lightning_memplan.callbacks import MemoryPlanCallback
from lightning_memplan.testing.zoo import gpt2_style
from lightning_memplan.tracking.compiled import AllocationMeter, compiled_parts, eager_view

#: The "eager" backend runs dynamo's frame conversion (where the dispatch-mode check skips a frame, before
#: any backend is called) without AOTAutograd's and inductor's compile time; the run's memory is eager's.
BACKEND = "eager"


def _fit(root, model, callbacks, n_batches=4):
    torch._dynamo.reset()
    counters.clear()
    config = gpt2_style(n_layers=1)
    trainer = make_trainer(root, callbacks, limit_train_batches=n_batches, logger=False)
    trainer.fit(model, token_loader(config, 2, [32], n_batches))
    return dict(counters["frames"])


def _compiled_submodule() -> LitGPT:
    torch.manual_seed(0)
    lit = LitGPT(gpt2_style(n_layers=1))
    lit.model = torch.compile(lit.model, backend=BACKEND)
    return lit


def test_compiled_submodule_stays_compiled_and_is_measured(tmp_path):
    reference = _fit(tmp_path / "plain", _compiled_submodule(), [])
    assert reference.get("ok", 0) >= 1 and reference.get("ok") == reference.get("total")
    cb = MemoryPlanCallback(measure_every_n_steps=2, print_report=False, write_files=False)
    frames = _fit(tmp_path / "cb", _compiled_submodule(), [cb])
    assert frames == reference  # same frames converted, none skipped, with the callback attached
    assert cb.report.run["compiled"] == ["model (OptimizedModule)"]
    assert cb.report.run["estimate_source"] == "calibrated"
    rank = cb.report.epochs[-1].ranks[0]
    tracked = [t for t in rank.tracked if t.measurement == "compiled:profiler"]
    assert [t.step for t in tracked] == [0, 1, 3]
    steady = [t for t in tracked if not t.warmup]
    assert steady and all(t.measured_peak and t.estimated_peak for t in steady)
    # aot_eager keeps eager's memory, so the calibrated estimate of the eager model describes it.
    assert all(0.9 < t.ratio < 1.1 for t in steady), [t.ratio for t in steady]
    assert set(steady[0].measured_phase_peaks) == {"forward", "backward", "optimizer"}


def test_compiled_lightning_module_given_to_the_trainer(tmp_path):
    def compiled():
        torch.manual_seed(0)
        return torch.compile(LitGPT(gpt2_style(n_layers=1)), backend=BACKEND)

    reference = _fit(tmp_path / "plain", compiled(), [])
    cb = MemoryPlanCallback(measure_every_n_steps=2, print_report=False, write_files=False)
    assert _fit(tmp_path / "cb", compiled(), [cb]) == reference
    assert cb.report.run["compiled"] == ["LitGPT (torch.compile given to the Trainer)"]
    assert cb.report.run["estimate_source"] == "calibrated"
    assert {t.measurement for t in cb.report.epochs[-1].ranks[0].tracked} == {"compiled:profiler"}


def test_eager_models_keep_the_tensor_tracker(tmp_path):
    torch.manual_seed(0)
    cb = MemoryPlanCallback(measure_every_n_steps=2, print_report=False, write_files=False, calibrate=False)
    _fit(tmp_path, LitGPT(gpt2_style(n_layers=1)), [cb])
    assert cb.report.run["compiled"] == []
    assert {t.measurement for t in cb.report.epochs[-1].ranks[0].tracked} == {"tensor_tracker"}


def test_eager_view_restores_every_compiled_part():
    lit = _compiled_submodule()
    compiled = lit.model
    with eager_view(lit) as eager:
        assert eager is lit and compiled_parts(lit) == [] and lit.model is compiled._orig_mod
    assert lit.model is compiled and compiled_parts(lit) == ["model (OptimizedModule)"]
    from lightning.pytorch.utilities.compile import from_compiled

    wrapped = from_compiled(torch.compile(LitGPT(gpt2_style(n_layers=1)), backend=BACKEND))
    step = wrapped.training_step
    with eager_view(wrapped):
        assert "training_step" not in wrapped.__dict__
    assert wrapped.training_step is step


def test_allocation_meter_agrees_with_pytorch_mem_tracker():
    """The profiler-event meter against PyTorch's own MemTracker on the same eager step."""
    from torch.distributed._tools.mem_tracker import MemTracker

    def setup():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(64, 256)
        model(x).square().mean().backward()  # states and grads exist: a steady-state step follows
        opt.step()
        return model, opt, x

    def step(model, opt, x, mark):
        mark("forward")
        loss = model(x).square().mean()
        mark("backward")
        loss.backward()
        mark("optimizer")
        opt.step()

    model, opt, x = setup()
    meter = AllocationMeter("cpu")
    meter.start(model, [opt], x)
    step(model, opt, x, meter.set_phase)
    peak, phases = meter.stop()
    model, opt, x = setup()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step(model, opt, x, lambda phase: None)
    reference = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert abs(peak - reference) / reference < 0.02, (peak, reference)
    assert max(phases.values()) == peak and set(phases) == {"forward", "backward", "optimizer"}
