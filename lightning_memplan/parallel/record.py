"""What memplan_auto writes down about its decision: the JSON record (``memplan_plan.json`` in the log
directory, the ``"memplan"`` entry of checkpoints), the console text, and reading a checkpoint's plan back.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.rank_zero import rank_zero_warn  # the object lightning.pytorch re-exports

from lightning_memplan.files import json_default, write_atomic
from lightning_memplan.model.specs import ParallelPlan
from lightning_memplan.parallel.decision import Resolution
from lightning_memplan.parallel.mesh import MeshAxis
from lightning_memplan.report.paths import PLAN_FILENAME  # written into the log directory by rank 0

__all__ = ["CHECKPOINT_KEY", "PLAN_FILENAME", "checkpoint_plan", "explain", "publish", "record", "stored_plan"]

#: Key under which the applied plan is stored in checkpoints.
CHECKPOINT_KEY = "memplan"


def record(res: Resolution) -> dict[str, Any]:
    """The JSON-ready record of a resolution: applied plan, mesh, recompute, loss, notes, decision."""
    decision = res.decision
    to_dict = getattr(decision, "to_dict", None)
    return {
        "plan": res.plan.to_dict(),
        "describe": res.plan.describe(),
        "mesh": {str(axis): size for axis, size in zip(MeshAxis, res.mesh.shape, strict=True)},
        "reshard_after_forward": res.mesh.reshard_after_forward,
        "recompute": res.recompute,
        "loss": res.loss,
        "notes": list(res.notes),
        "decision": to_dict() if callable(to_dict) else None,
    }


def explain(res: Resolution) -> str:
    """The decision's ``explain()`` text plus the mesh line, for the console."""
    explain = getattr(res.decision, "explain", None)
    text = explain() if callable(explain) else res.plan.describe()
    mesh = " x ".join(f"{axis}={size}" for axis, size in zip(MeshAxis, res.mesh.shape, strict=True))
    return f"{text}\nmemplan_auto mesh: {mesh}; recompute={res.recompute}"


def publish(res: Resolution, log_dir: str | os.PathLike[str] | None, loggers: Iterable[Any]) -> None:
    """Rank 0's record of the decision: ``memplan_plan.json`` in ``log_dir`` (atomic write, never through a
    link; skipped when ``None``; a write that fails, e.g. a full or read-only disk, is a warning and the run
    goes on: the plan is applied all the same) and the plan as hyperparameters (``memplan/dp``, ...,
    ``memplan/plan``) on every logger that logs hyperparameters."""
    if log_dir is not None:
        path = os.path.join(log_dir, PLAN_FILENAME)
        try:
            write_atomic(path, json.dumps(record(res), indent=2, default=_json_value))
        except (OSError, ValueError) as exc:
            rank_zero_warn(
                f"memplan_auto could not write its plan record {path!r} ({type(exc).__name__}: {exc}); the plan is "
                "applied all the same (the HTML report has no plan map). Free space or make the log folder writable"
            )
    params: dict[str, Any] = {f"memplan/{k}": v for k, v in res.plan.to_dict().items()}
    params["memplan/plan"] = res.plan.describe()
    for logger in loggers:
        try:
            logger.log_hyperparams(params)
        except NotImplementedError:  # Fabric's CSVLogger logs no hyperparameters
            continue


def _json_value(value: Any) -> Any:
    """NumPy/torch scalars as their numbers (:func:`~lightning_memplan.files.json_default`), anything else
    JSON does not know (a dtype, an enum) as its text, as the record always wrote it."""
    try:
        return json_default(value)
    except TypeError:
        return str(value)


def stored_plan(ckpt_path: Any) -> ParallelPlan | None:
    """The plan stored in a memplan_auto checkpoint (file or distributed-checkpoint folder), if any.

    Read before Lightning's own load (the plan decides the mesh the checkpoint is loaded into), so it is
    read with ``torch.load(weights_only=True)`` always, whatever ``fit(weights_only=...)`` says: the
    record is plain JSON-like data, and nothing in the file is ever executed here. A file that only
    loads with ``weights_only`` off (custom pickled objects) gives a warning and no stored plan; the
    user's own ``fit(weights_only=...)`` then decides whether Lightning loads it.
    """
    if ckpt_path is None:
        return None
    path = Path(ckpt_path)
    meta = path / _METADATA_FILENAME if path.is_dir() else path
    if not meta.is_file():
        return None
    try:
        checkpoint = torch.load(meta, map_location="cpu", mmap=not path.is_dir(), weights_only=True)
    except pickle.UnpicklingError as exc:
        rank_zero_warn(
            f"memplan_auto: {str(meta)!r} does not load with torch.load(weights_only=True) ({_first_line(exc)}); "
            "its stored plan is not read (memplan never unpickles arbitrary objects) and a plan is made afresh. "
            "Pass MemplanAutoStrategy(plan=...) to force the checkpoint's plan"
        )
        return None
    return checkpoint_plan(checkpoint.get(CHECKPOINT_KEY) if isinstance(checkpoint, dict) else None, meta)


#: What reading a stored plan may raise: each means "not a plan this version wrote", never "end the run".
_NOT_A_PLAN = (ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError, RecursionError)


def checkpoint_plan(entry: Any, where: Any, *, world_size: int | None = None) -> ParallelPlan | None:
    """The plan of a checkpoint's ``"memplan"`` entry (:func:`record`), checked: ``None`` without one. An
    entry this version cannot use (not a dict, a ``"plan"`` that is not a dict, a plan ``ParallelPlan``
    refuses, or one for another ``world_size``: tampered, or from another run or version) gives one warning
    naming the field, and ``None``: memplan_auto then makes a plan afresh and the run goes on."""
    if entry is None:
        return None
    try:
        if not isinstance(entry, dict):
            raise TypeError(f"{CHECKPOINT_KEY!r} is a {type(entry).__name__}, not the record memplan_auto writes")
        stored = entry.get("plan")
        if stored is None:
            return None
        if not isinstance(stored, dict):
            raise TypeError(f"{CHECKPOINT_KEY}['plan'] is a {type(stored).__name__}, not a plan")
        plan = ParallelPlan.from_dict(stored)
        if world_size is not None and plan.world_size != world_size:
            raise ValueError(f"{CHECKPOINT_KEY}['plan'] ({plan.describe()}) needs {plan.world_size} processes, this run "
                             f"has {world_size}")
    except _NOT_A_PLAN as exc:
        rank_zero_warn(f"memplan_auto: the checkpoint {str(where)!r} holds a stored plan this run cannot use "
                       f"({type(exc).__name__}: {str(exc)[:300]}); it is not used and a plan is made afresh")
        return None
    return plan


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
