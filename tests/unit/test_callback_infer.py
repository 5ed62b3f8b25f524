"""What MemoryPlanCallback infers from batches, optimizers and strategies; constructor validation;
remedies; the CPU probe."""

from __future__ import annotations

from collections import UserDict, namedtuple
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from lightning_memplan.callbacks import MemoryPlanCallback, is_out_of_memory
from lightning_memplan.live import (
    InferenceError,
    batch_factory,
    batch_shape,
    infer_optimizer,
    infer_plan,
    infer_train_spec,
)
from lightning_memplan.model.specs import ParallelPlan, TrainSpec
from lightning_memplan.monitoring.advice import REMEDIES, culprit, headroom_message, mismatch_message, remedy
from lightning_memplan.monitoring.measure import PhaseProbe, read_rss
from lightning_memplan.report import StepRecord

IDS = torch.zeros(3, 17, dtype=torch.long)


class BatchEncoding(UserDict):
    """Shaped like Hugging Face's ``BatchEncoding``: a ``UserDict`` with attribute access."""

    def __getattr__(self, name):
        if name == "data":
            raise AttributeError(name)
        try:
            return self.data[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass
class Packed:
    meta: str
    tokens: torch.Tensor


Pair = namedtuple("Pair", "x y")


@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        (IDS, (3, 17)),
        ((IDS, IDS), (3, 17)),
        ([IDS], (3, 17)),
        ({"labels": torch.zeros(3, 5, dtype=torch.long), "input_ids": IDS}, (3, 17)),  # input_ids preferred
        (BatchEncoding(input_ids=IDS, attention_mask=torch.ones(3, 17)), (3, 17)),
        ({"a": ["text", {"b": (None, IDS)}]}, (3, 17)),  # nested containers
        (Packed("m", IDS), (3, 17)),
        (Pair(IDS, IDS), (3, 17)),
        (torch.randn(3, 17, 8), (3, 17)),  # embeddings [b, s, h]
        ((torch.randn(5, 20), torch.zeros(5, dtype=torch.long)), (5, 1)),  # MLP features: one position
        (torch.zeros(6, dtype=torch.long), (6, 1)),
    ],
)
def test_batch_shape_reads_every_container(batch, expected):
    assert batch_shape(batch) == expected


def test_batch_shape_errors_say_which_argument_supplies_it():
    # images and videos are fixed-size samples: s = 1 (the memory grows with b); seq_len= names another axis
    assert batch_shape(torch.randn(4, 3, 8, 8)) == (4, 1)
    assert batch_shape(torch.randn(4, 3, 2, 8, 8)) == (4, 1)
    assert batch_shape(torch.randn(4, 3, 8, 8), seq_len=64) == (4, 64)
    with pytest.raises(InferenceError, match=r"train_spec=TrainSpec\(micro_batch=\.\.\., seq_len=\.\.\.\)"):
        batch_shape({"text": ["a", "b"]})
    with pytest.raises(InferenceError, match="scalar"):
        batch_shape(torch.tensor(1.0))


def test_batch_factory_resizes_batch_and_sequence_and_keeps_types():
    batch = BatchEncoding(
        input_ids=torch.randint(5, 9, (2, 8)), mask=torch.ones(2, 1, 8, 8, dtype=torch.bool), n=3
    )
    out = batch_factory(batch, 2, 8)(4, 16)
    assert type(out) is BatchEncoding and out["n"] == 3
    assert out["input_ids"].shape == (4, 16) and out["mask"].shape == (4, 1, 16, 16)
    assert int(out["input_ids"].min()) >= 5 and int(out["input_ids"].max()) <= 8  # real token range
    p = batch_factory(Pair(torch.randn(2, 8, 3), torch.zeros(2, 8, dtype=torch.long)), 2, 8)(1, 4)
    assert isinstance(p, Pair) and p.x.shape == (1, 4, 3) and p.y.shape == (1, 4)


