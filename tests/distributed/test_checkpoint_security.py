"""Nothing in a checkpoint is ever executed by memplan_auto: a pickle payload (an object whose
``__reduce__`` writes a marker file when unpickled) planted in a checkpoint *file* and in a distributed
checkpoint *folder*'s metadata file must not run through ``trainer.fit(ckpt_path=...)`` (memplan reads the
stored plan before Lightning's load) nor through the strategy's own sharded loader.

The genuine checkpoints (written by a one-step fit) are made first, then the payload is added to them with
``torch.save``; the fit on the tampered file must fail with torch's weights-only refusal, leaving no
marker. The fits run in a child process (``run_distributed(fn, 1)``) so this process keeps no process group.
"""

from __future__ import annotations

import os
import warnings

import lightning as L
import pytest
import torch

from lightning_memplan.parallel.record import CHECKPOINT_KEY, stored_plan
from lightning_memplan.testing import run_distributed
from lightning_memplan.testing.zoo import GPT, GPTConfig, causal_lm_loss


class Payload:
    """Unpickling this runs ``exec``, which writes ``marker``: the proof that a file's code was executed."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('executed')",))


class _TinyLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(64, 1, 16, 2, max_positions=8))

    def training_step(self, batch, batch_idx):
        return causal_lm_loss(self.model, *batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def _loader():
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return torch.utils.data.DataLoader(data, batch_size=2)


def _fit(root: str, distributed: bool, ckpt_path: str | None = None, calls: list[str] | None = None) -> L.Trainer:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_memplan.strategies import MemplanAutoStrategy

    strategy = MemplanAutoStrategy(memory_budget=2**30, save_distributed_checkpoint=distributed)
    original = strategy._load_sharded

    def spy(path, weights_only, **kwargs):
        if calls is not None:
            calls.append(str(path))
        return original(path, weights_only, **kwargs)

    strategy._load_sharded = spy  # type: ignore[method-assign]
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
        callbacks=[ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), save_last=True, save_top_k=0)],
    )
    if ckpt_path is not None:
        trainer.ckpt_path = ckpt_path  # read by memplan before setup (stored plan), then by Lightning's load
    trainer.fit(_TinyLM(), _loader())
    return trainer


def _plant(meta_file: str, marker: str) -> None:
    checkpoint = torch.load(meta_file, map_location="cpu", weights_only=True)
    assert CHECKPOINT_KEY in checkpoint  # the genuine file holds memplan's record and loads weights-only
    checkpoint["payload"] = Payload(marker)
    torch.save(checkpoint, meta_file)


def tampered_fit_worker(rank: int, world: int, root: str) -> dict:
    return {kind: _tampered_case(os.path.join(root, kind), kind == "directory") for kind in ("file", "directory")}


def _tampered_case(root: str, distributed: bool) -> dict:
    _fit(os.path.join(root, "first"), distributed)
    path = os.path.join(root, "first", "ckpt", "last.ckpt")
    is_dir = os.path.isdir(path)
    marker = os.path.join(root, "EXECUTED")
    _plant(os.path.join(path, "meta.pt") if is_dir else path, marker)
    calls: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            _fit(os.path.join(root, "second"), distributed, ckpt_path=path, calls=calls)
            error = None
        except Exception as exc:  # noqa: BLE001 - reported to the test
            error = f"{type(exc).__name__}: {exc}"
    return {
        "is_dir": is_dir,
        "error": error,
        "executed": os.path.exists(marker),
        "warnings": [str(w.message) for w in caught if "weights_only=True" in str(w.message)],
        "sharded_calls": calls,
    }


@pytest.mark.distributed
def test_pickle_payload_in_a_checkpoint_is_never_executed(tmp_path):
    (out,) = run_distributed(tampered_fit_worker, 1, str(tmp_path))
    for kind, case in out.items():
        assert case["is_dir"] is (kind == "directory")
        assert case["executed"] is False, kind
        assert case["warnings"], f"{kind}: stored_plan must say why the stored plan was not read"
        assert case["error"] is not None, kind
    # The file: Lightning's ModelParallelStrategy loader is reached and refuses it (no marker either way).
    # The folder, one device: plain (non-DTensor) parameters, so the strategy's own sharded loader reads it,
    # and its torch.load refuses the payload (torch's weights-only unpickler), as Lightning's does.
    directory = out["directory"]
    assert directory["sharded_calls"] and directory["error"].startswith("UnpicklingError")
    assert "weights_only" in directory["error"]


def test_stored_plan_reads_weights_only_and_never_runs_a_payload(tmp_path):
    marker = tmp_path / "EXECUTED"
    plan = {"dp": 2, "zero": 3}
    good = tmp_path / "good.ckpt"
    torch.save({CHECKPOINT_KEY: {"plan": plan}, "state_dict": {"w": torch.ones(2)}}, good)
    assert stored_plan(good).to_dict()["zero"] == 3
    folder = tmp_path / "dcp"
    folder.mkdir()
    for target in (tmp_path / "bad.ckpt", folder / "meta.pt"):
        torch.save({CHECKPOINT_KEY: {"plan": plan}, "payload": Payload(str(marker))}, target)
        with pytest.warns(UserWarning, match=r"weights_only=True"):
            got = stored_plan(folder if target.parent == folder else target)
        assert got is None
        assert not marker.exists()
