"""Issue 35: MemoryPlanCallback on a QLoRA model in a CPU Trainer.

The model: a small Hugging Face Llama loaded by transformers with NF4 double-quantised base weights
(bitsandbytes quantizes on the CPU), peft LoRA on q/v. The callback reads ``base_weights="nf4-dq"`` from the
module (peft-wrapped bitsandbytes ``Linear4bit``), names it in the report, and its estimate of every tracked
step is within 5% of the step it measures (its tensor tracker counts bitsandbytes' absmaxes and codes).
Lightning's own ``BitsandbytesPrecision`` refuses a CPU Trainer ("only supported on CUDA GPUs"); its
reading is checked on the plugin object in ``tests/unit/test_quantized.py``.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from test_callback_helpers import make_trainer
from torch.utils.data import DataLoader

from lightning_memplan.callbacks import MemoryPlanCallback

transformers = pytest.importorskip("transformers", reason="real Hugging Face models")
peft = pytest.importorskip("peft", reason="LoRA adapters")
pytest.importorskip("bitsandbytes", reason="the quant extra (pip install 'lightning-memplan[quant]')")

pytestmark = pytest.mark.hf


class LitQLoRA(L.LightningModule):
    def __init__(self, model: Any):
        super().__init__()
        self.model = model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def _qlora(folder: Path) -> Any:
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=344, vocab_size=1024)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = transformers.AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=quant, dtype=torch.float32, device_map="cpu")
    return peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))


def _loader(vocab: int, n: int = 4) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (2, 64), generator=gen)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    return DataLoader(batches, batch_size=None)


def test_callback_reads_nf4_dq_and_estimates_within_5_percent(tmp_path: Path) -> None:
    model = _qlora(tmp_path / "llama")
    cb = MemoryPlanCallback(measure_every_n_steps=1, print_report=False, write_files=False)
    trainer = make_trainer(tmp_path, [cb], limit_train_batches=4, logger=False, precision="32-true")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(LitQLoRA(model), _loader(model.config.vocab_size))
    assert cb._train is not None and cb._train.base_weights == "nf4-dq"
    assert cb.report.run["precision"] == "32-true; base weights nf4-dq"
    tracked = [r for r in cb.report.epochs[0].ranks[0].tracked if not r.warmup]
    assert tracked
    for r in tracked:
        assert r.estimated_peak == pytest.approx(r.measured_peak, rel=0.05), (r.estimated_peak, r.measured_peak)