@pytest.mark.parametrize(
    ("optimizer", "expected"),
    [
        (lambda p: torch.optim.AdamW(p), ("adamw", "for_loop")),
        (lambda p: torch.optim.Adam(p, foreach=True), ("adam", "foreach")),
        (lambda p: torch.optim.Adam(p, foreach=False), ("adam", "for_loop")),
        (lambda p: torch.optim.AdamW(p, fused=True), ("adamw", "fused")),
        (lambda p: torch.optim.SGD(p, lr=0.1), ("sgd", "for_loop")),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), ("sgd_momentum", "for_loop")),
    ],
)
def test_infer_optimizer(optimizer, expected):
    opt = optimizer([torch.nn.Parameter(torch.zeros(2))])
    assert infer_optimizer(opt) == expected
    assert infer_optimizer(SimpleNamespace(optimizer=opt)) == expected  # LightningOptimizer wrapper


def test_unknown_optimizer_names_the_override():
    opt = torch.optim.RMSprop([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(InferenceError, match="RMSprop.*optimizer_bytes_per_param"):
        infer_optimizer(opt)


def _trainer(strategy, world=1, precision="bf16-mixed", accumulate=1, optimizers=()):
    return SimpleNamespace(
        strategy=strategy,
        world_size=world,
        precision=precision,
        accumulate_grad_batches=accumulate,
        optimizers=list(optimizers),
    )


def test_infer_train_spec_from_trainer_and_batch():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    spec = infer_train_spec(_trainer(None, precision="16-mixed", accumulate=4, optimizers=[opt]), (IDS, IDS))
    assert spec == TrainSpec(
        micro_batch=3,
        seq_len=17,
        precision="16-mixed",
        optimizer="sgd_momentum",
        optimizer_impl="for_loop",
        grad_accumulation=4,
    )
    base = TrainSpec(micro_batch=1, seq_len=1, optimizer="adamw8bit", recompute="full")
    assert infer_train_spec(_trainer(None), IDS, base=base) == base.replace(micro_batch=3, seq_len=17)
    with pytest.raises(InferenceError, match="no optimizer.*train_spec="):
        infer_train_spec(_trainer(None), IDS)
    # memplan_auto's resolution: the recompute and loss mode it applies
    auto = SimpleNamespace(resolution=SimpleNamespace(recompute="selective", loss="chunked"))
    applied = infer_train_spec(_trainer(auto, optimizers=[opt]), IDS)
    assert (applied.recompute, applied.loss) == ("selective", "chunked")


def test_infer_plan_from_strategies():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy

    assert infer_plan(_trainer(SingleDeviceStrategy("cpu")))[0] == ParallelPlan()
    assert infer_plan(_trainer(DDPStrategy(), world=4))[0] == ParallelPlan(dp=4)
    assert infer_plan(_trainer(FSDPStrategy(sharding_strategy="SHARD_GRAD_OP"), world=8))[0] == ParallelPlan(
        dp=8, zero=2
    )
    assert infer_plan(_trainer(FSDPStrategy(), world=8))[0] == ParallelPlan(dp=8, zero=3)

    class DeepSpeedStrategy:  # recognised by name, so deepspeed itself is never imported
        config = {"zero_optimization": {"stage": 2}}

    assert infer_plan(_trainer(DeepSpeedStrategy(), world=2))[0] == ParallelPlan(dp=2, zero=2)
    decided = ParallelPlan(dp=2, tp=2, zero=3)

    class MemplanAutoStrategy:
        decision = SimpleNamespace(plan=decided, train=None)

    assert infer_plan(_trainer(MemplanAutoStrategy(), world=4))[0] == decided
    folded = ParallelPlan(dp=4, zero=3)  # what it applied after folding an inapplicable tp into dp
    MemplanAutoStrategy.applied_plan = folded
    assert infer_plan(_trainer(MemplanAutoStrategy(), world=4))[0] == folded

    class Exotic:
        pass

    with pytest.raises(InferenceError, match=r"'Exotic'.*plan=ParallelPlan"):
        infer_plan(_trainer(Exotic()))


class _Mesh:
    """The slice of ``DeviceMesh`` the callback reads (a real 2 x 4 mesh needs 8 processes)."""

    mesh_dim_names = ("data_parallel", "tensor_parallel")
    mesh = torch.arange(8).view(2, 4)

    def __getitem__(self, name):
        size = {"data_parallel": 2, "tensor_parallel": 4}[name]
        return SimpleNamespace(size=lambda: size)


def test_infer_plan_reads_model_parallel_mesh():
    class ModelParallelStrategy:
        device_mesh = _Mesh()

    plan, how = infer_plan(_trainer(ModelParallelStrategy(), world=8), torch.nn.Linear(2, 2))
    assert plan == ParallelPlan(dp=2, tp=4) and "tensor_parallel" in how
    sharded = torch.nn.Sequential(torch.nn.Linear(2, 2))
    from torch.distributed.fsdp import FSDPModule

    sharded[0].__class__ = type("FSDPLinear", (FSDPModule, torch.nn.Linear), {})  # what fully_shard does
    assert infer_plan(_trainer(ModelParallelStrategy(), world=8), sharded)[0] == ParallelPlan(
        dp=2, tp=4, zero=3
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tolerance": -0.1}, "tolerance=-0.1"),
        ({"tolerance": float("nan")}, "tolerance=nan"),
        ({"measure_every_n_steps": 0}, "measure_every_n_steps=0"),
        ({"measure_every_n_steps": 2.5}, "measure_every_n_steps=2.5"),
        ({"units": "GiBs"}, "units='GiBs'.*'GiB'"),
        ({"min_headroom": 1.5}, "min_headroom=1.5"),
        ({"seq_len": 0}, "seq_len=0"),
        ({"max_seq_len": -4}, "max_seq_len=-4"),
        ({"memory_budget": 0}, "memory_budget=0"),
        ({"track_tensors": "yes"}, "track_tensors='yes'"),
    ],
)
def test_constructor_rejects_bad_values_naming_the_argument(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):  # TypeError for a wrong type (2.5 steps)
        MemoryPlanCallback(**kwargs)


def test_constructor_rejects_wrong_spec_types():
    with pytest.raises(TypeError, match="model_spec="):
        MemoryPlanCallback(model_spec={"n_layers": 2})
    with pytest.raises(TypeError, match="plan="):
        MemoryPlanCallback(plan="dp=2")


def test_out_of_memory_recognised():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ... out of memory")
    )
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_remedies_follow_the_decision_table():
    train = TrainSpec(micro_batch=4, seq_len=4096)
    # logits -> chunked loss first, then vocab-parallel once chunked is in use
    assert "chunks" in remedy("logits", ParallelPlan(), train)
    assert "vocab-parallel" in remedy("logits", ParallelPlan(), train.replace(loss="chunked"))
    # activations -> recompute, then smaller micro-batch, then sequence parallel
    assert "checkpointing" in remedy("activations", ParallelPlan(), train)
    assert "micro-batch" in remedy("activations", ParallelPlan(), train.replace(recompute="full"))
    assert "sequence parallelism" in remedy(
        "activations", ParallelPlan(), train.replace(recompute="full", micro_batch=1)
    )
    # eager attention scores -> fused attention
    assert "scaled_dot_product_attention" in remedy(
        "attention", ParallelPlan(), train.replace(attention="eager")
    )
    # model states -> ZeRO stages in order on dp > 1, then tensor parallel
    assert "ZeRO-1" in remedy("optimizer", ParallelPlan(dp=8), train)
    assert "ZeRO-3" in remedy("params", ParallelPlan(dp=8, zero=2), train)
    assert "tensor parallelism" in remedy("params", ParallelPlan(dp=8, zero=3), train)
    # ... and on one device the state format, then sharding over more GPUs
    assert "8-bit" in remedy("optimizer", ParallelPlan(), train)
    assert "FSDP" in remedy("optimizer", ParallelPlan(), train.replace(optimizer="adamw8bit"))
    # a single layer's all-gathered weights -> tensor parallel
    assert "tensor" in remedy("comm", ParallelPlan(dp=8, zero=3), train)
    assert set(REMEDIES) >= {"params", "activations", "attention", "logits", "comm"}


