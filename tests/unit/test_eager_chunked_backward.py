"""The last block's eager softmax backward as a backward point of its own (``backward_softmax``).

With the chunked loss nothing of size ``[b, s, V]`` is alive when the backward starts, so eager attention's
backward peak is the last block's softmax backward: its two ``[b, a, s, s]`` temporaries, the residual and
value gradients beside them, while autograd has already released what the head and the block's nodes after
the softmax saved (``terms.eager_softmax_backward_*``). Putting the temporaries on every saved activation
over-estimated that phase by +5 % to +21 % on the zoo (benchmarks/gpu_check.py --allow-cpu).

Checked against a real CPU step (``trace_memory(fake=False)``: ``TensorTracker`` on a steady-state step in
Lightning's order) at shapes other than the ones the model was worked out on (b=2, s=256, chunks of 256):
b=1, s=512 with chunks of 128 and b=4, s=128 with one chunk of 512.
"""

from __future__ import annotations

import pytest
import torch

from lightning_memplan.loss import linear_cross_entropy
from lightning_memplan.model import param_counts, terms
from lightning_memplan.model.estimate import estimate_memory
from lightning_memplan.model.sizes import kernels_of, precision_bytes
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.testing.zoo import GPT, gpt2_style, llama_style, tied_style
from lightning_memplan.tracking.trace import trace_memory

# benchmarks/bench_estimate_accuracy.py's zoo sizes
SIZES = {"vocab_size": 2048, "n_layers": 4, "hidden": 128, "max_positions": 512}
MODELS = {
    "gpt2": lambda: gpt2_style(**SIZES, n_heads=4, attention="eager"),
    "llama": lambda: llama_style(**SIZES, n_heads=8, n_kv_heads=2, attention="eager"),
    "tied": lambda: tied_style(**SIZES, n_heads=4, attention="eager"),
}
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")

HELD_OUT = ((1, 512, 128), (4, 128, 512))  # (b, s, loss chunk): not the (2, 256, 256) worked on
TARGET = 0.05
SOFTMAX_BACKWARD = "aten._softmax_backward_data.default#1"  # the first in the backward: the last block's


