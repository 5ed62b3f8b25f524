"""Issue 35: quantized base weights, low-bit optimizer states and float8 terms against the libraries.

The byte counts of ``model/quantized.py`` are checked against what bitsandbytes and torchao really allocate
on the CPU (every storage of a quantized ``Linear4bit`` / ``Linear8bitLt`` weight and its constants, every
state tensor of the optimizers), the Llama-3-8B QLoRA parameter bytes against a hand count written here
from the published config, and the bad inputs against their messages. Nothing here is fitted.
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_memplan.model import float8, quantized
from lightning_memplan.model.estimate import estimate_memory
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec

LLAMA_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tensor subclasses through their inner tensors)."""
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    seen: dict[int, int] = {}
    for t in tensors:
        storages = get_untyped_storages(t) if is_traceable_wrapper_subclass(t) else {t.untyped_storage()}
        for st in storages:
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


# --------------------------------------------------------------------------------------------- hand count
def test_llama3_8b_qlora_nf4_dq_parameter_bytes_equal_a_hand_count() -> None:
    """Llama-3-8B (config.json: 32 layers, hidden 4096, 32 heads, 8 kv heads, intermediate 14336, vocab
    128256, untied) + LoRA r=16 on every block linear, NF4 with double quantisation, bf16 elsewhere."""
    h, f, v, layers, r = 4096, 14336, 128256, 32, 16
    kv = 8 * 128
    linears = [(h, h), (h, kv), (h, kv), (h, h), (h, f), (h, f), (f, h)]  # (in, out) of q k v o gate up down
    per_layer = 0
    for inp, out in linears:
        n = inp * out
        absmax = n // 64  # 64 values per absmax; every n here is a multiple of 64 * 256
        per_layer += n // 2 + absmax + 4 * (absmax // 256) + 4 + 16 * 4 + 256 * 4  # packed, uint8, fp32, offset, codes
    quantized_bytes = layers * per_layer
    bf16 = 2
    embedding, head, norms = v * h, v * h, (2 * layers + 1) * h
    adapter = layers * sum(r * (inp + out) for inp, out in linears)
    hand = quantized_bytes + (embedding + head + norms + adapter) * bf16

    spec = ModelSpec.preset("llama3-8b").with_lora(rank=r, targets=LLAMA_ALL)
    assert spec.n_trainable_params == adapter
    train = TrainSpec(micro_batch=1, seq_len=2048, precision="bf16-true", base_weights="nf4-dq")
    est = estimate_memory(spec, train)
    assert est.params == hand
    assert est.details["quantized_params"] == layers * sum(i * o for i, o in linears)
    # 4.127 bits per quantized value: 4 + 8/64 + 32/(64*256) + the per-weight constants
    assert est.details["quantized_bits_x1000"] == math.floor(8000 * quantized_bytes / est.details["quantized_params"])
    plain = estimate_memory(spec, train.replace(base_weights=None))
    assert plain.params == (embedding + head + norms + layers * sum(i * o for i, o in linears)) * bf16
    assert est.grads == plain.grads and est.by_phase["optimizer"]["optimizer"] == adapter * 2 * 2  # bf16 Adam
    # FSDP2 on 8 ranks (bnb_4bit_quant_storage=bfloat16): the packed values and the bf16 rest sharded, every
    # layer's QuantState constants whole on each rank; a gathered block holds its packed values, norms, adapter
    packed = layers * sum(i * o for i, o in linears) // 2
    constants = quantized_bytes - packed
    fsdp = estimate_memory(spec, train, ParallelPlan(dp=8, zero=3))
    assert fsdp.params == math.ceil((packed + (embedding + head + norms + adapter) * bf16) / 8) + constants
    assert fsdp.by_phase["optimizer"]["optimizer"] == math.ceil(adapter * 2 * 2 / 8)
    block_unit = sum(i * o for i, o in linears) // 2 + (2 * h + adapter // layers) * bf16
    zero2 = estimate_memory(spec, train, ParallelPlan(dp=8, zero=2))  # every unit kept gathered from forward on
    root = (embedding + head + h) * bf16
    assert zero2.by_phase["forward"]["comm"] == layers * block_unit + root + block_unit


