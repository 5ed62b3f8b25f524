"""FSDP2's ``CPUOffloadPolicy`` (``TrainSpec(offload="params")``) and activation offloading
(``offload_activations=True``): device and host bytes by hand, the host bytes of ``save_on_cpu`` against a
counting pack hook, the planner's fallback to offloading within a host budget, and the command line.

The pack-hook check counts what ``torch.autograd.graph.save_on_cpu`` would copy to the host on a GPU: one
new host tensor of ``numel * element_size`` bytes per saved tensor per save. The rules of
``model/offload.py`` (``saved_again_bytes``) were written from the zoo Llama-style GPT's list of saves under
``"32-true"``; the GPT-2-style GPT (LayerNorm, GELU, learned positions), ``"bf16-mixed"`` and the Hugging
Face ``LlamaForCausalLM`` (composite RMSNorm) are held out (the LayerNorm bias rule came from the first run
of the GPT-2-style case). Each matches exactly.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from lightning_memplan.cli import main
from lightning_memplan.hardware import HardwareSpec
from lightning_memplan.model import terms
from lightning_memplan.model.estimate import estimate_memory
from lightning_memplan.model.offload import (
    PINNED_ROUNDING_BOUND,
    host_need_bytes,
    offload_blocker,
    saved_weight_bytes,
)
from lightning_memplan.model.sizes import kernels_of, precision_bytes
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.planning import Allow, plan
from lightning_memplan.planning.offload import offload_step_time
from lightning_memplan.testing.zoo import GPT, GPTConfig, causal_lm_loss

pytestmark = pytest.mark.hf

GiB = 2**30
LLAMA7B = ModelSpec.preset("llama-7b")


def _train(**kw: Any) -> TrainSpec:
    return TrainSpec(**{"micro_batch": 1, "seq_len": 4096, **kw})


# --- the TrainSpec options and the plans they need -----------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(offload="optimizer"), r"offload='optimizer' needs framework='deepspeed'.*use offload='params'"),
        (dict(offload_activations=True, recompute="full"), r"offload_activations=True needs recompute='none'"),
        (dict(offload_activations=True, framework="megatron"), r"offload_activations=True needs framework='torch'"),
        (dict(offload="params", framework="fsdp1"), r"offload='params' needs framework='deepspeed'.*FSDP2"),
    ],
)
def test_bad_train_specs_name_the_rule_and_the_fix(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _train(**kwargs)


def test_offload_activations_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="offload_activations"):
        _train(offload_activations=1)


@pytest.mark.parametrize(
    ("train", "plan", "match"),
    [
        (dict(offload="params"), ParallelPlan(dp=4, zero=1), r"zero=1 has no FSDP2 form; use zero=2 or zero=3"),
        (dict(offload="params"), ParallelPlan(dp=4), r"not DDP.*grad_buckets=False"),
        (dict(offload="params"), ParallelPlan(dp=2, pp=2, zero=3, microbatches=2), r"pipeline parallelism \(pp=2\)"),
        (dict(offload_activations=True), ParallelPlan(pp=2, microbatches=2), r"pipeline parallelism"),
    ],
)
def test_plans_the_offloads_cannot_run_are_refused(train: dict[str, Any], plan: ParallelPlan, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        estimate_memory(LLAMA7B, _train(**train), plan)


def test_what_offload_params_can_run_with() -> None:
    t = _train(offload="params")
    for ok in (ParallelPlan(dp=8, zero=3), ParallelPlan(dp=8, zero=2), ParallelPlan(), ParallelPlan(dp=8, grad_buckets=False)):
        assert offload_blocker(t, ok) is None, ok


# --- CPUOffloadPolicy by hand ---------------------------------------------------------------------------------


def test_cpu_offload_policy_moves_the_sharded_states_to_pinned_host_memory() -> None:
    """llama-7b, dp=8 zero=3, bf16-mixed AdamW: without offload the rank holds N/8 fp32 parameters and
    gradients and 8 N/8 bytes of Adam states; with CPUOffloadPolicy those bytes are the host's (parameters and
    gradients pinned), none are on the device, and the CPU step's for-loop temporaries (two of the largest
    shard's fp32 tensors) are host buffers."""
    plan = ParallelPlan(dp=8, zero=3)
    plain = estimate_memory(LLAMA7B, _train(), plan)
    off = estimate_memory(LLAMA7B, _train(offload="params"), plan)
    d = off.details
    states = plain.by_phase["optimizer"]
    assert (d["host_params"], d["host_grads"], d["host_optimizer"]) == (states["params"], states["grads"],
                                                                         states["optimizer"])
    n_local = d["local_params"]
    assert d["host_params"] == math.ceil(n_local * 4 / 8)
    assert d["host_pinned"] == d["host_params"] + d["host_grads"]
    largest = LLAMA7B.vocab_size * LLAMA7B.hidden  # the embedding/lm_head matrix
    assert d["host_buffers"] == 2 * math.ceil(largest / 8) * 4
    assert off.host == sum(d[f"host_{p}"] for p in ("params", "grads", "optimizer", "master", "buffers", "activations"))
    for phase in ("forward", "backward", "optimizer"):
        assert all(off.by_phase[phase][c] == 0 for c in ("params", "grads", "optimizer", "master")), phase
    assert off.total < plain.total - states["params"] - states["optimizer"]
    # ZeRO-3 copies each shard to the device for the forward's and the backward's all-gather; each
    # gradient shard comes back once
    assert d["offload_h2d_bytes"] == 2 * d["host_params"]
    assert d["offload_d2h_bytes"] == d["host_grads"]
    assert host_need_bytes(off) == off.host + (PINNED_ROUNDING_BOUND - 1) * d["host_pinned"]


