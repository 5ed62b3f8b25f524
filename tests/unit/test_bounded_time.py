"""Bounded time for any int (issue 23): every loop whose length depends on a user value is bounded by
arithmetic, and the bounded forms give exactly what the unbounded ones gave where those are computable.

- the pipeline timeline: :func:`stage_moments` replays a bounded part of the step; compared here with the
  undominated set over *every* backward (:func:`backward_moments`, the full replay) for every stage of
  p <= 8, m <= 64, v <= 4 and the three schedules, with unequal chunk shares;
- divisors by factorisation (``validation.divisors``, ``planning.space.divisors``), compared with the
  definition;
- absurd sizes refused with a named bound (``MAX_WORLD_SIZE``, ``MAX_GPUS_PER_NODE``, ``MAX_PIPELINE_CHUNKS``);
- the issue's calls (``plan(num_nodes=2**80)``, ``plan(gpus_per_node=2**40)``, ``plan(global_batch=2**80)``,
  ``estimate(pp=2, microbatches=10**9)``) answer; each runs under a generous hang guard (a thread joined
  for :data:`HANG_GUARD_S`), which catches a loop linear in the value, not a slow machine.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest

from lightning_memplan.hardware import HardwareSpec
from lightning_memplan.hardware.spec import MAX_GPUS_PER_NODE
from lightning_memplan.model import estimate_memory
from lightning_memplan.model.pipeline_timeline import (
    MAX_LISTED_BACKWARDS,
    StageMoment,
    backward_moments,
    stage_moments,
)
from lightning_memplan.model.specs import MAX_PIPELINE_CHUNKS, ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.planning import plan
from lightning_memplan.planning.space import Allow, divisors, enumerate_layouts
from lightning_memplan.validation import MAX_WORLD_SIZE
from lightning_memplan.validation import divisors as bounded_divisors

HANG_GUARD_S = 10.0  # a hang guard, not a speed bound: a loop linear in 2**80 never ends
SMALL = ModelSpec(2, 64, 4, 128)
TRAIN = TrainSpec(micro_batch=2, seq_len=32)


def answer(call: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """``call()``'s result or exception, failing the test if it has not answered within the hang guard."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(HANG_GUARD_S)
    assert not worker.is_alive(), f"no answer within the {HANG_GUARD_S} s hang guard"
    return out.get("value"), out.get("error")


# ------------------------------------------------------------------------------ pipeline timeline
def _undominated_over_every_backward(stage: int, p: int, m: int, schedule: str, v: int,
                                     acts: tuple[float, ...], grads: tuple[float, ...],
                                     has_head: bool) -> list[StageMoment]:
    """The reference: every backward of the full replay, weighted as stage_moments does, then the
    pairwise filter (a moment is dropped when another is >= in every field)."""
    chunks = len(acts)
    weighted = set()
    for held_n, chunk, done in set(backward_moments(stage, p, m, schedule, v if chunks > 1 else 1)):
        before = sum((g for g, d in zip(grads, done, strict=True) if d), 0.0)
        after = before if done[chunk] else before + grads[chunk]
        held = sum(n * a for n, a in zip(held_n, acts, strict=True))
        weighted.add(StageMoment(held, held - acts[chunk], float(held_n[-1]) if has_head else 0.0,
                                 has_head and chunk == chunks - 1, before, min(after, 1.0)))
    return sorted(a for a in weighted
                  if not any(b != a and all(x >= y for x, y in zip(b, a, strict=True)) for b in weighted))


def _shares(rng: random.Random, n: int) -> tuple[float, ...]:
    raw = [rng.random() + 0.05 for _ in range(n)]
    return tuple(x / sum(raw) for x in raw)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_bounded_timeline_equals_the_full_replay(schedule: str) -> None:
    rng = random.Random(23)
    compared = 0
    for p in (1, 2, 3, 4, 8) if schedule != "interleaved" else (2, 3, 4, 8):
        for v in (1, 2, 3, 4) if schedule == "interleaved" else (1,):
            for m in range(1, 65):
                for stage in range(p):
                    acts, grads = _shares(rng, v), _shares(rng, v)
                    has_head = stage == p - 1
                    ours = list(stage_moments(stage, p, m, schedule, v, acts, grads, has_head))
                    assert ours == _undominated_over_every_backward(stage, p, m, schedule, v, acts, grads, has_head), (
                        schedule, p, m, v, stage)
                    compared += 1
    assert compared > 1000