# ---------------------------------------------------------------------------------- library layouts
@pytest.mark.parametrize("fmt", ["nf4", "nf4-dq", "fp4", "fp4-dq"])
def test_four_bit_weight_bytes_are_bitsandbytes_storages(fmt: str) -> None:
    bnb = pytest.importorskip("bitsandbytes", reason="the quant extra (pip install 'lightning-memplan[quant]')")
    from lightning_memplan.tracking.tracker import quantization_constants

    kind, nested = fmt.split("-")[0], fmt.endswith("-dq")
    for out, inp in ((128, 96), (200, 72), (1, 10), (512, 640)):
        layer = bnb.nn.Linear4bit(inp, out, bias=False, compute_dtype=torch.float32, quant_type=kind,
                                  compress_statistics=nested).to("cpu")  # quantized on the move
        assert layer.weight.bnb_quantized
        measured = _storage_bytes([layer.weight, *quantization_constants(layer.weight)])
        assert measured == quantized.quantized_weight_bytes(out, inp, fmt), (fmt, out, inp)


def test_int8_weight_bytes_are_bitsandbytes_storages() -> None:
    bnb = pytest.importorskip("bitsandbytes", reason="the quant extra (pip install 'lightning-memplan[quant]')")
    from lightning_memplan.tracking.tracker import quantization_constants

    layer = bnb.nn.Linear8bitLt(96, 128, bias=False, has_fp16_weights=False).to("cpu")
    assert layer.weight.dtype == torch.int8
    assert _storage_bytes([layer.weight, *quantization_constants(layer.weight)]) == \
        quantized.quantized_weight_bytes(128, 96, "int8")


def test_torchao_nf4_tensor_is_nf4_dq_without_the_second_map() -> None:
    pytest.importorskip("torchao", reason="the quant extra (pip install 'lightning-memplan[quant]')")
    from torchao.quantization import to_nf4

    weight = to_nf4(torch.randn(256, 128))  # block 64, scaler block 256: torchtune's QLoRA layout
    assert _storage_bytes([weight]) == quantized.quantized_weight_bytes(256, 128, "nf4-dq") - 256 * 4


def test_four_bit_backward_rebuilds_the_weight_measured_by_memtracker() -> None:
    """The input gradient of a frozen ``Linear4bit`` dequantizes the weight again (``MatMul4Bit.backward``):
    beside the output gradient, the input gradient and the layer, MemTracker sees exactly ``n * 4`` bytes
    more at the backward's peak (fp32 weight)."""
    bnb = pytest.importorskip("bitsandbytes", reason="the quant extra (pip install 'lightning-memplan[quant]')")
    from torch.distributed._tools.mem_tracker import MemTracker

    from lightning_memplan.testing.hf_architectures import _skip_frozen_grad_hooks
    from lightning_memplan.tracking.tracker import quantization_constants

    layer = bnb.nn.Linear4bit(256, 512, bias=False, compute_dtype=torch.float32, quant_type="nf4").to("cpu")
    x = torch.randn(4, 256, requires_grad=True)
    grad = torch.randn(4, 512)
    layer(x).backward(grad)  # warm-up
    x.grad = None
    y = layer(x)
    tracker = MemTracker()
    _skip_frozen_grad_hooks(tracker, layer)
    constants = quantization_constants(layer.weight)
    tracker.track_external(layer, x, grad, y, *constants)
    with tracker:
        y.backward(grad)
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    held = _storage_bytes([layer.weight, *constants]) + x.nbytes + grad.nbytes + y.nbytes + x.grad.nbytes
    rebuilt = quantized.dequant_transient_bytes(512, 256, "nf4", compute_bytes=4, stored_bytes=4, phase="backward")
    assert rebuilt == 512 * 256 * 4
    # the rebuilt weight, and at most the matmul's input gradient before autograd hands it to x.grad
    assert peak - held in (rebuilt, rebuilt + x.grad.nbytes)