def test_one_rank_offload_gathers_one_block_at_a_time() -> None:
    """dp=1: memplan_auto shards over a one-rank mesh, so the device holds the root unit and the blocks being
    computed, not the whole model (without offload the whole model and its states are on the device)."""
    plain = estimate_memory(LLAMA7B, _train(), ParallelPlan())
    off = estimate_memory(LLAMA7B, _train(offload="params"), ParallelPlan())
    assert off.details["host_params"] == plain.params and off.params == 0
    block = terms.layer_param_count(LLAMA7B) * 4
    assert block < off.comm < 6 * block + 2 * LLAMA7B.vocab_size * LLAMA7B.hidden * 4


# --- activation offloading ------------------------------------------------------------------------------------


def _count_packs(blocks: Any, run: Any) -> int:
    """Bytes ``save_on_cpu`` would copy to the host: every save inside the blocks, ``numel * element_size``."""
    from torch.autograd.graph import saved_tensors_hooks

    packed = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        packed[0] += tensor.numel() * tensor.element_size()
        return tensor

    for block in blocks:
        forward = block.forward

        def wrapped(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            with saved_tensors_hooks(pack, lambda t: t):
                return _forward(*args, **kwargs)

        block.forward = wrapped
    run()
    return packed[0]


V, S, H = 512, 128, 64
ZOO_CONFIGS = {
    "llama": dict(ffn_kind="swiglu", n_kv_heads=2, norm="rmsnorm", position_embedding="rope", bias=False),
    "gpt2": dict(max_positions=S),
}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("kind", sorted(ZOO_CONFIGS))
def test_host_activation_bytes_are_what_save_on_cpu_packs(kind: str, precision: str) -> None:
    torch.manual_seed(0)
    cfg = dict(ZOO_CONFIGS[kind])
    cfg.setdefault("max_positions", S)
    model = GPT(GPTConfig(V, 2, H, 4, **cfg))
    x = torch.randint(0, V, (4, S + 1))

    def run() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = causal_lm_loss(model, x[:, :-1], x[:, 1:])
        loss.backward()

    packed = _count_packs(model.blocks, run)
    spec = ModelSpec.from_module(model, calibration="analytic")
    est = estimate_memory(spec, TrainSpec(micro_batch=4, seq_len=S, precision=precision, device="cpu",
                                          offload_activations=True))
    assert est.details["host_activations"] == packed


def test_host_activation_bytes_of_a_hugging_face_llama() -> None:
    """Held out: LlamaRMSNorm (``norm_impl="composite"``), separate q/k/v, rotary tables (b=1: HF's per-sequence
    tables are b copies of the rule's)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=S, attn_implementation="sdpa"))
    x = torch.randint(0, V, (1, S))
    packed = _count_packs(model.model.layers, lambda: model(input_ids=x, labels=x).loss.backward())
    spec = ModelSpec.from_module(model, calibration="analytic")
    est = estimate_memory(spec, TrainSpec(micro_batch=1, seq_len=S, precision="32-true", device="cpu",
                                          norm_impl="composite", offload_activations=True))
    assert est.details["host_activations"] == packed


def test_activation_offload_keeps_one_block_on_the_device() -> None:
    """llama-7b dp=8 zero=3: the blocks' saves leave the device (host: L blocks' saves, what they save again
    and the weights each matmul saves, bf16 copies under autocast); the device's forward holds at most one
    block's saves."""
    plan = ParallelPlan(dp=8, zero=3)
    plain = estimate_memory(LLAMA7B, _train(), plan)
    off = estimate_memory(LLAMA7B, _train(offload_activations=True), plan)
    layer = terms.layer_activation_bytes(LLAMA7B, kernels_of(_train()), 1, 4096)
    assert off.by_phase["forward"]["activations"] <= layer
    assert plain.by_phase["forward"]["activations"] >= LLAMA7B.n_layers * layer
    weights = saved_weight_bytes(LLAMA7B, precision_bytes(_train()), LLAMA7B.n_layers * terms.layer_matmul_param_count(LLAMA7B),
                                 LLAMA7B.n_layers)
    assert off.details["host_activations"] >= LLAMA7B.n_layers * layer + weights
    assert off.details["host_pinned"] == off.details["host_activations"]
    assert off.details["offload_h2d_bytes"] == off.details["offload_d2h_bytes"] == off.details["host_activations"]
    assert off.total < plain.total


