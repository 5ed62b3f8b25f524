"""Where :class:`~lightning_memplan.callbacks.MemoryPlanCallback` writes its report files, and how each
logger receives them through its own API.

Directories: ``trainer.log_dir`` is the first logger's ``log_dir`` for TensorBoard and CSV (a
``version_N`` folder of its own), but for MLflow and Weights & Biases it is the *shared* ``save_dir``
(``mlruns/``, ``wandb/``), so every run wrote, and merged into, the same ``memory_report.json``. The
report therefore goes to each file logger's own run folder (``log_dir`` of every TensorBoard/CSV
logger), to W&B's run files folder (``run.dir``, uploaded with the run), and, when the first logger has
no folder of its own, to ``<default_root_dir>/memory_reports/<run id>``.

Names stay inside their root (CWE-22): the run id in the fallback folder is made one harmless path
component (:func:`~lightning_memplan.files.safe_component`: ``"../../outside"`` -> ``"_._.._outside"``), and a
TensorBoard/CSV ``log_dir`` that a name or version like ``"../../outside"``, an absolute path or a NUL
puts outside the logger's own root folder is refused with a warning (the report then goes to the
fallback folder under ``default_root_dir``).

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

from lightning_memplan.files import safe_component
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


def _inside(path: str, root: str) -> bool:
    """Whether ``path`` lies in ``root`` (lexically, after ``..`` is resolved; no NUL in either)."""
    if "\x00" in path or "\x00" in root:
        return False
    full, base = os.path.normpath(os.path.abspath(path)), os.path.normpath(os.path.abspath(root))
    try:
        return os.path.commonpath([full, base]) == base
    except ValueError:  # different drives (Windows)
        return False


def _own_dir(logger: Any) -> str | None:
    """The logger's own run folder, or ``None`` when it has none on this machine (or when its name or
    version puts it outside the logger's root folder: refused with a warning)."""
    csv, mlflow, tensorboard, wandb = _logger_classes()
    if isinstance(logger, (csv, tensorboard)):
        log_dir = str(logger.log_dir)
        root = str(getattr(logger, "save_dir", None) or logger.root_dir)  # the Trainer's loggers / Fabric's
        if _inside(log_dir, root):
            return log_dir
        from lightning.fabric.utilities.rank_zero import rank_zero_warn

        rank_zero_warn(
            f"MemoryPlanCallback: {type(logger).__name__}.log_dir={log_dir!r} lies outside its root folder {root!r} "
            f"(name={logger.name!r}, version={logger.version!r}); the memory report is not written there but under "
            f"default_root_dir/{_FALLBACK_FOLDER}/. Give the logger a plain name and version (no '..', '/' or NUL)"
        )
        return None
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
    else ``<default_root_dir>/memory_reports/<run id>`` (MLflow, custom loggers, a logger whose folder a
    name or version puts outside its root; the run id made one safe path component), else ``fallback``
    (no logger: ``default_root_dir``)."""
    own = [_own_dir(lg) for lg in trainer.loggers]  # once per logger: a refused folder warns once
    dirs = [d for d in own if d]
    if trainer.loggers and (not dirs or own[0] is None):
        run = _run_id(trainer.loggers[0])
        if run is not None:
            dirs.insert(0, os.path.join(str(trainer.default_root_dir), _FALLBACK_FOLDER, safe_component(run)))
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
    logger through its own API (module docstring). A logger that fails to take them (a full artifact store,
    an unreadable PNG) gives a warning; the other loggers and the run go on."""
    for logger in trainer.loggers:
        try:
            _log_files(logger, files, epoch, units, step)
        except Exception as exc:  # noqa: BLE001 - a monitoring upload never ends the run
            from lightning.fabric.utilities.rank_zero import rank_zero_warn

            rank_zero_warn(
                f"MemoryPlanCallback: {type(logger).__name__} did not take the memory report files "
                f"({type(exc).__name__}: {str(exc)[:300]}); they are on disk, and the run goes on"
            )


def _log_files(logger: Any, files: Any, epoch: EpochReport, units: str, step: int) -> None:
    _, mlflow, tensorboard, wandb = _logger_classes()
    paths = [p for p in (files.json, files.markdown, files.html, files.png) if p is not None]
    if isinstance(logger, mlflow) and logger.run_id:
        for path in paths:
            logger.experiment.log_artifact(logger.run_id, str(path), _ARTIFACT_PATH)
    elif isinstance(logger, wandb):
        run = logger.experiment
        for path in paths:
            run.save(str(path), base_path=str(Path(path).parent), policy="now")
        if files.json is not None:  # the epoch's files (the end of a fit adds its pictures alone)
            columns, data = table_rows(epoch, units)
            logger.log_table(key=f"{PREFIX}/ranks", columns=columns, data=data, step=step)
        if files.png is not None:
            logger.log_image(key=f"{PREFIX}/report", images=[str(files.png)], step=step)
    elif isinstance(logger, tensorboard) and files.png is not None:
        logger.experiment.add_image(f"{PREFIX}/report", _png_array(files.png), global_step=step, dataformats="HWC")
