"""The traced config-only path (tracking/hf_trace.py) against PyTorch's MemTracker on real HF models."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("transformers", reason="the traced config-only path builds the transformers class")

from lightning_memplan.model.estimate import estimate_memory  # noqa: E402
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec  # noqa: E402
from lightning_memplan.testing.hf_architectures import example_batch, measure_step  # noqa: E402
from lightning_memplan.tracking import hf_trace  # noqa: E402

pytestmark = pytest.mark.hf


def _llama(**extra):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=172, vocab_size=512, **extra)


def _measured(config, b: int, s: int, precision: str) -> int:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return measure_step(model, example_batch(model, b, s), precision=precision)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_config_only_llama_matches_memtracker_at_an_untraced_shape(precision: str) -> None:
    """3 blocks from depth-1/2 traces, at (b, s) = (3, 40) (traced: (1, 64), (2, 128)): within 1%."""
    config = _llama()
    spec = ModelSpec.from_hf_config(config)
    train = TrainSpec(micro_batch=3, seq_len=40, precision=precision, optimizer_impl="for_loop", device="cpu")
    est = estimate_memory(spec, train)
    measured = _measured(config, 3, 40, precision)
    assert est.source == "hf_trace"
    assert abs(est.total / measured - 1) < 0.01, (est.total, measured)
    # exact parameter count from the depth-1/2 copies (not the shape formula)
    assert est.params == sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_config(
        config).parameters()) * 4


def test_config_only_llama_extrapolates_to_long_context() -> None:
    """At s=1024 (8x the longest traced length) the estimate stays within 3% of MemTracker.

    Regression: a quadratic term fitted to the small phase-moment differences of an SDPA step (no [s, s]
    tensor is saved) extrapolated to terabytes at long context (llama3-70b at s=8192: 3.6 TiB).
    """
    config = _llama()
    spec = ModelSpec.from_hf_config(config)
    train = TrainSpec(micro_batch=1, seq_len=1024, precision="32-true", optimizer_impl="for_loop", device="cpu")
    est = estimate_memory(spec, train)
    measured = _measured(config, 1, 1024, "32-true")
    assert est.source == "hf_trace"
    assert abs(est.total / measured - 1) < 0.03, (est.total, measured)


def test_llama3_70b_config_at_8k_context_agrees_with_the_analytic_terms() -> None:
    """Llama-3-70B's config (no download), b=1, s=8192, FSDP 8: the traced path within 10% of the analytic
    terms (which match MemTracker for Llama-style SDPA models), never the b*s^2 blow-up.

    Regression: the SDPA trace fitted ~700 B per b*s^2 of opposite sign to 'activations' and 'attention';
    clamping each component at 0 then gave 3,639 GiB instead of ~400 GiB.
    """
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
           "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
           "num_hidden_layers": 80, "vocab_size": 128256, "max_position_embeddings": 8192,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False}
    spec = ModelSpec.from_hf_config(cfg)
    train = TrainSpec(micro_batch=1, seq_len=8192, precision="bf16-mixed")
    plan = ParallelPlan(dp=8, zero=3)
    traced = estimate_memory(spec, train, plan)
    # HF's LlamaRMSNorm is the composite fp32-upcast one: the analytic terms told so (the traced path reads it)
    analytic = estimate_memory(dataclasses.replace(spec, hf_config=None), train.replace(norm_impl="composite"), plan)
    assert traced.source == "hf_trace" and analytic.source != "hf_trace"
    assert abs(traced.total / analytic.total - 1) < 0.10, (traced.total, analytic.total)
    assert traced.attention < 0.15 * traced.total, traced.attention


def test_mixture_of_experts_traces_without_a_real_step() -> None:
    """Mixtral (4 experts, top-2): the grouped expert kernel is traced under fake tensors (no fallback)."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, vocab_size=512, num_local_experts=4, num_experts_per_tok=2)
    train = TrainSpec(micro_batch=2, seq_len=32, precision="bf16-mixed", optimizer_impl="for_loop", device="cpu")
    est = estimate_memory(ModelSpec.from_hf_config(config), train)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    measured = measure_step(model, example_batch(model, 2, 32), precision="bf16-mixed")
    assert est.source == "hf_trace" and abs(est.total / measured - 1) < 0.03, (est.total, measured)
    assert est.params == 4 * sum(p.numel() for p in model.parameters())  # every expert counted