def test_a_cpu_step_pins_and_copies_nothing_extra() -> None:
    cpu = estimate_memory(LLAMA7B, _train(offload="params", offload_activations=True, device="cpu"), ParallelPlan(dp=8, zero=3))
    assert cpu.details["host_pinned"] == 0


def test_a_traced_estimate_scales_in_the_offloads_and_keeps_the_host_bytes() -> None:
    """A Hugging Face config traced from its class (source ``hf_trace``): the trace is a plain step, the
    offloads come from the analytic terms' ratio, and the host bytes are the analytic ones."""
    pytest.importorskip("transformers")
    config = dict(model_type="llama", vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=S)
    spec, plan_ = ModelSpec.from_hf_config(config), ParallelPlan(dp=2, zero=3)
    train = TrainSpec(micro_batch=4, seq_len=S, precision="32-true", device="cpu")
    plain = estimate_memory(spec, train, plan_)
    states = estimate_memory(spec, train.replace(offload="params"), plan_)
    acts = estimate_memory(spec, train.replace(offload_activations=True), plan_)
    assert plain.source == states.source == acts.source == "hf_trace"
    assert states.params == 0 and states.host == sum(states.details[f"host_{p}"] for p in ("params", "grads", "optimizer",
                                                                                           "master", "buffers"))
    assert acts.host == acts.details["host_activations"] > 0 and acts.activations < plain.activations / 4


# --- the planner ------------------------------------------------------------------------------------------------


def _h100(host: int | None) -> HardwareSpec:
    return HardwareSpec.preset("h100", gpus_per_node=1).replace(host_memory_bytes=host)


def test_the_planner_offloads_when_nothing_fits_on_the_device_and_says_so() -> None:
    decision = plan(LLAMA7B, _train(), _h100(1024 * GiB))
    assert decision.fits and decision.train.offload == "params"
    text = decision.explain()
    assert "nothing fits on the devices without offloading, so the plan offloads parameters" in text
    assert "host budget" in text and "offload: 'none' -> 'params'" in text
    assert decision.estimate.host > 0 and decision.host_budget_bytes == round(1024 * GiB * 0.9)
    assert host_need_bytes(decision.estimate) <= decision.host_budget_bytes
    assert "offload" in decision.step.exposed_s  # the PCIe copies the step waits for
    assert decision.to_dict()["host_budget_bytes"] == decision.host_budget_bytes
    assert type(decision).from_dict(decision.to_dict()).train.offload == "params"


def test_the_planner_keeps_to_the_host_budget() -> None:
    decision = plan(LLAMA7B, _train(), _h100(64 * GiB))
    assert not decision.fits and decision.train.offload == "none"
    assert any("nor with offloading to host memory" in n and "host memory per rank" in n for n in decision.notes)


def test_the_planner_does_not_offload_without_a_host_figure_or_when_told_not_to() -> None:
    unknown = plan(LLAMA7B, _train(), _h100(None))
    assert not unknown.fits and any("the host memory is unknown" in n for n in unknown.notes)
    never = plan(LLAMA7B, _train(), _h100(1024 * GiB), allow={"offload": ["none"]})
    assert not never.fits and never.train.offload == "none"
    explicit = plan(LLAMA7B, _train(), _h100(None), host_memory_budget=512 * GiB)
    assert explicit.fits and explicit.train.offload != "none"


def test_the_planner_prefers_the_devices_when_they_suffice() -> None:
    decision = plan(ModelSpec.preset("gpt2"), _train(seq_len=1024), _h100(1024 * GiB))
    assert decision.fits and decision.train.offload == "none" and not decision.train.offload_activations


def test_a_cpu_host_never_offloads() -> None:
    cpu = HardwareSpec("cpu (test)", 8 * GiB, host_memory_bytes=8 * GiB)
    decision = plan(LLAMA7B, _train(device="cpu"), cpu)
    assert not decision.fits and any("not tried on a CPU step" in n for n in decision.notes)


