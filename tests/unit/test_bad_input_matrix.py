"""The bad-input matrix (issue 23, "must show", second bullet): every public entry point x every numeric or
bool argument x {a NumPy int, a NumPy float, a 0-d tensor, ``"true"``/``"false"``, ``2**80``, ``-1``,
``nan``, ``inf``, ``None``} answers in bounded time, either

- refused with a ``ValueError``/``TypeError`` whose message names the argument (``name=``) and shows the
  value, or
- accepted, where the value is valid for the argument (its docstring decides: ``None`` for an optional,
  ``-1`` where it is allowed, ``2**80`` where there is no upper bound): a NumPy scalar or a 0-d tensor is
  converted at the door (``validation.plain_scalar``), so what the entry point stores is a plain Python
  ``int``/``float``/``bool``. A float-valued scalar is never an int, an int never a bool, and a string
  never a truth value.

The cases are generated from one table of arguments (:data:`ARGS`), with ids such as
``TrainSpec.micro_batch-np.int64``. Each call runs in a worker thread joined for :data:`HANG_GUARD_S`
(a hang guard: a loop linear in ``2**80`` never ends) and its CPU time is bounded by :data:`BOUND_S` (the
issue's "< 2 s"; the test machine may be shared, so wall time is only guarded). Heavy first-use costs
(imports, the first fake-tensor trace, the Fabric) are paid once by the ``warm`` fixture, outside the bound.
``tests/unit/test_bad_input.py`` holds the hand-found corpus and the CLI; this file is the systematic grid.
"""

from __future__ import annotations

import functools
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from lightning_memplan.callbacks import MemoryPlanBatchSizeFinder, MemoryPlanCallback
from lightning_memplan.hardware import HardwareSpec
from lightning_memplan.loss import LinearCrossEntropy, linear_cross_entropy
from lightning_memplan.model import estimate_memory
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.planning import max_micro_batch, max_seq_len, plan
from lightning_memplan.tracking.trace import calibrate, trace_memory

np = pytest.importorskip("numpy")

HANG_GUARD_S = 10.0  # wall-clock hang guard per call (a loop linear in 2**80 never ends)
BOUND_S = 2.0  # CPU seconds per call (the bound on an answer)
NAN, INF, HUGE = float("nan"), float("inf"), 2**80

ACCEPTED, REFUSED, EITHER = "accepted", "refused", "either"
_PLAIN = {"int": int, "float": float, "bool": bool}


@dataclass(frozen=True)
class Arg:
    """One numeric or bool argument of one entry point, and what its docstring says is valid.

    ``call(value)`` passes ``value`` as that argument (everything else valid); ``read(result)`` is what the
    entry point kept of it (``None``: it keeps nothing to read). ``ok`` is a valid plain value of ``kind``
    (the NumPy and tensor cases wrap it; a float argument's NumPy-int case wraps ``int_ok``).
    """

    where: str
    name: str
    kind: str  # "int", "float" or "bool"
    ok: Any
    call: Callable[[Any], Any]
    read: Callable[[Any], Any] | None = None
    optional: bool = False  # None is valid
    negative: bool = False  # -1 is valid
    huge: str = EITHER  # 2**80: ACCEPTED (no upper bound), REFUSED (a documented bound), EITHER (depends)
    int_ok: int | None = None
    stored: type | None = None  # the stored type when not the kind's (a float budget kept as int bytes)
    needle: str | None = None  # what the message must contain (default "name=")

    @property
    def id(self) -> str:
        return f"{self.where}.{self.name}"


LABELS = ("np.int64", "np.float64", "tensor", "'true'", "'false'", "2**80", "-1", "nan", "inf", "None")


