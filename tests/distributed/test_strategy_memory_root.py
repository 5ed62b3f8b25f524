"""FSDP2's root unit at the end of the backward, against the tensor-level measurement (2 gloo ranks).

A large vocabulary (V = 8192, h = 64, two blocks, b = 2, s = 48, fp32, AdamW, ZeRO-3) makes the
embedding and lm_head most of the model, so the end of the backward is the measured step peak: the
root unit (``LinearCrossEntropy`` reads ``lm_head.weight`` in ``training_step``, so the strategy keeps
the embedding and head in the root) reduce-scatters last, in the backward's final callback, with its
unsharded gradients and their reduce-scatter copy-in alive
(:func:`lightning_memplan.model.terms.fsdp_root_post_backward_bytes`).

Measured here: step peak 19,868,256 B (backward, at FSDP's copy-in), estimate 19,341,440 B (its
forward phase; -2.7 %). The estimate's backward phase is 18,478,336 B with the root term (-7.0 % of the
measured backward peak) and 15,022,592 B without it (-24.4 %); the measured copy-in moment also holds
one more [V, h] fp32 tensor (2,097,152 B, classified as activations) not yet identified.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from test_strategy_budget import ESTIMATE_RTOL, SteadyStepMeter  # noqa: I001
from test_strategy_parity import make_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_memplan.model.specs import ParallelPlan, TrainSpec
from lightning_memplan.testing import run_distributed
from lightning_memplan.testing.zoo import GPT, GPTConfig

VOCAB, SEQ, HIDDEN, BATCH, STEPS = 8192, 48, 64, 2, 4


class WideVocabLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from lightning_memplan.loss import LinearCrossEntropy

        torch.manual_seed(0)
        self.model = GPT(GPTConfig(VOCAB, 2, HIDDEN, 4, max_positions=SEQ, ffn_kind="swiglu", n_kv_heads=2,
                                   norm="rmsnorm", position_embedding="rope", bias=False))
        self.loss_fn = LinearCrossEntropy()

    def training_step(self, batch, batch_idx):
        return self.loss_fn(self.model(batch[0]), self.model.lm_head.weight, batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def root_worker(rank: int, world: int) -> dict:
    from lightning_memplan.strategies import MemplanAutoStrategy

    plan = ParallelPlan(dp=2, zero=3)
    tokens = torch.randint(0, VOCAB, (BATCH * STEPS * plan.dp, SEQ + 1), generator=torch.Generator().manual_seed(1))
    meter = SteadyStepMeter(SEQ, VOCAB)
    train = TrainSpec(micro_batch=BATCH, seq_len=SEQ, precision="32-true", device="cpu", loss="chunked")
    strategy, module = MemplanAutoStrategy(plan=plan, train=train), WideVocabLM()
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)
    make_trainer(strategy, steps=STEPS, callbacks=[meter]).fit(module, loader)
    est = strategy.decision.estimate
    return {"estimate": est.total, "est_backward": sum(est.by_phase["backward"].values()),
            "measured_backward": sum(meter.report.by_phase["backward"].values()), "ops": dict(meter.report.peak_ops), "phase": est.peak_phase, "by_phase": est.by_phase,
            "measured": meter.report.total, "measured_phase": meter.report.peak_phase,
            "components": {k: v for k, v in meter.report.peak.items() if v}}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_root_unit_end_of_backward_matches_the_estimate():
    for rank, r in enumerate(run_distributed(root_worker, 2, timeout_s=280)):
        err = r["estimate"] / r["measured"] - 1
        print(f"rank {rank}: estimate {r['estimate']:,} B ({r['phase']}), measured {r['measured']:,} B "
              f"({r['measured_phase']}, {err:+.2%}) {r['components']} est {r['by_phase'][r['phase']]} {r['ops']}")
        assert r["measured_phase"] == "backward"
        assert abs(err) <= ESTIMATE_RTOL, (rank, r)
        # the backward phase with the root unit's post-backward: within 10 % (24 % short without it)
        assert abs(r["est_backward"] / r["measured_backward"] - 1) <= 0.10, (rank, r)
