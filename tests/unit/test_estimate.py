"""estimate_memory: phases, ranks, plans, validation and monotonicity."""

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_memplan.model import ModelSpec, ParallelPlan, TrainSpec, estimate_memory, terms
from lightning_memplan.model.result import COMPONENTS, PHASES, Calibration, MemoryEstimate
from lightning_memplan.model.sizes import kernels_of

GB = 10**9


def small_llama(**kw):
    base = dict(n_kv_heads=2, ffn_hidden=128, ffn_kind="swiglu", norm="rmsnorm")
    base.update(kw)
    return ModelSpec(8, 64, 8, 1000, **base)


def test_eight_way_zero3_is_14_gb_per_gpu_seed_004():
    # Seed 004: 16N / 8 = 14 GB per GPU for a 7B model with mixed-precision Adam + fp32 master.
    model = ModelSpec.preset("llama-7b")
    model = ModelSpec(**{**model.to_dict(), "n_params": 7 * 10**9})
    train = TrainSpec(micro_batch=1, seq_len=1024, precision="bf16-true", master_weights=True)
    est = estimate_memory(model, train, ParallelPlan(dp=8, zero=3))
    states = est.by_phase["optimizer"]
    got = states["params"] + states["grads"] + states["optimizer"] + states["master"]
    assert abs(got - 14 * GB) <= 16  # ceil() of four sharded terms
    # Without sharding the same states are 112 GB.
    est1 = estimate_memory(model, train)
    s1 = est1.by_phase["optimizer"]
    assert abs(s1["params"] + s1["grads"] + s1["optimizer"] + s1["master"] - 112 * GB) <= 4


def test_components_sum_to_total_and_phases_consistent():
    est = estimate_memory(small_llama(), TrainSpec(micro_batch=2, seq_len=32))
    assert est.total == sum(est.components().values())
    assert est.total == max(est.phase_total(p) for p in PHASES)
    assert est.components() == dict(est.by_phase[est.peak_phase])


def test_logits_and_activations_freed_before_optimizer_step():
    est = estimate_memory(small_llama(), TrainSpec(micro_batch=2, seq_len=32))
    opt = est.by_phase["optimizer"]
    assert opt["logits"] == 0 and opt["activations"] == 0 and opt["attention"] == 0
    assert opt["workspace"] > 0  # foreach Adam's sqrt temporaries
    fwd = est.by_phase["forward"]
    assert fwd["logits"] > 0 and fwd["activations"] > 0


def test_grads_in_forward_follow_lightnings_zero_grad_order():
    model, train = small_llama(), TrainSpec(micro_batch=2, seq_len=32, precision="32-true")
    n = model.num_params
    lightning = estimate_memory(model, train)
    assert lightning.by_phase["forward"]["grads"] == 4 * n  # previous step's grads alive until backward
    assert lightning.by_phase["optimizer"]["grads"] == 4 * n
    plain = estimate_memory(model, train.replace(grads_alive_in_forward=False))
    assert plain.by_phase["forward"]["grads"] == 0
    # With accumulation the grads exist from the second micro-batch on, whatever the loop does.
    acc = estimate_memory(model, train.replace(grads_alive_in_forward=False, grad_accumulation=4))
    assert acc.by_phase["forward"]["grads"] == 4 * n


def test_static_states_exact_for_32_true_adam():
    model = small_llama()
    n = model.num_params
    est = estimate_memory(model, TrainSpec(micro_batch=1, seq_len=8, precision="32-true"))
    opt = est.by_phase["optimizer"]
    assert (opt["params"], opt["grads"], opt["optimizer"], opt["master"]) == (4 * n, 4 * n, 8 * n, 0)