def test_allow_takes_offload_choices() -> None:
    assert Allow.parse({"offload": ["none", "activations"]}).offload == ("none", "activations")
    with pytest.raises(ValueError, match=r"allow\['offload'\] contains 'optimizer'"):
        Allow.parse({"offload": ["optimizer"]})


def test_offload_step_time_prices_the_pcie_copies() -> None:
    """Activation copies run on the compute stream: ``2 A m / bw`` exposed. FSDP2's shard copies run on its
    side streams: the larger direction less ``OVERLAP_EFFICIENCY`` of the compute is exposed, the rest overlapped."""
    from lightning_memplan.planning.timing import OVERLAP_EFFICIENCY, StepTime

    bw = _h100(None).resolved("host_link_bw")
    step = StepTime(total_s=1.0, compute_s=0.8, bubble_s=0.0, tokens=4096, tokens_per_s=4096.0, mfu=0.4)
    plan_ = ParallelPlan(dp=8, zero=3)
    acts = estimate_memory(LLAMA7B, _train(offload_activations=True), plan_)
    timed = offload_step_time(step, acts, _train(offload_activations=True), _h100(None))
    expected = 2 * acts.details["host_activations"] / bw
    assert timed.exposed_s["offload"] == pytest.approx(expected) and timed.total_s == pytest.approx(1.0 + expected)
    assert timed.tokens_per_s == pytest.approx(4096 / timed.total_s)
    states = estimate_memory(LLAMA7B, _train(offload="params"), plan_)
    timed = offload_step_time(step, states, _train(offload="params"), _h100(None))
    copy_s = max(states.details["offload_h2d_bytes"], states.details["offload_d2h_bytes"]) / bw
    exposed = max(0.0, copy_s - OVERLAP_EFFICIENCY * 0.8)
    assert timed.total_s == pytest.approx(1.0 + exposed)
    assert timed.overlapped_s["offload"] == pytest.approx(copy_s - exposed)
    plain = estimate_memory(LLAMA7B, _train(), plan_)
    assert offload_step_time(step, plain, _train(), _h100(None)) is step  # nothing offloaded


# --- hardware -------------------------------------------------------------------------------------------------


def test_host_link_and_memory_fields() -> None:
    h100 = HardwareSpec.preset("h100")
    assert h100.host_link_bw == 64e9 and h100.host_memory_bytes is None  # PCIe Gen5 x16, half of 128 GB/s
    assert HardwareSpec.preset("a100").host_link_bw == 32e9 and HardwareSpec.preset("v100").host_link_bw == 16e9
    spec = h100.replace(host_memory_bytes=2 * 2**40)
    assert HardwareSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="host_memory_bytes"):
        h100.replace(host_memory_bytes=0)
    with pytest.raises(ValueError, match="host_link_bw"):
        h100.replace(host_link_bw=-1.0)
    assert HardwareSpec.detect().host_memory_bytes  # sysconf on this (POSIX) host


# --- command line ---------------------------------------------------------------------------------------------


def test_cli_estimates_fsdp2_offloads_with_host_rows(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--model", "llama-7b", "--seq-len", "4096", "--dp", "8", "--zero", "3"]
    assert main([*args, "--framework", "fsdp2", "--offload", "params+activations"]) == 0
    out = capsys.readouterr().out
    assert "host params" in out and "host activations" in out and "page-locked" in out
    assert main([*args, "--offload", "activations", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["train"]["offload_activations"] is True and payload["train"]["framework"] == "torch"
    assert payload["estimates"][0]["host"] == payload["estimates"][0]["details"]["host_activations"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--offload", "optimizer"], "offload='optimizer' needs framework='deepspeed'"),
        (["--offload", "activations", "--recompute", "full"], "needs recompute='none'"),
        (["--offload", "params", "--zero", "1", "--dp", "4"], "zero=1 has no FSDP2 form"),
        (["--offload", "activations", "--framework", "deepspeed", "--zero", "3", "--dp", "2"], "needs framework='torch'"),
    ],
)
def test_cli_refuses_bad_offload_combinations(capsys: pytest.CaptureFixture[str], extra: list[str], message: str) -> None:
    assert main(["estimate", "--model", "gpt2", "--seq-len", "128", *extra]) != 0
    assert message in capsys.readouterr().err


def test_cli_plan_takes_a_host_memory(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--model", "llama-7b", "--seq-len", "4096", "--hardware", "h100", "--gpus-per-node", "1",
                 "--host-memory", "1TiB", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 and payload["train"]["offload"] == "params"
    assert payload["hardware"]["host_memory_bytes"] == 2**40
