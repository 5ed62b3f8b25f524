"""MemoryPlanCallback with torch.compile: the model stays compiled, and estimate and measurement are
still reported (the calibration trace and the tensor tracker are dispatch modes, which make dynamo skip
a frame for good: ``torch/_dynamo/convert_frame.py``, "non-infra torch dispatch mode present").

Every way of compiling is checked against the same run without the callback (dynamo's frame counters
equal): a compiled sub-module, a compiled LightningModule, a compiled free function that training_step
calls, ``block.forward = torch.compile(block.forward)``, ``block.compile()``, and a compiled function
only found at run time (called from a helper no scan sees)."""

from __future__ import annotations

import pytest
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


def _head_loss(model, hidden, targets):
    return torch.nn.functional.cross_entropy(model.logits(hidden).flatten(0, 1), targets.flatten())


compiled_head_loss = torch.compile(_head_loss, backend=BACKEND)


class FreeFunctionGPT(LitGPT):
    """training_step calls a module-level compiled function (``fn = torch.compile(block_fn)``)."""

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        return compiled_head_loss(self.model, self.model(idx), targets)


class HelperGPT(LitGPT):
    """The compiled function is called from a helper: training_step's own code does not name it."""

    def training_step(self, batch, batch_idx):
        return self._loss(*batch)

    def _loss(self, idx, targets):
        return compiled_head_loss(self.model, self.model(idx), targets)


def _compiled_in_place(kind: str) -> LitGPT:
    torch.manual_seed(0)
    config = gpt2_style(n_layers=1)
    if kind == "free function":
        return FreeFunctionGPT(config)
    if kind == "run time":
        return HelperGPT(config)
    lit = LitGPT(config)
    block = lit.model.blocks[0]
    if kind == "forward":
        block.forward = torch.compile(block.forward, backend=BACKEND)
    else:
        block.compile(backend=BACKEND)
    return lit


def _eager_peak(tmp_path) -> int:
    """The same model's steady peak, eager, from the tensor tracker (the reference for the profiler)."""
    torch.manual_seed(0)
    cb = MemoryPlanCallback(measure_every_n_steps=2, print_report=False, write_files=False, calibrate=False)
    _fit(tmp_path / "eager", LitGPT(gpt2_style(n_layers=1)), [cb])
    (peak,) = {t.measured_peak for t in cb.report.epochs[-1].ranks[0].tracked if not t.warmup}
    return peak


@pytest.mark.parametrize(
    ("kind", "found"),
    [
        ("free function", "compiled_head_loss (torch.compile, called in training_step)"),
        ("forward", "model.blocks.0.forward (torch.compile)"),
        ("module.compile", "model.blocks.0 (nn.Module.compile)"),
        ("run time", "compiled code called in training (dynamo converted frames in step 0)"),
    ],
)
def test_compiled_parts_stay_compiled_and_are_measured_by_the_profiler(tmp_path, kind, found):
    reference = _fit(tmp_path / "plain", _compiled_in_place(kind), [])
    assert reference == {"total": 1, "ok": 1}
    cb = MemoryPlanCallback(measure_every_n_steps=2, print_report=False, write_files=False)
    assert _fit(tmp_path / "cb", _compiled_in_place(kind), [cb]) == reference  # nothing skipped
    assert cb.report.run["compiled"] == [found]
    tracked = cb.report.epochs[-1].ranks[0].tracked
    if kind == "run time":
        # found after step 0 ran under the compile-safe tracker: its tensor-level numbers are dropped
        assert [(t.step, t.measurement) for t in tracked[:1]] == [(0, "rss")]
        assert any("torch.compile found at run time" in n for n in cb.report.notes)
        tracked = tracked[1:]
    assert [(t.step, t.measurement) for t in tracked if not t.warmup] == [(1, "compiled:profiler"), (3, "compiled:profiler")]
    steady = [t.measured_peak for t in tracked if not t.warmup]
    eager = _eager_peak(tmp_path) if kind == "free function" else None
    # the eager backend keeps eager's memory: every steady step reads the same peak (no unreported frees
    # of the previous step's gradients), and that peak is the eager tensor tracker's within 0.1 %
    assert max(steady) - min(steady) <= 1e-3 * min(steady), steady
    if eager is not None:
        assert abs(steady[0] - eager) <= 1e-3 * eager, (steady, eager)


def test_compiled_parts_names_every_form_and_eager_view_restores_them():
    lit = _compiled_in_place("forward")
    block = lit.model.blocks[0]
    wrapped = block.__dict__["forward"]
    impl_lit = _compiled_in_place("module.compile")
    impl = impl_lit.model.blocks[0]._compiled_call_impl
    with eager_view(lit), eager_view(impl_lit):
        assert compiled_parts(lit) == [] and "forward" not in block.__dict__
        assert impl_lit.model.blocks[0]._compiled_call_impl is None
    assert block.__dict__["forward"] is wrapped and impl_lit.model.blocks[0]._compiled_call_impl is impl

    class Decorated(LitGPT):
        @torch.compile(backend=BACKEND)
        def forward(self, idx):
            return self.model(idx)

    assert compiled_parts(Decorated(gpt2_style(n_layers=1))) == ["Decorated.forward (torch.compile)"]
    assert compiled_parts(HelperGPT(gpt2_style(n_layers=1))) == []  # left to the run-time check


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
        # frees the gradients setup() made with profiling off: the allocator does not report those frees
        opt.zero_grad(set_to_none=True)
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
