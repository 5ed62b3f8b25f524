"""plan(): the hand-checked decisions of issue 5, the rules that must emerge, bad input, the
nothing-fits path, JSON round trip, rendering, and the pruned search against brute force."""

from __future__ import annotations

import json
import os

import pytest

from lightning_memplan.hardware import HardwareSpec
from lightning_memplan.model import terms
from lightning_memplan.model.estimate import estimate_memory
from lightning_memplan.model.reserved import reserved_memory
from lightning_memplan.model.result import readable_bytes
from lightning_memplan.model.sizes import kernels_of
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.planning import (
    CHANGE_COST,
    CHANGE_PENALTY,
    SIMPLICITY_MARGIN,
    PlanDecision,
    PlanDoesNotFitError,
    memory_budget,
    plan,
)
from lightning_memplan.planning.space import Allow, enumerate_layouts
from lightning_memplan.planning.timing import Layout, StepTimeModel

GiB = 2**30
LONGCTX = ModelSpec(4, 1024, 8, 128256, ffn_kind="swiglu", norm="rmsnorm", name="longctx")


def _reserved(model, train, plan_, est=None) -> int:
    """The modelled peak reserved bytes of a CUDA step (model/reserved.py), what the planner's fit uses."""
    est = estimate_memory(model, train, plan_) if est is None else est
    return reserved_memory(model, train, plan_, est).reserved


def _fits(d: PlanDecision) -> None:
    assert d.fits and d.reserved.reserved <= d.budget.budget and d.shortfall_bytes == 0
    # the reported estimate is the worst rank's, as estimate_memory computes it independently
    assert d.estimate.total == estimate_memory(d.model, d.train, d.plan).total
    if d.train.device == "cuda" and not d.hardware.name.startswith("cpu"):
        assert d.reserved.reserved == _reserved(d.model, d.train, d.plan) >= d.estimate.total


# --------------------------------------------------------------------------------------------
# Must show: hand-checked cases
# --------------------------------------------------------------------------------------------


def test_small_model_one_gpu_gets_plain_single_device():
    d = plan(ModelSpec.preset("gpt2"), TrainSpec(micro_batch=8, seq_len=1024), HardwareSpec.preset("a100-80gb"))
    _fits(d)
    assert d.plan == ParallelPlan() and d.train == d.base_train  # nothing changed
    # by hand: 124M params in fp32 (4 B) with two fp32 Adam states (8 B): ~1.5 GB << 67 GiB budget
    n = d.model.num_params
    assert d.estimate.params == 4 * n and d.estimate.optimizer == 8 * n


def test_small_model_eight_gpus_gets_plain_dp():
    d = plan(ModelSpec.preset("gpt2"), TrainSpec(micro_batch=8, seq_len=1024), HardwareSpec.preset("a100-80gb", gpus_per_node=8))
    _fits(d)
    assert d.plan == ParallelPlan(8) and d.train == d.base_train
    zero_variants = [c for c in d.candidates if c.plan.zero > 0 and c.plan.dp == 8]
    assert all(c.score >= d.candidates[0].score for c in zero_variants)


def test_states_that_do_not_fit_get_fsdp():
    model = ModelSpec.preset("llama-7b")
    train = TrainSpec(micro_batch=1, seq_len=2048)
    hw = HardwareSpec.preset("a100-80gb", gpus_per_node=8)
    d = plan(model, train, hw, global_batch=64)
    _fits(d)
    # by hand: 6.7e9 params x 16 B = 108 GB of model states per replica > 67 GiB without sharding
    assert model.num_params * 16 > d.budget.budget
    assert d.plan.zero == 3 and d.plan.dp == 8 and d.plan.tp == d.plan.pp == 1
    # FULL_SHARD: 16N / 8 per rank of states
    assert d.estimate.params + d.estimate.optimizer == pytest.approx(model.num_params * 12 / 8, rel=0.02)


