"""A Hugging Face ``LlamaForCausalLM`` from a tiny config (no download) trains under memplan_auto with
pipeline parallelism on 2 gloo processes, and its losses equal single-process training.

The plan is forced as ``ParallelPlan(pp=2)``: ParallelPlan's default ``microbatches=1`` cannot run 1F1B
over two stages, so memplan_auto must replace it by 2 at setup and say so. The stages run the built-in
Llama slice forward (``parallel/pipeline.py``): stage 0 holds ``model.embed_tokens`` and block 0,
stage 1 block 1, ``model.norm`` and ``lm_head``. The loss is transformers' own causal-LM loss
(``LlamaForCausalLM.loss_function``: labels shifted inside), per micro-batch; every micro-batch holds
the same number of tokens, so the schedule's mean of micro-batch means is the whole batch's mean.
Tolerance on losses: ``atol=2e-5`` (fp32, SGD), as in ``test_strategy_hf``.
"""

from __future__ import annotations

import pytest
from test_strategy_hf import GLOBAL_BATCH, LOSS_ATOL, STEPS, HFLlamaLM, Recorder, reference_losses, tokens  # noqa: I001
from torch.utils.data import DataLoader, TensorDataset

from lightning_memplan.testing import run_distributed

pytest.importorskip("transformers.masking_utils", reason="the built-in HF pipeline forward needs transformers >= 4.53")

pytestmark = pytest.mark.hf


class PipelinedHFLlamaLM(HFLlamaLM):
    """The single-process module of ``test_strategy_hf`` plus the pipeline's batch split and loss."""

    def pipeline_batch(self, batch):
        (input_ids,) = batch
        return input_ids, input_ids

    def pipeline_loss(self, logits, labels):
        return self.model.loss_function(logits=logits, labels=labels, vocab_size=self.model.config.vocab_size)


def hf_pp_worker(rank: int, world: int, root: str) -> dict:
    import lightning as L

    import lightning_memplan.strategies  # noqa: F401 - registers "memplan_auto"
    from lightning_memplan.model.specs import ParallelPlan
    from lightning_memplan.strategies import MemplanAutoStrategy

    module = PipelinedHFLlamaLM()
    recorder = Recorder()
    strategy = MemplanAutoStrategy(plan=ParallelPlan(pp=2))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False, default_root_dir=root,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
    )
    trainer.fit(module, DataLoader(TensorDataset(tokens()), batch_size=GLOBAL_BATCH))
    inner = module.model.model
    return {
        "losses": recorder.losses,
        "ref": reference_losses(),
        "plan": strategy.applied_plan,
        "notes": list(strategy.resolution.notes),
        "family": strategy._layout.family,
        "blocks": sorted(inner.layers.keys()),
        "has_embedding": inner.embed_tokens is not None,
        "has_head": module.model.lm_head is not None and inner.norm is not None,
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_hf_llama_trains_with_pipeline_parallel(tmp_path):
    results = run_distributed(hf_pp_worker, 2, str(tmp_path), timeout_s=120)
    for stage, r in enumerate(results):
        assert r["family"] == "hf-llama"
        assert (r["plan"].pp, r["plan"].microbatches, r["plan"].schedule) == (2, 2, "1f1b"), r["plan"]
        assert any("applied microbatches=2" in n for n in r["notes"]), r["notes"]  # the default was replaced
        assert r["blocks"] == [str(stage)]  # one block per stage
        assert (r["has_embedding"], r["has_head"]) == (stage == 0, stage == 1)  # embed_tokens dropped on stage 1
        torch_close(r["losses"], r["ref"])
    assert results[0]["ref"][-1] != results[0]["ref"][0]  # the steps changed the model


def torch_close(got: list[float], want: list[float]) -> None:
    import torch

    assert len(got) == STEPS
    torch.testing.assert_close(got, want, atol=LOSS_ATOL, rtol=0)
