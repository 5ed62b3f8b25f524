"""litgpt's ``GPT`` under memplan_auto with forced tp=2: attention split per head (the fused ``attn.qkv``
permuted so each rank holds its own Q heads, K and V groups; ``attn.proj`` row-parallel), the MLP and the
vocab split as for the other layouts.

Parity: checked against a single-process run of the same model and batches (losses, final weights through
``state_dict``), both runs in float64. Tensor parallelism changes only the order of floating-point sums
(each rank's partial matmul over its heads / columns, then an all-reduce, where one process sums in one
GEMM), and AdamW amplifies such rounding: an update is ``lr * m / (sqrt(v) + eps)``, so for an element whose
gradient is near or below ``eps = 1e-8`` a gradient difference ``dg`` moves the weight by up to
``lr * dg / eps = 1e5 * dg``. In float32 (unit roundoff 6e-8) the worst weight after 5 steps differed by
1.0e-5 on this machine and by 2.08e-5 on a fresh install (issue 27), against ``atol=2e-5``: no fixed fp32
tolerance separates that noise from a real bug. In float64 (unit roundoff 1.1e-16) the same bound, with
gradients below 1e-2 summed over ``b s = 256`` tokens, is ``1e5 * 256 * 1.1e-16 * 1e-2 ~ 3e-11`` per step,
1.5e-10 after 5 steps; measured worst 1.4e-16. ``PARITY_ATOL = 1e-9`` is above that bound and far below
what a real mistake does (a wrong head permutation or a missing all-reduce moves weights by O(lr) = 1e-3
per step).

Memory (float32, a Llama-family config as litgpt ships it: RoPE over the whole head, litgpt's default
``block_size=4096``): the strategy's estimate (the planner's analytic model) within ``ESTIMATE_RTOL`` of the
tensor-level measurement of the steady steps, and ``MemoryPlanCallback``'s estimate within its default
``tolerance`` (10 %) of its own measurement, on every rank. litgpt registers its RoPE tables ``cos`` /
``sin`` (``[block_size, rope_n_elem]``, 512 KiB here) as buffers at construction; tensor parallelism shards
parameters, not buffers, so each rank holds them whole (``ModelSpec.buffer_bytes``).

Measured here (2 ranks, n_layer=2, n_embd=64, n_head=4, n_query_groups=2, LLaMAMLP, s=64, b=4, fp32, AdamW):
strategy estimate 3,736,320 B, measured 3,786,820 B (-1.3 %); without the RoPE tables (before) 3,212,032 B
(-15.2 %, the measurement 17.9 % above the estimate). At ``block_size=64`` (the parity config) the estimate
was -1.7 %; with attention replicated (before the per-head split) -15.4 %.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from test_strategy_budget import ESTIMATE_RTOL  # noqa: I001
from test_strategy_parity import make_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_memplan.live.layouts import find_layout
from lightning_memplan.model.specs import ParallelPlan, TrainSpec
from lightning_memplan.parallel.tensor_parallel import litgpt_qkv_rows, tensor_parallel_blocker
from lightning_memplan.testing import run_distributed

litgpt = pytest.importorskip("litgpt", reason="litgpt builds the GPT under test")

VOCAB, SEQ, BATCH, STEPS = 256, 64, 4, 5
#: float64 parity tolerance for losses and final weights (the bound in the module docstring).
PARITY_ATOL = 1e-9
#: MemoryPlanCallback's default ``tolerance``: the mismatch it warns about.
CALLBACK_RTOL = 0.10
#: The memory case: RoPE over the whole head (litgpt's Llama configs) at litgpt's default block_size.
ROPE_TABLES = dict(rotary_percentage=1.0, block_size=4096)


def litgpt_gpt(n_query_groups: int = 2, **config: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return litgpt.GPT(litgpt.Config(**{
        **dict(n_layer=2, n_embd=64, n_head=4, n_query_groups=n_query_groups, vocab_size=VOCAB,
               padded_vocab_size=VOCAB, block_size=SEQ, mlp_class_name="LLaMAMLP", intermediate_size=128,
               bias=False, norm_class_name="RMSNorm"),
        **config,
    }))


class LitGPTLM(L.LightningModule):
    def __init__(self, dtype: torch.dtype = torch.float32, **config: object) -> None:
        super().__init__()
        self.model = litgpt_gpt(**config).to(dtype)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        logits = self.model(batch[0])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[1].reshape(-1))
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _loader() -> DataLoader:
    tokens = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)


def _strategy(world: int):
    from lightning_memplan.strategies import MemplanAutoStrategy

    train = TrainSpec(micro_batch=BATCH, seq_len=SEQ, precision="32-true", device="cpu", loss="naive")
    return MemplanAutoStrategy(plan=ParallelPlan(tp=world), train=train)


def parity_run(world: int) -> dict:
    """The float64 run: losses, placements, per-rank head counts and the final global weights."""
    from torch.distributed.tensor import DTensor

    module = LitGPTLM(torch.float64)  # Lightning's "32-true" leaves the module's dtype as it is
    make_trainer(_strategy(world), steps=STEPS).fit(module, _loader())
    attn = module.model.transformer.h[0].attn
    placements = {name: str(p.placements) if isinstance(p, DTensor) else None
                  for name, p in (("qkv", attn.qkv.weight), ("proj", attn.proj.weight))}
    raw = module.model.state_dict()
    qkv_plain = all(not isinstance(v, DTensor) for k, v in raw.items() if ".qkv." in k)
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in raw.items()}
    # the state dict (qkv as the unsharded model's plain tensor) loads back and reads out unchanged
    module.model.load_state_dict(raw)
    again = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.model.state_dict().items()}
    return {"losses": module.losses, "placements": placements, "heads": (attn.config.n_head, attn.config.n_query_groups),
            "state": state, "qkv_plain": qkv_plain, "roundtrip": all(torch.equal(state[k], again[k]) for k in state)}


def memory_run(rank: int, world: int) -> dict:
    """The float32 run with the RoPE tables: the strategy's estimate, and MemoryPlanCallback's estimate and
    measurement at its steady step with the smallest measured peak (see test_strategy_budget)."""
    from lightning_memplan.callbacks import MemoryPlanCallback

    strategy = _strategy(world)
    callback = MemoryPlanCallback(print_report=False, write_files=False, measure_every_n_steps=1)
    make_trainer(strategy, steps=STEPS, callbacks=[callback]).fit(LitGPTLM(**ROPE_TABLES), _loader())
    summary = next(r for r in callback.report.epochs[-1].ranks if r.rank == rank)
    best = min((r for r in summary.tracked if not r.warmup and r.measured_peak), key=lambda r: r.measured_peak)
    return {"strategy": strategy.decision.estimate.total, "estimated": best.estimated_peak,
            "measured": best.measured_peak, "source": callback.report.run["estimate_source"],
            "buffer_bytes": callback.report.run["model_spec"]["buffer_bytes"]}


def litgpt_worker(rank: int, world: int, memory: bool = True) -> dict:
    return {"parity": parity_run(world), "memory": memory_run(rank, world) if memory else None}


@pytest.fixture(scope="module")
def litgpt_runs() -> tuple[dict, list[dict]]:
    """One single-process float64 run and one 2-process run (float64 parity, then float32 memory)."""
    (single,) = run_distributed(litgpt_worker, 1, False, timeout_s=240)
    return single, run_distributed(litgpt_worker, 2, timeout_s=420)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(720)
def test_litgpt_tensor_parallel_shards_attention_and_matches_one_process(litgpt_runs):
    single, results = litgpt_runs
    ref = single["parity"]
    for rank, out in enumerate(results):
        r = out["parity"]
        worst = max(((k, (r["state"][k] - v).abs().max().item()) for k, v in ref["state"].items()), key=lambda x: x[1])
        print(f"rank {rank}: losses {r['losses']} vs {ref['losses']}; largest weight difference {worst}")
        assert r["placements"] == {"qkv": "(Shard(dim=0),)", "proj": "(Shard(dim=1),)"}, r["placements"]
        assert r["heads"] == (2, 1)  # per-rank n_head, n_query_groups
        assert len(r["losses"]) == STEPS and ref["losses"][-1] != ref["losses"][0]  # training moved the model
        torch.testing.assert_close(r["losses"], ref["losses"], atol=PARITY_ATOL, rtol=0)
        assert r["state"].keys() == ref["state"].keys() and r["roundtrip"] and r["qkv_plain"]
        for key, value in ref["state"].items():  # same global tensors (litgpt's row order) as one process
            assert value.dtype == torch.float64, key
            torch.testing.assert_close(r["state"][key], value, atol=PARITY_ATOL, rtol=0, msg=key)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(720)
def test_litgpt_tensor_parallel_estimates_every_rank(litgpt_runs):
    """Issue 27: forced tp=2 measured 27.5 % above the estimate on rank 0 (the RoPE tables were not counted)."""
    _, results = litgpt_runs
    tables = 2 * ROPE_TABLES["block_size"] * 16 * 4  # cos and sin, [4096, head_size=16], fp32
    for rank, out in enumerate(results):
        r = out["memory"]
        strategy_err = r["strategy"] / r["measured"] - 1
        callback_err = r["estimated"] / r["measured"] - 1
        print(f"tp=2 rank {rank}: measured {r['measured']:,} B; strategy estimate {r['strategy']:,} B "
              f"({strategy_err:+.1%}); MemoryPlanCallback ({r['source']}) {r['estimated']:,} B ({callback_err:+.1%})")
        assert r["buffer_bytes"] == tables
        assert abs(strategy_err) <= ESTIMATE_RTOL, (rank, r)
        assert abs(callback_err) <= CALLBACK_RTOL, (rank, r)


def test_litgpt_qkv_rows_give_each_rank_its_heads():
    """Rank r's contiguous chunk of the permuted rows is its Q heads, then its K and V groups."""
    rows = litgpt_qkv_rows(n_head=4, n_query_groups=2, head_size=2, tp=2)
    q, k, v = list(range(8)), list(range(8, 12)), list(range(12, 16))
    assert rows.tolist() == q[:4] + k[:2] + v[:2] + q[4:] + k[2:] + v[2:]
    assert sorted(rows.tolist()) == list(range(16))


def test_litgpt_tp_refused_when_tp_does_not_divide_the_query_groups():
    gpt = litgpt_gpt(n_query_groups=1)
    assert tensor_parallel_blocker(find_layout(gpt), gpt, 2) == "tp=2 does not divide n_query_groups=1; use tp in [1]"
    gpt = litgpt_gpt(n_query_groups=2)
    assert tensor_parallel_blocker(find_layout(gpt), gpt, 2) is None


def test_litgpt_resume_at_another_tp_is_refused():
    """Optimizer states of the split qkv are in a tp-dependent row order: resuming them at another tp would
    pair moments with the wrong rows, so memplan_auto's load_checkpoint refuses (same tp resumes)."""
    from lightning_memplan.parallel.tensor_parallel import resume_blocker

    layout = find_layout(litgpt_gpt())
    assert resume_blocker(layout, 2, 2) is None
    message = resume_blocker(layout, 2, 1)
    assert message is not None and "tp=2" in message and "plan=ParallelPlan(tp=2" in message