def test_single_layer_too_large_gets_tensor_parallel():
    wide = ModelSpec(8, 32768, 256, 32000, ffn_kind="gelu", name="wide")
    hw = HardwareSpec.preset("h100-sxm", gpus_per_node=8, num_nodes=8)
    d = plan(wide, TrainSpec(micro_batch=1, seq_len=2048), hw, global_batch=64)
    _fits(d)
    # one block: 12 h^2 = 12.9e9 params; its fp32 weights alone (51.5 GB) plus Adam (103 GB) exceed a GPU,
    # so neither FSDP (gathers a whole block) nor PP (keeps whole blocks) can hold it: TP splits it.
    layer = 12 * 32768**2
    assert layer * 4 * 2 > d.budget.budget
    assert d.plan.tp > 1  # the block is split (tp=4 with one block per pipeline stage fits)
    assert all(c.plan.tp > 1 for c in d.candidates)
    # without TP nothing fits (the search may rank tp=1 layouts as slower before memory-checking them)
    assert not plan(wide, TrainSpec(micro_batch=1, seq_len=2048), hw, global_batch=64, allow={"tp": [1]}).fits


def test_logits_bound_long_context_gets_chunked_loss_not_more_ranks():
    hw1 = HardwareSpec.preset("h100-sxm")
    train = TrainSpec(micro_batch=1, seq_len=131072)
    d = plan(LONGCTX, train, hw1)
    _fits(d)
    # by hand: naive loss keeps bf16 logits + fp32 input of log_softmax + fp32 log-probs of
    # 131072 x 128256 = 10 B/element x 16.8e9 = 168 GB > 67 GiB; chunked keeps one chunk.
    assert 131072 * 128256 * 10 > d.budget.budget
    assert d.train.loss == "chunked" and d.plan == ParallelPlan()
    naive = estimate_memory(LONGCTX, train, ParallelPlan())
    assert naive.largest_component() == "logits" and naive.total > d.budget.budget
    # with 8 GPUs it stays a loss-mode fix: no context/tensor parallelism and no ZeRO
    d8 = plan(LONGCTX, train, HardwareSpec.preset("h100-sxm", gpus_per_node=8), global_batch=8)
    _fits(d8)
    assert d8.train.loss == "chunked" and d8.plan == ParallelPlan(8)


def test_deep_model_over_slow_network_gets_pp_across_nodes_tp_inside():
    slow = HardwareSpec.preset("a100-80gb", gpus_per_node=8, num_nodes=16).replace(inter_node_bw=100e9 / 8 / 8)
    d = plan(ModelSpec.preset("gpt3-175b"), TrainSpec(micro_batch=1, seq_len=2048), slow, global_batch=512)
    _fits(d)
    assert d.plan.tp > 1 and d.plan.tp * d.plan.cp <= 8  # TP (and any CP) inside the NVLink node
    assert d.plan.pp * d.plan.tp * d.plan.cp > 8  # the pipeline spans nodes
    assert d.plan.zero < 3  # no parameter all-gathers over the 1.6 GB/s network
    assert not d.candidates[0].notes  # nothing crosses nodes except the pipeline
    cross = [c for c in d.candidates if c.plan.tp > 8]
    assert all(c.step.total_s > 5 * d.step.total_s for c in cross)


# --------------------------------------------------------------------------------------------
# Rules that must emerge
# --------------------------------------------------------------------------------------------


def test_tp_stays_inside_a_node_unless_nothing_else_fits():
    model = ModelSpec(16, 8192, 64, 32000, name="m")
    hw = HardwareSpec.preset("h100-sxm", gpus_per_node=8, num_nodes=2)
    d = plan(model, TrainSpec(micro_batch=1, seq_len=4096), hw, global_batch=32)
    _fits(d)
    assert d.plan.tp <= 8
    # forbid everything that could replace cross-node TP: now it is the only fit, and it says so
    only = plan(model, TrainSpec(micro_batch=1, seq_len=4096), hw, global_batch=32,
                allow={"pp": [1], "cp": [1], "zero": [0], "dp": [1]}, memory_budget=40 * GiB)
    _fits(only)
    assert only.plan.tp == 16 and any("crosses nodes" in n for n in only.candidates[0].notes)