def value_and_expectation(arg: Arg, label: str) -> tuple[Any, str]:
    """The value of column ``label`` for ``arg``, and whether it must be accepted or refused."""
    kind = arg.kind
    if label == "np.int64":  # an int is never a bool; for a float argument it is a valid number
        if kind == "bool":
            return np.int64(1), REFUSED
        return np.int64(arg.ok if kind == "int" else arg.int_ok), ACCEPTED
    if label == "np.float64":  # a float is never an int (not even 2.0), nor a bool
        if kind == "float":
            return np.float64(arg.ok), ACCEPTED
        return np.float64(1.0 if kind == "bool" else arg.ok), REFUSED
    if label == "tensor":  # a 0-d tensor holding a valid value: converted at the door
        return torch.tensor(arg.ok), ACCEPTED
    if label in ("'true'", "'false'"):  # a string is never a truth value, nor a number
        return label.strip("'"), REFUSED
    if label == "2**80":
        return HUGE, REFUSED if kind == "bool" else arg.huge
    if label == "-1":
        return -1, ACCEPTED if arg.negative and kind != "bool" else REFUSED
    if label in ("nan", "inf"):
        return (NAN if label == "nan" else INF), REFUSED
    assert label == "None"
    return None, ACCEPTED if arg.optional else REFUSED


def plain_of(value: Any, arg: Arg) -> Any:
    """The plain Python value an accepted ``value`` must be stored as."""
    item = value.item() if hasattr(value, "item") else value
    return (arg.stored or _PLAIN[arg.kind])(item)


