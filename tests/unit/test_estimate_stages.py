"""The estimate as a pipeline of named stages (issue 34): each stage takes resolved records, never a
``TrainSpec``; its records hold published figures; the public ``estimate_stage`` is what the tracer uses.

The byte-for-byte check of the whole pipeline against the tree before it is
``tests/unit/test_estimate_snapshot.py``.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from lightning_memplan.model import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.model.comm_buffers import comm_buffers
from lightning_memplan.model.estimate import estimate_memory, estimate_stage
from lightning_memplan.model.resolve import resolve_stage
from lightning_memplan.model.sizes import kernels_of, precision_bytes
from lightning_memplan.model.states import stage_states

MODEL = Path(__file__).resolve().parents[2] / "lightning_memplan" / "model"
#: The stages after the first and the term modules: what they take is resolved.
_NO_TRAINSPEC = ("terms.py", "checkpointing.py", "moe_terms.py", "states.py", "comm_buffers.py", "activations.py",
                 "assemble.py", "stage_layout.py", "deepspeed.py", "low_precision.py", "quantized.py", "float8.py")


@pytest.mark.parametrize("name", _NO_TRAINSPEC)
def test_terms_and_later_stages_take_no_trainspec(name: str) -> None:
    """No function of these modules has a ``TrainSpec`` parameter, and none imports the class: the element
    sizes and kernels are resolved once (``model/sizes.py``, ``model/resolve.py``)."""
    tree = ast.parse((MODEL / name).read_text(encoding="utf-8"))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            bad += [f"{node.name}({a.arg})" for a in args
                    if a.annotation is not None and "TrainSpec" in ast.unparse(a.annotation)]
        if isinstance(node, ast.ImportFrom):
            bad += [f"imports {alias.name}" for alias in node.names if alias.name == "TrainSpec"]
    assert not bad, f"model/{name}: {bad}"


def test_the_element_size_helper_is_called_in_one_place_of_the_estimate() -> None:
    """``precision_bytes(train)`` is called by the resolvers of ``model/sizes.py`` and by the entry points
    that take a ``TrainSpec`` outside the training estimate (the checkpoint and reserved estimates), not by
    a term: 36 calls in model/ before issue 34."""
    calls = {}
    for path in sorted(MODEL.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        n = sum(1 for node in ast.walk(tree) if isinstance(node, ast.Call)
                and ast.unparse(node.func).split(".")[-1] == "precision_bytes")
        if n:
            calls[path.name] = n
    assert calls == {"sizes.py": 2, "checkpoint_estimate.py": 1, "reserved.py": 2}, calls


def test_states_reproduce_the_zero_paper_figure_1() -> None:
    """Rajbhandari et al. 2020 (arXiv 1910.02054) Fig. 1: 7.5B parameters on 64 data-parallel ranks, mixed
    precision Adam (2 + 2 + K bytes, K = 12: fp32 master 4 + two fp32 states 8): P_os 31.4 GB per rank,
    P_os+g+p 1.9 GB. ``bf16-true`` with ``master_weights=True`` is that layout; ZeRO-1 shards the K N,
    ZeRO-3 (FSDP2) all of it."""
    model = ModelSpec(32, 4096, 32, 32000, ffn_kind="swiglu", ffn_hidden=11008, n_params=7_500_000_000)
    train = TrainSpec(micro_batch=1, seq_len=1024, precision="bf16-true", master_weights=True)
    want = {1: 31.4e9, 3: 1.9e9}
    for zero, total in want.items():
        plan = ParallelPlan(dp=64, zero=zero)
        r = resolve_stage(model, train, plan, 0)
        assert r.params.local == 7_500_000_000
        states = stage_states(model, r, plan)
        got = states.params + states.grads + states.optimizer + states.master
        assert got == pytest.approx(total, rel=0.02), zero
    zero3 = stage_states(model, resolve_stage(model, train, ParallelPlan(dp=64, zero=3), 0), ParallelPlan(dp=64, zero=3))
    assert (zero3.params, zero3.optimizer, zero3.master) == (
        math.ceil(2 * 7.5e9 / 64), math.ceil(8 * 7.5e9 / 64), math.ceil(4 * 7.5e9 / 64))


def test_ddp_buckets_mirror_every_gradient() -> None:
    """DDP's buckets are a second flat copy of the gradients (``gradient_as_bucket_view=False``, PyTorch's
    and Lightning's default): the communication stage holds exactly the states stage's gradient bytes,
    for the whole step."""
    model, train, plan = ModelSpec.preset("gpt2"), TrainSpec(micro_batch=2, seq_len=1024), ParallelPlan(dp=4)
    r = resolve_stage(model, train, plan, 0)
    states = stage_states(model, r, plan)
    comm = comm_buffers(model, r, plan, states)
    assert comm.static == states.grads == r.params.local * 4  # bf16-mixed: fp32 gradients
    assert comm.forward == comm.backward == 0


def test_resolve_reads_the_element_sizes_once() -> None:
    """The resolved stage carries the step's kernels and element sizes (the records ``kernels_of`` and
    ``precision_bytes`` return, cached by the spec), the tokens of one rank's micro-batch (the sequence
    split by context parallelism) and the dataloader batch of a pipeline rank (m micro-batches)."""
    model = ModelSpec.preset("llama3-8b")
    train = TrainSpec(micro_batch=2, seq_len=4096, attention="eager", recompute="full")
    r = resolve_stage(model, train, ParallelPlan(dp=2, cp=2, zero=3), 0)
    assert r.kernels is kernels_of(train) and r.sizes is precision_bytes(train)
    assert (r.b, r.s, r.tokens, r.shard) == (2, 2048, 4096, 4)
    piped = resolve_stage(model, train, ParallelPlan(pp=4, microbatches=8), 3)
    assert piped.batch_tokens == 2 * 4096 * 8 and piped.layout.has_head and not piped.layout.has_embedding


@pytest.mark.parametrize("plan", [ParallelPlan(), ParallelPlan(dp=8, zero=3), ParallelPlan(pp=4, microbatches=8),
                                  ParallelPlan(dp=4, zero=3)])
def test_estimate_stage_is_the_rank_estimate(plan: ParallelPlan) -> None:
    """``estimate_stage`` (public: the tracer passes it to the traced scaling) is ``estimate_memory`` of the
    first rank of each stage, and the worst of them is ``estimate_memory(rank=None)``."""
    model, train = ModelSpec.preset("llama3-8b"), TrainSpec(micro_batch=1, seq_len=2048, loss="chunked")
    per_stage = plan.dp * plan.cp * plan.tp
    stages = [estimate_stage(model, train, plan, stage, stage * per_stage) for stage in range(plan.pp)]
    for stage, est in enumerate(stages):
        assert est.to_dict() == estimate_memory(model, train, plan, rank=stage * per_stage).to_dict()
    assert max(stages, key=lambda e: e.total).to_dict() == estimate_memory(model, train, plan).to_dict()


def test_the_tracer_uses_the_public_stage_estimate() -> None:
    tree = ast.parse((MODEL.parent / "tracking" / "hf_trace.py").read_text(encoding="utf-8"))
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and node.module == "lightning_memplan.model.estimate" for alias in node.names}
    assert names == {"estimate_stage"}


@pytest.mark.parametrize("plan", [ParallelPlan(), ParallelPlan(dp=8, zero=3)])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_calibration_under_activation_offloading_scales_like_the_analytic_terms(plan: ParallelPlan,
                                                                                 attention: str) -> None:
    """A calibration that reproduces the analytic one-device step exactly (its coefficients are that step's
    bytes) gives the analytic estimate under activation offloading too, forward and backward: the traced
    step has no offloaded block's point (``forward_block``), which stays analytic. 223c039 raised
    ``KeyError: 'forward_block'`` here."""
    from lightning_memplan.model.activations import activation_points
    from lightning_memplan.model.result import Calibration

    model = ModelSpec.preset("gpt2")
    train = TrainSpec(micro_batch=2, seq_len=1024, attention=attention, offload_activations=True)
    single = activation_points(model, resolve_stage(model, train.replace(offload_activations=False), ParallelPlan(), 0),
                               ParallelPlan())
    points = {"forward": "forward", "backward": "backward_start", "optimizer": "optimizer"}
    calibration = Calibration(coefficients={
        phase: {comp: (float(value), 0.0, 0.0) for comp, value in single[point].items()}
        for phase, point in points.items()})
    analytic = estimate_memory(model, train, plan)
    calibrated = estimate_memory(model, train, plan, calibration=calibration)
    assert calibrated.source == "calibrated"
    for phase in ("forward", "backward"):
        assert calibrated.by_phase[phase] == analytic.by_phase[phase], phase
    # a calibrated optimizer phase holds the traced step's temporaries instead of the analytic ones
    opt_ws = analytic.details["optimizer_workspace"]
    assert calibrated.by_phase["optimizer"] == dict(analytic.by_phase["optimizer"],
                                                    workspace=analytic.by_phase["optimizer"]["workspace"] - opt_ws)