def _step(name: str, precision: str, b: int, s: int, chunk: int, **trace: object):
    torch.manual_seed(0)
    model = GPT(MODELS[name]())
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, SIZES["vocab_size"], (b, s + 1), generator=gen)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    def loss_fn(module: GPT, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return linear_cross_entropy(module(batch[0]), module.lm_head.weight, batch[1], chunk_size=chunk)

    measured = trace_memory(model, batch, loss_fn=loss_fn, precision=precision, fake=False, seq_len=s, **trace)
    train = TrainSpec(micro_batch=b, seq_len=s, precision=precision, optimizer="adamw", optimizer_impl="for_loop",
                      attention="eager", loss="chunked", loss_chunk_size=chunk, device="cpu")
    return model.spec(), train, measured


@pytest.fixture(autouse=True)
def _two_threads(two_threads):
    """Real steps on at most two threads (tests/conftest.py)."""


@pytest.mark.parametrize(("b", "s", "chunk"), HELD_OUT, ids=[f"b{b}-s{s}-chunk{c}" for b, s, c in HELD_OUT])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_eager_chunked_backward_within_target_of_a_real_step(name: str, precision: str, b: int, s: int,
                                                             chunk: int) -> None:
    spec, train, measured = _step(name, precision, b, s, chunk)
    estimate = estimate_memory(spec, train, ParallelPlan())
    real = measured.estimate.phase_total("backward")
    err = (estimate.phase_total("backward") - real) / real
    assert abs(err) < TARGET, f"{name} {precision} b={b} s={s} chunk={chunk}: backward {err:+.2%}"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_peak_is_the_last_blocks_softmax_backward_and_the_point_holds_its_bytes(precision: str) -> None:
    """Llama, b=1, s=512: the real step's backward peaks right after the last block's softmax backward,
    and the estimate's backward is that point (its workspace: the temporaries and the residual and value
    gradients) within 3 % of the bytes live there (the zoo's per-block causal masks, [s, s] bytes each, are
    what it leaves out)."""
    b, s, chunk = 1, 512, 128
    spec, train, measured = _step("llama", precision, b, s, chunk, pin_moments={"backward": SOFTMAX_BACKWARD})
    report = measured.report
    assert report.peak_ops["backward"] == SOFTMAX_BACKWARD
    backward = estimate_memory(spec, train, ParallelPlan()).by_phase["backward"]
    assert backward["workspace"] == (terms.eager_softmax_backward_bytes(spec, kernels_of(train), b, s)
                                     + terms.eager_softmax_backward_grad_bytes(spec, kernels_of(train), b, s))
    pinned = sum(report.pinned["backward"].values())
    assert sum(backward.values()) == pytest.approx(pinned, rel=0.03)
    # the gradients of the head and of the last block's parameters after its scores exist by then, exactly
    after_matmul, after_other = param_counts.layer_params_after_scores(spec)
    head = terms.norm_param_count(spec) + spec.vocab_size * spec.hidden
    grad_bytes = precision_bytes(train).grad
    assert backward["grads"] == (head + after_matmul + after_other) * grad_bytes == report.pinned["backward"]["grads"]


@pytest.mark.parametrize("spec", [
    ModelSpec.preset("llama3-8b"), ModelSpec.preset("gpt2-medium"),
    GPT(MODELS["llama"]()).spec(), GPT(MODELS["gpt2"]().replace(dropout=0.1)).spec(),
    ModelSpec(4, 256, 8, 1024, ffn_kind="swiglu", n_experts=4, experts_per_token=2, n_shared_experts=1),
    ModelSpec(4, 256, 8, 1024, kv_lora_rank=32, q_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16),
], ids=["llama3-8b", "gpt2-medium", "zoo-llama", "zoo-gpt2-dropout", "moe", "mla"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(("t", "sp"), [(1, False), (2, False), (4, True)])
def test_the_split_adds_up_and_divides_as_the_layer_does(spec: ModelSpec, precision: str, t: int, sp: bool) -> None:
    train = TrainSpec(micro_batch=2, seq_len=256, precision=precision, attention="eager")
    layer = terms.layer_activation_bytes(spec, kernels_of(train), 2, 256, t=t, sp=sp)
    through, after = terms.layer_activation_split_bytes(spec, kernels_of(train), 2, 256, t=t, sp=sp)
    assert through > 0 and after > 0 and through + after == layer
    freed = terms.eager_softmax_backward_freed_bytes(spec, kernels_of(train), 2, 256, t=t, sp=sp)
    assert freed["activations"] == after
    attention = terms.eager_attention_bytes(spec, kernels_of(train), 2, 256, t=t)
    assert 0 <= freed["attention"] < attention
    assert freed["attention"] + terms.eager_softmax_output_bytes(spec, kernels_of(train), 2, 256, t=t) == attention
    # the temporaries and the value gradient are split by heads; the residual gradient by SP only
    one = terms.eager_softmax_backward_bytes(spec, kernels_of(train), 2, 256)
    assert terms.eager_softmax_backward_bytes(spec, kernels_of(train), 2, 256, t=t) * t == one
    pb = precision_bytes(train)
    residual = 2 * 256 * spec.hidden * pb.residual
    grads_1 = terms.eager_softmax_backward_grad_bytes(spec, kernels_of(train), 2, 256)
    grads_t = terms.eager_softmax_backward_grad_bytes(spec, kernels_of(train), 2, 256, t=t, sp=sp)
    assert grads_t - residual // (t if sp else 1) == (grads_1 - residual) // t


@pytest.mark.parametrize("train", [
    TrainSpec(micro_batch=2, seq_len=2048, attention="sdpa", loss="chunked"),
    TrainSpec(micro_batch=2, seq_len=2048, attention="eager", loss="chunked", recompute="full"),
    TrainSpec(micro_batch=2, seq_len=2048, attention="eager", loss="chunked", recompute="selective"),
], ids=["sdpa", "eager-full", "eager-selective"])
def test_no_softmax_terms_without_a_materialised_softmax_backward(train: TrainSpec) -> None:
    spec = ModelSpec.preset("llama3-8b")
    assert terms.eager_softmax_backward_bytes(spec, kernels_of(train), 2, 2048) == 0
    assert terms.eager_softmax_backward_grad_bytes(spec, kernels_of(train), 2, 2048) == 0
    assert terms.eager_softmax_backward_freed_bytes(spec, kernels_of(train), 2, 2048) == {"activations": 0, "attention": 0}


def _softmax_point_chosen(backward: dict[str, int], spec: ModelSpec, train: TrainSpec, plan: ParallelPlan) -> bool:
    b, s, t = train.micro_batch, train.seq_len, plan.tp
    return backward["workspace"] == (terms.eager_softmax_backward_bytes(spec, kernels_of(train), b, s, t=t)
                                     + terms.eager_softmax_backward_grad_bytes(spec, kernels_of(train), b, s, t=t, sp=plan.sp))


@pytest.mark.parametrize("plan", [ParallelPlan(), ParallelPlan(tp=2), ParallelPlan(tp=2, sp=True),
                                  ParallelPlan(dp=4), ParallelPlan(dp=4, zero=3)], ids=lambda p: p.describe())
def test_one_stage_point_is_the_forward_less_what_autograd_freed(plan: ParallelPlan) -> None:
    """Without a pipeline the point holds the forward's saves less the head's and the last block's after
    its scores, divided by tensor and sequence parallelism as the saved bytes are (CUDA, bf16-mixed)."""
    spec = GPT(MODELS["llama"]()).spec()
    train = TrainSpec(micro_batch=2, seq_len=512, attention="eager", loss="chunked")
    b, s, t, sp = train.micro_batch, train.seq_len, plan.tp, plan.sp
    est = estimate_memory(spec, train, plan)
    forward, backward = est.by_phase["forward"], est.by_phase["backward"]
    assert _softmax_point_chosen(backward, spec, train, plan)
    pb = precision_bytes(train)
    head = terms.norm_saved_bytes(spec, kernels_of(train), b * s, split=t if sp else 1) + b * s * spec.hidden * pb.compute
    _, after = terms.layer_activation_split_bytes(spec, kernels_of(train), b, s, t=t, sp=sp)
    assert backward["activations"] == forward["activations"] - head - after
    freed = terms.eager_softmax_backward_freed_bytes(spec, kernels_of(train), b, s, t=t, sp=sp)
    assert backward["attention"] == forward["attention"] - freed["attention"]
    if plan.zero < 2:  # the head's and the block's autocast weight copies are gone (FSDP casts itself: none)
        assert backward["other"] < forward["other"]
    else:
        assert backward["other"] == forward["other"]


@pytest.mark.parametrize("plan", [
    ParallelPlan(pp=2, microbatches=4), ParallelPlan(pp=2, microbatches=4, schedule="gpipe"),
    ParallelPlan(tp=2, pp=2, microbatches=4, schedule="interleaved", virtual_stages=2),
], ids=lambda p: p.describe())
def test_pipeline_stages_free_one_micro_batchs_part(plan: ParallelPlan) -> None:
    """Under a pipeline the backward of one micro-batch frees only its own head and last block's part: every
    stage's point keeps the other in-flight micro-batches' saves (autocast's copies stay: the schedule runs
    its backwards inside the autocast region)."""
    spec = GPT(MODELS["llama"]()).spec()
    train = TrainSpec(micro_batch=2, seq_len=512, attention="eager", loss="chunked")
    b, s, t = train.micro_batch, train.seq_len, plan.tp
    _, after = terms.layer_activation_split_bytes(spec, kernels_of(train), b, s, t=t, sp=plan.sp)
    pb = precision_bytes(train)
    head = terms.norm_saved_bytes(spec, kernels_of(train), b * s, split=t if plan.sp else 1) + b * s * spec.hidden * pb.compute
    for stage in range(plan.pp):
        est = estimate_memory(spec, train, plan, rank=stage * plan.dp * plan.cp * plan.tp)
        forward, backward = est.by_phase["forward"], est.by_phase["backward"]
        assert _softmax_point_chosen(backward, spec, train, plan)
        assert all(value >= 0 for value in backward.values())
        # the point's moment holds the most micro-batches (the forward's), less one head and one block's part
        assert forward["activations"] - head - after <= backward["activations"] < forward["activations"]
        assert backward["other"] == forward["other"]
