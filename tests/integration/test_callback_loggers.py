"""Report files and images through each logger's own API, each run in its own folder: MLflow (a file
store in tmp_path), TensorBoard and Weights & Biases (offline)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_callback_helpers import LitGPT, make_trainer, token_loader

from lightning_memplan.callbacks import MemoryPlanCallback
from lightning_memplan.report import load_report
from lightning_memplan.testing.zoo import gpt2_style

REPORT_FILES = {"memory_report.json", "memory_report.md", "memory_report.html", "memory_report.png"}


def _fit(root, logger, n_batches=2):
    torch.manual_seed(0)
    config = gpt2_style(n_layers=1)
    cb = MemoryPlanCallback(measure_every_n_steps=1, calibrate=False, print_report=False, units="MiB")
    make_trainer(root, [cb], limit_train_batches=n_batches, logger=logger, default_root_dir=str(root)).fit(
        LitGPT(config), token_loader(config, 2, [16], n_batches)
    )
    return cb


def test_mlflow_runs_keep_their_own_report_artifacts(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="MLflow logger test")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the brief's file store, in tmp_path
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    runs = []
    for n_batches in (2, 3):
        logger = MLFlowLogger(experiment_name="memplan", tracking_uri=uri)
        _fit(tmp_path, logger, n_batches)
        runs.append((logger.run_id, n_batches))
    client = MlflowClient(tracking_uri=uri)
    for run_id, n_batches in runs:
        names = {Path(a.path).name for a in client.list_artifacts(run_id, "memory_report")}
        assert names == REPORT_FILES
        local = Path(client.download_artifacts(run_id, "memory_report/memory_report.json", str(tmp_path / run_id)))
        report = load_report(local)
        assert report.epochs[-1].ranks[0].steps == n_batches  # the first run's report survived the second
        assert (tmp_path / "memory_reports" / run_id / "memory_report.json").is_file()
    assert not (tmp_path / "mlruns" / "memory_report.json").exists()


def test_tensorboard_gets_the_report_image_and_text(tmp_path):
    pytest.importorskip("tensorboard", reason="TensorBoard logger test")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(str(tmp_path), name="tb")
    _fit(tmp_path, logger)
    assert REPORT_FILES <= {p.name for p in Path(logger.log_dir).iterdir()}
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    assert "memplan/report" in events.Tags()["images"]
    image = events.Images("memplan/report")[0]
    assert image.width > 100 and image.height > 100
    assert any(tag.startswith("memplan/report") for tag in events.Tags()["tensors"])  # add_text


def test_wandb_gets_files_image_and_a_numeric_table(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="W&B logger test")
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="memplan", save_dir=str(tmp_path))
    cb = _fit(tmp_path, logger)
    run_dir = Path(logger.experiment.dir)
    logger.experiment.finish()
    assert REPORT_FILES <= {p.name for p in run_dir.iterdir()}  # the run's own files folder
    tables = list(run_dir.rglob("ranks_*.table.json"))
    assert tables, sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    table = json.loads(tables[-1].read_text())
    assert table["columns"][:3] == ["rank", "estimated_peak_mib", "measured_peak_mib"]
    row = table["data"][0]
    assert all(isinstance(v, (int, float)) for v in row[:5])
    rank = cb.report.epochs[-1].ranks[0]
    assert row[2] == pytest.approx(rank.measured_peak / 2**20)
    assert list(run_dir.rglob("report_*.png"))
