"""memplan_auto on one process: registration, argument checks, layout recognition, the decision logic
(pure, no process group), mesh sizes, candidate filtering, a real single-device fit, and the user guide's
snippets.

Runs that initialise a process group happen in a child process (``run_distributed(fn, 1)`` or a
subprocess), so this test process never keeps one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch import nn

from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.parallel.decision import decide
from lightning_memplan.parallel.pipeline import pipeline_blocker, split_blocks, stage_indices
from lightning_memplan.parallel.planner_bridge import applicable, narrow_allow
from lightning_memplan.parallel.tensor_parallel import sequence_parallel_blocker, tensor_parallel_blocker
from lightning_memplan.strategies import MemplanAutoStrategy, MeshLayout, find_layout
from lightning_memplan.testing import run_distributed
from lightning_memplan.testing.zoo import GPT, GPTConfig, MLPNet, causal_lm_loss, llama_style

pytestmark = pytest.mark.hf

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------ registration
def test_registered_and_resolved_by_name():
    from lightning.pytorch.strategies import StrategyRegistry

    assert "memplan_auto" in StrategyRegistry
    trainer = L.Trainer(strategy="memplan_auto", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, MemplanAutoStrategy)


@pytest.mark.parametrize(
    "first_import",
    [
        "from lightning_memplan import MemplanAutoStrategy",  # the lazy export, before Lightning is loaded
        "from lightning_memplan.strategies import MemplanAutoStrategy",
        "import lightning_memplan; import lightning",
        "import lightning; import lightning_memplan",
    ],
)
def test_registered_whatever_is_imported_first(first_import):
    # A fresh interpreter each: importing the strategies package first used to fail with a circular
    # import (Lightning's import fired the registration hook while the package was half-initialised).
    code = f"{first_import}\nfrom lightning.pytorch.strategies import StrategyRegistry\nprint('memplan_auto' in StrategyRegistry)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr[-2000:]


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        ({"memory_budget": 0}, ValueError, "memory_budget=0"),
        ({"memory_budget": 1.5}, TypeError, "memory_budget=1.5"),  # an int of bytes, as every int argument
        ({"plan": "dp=2"}, TypeError, "plan='dp=2'"),
        ({"train": {"micro_batch": 1}}, TypeError, "train="),
        ({"headroom": 1.0}, ValueError, "headroom=1.0"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs, exc, words):
    with pytest.raises(exc, match=re.escape(words)):
        MemplanAutoStrategy(**kwargs)


class _NoCollectivesAccelerator(L.pytorch.accelerators.Accelerator):
    """An accelerator that is neither CPU nor CUDA (as MPS or XLA would be to memplan_auto)."""

    def setup_device(self, device):
        pass

    def teardown(self):
        pass

    @staticmethod
    def parse_devices(devices):
        return int(devices)

    @staticmethod
    def get_parallel_devices(devices):
        return [torch.device("cpu")] * int(devices)

    @staticmethod
    def auto_device_count():
        return 1

    @staticmethod
    def is_available():
        return True

    def get_device_stats(self, device):
        return {}

    @classmethod
    def name(cls):
        return "no_collectives"


def test_unsupported_accelerator_is_rejected_at_setup():
    strategy = MemplanAutoStrategy(plan=ParallelPlan())
    trainer = L.Trainer(accelerator=_NoCollectivesAccelerator(), devices=1, strategy=strategy, logger=False,
                        max_steps=1, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="_NoCollectivesAccelerator.*accelerator='cpu'"):
        trainer.fit(_TinyLM(), _loader())
    assert not torch.distributed.is_initialized()  # rejected before any process group


# ------------------------------------------------------------------------------- layouts and plans
def test_layouts_recognised_by_attribute_names():
    zoo = find_layout(nn.ModuleDict({"model": GPT(llama_style())}))
    assert (zoo.family, zoo.root_path, zoo.blocks, zoo.head) == ("zoo-gpt", "model", "blocks", "lm_head")
    assert zoo.colwise == ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    generic = find_layout(MLPNet(16, 32, 3, 4))
    assert generic.family == "generic" and generic.blocks == "layers"
    assert "tp_plan" in tensor_parallel_blocker(generic, MLPNet(16, 32, 3, 4), tp=2)
    assert find_layout(nn.Linear(2, 2)) is None


class _LitgptBlock(nn.Module):  # litgpt's attribute names (LLaMAMLP), written from its public layout
    def __init__(self) -> None:
        super().__init__()
        self.norm_1, self.norm_2 = nn.RMSNorm(32), nn.RMSNorm(32)
        self.attn = nn.Module()
        self.attn.qkv, self.attn.proj = nn.Linear(32, 64), nn.Linear(32, 32)
        self.mlp = nn.Module()
        self.mlp.fc_1, self.mlp.fc_2, self.mlp.proj = nn.Linear(32, 88), nn.Linear(32, 88), nn.Linear(88, 32)


class _LitgptGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(64, 32), "h": nn.ModuleList(_LitgptBlock() for _ in range(2)), "ln_f": nn.RMSNorm(32),
        })
        self.lm_head = nn.Linear(32, 64, bias=False)


def test_litgpt_layout_recognised_and_tp_needs_litgpt_attention():
    layout = find_layout(_LitgptGPT())
    assert layout.family == "litgpt" and layout.tp_note is None
    assert layout.colwise == ("mlp.fc_1", "mlp.fc_2") and layout.rowwise == ("attn.proj", "mlp.proj")
    # attention is split per head only for litgpt's own CausalSelfAttention (fused qkv, config head counts;
    # tests/distributed/test_strategy_litgpt_tp.py runs the real one): anything else is refused, not scrambled
    assert "no fused qkv" in tensor_parallel_blocker(layout, layout.root, tp=2)
    assert tensor_parallel_blocker(layout, layout.root, tp=1) is None


def test_head_count_divisibility_blocks_tp():
    layout = find_layout(GPT(llama_style()))  # 4 heads, 2 kv-heads
    assert tensor_parallel_blocker(layout, layout.root, tp=2) is None
    assert tensor_parallel_blocker(layout, layout.root, tp=4) == "tp=4 does not divide kv_heads=2; use tp in [1, 2]"


def test_hf_models_recognised():
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
    layout = find_layout(llama)
    assert layout.family == "hf-llama" and layout.blocks == "model.layers"
    assert tensor_parallel_blocker(layout, llama, tp=2) is None
    assert "num_key_value_heads" not in (tensor_parallel_blocker(layout, llama, tp=4) or "kv_heads")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64))
    layout = find_layout(gpt2)
    assert layout.family == "hf-gpt2" and "Conv1D" in tensor_parallel_blocker(layout, gpt2, tp=2)
    assert "does not implement the pipeline contract" in pipeline_blocker(layout, pp=2)


def _decide(module, forced=None, planner=None, world=2, seq=8):
    return decide(
        model_spec=ModelSpec(2, 32, 4, 64), train=TrainSpec(micro_batch=4, seq_len=seq), world_size=world,
        layout=find_layout(module), module=module, self_parallel=False, forced=forced, forced_source="forced",
        planner=planner,
    )


def test_forced_plan_the_module_cannot_take_is_folded_with_a_note():
    res = _decide(MLPNet(16, 32, 3, 4), forced=ParallelPlan(dp=2, tp=2, zero=3), world=4)
    assert res.plan == ParallelPlan(dp=4, zero=3, grad_buckets=False)
    assert res.mesh == MeshLayout(dp_shard=4, reshard_after_forward=True, notes=())
    assert len(res.notes) == 1 and res.notes[0].startswith("tp=2 not applied: MLPNet is not a recognised layout")
    tied = GPT(GPTConfig(64, 2, 32, 4, tied_embeddings=True))
    res = _decide(tied, forced=ParallelPlan(pp=2))
    assert res.plan == ParallelPlan(dp=2, grad_buckets=False) and "tied embeddings" in res.notes[0]


def test_sequence_parallel_applies_to_recognised_layouts_without_pipelines():
    rope, learned = GPT(llama_style()), GPT(GPTConfig(64, 2, 32, 4))
    assert sequence_parallel_blocker(find_layout(rope), tp=2, pp=1) is None
    assert sequence_parallel_blocker(find_layout(learned), tp=2, pp=1) is None
    assert sequence_parallel_blocker(find_layout(rope), tp=2, pp=2) is None  # SP inside pipeline stages

    class Stack(nn.Module):  # a generic layout: a module-provided tp_plan, but no SP entry points
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
            self.tp_plan = {"layers.*": "colwise"}

    assert "zoo GPT and Hugging Face Llama" in sequence_parallel_blocker(find_layout(Stack()), tp=2, pp=1)
    res = _decide(rope, forced=ParallelPlan(tp=2, sp=True))
    assert res.plan == ParallelPlan(tp=2, sp=True, grad_buckets=False) and not res.notes
    res = _decide(Stack(), forced=ParallelPlan(tp=2, sp=True))
    assert res.plan == ParallelPlan(tp=2, grad_buckets=False)
    assert len(res.notes) == 1 and res.notes[0].startswith("sp not applied: sequence parallelism is applied to")
    res = _decide(rope, forced=ParallelPlan(pp=2, tp=2, sp=True, microbatches=2), world=4)
    assert res.plan.sp is True and res.plan.pp == 2 and not res.notes
    res = _decide(rope, forced=ParallelPlan(tp=2, sp=True), seq=7)  # equal sequence slices impossible
    assert res.plan == ParallelPlan(tp=2, grad_buckets=False)
    assert res.notes[0].startswith("sp not applied: seq_len=7 is not divisible by tp=2")


def test_the_plan_assumes_the_loss_a_linear_cross_entropy_module_runs():
    from lightning_memplan.loss import LinearCrossEntropy
    from lightning_memplan.parallel.inputs import lce_loss_mode

    plain = nn.Sequential(nn.Linear(4, 4))
    assert lce_loss_mode(plain) == ("naive", None)
    assert lce_loss_mode(nn.ModuleDict({"lm": plain, "loss": LinearCrossEntropy()})) == ("chunked", None)
    assert lce_loss_mode(nn.ModuleDict({"loss": LinearCrossEntropy(chunk_size=256)})) == ("chunked", 256)


def test_forced_plan_with_the_wrong_world_size_is_an_error():
    with pytest.raises(ValueError, match=r"needs 4 processes .* the Trainer runs 2 \(devices x num_nodes\)"):
        _decide(GPT(llama_style()), forced=ParallelPlan(dp=2, tp=2))


def test_auto_plan_replans_without_a_blocked_dimension():
    calls = []

    def planner(blocked):
        calls.append(dict(blocked))
        plan = ParallelPlan(dp=2) if blocked else ParallelPlan(tp=2)
        return SimpleNamespace(plan=plan, train=TrainSpec(micro_batch=4, seq_len=8, recompute="full"))

    # a module with no tensor-parallel plan: the search never sees tp (the same blocker as at setup)
    res = _decide(MLPNet(16, 32, 3, 4), planner=planner)
    assert [set(c) for c in calls] == [{"tp", "pp"}]
    assert res.plan == ParallelPlan(dp=2, grad_buckets=False) and res.recompute == "full" and not res.notes
    # a planner that ignores the exclusion is caught by the same rule after the search and re-asked
    calls.clear()
    res = _decide(MLPNet(16, 32, 3, 4), planner=lambda blocked: planner({}) if not calls else planner(blocked))
    assert "planner chose dp=1 tp=2" in res.notes[0] and "re-planned without tp: dp=2" == res.notes[1]


def test_module_blockers_are_the_setup_blockers_per_size():
    from lightning_memplan.parallel.decision import applicability, module_blockers

    gqa = GPT(GPTConfig(64, 2, 32, 4, n_kv_heads=2))  # tp=4 cannot split 2 key/value heads; 2 blocks: pp <= 2
    blocked = module_blockers(find_layout(gqa), gqa, 4, self_parallel=False)
    assert set(blocked) == {"tp=4", "pp=4"}
    for key, why in blocked.items():
        dim, size = key.split("=")
        assert applicability(ParallelPlan(**{dim: int(size)}), find_layout(gqa), gqa, self_parallel=False)[dim] == why
    allow = narrow_allow(None, TrainSpec(micro_batch=4, seq_len=8), set(blocked), has_lce=False, pipeline=True, world=4)
    assert (allow.tp, allow.pp) == ((1, 2), (1, 2))
    assert module_blockers(find_layout(gqa), gqa, 4, self_parallel=True) == {}


def test_forced_pipeline_schedule_is_checked_against_the_batch_at_setup():
    gpt = GPT(GPTConfig(64, 4, 32, 4))
    # microbatches=1 is ParallelPlan's default: replaced by the smallest count 1F1B can run, said so
    res = _decide(gpt, forced=ParallelPlan(dp=2, pp=2), world=4)
    assert res.plan.microbatches == 2 and any("applied microbatches=2 instead" in n for n in res.notes)
    assert _decide(gpt, forced=ParallelPlan(pp=2, schedule="gpipe")).plan.microbatches == 1  # GPipe runs m=1
    # an explicit count that cannot run is refused at setup, naming the fix
    with pytest.raises(ValueError, match=r"1f1b needs microbatches >= pp .* force microbatches=4"):
        _decide(gpt, forced=ParallelPlan(pp=4, microbatches=2), world=4)
    with pytest.raises(ValueError, match=r"batch 4 is not divisible by microbatches=3"):
        _decide(gpt, forced=ParallelPlan(pp=2, microbatches=3))
    # (an interleaved count that is not a multiple of pp is refused by ParallelPlan itself)


@pytest.mark.parametrize(
    ("plan", "shape", "reshard"),
    [
        (ParallelPlan(dp=8), (1, 8, 1, 1), True),
        (ParallelPlan(dp=8, zero=3), (1, 1, 8, 1), True),
        (ParallelPlan(dp=4, zero=2, tp=2), (1, 1, 4, 2), False),
        (ParallelPlan(dp=2, zero=1, pp=2, microbatches=2), (2, 1, 2, 1), False),
        (ParallelPlan(dp=2, cp=2), (1, 4, 1, 1), True),
        (ParallelPlan(dp=4, zero=3, reshard_after_forward=2), (1, 1, 4, 1), 2),  # passed to fully_shard as is
        (ParallelPlan(dp=2, cp=2, zero=3, reshard_after_forward=2), (1, 1, 4, 1), 2),
    ],
)
def test_mesh_sizes_from_plan(plan, shape, reshard):
    layout = MeshLayout.from_plan(plan)
    assert layout.shape == shape and layout.world_size == plan.world_size
    assert layout.reshard_after_forward is reshard
    assert bool(layout.notes) == (plan.cp > 1 or plan.zero == 1)


def test_block_split_and_interleaved_placement():
    assert split_blocks(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert stage_indices(1, 4, 2) == [1, 5]
    assert "cannot fill 8 pipeline stages" in pipeline_blocker(find_layout(GPT(llama_style(n_layers=4))), 4, 2)


def test_only_candidates_the_dataloader_batch_allows():
    train = TrainSpec(micro_batch=4, seq_len=8, grad_accumulation=2)

    def cand(plan, b, acc=1):
        return SimpleNamespace(plan=plan, train=train.replace(micro_batch=b, grad_accumulation=acc))

    assert applicable(cand(ParallelPlan(dp=2), 4, 2), train)
    assert not applicable(cand(ParallelPlan(dp=2), 2, 4), train)  # would need in-step accumulation
    assert applicable(cand(ParallelPlan(pp=2, microbatches=4), 2), train)  # B=4 -> m=2 >= pp
    assert not applicable(cand(ParallelPlan(pp=2, microbatches=2), 4), train)  # m=1 < pp (1F1B)
    assert applicable(cand(ParallelPlan(pp=2, microbatches=2, schedule="gpipe"), 4), train)  # GPipe runs m=1
    assert not applicable(cand(ParallelPlan(pp=2, schedule="interleaved", virtual_stages=2, microbatches=6), 4), train)
    allow = narrow_allow({"tp": [1, 2], "zero": [0, 1, 3]}, train, {"tp"}, has_lce=False, pipeline=True)
    assert (allow.tp, allow.zero, allow.cp, allow.sp, allow.loss) == ((1,), (0, 3), (1,), (False,), ("naive",))
    assert allow.micro_batch == (1, 2, 4)
    with pytest.raises(ValueError, match="allow restricts tp"):
        narrow_allow({"tp": [2]}, train, {"tp"}, has_lce=False, pipeline=True)
    assert narrow_allow(None, train, set(), has_lce=False, pipeline=True).sp == (False, True)
    # a LinearCrossEntropy module runs chunked or vocab-parallel under memplan_auto, never full logits
    assert narrow_allow(None, train, set(), has_lce=True, pipeline=True).loss == ("chunked", "vocab_parallel")
    with pytest.raises(ValueError, match=r"allow restricts loss to \('naive',\)"):
        narrow_allow({"loss": ["naive"]}, train, set(), has_lce=True, pipeline=True)
    assert narrow_allow(None, train, {"sp"}, has_lce=False, pipeline=True).sp == (False,)
    with pytest.raises(ValueError, match=r"allow restricts sp to \(True,\)"):
        narrow_allow({"sp": [True]}, train, {"sp"}, has_lce=False, pipeline=True)


# -------------------------------------------------------------------------------- single-device fit
class _TinyLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(64, 2, 32, 4, max_positions=8))

    def training_step(self, batch, batch_idx):
        loss = causal_lm_loss(self.model, *batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _loader():
    tokens = torch.randint(0, 64, (8, 9), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return torch.utils.data.DataLoader(data, batch_size=4)


def single_device_worker(rank: int, world: int, root: str) -> dict:
    from lightning.pytorch.loggers import CSVLogger

    from lightning_memplan.live import infer_plan

    strategy = MemplanAutoStrategy(memory_budget=2**30)
    logger = CSVLogger(root, name="run")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2,
                        logger=logger, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(_TinyLM(), _loader())
    with open(os.path.join(trainer.log_dir, "memplan_plan.json")) as fh:
        written = json.load(fh)
    with open(os.path.join(trainer.log_dir, "hparams.yaml")) as fh:
        hparams = fh.read()
    return {
        "plan": strategy.applied_plan,
        "decision_type": type(strategy.decision).__name__,
        "written": written,
        "hparams": hparams,
        "callback_plan": infer_plan(trainer)[0],
        "loss": float(trainer.callback_metrics["train_loss"]),
    }


@pytest.mark.distributed
def test_single_device_fit_plans_logs_and_writes_the_decision(tmp_path):
    (out,) = run_distributed(single_device_worker, 1, str(tmp_path))
    applied = ParallelPlan(grad_buckets=False)  # memplan_auto replicates with FSDP2: no DDP buckets
    assert out["plan"] == applied and out["decision_type"] == "PlanDecision"
    assert out["written"]["plan"] == applied.to_dict() and out["written"]["mesh"]["dp_replicate"] == 1
    assert out["written"]["decision"]["fits"] is True
    assert "memplan/plan: dp=1" in out["hparams"]
    assert out["callback_plan"] == out["plan"]  # what MemoryPlanCallback reads
    assert 0 < out["loss"] < 10


# ------------------------------------------------------------------------------------- user guide
@pytest.mark.slow
def test_user_guide_snippets_run():
    text = (ROOT / "docs" / "strategy.md").read_text()
    snippets = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(snippets) >= 4
    script = "\n\n".join(snippets)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MemplanAutoStrategy" in proc.stdout and "generic layers" in proc.stdout
    assert "dp=2" in proc.stdout and "[range(0, 3), range(3, 5)]" in proc.stdout
