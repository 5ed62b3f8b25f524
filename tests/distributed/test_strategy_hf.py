"""A Hugging Face ``LlamaForCausalLM`` from a tiny config (no download) trains under memplan_auto with
tensor parallelism on CPU, with and without sequence parallelism, and its losses equal single-process
training.

The plan is searched, not forced: ``allow=("tp",)`` leaves the planner only tensor parallelism, so on
two processes it must pick tp=2, and the strategy must recognise the Llama layout
(``model.layers.*.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``, ``lm_head``) to apply it.
Tolerance on losses: ``atol=2e-5`` (fp32, SGD).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_memplan.testing import run_distributed

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

VOCAB, SEQ, GLOBAL_BATCH, STEPS = 64, 8, 4, 3
LOSS_ATOL = 2e-5


def llama_config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )


class HFLlamaLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = transformers.LlamaForCausalLM(llama_config())

    def training_step(self, batch, batch_idx):
        (input_ids,) = batch
        return self.model(input_ids=input_ids, labels=input_ids).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL_BATCH * STEPS, SEQ), generator=torch.Generator().manual_seed(3))


def reference_losses() -> list[float]:
    # dp = 1 under TP: Lightning's DistributedSampler (seed 0) permutes the whole dataset for every rank.
    module = HFLlamaLM()
    optimizer = module.configure_optimizers()
    data = tokens()[torch.randperm(GLOBAL_BATCH * STEPS, generator=torch.Generator().manual_seed(0))]
    out = []
    for step in range(STEPS):
        loss = module.training_step((data[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH],), step)
        out.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return out


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def hf_tp_worker(rank: int, world: int, root: str) -> list[dict]:
    from lightning_memplan.model.specs import ParallelPlan

    # searched (only TP allowed), then forced tensor + sequence parallelism
    return [fit_hf(world, root, {"allow": ("tp",), "memory_budget": 2**30}),
            fit_hf(world, root, {"plan": ParallelPlan(tp=2, sp=True)})]


def fit_hf(world: int, root: str, strategy_kwargs: dict) -> dict:
    from torch.distributed.tensor import DTensor

    import lightning_memplan.strategies  # noqa: F401 - registers "memplan_auto"
    from lightning_memplan.strategies import MemplanAutoStrategy

    module = HFLlamaLM()
    recorder = Recorder()
    strategy = MemplanAutoStrategy(**strategy_kwargs)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False, default_root_dir=root,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
    )
    trainer.fit(module, DataLoader(TensorDataset(tokens()), batch_size=GLOBAL_BATCH))
    q = module.model.model.layers[0].self_attn.q_proj.weight
    head = module.model.lm_head.weight
    return {
        "losses": recorder.losses,
        "ref": reference_losses(),
        "plan": strategy.applied_plan,
        "family": strategy._layout.family,
        "q_local": tuple(q.to_local().shape) if isinstance(q, DTensor) else None,
        "head_local": tuple(head.to_local().shape) if isinstance(head, DTensor) else None,
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_hf_llama_trains_with_tensor_parallel(tmp_path):
    results = run_distributed(hf_tp_worker, 2, str(tmp_path))
    assert [runs[1]["plan"].sp for runs in results] == [True, True]  # the forced TP + SP plan was applied
    for r in (run for runs in results for run in runs):
        assert r["plan"].tp == 2 and r["plan"].dp == 1, r["plan"]
        assert r["family"] == "hf-llama"
        assert r["q_local"] == (16, 32)  # 4 heads x 8 -> 2 heads per rank
        assert r["head_local"] == (32, 32)  # vocab 64 sharded on rows
        torch.testing.assert_close(r["losses"], r["ref"], atol=LOSS_ATOL, rtol=0)
    assert results[0][0]["ref"][-1] != results[0][0]["ref"][0]  # the steps changed the model