def _record(**kw):
    base = dict(
        step=5,
        epoch=0,
        rank=1,
        micro_batch=2,
        seq_len=64,
        estimated_peak=100,
        measured_peak=125,
        estimated_components={"params": 40, "activations": 50, "logits": 10},
        estimated_phase_peaks={"forward": 100, "backward": 90, "optimizer": 60},
    )
    base.update(kw)
    return StepRecord(**base)


def test_mismatch_names_the_component_with_the_largest_excess():
    r = _record(measured_components={"params": 40, "activations": 52, "logits": 33})
    assert culprit(r)[0] == "logits"  # +23 bytes, more than activations' +2
    text = mismatch_message(r, 0.10)
    assert "25.0% above" in text and "most likely component: logits" in text and "rank 1" in text
    assert mismatch_message(r, 0.30) is None  # within tolerance
    assert mismatch_message(_record(measured_components={"params": 125}, warmup=True), 0.1) is None
    # Without a breakdown (CUDA allocator), blame the largest estimated component.
    assert culprit(_record(measured_phase_peaks={"forward": 125}))[0] == "activations"


def test_headroom_warning_threshold():
    r = _record(device_memory=1000, headroom=99)
    assert "min_headroom=10%" in headroom_message(r, 0.10, ParallelPlan(), None)
    assert headroom_message(_record(device_memory=1000, headroom=100), 0.10, ParallelPlan(), None) is None


