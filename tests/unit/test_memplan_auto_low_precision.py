"""What memplan_auto needs to plan a quantized run (issue 35), piece by piece; the whole of it runs in
tests/distributed/test_memplan_auto_qlora.py (2 gloo processes, a QLoRA Hugging Face Llama).

- one reader (``live/low_precision.low_precision_fields``) for the callback and both front doors: the Trainer's
  ``train_spec_for`` and ``compose_train_spec`` carry ``base_weights`` into the planned TrainSpec; ``train=``
  fields the user set win;
- the search leaves out what cannot be applied, with the reason as a decision note
  (``planner_bridge.low_precision_limits`` / ``narrow_allow``), and a forced tp on quantized blocks is
  blocked (``tensor_parallel_blocker``);
- a meta copy of a bitsandbytes module traces under fake tensors like the module itself (a stand-in per
  ``Params4bit`` / ``Int8Params``), so the plan is calibrated; that calibration says it traced quantized
  weights, and the estimate does not add their backward rebuild again;
- the tensor tracker counts a layer's ``QuantState`` when its weight is replaced by a plain parameter (what
  FSDP2 does).
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec

bnb = pytest.importorskip("bitsandbytes", reason="the quant extra (pip install 'lightning-memplan[quant]')")


def _blocks(n: int = 2, dropout: float = 0.0) -> torch.nn.Module:
    """A token model whose ``layers`` are NF4-DQ ``Linear4bit`` blocks (quantized on the move to the CPU)
    and a trainable head."""
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(64, 32)
            self.layers = torch.nn.ModuleList(
                torch.nn.Sequential(bnb.nn.Linear4bit(32, 32, bias=False, compute_dtype=torch.float32, quant_type="nf4",
                                                      compress_statistics=True), torch.nn.Dropout(dropout))
                for _ in range(n))
            self.head = torch.nn.Linear(32, 64)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.embed(ids)
            for layer in self.layers:
                x = x + layer(x)
            return self.head(x)

    return Net().to("cpu")


def _trace(module: torch.nn.Module, fake: bool = True) -> Any:
    from lightning_memplan.tracking.trace import trace_memory

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fall back to a real step
        return trace_memory(module, batch_shape=(2, 16), optimizer="adamw", optimizer_impl="for_loop",
                            precision="32-true", fake=fake)


def test_a_meta_copy_of_a_bitsandbytes_module_traces_as_the_module() -> None:
    from lightning_memplan.tracking.fake_params import STAND_IN_ATTR, holds_quantized_parameters
    from lightning_memplan.tracking.meta_copy import meta_copy

    net = _blocks()
    copy = meta_copy(net)
    layer = copy.layers[0][0]
    assert layer.weight.is_meta and getattr(layer.weight, STAND_IN_ATTR) == "Params4bit"
    assert layer.weight.quant_state is layer.quant_state  # one QuantState, as in the module
    assert layer.quant_state.absmax.is_meta and layer.quant_state.state2.absmax.is_meta
    assert holds_quantized_parameters(copy) and holds_quantized_parameters(net)
    assert not holds_quantized_parameters(torch.nn.Linear(2, 2))
    real = _trace(net, fake=False)
    assert _trace(copy).estimate.total == _trace(net).estimate.total == real.estimate.total
    assert net.layers[0][0].weight.quant_state is net.layers[0][0].quant_state and not net.layers[0][0].weight.is_meta


def test_a_calibration_of_quantized_weights_keeps_their_backward_rebuild_once() -> None:
    """``calibrate`` of a quantized module sets ``Calibration.quantized`` (round trip), and the estimate then
    leaves out the backward transient it adds for a calibration of unquantized weights; the forward one
    (inside bitsandbytes' ``gemm_4bit`` op, invisible to a trace) stays."""
    from lightning_memplan.model.activations import LOW_PRECISION_POINT, low_precision_points
    from lightning_memplan.model.result import Calibration
    from lightning_memplan.tracking.meta_copy import meta_copy
    from lightning_memplan.tracking.trace import calibrate

    cal = calibrate(meta_copy(_blocks()), ((1, 16), (2, 16)), optimizer="adamw", optimizer_impl="for_loop",
                    precision="32-true")
    assert cal.quantized and Calibration.from_dict(cal.to_dict()).quantized
    plain = Calibration(coefficients=cal.coefficients)
    assert not plain.quantized and "quantized" not in plain.to_dict()  # older dicts and snapshots unchanged
    zero = dict.fromkeys(("activations", "attention", "logits", "workspace", "other"), 0)
    points = {k: dict(zero) for k in ("forward", "backward_start", "backward_layer", "backward_end")}
    low = SimpleNamespace(scales=0, forward=7, backward=11, head_output=0)
    stage = SimpleNamespace(low=low)
    added = low_precision_points({k: dict(v) for k, v in points.items()}, stage)  # type: ignore[arg-type]
    traced = low_precision_points({k: dict(v) for k, v in points.items()}, stage, traced_backward=True)  # type: ignore[arg-type]
    assert added["backward_layer"]["workspace"] == 11 and traced["backward_layer"]["workspace"] == 0
    assert added[LOW_PRECISION_POINT]["workspace"] == traced[LOW_PRECISION_POINT]["workspace"] == 7


def test_the_tracker_counts_a_quant_state_whose_weight_was_replaced() -> None:
    """FSDP2 replaces a ``Linear4bit``'s ``Params4bit`` by a plain sharded parameter without ``quant_state``;
    the layer keeps it. The tracker counts it from the layer then, once (not twice when both hold it)."""
    from lightning_memplan.tracking import TensorTracker
    from lightning_memplan.tracking.tracker import quantization_constants

    net = _blocks(n=1)
    layer = net.layers[0][0]
    constants = sum(t.untyped_storage().nbytes() for t in quantization_constants(layer.weight))
    assert constants > 0 and quantization_constants(layer) == quantization_constants(layer.weight)

    def params(module: torch.nn.Module) -> int:
        with TensorTracker(module) as tracker:
            torch.zeros(1)
        return tracker.report().current["params"]

    whole = params(net)
    layer.weight = torch.nn.Parameter(layer.weight.data.clone(), requires_grad=False)  # as FSDP2's sharded param
    assert getattr(layer.weight, "quant_state", None) is None
    assert params(net) == whole  # the layer's QuantState, counted once either way


def test_the_planned_train_spec_carries_quantized_weights_and_train_wins() -> None:
    from lightning_memplan.live.low_precision import infer_low_precision, low_precision_fields
    from lightning_memplan.parallel.inputs import compose_train_spec, train_spec_for

    net = _blocks()
    assert low_precision_fields(None, net, "32-true") == {"base_weights": "nf4-dq"}
    trainer = SimpleNamespace(precision_plugin=None, lightning_module=net, precision="32-true",
                              accumulate_grad_batches=1, strategy=None)
    assert infer_low_precision(trainer) == low_precision_fields(None, net, "32-true")  # the callback's reader
    base = TrainSpec(micro_batch=2, seq_len=16)
    planned = train_spec_for(trainer, net, base)
    assert planned.base_weights == "nf4-dq" and (planned.micro_batch, planned.seq_len) == (2, 16)
    kwargs = dict(shape=(2, 16), module=net, precision="32-true", grad_accumulation=1, device="cpu",
                  optimizer=("adamw", "for_loop"), runner="Fabric", low={"base_weights": "nf4-dq"})
    assert compose_train_spec(base=None, **kwargs).base_weights == "nf4-dq"  # type: ignore[arg-type]
    mine = compose_train_spec(base=base.replace(base_weights="nf4"), **kwargs)  # type: ignore[arg-type]
    assert mine.base_weights == "nf4"  # a field the user set wins
    bf16 = compose_train_spec(base=None, **{**kwargs, "low": {"precision": "bf16-true"}})  # type: ignore[arg-type]
    assert bf16.precision == "bf16-true"  # a quantization plugin's compute dtype


def test_the_search_leaves_out_what_quantized_weights_cannot_run_and_says_why() -> None:
    from lightning_memplan.parallel.planner_bridge import low_precision_limits, narrow_allow, run_planner

    train = TrainSpec(micro_batch=1, seq_len=64, base_weights="nf4-dq")
    assert set(low_precision_limits(train)) == {"tp"}
    assert set(low_precision_limits(train.replace(base_weights="int8"))) == {"tp", "zero"}
    assert set(low_precision_limits(TrainSpec(micro_batch=1, seq_len=64, precision="bf16-true", float8="rowwise"))) == {"tp"}
    assert low_precision_limits(TrainSpec(micro_batch=1, seq_len=64)) == {}
    allow = narrow_allow(None, train, set(), has_lce=False, pipeline=False, world=4)
    assert allow.tp == (1,) and allow.sp == (False,) and allow.zero == (0, 2, 3)
    assert narrow_allow(None, train.replace(base_weights="int8"), set(), has_lce=False, pipeline=False).zero == (0,)
    with pytest.raises(ValueError, match="allow restricts tp"):
        narrow_allow({"tp": [2]}, train, set(), has_lce=False, pipeline=False, world=4)
    spec = ModelSpec.preset("llama3-8b").with_lora(rank=16, targets=("q_proj", "v_proj"))
    decision = run_planner(spec, train.replace(micro_batch=1, seq_len=2048, precision="bf16-true"), hardware="h100-80gb",
                           devices=4, num_nodes=1, memory_budget=None, headroom=0.1, allow=None, exclude=set(),
                           has_lce=False)
    assert decision.plan.tp == 1 and all(c.plan.tp == 1 for c in decision.candidates)
    assert any("tensor parallelism not searched: base_weights='nf4-dq'" in n for n in decision.notes)
    assert "tensor parallelism not searched" in decision.explain()


def test_forced_tensor_parallelism_on_quantized_blocks_is_blocked_with_the_reason() -> None:
    from lightning_memplan.live.layouts import find_layout
    from lightning_memplan.parallel.decision import applicability, fold_blocked
    from lightning_memplan.parallel.tensor_parallel import tensor_parallel_blocker

    net = _blocks()
    reason = tensor_parallel_blocker(find_layout(net), net, 2)
    assert reason is not None and "nf4-dq quantized weights" in reason and "not DTensors" in reason
    assert tensor_parallel_blocker(find_layout(net), net, 1) is None
    plan, notes = fold_blocked(ParallelPlan(tp=2), applicability(ParallelPlan(tp=2), find_layout(net), net, self_parallel=False))
    assert plan == ParallelPlan(dp=2) and "not DTensors" in notes[0]


def test_fabric_plans_with_the_same_reader() -> None:
    """Fabric's front door reads the module given to ``fabric.setup`` and its precision plugin through the
    same ``low_precision_fields`` (here a plain ``Precision``: the module says nf4-dq)."""
    from lightning.fabric.plugins import Precision

    from lightning_memplan.fabric.strategy import MemplanAutoFabricStrategy
    from lightning_memplan.parallel.resolve import PlanningOptions

    door = SimpleNamespace(_options=PlanningOptions(train=TrainSpec(micro_batch=2, seq_len=16)),
                           root_device=torch.device("cpu"), precision=Precision())
    train = MemplanAutoFabricStrategy._read_train(door, _blocks(), [])  # type: ignore[arg-type]
    assert train.base_weights == "nf4-dq" and train.precision == "32-true"
