"""The step-time model reproduces published training throughput within 15 % on the published layout
(every row of ``benchmarks/planner_vs_published.py``: torchtitan on H100 and A100, Megatron-LM's
Table 1, Llama 3's Table 4; sources in the rows)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "planner_vs_published.py"
_spec = importlib.util.spec_from_file_location("planner_vs_published", _PATH)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)

ROWS = bench.rows() + bench.more_rows()


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_published_layout_predicted_within_15_percent(row):
    got = bench.predicted(row)
    assert abs(got / row.published - 1) <= 0.15, f"{row.name}: predicted {got:.4g} vs published {row.published} {row.metric}"


def test_rows_cover_the_issue_table():
    names = " ".join(r.name for r in bench.rows())
    for needle in ("8B, FSDP 8", "8B, FSDP 64", "70B, FSDP 64", "145.6B", "1T", "405B"):
        assert needle in names


@pytest.mark.parametrize("row", bench.rows()[:3], ids=[r.name for r in bench.rows()[:3]])
def test_choice_at_least_as_fast_and_published_layout_fits(row):
    """On the torchtitan clusters (global batch as published) the planner's own choice is predicted at
    least as fast as the published layout, and the published layout forced with allow= fits."""
    from lightning_memplan.planning import plan

    forced = plan(row.model, row.train, row.hardware, global_batch=row.global_batch,
                  allow=bench._allow_of(row.plan, row.train), top_k=1)
    assert forced.fits and forced.plan == row.plan
    full = plan(row.model, row.train, row.hardware, global_batch=row.global_batch, top_k=1)
    assert full.fits and full.step.tokens_per_s >= forced.step.tokens_per_s


LLAMA3_405B = [r for r in ROWS if r.name.startswith("Llama 3 405B")]
LONG_CONTEXT = bench.long_context_rows()


def _plan_405b(row, **allow_overrides):
    from lightning_memplan.planning import plan

    allow = {**bench._allow_of(row.plan, row.train), **allow_overrides}
    return plan(row.model, row.train, row.hardware, global_batch=row.global_batch, allow=allow, top_k=1, headroom=0.0)


@pytest.mark.parametrize("row", LLAMA3_405B, ids=[r.name for r in LLAMA3_405B])
def test_405b_choice_at_least_as_fast_as_the_published_layout_that_fits(row):
    """Llama 3 405B (arXiv 2407.21783 Table 4), planned with the run's own budget (headroom 0): the
    planner's choice is predicted at least as fast as the published layout (TP 8 x PP 16 x DP,
    interleaved) with the recompute mode that fits, and at least as fast as the published layout itself
    where that fits."""
    from lightning_memplan.planning import plan

    full = plan(row.model, row.train, row.hardware, global_batch=row.global_batch, top_k=1, headroom=0.0)
    assert full.fits
    published_fitting = _plan_405b(row, recompute=["none", "selective_op", "selective", "full"])
    assert published_fitting.fits and published_fitting.plan.tp == 8 and published_fitting.plan.pp == 16
    assert full.step.tokens_per_s >= published_fitting.step.tokens_per_s
    forced = _plan_405b(row)
    if forced.fits:
        assert full.step.tokens_per_s >= forced.step.tokens_per_s


def test_405b_choice_on_16k_gpus_is_the_published_layout():
    """On Llama 3's 16,384 H100 the choice is the published layout itself (TP 8 x PP 16 x DP 128, v = 8,
    zero 2). Adding CP 2 (DP 64) is predicted 3.9 % faster (half the interleaved bubble), below the 5 %
    a parallel dimension must buy (SIMPLICITY_MARGIN); the explanation says so in numbers."""
    from lightning_memplan.planning import plan

    row = next(r for r in LLAMA3_405B if "16,384" in r.name)
    full = plan(row.model, row.train, row.hardware, global_batch=row.global_batch, top_k=1, headroom=0.0)
    forced = _plan_405b(row)
    assert (full.plan, full.train) == (forced.plan, forced.train) and full.plan == row.plan
    note = next(n for n in full.notes if n.startswith("fastest predicted plan"))
    assert re.search(r"cp=2 .*it is predicted [0-4]\.\d% faster but adds cp; each added parallel dimension must buy > 5%", note)


def test_405b_choice_on_8k_gpus_keeps_cp_only_where_memory_needs_it():
    """On 8,192 H100 the published layout does not fit the memory model (79.7 GiB reserved, 79.3 GiB
    allocated, vs a 78.5 GiB budget; see the xfail below); every layout without CP then needs recompute,
    and the explanation names the best of them and the gain, above the 5 % margin, that justifies CP."""
    from lightning_memplan.planning import SIMPLICITY_MARGIN, plan

    row = next(r for r in LLAMA3_405B if "8,192" in r.name)
    full = plan(row.model, row.train, row.hardware, global_batch=row.global_batch, top_k=1, headroom=0.0)
    assert full.fits and full.plan.cp > 1
    note = next(n for n in full.notes if n.startswith("without cp: best "))
    gain = float(re.search(r"the choice is predicted ([\d.]+)% faster", note).group(1))
    assert "cp=" not in note.split(":")[1] and gain > 100 * SIMPLICITY_MARGIN


def test_70b_on_64_a100_choice_is_fsdp_x_tp_inside_the_node():
    """Llama 3 70B on torchtitan's 64 A100: the choice is FSDP x TP 8 (torchtitan's 2D), not the
    TP 4 x PP 4 x CP 4 layout predicted 4.9 % faster with two more dimensions (> 10.25 % needed); and the
    single added dimension (tp) is justified by more than the margin over FSDP alone."""
    from lightning_memplan.planning import SIMPLICITY_MARGIN, plan

    row = next(r for r in bench.rows() if "70B" in r.name)
    full = plan(row.model, row.train, row.hardware, global_batch=row.global_batch, top_k=1, headroom=0.0)
    p = full.plan
    assert (p.dp, p.tp, p.pp, p.cp) == (8, 8, 1, 1)
    fastest = next(n for n in full.notes if n.startswith("fastest predicted plan"))
    assert "adds pp and cp" in fastest and "2 > 10.3%" in fastest
    without_tp = next(n for n in full.notes if n.startswith("without tp: best "))
    gain = float(re.search(r"the choice is predicted ([\d.]+)% faster", without_tp).group(1))
    assert gain > 100 * SIMPLICITY_MARGIN


def test_simplicity_margin_is_within_the_time_models_error_band():
    """SIMPLICITY_MARGIN's rationale: a predicted gain smaller than the model's own error against
    published runs does not justify a parallel dimension; the margin is at most the median |error| of
    the pinned rows (5.8 % today)."""
    from lightning_memplan.planning import SIMPLICITY_MARGIN

    assert 0 < 100 * SIMPLICITY_MARGIN <= bench.median_abs_error()


_8K_GPUS_XFAIL = pytest.mark.xfail(strict=True, reason=(
    "does not hold yet on 8,192 GPUs (m = 32 sequences per DP rank): stage 1 needs 79.7 GiB reserved (79.3 GiB "
    "allocated) vs the 78.5 GiB budget: activations 70.0 GiB = 17.6 in-flight micro-batches (torch's / Megatron's interleaved warm-up, "
    "(v-1) p + 2 (p-1-i) + 1 chunk forwards) x 8 blocks x 0.497 GiB (Megatron-style SP, no recompute), plus "
    "5.9 GiB of bf16 parameters kept unsharded (not resharded after forward), 1.5 GiB of one block's fp32 "
    "gradient awaiting its reduce-scatter and 0.2 GiB of the last backward's matmul input gradient; on 16,384 "
    "GPUs (m = 16) the same stage holds 16 and fits at 72.7 GiB reserved (72.3 GiB allocated). Llama 3's own schedule (section 3.3.2, a tunable number N of consecutive micro-batches per stage) "
    "and its proactive deallocation are not modelled"))


@pytest.mark.parametrize("row", [pytest.param(r, marks=_8K_GPUS_XFAIL) if "8,192" in r.name else r
                                 for r in LLAMA3_405B + LONG_CONTEXT], ids=[r.name for r in LLAMA3_405B + LONG_CONTEXT])
def test_405b_published_layout_fits_when_forced(row):
    """Llama 3 405B ran this layout on 80 GB H100s; the memory model fits it when forced with Llama 3's
    recipe (``framework="llama3"``: first and last stage one block lighter, Megatron-style sequence
    parallelism, gradients reduce-scattered per micro-batch; no recompute, zero=2; headroom 0: the run is
    known to have fit, so only the device's own overheads are subtracted)."""
    from lightning_memplan.planning import plan

    assert row.train.framework == "llama3" and row.train.recompute == "none" and row.plan.zero == 2
    forced = plan(row.model, row.train, row.hardware, global_batch=row.global_batch,
                  allow=bench._allow_of(row.plan, row.train), top_k=1, headroom=0.0)
    assert forced.plan == row.plan
    assert forced.fits, f"{forced.chosen.need_text()} vs budget {forced.budget.budget / 2**30:.1f} GiB"


@pytest.mark.parametrize("row", LONG_CONTEXT, ids=[r.name for r in LONG_CONTEXT])
def test_long_context_row_is_reported_between_the_two_mfu_conventions(row):
    """Llama 3's CP 16 row at 131K: the throughput is not pinned within 15 % (the MFU convention for the
    attention square decides it, see the row's note), but the published 38 % lies between the model's
    full-square and causal-half readings."""
    from lightning_memplan.planning import flops as F

    full_square = bench.predicted(row)
    s = row.train.seq_len
    share = row.model.n_layers * F.attention_flops_per_token(row.model, s) / F.model_flops_per_token(row.model, s)
    causal_half = full_square * (1 - share / 2)
    assert causal_half < row.published < full_square