def test_vision_config_without_vocab_is_estimated() -> None:
    from transformers import ViTConfig

    config = ViTConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                       image_size=32, patch_size=8, num_labels=10)
    spec = ModelSpec.from_hf_config(config)  # used to raise "missing vocab_size"
    s = hf_trace.vision_tokens(config.to_dict())
    est = estimate_memory(spec, TrainSpec(micro_batch=2, seq_len=s, precision="32-true", optimizer_impl="for_loop",
                                          device="cpu"))
    from transformers import ViTForImageClassification

    torch.manual_seed(0)
    model = ViTForImageClassification(config)
    measured = measure_step(model, example_batch(model, 2, s), precision="32-true")
    assert est.source == "hf_trace" and abs(est.total / measured - 1) < 0.03, (est.total, measured)


def test_plans_and_frozen_parameters_scale_the_traced_bytes() -> None:
    spec = ModelSpec.from_hf_config(_llama())
    train = TrainSpec(micro_batch=2, seq_len=64, precision="32-true", device="cpu")
    one = estimate_memory(spec, train)
    sharded = estimate_memory(spec, train, ParallelPlan(dp=4, zero=3))
    assert sharded.source == "hf_trace"
    assert sharded.by_phase["optimizer"]["params"] == pytest.approx(one.by_phase["optimizer"]["params"] / 4, rel=0.01)
    lora = estimate_memory(
        dataclasses.replace(spec, n_trainable_params=1000), train
    )
    assert lora.by_phase["optimizer"]["optimizer"] < one.by_phase["optimizer"]["optimizer"] / 20


def _no_trace(*args, **kwargs):
    raise AssertionError("traced again: the cache was not used")


