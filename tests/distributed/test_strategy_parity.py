"""memplan_auto applies forced plans -- DDP, FSDP (ZeRO-2/3), TP, TP+SP, TP+SP+FSDP, TP+FSDP, PP (1F1B,
GPipe, interleaved), PP+FSDP, activation checkpointing, ``LinearCrossEntropy`` switched to vocab-parallel under TP -- and
training matches one process.

Reference: the same GPT (same seed), the same samples in the same order, a plain PyTorch loop on one
process with the whole global batch (``loss.backward(); SGD.step()``), no Lightning and no strategy.
Lightning's distributed sampler shuffles training data with seed 0 (``DistributedSampler(shuffle=True,
seed=0)``); rank r of d takes permuted positions r, r+d, ..., so the union of the d per-rank batches of
step k is exactly the reference batch k of the permuted dataset, and the mean of the per-rank losses
equals the reference loss.

Tolerances (fp32, SGD so that rounding differences are not amplified by Adam's normalisation): losses
``atol=2e-5``, parameters after the last step ``atol=2e-5``; replicas of the same parameter on different
ranks must agree to ``1e-6``.
"""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_memplan.model.specs import ParallelPlan, TrainSpec
from lightning_memplan.testing import run_distributed
from lightning_memplan.testing.zoo import GPT, GPTConfig, causal_lm_loss

VOCAB, HIDDEN, HEADS, SEQ, GLOBAL_BATCH, STEPS = 64, 32, 4, 8, 8, 3
LOSS_ATOL = 2e-5
PARAM_ATOL = 2e-5
REPLICA_ATOL = 1e-6


