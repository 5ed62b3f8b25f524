"""Snapshot of ``estimate_memory``'s answers, as canonical JSON, to compare two trees byte for byte.

Two tables:

- ``analytic``: the hand-written terms on a fixed grid: presets gpt2, gpt2-medium, llama-7b, llama3-8b
  x ``TrainSpec.framework`` (torch, megatron, llama3) x ``recompute`` (none, selective, selective_op,
  full) x ``attention`` (sdpa, eager) x 6 layouts (one device; DDP; FSDP zero=3; TP+SP; a 1F1B-interleaved
  pipeline with TP; a GPipe pipeline with ZeRO-1) x 2 loss modes per layout x ``rank`` (None, 0):
  4 * 3 * 4 * 2 * 6 * 2 * 2 = 2,304 cases. A case the estimate refuses is recorded by its error text.
- ``hf``: the config-only estimates of the Hugging Face architecture grid of
  ``benchmarks/bench_hf_architectures.py`` (14 architectures x 2 precisions x sdpa/eager (T5: eager) x
  dropout 0/0.1 x HF checkpointing: 216 rows), ``estimate_memory(ModelSpec.from_hf_config(model.config),
  TrainSpec(...))`` exactly as that benchmark asks it (transformers needed; traced, so slow: every row
  traces its own config and step). ``--entries PATH`` also writes the traced coefficient entries the
  rows used (what the coefficient source returns, keyed by config JSON and traced step) for
  ``tests/unit/test_estimate_snapshot.py``, which replays them without tracing.


Eight more tables (:data:`COVERAGE_TABLES`, issue 34), cheap (no tracing), from public names only:

- ``coverage``: every framework and layout of :data:`COVERAGE_LAYOUTS` (torch single, DDP with and without
  buckets, ZeRO-1, FSDP2 ZeRO-2/3 with ``reshard_after_forward=2`` and own embedding/head units, TP+SP,
  TP x FSDP, CP, 1F1B, GPipe, interleaved, FSDP2 inside pipeline stages (ZeRO-3, ZeRO-2, replicate),
  FSDP2's ``CPUOffloadPolicy`` and activation offloading; Megatron and Llama 3 layouts; FSDP1 NO_SHARD,
  SHARD_GRAD_OP and FULL_SHARD; DeepSpeed ZeRO 0-3 with and without optimizer/parameter offload, with TP
  and with a ``zero_config``) x recompute (4) x attention (2) x two models (gpt2: learned positions, tied,
  LayerNorm, GELU; llama3-8b: RoPE, GQA, SwiGLU, RMSNorm) x ``rank`` (None, the last rank), two loss modes
  per case rotating over all five.
- ``variants``: every layout x :data:`TRAIN_VARIANTS` (precisions, master weights, optimizers and their
  implementations, gradient accumulation, the CPU device, RMSNorm implementations, byte overrides, chunk
  sizes, other shapes) and :data:`MODEL_VARIANTS` (dropout, explicit ``n_params``, LoRA, module buffers,
  mixture-of-experts and multi-head latent attention read from published configs), recompute and
  attention rotating; ``rank`` None and the last rank.
- ``eval``: ``estimate_eval_memory`` per layout (val with and without a KV cache, predict with a
  generate); ``checkpoint``: ``estimate_checkpoint_memory`` per layout (full/sharded, CPU offload or not);
  ``reserved``: ``reserved_memory`` of the coverage estimates (rank None); ``planner``: ``plan()``'s
  decisions (and ``max_micro_batch`` / ``max_seq_len``) on a few clusters.
- ``calibrated``: every layout x recompute x attention with fixed fitted coefficients
  (``estimate_memory(..., calibration=...)``).
- ``hf_plans``: the stored traced entries of the ``hf`` rows (``--entries``'s file) replayed under
  parallel plans (every architecture, both precisions, FSDP, TP, a pipeline): the traced path's scaling
  by the analytic stage estimate.

Only public names that exist before and after the package reorganisation are imported; moved internals
are looked up at both places.

Run: ``python benchmarks/estimate_snapshot.py [--tables analytic hf coverage ...] [--out PATH]
[--entries PATH] [--stored-entries PATH]`` (``--out`` ending in ``.gz`` is gzip-compressed, with a fixed
mtime, so equal tables give equal files).
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import itertools
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# Runnable from a checkout: the repository root after any installed copy (PYTHONPATH=<another tree> wins).
sys.path.append(str(Path(__file__).resolve().parents[1]))

from lightning_memplan import ModelSpec, ParallelPlan, TrainSpec, estimate_memory  # noqa: E402

PRESETS = ("gpt2", "gpt2-medium", "llama-7b", "llama3-8b")
FRAMEWORKS = ("torch", "megatron", "llama3")
RECOMPUTE = ("none", "selective", "selective_op", "full")
ATTENTION = ("sdpa", "eager")
#: (name, plan, the two loss modes it is paired with)
LAYOUTS: tuple[tuple[str, ParallelPlan, tuple[str, str]], ...] = (
    ("single", ParallelPlan(), ("naive", "fp32_upcast")),
    ("ddp8", ParallelPlan(dp=8), ("chunked", "naive")),
    ("fsdp8", ParallelPlan(dp=8, zero=3), ("fp32_upcast", "chunked")),
    ("tp4sp_dp2", ParallelPlan(dp=2, tp=4, sp=True), ("vocab_parallel", "loss_parallel")),
    ("pp4_interleaved_v2_tp2", ParallelPlan(tp=2, pp=4, microbatches=8, schedule="interleaved", virtual_stages=2),
     ("vocab_parallel", "chunked")),
    ("pp2_gpipe_dp2_zero1", ParallelPlan(dp=2, pp=2, microbatches=4, schedule="gpipe", zero=1),
     ("naive", "fp32_upcast")),
)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _answer(model: ModelSpec, train: TrainSpec, plan: ParallelPlan | None, rank: int | None) -> dict[str, Any]:
    try:
        return estimate_memory(model, train, plan, rank=rank).to_dict()
    except (ValueError, TypeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def analytic_table() -> dict[str, Any]:
    """``{case key: MemoryEstimate.to_dict() or {"error": ...}}`` for the 2,304-case grid."""
    out: dict[str, Any] = {}
    for preset, framework, recompute, attention, (layout, plan, losses), rank in itertools.product(
        PRESETS, FRAMEWORKS, RECOMPUTE, ATTENTION, LAYOUTS, (None, 0)
    ):
        model = ModelSpec.preset(preset)
        for loss in losses:
            train = TrainSpec(micro_batch=2, seq_len=2048, precision="bf16-mixed", recompute=recompute,
                              attention=attention, loss=loss, framework=framework)
            key = f"{preset}|{framework}|{recompute}|{attention}|{layout}|{loss}|rank={rank}"
            out[key] = _answer(model, train, plan, rank)
    return out


def _import_first(*names: str) -> Any:
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(f"none of {names} imports")


def hf_rows() -> list[tuple[str, str, str, float, bool]]:
    """The 216 rows of ``bench_hf_architectures.grid`` (full grid): every architecture x (dropout,
    checkpointing) x precision x its attention implementations."""
    from lightning_memplan.testing.hf_architectures import ARCHITECTURES

    return [
        (name, precision, attention, dropout, ckpt)
        for dropout, ckpt in ((0.0, False), (0.1, False), (0.0, True), (0.1, True))
        for precision in ("32-true", "bf16-mixed")
        for name, arch in ARCHITECTURES.items()
        for attention in arch.attentions
    ]


def hf_table(entries: dict[str, Any] | None) -> dict[str, Any]:
    """``{row key: MemoryEstimate.to_dict() or {"error": ...}}`` of the config-only HF grid; records the
    traced entries into ``entries`` (``{config JSON + traced step JSON: entry}``) when given."""
    from lightning_memplan.testing.hf_architectures import ARCHITECTURES, build_model

    hf_trace = _import_first("lightning_memplan.tracking.hf_trace", "lightning_memplan.model.hf_trace")
    if entries is not None:
        _record_entries(entries)
    out: dict[str, Any] = {}
    for name, precision, attention, dropout, ckpt in hf_rows():
        arch = ARCHITECTURES[name]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = build_model(arch, dropout=dropout, attention=attention, checkpointing=ckpt)
            s = hf_trace.vision_tokens(model.config.to_dict()) if arch.vision else 128
            train = TrainSpec(micro_batch=2, seq_len=s, precision=precision, attention=attention,
                              recompute="full" if ckpt else "none", optimizer_impl="for_loop", device="cpu")
            spec = ModelSpec.from_hf_config(model.config)
            key = f"{name}|{precision}|{attention}|{dropout:g}|ckpt={ckpt}"
            out[key] = _answer(spec, train, None, None)
            out[key]["hf_config"] = spec.hf_config
            out[key]["train"] = train.to_dict()
    return out


def _record_entries(entries: dict[str, Any]) -> None:
    """Wrap ``trace_depths`` where the tracer calls it so each traced entry is kept (key: the config
    JSON and the traced step's JSON, what ``tests/unit/test_estimate_snapshot.py`` looks up)."""
    calibrate = _import_first("lightning_memplan.tracking.hf_calibrate", "lightning_memplan.model.hf_calibrate")
    original = calibrate.trace_depths

    def recording(cfg: Any, t0: Any) -> dict[str, Any]:
        entry = original(cfg, t0)
        from lightning_memplan.model.hf_build import canonical_config_json

        entries[canonical_config_json(dict(cfg)) + "\n" + t0.to_json()] = entry
        return entry

    calibrate.trace_depths = recording
    for name in ("lightning_memplan.tracking.hf_trace", "lightning_memplan.model.hf_trace"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "trace_depths"):
            module.trace_depths = recording


# ----------------------------------------------------------------------------------- issue 34's coverage
#: (framework, name, plan, TrainSpec overrides)
COVERAGE_LAYOUTS: tuple[tuple[str, str, ParallelPlan, dict[str, Any]], ...] = (
    ("torch", "single", ParallelPlan(), {}),
    ("torch", "ddp8", ParallelPlan(dp=8), {}),
    ("torch", "ddp8_no_buckets", ParallelPlan(dp=8, grad_buckets=False), {}),
    ("torch", "zero1_dp8", ParallelPlan(dp=8, zero=1), {}),
    ("torch", "fsdp2_zero2_dp8", ParallelPlan(dp=8, zero=2), {}),
    ("torch", "fsdp2_zero3_dp8", ParallelPlan(dp=8, zero=3), {}),
    ("torch", "fsdp2_zero3_reshard2", ParallelPlan(dp=8, zero=3, reshard_after_forward=2), {}),
    ("torch", "fsdp2_zero3_own_units", ParallelPlan(dp=8, zero=3, own_units=("embedding", "head")), {}),
    ("torch", "tp4_sp", ParallelPlan(tp=4, sp=True), {}),
    ("torch", "tp2_dp4_zero3", ParallelPlan(dp=4, tp=2, zero=3), {}),
    ("torch", "cp2_dp4_zero3", ParallelPlan(dp=4, cp=2, zero=3), {}),
    ("torch", "pp4_1f1b_m8", ParallelPlan(pp=4, microbatches=8), {}),
    ("torch", "pp2_gpipe_m4_dp2_zero1", ParallelPlan(dp=2, pp=2, microbatches=4, schedule="gpipe", zero=1), {}),
    ("torch", "pp4_interleaved_v2_tp2",
     ParallelPlan(tp=2, pp=4, microbatches=8, schedule="interleaved", virtual_stages=2), {}),
    ("torch", "pp2_fsdp2_zero3_m2", ParallelPlan(dp=2, pp=2, zero=3, microbatches=2), {}),
    ("torch", "pp2_fsdp2_zero2_m4", ParallelPlan(dp=2, pp=2, zero=2, microbatches=4), {}),
    ("torch", "pp2_replicate_m2", ParallelPlan(dp=2, pp=2, microbatches=2, grad_buckets=False), {}),
    ("torch", "offload_params_single", ParallelPlan(), {"offload": "params"}),
    ("torch", "offload_params_zero3_dp8", ParallelPlan(dp=8, zero=3), {"offload": "params"}),
    ("torch", "offload_params_zero2_dp8", ParallelPlan(dp=8, zero=2), {"offload": "params"}),
    ("torch", "offload_acts_single", ParallelPlan(), {"offload_activations": True}),
    ("torch", "offload_acts_zero3_dp8", ParallelPlan(dp=8, zero=3), {"offload_activations": True}),
    ("torch", "offload_both_zero3_dp8", ParallelPlan(dp=8, zero=3), {"offload": "params", "offload_activations": True}),
    ("megatron", "tp4_sp_dp2", ParallelPlan(dp=2, tp=4, sp=True), {}),
    ("megatron", "pp4_interleaved_v2_tp2",
     ParallelPlan(tp=2, pp=4, microbatches=8, schedule="interleaved", virtual_stages=2), {}),
    ("llama3", "tp4_sp_dp2_zero3", ParallelPlan(dp=2, tp=4, sp=True, zero=3), {}),
    ("llama3", "pp2_fsdp_zero3_m4", ParallelPlan(dp=2, pp=2, zero=3, microbatches=4), {}),
    ("llama3", "pp4_interleaved_v2_tp2_dp2",
     ParallelPlan(dp=2, tp=2, pp=4, microbatches=8, schedule="interleaved", virtual_stages=2, zero=1), {}),
    ("fsdp1", "single", ParallelPlan(), {}),
    ("fsdp1", "no_shard_dp8", ParallelPlan(dp=8), {}),
    ("fsdp1", "shard_grad_op_dp8", ParallelPlan(dp=8, zero=2), {}),
    ("fsdp1", "full_shard_dp8", ParallelPlan(dp=8, zero=3), {}),
    ("deepspeed", "zero0_dp8", ParallelPlan(dp=8), {}),
    ("deepspeed", "zero1_dp8", ParallelPlan(dp=8, zero=1), {}),
    ("deepspeed", "zero2_dp8", ParallelPlan(dp=8, zero=2), {}),
    ("deepspeed", "zero3_dp8", ParallelPlan(dp=8, zero=3), {}),
    ("deepspeed", "zero1_dp8_offload_optimizer", ParallelPlan(dp=8, zero=1), {"offload": "optimizer"}),
    ("deepspeed", "zero2_dp8_offload_optimizer", ParallelPlan(dp=8, zero=2), {"offload": "optimizer"}),
    ("deepspeed", "zero3_dp8_offload_optimizer", ParallelPlan(dp=8, zero=3), {"offload": "optimizer"}),
    ("deepspeed", "zero3_dp8_offload_params", ParallelPlan(dp=8, zero=3), {"offload": "params"}),
    ("deepspeed", "zero3_tp2_dp4", ParallelPlan(dp=4, tp=2, zero=3), {}),
    ("deepspeed", "zero3_dp8_config", ParallelPlan(dp=8, zero=3),
     {"zero_config": {"reduce_bucket_size": 50_000_000, "prefetch_bucket_size": 10_000_000,
                      "param_persistence_threshold": 1_000_000, "allgather_bucket_size": 100_000_000,
                      "overlap_comm": True, "contiguous_gradients": False}}),
)
COVERAGE_MODELS = ("gpt2", "llama3-8b")
LOSSES = ("naive", "fp32_upcast", "chunked", "vocab_parallel", "loss_parallel")

#: (name, TrainSpec overrides): one axis value each
TRAIN_VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("fp32", {"precision": "32-true"}),
    ("bf16_true", {"precision": "bf16-true"}),
    ("fp16_mixed", {"precision": "16-mixed"}),
    ("fp16_true", {"precision": "16-true"}),
    ("bf16_true_master", {"precision": "bf16-true", "master_weights": True}),
    ("adam_fused", {"optimizer": "adam", "optimizer_impl": "fused"}),
    ("adamw_for_loop", {"optimizer_impl": "for_loop"}),
    ("sgd", {"optimizer": "sgd"}),
    ("sgd_momentum", {"optimizer": "sgd_momentum"}),
    ("adamw8bit", {"optimizer": "adamw8bit"}),
    ("lion_foreach", {"optimizer": "lion"}),
    ("lion_for_loop", {"optimizer": "lion", "optimizer_impl": "for_loop"}),
    ("adafactor", {"optimizer": "adafactor"}),
    ("accumulate4", {"grad_accumulation": 4}),
    ("grads_freed_before_forward", {"grads_alive_in_forward": False}),
    ("cpu", {"device": "cpu", "optimizer_impl": "for_loop"}),
    ("cpu_fp32", {"device": "cpu", "precision": "32-true"}),
    ("rmsnorm_composite", {"norm_impl": "composite"}),
    ("rmsnorm_composite_fp32", {"norm_impl": "composite_fp32"}),
    ("byte_overrides", {"precision": "bf16-true", "param_bytes": 2, "grad_bytes": 4, "master_bytes": 4,
                        "optimizer_bytes_per_param": 6.0, "activation_bytes": 2}),
    ("chunked_1024", {"loss": "chunked", "loss_chunk_size": 1024}),
    ("chunked_cpu", {"loss": "chunked", "device": "cpu"}),
    ("short_b1", {"micro_batch": 1, "seq_len": 512}),
    ("long_b4", {"micro_batch": 4, "seq_len": 4096}),
)


