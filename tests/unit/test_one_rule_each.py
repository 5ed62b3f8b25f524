"""One record or rule where two copies used to be (issue 34): the planner's layout shape, the config
readers' first-present field."""

from __future__ import annotations

from lightning_memplan.hardware import HardwareSpec
from lightning_memplan.model import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.model.hf_experts import first_value
from lightning_memplan.planning import space, timing
from lightning_memplan.planning.space import Allow, enumerate_layouts


def test_search_and_timing_share_one_layout_record() -> None:
    """``space.LayoutChoice`` is a ``Layout`` with the search's options; the time model takes its
    ``shape`` and prices it as ``predict_step_time`` prices the same plan."""
    assert timing.Layout is space.Layout and issubclass(space.LayoutChoice, space.Layout)
    model, train = ModelSpec.preset("gpt2"), TrainSpec(micro_batch=2, seq_len=1024)
    hardware = HardwareSpec.preset("h100-sxm")
    layouts, _ = enumerate_layouts(model, train, 8, Allow.parse(None), 32)
    lc = next(lc for lc in layouts if (lc.dp, lc.tp, lc.pp, lc.cp, lc.b) == (4, 2, 1, 1, 2))
    assert type(lc.shape) is space.Layout and lc.shape == space.Layout(4, 2, 1, 1, 2, lc.m, "1f1b", 1)
    assert lc.shape.describe() == lc.describe()
    tm = timing.StepTimeModel(model, train, hardware, recomputes=("none",), zeros=(0,), losses=("naive",))
    plan = ParallelPlan(dp=4, tp=2)
    step = timing.predict_step_time(model, train.replace(grad_accumulation=lc.m), hardware, plan)
    assert tm.layout(lc.shape).step_time("none", 0, "naive") == step


def test_first_value_reads_the_first_name_set() -> None:
    """The config readers' one rule for alternative field names: the first name whose value is not
    ``None`` (a 0 or False is a value), ``None`` when none is set."""
    cfg = {"n_layer": None, "num_layers": 0, "num_hidden_layers": None, "n_embd": 768}
    assert first_value(cfg, ("num_hidden_layers", "n_layer", "num_layers")) == 0
    assert first_value(cfg, ("hidden_size", "n_embd")) == 768
    assert first_value(cfg, ("vocab_size",)) is None