@pytest.mark.parametrize(("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4)])
def test_the_timeline_answers_for_any_number_of_micro_batches(schedule: str, v: int) -> None:
    p = 8
    small = [stage_moments(s, p, 64, schedule, v, (1 / v,) * v, (1 / v,) * v, s == p - 1) for s in range(p)]
    for m in (10**9, 2**80):
        m -= m % p  # interleaved needs a multiple of p
        big, error = answer(lambda m=m: [stage_moments(s, p, m, schedule, v, (1 / v,) * v, (1 / v,) * v, s == p - 1)
                                          for s in range(p)])
        assert error is None, error
        # 1F1B and interleaved reach their steady state within 64 micro-batches: the same moments
        if schedule != "gpipe":
            assert big == small


def test_backward_moments_refuses_an_unbounded_listing_by_name() -> None:
    with pytest.raises(ValueError, match=r"m=1000000000 .*stage_moments"):
        backward_moments(0, 2, 10**9, "1f1b")
    assert len(backward_moments(0, 2, MAX_LISTED_BACKWARDS, "1f1b")) == MAX_LISTED_BACKWARDS


def test_estimate_with_a_billion_micro_batches_answers() -> None:
    model = ModelSpec(8, 64, 4, 128)
    for schedule, extra in (("1f1b", {}), ("gpipe", {}), ("interleaved", {"virtual_stages": 2})):
        result, error = answer(lambda s=schedule, e=extra: estimate_memory(
            model, TRAIN, ParallelPlan(pp=2, microbatches=10**9, schedule=s, **e)))
        assert error is None, error
        assert result.total > 0


def test_estimates_do_not_change_for_ordinary_micro_batch_counts() -> None:
    """The bounded replay is the same estimate: GPipe, whose held micro-batches grow with m, still
    counts all of them; 1F1B's stop growing once m > p (the whole breakdown is the same for m = 4, 64 and
    10**6 but for the dataloader batch every stage receives, m micro-batches of int64 ids and targets,
    which grows with m and is counted in ``other`` at every phase)."""
    model = ModelSpec(8, 64, 4, 128)
    gpipe = [estimate_memory(model, TRAIN, ParallelPlan(pp=2, microbatches=m, schedule="gpipe")).activations
             for m in (2, 4, 8)]
    assert gpipe[0] < gpipe[1] < gpipe[2]
    ms = (4, 64, 10**6)
    ones = [estimate_memory(model, TRAIN, ParallelPlan(pp=2, microbatches=m)).to_dict() for m in ms]
    for m, one in zip(ms, ones, strict=True):
        batch = one["details"].pop("batch_input")
        assert batch == 16 * TRAIN.micro_batch * TRAIN.seq_len * m  # ids and targets, 8 B each per token
        one["other"] -= batch
        one["total"] -= batch
        for phase in one["by_phase"].values():
            phase["other"] -= batch
    assert ones[0] == ones[1] == ones[2]


# ---------------------------------------------------------------------------------------- divisors
def test_divisors_by_factorisation_match_the_definition() -> None:
    for n in range(1, 2000):
        expected = [d for d in range(1, n + 1) if n % d == 0]
        assert bounded_divisors(n) == expected == divisors(n)
    assert divisors(MAX_WORLD_SIZE) == [2**k for k in range(25)]
    with pytest.raises(ValueError, match=r"n=1000000000000000000000 is too large"):
        divisors(10**21)


def test_reshard_choices_come_from_the_factorisation() -> None:
    with pytest.raises(ValueError, match=r"use one of \[2, 3, 4, 6\]"):
        ParallelPlan(dp=12, zero=3, reshard_after_forward=5)


# ------------------------------------------------------------------------------------ named bounds
def test_absurd_sizes_are_refused_naming_the_bound() -> None:
    with pytest.raises(ValueError, match=r"num_nodes=\d+ must be <= 16777216.*MAX_WORLD_SIZE"):
        HardwareSpec.preset("l4", num_nodes=2**80)
    with pytest.raises(ValueError, match=rf"gpus_per_node=1099511627776 must be <= {MAX_GPUS_PER_NODE}"):
        HardwareSpec.preset("l4", gpus_per_node=2**40)
    with pytest.raises(ValueError, match=r"gpus_per_node=4096 x num_nodes=8192 .*MAX_WORLD_SIZE"):
        HardwareSpec.preset("l4", gpus_per_node=4096, num_nodes=8192)
    with pytest.raises(ValueError, match=r"dp\*tp\*pp\*cp=.*MAX_WORLD_SIZE"):
        ParallelPlan(dp=2**20, tp=2**5)
    with pytest.raises(ValueError, match=rf"pp=256 x virtual_stages=4 .*MAX_PIPELINE_CHUNKS={MAX_PIPELINE_CHUNKS}"):
        ParallelPlan(pp=256, microbatches=256, schedule="interleaved", virtual_stages=4)
    ParallelPlan(dp=2**22, tp=4)  # exactly MAX_WORLD_SIZE is accepted
    ParallelPlan(pp=MAX_PIPELINE_CHUNKS, microbatches=MAX_PIPELINE_CHUNKS)


def test_the_search_rejects_deeper_pipelines_than_the_bound() -> None:
    deep = ModelSpec(4096, 64, 4, 128)
    layouts, rejected = enumerate_layouts(deep, TRAIN.replace(grad_accumulation=2048), 2048,
                                          Allow(tp=(1,), cp=(1,), micro_batch=(1,)), None)
    assert layouts and all(lay.pp * lay.v <= MAX_PIPELINE_CHUNKS for lay in layouts)
    assert max(lay.pp for lay in layouts) == MAX_PIPELINE_CHUNKS
    bound = {where for where, kind, _ in rejected if kind == "bound"}
    assert bound == {"tp=1 pp=1024", "tp=1 pp=2048"}


# ---------------------------------------------------------------------------- the issue's calls
@pytest.mark.parametrize(
    "call",
    [
        lambda: plan(SMALL, TRAIN, HardwareSpec.preset("l4", num_nodes=2**80)),
        lambda: plan(SMALL, TRAIN, HardwareSpec.preset("l4", gpus_per_node=2**40)),
        lambda: plan(SMALL, TRAIN, HardwareSpec.preset("l4"), global_batch=2**80),
        lambda: plan(SMALL, TRAIN, HardwareSpec.preset("h100", gpus_per_node=8, num_nodes=8), global_batch=2**80),
        lambda: plan(SMALL, TRAIN, HardwareSpec.preset("h100", gpus_per_node=8, num_nodes=2**21)),
        lambda: estimate_memory(ModelSpec(8, 64, 4, 128), TRAIN, ParallelPlan(pp=2, microbatches=10**9)),
    ],
    ids=["num_nodes=2**80", "gpus_per_node=2**40", "global_batch=2**80", "64 GPUs global_batch=2**80",
         "world=2**24", "pp=2 m=10**9"],
)
def test_the_issues_calls_answer(call: Callable[[], Any]) -> None:
    result, error = answer(call)
    if error is not None:
        assert isinstance(error, ValueError) and "=" in str(error), repr(error)
    else:
        assert result is not None


def test_specs_hold_plain_json_after_numpy_and_tensor_scalars() -> None:
    np = pytest.importorskip("numpy")
    import torch

    model = ModelSpec(np.int64(2), torch.tensor(64), np.int32(4), np.uint16(128), dropout=np.float32(0.25),
                      bias=np.bool_(True), n_kv_heads=np.int64(2))
    train = TrainSpec(micro_batch=np.int64(2), seq_len=torch.tensor(32), optimizer_bytes_per_param=np.float64(8.0),
                      master_weights=torch.tensor(False))
    layout = ParallelPlan(np.int64(2), pp=np.int8(2), microbatches=torch.tensor(4), zero=np.int64(1), sp=np.bool_(False))
    hw = HardwareSpec("gpu", np.int64(2**34), gpus_per_node=np.int64(8), peak_flops=np.float32(1e12))
    import dataclasses

    def plain(value: Any) -> bool:  # JSON's own types all the way down (tuples are JSON arrays)
        if isinstance(value, (list, tuple)):
            return all(plain(v) for v in value)
        if isinstance(value, dict):
            return all(type(k) is str and plain(v) for k, v in value.items())
        return type(value) in (int, float, bool, str, type(None))

    def as_json(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [as_json(v) for v in value]
        if isinstance(value, dict):
            return {k: as_json(v) for k, v in value.items()}
        return value

    for spec in (model, train, layout, hw):
        data = dataclasses.asdict(spec)
        text = json.dumps(data)  # numpy/tensor values would raise here
        assert json.loads(text) == as_json(data)
        assert plain(data), data
    assert model.to_dict()["n_layers"] == 2 and type(model.to_dict()["n_layers"]) is int
    assert type(hw.memory_bytes) is int and hw.memory_bytes == 2**34
    assert model.dropout == 0.25 and train.optimizer_bytes_per_param == 8.0 and layout.zero == 1