def test_cpu_probe_reads_rss_like_proc_status():
    with open("/proc/self/status") as fh:
        vmrss_kib = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
    assert read_rss() == pytest.approx(vmrss_kib * 1024, rel=0.05)
    probe = PhaseProbe(torch.device("cpu"))
    probe.start_step()
    probe.enter_phase("backward")
    keep = torch.ones(64 * 2**20 // 4)  # 64 MiB touched: RSS grows
    reading = probe.end_step()
    assert reading.measured_peak is None and reading.phase_peaks == {}  # no tensor-level numbers on CPU
    assert reading.reserved >= vmrss_kib * 1024 + 32 * 2**20
    assert reading.device_memory > reading.reserved
    del keep


class _FakeAllocator:
    """A scripted stand-in for the CUDA caching allocator's counters (no GPU in CI); the probe's phase
    logic is checked against peaks worked by hand."""

    def __init__(self):
        self.allocated = self.peak = 100
        self.reserved = self.peak_reserved = 200
        self.resets = 0

    def alloc(self, n):
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, self.allocated + 100)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def reset(self, device=None):
        self.peak, self.peak_reserved = self.allocated, self.reserved
        self.resets += 1


def test_cuda_probe_phase_peaks_with_a_scripted_allocator(monkeypatch):
    from lightning_memplan.monitoring.measure import CudaProbe

    fake = _FakeAllocator()
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: fake.peak)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d=None: fake.peak_reserved)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: fake.reserved)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (10_000 - fake.reserved - 300, 10_000))
    probe = CudaProbe(torch.device("cuda", 0))
    probe.start_step()
    fake.alloc(500)  # forward: activations up to 600
    fake.alloc(-100)
    probe.enter_phase("backward")
    fake.alloc(300)  # backward peak 800
    fake.alloc(-400)
    probe.enter_phase("backward")  # on_after_backward: same phase, peaks merge
    fake.alloc(50)  # clipping temporaries: 450
    probe.enter_phase("optimizer")
    fake.alloc(200)  # optimizer temporaries: 650
    fake.alloc(-200)
    reading = probe.end_step()
    assert reading.phase_peaks == {"forward": 600, "backward": 800, "optimizer": 650}
    assert reading.measured_peak == 800
    assert reading.reserved == 900  # 800 allocated + 100 slack at the backward peak
    assert reading.device_memory == 10_000
    assert reading.unavailable == 300  # held outside the allocator (context, other processes)
    assert fake.resets == 5  # at the step start and at every boundary