def test_more_dp_at_fixed_micro_batch_relieves_no_memory():
    model = ModelSpec.preset("llama-7b")
    train = TrainSpec(micro_batch=1, seq_len=2048)
    peaks = {}
    for nodes in (1, 4):
        hw = HardwareSpec.preset("a100-80gb", gpus_per_node=8, num_nodes=nodes)
        d = plan(model, train, hw, allow=("dp",), top_k=1)
        assert not d.fits
        peaks[nodes] = d.estimate.total
    assert peaks[1] == peaks[4]  # 4x the replicas, same bytes per rank


def test_logits_bound_is_not_fixed_by_zero():
    """ZeRO shards states, not the [b, s, V] logits: with only ZeRO allowed the long-context case does
    not fit, and the suggestion is the loss mode, ranked before more GPUs."""
    hw = HardwareSpec.preset("h100-sxm", gpus_per_node=8)
    d = plan(LONGCTX, TrainSpec(micro_batch=1, seq_len=131072), hw, global_batch=8,
             allow={"tp": [1], "pp": [1], "cp": [1], "loss": ["naive"]})
    assert not d.fits and d.plan.zero in (0, 1, 2, 3)
    assert d.estimate.largest_component() == "logits"
    kinds = [s.kind for s in d.suggestions if s.fits]
    changes = [s.change for s in d.suggestions if s.fits]
    assert changes[0] == "loss='chunked'"
    if "cluster" in kinds:
        assert kinds.index("train") < kinds.index("cluster")


def test_cheapest_sufficient_change_wins_when_close():
    d = plan(ModelSpec.preset("llama-7b"), TrainSpec(micro_batch=1, seq_len=2048),
             HardwareSpec.preset("a100-80gb", gpus_per_node=8), global_batch=64)
    best = d.candidates[0]
    for c in d.candidates[1:]:
        # anything kept below the winner is either slower or needs more machinery
        assert c.step.total_s >= best.step.total_s * (1 - CHANGE_PENALTY * (c.change_cost - best.change_cost)) - 1e-12


# --------------------------------------------------------------------------------------------
# Bad input and nothing fits
# --------------------------------------------------------------------------------------------


def test_world_size_no_plan_divides():
    model = ModelSpec(4, 512, 8, 1000)
    hw = HardwareSpec.preset("a100-80gb", gpus_per_node=7)
    with pytest.raises(ValueError, match=r"world size 7 .* admits no dp x tp x pp x cp layout"):
        plan(model, TrainSpec(micro_batch=1, seq_len=1024), hw, global_batch=64)


def test_global_batch_not_divisible():
    hw = HardwareSpec.preset("a100-80gb", gpus_per_node=8)
    with pytest.raises(ValueError, match=r"global_batch=12 is not divisible by dp x micro-batch"):
        plan(ModelSpec.preset("gpt2"), TrainSpec(micro_batch=1, seq_len=1024), hw, global_batch=12, allow=("dp",))


@pytest.mark.parametrize("budget", [0, -5])
def test_memory_budget_must_be_positive(budget):
    with pytest.raises(ValueError, match="memory_budget"):
        plan(ModelSpec.preset("gpt2"), TrainSpec(micro_batch=1, seq_len=128), HardwareSpec.preset("l4"), memory_budget=budget)


def test_other_bad_arguments():
    m, t, hw = ModelSpec.preset("gpt2"), TrainSpec(micro_batch=1, seq_len=128), HardwareSpec.preset("l4")
    with pytest.raises(TypeError, match="hardware"):
        plan(m, t, "h100")
    with pytest.raises(ValueError, match="headroom"):
        plan(m, t, hw, headroom=1.5)
    with pytest.raises(ValueError, match="global_batch"):
        plan(m, t, hw, global_batch=0)
    with pytest.raises(ValueError, match="allow contains"):
        plan(m, t, hw, allow=("dp", "magic"))


