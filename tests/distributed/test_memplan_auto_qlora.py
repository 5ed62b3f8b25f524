"""memplan_auto with QLoRA (issue 35: "the planner and max_micro_batch take them into account"), on 2 gloo
processes: a tiny Hugging Face Llama (2 layers, h=128, 4 heads, 2 key/value heads, V=1024) loaded by
transformers with NF4 double-quantised base weights (``bnb_4bit_quant_storage=torch.float32``, as the peft
docs page "FSDP + QLoRA" asks, so FSDP2 shards the packed values with the rest) and peft LoRA r=8 on q/v,
trained by a LightningModule under ``MemplanAutoStrategy(memory_budget=...)``.

What is checked:

- the planner plans with the quantized weights: ``decision.train.base_weights == "nf4-dq"`` is read from the
  module (``parallel/inputs.train_spec_for`` through ``live/low_precision.low_precision_fields``, what the
  callback reads), tensor parallelism is not searched and the explanation says why;
- the chosen plan's estimate is the calibrated one of the module (its meta copy traced under fake tensors:
  bitsandbytes' parameters become meta stand-ins carrying their quant state, ``tracking/fake_params.py``),
  and every rank's measured steady-step peak (the project's tensor tracker, which counts the ``QuantState``
  tensors) is within 5 % of it and under the budget whenever ``[FITS]`` is printed; a budget nothing fits is
  refused at setup;
- FSDP2 ``fully_shard`` over the 4-bit model (``allow`` restricted to ZeRO-3): the blocks are FSDP units whose
  packed weights are sharded DTensors, and the same 5 % holds; DDP (FSDP2 over a replicate mesh) likewise;
- a forced ``tp=2`` is folded into data parallelism with the reason (packed weights are not DTensors).

Budgets and plans measured here (b=2, s=64 per rank, fp32, AdamW over the adapter): see the printed lines.
Nothing was fitted on these runs: the calibration is the module's own trace at the dataloader's shape.
"""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import pytest
import torch

from lightning_memplan.testing import run_distributed

pytest.importorskip("transformers", reason="real Hugging Face models")
pytest.importorskip("peft", reason="LoRA adapters")
pytest.importorskip("bitsandbytes", reason="the quant extra (pip install 'lightning-memplan[quant]')")

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.hf]

MiB = 2**20
VOCAB, SEQ, BATCH, STEPS = 1024, 64, 2, 3
RTOL = 0.05
#: (budget, allow, forced plan): DDP fits; DDP needs selective / more recompute; FSDP2 only (allow); nothing
#: fits; forced tp=2.
CASES: tuple[tuple[int | None, Any, Any], ...] = (
    (8 * MiB, None, None),
    (int(5.5 * MiB), None, None),
    (int(4.5 * MiB), None, None),
    (8 * MiB, {"dp": [2], "zero": [3]}, None),
    (3 * MiB, None, None),
    (None, None, "tp"),
)


def _qlora_module() -> Any:
    import lightning as L
    import peft
    import transformers

    class QLoRALM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                                              num_key_value_heads=2, intermediate_size=344, vocab_size=VOCAB)
            folder = tempfile.mkdtemp()
            torch.manual_seed(0)
            transformers.LlamaForCausalLM(config).save_pretrained(folder)
            quant = transformers.BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.float32)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                base = transformers.AutoModelForCausalLM.from_pretrained(
                    folder, quantization_config=quant, dtype=torch.float32, device_map="cpu")
            self.model = peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    return QLoRALM()


def _fit(world: int, budget: int | None, allow: Any, forced: Any) -> dict[str, Any]:
    from test_strategy_budget import SteadyStepMeter
    from test_strategy_parity import make_trainer
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_memplan.model.specs import ParallelPlan
    from lightning_memplan.strategies import MemplanAutoStrategy

    tokens = torch.randint(0, VOCAB, (BATCH * world * STEPS, SEQ), generator=torch.Generator().manual_seed(1))
    plan = ParallelPlan(tp=world) if forced == "tp" else None
    strategy = MemplanAutoStrategy(memory_budget=budget, allow=allow, plan=plan)
    meter, module = SteadyStepMeter(SEQ, VOCAB), _qlora_module()
    try:
        make_trainer(strategy, steps=STEPS, callbacks=[meter]).fit(module, DataLoader(TensorDataset(tokens),
                                                                                      batch_size=BATCH))
    except ValueError as exc:  # rank 0's PlanDoesNotFitError, raised on every rank
        return {"refused": str(exc)}
    blocks = module.model.base_model.model.model.layers
    k_proj = blocks[0].self_attn.k_proj
    decision = strategy.decision
    return {"plan": strategy.applied_plan.describe(), "zero": strategy.applied_plan.zero, "explain": decision.explain(),
            "estimate": decision.estimate.total, "source": decision.estimate.source,
            "base_weights": decision.train.base_weights, "measured": meter.report.total,
            "recompute": strategy.resolution.recompute, "notes": list(strategy.resolution.notes),
            "fsdp_blocks": all(isinstance(b, FSDPModule) for b in blocks),
            "packed_sharded": isinstance(k_proj.weight, DTensor) and k_proj.weight.dtype == torch.float32}


def qlora_worker(rank: int, world: int) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    return [_fit(world, *case) for case in CASES]


@pytest.mark.timeout(900)
def test_memplan_auto_plans_and_applies_qlora_within_its_calibrated_estimate() -> None:
    results = run_distributed(qlora_worker, 2, timeout_s=800)
    for rank, per_case in enumerate(results):
        for (budget, allow, forced), r in zip(CASES, per_case, strict=True):
            label = f"rank {rank} budget={budget} allow={allow} forced={forced}"
            if budget == 3 * MiB:
                assert "refused" in r and "no parallel plan fits" in r["refused"], (label, r)
                print(f"{label}: refused")
                continue
            assert "refused" not in r, (label, r)
            err = r["estimate"] / r["measured"] - 1
            print(f"{label}: {r['plan']} recompute={r['recompute']}: calibrated {r['estimate']:,} B, measured "
                  f"{r['measured']:,} B ({err:+.2%})")
            assert r["base_weights"] == "nf4-dq" and r["source"] == "calibrated", (label, r)
            assert abs(err) <= RTOL, (label, r)
            if forced == "tp":
                assert r["plan"] == "dp=2", r
                assert any("tp=2 not applied" in n and "not DTensors" in n for n in r["notes"]), r["notes"]
                continue
            assert budget is not None and "[FITS]" in r["explain"] and r["measured"] <= budget, (label, r)
            assert "tensor parallelism not searched: base_weights='nf4-dq'" in r["explain"], r["explain"]
            if allow is not None:  # FSDP2 over the 4-bit model: units per block, packed weights sharded
                assert r["zero"] == 3 and r["fsdp_blocks"] and r["packed_sharded"], (label, r)