def test_cache_memory_and_disk(tmp_path, monkeypatch) -> None:
    """The second estimate reads the in-memory entry, a fresh process (memory cleared) the JSON file;
    neither traces."""
    spec = ModelSpec.from_hf_config(_llama(rms_norm_eps=1e-5 + 1e-9))  # its own cache key
    train = TrainSpec(micro_batch=2, seq_len=64, precision="32-true", device="cpu")
    monkeypatch.setenv(hf_trace.CACHE_ENV, str(tmp_path))
    first = estimate_memory(spec, train)
    files = list(tmp_path.glob("hf_trace_*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["class"] == "LlamaForCausalLM"
    monkeypatch.setattr(hf_trace, "trace_depths", _no_trace)
    assert estimate_memory(spec, train) == first  # memory
    # another batch shape, loss mode and plan: scaled from the same entry (only TracedStep's fields key it)
    assert estimate_memory(spec, train.replace(micro_batch=3, seq_len=50)).total > first.total
    assert estimate_memory(spec, train.replace(loss="naive"), ParallelPlan(dp=2, zero=3)).source == "hf_trace"
    hf_trace.clear_cache()
    assert estimate_memory(spec, train) == first  # read back from disk, no trace


def test_cache_defaults_to_the_xdg_cache_dir(tmp_path, monkeypatch) -> None:
    from lightning_memplan.tracking import hf_cache

    monkeypatch.delenv(hf_trace.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert hf_cache.cache_dir() == tmp_path / "lightning_memplan" / "hf_trace"
    estimate_memory(ModelSpec.from_hf_config(_llama(rms_norm_eps=1e-5 + 2e-9)),
                    TrainSpec(micro_batch=1, seq_len=32, precision="32-true", device="cpu"))
    (path,) = (tmp_path / "lightning_memplan" / "hf_trace").glob("hf_trace_*.json")
    assert json.loads(path.read_text())["class"] == "LlamaForCausalLM"
    monkeypatch.setenv(hf_trace.CACHE_ENV, "0")
    assert hf_cache.cache_dir() is None


def test_cache_ignores_a_corrupt_file_with_a_warning(tmp_path, monkeypatch) -> None:
    """Not JSON, another key's entry, or an entry the parser rejects: warned about, computed again and
    rewritten; a good file is read without computing."""
    from lightning_memplan.tracking import hf_cache

    monkeypatch.setenv(hf_trace.CACHE_ENV, str(tmp_path))
    calls = []

    def compute():
        calls.append(1)
        return {"value": 7}

    key = hf_cache.entry_key("{}", "test-corrupt")
    path = tmp_path / f"hf_trace_{key}.json"
    assert hf_cache.cached(key, compute, lambda d: int(d["value"])) == 7 and len(calls) == 1
    hf_cache.clear_cache()
    assert hf_cache.cached(key, compute, lambda d: int(d["value"])) == 7 and len(calls) == 1  # from disk
    for garbage in ("{not json", json.dumps({"key": "another", "value": 7}), json.dumps({"key": key})):
        path.write_text(garbage)
        hf_cache.clear_cache()
        with pytest.warns(RuntimeWarning, match="ignoring the HF trace cache file"):
            assert hf_cache.cached(key, compute, lambda d: int(d["value"])) == 7
        assert json.loads(path.read_text()) == {"key": key, "value": 7}
    assert len(calls) == 4
    hf_cache.clear_cache()


def test_unknown_architecture_raises_naming_it() -> None:
    config = {"model_type": "not_a_real_arch", "num_hidden_layers": 2, "hidden_size": 64,
              "num_attention_heads": 4, "vocab_size": 100}
    spec = ModelSpec.from_hf_config(config)
    with pytest.raises(ValueError, match="not_a_real_arch.*ModelSpec"):
        estimate_memory(spec, TrainSpec(micro_batch=1, seq_len=16, device="cpu"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "row",
    [("gpt2", "bf16-mixed", "eager", 0.1, True), ("t5", "32-true", "eager", 0.0, False),
     ("qwen2_moe", "bf16-mixed", "sdpa", 0.1, False)],
    ids=["gpt2-bf16-eager-dropout-ckpt", "t5-fp32", "qwen2moe-bf16-dropout"],
)
def test_benchmark_rows_stay_within_targets(row, monkeypatch) -> None:
    """A few rows of benchmarks/bench_hf_architectures.py at tiny shapes (b=1, s=32): config-only within
    3% and traced within 0.5% of MemTracker."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_hf_architectures.py"
    spec = importlib.util.spec_from_file_location("bench_hf_architectures", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(__import__("sys").modules, spec.name, bench)  # its dataclasses look themselves up
    spec.loader.exec_module(bench)
    result = bench.run_row(*row, micro_batch=1, seq_len=32)
    assert result.source == "hf_trace"
    assert abs(result.config_error) < bench.CONFIG_TARGET, result
    assert abs(result.traced_error) < bench.TRACED_TARGET, result


def test_from_module_keeps_the_config_only_for_the_bare_model() -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_llama())
    assert ModelSpec.from_module(model).hf_config is not None  # exactly what the config builds
    model.model.embed_tokens.weight.requires_grad_(False)
    frozen = ModelSpec.from_module(model)
    assert frozen.hf_config is None and frozen.n_trainable_params == frozen.n_params - 512 * 64
    model.model.embed_tokens.weight.requires_grad_(True)
    model.gradient_checkpointing_enable()
    assert ModelSpec.from_module(model).hf_config is None
    from lightning_memplan.model.introspect import recompute_of

    assert recompute_of(model) == "full"


@pytest.mark.parametrize(("precision", "optimizer"), [("32-true", "adamw"), ("bf16-mixed", "adamw"), ("32-true", "sgd")])
def test_primed_one_step_trace_equals_the_two_step_steady_state(precision: str, optimizer: str) -> None:
    """The config-only path traces one step with zero gradients and optimizer states made by torch's own
    step (half the trace time); every phase, component and pinned moment of the calibration is the same,
    byte for byte, as tracing two Lightning-order steps. Plain SGD allocates nothing in its step, so its
    optimizer phase peaks at the phase's start: the other shape is measured at that "start" moment too
    (tests/distributed/test_strategy_hf.py's tiny Llama once failed there)."""
    from lightning_memplan.model.hf_build import build_reduced, input_fn_for
    from lightning_memplan.model.traced import traced_train
    from lightning_memplan.tracking.hf_calibrate import primed_optimizer
    from lightning_memplan.tracking.trace import calibrate

    cfg = _llama().to_dict()
    t0 = traced_train(TrainSpec(micro_batch=2, seq_len=32, precision=precision, optimizer=optimizer,
                                optimizer_impl="for_loop", device="cpu"), "cpu")
    model = build_reduced(cfg, 2, attention=t0.attention, recompute=t0.recompute)
    input_fn, _ = input_fn_for(model, cfg)
    shapes = ((1, 16), (2, 32))
    two = calibrate(model, shapes, input_fn=input_fn, precision=precision, optimizer=optimizer,
                    optimizer_impl="for_loop", quadratic=False)
    one = calibrate(model, shapes, input_fn=input_fn, precision=precision, steps=1,
                    optimizer=primed_optimizer(optimizer, "for_loop"), quadratic=False)
    assert one == two


@pytest.mark.parametrize(
    ("family", "targets"),
    [("llama", ("q_proj", "v_proj")), ("llama", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj")),
     ("gpt2", ("c_attn", "c_proj")), ("phi3", ("qkv_proj", "gate_up_proj")), ("gpt_neox", ("query_key_value",))],
)
def test_with_lora_counts_what_peft_trains(family: str, targets: tuple[str, ...]) -> None:
    """ModelSpec.with_lora (no peft) equals peft's trainable count on the real model."""
    peft = pytest.importorskip("peft")
    from lightning_memplan.testing.hf_architectures import ARCHITECTURES
    from lightning_memplan.tracking.hf_trace import model_class

    config = ARCHITECTURES[family].config(0.0)
    model = peft.get_peft_model(model_class(config)._from_config(config),
                                peft.LoraConfig(r=4, target_modules=list(targets)))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert ModelSpec.from_hf_config(config).with_lora(rank=4, targets=targets).n_trainable_params == trained


def test_with_lora_refuses_an_unknown_module_name() -> None:
    spec = ModelSpec.from_hf_config(_llama())
    with pytest.raises(ValueError, match="wq.*n_trainable_params"):
        spec.with_lora(rank=8, targets=("wq",))
    with pytest.raises(TypeError, match="list of module names"):
        spec.with_lora(rank=8, targets="q_proj")  # type: ignore[arg-type]


def test_a_cuda_estimate_scales_the_cpu_trace_with_the_traced_class_norms() -> None:
    """A CPU trace scaled to CUDA takes the traced class's RMSNorm (HF Llama's composite fp32-upcast one,
    detected on the built copy), whatever ``norm_impl`` the TrainSpec says: on CUDA a fused norm would save
    the bf16 input where the composite one saves an fp32 copy too (terms.norm_saved_bytes)."""
    spec = ModelSpec.from_hf_config(_llama())
    train = TrainSpec(micro_batch=2, seq_len=64, precision="bf16-mixed", device="cuda")
    native, composite = (estimate_memory(spec, train.replace(norm_impl=impl)) for impl in ("native", "composite"))
    assert native.source == composite.source == "hf_trace"
    assert native.total == composite.total and native.activations == composite.activations
    # on CPU both implementations save the same fp32 copy, so the CPU trace is the CUDA answer for a
    # composite norm; a fused-norm CUDA step (the analytic ratio with "native") would be smaller
    cpu = estimate_memory(spec, train.replace(device="cpu"))
    analytic = dataclasses.replace(spec, hf_config=None)
    fused_ratio = (estimate_memory(analytic, train.replace(norm_impl="native")).activations
                   / estimate_memory(analytic, train.replace(norm_impl="native", device="cpu")).activations)
    assert fused_ratio < 0.97  # the variant matters on CUDA at this shape, so the check below can fail
    assert composite.activations > 1.02 * fused_ratio * cpu.activations


def test_use_cache_false_is_estimated_like_the_real_step() -> None:
    """Issue 25: an HF Llama built with ``use_cache=False`` traced about 8% high (b=4). Config-only and
    ``trace_memory`` on the module both within 1% of MemTracker at a held-out (4, 48)."""
    from lightning_memplan.tracking.trace import trace_memory

    config = _llama()
    config.use_cache = False
    measured = _measured(config, 4, 48, "32-true")
    train = TrainSpec(micro_batch=4, seq_len=48, precision="32-true", optimizer_impl="for_loop", device="cpu")
    est = estimate_memory(ModelSpec.from_hf_config(config), train)
    assert est.source == "hf_trace" and abs(est.total / measured - 1) < 0.01, (est.total, measured)
    model = __import__("transformers").AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    traced = trace_memory(model, example_input=example_batch(model, 4, 48), optimizer_impl="for_loop")
    assert abs(traced.estimate.total / measured - 1) < 0.01, (traced.estimate.total, measured)
