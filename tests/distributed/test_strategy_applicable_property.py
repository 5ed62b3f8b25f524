"""Property: what memplan_auto plans, it can apply; what it is forced to do, it runs or refuses at setup.

For random tiny zoo GPTs (layers, heads, key/value heads, width, tied embeddings, positions) on two gloo
processes:

* under a random ``memory_budget`` the plan memplan_auto chooses applies and runs a training step, or
  setup says that nothing fits (a ``ValueError`` before any step);
* a random forced ``ParallelPlan`` (dp/tp/pp/zero/sp/schedule/microbatches) either runs a step or is
  refused at setup with a ``ValueError``/``TypeError`` that names an argument -- never an error from
  inside the first step.

Hypothesis draws the examples once (fixed draws by default, see ``tests/conftest.py``) and one pair of
processes runs them all: spawning per example would cost tens of seconds each.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_memplan.testing import run_distributed

hyp = pytest.importorskip("hypothesis")
st = hyp.strategies

WORLD, VOCAB, SEQ, BATCH = 2, 32, 8, 4


@st.composite
def examples(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    model = {
        "n_layers": draw(st.integers(1, 3)),
        "heads": heads,
        "kv": draw(st.sampled_from([d for d in (1, 2, 4) if heads % d == 0])),
        "head_dim": draw(st.sampled_from([4, 8])),
        "tied": draw(st.booleans()),
        "rope": draw(st.booleans()),
    }
    if draw(st.booleans()):
        return model, {"memory_budget": draw(st.integers(150_000, 2_000_000))}
    tp = draw(st.sampled_from([1, 2]))
    pp = WORLD // tp if draw(st.booleans()) else 1
    schedule = draw(st.sampled_from(["1f1b", "gpipe"]))
    plan = {
        "dp": WORLD // (tp * pp), "tp": tp, "pp": pp, "zero": draw(st.sampled_from([0, 2, 3])),
        "sp": draw(st.booleans()) and tp > 1, "schedule": schedule,
        "microbatches": draw(st.sampled_from([1, 2, 4])) if pp > 1 else 1,
    }
    if plan["dp"] == 1:
        plan["zero"] = 0
    return model, {"plan": plan}


def property_worker(rank: int, world: int, cases: list, root: str) -> list[dict]:
    import lightning as L

    from lightning_memplan.model.specs import ParallelPlan
    from lightning_memplan.strategies import MemplanAutoStrategy
    from lightning_memplan.testing.zoo import GPT, GPTConfig, causal_lm_loss

    class Tiny(L.LightningModule):
        def __init__(self, m: dict) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT(GPTConfig(
                VOCAB, m["n_layers"], m["heads"] * m["head_dim"], m["heads"], n_kv_heads=m["kv"], max_positions=SEQ,
                tied_embeddings=m["tied"], position_embedding="rope" if m["rope"] else "learned",
            ))

        def training_step(self, batch, batch_idx):
            return causal_lm_loss(self.model, *batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class StepWatch(L.Callback):
        started = False

        def on_train_batch_start(self, *args):
            self.started = True

    tokens = torch.randint(0, VOCAB, (BATCH * world, SEQ + 1), generator=torch.Generator().manual_seed(0))
    out = []
    for i, (model, kwargs) in enumerate(cases):
        if "plan" in kwargs:
            try:
                kwargs = {"plan": ParallelPlan(**kwargs["plan"])}
            except (ValueError, TypeError) as exc:  # the plan itself is invalid: refused before any run
                out.append({"case": (model, kwargs), "outcome": "refused", "error": f"{type(exc).__name__}: {exc}"})
                continue
        watch = StepWatch()
        strategy = MemplanAutoStrategy(**kwargs)
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=strategy, max_steps=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[watch],
            default_root_dir=os.path.join(root, str(i)),
        )
        loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)
        try:
            trainer.fit(Tiny(model), loader)
        except Exception as exc:  # noqa: BLE001 - classified below
            out.append({"case": (model, kwargs), "outcome": "raised", "started": watch.started,
                        "type": type(exc).__name__, "error": str(exc)})
            continue
        out.append({"case": (model, kwargs), "outcome": "ran", "steps": trainer.global_step,
                    "plan": strategy.applied_plan.describe()})
    return out


#: Examples per run (x MEMPLAN_HYPOTHESIS_SCALE): each is one fit on the same two processes.
N_EXAMPLES = 5 * int(os.environ.get("MEMPLAN_HYPOTHESIS_SCALE", "1"))


def drawn_examples(n: int) -> list:
    """``n`` distinct examples as hypothesis generates them (fixed under the default ``ci`` profile):
    the drawing is pure and runs here; only the fits need the processes."""
    out: list = []

    @hyp.settings(max_examples=4 * n, phases=[hyp.Phase.generate])
    @hyp.given(examples())
    def collect(example):
        if example not in out and len(out) < n:
            out.append(example)

    collect()
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_chosen_plans_run_and_forced_plans_run_or_are_refused_at_setup(tmp_path):
    cases = drawn_examples(N_EXAMPLES)
    assert len(cases) == N_EXAMPLES
    results = run_distributed(property_worker, WORLD, cases, str(tmp_path), timeout_s=240)
    outcomes = []
    for r in results[0]:
        print(r)
        outcomes.append(r["outcome"])
        if r["outcome"] == "ran":
            assert r["steps"] == 1
        elif r["outcome"] == "raised":
            auto = "memory_budget" in r["case"][1]
            assert not r["started"], f"failed inside a training step, not at setup: {r}"
            assert r["type"] in ("ValueError", "TypeError", "PlanDoesNotFitError"), r
            if auto:  # the only refusal a searched plan may give: nothing fits the budget
                assert "fit" in r["error"], r
            else:
                assert "=" in r["error"], r  # names the argument and its value
    assert "ran" in outcomes
