"""The bad-input corpus: every public entry point refuses bad input with a ``ValueError`` or ``TypeError``
whose message names the argument (or the file), within one second (of CPU; wall time is bounded
loosely, the test machine being shared), and accepts nothing silently.

A table (:data:`CASES`, :data:`CLI_CASES`, :data:`FILE_CASES`: generated per kind of value and per
field, plus the specific cases found by hand: hangs, silently wrong numbers, uncaught errors) and a
hypothesis strategy drawing bad values of each kind for each field (the project's hypothesis profile:
fixed examples by default, ``MEMPLAN_HYPOTHESIS=explore`` for new ones, ``MEMPLAN_HYPOTHESIS_SCALE``).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_memplan.callbacks import MemoryPlanCallback
from lightning_memplan.cli import main
from lightning_memplan.hardware import HardwareSpec
from lightning_memplan.loss import LinearCrossEntropy, LossOptions, linear_cross_entropy
from lightning_memplan.model import estimate_memory
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.planning import plan
from lightning_memplan.report.io import load_report
from lightning_memplan.tracking.trace import trace_memory
from lightning_memplan.validation import read_json_file

BOUND_S = 1.0  # every refusal must come within this much CPU time (a linear loop burns CPU) ...
WALL_S = 10.0  # ... and this much wall time (loose: the test machine may be shared by many processes)


class _Clock:
    """CPU and wall time of a block: ``elapsed`` (CPU) is checked against BOUND_S, ``wall`` against WALL_S."""

    def __enter__(self) -> _Clock:
        self._cpu, self._wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.elapsed = time.process_time() - self._cpu
        self.wall = time.perf_counter() - self._wall

    def ok(self) -> bool:
        return self.elapsed < BOUND_S and self.wall < WALL_S
NAN, INF = float("nan"), float("inf")


@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[], Any]
    needle: str  # must appear in the message: the argument's name (with its value) or the file path
    exc: tuple[type[BaseException], ...] = (ValueError, TypeError)


CASES: list[Case] = []


def case(id: str, call: Callable[[], Any], needle: str, exc: tuple[type[BaseException], ...] = (ValueError, TypeError)) -> None:
    CASES.append(Case(id, call, needle, exc))


# ------------------------------------------------------------------------------ valid baselines
MODEL = dict(n_layers=2, hidden=64, n_heads=4, vocab_size=128)
TRAIN = dict(micro_batch=2, seq_len=32)
HW = dict(name="gpu", memory_bytes=2**34)
SMALL = ModelSpec(**MODEL)
SMALL_TRAIN = TrainSpec(**TRAIN)
L4 = HardwareSpec.preset("l4")


def model_with(**kw: Any) -> Callable[[], Any]:
    return lambda: ModelSpec(**{**MODEL, **kw})


def train_with(**kw: Any) -> Callable[[], Any]:
    return lambda: TrainSpec(**{**TRAIN, **kw})


def hw_with(**kw: Any) -> Callable[[], Any]:
    return lambda: HardwareSpec(**{**HW, **kw})


# ------------------------------------------------------------------------- bad values per kind
BAD_SIZES = [0, -1, -(10**12), 2.7, 2.0, True, False, "3", b"3", None, NAN, INF, [2], 1 + 0j]
BAD_OPTIONAL_SIZES = [v for v in BAD_SIZES if v is not None]
BAD_BOOLS = ["no", "False", "True", "", 0, 1, 1.0, None, [True]]
BAD_CHOICES = ["bogus", "", "SDPA ", None, 3, True, ["x"]]
NON_FINITE = [NAN, INF, -INF, "1.0", True, None]

MODEL_SIZES = ["n_layers", "hidden", "n_heads", "vocab_size"]
MODEL_OPTIONAL_SIZES = ["n_kv_heads", "head_dim", "ffn_hidden", "max_positions", "n_params"]
TRAIN_SIZES = ["micro_batch", "seq_len", "grad_accumulation"]
TRAIN_OPTIONAL_SIZES = ["loss_chunk_size", "param_bytes", "grad_bytes", "master_bytes", "activation_bytes"]
PLAN_SIZES = ["dp", "tp", "pp", "cp", "microbatches", "virtual_stages"]
HW_SIZES = ["memory_bytes", "gpus_per_node", "num_nodes"]
HW_SPEEDS = ["peak_flops", "peak_flops_fp32", "intra_node_bw", "inter_node_bw", "memory_bw"]

for field in MODEL_SIZES:
    for v in BAD_SIZES:
        case(f"ModelSpec.{field}={v!r}", model_with(**{field: v}), f"{field}=")
for field in MODEL_OPTIONAL_SIZES:
    for v in BAD_OPTIONAL_SIZES:
        case(f"ModelSpec.{field}={v!r}", model_with(**{field: v}), f"{field}=")
for field in TRAIN_SIZES:
    for v in BAD_SIZES:
        case(f"TrainSpec.{field}={v!r}", train_with(**{field: v}), f"{field}=")
for field in TRAIN_OPTIONAL_SIZES:
    for v in BAD_OPTIONAL_SIZES[:8]:
        case(f"TrainSpec.{field}={v!r}", train_with(**{field: v}), f"{field}=")
for field in PLAN_SIZES:
    for v in BAD_SIZES:
        case(f"ParallelPlan.{field}={v!r}", lambda f=field, v=v: ParallelPlan(**{f: v}), f"{field}=")
for field in HW_SIZES:
    for v in BAD_SIZES[:10]:
        case(f"HardwareSpec.{field}={v!r}", hw_with(**{field: v}), f"{field}=")
for field in HW_SPEEDS:
    for v in [0, -1.0, NAN, INF, "1e12", True]:
        case(f"HardwareSpec.{field}={v!r}", hw_with(**{field: v}), f"{field}=")

for field in ["bias", "tied_embeddings", "qkv_fused"]:
    for v in BAD_BOOLS:
        case(f"ModelSpec.{field}={v!r}", model_with(**{field: v}), f"{field}=")
for field in ["master_weights", "grads_alive_in_forward"]:
    for v in BAD_BOOLS:
        case(f"TrainSpec.{field}={v!r}", train_with(**{field: v}), f"{field}=")
for field in ["sp", "grad_buckets"]:
    for v in BAD_BOOLS:
        case(f"ParallelPlan.{field}={v!r}", lambda f=field, v=v: ParallelPlan(tp=2, **{f: v}), f"{field}=")
for field in ["supports_bf16", "fallback"]:
    for v in BAD_BOOLS[:6]:
        case(f"HardwareSpec.{field}={v!r}", hw_with(**{field: v}), f"{field}=")
for field in ["shift", "validate_targets", "sequence_parallel", "allow_retain_graph"]:
    for v in BAD_BOOLS[:6]:
        case(f"LossOptions.{field}={v!r}", lambda f=field, v=v: LossOptions(**{f: v}), f"{field}=")
for field in ["calibrate", "write_files", "print_report"]:
    for v in BAD_BOOLS:
        case(f"MemoryPlanCallback.{field}={v!r}", lambda f=field, v=v: MemoryPlanCallback(**{f: v}), f"{field}=")

for field in ["ffn_kind", "norm", "position_embedding"]:
    for v in BAD_CHOICES:
        case(f"ModelSpec.{field}={v!r}", model_with(**{field: v}), f"{field}=")
for field in ["precision", "optimizer", "optimizer_impl", "recompute", "attention", "loss", "device", "norm_impl"]:
    for v in BAD_CHOICES:
        case(f"TrainSpec.{field}={v!r}", train_with(**{field: v}), f"{field}=")
for v in BAD_CHOICES:
    case(f"ParallelPlan.schedule={v!r}", lambda v=v: ParallelPlan(schedule=v), "schedule=")
for field in ["reduction", "mode", "backend"]:
    for v in BAD_CHOICES[:5]:
        case(f"LossOptions.{field}={v!r}", lambda f=field, v=v: LossOptions(**{f: v}), f"{field}=")
for v in [4, -1, True, "3", 1.0, None]:
    case(f"ParallelPlan.zero={v!r}", lambda v=v: ParallelPlan(zero=v), "zero=")

# finite numbers in a range
for v in [1.0, 1.5, -0.1, *NON_FINITE]:
    case(f"ModelSpec.dropout={v!r}", model_with(dropout=v), "dropout=")
for v in [0, -1, *NON_FINITE[:5]]:
    case(f"TrainSpec.optimizer_bytes_per_param={v!r}", train_with(optimizer_bytes_per_param=v), "optimizer_bytes_per_param=")
for v in [1.0, -0.1, *NON_FINITE]:
    case(f"LossOptions.label_smoothing={v!r}", lambda v=v: LossOptions(label_smoothing=v), "label_smoothing=")
for v in [-1.0, *NON_FINITE]:
    case(f"LossOptions.z_loss={v!r}", lambda v=v: LossOptions(z_loss=v), "z_loss=")
for v in [0, -30.0, *NON_FINITE[:5]]:
    case(f"LossOptions.softcap={v!r}", lambda v=v: LossOptions(softcap=v), "softcap=")
for v in [0, -5, 2.5, True, "auto-ish", "1024"]:
    case(f"LossOptions.chunk_size={v!r}", lambda v=v: LossOptions(chunk_size=v), "chunk_size=")
for v in [0, -1, 1.5, True, "1GB"]:
    case(f"LossOptions.chunk_budget_bytes={v!r}", lambda v=v: LossOptions(chunk_budget_bytes=v), "chunk_budget_bytes=")
for v in [-0.1, *NON_FINITE]:
    case(f"MemoryPlanCallback.tolerance={v!r}", lambda v=v: MemoryPlanCallback(tolerance=v), "tolerance=")
for v in [1.0, -0.1, NAN, INF, "0.1", True]:
    case(f"MemoryPlanCallback.min_headroom={v!r}", lambda v=v: MemoryPlanCallback(min_headroom=v), "min_headroom=")
for field in ["measure_every_n_steps", "seq_len", "max_seq_len", "memory_budget"]:
    for v in [0, -1, 2.5, True, "8"]:
        case(f"MemoryPlanCallback.{field}={v!r}", lambda f=field, v=v: MemoryPlanCallback(**{f: v}), f"{field}=")
for field, v in [("model_spec", {"n_layers": 2}), ("train_spec", "b=1"), ("plan", "dp=2"), ("units", "GiBs"), ("track_tensors", "yes")]:
    case(f"MemoryPlanCallback.{field}={v!r}", lambda f=field, v=v: MemoryPlanCallback(**{f: v}), f"{field}=")

# plan(): the planner's own arguments
for v in [0, 0.5, -1, INF, NAN, "70GiB", True]:
    case(f"plan.memory_budget={v!r}", lambda v=v: plan(SMALL, SMALL_TRAIN, L4, memory_budget=v), "memory_budget=")
for v in [1.0, -0.1, NAN, INF, "0.1", True]:
    case(f"plan.headroom={v!r}", lambda v=v: plan(SMALL, SMALL_TRAIN, L4, headroom=v), "headroom=")
for v in [0, -4, 2.5, True, "8"]:
    case(f"plan.global_batch={v!r}", lambda v=v: plan(SMALL, SMALL_TRAIN, L4, global_batch=v), "global_batch=")
for v in [0, -1, 1.5, True]:
    case(f"plan.top_k={v!r}", lambda v=v: plan(SMALL, SMALL_TRAIN, L4, top_k=v), "top_k=")
case("plan.model=dict", lambda: plan(MODEL, SMALL_TRAIN, L4), "model=")
case("plan.train=dict", lambda: plan(SMALL, TRAIN, L4), "train=")
case("plan.hardware=str", lambda: plan(SMALL, SMALL_TRAIN, "h100"), "hardware=")

# estimate_memory
for v in [1.5, True, "0", -1, 99]:
    case(f"estimate_memory.rank={v!r}", lambda v=v: estimate_memory(SMALL, SMALL_TRAIN, rank=v), "rank=")
case("estimate_memory.plan=dict", lambda: estimate_memory(SMALL, SMALL_TRAIN, {"dp": 2}), "plan=")
case("estimate_memory.model=None", lambda: estimate_memory(None, SMALL_TRAIN), "model=")
case("estimate_memory.calibration=str", lambda: estimate_memory(SMALL, SMALL_TRAIN, calibration="fit"), "calibration=")
case("estimate_memory cp=2 eager", lambda: estimate_memory(SMALL, TrainSpec(**TRAIN, attention="eager"), ParallelPlan(cp=2)), "cp=2")
case("estimate_memory tp=3", lambda: estimate_memory(SMALL, SMALL_TRAIN, ParallelPlan(tp=3)), "tp=3")
case("estimate_memory pp=9", lambda: estimate_memory(SMALL, SMALL_TRAIN, ParallelPlan(pp=9)), "pp=9")
# 1F1B with fewer micro-batches than stages cannot run (torch Schedule1F1B); ParallelPlan's default m=1
case("estimate_memory pp=2 1f1b m=1", lambda: estimate_memory(SMALL, SMALL_TRAIN, ParallelPlan(pp=2)), "microbatches=1")
case("estimate_memory pp=2 1f1b m=1 rank=1",
     lambda: estimate_memory(SMALL, SMALL_TRAIN, ParallelPlan(pp=2, microbatches=1), rank=1), "microbatches>=2")
case("plan pp=2 1f1b only m=1", lambda: plan(SMALL, SMALL_TRAIN, HardwareSpec.preset("l4", gpus_per_node=2),
                                            allow={"pp": [2], "schedule": ["1f1b"], "micro_batch": [2]}), "microbatches=1")

# inconsistent plans no layout can run
case("ParallelPlan interleaved pp=1", lambda: ParallelPlan(schedule="interleaved"), "schedule='interleaved'")
case("ParallelPlan v=3 pp=1", lambda: ParallelPlan(schedule="interleaved", virtual_stages=3), "pp > 1")
case("ParallelPlan v=2 1f1b", lambda: ParallelPlan(pp=2, virtual_stages=2, microbatches=2), "virtual_stages=2")
case("ParallelPlan pp=4 m=2 interleaved", lambda: ParallelPlan(pp=4, microbatches=2, schedule="interleaved", virtual_stages=2), "microbatches=2")
case("ParallelPlan sp without tp", lambda: ParallelPlan(sp=True), "sp=True")
# FSDP2 reshard_after_forward: an int is a non-trivial divisor of the shard size, ZeRO-3, no TP
case("ParallelPlan raf=2 zero=2", lambda: ParallelPlan(dp=4, zero=2, reshard_after_forward=2), "needs zero=3")
case("ParallelPlan raf=3 dp=4", lambda: ParallelPlan(dp=4, zero=3, reshard_after_forward=3), "use one of [2]")
case("ParallelPlan raf=4 dp=4", lambda: ParallelPlan(dp=4, zero=3, reshard_after_forward=4), "reshard_after_forward=4")
case("ParallelPlan raf=2 dp=2", lambda: ParallelPlan(dp=2, zero=3, reshard_after_forward=2), "use True")
case("ParallelPlan raf=1", lambda: ParallelPlan(dp=4, zero=3, reshard_after_forward=1), "reshard_after_forward=1")
case("ParallelPlan raf=2.0", lambda: ParallelPlan(dp=4, zero=3, reshard_after_forward=2.0), "reshard_after_forward=2.0")
case("ParallelPlan raf='2'", lambda: ParallelPlan(dp=4, zero=3, reshard_after_forward="2"), "reshard_after_forward='2'")
case("ParallelPlan raf=2 tp=2", lambda: ParallelPlan(dp=4, tp=2, zero=3, reshard_after_forward=2), "needs tp=1")
case("ParallelPlan raf=False zero=3", lambda: ParallelPlan(dp=4, zero=3, reshard_after_forward=False), "set zero=2")
case("ParallelPlan raf=True zero=0", lambda: ParallelPlan(dp=4, reshard_after_forward=True), "set zero=3")

# bounded time: values whose divisors used to be enumerated linearly
case("hang hidden=1e9+1", lambda: ModelSpec(2, 10**9 + 1, 2, 100), "n_heads=2")
case("hang hidden=1e12", lambda: ModelSpec(2, 10**12, 7, 100), "n_heads=7")
case("hang n_heads=2**40 kv=3", lambda: ModelSpec(2, 2**40, 2**40, 100, n_kv_heads=3), "n_kv_heads=3")
case("hang hidden=2**61-1", lambda: ModelSpec(2, 2**61 - 1, 2**31, 100), "n_heads=")
case("hang estimate tp=3 heads=2**31",
     lambda: estimate_memory(ModelSpec(2, 2**31, 2**31, 100, head_dim=1), TrainSpec(**TRAIN), ParallelPlan(tp=3)), "tp=3")

# HardwareSpec constructors
case("HardwareSpec.from_dict({})", lambda: HardwareSpec.from_dict({}), "from_dict")
case("HardwareSpec.from_dict(name only)", lambda: HardwareSpec.from_dict({"name": "x"}), "memory_bytes")
case("HardwareSpec.from_dict(unknown key)", lambda: HardwareSpec.from_dict({**HW, "bogus": 1}), "bogus")
case("HardwareSpec.from_dict(5)", lambda: HardwareSpec.from_dict(5), "from_dict")
case("HardwareSpec.from_dict(str memory)", lambda: HardwareSpec.from_dict({"name": "x", "memory_bytes": "80GB"}), "memory_bytes=")
case("HardwareSpec.preset unknown", lambda: HardwareSpec.preset("h300"), "h300")
case("HardwareSpec.preset 5", lambda: HardwareSpec.preset(5), "name=")
case("HardwareSpec.preset gpus=0", lambda: HardwareSpec.preset("l4", gpus_per_node=0), "gpus_per_node=")
case("HardwareSpec name=''", lambda: HardwareSpec("", 2**30), "name=")
case("HardwareSpec source=5", lambda: HardwareSpec("x", 2**30, source=5), "source=")

# MemoryPlanCallback.load_state_dict: a checkpoint's bad state is a warning, not an error (a resumed run never
# ends in the package): test_checkpoint_state_is_dropped_with_one_warning below
BAD_STATES = [("report=5", {"report": 5}), ("epochs=5", {"report": {"format_version": 1, "epochs": 5}}),
              ("epochs=[{}]", {"report": {"format_version": 1, "epochs": [{}]}}), ("list", [1])]

# Hugging Face configs and modules
HF = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, model_type="llama")
for key, v in [("num_hidden_layers", 2.7), ("num_hidden_layers", True), ("num_hidden_layers", "2"), ("hidden_size", 0),
               ("hidden_size", 64.5), ("num_attention_heads", None), ("vocab_size", -1), ("num_key_value_heads", 1.5),
               ("intermediate_size", "big"), ("max_position_embeddings", 1.5), ("head_dim", True),
               ("attention_dropout", 1.5), ("attention_dropout", NAN), ("attention_dropout", "0.1"), ("tie_word_embeddings", "false")]:
    case(f"from_hf_config {key}={v!r}", lambda k=key, v=v: ModelSpec.from_hf_config({**HF, k: v}), key)
case("from_hf_config missing", lambda: ModelSpec.from_hf_config({"model_type": "llama"}), "missing")
case("from_hf_config 5", lambda: ModelSpec.from_hf_config(5), "config")
case("from_module nn.Module()", lambda: ModelSpec.from_module(nn.Module()), "module=")
case("from_module str", lambda: ModelSpec.from_module("gpt2"), "module=")
case("ModelSpec.preset unknown", lambda: ModelSpec.preset("gpt5"), "gpt5")
case("ModelSpec hf_config=5", lambda: ModelSpec(**MODEL, hf_config=5), "hf_config=")
case("ModelSpec learned without max_positions", lambda: ModelSpec(**MODEL, position_embedding="learned"), "max_positions=")
case("ModelSpec n_kv_heads=3", lambda: ModelSpec(**MODEL, n_kv_heads=3), "n_kv_heads=3")

# trace_memory
_LINEAR = nn.Linear(4, 4)
case("trace_memory steps=0", lambda: trace_memory(_LINEAR, torch.randn(2, 4), steps=0), "steps=")
case("trace_memory steps=1.5", lambda: trace_memory(_LINEAR, torch.randn(2, 4), steps=1.5), "steps=")
case("trace_memory both inputs", lambda: trace_memory(_LINEAR, torch.randn(2, 4), batch_shape=(1, 4)), "batch_shape=")
case("trace_memory no input", lambda: trace_memory(_LINEAR), "example_input=")
case("trace_memory grads_alive=str", lambda: trace_memory(_LINEAR, torch.randn(2, 4), grads_alive_in_forward="no"), "grads_alive_in_forward=")
case("trace_memory device=mps", lambda: trace_memory(_LINEAR, torch.randn(2, 4), device="meta"), "device=")
case("trace_memory optimizer_impl", lambda: trace_memory(_LINEAR, torch.randn(2, 4), optimizer_impl="fast"), "optimizer_impl=")
case("trace_memory precision", lambda: trace_memory(_LINEAR, torch.randn(2, 4), precision="fp8"), "precision=")

# the loss: tensors and options
H, W = torch.randn(4, 8), torch.randn(10, 8)
T_OK = torch.tensor([1, 2, 3, 4])
for mode in ("naive", "fp32_upcast", "chunked", "auto"):
    for bad in (10, 10**6, -5):
        target = torch.tensor([1, 2, 3, bad])
        case(f"linear_cross_entropy target={bad} mode={mode}", lambda t=target, m=mode: linear_cross_entropy(H, W, t, mode=m), "target")
    case(f"linear_cross_entropy weight on meta mode={mode}", lambda m=mode: linear_cross_entropy(H, W.to("meta"), T_OK, mode=m), "weight")
    case(f"linear_cross_entropy target on meta mode={mode}", lambda m=mode: linear_cross_entropy(H, W, T_OK.to("meta"), mode=m), "target")
    case(f"linear_cross_entropy hidden on meta mode={mode}", lambda m=mode: linear_cross_entropy(H.to("meta"), W, T_OK, mode=m), "hidden")
case("linear_cross_entropy process_group='abc'", lambda: linear_cross_entropy(H, W, T_OK, process_group="abc"), "process_group=")
case("linear_cross_entropy hidden=list", lambda: linear_cross_entropy([1.0], W, T_OK), "hidden")
case("linear_cross_entropy target float", lambda: linear_cross_entropy(H, W, T_OK.float()), "target")
case("linear_cross_entropy target shape", lambda: linear_cross_entropy(H, W, T_OK[:3]), "target")
case("linear_cross_entropy weight shape", lambda: linear_cross_entropy(H, torch.randn(10, 7), T_OK), "weight")
case("linear_cross_entropy z_loss=nan", lambda: linear_cross_entropy(H, W, T_OK, z_loss=NAN), "z_loss=")
case("linear_cross_entropy softcap=inf", lambda: linear_cross_entropy(H, W, T_OK, softcap=INF), "softcap=")
case("linear_cross_entropy vocab_parallel alone", lambda: linear_cross_entropy(H, W, T_OK, mode="vocab_parallel"), "vocab_parallel")
case("LinearCrossEntropy unknown option", lambda: LinearCrossEntropy(chunksize=3), "chunksize")
case("LinearCrossEntropy return_metrics='no'", lambda: LinearCrossEntropy(return_metrics="no"), "return_metrics=")
case("LinearCrossEntropy z_loss=inf", lambda: LinearCrossEntropy(z_loss=INF), "z_loss=")
case("LinearCrossEntropy target=10", lambda: LinearCrossEntropy()(H, W, torch.tensor([1, 2, 3, 10])), "target")
case("LossOptions ignore_index=1.5", lambda: LossOptions(ignore_index=1.5), "ignore_index=")
case("LossOptions ignore_index=True", lambda: LossOptions(ignore_index=True), "ignore_index=")
case("LossOptions accum_dtype=int", lambda: LossOptions(accum_dtype=torch.int64), "accum_dtype=")
case("LossOptions sequence_parallel naive", lambda: LossOptions(sequence_parallel=True, mode="naive"), "sequence_parallel=True")


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_by_name_in_bounded_time(c: Case) -> None:
    with _Clock() as clock, pytest.raises(c.exc) as err:
        c.call()
    assert clock.ok(), f"{c.id}: took {clock.elapsed:.2f} s CPU, {clock.wall:.2f} s wall"
    message = str(err.value)
    assert c.needle in message, f"{c.id}: the message does not name {c.needle!r}: {message!r}"


# ---------------------------------------------------------------------------------- the CLI
def _files(root: Path) -> dict[str, Path]:
    bad = {
        "inf.json": b'{"num_hidden_layers": 2, "hidden_size": Infinity, "num_attention_heads": 2, "vocab_size": 10}',
        "big.json": b'{"num_hidden_layers": 2, "hidden_size": 1e400, "num_attention_heads": 2, "vocab_size": 10}',
        "nan.json": b'{"num_hidden_layers": NaN, "hidden_size": 64, "num_attention_heads": 2, "vocab_size": 10}',
        "empty.json": b"",
        "latin1.json": b'{"name": "caf\xe9"}',
        "deep.json": b"[" * 100_000 + b"]" * 100_000,
        "list.json": b"[1, 2]",
        "layers.json": b'{"num_hidden_layers": 2.7, "hidden_size": 64, "num_attention_heads": 2, "vocab_size": 10}',
        "bool.json": b'{"num_hidden_layers": true, "hidden_size": 64, "num_attention_heads": 2, "vocab_size": 10}',
        "missing.json": b'{"hidden_size": 64}',
        "torn.json": b'{"num_hidden_layers": 2, "hid',
        "report-epoch.json": b'{"format_version": 1, "epochs": [{}]}',
        "report-int.json": b'{"format_version": 1, "epochs": 5}',
        "report-none.json": b'{"format_version": 1}',
        "report-types.json": b'{"format_version": 1, "epochs": [{"epoch": "x", "ranks": 3}]}',
        "report-version.json": b'{"format_version": 99, "epochs": []}',
    }
    out = {}
    for name, data in bad.items():
        (root / name).write_bytes(data)
        out[name] = root / name
    return out


PLAN = ["plan", "--model", "gpt2", "--hardware", "l4", "--seq-len", "128"]
EST = ["estimate", "--model", "gpt2", "--seq-len", "128"]
CLI_CASES: list[tuple[str, list[str], str]] = []
for flag, values in [("--gpus-per-node", ["0", "-1", "x", "2.5"]), ("--nodes", ["0", "x"]), ("--top", ["-1", "0", "x"]),
                     ("--memory-budget", ["1e400", "abc", "3 parsecs", "0"]), ("--headroom", ["nan", "inf", "x", "1.5"]),
                     ("--global-batch", ["0", "1.5"]), ("--inter-node-bw", ["nan", "x"]), ("--micro-batch", ["0", "x"]),
                     ("--seq-len", ["0", "-3"]), ("--grad-accumulation", ["0"]), ("--loss-chunk-size", ["0"]),
                     ("--allow", ["tp=two", "sp=maybe"])]:
    for v in values:
        needle = {"--memory-budget": "memory", "--headroom": "headroom", "--global-batch": "global", "--allow": "--allow"}.get(flag, flag)
        CLI_CASES.append((f"plan {flag} {v}", PLAN + [flag, v], needle))
for flag, values in [("--tp", ["0", "x"]), ("--dp", ["-1"]), ("--pp", ["0"]), ("--cp", ["0"]), ("--rank", ["-1", "x", "99"]),
                     ("--microbatches", ["0"]), ("--virtual-stages", ["0"]), ("--zero", ["4", "x"]),
                     ("--precision", ["fp8"]), ("--optimizer", ["rmsprop"])]:
    for v in values:
        CLI_CASES.append((f"estimate {flag} {v}", EST + [flag, v], "rank=" if (flag, v) == ("--rank", "99") else flag))
CLI_CASES += [
    ("estimate unknown model", ["estimate", "--model", "gpt5", "--seq-len", "8"], "gpt5"),
    ("estimate missing file", ["estimate", "--model", "nope/config.json", "--seq-len", "8"], "nope/config.json"),
    ("estimate bad import", ["estimate", "--model", "no_such_pkg.mod:Cls", "--seq-len", "8"], "no_such_pkg"),
    ("estimate bad kwargs", ["estimate", "--model", "torch.nn:Linear", "--model-kwargs", "{x", "--seq-len", "8"], "--model-kwargs"),
    ("estimate sp without tp", EST + ["--sp"], "sp=True"),
    ("estimate pp=4 1f1b m=1", EST + ["--pp", "4", "--microbatches", "1"], "microbatches=1"),
    ("plan unknown hardware", PLAN[:4] + ["h300", "--seq-len", "8"], "h300"),
    ("report missing", ["report", "/nonexistent/memory_report.json"], "/nonexistent"),
]
FILE_NAMES = ["inf.json", "big.json", "nan.json", "empty.json", "latin1.json", "deep.json", "list.json", "layers.json",
              "bool.json", "missing.json", "torn.json"]
REPORT_NAMES = ["report-epoch.json", "report-int.json", "report-none.json", "report-types.json", "report-version.json",
                "empty.json", "deep.json", "latin1.json", "torn.json", "list.json"]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    files = _files(tmp_path_factory.mktemp("bad_files"))
    main(["estimate", "--model", "gpt2", "--seq-len", "8", "--json"])  # warm the lazy imports, outside the bound
    return files


def _run_cli(argv: list[str]) -> tuple[int, str, float]:
    err, out = io.StringIO(), io.StringIO()
    with _Clock() as clock, contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(argv)
    return code, err.getvalue(), clock.elapsed if clock.wall < WALL_S else WALL_S


@pytest.mark.parametrize(("argv", "needle"), [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_refuses_bad_flags_by_name(bad_files, argv, needle):
    code, err, elapsed = _run_cli(argv)
    assert code == 2, f"accepted (status {code}): {argv}"
    assert needle in err, err
    assert "Traceback" not in err and elapsed < BOUND_S, (elapsed, err)


@pytest.mark.parametrize("name", FILE_NAMES)
def test_cli_refuses_a_bad_config_file_naming_it(bad_files, name):
    path = bad_files[name]
    code, err, elapsed = _run_cli(["estimate", "--model", str(path), "--seq-len", "8"])
    assert code == 2 and str(path) in err and "Traceback" not in err, err
    assert elapsed < BOUND_S


@pytest.mark.parametrize("name", REPORT_NAMES)
def test_a_bad_report_file_is_refused_naming_it(bad_files, name):
    path = bad_files[name]
    code, err, elapsed = _run_cli(["report", str(path)])
    assert code == 2 and str(path) in err and "Traceback" not in err, err
    assert elapsed < BOUND_S
    with _Clock() as clock, pytest.raises(ValueError, match="path=") as exc:
        load_report(path)
    assert str(path) in str(exc.value) and clock.ok()


@pytest.mark.parametrize("name", FILE_NAMES)
def test_read_json_file_names_the_file(bad_files, name):
    path = bad_files[name]
    if name in ("list.json", "layers.json", "bool.json", "missing.json"):
        read_json_file(path)  # valid JSON: the callers refuse what it holds (see the CLI test above)
        return
    with pytest.raises(ValueError) as exc:
        read_json_file(path, what="a config.json")
    assert str(path) in str(exc.value)


@pytest.mark.parametrize(("label", "state"), BAD_STATES, ids=[label for label, _ in BAD_STATES])
def test_checkpoint_state_is_dropped_with_one_warning(label, state):
    callback = MemoryPlanCallback()
    with pytest.warns(UserWarning, match="load_state_dict") as caught:
        callback.load_state_dict(state)
    assert len(caught) == 1 and callback.report.epochs == () and callback.state_dict()["batches_seen"] == 0


def test_cli_help_says_that_pkg_module_class_runs_code():
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        main(["estimate", "--help"])
    text = " ".join(out.getvalue().split())
    assert "SECURITY" in text and "runs its code" in text
    docs = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    assert "**Security:**" in docs and "runs" in docs


def test_the_corpus_is_large():
    total = len(CASES) + len(CLI_CASES) + len(FILE_NAMES) + len(REPORT_NAMES)
    assert total >= 300, total


# ------------------------------------------------------------------------- property: any bad value
hyp = pytest.importorskip("hypothesis", reason="hypothesis is in the dev extra")
st = hyp.strategies


def _not_a_size(value: Any) -> bool:
    return not (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


bad_size = st.one_of(
    st.integers(max_value=0),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=4),
    st.none(),
    st.lists(st.integers(1, 4), max_size=2),
).filter(_not_a_size)
bad_bool = st.one_of(st.text(max_size=6), st.integers(), st.floats(allow_nan=True), st.none())
bad_finite = st.one_of(
    st.sampled_from([NAN, INF, -INF]), st.text(max_size=4), st.booleans(), st.complex_numbers(allow_nan=False).filter(lambda z: z.imag != 0)
)

TARGETS: list[tuple[str, Callable[..., Any], str, Any]] = (
    [(f"ModelSpec.{f}", model_with, f, bad_size) for f in MODEL_SIZES]
    + [(f"ModelSpec.{f}", model_with, f, bad_size.filter(lambda v: v is not None)) for f in MODEL_OPTIONAL_SIZES]
    + [(f"TrainSpec.{f}", train_with, f, bad_size) for f in TRAIN_SIZES]
    + [(f"HardwareSpec.{f}", hw_with, f, bad_size) for f in HW_SIZES]
    + [(f"ModelSpec.{f}", model_with, f, bad_bool) for f in ("bias", "tied_embeddings", "qkv_fused")]
    + [(f"TrainSpec.{f}", train_with, f, bad_bool) for f in ("master_weights", "grads_alive_in_forward")]
    + [(f"HardwareSpec.{f}", hw_with, f, bad_finite) for f in HW_SPEEDS]
    + [("ModelSpec.dropout", model_with, "dropout", st.one_of(bad_finite, st.floats(min_value=1.0), st.floats(max_value=-1e-9)))]
    + [("TrainSpec.optimizer_bytes_per_param", train_with, "optimizer_bytes_per_param", st.one_of(bad_finite, st.floats(max_value=0.0)))]
    + [(f"LossOptions.{f}", lambda **kw: (lambda: LossOptions(**kw)), f, bad_finite) for f in ("label_smoothing", "z_loss")]
    + [(f"ParallelPlan.{f}", lambda **kw: (lambda: ParallelPlan(**kw)), f, bad_size) for f in PLAN_SIZES]
    + [(f"ParallelPlan.{f}", lambda **kw: (lambda: ParallelPlan(tp=2, **kw)), f, bad_bool) for f in ("sp", "grad_buckets")]
    + [(f"MemoryPlanCallback.{f}", lambda **kw: (lambda: MemoryPlanCallback(**kw)), f, bad_bool) for f in ("calibrate", "write_files", "print_report")]
)


@st.composite
def bad_call(draw: Any) -> tuple[str, Callable[[], Any], str, Any]:
    label, make, field, values = draw(st.sampled_from(TARGETS))
    value = draw(values)
    return label, make(**{field: value}), field, value


@hyp.settings(max_examples=300 * int(os.environ.get("MEMPLAN_HYPOTHESIS_SCALE", "1")))
@hyp.given(bad_call())
def test_any_bad_value_of_any_field_is_refused_by_name(drawn):
    label, call, field, value = drawn
    with _Clock() as clock, pytest.raises((ValueError, TypeError)) as err:
        call()
    assert clock.ok(), (label, value, clock.elapsed, clock.wall)
    assert f"{field}=" in str(err.value), (label, value, str(err.value))


def test_bounded_divisor_search_is_exact_when_small_and_honest_when_large():
    from lightning_memplan.validation import MAX_DIVISOR_SEARCH, divisor_hint, divisors

    assert divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(1) == [1] and divisors(97) == [1, 97]
    assert divisors(MAX_DIVISOR_SEARCH**2) is not None and divisors((MAX_DIVISOR_SEARCH + 1) ** 2) is None
    assert all(10**10 % d == 0 for d in divisors(10**10) or [])
    assert divisor_hint(10**30) == f"a divisor of {10**30}" and math.isqrt(10**30) > MAX_DIVISOR_SEARCH
