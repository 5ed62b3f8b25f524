"""Issue 25: config-only estimates at the shape asked for and for mixed layer stacks, against MemTracker.

Each family of ``lightning_memplan.testing.hf_architectures.SHAPE_ARCHITECTURES`` is pinned at one
held-out shape (never one the fit was made at: (1, 64), (2, 128), (2, 64), probe (1, 256)) against a
real CPU step measured by PyTorch's MemTracker: config-only within 3%. The full grid is
``python benchmarks/bench_hf_architectures.py --shapes`` (benchmarks/results/hf_architectures_shapes.md).
Mamba (v1) and Jamba scan token by token in the real CPU step, so they are pinned at small shapes.
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("transformers")

from lightning_memplan.model.estimate import estimate_memory  # noqa: E402
from lightning_memplan.model.specs import ModelSpec, TrainSpec  # noqa: E402
from lightning_memplan.model.traced import DepthTraces  # noqa: E402
from lightning_memplan.testing.hf_architectures import (  # noqa: E402
    SHAPE_ARCHITECTURES,
    build_model,
    example_batch,
    loss_of,
    measure_step,
)

pytestmark = pytest.mark.hf

# (family, b, s): a held-out shape each: b=4 is never traced (a shape the fit cannot trust is traced at (1, s) and
# (2, s)), and s is past the window/chunk steps of the tiny configs.
PINNED = [
    ("deepseek_v3", 4, 512),  # MLA: CPU SDPA math path, b*s^2 scores; first_k_dense_replace=1; traced at (1|2, 512): b=4 held out
    ("llama4_maverick", 4, 1024),  # dense/MoE interleaved, NoPE block, chunked attention past 256
    ("gemma3", 4, 512),  # sliding (256) / global, past the window
    ("gpt_oss", 4, 384),  # sinks (eager), sliding/full alternation
    ("mamba2", 4, 640),  # chunk padding (256): 640 pads to 768
]


def _train(b: int, s: int, attention: str) -> TrainSpec:
    return TrainSpec(micro_batch=b, seq_len=s, precision="32-true", attention=attention, optimizer_impl="for_loop",
                     device="cpu")


@pytest.mark.parametrize(("name", "b", "s"), PINNED, ids=[p[0] for p in PINNED])
def test_config_only_at_a_held_out_shape(name: str, b: int, s: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_MEMPLAN_HF_TRACE_CACHE", "0")
    arch = SHAPE_ARCHITECTURES[name]
    attention = arch.attentions[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_model(arch, dropout=0.0, attention=attention, checkpointing=False)
        estimate = estimate_memory(ModelSpec.from_hf_config(model.config), _train(b, s, attention))
        measured = measure_step(model, example_batch(model, b, s), precision="32-true")
    assert estimate.source == "hf_trace"
    assert abs(estimate.total / measured - 1) < 0.03, (name, estimate.total, measured)


def test_mamba_fake_trace_takes_the_real_scan() -> None:
    """transformers' Mamba runs an associative scan when it sees a FakeTensor and the sequential scan in the
    real CPU step: trace_memory patches the check (tracking/fake_fidelity.py), so the two agree."""
    from lightning_memplan.tracking.trace import trace_memory

    arch = SHAPE_ARCHITECTURES["mamba"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_model(arch, dropout=0.0, attention="eager", checkpointing=False)
        batch = example_batch(model, 1, 32)
        traced = trace_memory(model, example_input=batch, loss_fn=loss_of, precision="32-true", seq_len=32)
        measured = measure_step(model, batch, precision="32-true")
    assert traced.mode == "fake"
    assert abs(traced.total / measured - 1) < 0.005, (traced.total, measured)


def test_layer_kinds_are_counted_as_the_config_has_them() -> None:
    """Maverick's interleaved MoE: dense, MoE, dense, MoE-with-full-attention (NoPE) are three kinds; the
    exact parameter count of the full model equals the kinds' sum."""
    from lightning_memplan.model.hf_build import full_model, layer_plan

    cfg = SHAPE_ARCHITECTURES["llama4_maverick"].config(0.0).to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = full_model(cfg, attention="sdpa")
    plan = layer_plan(model, cfg)
    assert plan.kinds == (0, 1, 0, 2) and plan.counts() == (2, 1, 1)
    assert plan.n_params == sum(p.numel() for p in model.parameters())


def _entry_form(**form: object) -> DepthTraces:
    cal = {"coefficients": {}, "traced_shapes": [[1, 64], [2, 128]], "precision": "32-true", "n_params": 1}
    depth = {"calibration": cal, "n_params": 1}
    return DepthTraces.from_entry({"class": "X", "norm_impl": "native", "depths": {"1": depth, "2": depth},
                                   "form": form})


def test_where_the_fit_is_trusted() -> None:
    ok = dict(fitted=[[1, 64], [2, 128]], probe=[1, 256], probe_error=0.001, tolerance=0.005, steps=[], seq_len=None)
    assert _entry_form(**ok).untrusted_at(4, 8192) is None  # linear, checked, no step: extrapolated
    assert "step" in (_entry_form(**{**ok, "steps": [4096]}).untrusted_at(1, 8192) or "")
    assert _entry_form(**{**ok, "steps": [4096]}).untrusted_at(1, 2048) is None
    assert "b*s^2" in (_entry_form(**{**ok, "quadratic": True}).untrusted_at(1, 512) or "")
    bad = {**ok, "probe_error": 0.4}
    assert "not of the fitted form" in (_entry_form(**bad).untrusted_at(1, 512) or "")
    assert _entry_form(**bad).untrusted_at(2, 128) is None  # a fitted shape is exact
    assert "s=512 only" in (_entry_form(**{**ok, "seq_len": 512}).untrusted_at(1, 1024) or "")
    legacy = DepthTraces.from_entry({"class": "X", "norm_impl": "native", "depths": _entry_form().__dict__ and {
        "1": {"calibration": {"coefficients": {}}, "n_params": 1}, "2": {"calibration": {"coefficients": {}}, "n_params": 1}}})
    assert legacy.form is None and legacy.untrusted_at(1, 8192) is None  # an older entry: as before