def test_report_text_goes_to_tensorboard_and_the_wandb_table_is_numeric():
    """TensorBoard gets add_text of the epoch table; MLflow and W&B get the report files instead (real
    loggers: tests/integration/test_callback_loggers.py), W&B's table in numbers, not "1.000 GiB"."""
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger

    from lightning_memplan.monitoring.artifacts import table_rows
    from lightning_memplan.monitoring.emit import log_report_text
    from lightning_memplan.report import EpochReport, RankSummary

    calls = []

    class Recorder:
        def add_text(self, tag, text, global_step):
            calls.append(("tb", tag, text, global_step))

        def log_text(self, *args, **kwargs):
            calls.append(("text", args, kwargs))

    def bare(cls, **attrs):
        sub = type(cls.__name__, (cls,), {"experiment": Recorder(), **attrs})
        return object.__new__(sub)

    wandb = bare(WandbLogger, log_text=lambda self, **kw: calls.append(("wandb", kw)))
    mlflow = bare(MLFlowLogger, run_id="run-1")
    trainer = SimpleNamespace(loggers=[bare(TensorBoardLogger), wandb, mlflow, object.__new__(CSVLogger)])
    epoch = EpochReport(
        epoch=2, ranks=(RankSummary(rank=0, epoch=2, estimated_peak=2**30, measured_peak=2**29),)
    )
    log_report_text(trainer, epoch, "GiB", step=40)
    (tb,) = calls
    assert tb[0] == "tb" and tb[1] == "memplan/report" and "## Epoch 2" in tb[2] and tb[3] == 40
    columns, data = table_rows(epoch, "GiB")
    assert columns[:3] == ["rank", "estimated_peak_gib", "measured_peak_gib"]
    assert data == [[0, 1.0, 0.5, None, None, None]]


def test_calibration_shapes_stay_within_the_real_sequence_and_avoid_the_head_width():
    from lightning_memplan.live import calibration_shapes

    assert calibration_shapes(2, 32, 16) == [(2, 32), (2, 24), (4, 32)]
    assert calibration_shapes(2, 32, 24) == [(2, 32), (2, 23), (4, 32)]  # 24 would look like [.., s, s]
    assert calibration_shapes(8, 1, None) == [(8, 1), (16, 1)]  # one position per sample: vary b only


def test_tracer_and_callback_read_the_same_tensor_of_an_encoder_decoder_batch() -> None:
    """One rule (``tracking.batch.first_tensor``) for the tracer and the callback. An encoder-decoder batch
    whose decoder ``labels`` come first in the mapping used to split them: the callback's reader took the
    token key (``input_ids``, s = 12), the tracer's own helper the first tensor in order (``labels``, s = 5),
    so ``trace_memory(example_input=batch)`` traced another sequence length than the callback estimated."""
    from lightning_memplan.tracking.batch import first_tensor

    batch = {"labels": torch.zeros(2, 5, dtype=torch.long), "input_ids": torch.ones(2, 12, dtype=torch.long)}
    assert first_tensor(batch) is batch["input_ids"]
    assert batch_shape(batch) == (2, 12)
    # the tracer reads its example batch with the same rule: a tiny encoder-decoder traced on that batch
    from lightning_memplan.tracking.trace import trace_memory

    class Seq2Seq(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.head = torch.nn.Linear(8, 16)

        def forward(self, batch):
            memory = self.emb(batch["input_ids"]).mean(1, keepdim=True)
            return self.head(self.emb(batch["labels"]) + memory)

    def loss_fn(module, batch):
        return torch.nn.functional.cross_entropy(module(batch).flatten(0, 1), batch["labels"].flatten())

    result = trace_memory(Seq2Seq(), example_input=batch, loss_fn=loss_fn)
    assert (result.micro_batch, result.seq_len) == batch_shape(batch) == (2, 12)
