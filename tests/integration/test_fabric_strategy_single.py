"""``Fabric(strategy="memplan_auto")`` on one CPU process: a launched Fabric loop through the registry name,
the optimizer created before ``fabric.setup`` kept (same object, hyperparameters and parameters), the plan
record written through ``log_plan(fabric)``, and the errors a Fabric user can hit at setup."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_memplan.model.specs import ParallelPlan, TrainSpec
from lightning_memplan.testing.zoo import GPT, GPTConfig, causal_lm_loss

L = pytest.importorskip("lightning")

VOCAB, SEQ = 64, 8


@pytest.fixture(autouse=True)
def _restore_environ():
    # fabric.launch() sets MASTER_ADDR/PORT, WORLD_SIZE, ... for its (here: no) child processes
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    # the strategy's one-process group must not outlive the test (later tests check none exists)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(VOCAB, 2, 32, 4, max_positions=SEQ))


def _loader(batch: int = 4) -> DataLoader:
    tokens = torch.randint(0, VOCAB, (4 * batch, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)


def _fabric(strategy, **kwargs):
    import lightning_memplan  # noqa: F401 - registers "memplan_auto"

    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, **kwargs)
    fabric.launch()
    return fabric


def test_registry_name_plans_from_the_dataloader_and_keeps_the_optimizer(tmp_path):
    from lightning.fabric.loggers import CSVLogger

    fabric = _fabric("memplan_auto", loggers=CSVLogger(tmp_path))
    loader = fabric.setup_dataloaders(_loader(batch=4))
    model = _gpt()
    optimizer = torch.optim.AdamW([{"params": model.blocks.parameters(), "lr": 1e-3},
                                   {"params": [p for n, p in model.named_parameters() if not n.startswith("blocks.")],
                                    "lr": 5e-4, "weight_decay": 0.0}])
    model, fabric_optimizer = fabric.setup(model, optimizer)
    strategy = fabric.strategy
    assert type(strategy).__name__ == "MemplanAutoFabricStrategy"
    assert strategy.applied_plan.world_size == 1
    assert strategy.decision.train.micro_batch == 4 and strategy.decision.train.seq_len == SEQ  # from the loader
    assert strategy.decision.train.optimizer == "adamw" and strategy.decision.train.precision == "32-true"
    assert fabric_optimizer.optimizer is optimizer  # remapped in place: same object and hyperparameters
    assert [g["lr"] for g in optimizer.param_groups] == [1e-3, 5e-4]
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for p in model.parameters()}
    for x, y in loader:
        loss = causal_lm_loss(model, x, y)
        fabric.backward(loss)
        fabric_optimizer.step()
        fabric_optimizer.zero_grad()
    assert optimizer.state  # the optimizer really stepped the model's parameters
    # checkpoint round trip (one process: nothing sharded, saved as Fabric saves a single device's)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": fabric_optimizer, "step": 4})
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    rest = fabric.load(tmp_path / "ckpt", {"model": model, "optimizer": fabric_optimizer})
    assert rest == {"step": 4} and all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    strategy.log_plan(fabric)
    written = json.loads((tmp_path / "lightning_logs" / "version_0" / "memplan_plan.json").read_text())
    assert written["plan"] == strategy.applied_plan.to_dict() == strategy.plan_record()["plan"]


def test_not_a_module_is_refused():
    from lightning_memplan.fabric import MemplanAutoFabricStrategy

    fabric = _fabric(MemplanAutoFabricStrategy(plan=ParallelPlan()))
    with pytest.raises(TypeError, match=r"module='not a model' must be a torch.nn.Module"):
        fabric.setup_module("not a model", move_to_device=False)


def test_forced_plan_for_another_world_size_is_refused():
    from lightning_memplan.fabric import MemplanAutoFabricStrategy

    fabric = _fabric(MemplanAutoFabricStrategy(plan=ParallelPlan(dp=2, zero=3)))
    with pytest.raises(ValueError, match=r"needs 2 processes .* but Fabric runs 1 .*Fabric\(devices=\.\.\."):
        fabric.setup(_gpt())


def test_no_batch_shape_says_how_to_give_it():
    from lightning_memplan.fabric import MemplanAutoFabricStrategy

    fabric = _fabric(MemplanAutoFabricStrategy())
    with pytest.raises(ValueError, match=r"fabric.setup_dataloaders\(train_loader\) before fabric.setup"):
        fabric.setup(_gpt())


def test_optimizer_with_state_and_stale_optimizer_are_refused():
    from lightning_memplan.fabric import MemplanAutoFabricStrategy

    train = TrainSpec(micro_batch=4, seq_len=SEQ)
    model = _gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = next(iter(_loader()))
    causal_lm_loss(model, x, y).backward()
    optimizer.step()  # momentum buffers: state
    fabric = _fabric(MemplanAutoFabricStrategy(train=train))
    with pytest.raises(ValueError, match=r"already holds state"):
        fabric.setup(model, optimizer)

    fabric = _fabric(MemplanAutoFabricStrategy(train=train))
    model = _gpt()
    stale = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # not the model's parameters
    model = fabric.setup_module(model)
    with pytest.raises(ValueError, match=r"Create the optimizer after setup_module"):
        fabric.setup_optimizers(stale)
