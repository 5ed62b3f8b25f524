"""``TrainSpec(framework="deepspeed")``: ZeRO as DeepSpeed allocates it (issue 27).

The published rows (ZeRO paper Fig. 1; DeepSpeed's own ``estimate_zero2/3_model_states_mem_needs``) come
from ``benchmarks/deepspeed_published.py``, which writes ``benchmarks/results/deepspeed_published.md``.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lightning_memplan.cli import main
from lightning_memplan.live import InferenceError, infer_plan, infer_train_spec, is_deepspeed
from lightning_memplan.model.estimate import estimate_memory
from lightning_memplan.model.frameworks import ZeroConfig, zero_settings_from_deepspeed_config
from lightning_memplan.model.result import MemoryEstimate
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec

ROOT = Path(__file__).resolve().parents[2]


@cache
def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("deepspeed_published", ROOT / "benchmarks" / "deepspeed_published.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["deepspeed_published"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _small() -> ModelSpec:
    return ModelSpec(n_layers=4, hidden=256, n_heads=4, vocab_size=1000, ffn_kind="swiglu", norm="rmsnorm")


def _train(**kw: Any) -> TrainSpec:
    return TrainSpec(micro_batch=1, seq_len=64, framework="deepspeed", **kw)


# --- published figures --------------------------------------------------------------------------------


def test_zero_paper_figure_1_within_2_percent() -> None:
    """Rajbhandari et al. 2019 Fig. 1: 7.5B params, 64 GPUs, K=12: 120 / 31.4 / 16.6 / 1.9 GB."""
    rows = _bench().fig1_rows()
    assert [stage for stage, _, _ in rows] == [0, 1, 2, 3]
    for stage, ours, paper in rows:
        assert abs(ours / paper - 1) < 0.02, (stage, ours, paper)
    # and the formulas exactly: (2 + 2 + 12) N, 4N + 12N/64, 2N + 14N/64, 16N/64 (+ unpartitioned norms)
    n, d = 7.5e9, 64
    exact = [16 * n, 4 * n + 12 * n / d, 2 * n + 14 * n / d, 16 * n / d]
    for (stage, ours, _), want in zip(rows, exact, strict=True):
        assert ours * 1e9 == pytest.approx(want, rel=1e-3), stage


def test_helper_table_matches_deepspeeds_formulas_up_to_the_named_terms() -> None:
    """Each row: ours - the named terms (what DeepSpeed allocates and its helper leaves out: ZeRO-3's 16-bit
    gradient partition buffer, its unpartitioned norm weights, the step's sub-group fp32 conversion) equals
    the helper's formula within 0.1% (rounding of N/d only). CPU: ours per node = helper / buffer factor for
    offload rows; without offload the helper's CPU figure is the start-up fp32 load and ours is 0."""
    bench = _bench()
    rows = bench.helper_rows()
    assert len(rows) == 10 and {r.model for r in rows} == {"1.3B (GPT-3 XL)", "7B (Llama)"}
    assert {(r.stage, r.offload) for r in rows} == set(bench.CASES)
    for r in rows:
        key = (r.model, r.stage, r.offload)
        assert r.gpu_ours - r.gpu_named == pytest.approx(r.gpu_helper, rel=1e-3), key
        if r.offload == "none":
            assert r.cpu_ours == 0 and r.cpu_named == 0, key
        else:
            assert r.cpu_ours - r.cpu_named == pytest.approx(r.cpu_helper / bench.BUFFER_FACTOR, rel=1e-3), key
        if r.stage == 3:  # the helper's largest layer is the embedding (V x h), as ours
            model = bench.table_models()[r.model]
            assert r.largest_layer == model.vocab_size * model.hidden, key
        # the named gaps are small next to the figures (at most 2N/d + 2N/gpus... of 16-20N/d)
        assert r.gpu_named <= 0.25 * r.gpu_ours and r.cpu_named <= 0.15 * max(r.cpu_ours, 1), key


def test_the_results_file_is_current() -> None:
    bench = _bench()
    assert bench.RESULTS.read_text(encoding="utf-8") == bench.render()


# --- the model ----------------------------------------------------------------------------------------


def test_stages_place_model_states_as_deepspeed_does() -> None:
    model, d = _small(), 4
    est = {z: estimate_memory(model, _train(), ParallelPlan(dp=d, zero=z)) for z in range(4)}
    n = est[0].details["local_params"]
    nd = -(-n // d)
    # 16-bit params on every rank for stages 0-2, their partition at stage 3 (+ the unpartitioned norms)
    assert est[0].params == est[1].params == est[2].params == 2 * n
    assert est[3].params == 2 * (nd + est[3].details["zero_persistent_params"])
    # fp32 master and Adam states: whole at stage 0, partitioned from stage 1
    assert est[0].by_phase["optimizer"]["master"] == 4 * n and est[1].by_phase["optimizer"]["master"] == 4 * nd
    assert est[2].by_phase["optimizer"]["optimizer"] == 8 * nd
    # gradients at the backward's end: whole at stage 1, the contiguous partition at stage 2
    assert est[1].details["zero_model_states_peak"] == 2 * n + 2 * n + 12 * nd
    assert est[2].details["zero_model_states_peak"] == 2 * n + 2 * nd + 12 * nd
    # no autocast copies: DeepSpeed casts the module to 16 bit; other is the batch alone (int64 token ids
    # and targets of b=1, s=64: 2 x 8 x 64 B)
    assert all(e.details["autocast_weight_copies"] == 0 and e.other == 2 * 8 * 64 for e in est.values())
    assert all(e.host == 0 for e in est.values())


def test_bucket_sizes_and_stage3_limits_are_read() -> None:
    model, plan2, plan3 = _small(), ParallelPlan(dp=2, zero=2), ParallelPlan(dp=2, zero=3)
    small = ZeroConfig(reduce_bucket_size=1000, prefetch_bucket_size=0, max_reuse_distance=0)
    big = ZeroConfig(reduce_bucket_size=2000, prefetch_bucket_size=0, max_reuse_distance=0)
    a, b = (estimate_memory(model, _train(zero_config=c), plan2) for c in (small, big))
    assert b.by_phase["backward"]["comm"] - a.by_phase["backward"]["comm"] == 1000 * 2  # one 16-bit bucket
    overlap = estimate_memory(model, _train(zero_config=small.__class__(**{**small.to_dict(), "overlap_comm": True})), plan2)
    assert overlap.by_phase["backward"]["comm"] == 2 * a.by_phase["backward"]["comm"]  # two with overlap_comm
    # ZeRO-3 keeps the last max_reuse_distance / 2 elements gathered at the loss
    near_est = estimate_memory(model, _train(zero_config=small), plan3)
    far = estimate_memory(model, _train(zero_config=ZeroConfig(reduce_bucket_size=1000, max_reuse_distance=10**9)),
                          plan3).by_phase["forward"]["comm"]
    n, largest = near_est.details["local_params"], near_est.details["zero_gathered_largest"] // 4
    # max_reuse_distance=0 keeps one module (the largest, V x h here); 1e9 keeps this small model whole
    assert far - near_est.by_phase["forward"]["comm"] == 2 * (n - largest) and largest == 1000 * 256


def test_offload_moves_states_to_the_host() -> None:
    model = _small()
    base = estimate_memory(model, _train(), ParallelPlan(dp=2, zero=3))
    opt = estimate_memory(model, _train(offload="optimizer"), ParallelPlan(dp=2, zero=3))
    par = estimate_memory(model, _train(offload="params"), ParallelPlan(dp=2, zero=3))
    nd = -(-base.details["local_params"] // 2)
    assert opt.master == opt.optimizer == 0 and opt.by_phase["backward"]["grads"] == 0
    assert opt.details["host_master"] == 4 * nd and opt.details["host_optimizer"] == 8 * nd
    assert opt.details["host_grads"] == (2 + 4) * nd  # the 16-bit partition and the fp32 buffer
    assert par.details["host_params"] == 2 * nd and par.params == 2 * par.details["zero_persistent_params"]
    assert base.host == 0 < opt.host < par.host and par.total < opt.total < base.total
    assert opt.host == sum(opt.details[f"host_{p}"] for p in ("params", "grads", "optimizer", "master", "buffers"))
    z2 = estimate_memory(model, _train(offload="optimizer"), ParallelPlan(dp=2, zero=2))
    assert z2.details["host_buffers"] > 0  # the 16-bit staging copy and the largest-parameter buffer


def test_host_is_in_the_estimate_dict_only_when_there_is_some() -> None:
    est = estimate_memory(_small(), _train(offload="optimizer"), ParallelPlan(dp=2, zero=2))
    data = est.to_dict()
    assert data["host"] == est.host > 0 and MemoryEstimate.from_dict(data) == est
    plain = estimate_memory(_small(), TrainSpec(micro_batch=1, seq_len=64), ParallelPlan(dp=2, zero=2))
    assert "host" not in plain.to_dict() and plain.host == 0


def test_train_spec_round_trips_with_zero_config() -> None:
    train = _train(offload="params", zero_config=ZeroConfig(reduce_bucket_size=123))
    back = TrainSpec.from_dict(json.loads(json.dumps(train.to_dict())))
    assert back == train and isinstance(back.zero_config, ZeroConfig)


# --- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("train", "plan", "match"),
    [
        (dict(offload="params"), ParallelPlan(dp=2, zero=2), r"offload='params' needs zero=3 \(got zero=2\).*zero=3"),
        (dict(offload="optimizer"), ParallelPlan(dp=2, zero=0), r"offload='optimizer' needs zero>=1"),
        (dict(), ParallelPlan(dp=2, pp=2, microbatches=2), r"framework='deepspeed'.*pp=2"),
    ],
)
def test_incompatible_plans_are_named_value_errors(train: dict[str, Any], plan: ParallelPlan, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        estimate_memory(_small(), _train(**train), plan)


def test_bad_train_spec_values() -> None:
    with pytest.raises(ValueError, match=r"offload='optimizer' needs framework='deepspeed'"):
        TrainSpec(micro_batch=1, seq_len=8, offload="optimizer")
    with pytest.raises(ValueError, match="offload"):
        _train(offload="disk")
    with pytest.raises(ValueError, match="zero_config is DeepSpeed's"):
        TrainSpec(micro_batch=1, seq_len=8, zero_config=ZeroConfig())
    with pytest.raises(TypeError, match="zero_config"):
        _train(zero_config=5)
    with pytest.raises(TypeError, match="unknown keys"):
        _train(zero_config={"reduce_bucket": 1})
    with pytest.raises(ValueError, match="reduce_bucket_size"):
        ZeroConfig(reduce_bucket_size=-1)


def test_reading_a_deepspeed_config() -> None:
    stage, offload, config = zero_settings_from_deepspeed_config({"zero_optimization": {
        "stage": 3, "reduce_bucket_size": 5e7, "stage3_prefetch_bucket_size": "auto",
        "stage3_max_live_parameters": 3e8, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu"},
    }})
    assert (stage, offload) == (3, "params")
    assert config.reduce_bucket_size == 50_000_000 and config.max_live_parameters == 300_000_000
    assert config.prefetch_bucket_size == ZeroConfig().prefetch_bucket_size  # "auto": DeepSpeed's default
    assert zero_settings_from_deepspeed_config({}) == (0, "none", ZeroConfig())
    with pytest.raises(ValueError, match="offload_param without offload_optimizer"):
        zero_settings_from_deepspeed_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    with pytest.raises(ValueError, match="stage"):
        zero_settings_from_deepspeed_config({"zero_optimization": {"stage": 4}})


# --- the callback's reader: Lightning's real DeepSpeedStrategy class ------------------------------------


def _lightning_deepspeed(**kwargs: Any) -> Any:
    """An instance of Lightning's real ``DeepSpeedStrategy`` holding the config Lightning itself builds.

    ``DeepSpeedStrategy.__init__`` imports deepspeed (not installed here), so the instance is made with
    ``__new__`` and its ``config`` by Lightning's own ``_create_default_config`` with the ``__init__``
    defaults; nothing is launched."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    defaults = {name: p.default for name, p in inspect.signature(DeepSpeedStrategy.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    defaults.update(kwargs)
    strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    names = inspect.signature(DeepSpeedStrategy._create_default_config).parameters
    zero_keys = ("stage", "contiguous_gradients", "overlap_comm", "allgather_partitions", "reduce_scatter",
                 "allgather_bucket_size", "reduce_bucket_size", "sub_group_size")
    args = {k: defaults[k] for k in names if k in defaults and k != "self"}
    strategy.config = DeepSpeedStrategy._create_default_config(
        strategy, **args, **{k: defaults[k] for k in zero_keys}
    )
    return strategy


def _trainer(strategy: Any, world: int = 4) -> Any:
    import torch

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    return SimpleNamespace(strategy=strategy, world_size=world, optimizers=[optimizer], precision="bf16-mixed",
                           accumulate_grad_batches=1, lightning_module=None)


def test_callback_reads_lightnings_deepspeed_strategy() -> None:
    strategy = _lightning_deepspeed(stage=3, offload_optimizer=True, offload_parameters=True)
    assert is_deepspeed(strategy)
    trainer = _trainer(strategy)
    plan, how = infer_plan(trainer)
    assert plan == ParallelPlan(dp=4, zero=3) and "offload params" in how
    import torch

    train = infer_train_spec(trainer, torch.zeros(2, 16, dtype=torch.long))
    assert (train.framework, train.offload) == ("deepspeed", "params")
    # Lightning's own defaults, not DeepSpeed's: 2e8 buckets, overlap_comm, pin_memory=False
    assert train.zero_config == ZeroConfig(reduce_bucket_size=200_000_000, allgather_bucket_size=200_000_000,
                                           overlap_comm=True, sub_group_size=10**12, pin_memory=False)
    est = estimate_memory(_small(), train, plan)
    assert est.host > 0


def test_deepspeed_stage_2_is_not_read_as_fsdp() -> None:
    trainer = _trainer(_lightning_deepspeed(), world=2)  # Lightning's default: stage 2, no offload
    plan, _ = infer_plan(trainer)
    import torch

    train = infer_train_spec(trainer, torch.zeros(1, 8, dtype=torch.long))
    assert plan.zero == 2 and train.framework == "deepspeed" and train.offload == "none"
    est = estimate_memory(_small(), train, plan)
    assert est.params == 2 * est.details["local_params"]  # whole 16-bit parameters on every rank (FSDP: 1/d)


def test_an_unreadable_config_is_an_inference_error() -> None:
    from lightning.pytorch.strategies import DeepSpeedStrategy

    strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    strategy.config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    with pytest.raises(InferenceError, match="train_spec="):
        infer_plan(_trainer(strategy))


# --- CLI --------------------------------------------------------------------------------------------------


def test_cli_estimate_prints_host_memory(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--model", "gpt2", "--seq-len", "128", "--dp", "4", "--zero", "3",
            "--framework", "deepspeed", "--offload", "optimizer"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "host memory" in out and "host optimizer" in out
    assert main([*args, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["train"]["offload"] == "optimizer" and payload["estimates"][0]["host"] > 0


def test_cli_refuses_params_offload_below_zero_3(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", "--model", "gpt2", "--seq-len", "128", "--dp", "4", "--zero", "2",
                 "--framework", "deepspeed", "--offload", "params"])
    assert code != 0
    assert "offload='params' needs zero=3" in capsys.readouterr().err


# --- report -------------------------------------------------------------------------------------------


def test_the_report_shows_host_memory_when_there_is_some() -> None:
    from lightning_memplan.report.records import EpochReport, MemoryReport, RankAccumulator, StepRecord
    from lightning_memplan.report.render import epoch_markdown, render_markdown

    est = estimate_memory(_small(), _train(offload="optimizer"), ParallelPlan(dp=2, zero=2))
    acc = RankAccumulator(rank=0, epoch=0, backend="cuda")
    acc.add(StepRecord(step=0, epoch=0, rank=0, estimated_peak=est.total, estimated_components=est.components(),
                       estimated_host=est.host))
    summary = acc.summary()
    assert summary.estimated_host == est.host
    assert type(summary).from_dict(json.loads(json.dumps(summary.to_dict()))) == summary
    epoch = EpochReport(epoch=0, ranks=(summary,))
    text = epoch_markdown(epoch, units="MiB")
    assert "host memory, offload" in text and f"{est.host / 2**20:.3f}" in text
    assert "host memory" in render_markdown(MemoryReport(epochs=(epoch,)), units="MiB")
    plain = RankAccumulator(rank=0, epoch=0, backend="cuda")
    plain.add(StepRecord(step=0, epoch=0, rank=0, estimated_peak=1))
    assert "estimated_host" not in plain.summary().to_dict()
    assert "host memory" not in epoch_markdown(EpochReport(epoch=0, ranks=(plain.summary(),)))