def _published(name: str) -> dict[str, Any]:
    path = Path(__file__).resolve().parents[1] / "tests" / "data" / "published_configs" / f"{name}.json"
    return dict(json.loads(path.read_text()))


def model_variants() -> dict[str, ModelSpec]:
    """The model axis of the ``variants`` table: dense presets changed one field at a time, a LoRA spec,
    and mixture-of-experts / latent-attention specs read (analytically) from published configs."""
    gpt2, llama = ModelSpec.preset("gpt2"), ModelSpec.preset("llama3-8b")
    import dataclasses

    return {
        "gpt2_dropout": dataclasses.replace(gpt2, dropout=0.1),
        "gpt2_qkv_fused_bias": dataclasses.replace(gpt2, qkv_fused=True, bias=True),
        "llama3_n_params": dataclasses.replace(llama, n_params=8_030_261_248),
        "llama3_buffers": dataclasses.replace(llama, buffer_bytes=2 * 4096 * 128 * 4),
        "llama3_lora": llama.with_lora(rank=16, targets=("q_proj", "k_proj", "v_proj", "o_proj")),
        "llama3_lora_dropout": llama.with_lora(rank=8, dropout=0.05),
        "mixtral_8x7b": ModelSpec.from_hf_config(_published("mixtral-8x7b"), calibration="analytic"),
        "qwen3_30b_a3b": ModelSpec.from_hf_config(_published("qwen3-30b-a3b"), calibration="analytic"),
        "deepseek_v3": ModelSpec.from_hf_config(_published("deepseek-v3"), calibration="analytic"),
    }