def test_nothing_fits_returns_closest_with_shortfall_and_fixes():
    model = ModelSpec.preset("llama-7b")
    hw = HardwareSpec.preset("h100-sxm")
    d = plan(model, TrainSpec(micro_batch=1, seq_len=4096), hw)
    assert not d.fits and not d.candidates
    assert d.shortfall_bytes == d.reserved.reserved - d.budget.budget > 0
    assert d.reserved.reserved == _reserved(model, d.train, d.plan) > d.estimate.total
    fixes = {s.kind: s for s in d.suggestions if s.fits}
    assert "cluster" in fixes and "GPUs" in fixes["cluster"].change
    assert fixes["cluster"].peak_bytes <= fixes["cluster"].reserved_bytes <= fixes["cluster"].budget_bytes
    with pytest.raises(PlanDoesNotFitError, match=r"short by .* GiB") as err:
        d.require_fit()
    assert isinstance(err.value, ValueError) and err.value.decision is d
    text = d.explain()
    assert "DOES NOT FIT" in text and "changes that would make it fit" in text


def test_suggested_shorter_sequence_fits_and_next_does_not():
    model = ModelSpec(4, 2048, 16, 32000, name="m")
    hw = HardwareSpec.preset("l4")
    d = plan(model, TrainSpec(micro_batch=1, seq_len=32768), hw, allow={"recompute": ["none"], "loss": ["naive"]})
    assert not d.fits
    seq = [s for s in d.suggestions if s.kind == "sequence"]
    assert seq and seq[0].fits
    s_max = int(seq[0].change.split("<=")[1])
    tr = d.train
    unit = 2 * d.plan.cp * d.plan.tp
    fits = _reserved(model, tr.replace(seq_len=s_max), d.plan)
    over = _reserved(model, tr.replace(seq_len=s_max + unit), d.plan)
    budget = memory_budget(hw, d.plan, headroom=0.1).budget
    assert fits <= budget < over


# --------------------------------------------------------------------------------------------
# Serialisation and rendering
# --------------------------------------------------------------------------------------------


def test_json_round_trip_and_rendering():
    d = plan(ModelSpec.preset("llama-7b"), TrainSpec(micro_batch=1, seq_len=2048),
             HardwareSpec.preset("a100-80gb", gpus_per_node=8), global_batch=64)
    data = json.loads(json.dumps(d.to_dict()))
    back = PlanDecision.from_dict(data)
    assert back.to_dict() == d.to_dict()
    assert back.plan == d.plan and back.train == d.train and back.estimate == d.estimate
    assert [c.plan for c in back.candidates] == [c.plan for c in d.candidates]
    text = d.explain()
    assert d.plan.describe() in text and "ranked candidates" in text and "budget per device" in text
    md = d.explain("markdown")
    assert md.startswith("## Parallel plan") and "| component | GiB |" in md and "### Rejected" in md
    rich_text = d.explain("rich")
    assert "memory at the peak" in rich_text and d.plan.describe() in rich_text
    with pytest.raises(ValueError, match="format"):
        d.explain("html")


def test_rejections_carry_reasons_in_words():
    model = ModelSpec(4, 640, 40, 32000, name="odd-heads")
    hw = HardwareSpec.preset("h100-sxm", gpus_per_node=8, num_nodes=2)
    d = plan(model, TrainSpec(micro_batch=1, seq_len=2048), hw, global_batch=16)
    reasons = [r.reason for r in d.rejected]
    assert "n_heads=40 not divisible by tp=16" in reasons
    mem = [r for r in d.rejected if r.kind == "memory" and r.peak_bytes is not None]
    for r in mem:
        assert r.reserved_bytes > r.budget_bytes and f"> {readable_bytes(r.budget_bytes)} budget" in r.reason
        assert f"needs {readable_bytes(r.reserved_bytes)} reserved ({readable_bytes(r.peak_bytes)} allocated)" in r.reason


