"""MemoryPlanCallback on real Hugging Face models in a CPU Trainer: peft LoRA (frozen base weights) and
HF gradient checkpointing, estimated vs measured per tracked step."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from test_callback_helpers import make_trainer
from torch.utils.data import DataLoader

from lightning_memplan.callbacks import MemoryPlanCallback

transformers = pytest.importorskip("transformers", reason="real Hugging Face models")

pytestmark = pytest.mark.hf


class LitHF(L.LightningModule):
    """A Hugging Face causal LM trained on its own loss (``model(**batch).loss``)."""

    def __init__(self, model: Any):
        super().__init__()
        self.model = model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _loader(vocab: int, n: int = 4) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (2, 32), generator=gen)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    return DataLoader(batches, batch_size=None)


def _llama() -> Any:
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=172, vocab_size=512)
    return transformers.AutoModelForCausalLM.from_config(config), ["q_proj", "v_proj"]


def _gpt2() -> Any:
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
    return transformers.AutoModelForCausalLM.from_config(config), ["c_attn"]


def _fit(tmp_path, model: Any, precision: str) -> MemoryPlanCallback:
    cb = MemoryPlanCallback(measure_every_n_steps=1, print_report=False, write_files=False)
    trainer = make_trainer(tmp_path, [cb], limit_train_batches=4, logger=False, precision=precision)
    trainer.fit(LitHF(model), _loader(model.config.vocab_size))
    return cb


def _tracked(cb: MemoryPlanCallback) -> list[Any]:
    return [r for r in cb.report.epochs[0].ranks[0].tracked if not r.warmup]


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_peft_lora_estimate_within_3_percent(tmp_path, make, precision: str) -> None:
    peft = pytest.importorskip("peft", reason="LoRA adapters")
    torch.manual_seed(0)
    base, targets = make()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                      fan_in_fan_out=make is _gpt2))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    cb = _fit(tmp_path, model, precision)
    assert cb._spec is not None and cb._spec.n_trainable_params == trainable
    tracked = _tracked(cb)
    assert tracked
    for r in tracked:
        assert r.estimated_peak == pytest.approx(r.measured_peak, rel=0.03), (r.estimated_peak, r.measured_peak)


def test_hf_gradient_checkpointing_is_detected(tmp_path) -> None:
    torch.manual_seed(0)
    model, _ = _llama()
    model.gradient_checkpointing_enable()
    cb = _fit(tmp_path, model, "32-true")
    assert cb._train is not None and cb._train.recompute == "full"
    for r in _tracked(cb):
        assert r.estimated_peak == pytest.approx(r.measured_peak, rel=0.03), (r.estimated_peak, r.measured_peak)