class TinyLM(L.LightningModule):
    """A zoo GPT trained with next-token cross-entropy and SGD."""

    def __init__(
        self, n_layers: int = 4, lr: float = 0.5, optimizer: str = "sgd", lce: bool = False, **config: object
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(VOCAB, n_layers, HIDDEN, HEADS, max_positions=SEQ, **config))
        self.lr, self.optimizer_name = lr, optimizer
        if lce:  # the project's logits-free loss; memplan_auto sets its mode (vocab-parallel under TP)
            from lightning_memplan.loss import LinearCrossEntropy

            self.loss_fn = LinearCrossEntropy()

    def training_step(self, batch, batch_idx):
        if hasattr(self, "loss_fn"):
            idx, targets = batch
            return self.loss_fn(self.model(idx), self.model.lm_head.weight, targets)
        return causal_lm_loss(self.model, *batch)

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def token_data(n_samples: int = GLOBAL_BATCH * STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (n_samples, SEQ + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lightning_order(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The order Lightning's shuffling DistributedSampler (seed 0, epoch 0) visits the samples in."""
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x[perm], y[perm]


def reference_run(model_kwargs: dict, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, plain PyTorch: per-step losses and the final parameters."""
    module = TinyLM(**model_kwargs)
    optimizer = module.configure_optimizers()
    x, y = lightning_order(*token_data())
    losses = []
    for step in range(steps):
        sl = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        loss = causal_lm_loss(module.model, x[sl], y[sl])
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return losses, {n: p.detach().clone() for n, p in module.named_parameters()}


class LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def full_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters gathered to full tensors (DTensor ``full_tensor``), names without wrapper prefixes."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        out[name.replace("_checkpoint_wrapped_module.", "")] = full.detach().clone()
    return out


def make_trainer(strategy, steps: int = STEPS, callbacks=(), **kwargs) -> L.Trainer:
    import tempfile

    import torch.distributed as dist

    defaults = dict(
        accelerator="cpu",
        devices=dist.get_world_size() if dist.is_initialized() else 1,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
        # memplan_plan.json goes to trainer.log_dir (default_root_dir without a logger): keep it out of the repo
        default_root_dir=tempfile.mkdtemp(prefix="memplan_strategy_test_"),
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def fit_forced(plan: ParallelPlan, model_kwargs: dict, train: TrainSpec | None = None) -> dict:
    """Run inside a worker: fit under the forced plan, compare with the reference on this rank."""
    import torch.distributed as dist

    from lightning_memplan.strategies import MemplanAutoStrategy

    ref_losses, ref_params = reference_run(model_kwargs)
    x, y = token_data()
    loader = DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // plan.dp)
    recorder = LossRecorder()
    module = TinyLM(**model_kwargs)
    strategy = MemplanAutoStrategy(plan=plan, train=train)
    make_trainer(strategy, callbacks=[recorder]).fit(module, loader)
    params = full_parameters(module)
    param_err = max((params[n] - ref_params[n]).abs().max().item() for n in params)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, params)
    spread = 0.0
    for other in gathered:
        for name, tensor in other.items():
            if name in params:
                spread = max(spread, (tensor - params[name]).abs().max().item())
    return {
        "losses": recorder.losses,
        "ref_losses": ref_losses,
        "param_err": param_err,
        "n_params_here": len(params),
        "n_params_total": len(ref_params),
        "replica_spread": spread,
        "applied": strategy.applied_plan,
        "dp_rank": strategy.device_mesh["data_parallel"].get_local_rank(),
        "mesh": strategy.resolution.mesh.shape,
        "lce_mode": module.loss_fn.mode if hasattr(module, "loss_fn") else None,
        "checkpointed": sum("CheckpointWrapper" in type(m).__name__ for m in module.modules())  # FSDP2 renames it FSDPCheckpointWrapper,
    }


def parity_worker(rank: int, world: int, cases: list) -> list[dict]:
    return [fit_forced(plan, kwargs, train) for plan, kwargs, train in cases]


def check_case(results: list[dict], plan: ParallelPlan) -> None:
    """Mean of the data-parallel ranks' losses equals the reference; params equal; replicas agree."""
    ref = results[0]["ref_losses"]
    per_dp: dict[int, list[float]] = {}
    for r in results:
        # memplan_auto applies data parallelism with FSDP2 replication: no DDP buckets. Which of the
        # embedding and lm_head get FSDP2 units of their own (own_units) follows the module
        # (tests/unit/test_own_units.py); the layout is the forced one.
        applied = dataclasses.replace(r["applied"], own_units=())
        assert applied == dataclasses.replace(plan, grad_buckets=False), (r["applied"], plan)
        assert len(r["losses"]) == STEPS
        per_dp.setdefault(r["dp_rank"], r["losses"])
        # ranks that share a data-parallel index (TP or PP peers) report the same loss
        torch.testing.assert_close(r["losses"], per_dp[r["dp_rank"]], atol=1e-6, rtol=0)
        assert r["param_err"] <= PARAM_ATOL, (plan, r["param_err"])
        assert r["replica_spread"] <= REPLICA_ATOL, (plan, r["replica_spread"])
    assert len(per_dp) == plan.dp
    mean = [sum(v[i] for v in per_dp.values()) / plan.dp for i in range(STEPS)]
    torch.testing.assert_close(mean, ref, atol=LOSS_ATOL, rtol=0)
    assert ref[-1] != ref[0]  # training moved the model, so equal losses are not trivially equal
    if plan.pp == 1:
        assert all(r["n_params_here"] == r["n_params_total"] for r in results)
    else:  # each stage holds only its own parameters, and together they hold all of them
        assert all(r["n_params_here"] < r["n_params_total"] for r in results)


RECOMPUTE_FULL = TrainSpec(micro_batch=4, seq_len=SEQ, precision="32-true", recompute="full")
RECOMPUTE_SELECTIVE = TrainSpec(micro_batch=4, seq_len=SEQ, precision="32-true", recompute="selective")
RECOMPUTE_SELECTIVE_OP = TrainSpec(micro_batch=4, seq_len=SEQ, precision="32-true", recompute="selective_op")
NO_RECOMPUTE = TrainSpec(micro_batch=4, seq_len=SEQ, precision="32-true", recompute="none")
LLAMA_KWARGS = {"ffn_kind": "swiglu", "n_kv_heads": 2, "norm": "rmsnorm", "position_embedding": "rope", "bias": False}
#: index in WORLD2_CASES of torchtitan's op-level checkpointing, followed by the same run without it
SELECTIVE_OP_CASE = 6

WORLD2_CASES = [
    (ParallelPlan(dp=2), {}, None),
    (ParallelPlan(dp=2, zero=3), {}, RECOMPUTE_FULL),
    (ParallelPlan(dp=2, zero=2), {"tied_embeddings": True}, None),
    (ParallelPlan(tp=2), {"ffn_kind": "swiglu", "n_kv_heads": 2, "norm": "rmsnorm", "position_embedding": "rope",
                          "bias": False}, RECOMPUTE_SELECTIVE),
    (ParallelPlan(tp=2), {"lce": True}, None),
    (ParallelPlan(dp=2, zero=3), {"lce": True}, None),
    (ParallelPlan(dp=2, zero=3), LLAMA_KWARGS, RECOMPUTE_SELECTIVE_OP),
    (ParallelPlan(dp=2, zero=3), LLAMA_KWARGS, NO_RECOMPUTE),
    (ParallelPlan(pp=2, microbatches=2), {}, None),
    (ParallelPlan(pp=2, microbatches=4, schedule="gpipe"), {}, None),
    (ParallelPlan(pp=2, microbatches=2, schedule="interleaved", virtual_stages=2), {}, None),
    # sequence parallelism (needs rotary positions): naive loss through the gathering lm_head, and the
    # vocab-parallel loss consuming the sequence-sharded hidden states; with selective recompute
    (ParallelPlan(tp=2, sp=True), {"position_embedding": "rope"}, RECOMPUTE_SELECTIVE),
    (ParallelPlan(tp=2, sp=True), {"ffn_kind": "swiglu", "n_kv_heads": 2, "norm": "rmsnorm", "position_embedding": "rope",
                                   "bias": False, "lce": True}, None),
]

WORLD4_CASES = [
    (ParallelPlan(dp=2, tp=2, zero=3), {"tied_embeddings": True}, None),
    (ParallelPlan(dp=2, pp=2, zero=3, microbatches=2), {}, RECOMPUTE_FULL),
    (ParallelPlan(dp=2, tp=2, sp=True, zero=3), {"position_embedding": "rope", "lce": True}, None),
]


@pytest.mark.distributed
@pytest.mark.slow
def test_forced_plans_match_single_process_world2():
    results = run_distributed(parity_worker, 2, WORLD2_CASES)
    for i, (plan, _, _) in enumerate(WORLD2_CASES):
        check_case([per_rank[i] for per_rank in results], plan)
    # DDP keeps full replicas (mesh dp_replicate=2), FSDP shards (dp_shard=2)
    assert results[0][0]["mesh"] == (1, 2, 1, 1)
    assert results[0][1]["mesh"] == (1, 1, 2, 1)
    # LinearCrossEntropy: switched to vocab-parallel under TP, chunked under FSDP (what the estimate assumes)
    assert [r[4]["lce_mode"] for r in results] == ["vocab_parallel"] * 2
    assert [r[5]["lce_mode"] for r in results] == ["chunked"] * 2
    assert [r[-1]["lce_mode"] for r in results] == ["vocab_parallel"] * 2  # TP + SP
    # op-level selective checkpointing (create_selective_checkpoint_contexts) recomputes the same numbers:
    # per rank, the losses equal those of the same run without checkpointing
    for per_rank in results:
        sac, plain = per_rank[SELECTIVE_OP_CASE], per_rank[SELECTIVE_OP_CASE + 1]
        torch.testing.assert_close(sac["losses"], plain["losses"], atol=1e-6, rtol=0)
        assert sac["checkpointed"] > 0 and plain["checkpointed"] == 0  # the policy really ran


@pytest.mark.distributed
@pytest.mark.slow
def test_combined_plans_match_single_process_world4():
    results = run_distributed(parity_worker, 4, WORLD4_CASES)
    for i, (plan, _, _) in enumerate(WORLD4_CASES):
        check_case([per_rank[i] for per_rank in results], plan)
    assert results[0][0]["mesh"] == (1, 1, 2, 2)
    assert results[0][1]["mesh"] == (2, 1, 2, 1)