@pytest.mark.parametrize("name", ["adamw8bit", "paged_adamw8bit", "paged_adamw"])
def test_bitsandbytes_optimizer_state_bytes(name: str) -> None:
    pytest.importorskip("bitsandbytes", reason="the quant extra (pip install 'lightning-memplan[quant]')")
    import bitsandbytes.optim as bo

    cls = {"adamw8bit": bo.AdamW8bit, "paged_adamw8bit": bo.PagedAdamW8bit, "paged_adamw": bo.PagedAdamW}[name]
    shapes = [(64, 128), (16, 64), (8192,), (3, 4096)]  # one under bitsandbytes' 4096-value threshold
    params = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    opt = cls(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in params:
        state = {k: v for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and not k.startswith("qmap")}
        assert _storage_bytes(list(state.values())) == quantized.optimizer_state_bytes(name, p.numel(), 4), (name, p.shape)


@pytest.mark.parametrize(("name", "cls_name"), [("adamw4bit", "AdamW4bit"), ("adamw_fp8", "AdamWFp8")])
def test_torchao_optimizer_state_bytes(name: str, cls_name: str) -> None:
    """torchao creates each state with ``_new_buffer`` (the step itself is a compiled kernel, not needed
    to see the layout): block-quantized above 4096 values, ``zeros_like`` below."""
    ao = pytest.importorskip("torchao.optim", reason="the quant extra (pip install 'lightning-memplan[quant]')")
    for shape in ((64, 128), (16, 64), (4096, 3)):
        p = torch.nn.Parameter(torch.randn(*shape))
        opt = getattr(ao, cls_name)([p])
        states = [opt._new_buffer(p, True), opt._new_buffer(p, False)]  # exp_avg (signed), exp_avg_sq
        assert _storage_bytes(states) == quantized.optimizer_state_bytes(name, p.numel(), 4), (name, shape)
    assert quantized.optimizer_state_rate(name, 4) == {"adamw4bit": 1.0625, "adamw_fp8": 2.03125}[name]


def test_torchao_bf16_states() -> None:
    ao = pytest.importorskip("torchao.optim", reason="the quant extra (pip install 'lightning-memplan[quant]')")
    p = torch.nn.Parameter(torch.randn(32, 64, dtype=torch.bfloat16))
    opt = ao._AdamW([p], bf16_stochastic_round=True)
    p.grad = torch.randn_like(p)
    opt.step()
    states = [v for k, v in opt.state[p].items() if k in ("exp_avg", "exp_avg_sq")]
    assert _storage_bytes(states) == quantized.optimizer_state_bytes("adamw_bf16", p.numel(), 2)


def test_low_bit_optimizers_in_the_estimate() -> None:
    model = ModelSpec(2, 64, 4, 256, ffn_kind="swiglu", norm="rmsnorm")
    n = model.num_params
    base = TrainSpec(micro_batch=1, seq_len=16, precision="bf16-mixed")
    for name, rate in (("adamw4bit", 1.0625), ("adamw_fp8", 2.03125), ("adamw_bf16", 4.0)):
        est = estimate_memory(model, base.replace(optimizer=name))
        assert est.by_phase["optimizer"]["optimizer"] == round(n * rate)
        assert est.details["optimizer_workspace"] == 0  # one fused / compiled kernel per tensor
    paged = estimate_memory(model, base.replace(optimizer="paged_adamw8bit"))
    assert paged.by_phase["optimizer"]["optimizer"] == 0  # unified memory: outside the caching allocator
    assert paged.host == paged.details["host_paged_optimizer"] == round(n * 2.03125)


# ------------------------------------------------------------------------------------------- float8
def test_float8_cast_terms_by_hand() -> None:
    # one [1024, 256] linear, 512 tokens: forward casts the input (512 x 256) and the weight (256 x 1024)
    fwd = float8.float8_forward_cast_bytes(512, 256, 1024, weight_in_fp8=False, rowwise=False)
    assert fwd == 512 * 256 + 4 + 256 * 1024 + 4
    assert float8.float8_forward_cast_bytes(512, 256, 1024, weight_in_fp8=True, rowwise=False) == 512 * 256 + 4
    bwd = float8.float8_backward_cast_bytes(512, 256, 1024, weight_in_fp8=True, rowwise=True)
    assert bwd == 2 * 512 * 1024 + 2 * 4 * 512 + 512 * 256 + 4 * 256
    assert float8.float8_all_gather_saving_bytes(1000, 2) == 1000
    assert float8.fp8_all_gather("tensorwise", True) and not float8.fp8_all_gather("rowwise", True)


def test_float8_keeps_a_bf16_steps_saved_activations() -> None:
    """torchao saves the high-precision input and weight (``ctx.save_for_backward(input_hp, weight_hp_t)``):
    float8 changes no saved activation, only transients, the autocast copies and FSDP's gather."""
    model = ModelSpec.preset("llama3-8b")
    train = TrainSpec(micro_batch=1, seq_len=4096, precision="bf16-mixed")
    plain, fp8 = estimate_memory(model, train), estimate_memory(model, train.replace(float8="tensorwise"))
    assert fp8.by_phase["backward"]["activations"] == plain.by_phase["backward"]["activations"]
    # bf16-mixed without FSDP: autocast caches no bf16 copy of a float8 linear's weight
    blocks = model.n_layers * quantized.quantized_block_numel(model)
    for phase in ("forward", "backward"):  # the copies are "other" (what the tracker calls casts of weights)
        assert plain.by_phase[phase]["other"] - fp8.by_phase[phase]["other"] == 2 * blocks


def test_float8_tensorwise_fsdp_gathers_one_byte_per_weight() -> None:
    model = ModelSpec.preset("llama3-8b")
    train = TrainSpec(micro_batch=1, seq_len=4096, precision="bf16-mixed", activation_bytes=2)
    plan = ParallelPlan(dp=8, zero=3)
    plain = estimate_memory(model, train, plan)
    fp8 = estimate_memory(model, train.replace(float8="tensorwise"), plan)
    rowwise = estimate_memory(model, train.replace(float8="rowwise"), plan)
    block = quantized.quantized_block_numel(model)
    # the last block's all-gather output kept in the forward: one float8 block instead of bf16
    assert plain.by_phase["forward"]["comm"] - fp8.by_phase["forward"]["comm"] == block
    assert rowwise.by_phase["forward"]["comm"] == plain.by_phase["forward"]["comm"]  # rowwise: bf16 gather


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(("changes", "match"), [
    ({"base_weights": "nf5"}, "base_weights='nf5'"),
    ({"float8": "blockwise"}, "float8='blockwise'"),
    ({"float8": "tensorwise", "precision": "32-true"}, "needs a bf16 precision"),
    ({"float8": "tensorwise", "base_weights": "nf4"}, "together are not modelled"),
    ({"base_weights": "nf4", "framework": "deepspeed"}, "needs framework='torch'"),
    ({"optimizer": "adamw2bit"}, "optimizer='adamw2bit'"),
])
def test_bad_low_precision_fields(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TrainSpec(micro_batch=1, seq_len=8, precision=changes.pop("precision", "bf16-mixed"), **changes)


def test_base_weights_needs_frozen_weights_and_a_plain_layout() -> None:
    model = ModelSpec(2, 64, 4, 256, ffn_kind="swiglu")
    train = TrainSpec(micro_batch=1, seq_len=16, base_weights="nf4")
    with pytest.raises(ValueError, match="with_lora"):
        estimate_memory(model, train)
    lora = model.with_lora(rank=4)
    with pytest.raises(ValueError, match="tp=2"):
        estimate_memory(lora, train, ParallelPlan(tp=2))
    with pytest.raises(ValueError, match="zero=3"):
        estimate_memory(lora, train.replace(base_weights="int8"), ParallelPlan(dp=2, zero=3))
    moe = ModelSpec(2, 64, 4, 256, n_experts=4, experts_per_token=2).with_lora(rank=4)
    with pytest.raises(ValueError, match="n_experts=4"):
        estimate_memory(moe, train)
    assert estimate_memory(lora, train, ParallelPlan(dp=2)).total > 0  # DDP is modelled
    assert estimate_memory(lora, train, ParallelPlan(dp=2, zero=3)).total > 0  # FSDP2 + QLoRA too


def test_int8_on_cuda_counts_its_per_token_buffers_and_warns_of_the_outliers() -> None:
    """CUDA int8 (``MatMul8bitLt``, bitsandbytes 0.50.2 ``autograd/_functions.py``): the forward's per-token
    buffers (the fp16 cast of a non-fp16 input, the int8 row copy, its fp32 row scales, the int32 product)
    are the largest linear's forward transient; LLM.int8()'s outlier columns depend on the data, so the
    estimate leaves them out, bounds them in its details and warns. No GPU measured this (the CPU runs
    ``MatMul8bitFp``, measured in tests/unit/test_qlora_step.py)."""
    spec = ModelSpec(2, 64, 4, 256, ffn_kind="swiglu", ffn_hidden=160).with_lora(rank=4, targets=("q_proj", "v_proj"))
    b, s, h, f = 2, 32, 64, 160
    tokens = b * s
    train = TrainSpec(micro_batch=b, seq_len=s, precision="16-true", base_weights="int8")
    with pytest.warns(UserWarning, match=r"LLM\.int8\(\)'s outlier columns"):
        est = estimate_memory(spec, train)
    linears = quantized.block_linear_shapes(spec)
    assert est.details["low_precision_forward_transient"] == max(
        tokens * i + 4 * tokens + 4 * tokens * o for i, o in linears)  # fp16 input: no cast
    assert est.details["int8_outlier_bound"] == 2 * sum(tokens * i * 2 for i, _ in linears)  # every column, 2 blocks
    assert est.details["int8_kept_inputs"] == 2 * tokens * (h + f) * 2  # MLP input and inner activation, fp16
    with pytest.warns(UserWarning, match="outlier columns"):
        bf16 = estimate_memory(spec, train.replace(precision="bf16-true"))
    assert bf16.details["low_precision_forward_transient"] == max(
        3 * tokens * i + 4 * tokens + 4 * tokens * o for i, o in linears)  # + the fp16 cast
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the CPU path keeps no outlier columns: no warning
        cpu = estimate_memory(spec, train.replace(device="cpu", precision="32-true"))
    assert "int8_outlier_bound" not in cpu.details


def _bnb_net(bnb: Any, dropout: float = 0.0) -> torch.nn.Module:
    """An embedding, an NF4-DQ ``Linear4bit``, a frozen ``Linear8bitLt`` and a trainable head, quantized on
    the move to the CPU."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(64, 32), torch.nn.Dropout(dropout),
        bnb.nn.Linear4bit(32, 128, bias=False, compute_dtype=torch.float32, quant_type="nf4", compress_statistics=True),
        bnb.nn.Linear8bitLt(128, 32, bias=False, has_fp16_weights=False, threshold=0.0), torch.nn.Linear(32, 64),
    ).to("cpu")


def test_trace_memory_fakes_bitsandbytes_parameters() -> None:
    """``trace_memory``'s fake copy of bitsandbytes' ``Params4bit`` and ``Int8Params``
    (``tracking/fake_params.py``): the fake step runs (no fall back to a real one) and its peak is the real
    CPU step's to the byte; the module itself is left as it was (its parameters, the layer's
    ``quant_state`` still the weight's)."""
    bnb = pytest.importorskip("bitsandbytes", reason="the quant extra (pip install 'lightning-memplan[quant]')")
    from lightning_memplan.tracking.trace import trace_memory

    net = _bnb_net(bnb)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    before = [(p, p.data_ptr()) for p in net.parameters()]
    net[3](torch.zeros(1, 128))  # Linear8bitLt moves CB/SCB to its MatmulLtState on its first call
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fake = trace_memory(net, example_input=(ids, ids.clone()), optimizer="adamw", optimizer_impl="for_loop",
                            precision="32-true")
    real = trace_memory(net, example_input=(ids, ids.clone()), optimizer="adamw", optimizer_impl="for_loop",
                        precision="32-true", fake=False)
    assert fake.mode == "fake" and real.mode == "real"
    assert fake.estimate.total == real.estimate.total and fake.estimate.params == real.estimate.params
    assert [(p, p.data_ptr()) for p in net.parameters()] == before
    assert net[2].quant_state is net[2].weight.quant_state and not net[2].weight.requires_grad


def test_trace_memory_real_step_leaves_the_random_state() -> None:
    """The real CPU step ``trace_memory`` runs (``fake=False``, and the fall back when a fake step fails)
    draws from the run's generators (dropout, synthetic batches): the CPU generator, Python's ``random``
    and NumPy's global state are put back."""
    bnb = pytest.importorskip("bitsandbytes", reason="the quant extra (pip install 'lightning-memplan[quant]')")
    import random

    import numpy as np

    from lightning_memplan.tracking.trace import trace_memory

    net = _bnb_net(bnb, dropout=0.5)
    random.seed(3)
    np.random.seed(3)
    states = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    trace_memory(net, batch_shape=(2, 16), optimizer="adamw", optimizer_impl="for_loop", precision="32-true",
                 fake=False)
    assert torch.equal(states[0], torch.get_rng_state())
    assert states[1] == random.getstate() and np.array_equal(states[2], np.random.get_state()[1])


def test_the_report_names_the_int8_outlier_bound() -> None:
    """The callback's session notes what the estimate leaves out for CUDA int8 (once, with the bound)."""
    from lightning_memplan.monitoring.options import MonitorOptions
    from lightning_memplan.monitoring.session import MemorySession

    session = MemorySession(MonitorOptions(write_files=False, print_report=False))
    session.fit.spec = ModelSpec(2, 64, 4, 256, ffn_kind="swiglu", ffn_hidden=160).with_lora(rank=4)
    session.fit.train = TrainSpec(micro_batch=1, seq_len=32, precision="16-true", base_weights="int8")
    session.fit.plan = ParallelPlan()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = session.estimate(2, 32)
        session.estimate(4, 32)
    assert est is not None and est.details["int8_outlier_bound"] > 0
    notes = [n for n in session.report.notes if "outlier columns" in n]
    assert len(notes) == 1 and "at most" in notes[0] and "batch 2 x 32" in notes[0], session.report.notes


# ----------------------------------------------------------------------------------- reading a run
@pytest.mark.parametrize(("mode", "want"), [
    ("nf4", "nf4"), ("nf4-dq", "nf4-dq"), ("fp4", "fp4"), ("fp4-dq", "fp4-dq"), ("int8", "int8"), ("int8-training", None),
])
def test_bitsandbytes_plugin_is_read(mode: str, want: str | None) -> None:
    """Lightning refuses ``BitsandbytesPrecision`` on a CPU Trainer ("only supported on CUDA GPUs"), so
    the inference is checked on the plugin object itself: its mode and dtype, the run's RNG untouched."""
    pytest.importorskip("bitsandbytes", reason="the quant extra (pip install 'lightning-memplan[quant]')")
    from lightning.pytorch.plugins import BitsandbytesPrecision

    from lightning_memplan.live.low_precision import infer_low_precision

    dtype = torch.float16 if mode.startswith("int8") else torch.bfloat16
    plugin = BitsandbytesPrecision(mode, dtype=dtype)
    state = torch.get_rng_state()
    fields = infer_low_precision(SimpleNamespace(precision_plugin=plugin, lightning_module=None, precision="32-true"))
    assert torch.equal(state, torch.get_rng_state())
    assert fields.get("base_weights") == want
    assert fields["precision"] == ("16-true" if mode.startswith("int8") else "bf16-true")


@pytest.mark.parametrize("ignore", [None, {"model.lm_head"}, {"lm_head"}, {"model.blocks"}, {"model"}])
def test_bitsandbytes_plugin_head_rule_is_its_own_conversion(ignore: set[str] | None) -> None:
    """Lightning's ``BitsandbytesPrecision`` replaces every ``nn.Linear`` whose dotted name starts with none
    of ``ignore_modules``, the lm_head included (Lightning 2.6.6 ``lightning/fabric/plugins/precision/
    bitsandbytes.py`` ``_convert_layers``). What the reader says of the blocks and the head, from the plugin
    object and the module before conversion, is what the plugin's real ``convert_module`` then does to a
    copy of that module (on the CPU it swaps the classes, quantizing nothing); reading the converted module
    agrees; the run's RNG is untouched."""
    bnb = pytest.importorskip("bitsandbytes", reason="the quant extra (pip install 'lightning-memplan[quant]')")
    import copy

    from lightning.pytorch.plugins import BitsandbytesPrecision

    from lightning_memplan.live.low_precision import infer_low_precision
    from lightning_memplan.testing.zoo import GPT, GPTConfig

    class Lit(torch.nn.Module):  # names as the Trainer converts them: relative to the LightningModule
        def __init__(self) -> None:
            super().__init__()
            self.model = GPT(GPTConfig(vocab_size=128, n_layers=2, hidden=64, n_heads=4, max_positions=32))

    lit = Lit()
    plugin = BitsandbytesPrecision("nf4-dq", dtype=torch.float32, ignore_modules=ignore)
    state = torch.get_rng_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        read = infer_low_precision(SimpleNamespace(precision_plugin=plugin, lightning_module=lit, precision="32-true"))
    assert torch.equal(state, torch.get_rng_state())
    converted = plugin.convert_module(copy.deepcopy(lit))
    head = isinstance(converted.model.lm_head, bnb.nn.Linear4bit)
    blocks = any(isinstance(m, bnb.nn.Linear4bit) for m in converted.model.blocks.modules())
    if head and not blocks:  # a quantized head alone is not a layout the estimate has: said, not hidden
        assert any("quantizes the lm_head but not the blocks" in str(w.message) for w in caught)
        head = False
    assert read.get("quantized_head", False) is head and (read.get("base_weights") == "nf4-dq") is blocks, read
    assert {None: (True, True), "model.lm_head": (False, True), "lm_head": (True, True), "model.blocks": (False, False),
            "model": (False, False)}[next(iter(ignore)) if ignore else None] == (head, blocks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        after = infer_low_precision(SimpleNamespace(precision_plugin=plugin, lightning_module=converted,
                                                    precision="32-true"))
    assert after.get("quantized_head", False) is head and (after.get("base_weights") == "nf4-dq") is blocks, after


def test_transformer_engine_plugin_is_read() -> None:
    """TransformerEngine is not installable without CUDA, so the plugin object is made without its
    ``__init__`` (which imports it): the reader needs only its class and ``weights_dtype``."""
    from lightning.pytorch.plugins import TransformerEnginePrecision

    from lightning_memplan.live.low_precision import plugin_low_precision

    plugin = object.__new__(TransformerEnginePrecision)
    plugin.weights_dtype = torch.bfloat16
    assert plugin_low_precision(plugin) == {"precision": "bf16-true", "float8": "tensorwise"}
    plugin.weights_dtype = torch.float16
    assert plugin_low_precision(plugin) == {"precision": "16-true"}


def test_float8_linear_and_optimizers_are_read() -> None:
    pytest.importorskip("torchao", reason="the quant extra (pip install 'lightning-memplan[quant]')")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.optim import AdamW4bit, AdamWFp8

    from lightning_memplan.live.low_precision import float8_of
    from lightning_memplan.live.optimizer import infer_optimizer

    for recipe in ("tensorwise", "rowwise"):
        module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name(recipe))
        assert float8_of(module) == recipe
    params = [torch.nn.Parameter(torch.randn(4, 4))]
    assert infer_optimizer(AdamW4bit(params))[0] == "adamw4bit"
    assert infer_optimizer(AdamWFp8(params))[0] == "adamw_fp8"
    bnb = pytest.importorskip("bitsandbytes", reason="the quant extra")
    assert infer_optimizer(bnb.optim.PagedAdamW8bit(params))[0] == "paged_adamw8bit"
    assert infer_optimizer(bnb.optim.AdamW8bit(params))[0] == "adamw8bit"


# ---------------------------------------------------------------------------------------------- CLI
def test_cli_flags(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from lightning_memplan.cli import main

    argv = ["estimate", "--model", "llama3-8b", "--seq-len", "2048", "--micro-batch", "1", "--precision", "bf16-true",
            "--lora-rank", "16", "--lora-targets", ",".join(LLAMA_ALL), "--base-weights", "nf4-dq", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    spec = ModelSpec.preset("llama3-8b").with_lora(rank=16, targets=LLAMA_ALL)
    want = estimate_memory(spec, TrainSpec(micro_batch=1, seq_len=2048, precision="bf16-true", base_weights="nf4-dq"))
    assert data["train"]["base_weights"] == "nf4-dq" and data["model"]["lora_rank"] == 16
    assert data["estimates"][0]["params"] == want.params
    assert main(argv[:-3] + ["--float8", "tensorwise", "--precision", "bf16-mixed"]) == 0
    assert "float8=tensorwise" in capsys.readouterr().out
    assert main(["estimate", "--model", "llama3-8b", "--seq-len", "64", "--base-weights", "nf4"]) == 2
    assert "with_lora" in capsys.readouterr().err
    assert main(argv[:-1] + ["--quantized-head", "--json"]) == 0  # Lightning's plugin: the lm_head too
    head = json.loads(capsys.readouterr().out)
    v, h = 128256, 4096
    assert head["train"]["quantized_head"] is True
    assert data["estimates"][0]["params"] - head["estimates"][0]["params"] == v * h * 2 - quantized.quantized_weight_bytes(
        v, h, "nf4-dq")
    assert main(argv[:-3] + ["--quantized-head"]) == 2  # needs --base-weights
    assert "quantized_head=True needs base_weights" in capsys.readouterr().err


def test_max_micro_batch_and_planner_take_quantized_weights_into_account() -> None:
    """A 24 GiB card: Llama-3-8B with a bf16 base and a q/v adapter does not fit one sequence of 2048, with
    NF4-DQ base weights it does; on 2 GPUs the planner ranks DDP and FSDP layouts for QLoRA and refuses
    tensor parallelism with the reason."""
    from lightning_memplan.hardware import HardwareSpec
    from lightning_memplan.planning import plan
    from lightning_memplan.planning.fit import max_micro_batch

    spec = ModelSpec.preset("llama3-8b").with_lora(rank=16, targets=("q_proj", "v_proj"))
    train = TrainSpec(micro_batch=1, seq_len=2048, precision="bf16-true")
    budget = 24 * 2**30
    assert max_micro_batch(spec, train, ParallelPlan(), memory_budget=budget) == 0
    assert max_micro_batch(spec, train.replace(base_weights="nf4-dq"), ParallelPlan(), memory_budget=budget) >= 1
    decision = plan(spec, train.replace(base_weights="nf4-dq"), HardwareSpec.preset("h100-80gb", gpus_per_node=2),
                    global_batch=8)
    assert decision.fits and decision.plan.tp == 1
    ranked = {(c.plan.dp, c.plan.zero) for c in decision.candidates if c.plan.pp == c.plan.tp == c.plan.cp == 1}
    assert {(2, 0), (2, 2)} <= ranked, ranked  # DDP and FSDP (SHARD_GRAD_OP, the fastest sharding here)
    assert all(c.plan.tp == 1 for c in decision.candidates)
    assert any("base_weights='nf4-dq' cannot run with tensor parallelism" in r.reason for r in decision.rejected)