def _train(framework: str, overrides: dict[str, Any], **fields: Any) -> TrainSpec:
    base: dict[str, Any] = {"micro_batch": 2, "seq_len": 2048, "precision": "bf16-mixed", "framework": framework}
    return TrainSpec(**{**base, **overrides, **fields})


def _case(model: ModelSpec, framework: str, overrides: dict[str, Any], plan: ParallelPlan, rank: int | None,
          **fields: Any) -> dict[str, Any]:
    try:
        train = _train(framework, overrides, **fields)
    except (ValueError, TypeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return _answer(model, train, plan, rank)


def _ranks(plan: ParallelPlan) -> tuple[int | None, int]:
    return None, plan.world_size - 1


def coverage_table() -> dict[str, Any]:
    """Every layout x recompute x attention x model x rank, two loss modes per case rotating over five."""
    out: dict[str, Any] = {}
    counter = itertools.count()
    for (framework, name, plan, overrides), preset, recompute, attention in itertools.product(
        COVERAGE_LAYOUTS, COVERAGE_MODELS, RECOMPUTE, ATTENTION
    ):
        model = ModelSpec.preset(preset)
        i = next(counter)
        for loss in (LOSSES[i % 5], LOSSES[(i + 2) % 5]):
            for rank in _ranks(plan):
                key = f"{framework}|{name}|{preset}|{recompute}|{attention}|{loss}|rank={rank}"
                out[key] = _case(model, framework, overrides, plan, rank, recompute=recompute,
                                 attention=attention, loss=loss)
    return out


def variants_table() -> dict[str, Any]:
    """Every layout x each train variant (on llama3-8b) and each model variant, recompute, attention and
    loss rotating so that each variant meets several of them."""
    out: dict[str, Any] = {}
    models = model_variants()
    llama = ModelSpec.preset("llama3-8b")
    axes = [(f"train:{n}", llama, o) for n, o in TRAIN_VARIANTS] + [(f"model:{n}", m, {}) for n, m in models.items()]
    counter = itertools.count()
    for (framework, name, plan, layout_overrides), (variant, model, overrides) in itertools.product(
        COVERAGE_LAYOUTS, axes
    ):
        i = next(counter)
        fields = {"recompute": RECOMPUTE[i % 4], "attention": ATTENTION[(i // 4) % 2], "loss": LOSSES[(i // 3) % 5]}
        fields.update(overrides)
        for rank in _ranks(plan):
            key = f"{framework}|{name}|{variant}|{fields['recompute']}|{fields['attention']}|{fields['loss']}|rank={rank}"
            out[key] = _case(model, framework, layout_overrides, plan, rank, **fields)
    return out


def _guarded(call: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``call``'s answer, or the text of the error it raised (223c039 raised ``KeyError: 'forward_block'``
    for a calibration under activation offloading: recorded as it was)."""
    try:
        return dict(call(*args, **kwargs))
    except (ValueError, TypeError, KeyError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def eval_table() -> dict[str, Any]:
    """``estimate_eval_memory`` per layout and model: val, val with a KV cache and held hidden states,
    predict with a generate, test after the first step (no optimizer states, no gradients)."""
    from lightning_memplan.model.eval_estimate import estimate_eval_memory

    cases = (
        ("val", {"phase": "val"}),
        ("val_kv_cache", {"phase": "val", "kv_cache": True, "held_hidden": 1}),
        ("predict_generate", {"phase": "predict", "generate_tokens": 16, "kv_cache": True}),
        ("test_fresh", {"phase": "test", "grads_alive": False, "optimizer_states": False}),
    )
    out: dict[str, Any] = {}
    for (framework, name, plan, overrides), preset, (case, kwargs) in itertools.product(
        COVERAGE_LAYOUTS, COVERAGE_MODELS, cases
    ):
        model = ModelSpec.preset(preset)
        attention = "eager" if "kv" in case else "sdpa"
        for rank in _ranks(plan):
            out[f"{framework}|{name}|{preset}|{case}|rank={rank}"] = _guarded(
                lambda *a, **k: estimate_eval_memory(*a, **k).to_dict(), model,
                _train(framework, overrides, attention=attention), plan, micro_batch=4, seq_len=1024, rank=rank,
                **kwargs)
    return out


def checkpoint_table() -> dict[str, Any]:
    """``estimate_checkpoint_memory`` per layout and model: full or sharded state dict, with or without the
    CPU offload, on CUDA; one CPU save."""
    from lightning_memplan.model.checkpoint_estimate import estimate_checkpoint_memory

    cases = (("full_offload", True, True, "cuda"), ("full", True, False, "cuda"),
             ("sharded_offload", False, True, "cuda"), ("sharded_cpu", False, True, "cpu"))
    out: dict[str, Any] = {}
    for (framework, name, plan, overrides), preset, (case, full, cpu_offload, device) in itertools.product(
        COVERAGE_LAYOUTS, COVERAGE_MODELS, cases
    ):
        model = ModelSpec.preset(preset)
        for rank in _ranks(plan):
            out[f"{framework}|{name}|{preset}|{case}|rank={rank}"] = _guarded(
                lambda *a, **k: estimate_checkpoint_memory(*a, **k).to_dict(), model, _train(framework, overrides),
                plan, full_state_dict=full, cpu_offload=cpu_offload, rank=rank, device=device)
    return out


def _reserved_case(model: ModelSpec, framework: str, overrides: dict[str, Any], plan: ParallelPlan, recompute: str,
                   expandable: bool) -> dict[str, Any]:
    import dataclasses

    from lightning_memplan.model.reserved import reserved_memory

    train = _train(framework, overrides, recompute=recompute, loss="chunked")
    r = reserved_memory(model, train, plan, estimate_memory(model, train, plan), expandable_segments=expandable)
    return {**dataclasses.asdict(r), "reserved": r.reserved}


def reserved_table() -> dict[str, Any]:
    """``reserved_memory`` of the worst rank's estimate per layout, model and recompute mode (sdpa, chunked
    loss), with and without expandable segments."""
    out: dict[str, Any] = {}
    for (framework, name, plan, overrides), preset, recompute in itertools.product(
        COVERAGE_LAYOUTS, COVERAGE_MODELS, RECOMPUTE
    ):
        model = ModelSpec.preset(preset)
        for expandable in (False, True):
            out[f"{framework}|{name}|{preset}|{recompute}|expandable={expandable}"] = _guarded(
                _reserved_case, model, framework, overrides, plan, recompute, expandable)
    return out


def planner_table() -> dict[str, Any]:
    """``plan()``'s decisions on a few clusters (a fit, a cramped one that offloads, a constrained search,
    a multi-node one) and the largest-fit searches of ``planning/fit.py``."""
    from lightning_memplan import HardwareSpec, plan
    from lightning_memplan.planning.fit import max_micro_batch, max_seq_len

    llama, gpt2 = ModelSpec.preset("llama3-8b"), ModelSpec.preset("gpt2")
    h100 = HardwareSpec.preset("h100-sxm")
    cases: dict[str, Any] = {
        "llama3_8b_h100x8": lambda: plan(llama, TrainSpec(micro_batch=2, seq_len=2048), h100, global_batch=64),
        "llama3_8b_a100_40gb_x4_offload": lambda: plan(
            llama, TrainSpec(micro_batch=1, seq_len=4096), HardwareSpec.preset("a100-40gb", gpus_per_node=4),
            global_batch=8, host_memory_budget=400e9),
        "llama3_8b_h100_allow": lambda: plan(
            llama, TrainSpec(micro_batch=2, seq_len=2048, recompute="selective_op"), h100, global_batch=32,
            allow={"tp": [1, 2], "zero": [0, 3], "recompute": ["none", "full"]}),
        "llama3_70b_h100_4_nodes": lambda: plan(
            ModelSpec.preset("llama3-70b"), TrainSpec(micro_batch=1, seq_len=8192),
            HardwareSpec.preset("h100-sxm", num_nodes=4), global_batch=128),
        "gpt2_l4_chunked": lambda: plan(gpt2, TrainSpec(micro_batch=8, seq_len=1024, loss="chunked"),
                                        HardwareSpec.preset("l4", gpus_per_node=2), global_batch=64),
        "gpt2_rtx4090_budget": lambda: plan(gpt2, TrainSpec(micro_batch=4, seq_len=1024, precision="32-true"),
                                            HardwareSpec.preset("rtx-4090"), memory_budget=8e9),
        # rejections of every kind, interleaved: tp 8 and 16 split no 12 heads, dp 16 no batch of 24
        "gpt2_a100_x16_batch24": lambda: plan(gpt2, TrainSpec(micro_batch=2, seq_len=1024),
                                              HardwareSpec.preset("a100-80gb", gpus_per_node=8, num_nodes=2),
                                              global_batch=24),
    }
    out: dict[str, Any] = {key: _guarded(lambda c=call: _without_timings(c().to_dict())) for key, call in cases.items()}
    train = TrainSpec(micro_batch=1, seq_len=2048)
    out["max_micro_batch_llama3_fsdp8_h100"] = max_micro_batch(llama, train, ParallelPlan(dp=8, zero=3),
                                                               hardware=h100)
    out["max_seq_len_llama3_tp4_h100"] = max_seq_len(llama, train, ParallelPlan(tp=4, sp=True, dp=2),
                                                     hardware=h100)
    out["max_micro_batch_gpt2_budget"] = max_micro_batch(gpt2, train, memory_budget=12e9)
    return out


def _without_timings(decision: dict[str, Any]) -> dict[str, Any]:
    """A decision's dictionary without the wall-clock seconds its search statistics report (``seconds``,
    ``*_s``): everything else is a function of the inputs."""
    stats = {k: v for k, v in decision.get("stats", {}).items() if k != "seconds" and not k.endswith("_s")}
    return {**decision, "stats": stats} if "stats" in decision else decision


def _calibration() -> Any:
    """A fixed set of coefficients (every phase and dynamic component, c0 + c1 b s + c2 b s^2), as a trace
    would fit them: what ``estimate_memory(..., calibration=...)`` scales to each plan."""
    from lightning_memplan.model.result import Calibration

    comps = {"activations": (1.5e6, 3.1e4, 2.0), "attention": (0.0, 0.0, 12.0), "logits": (2.0e5, 2.6e5, 0.0),
             "workspace": (4.0e6, 1.2e3, 0.5), "other": (7.7e7, 16.0, 0.0)}
    coefficients = {phase: {c: tuple(x * (1 + i / 10) for x in v) for c, v in comps.items()}
                    for i, phase in enumerate(("forward", "backward", "optimizer"))}
    return Calibration(coefficients=coefficients, traced_shapes=((1, 64), (2, 128)), precision="bf16-mixed")


def _calibrated_case(model: ModelSpec, framework: str, overrides: dict[str, Any], plan: ParallelPlan,
                     rank: int | None, calibration: Any) -> dict[str, Any]:
    return estimate_memory(model, _train(framework, overrides), plan, rank=rank, calibration=calibration).to_dict()


def calibrated_table() -> dict[str, Any]:
    """Every layout x recompute x attention on llama3-8b with the :func:`_calibration` coefficients (the
    analytic ratio plan / one device scales them; activation offloading and pipelines included)."""
    calibration = _calibration()
    out: dict[str, Any] = {}
    llama = ModelSpec.preset("llama3-8b")
    for (framework, name, plan, overrides), recompute, attention in itertools.product(
        COVERAGE_LAYOUTS, RECOMPUTE, ATTENTION
    ):
        for rank in _ranks(plan):
            key = f"{framework}|{name}|{recompute}|{attention}|rank={rank}"
            out[key] = _guarded(_calibrated_case, llama, framework, {**overrides, "recompute": recompute,
                                                                     "attention": attention}, plan, rank, calibration)
    return out


#: The plans the stored traced entries are replayed under (``hf_plans``).
HF_PLANS: tuple[tuple[str, ParallelPlan], ...] = (
    ("fsdp2_dp4_zero3", ParallelPlan(dp=4, zero=3)),
    ("ddp2", ParallelPlan(dp=2)),
    ("tp2", ParallelPlan(tp=2)),
    ("pp2_gpipe_m2", ParallelPlan(pp=2, microbatches=2, schedule="gpipe")),
)


class StoredSource:
    """Traced entries handed over as a coefficient source (the rows were traced on the CPU)."""

    def __init__(self, entries: dict[str, Any]) -> None:
        self._entries = entries
        self._parsed: dict[str, Any] = {}

    def __hash__(self) -> int:
        return id(self._entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StoredSource) and other._entries is self._entries

    def available(self) -> bool:
        return True

    def trace_device(self, device: str) -> str:
        return "cpu"

    def depth_traces(self, model: ModelSpec, t0: TrainSpec) -> Any:
        from lightning_memplan.model.traced import DepthTraces, TracedStep

        if model.hf_config is None:
            return None
        key = model.hf_config + "\n" + TracedStep.of(t0).to_json()
        if key not in self._parsed:
            self._parsed[key] = DepthTraces.from_entry(self._entries[key])
        return self._parsed[key]


def hf_plans_table(hf_rows_stored: dict[str, Any], entries: dict[str, Any]) -> dict[str, Any]:
    """Every stored ``hf`` row replayed from its traced entry at its own step (one CPU device: the traced
    answer) and on CUDA; the rows without dropout and checkpointing also under :data:`HF_PLANS`, on CUDA
    and on the CPU, rank None and the last rank."""
    source = StoredSource(entries)
    out: dict[str, Any] = {}
    for key, row in hf_rows_stored.items():
        _, _, _, dropout, ckpt = key.split("|")
        spec = ModelSpec.from_hf_config(json.loads(row["hf_config"]), calibration=source)
        traced_train = TrainSpec.from_dict(row["train"])
        out[f"{key}|own_step"] = _answer(spec, traced_train, None, None)
        out[f"{key}|cuda"] = _answer(spec, traced_train.replace(device="cuda"), None, None)
        if dropout != "0" or ckpt != "ckpt=False":
            continue
        for (plan_name, plan), device in itertools.product(HF_PLANS, ("cuda", "cpu")):
            train = traced_train.replace(device=device)
            for rank in _ranks(plan):
                out[f"{key}|{plan_name}|{device}|rank={rank}"] = _answer(spec, train, plan, rank)
    return out


COVERAGE_TABLES = ("coverage", "variants", "eval", "checkpoint", "reserved", "planner", "calibrated", "hf_plans")


def coverage_tables(names: tuple[str, ...] | list[str], stored: dict[str, Any] | None = None,
                    entries: dict[str, Any] | None = None) -> dict[str, Any]:
    """The tables of :data:`COVERAGE_TABLES` named in ``names``; ``hf_plans`` needs the stored ``hf`` rows
    (``stored``) and their traced ``entries``."""
    makers = {"coverage": coverage_table, "variants": variants_table, "eval": eval_table,
              "checkpoint": checkpoint_table, "reserved": reserved_table, "planner": planner_table,
              "calibrated": calibrated_table}
    out: dict[str, Any] = {}
    for name in names:
        if name == "hf_plans":
            if stored is None or entries is None:
                raise ValueError("hf_plans needs the stored hf rows and their traced entries")
            out[name] = hf_plans_table(stored, entries)
        else:
            out[name] = makers[name]()
    return out


def _read(path: Path) -> Any:
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def _write(path: Path, text: str) -> None:
    data = text.encode()
    if path.suffix == ".gz":
        data = gzip.compress(data, mtime=0)
    path.write_bytes(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", nargs="*", default=["analytic", "hf"],
                        choices=["analytic", "hf", *COVERAGE_TABLES])
    parser.add_argument("--out", default="estimate_snapshot.json", help="output path (.gz: gzip)")
    parser.add_argument("--entries", default=None, help="also write the traced entries the hf rows used here")
    parser.add_argument("--stored", default=None,
                        help="hf_plans: a snapshot holding the hf rows (e.g. tests/data/estimate_snapshot_8bf0700.json.gz)")
    parser.add_argument("--stored-entries", default=None,
                        help="hf_plans: their traced entries (e.g. tests/data/hf_trace_entries_8bf0700.json.gz)")
    args = parser.parse_args(argv)
    start = time.time()
    tables: dict[str, Any] = {}
    entries: dict[str, Any] | None = {} if args.entries else None
    if "analytic" in args.tables:
        tables["analytic"] = analytic_table()
        print(f"analytic: {len(tables['analytic'])} cases, "
              f"{sum('error' in v for v in tables['analytic'].values())} refused ({time.time() - start:.0f} s)")
    if "hf" in args.tables:
        tables["hf"] = hf_table(entries)
        print(f"hf: {len(tables['hf'])} rows, {sum('error' in v for v in tables['hf'].values())} refused "
              f"({time.time() - start:.0f} s)")
    wanted = [name for name in args.tables if name in COVERAGE_TABLES]
    if wanted:
        stored = _read(Path(args.stored))["hf"] if args.stored else None
        stored_entries = _read(Path(args.stored_entries)) if args.stored_entries else None
        tables.update(coverage_tables(wanted, stored, stored_entries))
        print(", ".join(f"{n}: {len(tables[n])}" for n in wanted) + f" ({time.time() - start:.0f} s)")
    _write(Path(args.out), _canonical(tables))
    if entries is not None and args.entries:
        _write(Path(args.entries), _canonical(entries))
        print(f"entries: {len(entries)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