# --------------------------------------------------------------------------------------------
# The pruned search equals brute force
# --------------------------------------------------------------------------------------------


def _brute_force(model, train, hw, global_batch, budget_bytes=None, headroom=0.1):
    """Every layout x every option, each estimated for every rank (rank=None), best per layout."""
    layouts, _ = enumerate_layouts(model, train, hw.world_size, Allow(), global_batch)
    tm = StepTimeModel(model, train, hw, recomputes=("none", "selective", "selective_op", "full"))
    best_per_layout = []
    for lc in layouts:
        lt = tm.layout(Layout(lc.dp, lc.tp, lc.pp, lc.cp, lc.b, lc.m, lc.schedule, lc.v))
        base = (CHANGE_COST["tp"] if lc.tp > 1 else 0) + (CHANGE_COST["cp"] if lc.cp > 1 else 0)
        base += (CHANGE_COST["pp"] + CHANGE_COST.get(lc.schedule, 0)) if lc.pp > 1 else 0
        base += CHANGE_COST["micro_batch"] if lc.b != train.micro_batch else 0
        best = None
        for rc in ("none", "selective", "selective_op", "full"):
            for z in lc.zeros:
                for lm in lc.losses:
                    for sp in lc.sps:
                        pp = lc.pp > 1
                        p = ParallelPlan(lc.dp, lc.tp, lc.pp, lc.cp, sp=sp, zero=z, microbatches=lc.m if pp else 1,
                                         schedule=lc.schedule if pp else "1f1b", virtual_stages=lc.v if pp else 1)
                        chunk = terms.planned_loss_chunk_tokens(model, kernels_of(train), lc.b * train.seq_len // lc.cp) if lm == "chunked" else None
                        t = train.replace(micro_batch=lc.b, grad_accumulation=1 if pp else lc.m, recompute=rc, loss=lm,
                                          loss_chunk_size=chunk)
                        peak = _reserved(model, t, p)
                        if peak > memory_budget(hw, p, headroom=headroom, explicit=budget_bytes).budget:
                            continue
                        cost = base + (CHANGE_COST[f"zero{z}"] if z else 0) + (CHANGE_COST["sp"] if sp else 0)
                        cost += CHANGE_COST.get(rc, 0) + (CHANGE_COST[lm] if lm != train.loss else 0)
                        axes = (lc.tp > 1) + (lc.pp > 1) + (lc.cp > 1)  # the simplicity margin, per axis
                        score = lt.total(rc, z, lm) / lt.tokens * (1 + CHANGE_PENALTY * cost) * (1 + SIMPLICITY_MARGIN) ** axes
                        if best is None or score < best[0]:
                            best = (score, p, t)
        if best:
            best_per_layout.append(best)
    return sorted(best_per_layout, key=lambda x: x[0])


@pytest.mark.parametrize(
    "model,train,hw,gb,budget",
    [
        (ModelSpec.preset("llama-7b"), TrainSpec(micro_batch=1, seq_len=2048), HardwareSpec.preset("a100-80gb", gpus_per_node=4), 8, None),
        (ModelSpec(12, 2048, 16, 50000, name="mid"), TrainSpec(micro_batch=2, seq_len=4096),
         HardwareSpec.preset("l40s", gpus_per_node=2, num_nodes=2), 8, 20 * GiB),
        # vocabulary-dominated toys at tight budgets: with tp > 1 the vocab-parallel loss can fit where the
        # chunked one does not (neither bounds the other), and at <= 2 blocks per stage no max-saving
        # miss bounds its layout (the pruned search said nothing fits in both)
        (ModelSpec(2, 256, 4, 128256, name="vocab-heavy-2"), TrainSpec(micro_batch=4, seq_len=128),
         HardwareSpec.preset("a100-80gb", gpus_per_node=2), 8, int(0.8 * GiB)),
        (ModelSpec(4, 128, 2, 128256, name="vocab-heavy-4"), TrainSpec(micro_batch=4, seq_len=128),
         HardwareSpec.preset("a100-80gb", gpus_per_node=2), 8, int(0.52 * GiB)),
    ],
    ids=["llama-7b", "mid", "vocab-heavy-2", "vocab-heavy-4"],
)
def test_pruned_search_equals_brute_force(model, train, hw, gb, budget):
    ref = _brute_force(model, train, hw, gb, budget)
    d = plan(model, train, hw, global_batch=gb, memory_budget=budget, top_k=5)
    assert ref, "the scenario must have a fitting plan"
    got = [(c.plan, c.train) for c in d.candidates]
    want = [(p, t) for _, p, t in ref[: len(got)]]
    assert got[0] == want[0]
    assert [round(c.score, 15) for c in d.candidates] == pytest.approx([s for s, _, _ in ref[: len(got)]], rel=1e-9)


def test_worst_rank_is_first_or_last_stage():
    """The planner estimates stage 0 and the last stage only; estimate_memory(rank=None) checks all."""
    model = ModelSpec.preset("llama3-8b")
    for plan_ in (ParallelPlan(2, 2, 4, microbatches=8), ParallelPlan(1, 1, 8, microbatches=16, schedule="interleaved", virtual_stages=2),
                  ParallelPlan(1, 1, 5, microbatches=5, schedule="gpipe"), ParallelPlan(1, 2, 3, sp=True, microbatches=3)):
        for train in (TrainSpec(micro_batch=1, seq_len=4096), TrainSpec(micro_batch=2, seq_len=1024, recompute="full", loss="chunked", loss_chunk_size=256)):
            first = estimate_memory(model, train, plan_, rank=0).total
            last = estimate_memory(model, train, plan_, rank=(plan_.pp - 1) * plan_.dp * plan_.cp * plan_.tp).total
            assert max(first, last) == estimate_memory(model, train, plan_).total


def test_1024_gpus_plan_fits_and_searches_the_whole_space():
    """The answer for 1024 GPUs; its CPU time is measured by ``benchmarks/bench_planner.py`` (no timing here)."""
    model, train = ModelSpec.preset("llama3-70b"), TrainSpec(micro_batch=1, seq_len=8192)
    hw = HardwareSpec.preset("h100-80gb", gpus_per_node=8, num_nodes=128)
    d = plan(model, train, hw, global_batch=1024)
    _fits(d)
    assert d.plan.world_size == 1024 and d.stats["layouts"] > 1000


# --------------------------------------------------------------------------------------------
# Property: whatever the (small) input, a decision is self-consistent
# --------------------------------------------------------------------------------------------

hyp = pytest.importorskip("hypothesis")
st = hyp.strategies


@hyp.settings(max_examples=25 * int(os.environ.get("MEMPLAN_HYPOTHESIS_SCALE", "1")))
@hyp.given(
    layers=st.integers(1, 12), heads=st.sampled_from([1, 2, 4, 8, 12]), head_dim=st.sampled_from([16, 64]),
    vocab=st.integers(50, 60000), seq=st.sampled_from([64, 256, 1024, 4096]), gpn=st.sampled_from([1, 2, 4, 8]),
    nodes=st.integers(1, 3), per_gpu=st.sampled_from([1, 2, 4]), budget_gib=st.sampled_from([None, 0.5, 4, 40]),
    chip=st.sampled_from(["a100-80gb", "l4", "h100-sxm"]),
)
def test_decisions_are_self_consistent(layers, heads, head_dim, vocab, seq, gpn, nodes, per_gpu, budget_gib, chip):
    model = ModelSpec(layers, heads * head_dim, heads, vocab)
    hw = HardwareSpec.preset(chip, gpus_per_node=gpn, num_nodes=nodes)
    world = hw.world_size
    gb = world * per_gpu
    budget = None if budget_gib is None else int(budget_gib * GiB)
    d = plan(model, TrainSpec(micro_batch=1, seq_len=seq), hw, global_batch=gb, memory_budget=budget)
    _check_decision(d, model, world, gb)


def _check_decision(d: PlanDecision, model: ModelSpec, world: int, gb: int) -> None:
    assert d.plan.world_size == world
    m = d.plan.microbatches if d.plan.pp > 1 else d.train.grad_accumulation
    assert d.plan.dp * d.train.micro_batch * m == gb
    assert d.estimate.total == estimate_memory(model, d.train, d.plan).total
    if d.fits:
        assert d.reserved.reserved <= d.budget.budget and d.candidates[0].plan == d.plan
        scores = [c.score for c in d.candidates]
        assert scores == sorted(scores)
        assert all(c.fits for c in d.candidates)
    else:
        assert d.shortfall_bytes > 0 and not d.candidates and d.suggestions
    assert PlanDecision.from_dict(json.loads(json.dumps(d.to_dict()))).to_dict() == d.to_dict()


@hyp.settings(max_examples=25 * int(os.environ.get("MEMPLAN_HYPOTHESIS_SCALE", "1")))
@hyp.given(
    layers=st.integers(1, 16), kv=st.sampled_from([1, 2, 4, 8]), vocab=st.integers(1000, 130000),
    seq=st.sampled_from([128, 2048, 32768]), gpn=st.sampled_from([2, 4, 8]), nodes=st.integers(1, 2),
    precision=st.sampled_from(["bf16-mixed", "bf16-true", "32-true", "16-mixed"]),
    attention=st.sampled_from(["sdpa", "eager"]), user_loss=st.sampled_from(["naive", "fp32_upcast", "chunked"]),
    zero=st.sets(st.sampled_from([0, 1, 2, 3]), min_size=1), recompute=st.sets(st.sampled_from(["none", "selective", "full"]), min_size=1),
    sp=st.sets(st.booleans(), min_size=1), schedule=st.sets(st.sampled_from(["gpipe", "1f1b", "interleaved"]), min_size=1),
    budget_gib=st.sampled_from([None, 2, 16]),
)
def test_decisions_respect_allow_and_stay_consistent(
    layers, kv, vocab, seq, gpn, nodes, precision, attention, user_loss, zero, recompute, sp, schedule, budget_gib
):
    model = ModelSpec(layers, 1024, 8, vocab, n_kv_heads=kv, ffn_kind="swiglu", norm="rmsnorm")
    hw = HardwareSpec.preset("h100-sxm", gpus_per_node=gpn, num_nodes=nodes)
    world = hw.world_size
    train = TrainSpec(micro_batch=1, seq_len=seq, precision=precision, attention=attention, loss=user_loss)
    allow = {"zero": sorted(zero), "recompute": sorted(recompute), "sp": sorted(sp), "schedule": sorted(schedule)}
    budget = None if budget_gib is None else budget_gib * GiB
    d = plan(model, train, hw, global_batch=2 * world, memory_budget=budget, allow=allow)
    _check_decision(d, model, world, 2 * world)
    for chosen in (d.plan, *(c.plan for c in d.candidates)):
        assert chosen.sp in sp or chosen.tp == 1
        assert chosen.zero in zero or chosen.dp == 1
        assert chosen.schedule in schedule or chosen.pp == 1
    assert d.train.recompute in recompute and d.train.precision == train.precision


def test_sentences_use_a_readable_unit_for_small_budgets():
    assert [readable_bytes(n) for n in (512, 50 * 2**20, 3 * 2**30 // 2, -2048)] == ["512 B", "50.0 MiB", "1.5 GiB", "-2.0 KiB"]
    d = plan(ModelSpec(4, 256, 4, 8000), TrainSpec(micro_batch=8, seq_len=512), HardwareSpec.preset("l4"),
             memory_budget=100 * 2**20)  # 8 GPUs fit it: the nothing-fits suggestions stop there
    assert not d.fits
    msg = str(pytest.raises(PlanDoesNotFitError, d.require_fit).value)
    assert "MiB allocated) > 100.0 MiB budget (short by " in msg and "0.0 GiB" not in msg and " 0 GiB" not in msg
