"""Issue 35: torchtitan's published Float8 rows (benchmarks/llama3_h100_202412_torchtitan.md at 9dec370,
Llama 3.1 8B, FSDP, local batch 2, seq 8192, selective AC, 8 x H100 96 GB):

====================  =========================  ================================
table                 "FSDP + torch.compile"     "FSDP + torch.compile + Float8"
====================  =========================  ================================
Table 1 (8 GPUs)      77.0 GiB                   76.8 GiB
Table 3 (128 GPUs)    62.0 GiB                   61.8 GiB
====================  =========================  ================================

How compile's own effect is kept apart: each Float8 row is paired with the "+ compile" row of its table,
which differs from it in Float8 alone (both compiled). The estimate models neither row's compile (its
reserved figure for the compiled bf16 row is the eager one, +5.8% / +8.7% over the published), so the
comparison that isolates Float8 is the pair's difference: published -0.2 GiB in both tables; estimated as
the same TrainSpec with and without ``float8="tensorwise"`` (FSDP2 all-gathers the float8 linears' weights in
one byte instead of two: the all-gather pool holds two blocks, 2 x 218M values, -0.41 GiB). Nothing here was
fitted to these rows; the float8 terms come from torchao's code (``lightning_memplan/model/float8.py``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from lightning_memplan.model import quantized
from lightning_memplan.model.estimate import estimate_memory
from lightning_memplan.model.reserved import reserved_memory
from lightning_memplan.model.specs import ModelSpec

GiB = 2**30


def _bench():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "published_gpu.py"
    spec = importlib.util.spec_from_file_location("published_gpu", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["published_gpu"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("table", "compiled", "float8"), [("Table 1", 77.0, 76.8), ("Table 3", 62.0, 61.8)])
def test_float8_rows_within_10_percent_and_below_bf16_by_at_most_1_gib(table: str, compiled: float,
                                                                       float8: float) -> None:
    bench = _bench()
    bf16_row = next(r for r in bench.RUNS if r.name == f"{table} FSDP + compile")
    f8_row = next(r for r in bench.RUNS if r.name == f"{table} FSDP + compile + Float8")
    assert (bf16_row.published_gib, f8_row.published_gib) == (compiled, float8)
    # the pair differs in Float8 alone: compile is held fixed on both sides
    assert f8_row.train == bf16_row.train.replace(float8="tensorwise") and f8_row.plan == bf16_row.plan
    bf16, f8 = bench.evaluate(bf16_row), bench.evaluate(f8_row)
    assert f8["hit"] and abs(f8["error"]) <= 0.10, f8["error"]
    saving = bf16["reserved"] - f8["reserved"]
    assert 0 < saving <= 1 * GiB, saving / GiB
    # the saving is FSDP2's float8 all-gather: two gathered blocks of float8 linears at one byte less per value,
    # less one fp32 precomputed scale per float8 weight (7 per block, 32 blocks)
    model = ModelSpec.preset("llama3-8b")
    assert saving == 2 * quantized.quantized_block_numel(model) - 4 * 7 * 32
    published_saving = (compiled - float8) * GiB
    assert abs(saving - published_saving) < 0.25 * GiB  # -0.41 GiB estimated, -0.2 GiB published


def test_float8_allocated_peak_at_the_loss_differs_by_the_prefetched_unit_only() -> None:
    """The allocated peak of these runs is the loss's backward start (the fp32 logits of 16384 tokens x
    128256), where FSDP2's root pre-backward hook has already prefetched the last block (torch 2.13
    ``_fsdp_param_group.FSDPParamGroup._backward_prefetch``): with float8 all-gather that unit's linear weights
    are gathered in float8, 1 byte each instead of bf16's 2, so the float8 peak is the bf16 one less one
    block's linear weights, plus the scales; the float8 copies (largest linear, 0.5 GiB in backward) sit at the
    last block's backward, below it."""
    from lightning_memplan.model.terms import layer_param_count

    bench = _bench()
    row = next(r for r in bench.RUNS if r.name == "Table 1 FSDP + compile + Float8")
    model = ModelSpec.preset("llama3-8b")
    est = estimate_memory(model, row.train, row.plan)
    plain = estimate_memory(model, row.train.replace(float8=None), row.plan)
    linear_weights = layer_param_count(model) - 2 * model.hidden  # a block less its two RMSNorm weights
    assert linear_weights == 218_103_808  # 4096 x (4096 + 1024 + 1024 + 4096) + 3 x 4096 x 14336
    assert est.peak_phase == "backward"
    assert est.total == plain.total - linear_weights + est.details["float8_scale_bytes"]
    assert est.details["float8_scale_bytes"] == 4 * 7 * 32
    assert est.details["low_precision_backward_transient"] < 0.6 * GiB
    assert (reserved_memory(model, row.train, row.plan, est).reserved
            < reserved_memory(model, row.train.replace(float8=None), row.plan, plain).reserved)