def test_zero_stages_shard_what_they_promise():
    model, train = small_llama(), TrainSpec(micro_batch=1, seq_len=16, precision="32-true")
    n, d = model.num_params, 4
    ddp = estimate_memory(model, train, ParallelPlan(dp=d)).by_phase["optimizer"]
    assert ddp["comm"] == 4 * n  # DDP's gradient buckets are a second copy of the grads
    z1 = estimate_memory(model, train, ParallelPlan(dp=d, zero=1)).by_phase["optimizer"]
    assert (z1["params"], z1["grads"], z1["optimizer"]) == (4 * n, 4 * n, -(-8 * n // d))
    z2 = estimate_memory(model, train, ParallelPlan(dp=d, zero=2)).by_phase["optimizer"]
    # FSDP2 SHARD_GRAD_OP: parameters sharded too (the unsharded copy is comm, forward to backward)
    assert (z2["params"], z2["grads"]) == (-(-4 * n // d), -(-4 * n // d))
    z3 = estimate_memory(model, train, ParallelPlan(dp=d, zero=3)).by_phase["optimizer"]
    assert z3["params"] == -(-4 * n // d)
    fwd3 = estimate_memory(model, train, ParallelPlan(dp=d, zero=3)).by_phase["forward"]
    assert fwd3["comm"] > 0  # the all-gathered unit


def test_more_dp_at_fixed_micro_batch_relieves_no_activation_memory():
    model, train = small_llama(), TrainSpec(micro_batch=2, seq_len=64)
    a1 = estimate_memory(model, train, ParallelPlan(dp=1)).by_phase["forward"]["activations"]
    a8 = estimate_memory(model, train, ParallelPlan(dp=8, zero=3)).by_phase["forward"]["activations"]
    assert a1 == a8


def test_pipeline_stages_differ():
    model = small_llama()
    train = TrainSpec(micro_batch=1, seq_len=32)
    plan = ParallelPlan(pp=4, microbatches=8)
    first = estimate_memory(model, train, plan, rank=0)
    last = estimate_memory(model, train, plan, rank=3)
    assert first.stage == 0 and last.stage == 3
    assert first.by_phase["forward"]["logits"] == 0 and last.by_phase["forward"]["logits"] > 0
    # 1F1B: stage 0 holds p = 4 micro-batches of its 2 layers, the last stage 1 (plus the head's inputs).
    layer = terms.layer_activation_bytes(model, kernels_of(train), 1, 32)
    assert first.by_phase["forward"]["activations"] == 4 * 2 * layer
    worst = estimate_memory(model, train, plan)
    assert worst.total == max(estimate_memory(model, train, plan, rank=r).total for r in range(4))


def test_interleaved_pays_the_extra_factor():
    model = small_llama()
    train = TrainSpec(micro_batch=1, seq_len=32)
    onef = estimate_memory(model, train, ParallelPlan(pp=4, microbatches=16), rank=0)
    inter = estimate_memory(model, train, ParallelPlan(pp=4, microbatches=16, schedule="interleaved", virtual_stages=2), rank=0)
    ratio = inter.by_phase["forward"]["activations"] / onef.by_phase["forward"]["activations"]
    assert ratio == pytest.approx(1 + 3 / 8, rel=1e-6)


def test_gpipe_holds_all_microbatches():
    model, train = small_llama(), TrainSpec(micro_batch=1, seq_len=32)
    g = estimate_memory(model, train, ParallelPlan(pp=2, microbatches=6, schedule="gpipe"), rank=0)
    o = estimate_memory(model, train, ParallelPlan(pp=2, microbatches=6), rank=0)
    assert g.by_phase["forward"]["activations"] == 3 * o.by_phase["forward"]["activations"]


def test_tied_embeddings_cost_a_head_copy_only_with_pipeline():
    tied = ModelSpec(4, 64, 4, 5000, tied_embeddings=True, position_embedding="learned", max_positions=64, bias=True)
    train = TrainSpec(micro_batch=1, seq_len=16, precision="32-true")
    single = estimate_memory(tied, train)
    assert single.by_phase["optimizer"]["params"] == 4 * tied.num_params
    last = estimate_memory(tied, train, ParallelPlan(pp=2, microbatches=2), rank=1)
    first = estimate_memory(tied, train, ParallelPlan(pp=2, microbatches=2), rank=0)
    total_pp = last.by_phase["optimizer"]["params"] + first.by_phase["optimizer"]["params"]
    assert total_pp == 4 * (tied.num_params + 5000 * 64)  # the last stage's own V*h head


def test_tensor_parallel_and_vocab_parallel_loss():
    model, train = small_llama(), TrainSpec(micro_batch=2, seq_len=32)
    t1 = estimate_memory(model, train)
    t2 = estimate_memory(model, train, ParallelPlan(tp=2))
    assert t2.by_phase["optimizer"]["params"] < 0.6 * t1.by_phase["optimizer"]["params"]
    naive = estimate_memory(model, train, ParallelPlan(tp=2)).by_phase["forward"]["logits"]
    vp = estimate_memory(model, train.replace(loss="vocab_parallel"), ParallelPlan(tp=2)).by_phase["forward"]["logits"]
    assert vp * 2 == naive


def test_chunked_loss_removes_the_logits_peak():
    model = ModelSpec(2, 64, 4, 50000)
    train = TrainSpec(micro_batch=4, seq_len=512)
    naive = estimate_memory(model, train)
    chunked = estimate_memory(model, train.replace(loss="chunked", loss_chunk_size=256))
    assert naive.largest_component() == "logits"
    # LinearCrossEntropy, bf16-mixed, N = 4 * 512 tokens, h = 64, V = 50000, 256-token chunks:
    n, h, v = 4 * 512, 64, 50000
    working_set = 256 * v * (4 + 2)  # one fp32 [chunk, V] buffer + its bf16 copy for the GEMMs
    stored = n * h * 4 + v * h * 4  # grads computed in forward: fp32 hidden grad, fp32 weight grad
    casts = v * h * 2 + v * h * 2 + n * h * 2  # weight-grad block, bf16 weight, bf16 hidden
    assert chunked.by_phase["forward"]["logits"] == working_set + stored + casts
    assert chunked.total < naive.total


def test_recompute_modes_order():
    model = small_llama()
    train = TrainSpec(micro_batch=2, seq_len=64, attention="eager")
    none = estimate_memory(model, train).by_phase["forward"]
    sel = estimate_memory(model, train.replace(recompute="selective")).by_phase["forward"]
    full = estimate_memory(model, train.replace(recompute="full")).by_phase["forward"]
    assert none["attention"] > 0 and sel["attention"] == 0 == full["attention"]
    assert full["activations"] < sel["activations"] == none["activations"]


def test_context_parallel_splits_sequence():
    model, train = small_llama(), TrainSpec(micro_batch=1, seq_len=64)
    c1 = estimate_memory(model, train).by_phase["forward"]["activations"]
    c2 = estimate_memory(model, train, ParallelPlan(cp=2)).by_phase["forward"]["activations"]
    assert c2 * 2 == pytest.approx(c1, rel=1e-9)


def test_calibration_replaces_dynamic_terms():
    model, train = small_llama(), TrainSpec(micro_batch=2, seq_len=32)
    coeffs = {p: {c: (0.0, 0.0, 0.0) for c in ("activations", "attention", "logits", "workspace", "other")} for p in PHASES}
    coeffs["forward"]["activations"] = (1000.0, 10.0, 0.5)
    cal = Calibration(coefficients=coeffs)
    est = estimate_memory(model, train, calibration=cal)
    assert est.source == "calibrated"
    assert est.by_phase["forward"]["activations"] == 1000 + 10 * 64 + 0.5 * 64 * 32


def test_estimate_round_trips_through_json():
    est = estimate_memory(small_llama(), TrainSpec(micro_batch=1, seq_len=16), ParallelPlan(pp=2, microbatches=2))
    again = MemoryEstimate.from_dict(json.loads(json.dumps(est.to_dict())))
    assert again == est


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: ModelSpec(0, 64, 4, 100), r"n_layers=0 must be >= 1"),
        (lambda: ModelSpec(2, -64, 4, 100), r"hidden=-64"),
        (lambda: ModelSpec(2, 64, 4, 100, n_kv_heads=3), r"n_kv_heads=3 must divide n_heads=4"),
        (lambda: TrainSpec(micro_batch=0, seq_len=8), r"micro_batch=0"),
        (lambda: TrainSpec(micro_batch=1, seq_len=8, precision="fp8"), r"precision='fp8'.*'bf16-mixed'"),
        (lambda: TrainSpec(micro_batch=1, seq_len=8, optimizer="adamax"), r"optimizer='adamax'.*'adamw'"),
        (lambda: TrainSpec(micro_batch=1, seq_len=8, param_bytes=0), r"param_bytes=0"),
        (lambda: TrainSpec(micro_batch=1, seq_len=8, optimizer_bytes_per_param=-1), r"optimizer_bytes_per_param=-1"),
        (lambda: ParallelPlan(tp=0), r"tp=0"),
        (lambda: ParallelPlan(zero=4), r"zero=4"),
        (lambda: ParallelPlan(sp=True), r"sp=True needs tp > 1"),
    ],
)
def test_bad_specs_raise_naming_the_argument(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


def test_bad_plans_for_the_model():
    model, train = small_llama(), TrainSpec(micro_batch=1, seq_len=32)
    with pytest.raises(ValueError, match=r"tp=3 does not divide n_heads=8.*use tp in \[1, 2\]"):
        estimate_memory(model, train, ParallelPlan(tp=3))
    with pytest.raises(ValueError, match=r"tp=4 does not divide n_kv_heads=2"):
        estimate_memory(model, train, ParallelPlan(tp=4))
    with pytest.raises(ValueError, match=r"pp=9 exceeds n_layers=8"):
        estimate_memory(model, train, ParallelPlan(pp=9))
    # uneven interleaved stages are allowed (8 blocks over 2 x 3 stages); more stages than blocks are not
    estimate_memory(model, train, ParallelPlan(pp=2, schedule="interleaved", virtual_stages=3, microbatches=2))
    with pytest.raises(ValueError, match=r"virtual_stages=5 x pp=2 = 10 stages exceed n_layers=8.*<= 4"):
        estimate_memory(model, train, ParallelPlan(pp=2, schedule="interleaved", virtual_stages=5, microbatches=2))
    with pytest.raises(ValueError, match=r"cp=3 does not divide seq_len=32"):
        estimate_memory(model, train, ParallelPlan(cp=3))
    with pytest.raises(TypeError, match=r"plan=.*ParallelPlan"):
        estimate_memory(model, train, {"dp": 2})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"n_layers=2.0 must be an int"):
        ModelSpec(2.0, 64, 4, 100)  # type: ignore[arg-type]


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ValueError, match=r"did you mean 'llama3-8b'.*known presets: gpt2"):
        ModelSpec.preset("llama3-8")


# -- property test -----------------------------------------------------------------------------

_models = st.builds(
    lambda layers, heads_pow, kv_div, head_dim, vocab, ffn_kind, norm, tied: ModelSpec(
        layers, (2**heads_pow) * head_dim, 2**heads_pow, vocab,
        n_kv_heads=max(1, 2**heads_pow // kv_div), ffn_kind=ffn_kind, norm=norm, tied_embeddings=tied,
    ),
    st.integers(1, 12), st.integers(0, 4), st.sampled_from([1, 2, 4]), st.sampled_from([8, 16, 64]),
    st.integers(2, 70000), st.sampled_from(["gelu", "swiglu", "relu"]), st.sampled_from(["layernorm", "rmsnorm"]),
    st.booleans(),
)
_trains = st.builds(
    # A fixed chunk size for the chunked loss: ``"auto"`` switches chunking on once N > max(h, 64)
    # tokens, so one more sequence can legitimately lower the peak there (the rule's break-even).
    lambda b, s, prec, rec, attn, loss, acc, chunk: TrainSpec(
        micro_batch=b, seq_len=s, precision=prec, recompute=rec, attention=attn, loss=loss, grad_accumulation=acc,
        loss_chunk_size=chunk if loss == "chunked" else None,
    ),
    st.integers(1, 8), st.integers(1, 4096), st.sampled_from(["32-true", "bf16-mixed", "16-mixed", "bf16-true"]),
    st.sampled_from(["none", "selective", "full"]), st.sampled_from(["sdpa", "eager"]),
    st.sampled_from(["naive", "fp32_upcast", "chunked"]), st.integers(1, 4), st.sampled_from([64, 1024, 8192]),
)


@settings(max_examples=150 * int(os.environ.get("MEMPLAN_HYPOTHESIS_SCALE", "1")))
@given(_models, _trains, st.sampled_from([0, 1, 2, 3]), st.sampled_from([1, 2, 4]))
def test_random_valid_specs_never_raise_and_grow_monotonically(model, train, zero, dp):
    plan = ParallelPlan(dp=dp, zero=zero)
    est = estimate_memory(model, train, plan)
    assert all(v >= 0 for v in est.components().values())
    assert all(v >= 0 for phase in est.by_phase.values() for v in phase.values())
    bigger_b = estimate_memory(model, train.replace(micro_batch=train.micro_batch + 1), plan)
    longer_s = estimate_memory(model, train.replace(seq_len=train.seq_len + 7), plan)
    assert bigger_b.total >= est.total
    assert longer_s.total >= est.total


def test_estimate_cli_prints_breakdown(capsys):
    """What the CLI prints; its wall time is measured by ``benchmarks/bench_cli.py`` (no timing here)."""
    from lightning_memplan.cli import main

    code = main("estimate --model llama-7b --micro-batch 1 --seq-len 4096 --precision bf16-mixed --dp 8 --zero 3".split())
    out = capsys.readouterr().out
    assert code == 0
    assert "activations" in out and "peak" in out and "llama-7b" in out
    code = main("estimate --model llama3-8b --seq-len 2048 --pp 2 --tp 2 --microbatches 4 --json".split())
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and len(data["estimates"]) == 2
    assert data["estimates"][1]["logits"] > 0 == data["estimates"][0]["by_phase"]["forward"]["logits"]


def test_estimate_cli_reports_bad_input(capsys):
    from lightning_memplan.cli import main

    assert main("estimate --model llama-7b --seq-len 4096 --tp 3".split()) == 2
    assert "tp=3 does not divide n_heads=32" in capsys.readouterr().err
    assert main("estimate --model nope --seq-len 4".split()) == 2


def test_components_constant_is_the_estimate_field_order():
    from lightning_memplan.model.result import OPTIONAL_COMPONENTS

    # a weight-averaging copy ("averaged") is shown only when there is one; the order is COMPONENTS' either way
    assert tuple(MemoryEstimate().components()) == tuple(c for c in COMPONENTS if c not in OPTIONAL_COMPONENTS)
    assert tuple(MemoryEstimate(averaged=8).components()) == COMPONENTS


def test_pipeline_gradients_meet_a_full_inflight_set_only_in_steady_1f1b():
    # Stage 0 of a 2-stage 1F1B pipeline holds 2 micro-batches after its warm-up forwards. With m = 2
    # its first backward comes before any gradient exists (the step dropped the previous ones), so the
    # forward peak has no gradients; with m = 4 the steady phase runs forwards after backwards, so it does.
    model, train = small_llama(), TrainSpec(micro_batch=1, seq_len=32, precision="32-true")
    m2 = estimate_memory(model, train, ParallelPlan(pp=2, microbatches=2), rank=0)
    m4 = estimate_memory(model, train, ParallelPlan(pp=2, microbatches=4), rank=0)
    assert m2.by_phase["forward"]["grads"] == 0
    assert m4.by_phase["forward"]["grads"] == m4.by_phase["optimizer"]["grads"] > 0
    layer = terms.layer_activation_bytes(model, kernels_of(train), 1, 32)
    # The first backward's first block runs before its own gradients exist (3 of the stage's 4 blocks'
    # then: model/assemble._block_backward), so the peak is the second backward's block: every gradient,
    # the other micro-batch's 4 layers, and a SwiGLU MLP backward's three [b s, f] fp32 tensors
    end = m2.by_phase["backward"]
    assert end["grads"] == m2.by_phase["optimizer"]["grads"]
    assert end["activations"] == 4 * layer
    assert end["workspace"] == 3 * 32 * model.ffn * 4


def test_auto_chunk_break_even_can_lower_the_peak_when_the_batch_grows():
    """Why the property test pins the chunk size: with ``loss_chunk_size=None`` ("auto"), N <= h tokens
    run as one chunk, while 2N > h tokens are chunked, so the logits working set shrinks (terms'
    ``auto_loss_chunk_tokens``; the same rule the loss module uses)."""
    model = ModelSpec(1, 512, 8, 4104)
    train = TrainSpec(micro_batch=1, seq_len=473, precision="bf16-true", recompute="full", loss="chunked")
    one, two = estimate_memory(model, train), estimate_memory(model, train.replace(micro_batch=2))
    assert terms.auto_loss_chunk_tokens(473, 512, 4104) == 473
    assert terms.auto_loss_chunk_tokens(946, 512, 4104) == 64
    assert two.logits < one.logits


def test_fsdp2_replication_counts_the_unsharded_unit_copies_by_hand():
    """Data parallelism applied as FSDP2 replication (``grad_buckets=False``): no DDP bucket, but FSDP2
    copies each unit into its unsharded buffer even with a shard size of 1. Worked by hand, fp32:
    a block holds 4h^2 + 8h^2 (gelu MLP, f = 4h) weights, biases 4h + f + h, two LayerNorms 4h."""
    model = ModelSpec(4, 64, 4, 1000, ffn_kind="gelu", norm="layernorm", bias=True, tied_embeddings=False,
                      position_embedding="rope")
    train = TrainSpec(micro_batch=2, seq_len=32, precision="32-true")
    h, f, v = 64, 256, 1000
    block = 4 * h * h + 2 * h * f + (4 * h + f + h) + 2 * 2 * h
    assert terms.layer_param_count(model) == block
    root = v * h + 2 * h + v * h  # embedding, final LayerNorm, untied head
    assert model.num_params == 4 * block + root
    ddp = estimate_memory(model, train, ParallelPlan(dp=2))
    fsdp2 = estimate_memory(model, train, ParallelPlan(dp=2, grad_buckets=False))
    single = estimate_memory(model, train, ParallelPlan())
    assert single.by_phase["forward"]["comm"] == 0
    # DDP holds its gradient buckets all step long; FSDP2 replication none, only transient unit copies
    assert ddp.by_phase["optimizer"]["comm"] == terms.ddp_bucket_bytes(model.num_params * 4) > 0
    assert fsdp2.by_phase["optimizer"]["comm"] == 0
    # the root unit only: a shard group of size 1 keeps no block's all-gather output for the next unit
    # (FSDPParamGroup.wait_for_unshard sets all_gather_state only when world_size > 1), nor does its
    # backward prefetch allocate one (unshard's world-size-1 branch copies at wait_for_unshard): the root, the
    # block in its backward and its gradient; the backward's peak here is its end, where the root unit's
    # unsharded gradients and their reduce copy-in are alive (terms.fsdp_root_post_backward_bytes)
    assert fsdp2.by_phase["forward"]["comm"] == root * 4
    block_backward = (root + block) * 4 + block * 4
    root_reduce = terms.fsdp_root_post_backward_bytes(root, 4, 4)
    assert root_reduce == 2 * root * 4 > block_backward
    assert fsdp2.by_phase["backward"]["comm"] == root_reduce
    assert fsdp2.params == ddp.params == single.params  # replication: nothing is sharded


def test_reshard_after_forward_int_lies_between_zero3_and_zero2_by_hand():
    """``fully_shard(reshard_after_forward=n)``: each of the L blocks keeps ceil(U / n) bytes of its
    gathered parameters from its forward to its backward (``FSDPParam.to_sharded_post_forward``). Worked
    by hand, fp32, d = 8, n = 2, the model of the replication test above (L = 4, U = 4 * block)."""
    model = ModelSpec(4, 64, 4, 1000, ffn_kind="gelu", norm="layernorm", bias=True, tied_embeddings=False,
                      position_embedding="rope")
    train = TrainSpec(micro_batch=2, seq_len=32, precision="32-true")
    h, f = 64, 256
    block = 4 * h * h + 2 * h * f + (4 * h + f + h) + 2 * 2 * h  # 49,984 parameters
    assert terms.layer_param_count(model) == block == 49_984
    z3 = estimate_memory(model, train, ParallelPlan(dp=8, zero=3))
    z3_true = estimate_memory(model, train, ParallelPlan(dp=8, zero=3, reshard_after_forward=True))
    raf2 = estimate_memory(model, train, ParallelPlan(dp=8, zero=3, reshard_after_forward=2))
    raf4 = estimate_memory(model, train, ParallelPlan(dp=8, zero=3, reshard_after_forward=4))
    z2 = estimate_memory(model, train, ParallelPlan(dp=8, zero=2))
    assert z3_true == z3  # True is what zero=3 does anyway
    unit = block * 4
    held = {2: 4 * (unit // 2), 4: 4 * (unit // 4)}  # 399,872 and 199,936 B
    assert held == {2: 399_872, 4: 199_936}
    for n, est in ((2, raf2), (4, raf4)):
        assert est.by_phase["forward"]["comm"] - z3.by_phase["forward"]["comm"] == held[n]
        # the backward's peak is its start (the loss), before any block is gathered again: all L still hold
        assert est.by_phase["backward"]["comm"] - z3.by_phase["backward"]["comm"] == held[n]
        assert est.params == z3.params and est.grads == z3.grads  # the shards themselves do not change
    assert z3.total < raf4.total < raf2.total < z2.total
    batch = 2 * 8 * 2 * 32  # the batch's int64 token ids and targets, alive through the step (issue 26)
    # ZeRO-3 peaks as the loss's backward starts: beside what the loss holds, the last block's all-gather
    # output the root unit's pre-backward hook prefetched (one unit, 199,936 B; FSDPParamGroup._backward_prefetch)
    assert (z3.total, raf2.total, z2.total) == (2_862_656 + batch + unit, 2_862_656 + batch + 399_872 + unit,
                                                3_770_368 + batch)
    assert ParallelPlan(dp=8, zero=3, reshard_after_forward=2).describe() == "dp=8 zero=3 raf=2"