# ------------------------------------------------------------------------------ valid baselines
MODEL = dict(n_layers=2, hidden=64, n_heads=4, vocab_size=128)
MOE = dict(MODEL, ffn_kind="swiglu", n_experts=4, experts_per_token=2, n_shared_experts=1)
MLA = dict(MODEL, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
TRAIN = dict(micro_batch=2, seq_len=32)
HW = dict(name="gpu", memory_bytes=2**34)
SMALL = ModelSpec(**MODEL)
SMALL_TRAIN = TrainSpec(**TRAIN)
L4 = HardwareSpec.preset("l4")
EXACT = 2.0**40  # a float (FLOP/s, bytes) that a float32 tensor holds exactly

# the loss: [B, S, h] hidden, [V, h] weight, [B, S] targets (shift needs the 3-d form)
HIDDEN = torch.randn(1, 4, 8)
WEIGHT = torch.randn(10, 8)
TARGET = torch.randint(0, 10, (1, 4))


class _Tokens(nn.Module):
    """The smallest language model a token-batch trace accepts (an embedding and a head)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


TOKENS = _Tokens()


@functools.cache
def _fabric_parts() -> tuple[Any, Any, Any, str]:
    """A real single-process CPU Fabric and a tiny model/optimizer it set up (made on first use)."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    module = nn.Linear(4, 4)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    return fabric, model, optimizer, tempfile.mkdtemp(prefix="memplan-matrix-")


def _monitor(**kw: Any) -> Any:
    from lightning_memplan.fabric import MemoryMonitor

    fabric, model, optimizer, folder = _fabric_parts()
    return MemoryMonitor(fabric, model, optimizer, dirpath=folder, **kw)


@functools.cache
def _decision() -> Any:
    return plan(SMALL, SMALL_TRAIN, L4)


def _module_loss(**kw: Any) -> LinearCrossEntropy:
    module = LinearCrossEntropy(**kw)
    module(HIDDEN, WEIGHT, TARGET)  # the options also run, not only construct
    return module


def _trainer_strategy(**kw: Any) -> Any:
    from lightning_memplan.strategies import MemplanAutoStrategy

    return MemplanAutoStrategy(**kw)


def _fabric_strategy(**kw: Any) -> Any:
    from lightning_memplan.fabric import MemplanAutoFabricStrategy

    return MemplanAutoFabricStrategy(**kw)


# ------------------------------------------------------------------------------------- the table
ARGS: list[Arg] = []


def field_of(where: str, make: Callable[..., Any], read: Callable[[Any, str], Any] = getattr,
             **base: Any) -> Callable[..., None]:
    """A registrar for the arguments of one entry point ``make(**base, name=value)``."""

    def add(name: str, kind: str, ok: Any, *, stored_as: Callable[[Any], Any] | None = None, **spec: Any) -> None:
        def call(value: Any, name: str = name) -> Any:
            return make(**{**base, name: value})

        def read_back(result: Any, name: str = name) -> Any:
            return read(result, name)

        ARGS.append(Arg(where, name, kind, ok, call, stored_as or read_back, **spec))

    return add


def no_read(result: Any) -> None:
    return None


# ModelSpec: sizes, optional sizes, fractions, flags; the MoE and MLA fields on their own baselines
add = field_of("ModelSpec", ModelSpec, **MODEL)
for name, ok in (("n_layers", 2), ("hidden", 64), ("n_heads", 4), ("vocab_size", 128)):
    add(name, "int", ok)
for name, ok in (("n_kv_heads", 2), ("head_dim", 16), ("ffn_hidden", 256), ("max_positions", 1024), ("n_params", 10**6)):
    add(name, "int", ok, optional=True)
add("n_trainable_params", "int", 1000, optional=True)  # 2**80 exceeds the model's parameters: refused by name
add("extra_layer_params", "int", 8)
add("buffer_bytes", "int", 4096)
add("dropout", "float", 0.5, int_ok=0, huge=REFUSED)
for name in ("bias", "tied_embeddings", "qkv_fused", "qkv_bias"):
    add(name, "bool", True)
add = field_of("ModelSpec", ModelSpec, **MOE)
add("n_experts", "int", 4)
add("experts_per_token", "int", 2, huge=REFUSED)  # at most n_experts; required with experts
add("expert_ffn_hidden", "int", 64, optional=True)
add("n_shared_experts", "int", 1)
add("shared_expert_ffn_hidden", "int", 64, optional=True)
add("shared_expert_gate", "bool", True)
add("first_dense_layers", "int", 1, huge=REFUSED)  # at most n_layers
add("moe_layer_step", "int", 2, huge=REFUSED)  # at most n_layers
add = field_of("ModelSpec", ModelSpec, **MLA)
add("kv_lora_rank", "int", 8)  # None with the other MLA fields set: refused, naming kv_lora_rank=
add("q_lora_rank", "int", 16, optional=True)
add("qk_nope_head_dim", "int", 8)
add("qk_rope_head_dim", "int", 8)
add("v_head_dim", "int", 8)

# TrainSpec
add = field_of("TrainSpec", TrainSpec, **TRAIN)
for name, ok in (("micro_batch", 2), ("seq_len", 32), ("grad_accumulation", 2)):
    add(name, "int", ok, huge=ACCEPTED)
for name, ok in (("loss_chunk_size", 1024), ("param_bytes", 2), ("grad_bytes", 2), ("master_bytes", 4),
                 ("activation_bytes", 2)):
    add(name, "int", ok, optional=True, huge=ACCEPTED)
add("optimizer_bytes_per_param", "float", 8.0, int_ok=8, optional=True, huge=ACCEPTED)
add("master_weights", "bool", True)
add("grads_alive_in_forward", "bool", False)

# ParallelPlan
add = field_of("ParallelPlan", ParallelPlan)
for name in ("dp", "tp", "pp", "cp"):
    add(name, "int", 2, huge=REFUSED)  # at most MAX_WORLD_SIZE devices
add("microbatches", "int", 4, huge=ACCEPTED)
add("zero", "int", 2, negative=False, huge=REFUSED)
add = field_of("ParallelPlan", ParallelPlan, pp=2, microbatches=4, schedule="interleaved")
add("virtual_stages", "int", 2, huge=REFUSED)  # at most MAX_PIPELINE_CHUNKS chunks
add = field_of("ParallelPlan", ParallelPlan, dp=4, zero=3)
add("reshard_after_forward", "int", 2, optional=True, huge=REFUSED)  # a divisor of dp*cp
add = field_of("ParallelPlan", ParallelPlan, tp=2)
add("sp", "bool", True)
add("grad_buckets", "bool", False)

# HardwareSpec: the constructor, preset() and detect()
add = field_of("HardwareSpec", HardwareSpec, **HW)
add("memory_bytes", "int", 2**34, huge=ACCEPTED)
add("gpus_per_node", "int", 8, huge=REFUSED)  # at most MAX_GPUS_PER_NODE
add("num_nodes", "int", 2, huge=REFUSED)  # at most MAX_WORLD_SIZE devices
for name in ("peak_flops", "peak_flops_fp32", "intra_node_bw", "inter_node_bw", "memory_bw"):
    add(name, "float", EXACT, int_ok=10**12, optional=True, huge=ACCEPTED)
add("supports_bf16", "bool", False)
add("fallback", "bool", True)
add = field_of("HardwareSpec.preset", functools.partial(HardwareSpec.preset, "l4"))
add("gpus_per_node", "int", 8, huge=REFUSED)
add("num_nodes", "int", 2, huge=REFUSED)
add = field_of("HardwareSpec.detect", HardwareSpec.detect)
add("num_nodes", "int", 2, huge=REFUSED)
add("device", "int", 0, optional=True, stored_as=no_read)  # a CUDA index; ignored without CUDA

# estimate_memory
add = field_of("estimate_memory", functools.partial(estimate_memory, SMALL, SMALL_TRAIN, ParallelPlan(dp=4)))
add("rank", "int", 3, optional=True, huge=REFUSED)  # a rank of the plan's 4

# plan() and the decision's explain()
add = field_of("plan", functools.partial(plan, SMALL, SMALL_TRAIN, L4))
add("global_batch", "int", 4, optional=True)
add("memory_budget", "float", 2.0**33, int_ok=2**33, optional=True, huge=ACCEPTED, stored_as=no_read)
add("headroom", "float", 0.25, int_ok=0, huge=REFUSED)
add("top_k", "int", 3, huge=ACCEPTED, stored_as=no_read)
add("expandable_segments", "bool", True)
add = field_of("PlanDecision.explain", lambda **kw: _decision().explain(**kw))
add("top", "int", 3, huge=ACCEPTED, stored_as=no_read)
add("max_rejected", "int", 3, huge=ACCEPTED, stored_as=no_read)

# the largest fit
for where, fit in (("max_micro_batch", max_micro_batch), ("max_seq_len", max_seq_len)):
    add = field_of(where, functools.partial(fit, SMALL, SMALL_TRAIN, None, hardware=L4))
    add("memory_budget", "float", 2.0**33, int_ok=2**33, optional=True, huge=ACCEPTED, stored_as=no_read)
    add("headroom", "float", 0.25, int_ok=0, huge=REFUSED, stored_as=no_read)
    add("expandable_segments", "bool", True, stored_as=no_read)
    add("reserved_margin", "int", 2**30, optional=True, huge=REFUSED, stored_as=no_read)  # bytes below 2**63

# trace_memory and calibrate (a fake-tensor step of a tiny token model)
add = field_of("trace_memory", functools.partial(trace_memory, TOKENS), batch_shape=(2, 8))
add("steps", "int", 2, huge=REFUSED)  # at most MAX_TRACE_STEPS
add("fake", "bool", False, stored_as=no_read)
add("seq_len", "int", 8, optional=True)
add("vocab_size", "int", 16, optional=True, stored_as=no_read)
add("grads_alive_in_forward", "bool", False, stored_as=no_read)
ARGS.append(Arg("trace_memory", "batch_shape[0]", "int", 2, lambda v: trace_memory(TOKENS, batch_shape=(v, 8)),
                lambda r: r.micro_batch, huge=REFUSED, needle="batch_shape[0] (micro_batch)="))
ARGS.append(Arg("trace_memory", "batch_shape[1]", "int", 8, lambda v: trace_memory(TOKENS, batch_shape=(2, v)),
                lambda r: r.seq_len, huge=REFUSED, needle="batch_shape[1] (seq_len)="))
ARGS.append(Arg("calibrate", "shapes[0][0]", "int", 1, lambda v: calibrate(TOKENS, ((v, 8), (2, 16))),
                lambda r: r.traced_shapes[0][0], huge=REFUSED, needle="shapes[0][0] (micro_batch)="))
ARGS.append(Arg("calibrate", "shapes[0][1]", "int", 8, lambda v: calibrate(TOKENS, ((1, v), (2, 16))),
                lambda r: r.traced_shapes[0][1], huge=REFUSED, needle="shapes[0][1] (seq_len)="))
add = field_of("calibrate", functools.partial(calibrate, TOKENS, ((1, 8), (2, 16))))
add("quadratic", "bool", False, optional=True, stored_as=no_read)


# the loss, functional and module (the module also runs a forward)
def _loss_options(add: Callable[..., None], read: bool) -> None:
    kept = {} if read else {"stored_as": no_read}
    add("ignore_index", "int", -100, negative=True, huge=REFUSED, **kept)  # an int64 target id
    add("label_smoothing", "float", 0.25, int_ok=0, huge=REFUSED, **kept)
    add("z_loss", "float", 0.5, int_ok=0, huge=ACCEPTED, **kept)
    add("softcap", "float", 32.0, int_ok=30, optional=True, huge=ACCEPTED, **kept)
    add("shift", "bool", True, **kept)
    add("chunk_size", "int", 2, huge=ACCEPTED, **kept)
    add("chunk_budget_bytes", "int", 2**20, huge=ACCEPTED, **kept)
    add("validate_targets", "bool", True, **kept)
    add("sequence_parallel", "bool", False, **kept)  # True needs a process group
    add("allow_retain_graph", "bool", True, **kept)


_loss_options(field_of("linear_cross_entropy", functools.partial(linear_cross_entropy, HIDDEN, WEIGHT, TARGET)), False)
field_of("linear_cross_entropy", functools.partial(linear_cross_entropy, HIDDEN, WEIGHT, TARGET))(
    "return_metrics", "bool", True, stored_as=lambda result: isinstance(result, tuple))
_loss_options(field_of("LinearCrossEntropy", _module_loss, read=lambda m, name: getattr(m.options, name)), True)
field_of("LinearCrossEntropy", _module_loss)("return_metrics", "bool", True)


# the monitoring front doors: the callback and Fabric's monitor share MonitorOptions
def _monitor_options(add: Callable[..., None]) -> None:
    add("measure_every_n_steps", "int", 10, huge=ACCEPTED)
    add("tolerance", "float", 0.5, int_ok=0, huge=ACCEPTED)
    add("min_headroom", "float", 0.25, int_ok=0, huge=REFUSED)
    add("calibrate", "bool", False)
    add("seq_len", "int", 2048, optional=True, huge=ACCEPTED)
    add("max_seq_len", "int", 8192, optional=True, huge=ACCEPTED)
    add("memory_budget", "int", 2**30, optional=True, huge=ACCEPTED)
    add("track_tensors", "bool", True, optional=True)
    add("write_files", "bool", False)
    add("print_report", "bool", False)
    add("generate_tokens", "int", 64, huge=REFUSED)


_monitor_options(field_of("MemoryPlanCallback", MemoryPlanCallback))
_monitor_options(field_of("MemoryMonitor", _monitor, read=lambda m, name: getattr(m.options, name)))
add = field_of("MemoryMonitor", _monitor)
add("grads_alive_in_forward", "bool", True)
add("accumulate_grad_batches", "int", 2, huge=ACCEPTED)
add("log_every_n_steps", "int", 10, huge=ACCEPTED)

add = field_of("MemoryPlanBatchSizeFinder", MemoryPlanBatchSizeFinder)
add("memory_budget", "float", 2.0**30, int_ok=2**30, optional=True, huge=ACCEPTED, stored=int)  # kept as int bytes
add("headroom", "float", 0.25, int_ok=0, huge=REFUSED)
add("seq_len", "int", 2048, optional=True, huge=ACCEPTED)
add("max_batch_size", "int", 512, optional=True, huge=ACCEPTED)
add("reserved_margin", "int", 2**30, optional=True, huge=REFUSED)  # bytes below 2**63 (or a ReservedMargin)

# the strategies: the Trainer's and Fabric's front doors share PlanningOptions
for where, make in (("MemplanAutoStrategy", _trainer_strategy), ("MemplanAutoFabricStrategy", _fabric_strategy)):
    add = field_of(where, make, read=lambda s, name: getattr(s._options, name))
    add("memory_budget", "int", 2**30, optional=True, huge=ACCEPTED)
    add("headroom", "float", 0.25, int_ok=0, huge=REFUSED)
    field_of(where, make, read=lambda s, name: s._save_distributed_checkpoint)("save_distributed_checkpoint", "bool", False)

ENTRY_POINTS = sorted({arg.where for arg in ARGS})
CASES = [(arg, label) for arg in ARGS for label in LABELS]


# ---------------------------------------------------------------------------------------- running
def answer(call: Callable[[], Any]) -> tuple[Any, BaseException | None, float]:
    """``call()``'s result or exception and the CPU seconds of the thread that ran it; fails the test if it
    has not answered within the hang guard."""
    out: dict[str, Any] = {}

    def run() -> None:
        start = time.thread_time()
        try:
            out["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["error"] = exc
        out["cpu"] = time.thread_time() - start

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(HANG_GUARD_S)
    assert not worker.is_alive(), f"no answer within the {HANG_GUARD_S} s hang guard"
    return out.get("value"), out.get("error"), out["cpu"]


@pytest.fixture(scope="module")
def warm() -> None:
    """Pay the first-use costs (lazy imports, the first fake-tensor trace, the Fabric) outside the bound."""
    trace_memory(TOKENS, batch_shape=(2, 8))
    linear_cross_entropy(HIDDEN, WEIGHT, TARGET)
    _decision().explain()
    max_micro_batch(SMALL, SMALL_TRAIN, hardware=L4)
    _monitor()
    _trainer_strategy()
    _fabric_strategy()
    HardwareSpec.detect()


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(("arg", "label"), CASES, ids=[f"{arg.id}-{label}" for arg, label in CASES])
def test_every_entry_point_answers_every_odd_value(warm: None, arg: Arg, label: str) -> None:
    value, expected = value_and_expectation(arg, label)
    result, error, cpu = answer(lambda: arg.call(value))
    assert cpu < BOUND_S, f"{arg.id}={value!r}: {cpu:.2f} s CPU"
    if error is not None:
        assert expected != ACCEPTED, f"{arg.id}={value!r} is valid but was refused: {error!r}"
        assert isinstance(error, (ValueError, TypeError)), f"{arg.id}={value!r} raised {error!r}"
        message = str(error)
        needle = arg.needle or f"{arg.name}="
        assert needle in message, f"the message does not name {needle!r}: {message!r}"
        assert repr(value) in message or str(value) in message, f"the message does not show {value!r}: {message!r}"
        return
    assert expected != REFUSED, f"{arg.id}={value!r} was accepted"
    if value is None or arg.read is None:
        return
    stored, plain = arg.read(result), plain_of(value, arg)
    if stored is not None:
        assert type(stored) is type(plain) and stored == plain, f"{arg.id}={value!r} kept {stored!r}, not {plain!r}"


def test_the_matrix_covers_every_public_entry_point() -> None:
    public = {"ModelSpec", "TrainSpec", "ParallelPlan", "HardwareSpec", "HardwareSpec.preset", "HardwareSpec.detect",
              "estimate_memory", "plan", "PlanDecision.explain", "max_micro_batch", "max_seq_len", "trace_memory",
              "calibrate", "linear_cross_entropy", "LinearCrossEntropy", "MemoryPlanCallback", "MemoryMonitor",
              "MemoryPlanBatchSizeFinder", "MemplanAutoStrategy", "MemplanAutoFabricStrategy"}
    assert set(ENTRY_POINTS) == public
    assert len({arg.id for arg in ARGS}) == len(ARGS)  # one row per argument
    assert len(CASES) == len(ARGS) * len(LABELS) >= 1000
