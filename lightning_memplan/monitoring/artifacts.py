"""Where :class:`~lightning_memplan.callbacks.MemoryPlanCallback` writes its report files, and how each
logger receives them through its own API.

Directories: ``trainer.log_dir`` is the first logger's ``log_dir`` for TensorBoard and CSV (a
``version_N`` folder of its own), but for MLflow and Weights & Biases it is the *shared* ``save_dir``
(``mlruns/``, ``wandb/``), so every run wrote, and merged into, the same ``memory_report.json``. The
report therefore goes to each file logger's own run folder (``log_dir`` of every TensorBoard/CSV
logger), to W&B's run files folder (``run.dir``, uploaded with the run), and, when the first logger has
no folder of its own, to ``<default_root_dir>/memory_reports/<run id>``.

Loggers (rank 0):

- MLflow: ``MlflowClient.log_artifact(run_id, path, "memory_report")`` for the JSON, Markdown, HTML and
  PNG files (the run's own artifact store).
- Weights & Biases: ``run.save(path, base_path=..., policy="now")`` for the files, ``log_image`` for the
  PNG and ``log_table`` with numeric columns (bytes in ``units``, the ratio as a float).
- TensorBoard: ``add_image`` of the PNG (HWC) beside the existing ``add_text`` report.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning_memplan.monitoring.emit import PREFIX
from lightning_memplan.report.records import EpochReport
from lightning_memplan.report.render import UNITS

__all__ = ["log_report_files", "report_dirs", "table_rows"]

#: Folder under ``default_root_dir`` for runs whose first logger keeps no folder of its own.
_FALLBACK_FOLDER = "memory_reports"
#: Artifact folder (MLflow) of the report files.
_ARTIFACT_PATH = "memory_report"


def _logger_classes() -> tuple[Any, Any, Any, Any]:
    # Fabric's CSV and TensorBoard loggers: the Trainer's are subclasses of them, so both kinds match.
    from lightning.fabric.loggers import CSVLogger, TensorBoardLogger
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger

    return CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger


def _own_dir(logger: Any) -> str | None:
    """The logger's own run folder, or ``None`` when it has none on this machine."""
    csv, mlflow, tensorboard, wandb = _logger_classes()
    if isinstance(logger, (csv, tensorboard)):
        return str(logger.log_dir)
    if isinstance(logger, wandb):
        run_dir = getattr(logger.experiment, "dir", None)
        return str(run_dir) if run_dir else None
    return None


def _run_id(logger: Any) -> str | None:
    _, mlflow, _, wandb = _logger_classes()
    if isinstance(logger, mlflow):
        return str(logger.run_id) if logger.run_id else None
    if isinstance(logger, wandb):
        return str(logger.experiment.id)
    version = getattr(logger, "version", None)
    return str(version) if version is not None else None


def report_dirs(trainer: Any, fallback: str) -> list[str]:
    """Folders the report is written to on rank 0: every logger's own run folder (first logger first),
    else ``<default_root_dir>/memory_reports/<run id>`` (MLflow, custom loggers), else ``fallback``
    (no logger: ``default_root_dir``)."""
    dirs = [d for d in (_own_dir(lg) for lg in trainer.loggers) if d]
    if trainer.loggers and (not dirs or _own_dir(trainer.loggers[0]) is None):
        run = _run_id(trainer.loggers[0])
        if run is not None:
            dirs.insert(0, os.path.join(str(trainer.default_root_dir), _FALLBACK_FOLDER, run))
    if not dirs:
        dirs = [fallback]
    return list(dict.fromkeys(dirs))


def table_rows(epoch: EpochReport, units: str) -> tuple[list[str], list[list[Any]]]:
    """Numeric per-rank table of an epoch: rank, the byte figures in ``units`` (floats), the ratio."""
    scale = UNITS[units]
    suffix = units.lower()
    columns = [
        "rank",
        f"estimated_peak_{suffix}",
        f"measured_peak_{suffix}",
        f"reserved_{suffix}",
        f"headroom_{suffix}",
        "measured_to_estimated",
    ]

    def view(value: int | None) -> float | None:
        return None if value is None else value / scale

    data = [
        [
            int(r.rank),
            view(r.estimated_peak),
            view(r.measured_peak),
            view(r.reserved),
            view(r.headroom),
            r.measured_to_estimated,
        ]
        for r in epoch.ranks
    ]
    return columns, data


def _png_array(path: Path) -> Any:
    import matplotlib.image

    return matplotlib.image.imread(str(path))  # HxWx4 float32 in [0, 1]


def log_report_files(trainer: Any, files: Any, epoch: EpochReport, units: str, step: int) -> None:
    """Give the written report (``files``: :class:`~lightning_memplan.report.io.WrittenFiles`) to each
    logger through its own API (module docstring)."""
    _, mlflow, tensorboard, wandb = _logger_classes()
    paths = [p for p in (files.json, files.markdown, files.html, files.png) if p is not None]
    for logger in trainer.loggers:
        if isinstance(logger, mlflow) and logger.run_id:
            for path in paths:
                logger.experiment.log_artifact(logger.run_id, str(path), _ARTIFACT_PATH)
        elif isinstance(logger, wandb):
            run = logger.experiment
            for path in paths:
                run.save(str(path), base_path=str(Path(path).parent), policy="now")
            columns, data = table_rows(epoch, units)
            logger.log_table(key=f"{PREFIX}/ranks", columns=columns, data=data, step=step)
            if files.png is not None:
                logger.log_image(key=f"{PREFIX}/report", images=[str(files.png)], step=step)
        elif isinstance(logger, tensorboard) and files.png is not None:
            logger.experiment.add_image(
                f"{PREFIX}/report", _png_array(files.png), global_step=step, dataformats="HWC"
            )
