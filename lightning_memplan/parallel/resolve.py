"""Planning for both front doors (the Trainer's ``MemplanAutoStrategy`` and Fabric's
``MemplanAutoFabricStrategy``): the options they take, the plan made on rank 0 and broadcast, and the
agreement check every rank runs once the mesh exists.

Plain functions over explicit arguments (module, world size, rank, ...), so the two strategies are thin
adapters that only read their own run (Trainer hooks or ``fabric.setup``) and call these (Lightning's ``ModelParallelStrategy`` builds on ``lightning.fabric.strategies.model_parallel`` the same way;
Lightning's ``pytorch.strategies.ModelParallelStrategy`` builds on ``fabric.strategies.model_parallel``
helpers the same way).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_memplan.live.layouts import TransformerLayout
from lightning_memplan.model.specs import ParallelPlan, TrainSpec
from lightning_memplan.parallel.decision import Resolution, decide
from lightning_memplan.parallel.inputs import BatchShapeUnknown, model_spec_for
from lightning_memplan.parallel.mesh import build_device_mesh
from lightning_memplan.parallel.record import explain
from lightning_memplan.parallel.stall import RankRendezvous
from lightning_memplan.validation import check_bool, check_number, check_optional_int

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "PlanningOptions",
    "check_agreement",
    "plan_on_every_rank",
    "rendezvous",
    "resolve",
    "resolve_on_rank_zero",
]


@dataclass(frozen=True, kw_only=True)
class PlanningOptions:
    """What the user gave the strategy about planning (the same arguments on both front doors).

    Args:
        memory_budget: bytes each rank may use for tensors; ``None`` uses the hardware memory minus
            ``headroom``.
        allow: restrictions passed to the planner (see :func:`lightning_memplan.planning.plan`).
        hardware: a ``HardwareSpec``, a preset name, or ``None`` (detect).
        plan: a forced :class:`ParallelPlan` (no search), or ``None``.
        train: the :class:`TrainSpec` to plan with, or ``None`` (read from the run).
        headroom: fraction of device memory kept free, in [0, 1).
        calibrate: check the plan against the calibrated estimate of the module before it is said to fit
            (``parallel/verify.py``: the module's meta copy traced under fake tensors on rank 0, at setup);
            ``False``: the analytic estimate alone decides (faster setup, a looser promise).

    Raises:
        ValueError / TypeError: naming the argument, its value and the rule.
    """

    memory_budget: int | None = None
    allow: Any = None
    hardware: Any = None
    plan: ParallelPlan | None = None
    train: TrainSpec | None = None
    headroom: float = 0.1
    calibrate: bool = True

    def __post_init__(self) -> None:
        # checked values stored back plain (np.int64 -> int, a 0-d tensor -> its item)
        object.__setattr__(self, "memory_budget", check_optional_int(
            "memory_budget", self.memory_budget, hint="a positive number of bytes, e.g. 8 * 2**30, or None"))
        if self.plan is not None and not isinstance(self.plan, ParallelPlan):
            raise TypeError(f"plan={self.plan!r} must be a lightning_memplan.ParallelPlan, e.g. ParallelPlan(dp=2, zero=3)")
        if self.train is not None and not isinstance(self.train, TrainSpec):
            raise TypeError(f"train={self.train!r} must be a lightning_memplan.TrainSpec")
        object.__setattr__(self, "headroom", check_number(
            "headroom", self.headroom, minimum=0.0, maximum=1.0, max_inclusive=False,
            hint="a fraction in [0, 1), e.g. 0.1"))
        object.__setattr__(self, "calibrate", check_bool(
            "calibrate", self.calibrate, hint="True checks the plan against the module's calibrated estimate"))


def resolve(
    *,
    options: PlanningOptions,
    module: nn.Module,
    layout: TransformerLayout | None,
    read_train: Callable[[], TrainSpec],
    precision: str,
    devices: int,
    num_nodes: int,
    self_parallel: bool,
    forced: ParallelPlan | None,
    forced_source: str,
    never: frozenset[str] = frozenset(),
    runner: str = "the Trainer",
    warn: Callable[[str], None],
    head_in_root: bool | None = None,
    read_batch: Callable[[], Any] | None = None,
) -> Resolution:
    """The :class:`Resolution` for ``module`` (rank 0 only: no collectives).

    Args:
        options: the strategy's planning arguments.
        module: the module to plan for (the LightningModule, or the module given to ``fabric.setup``).
        layout: ``find_layout(module)``.
        read_train: returns the TrainSpec of the run; raises :class:`BatchShapeUnknown` when the batch
            shape cannot be read. A forced plan then falls back to ``b=1, s=1`` (its estimate is rough).
        precision: the run's precision string, for that fallback.
        devices, num_nodes: processes per node and nodes (world size = their product).
        self_parallel: the module parallelises itself (Trainer ``configure_model``): pp/sp are not planned.
        forced, forced_source: a given plan and where it came from (``"forced"``, ``"checkpoint"``).
        never: dimensions never searched for this front door (Fabric: ``{"pp"}``).
        runner: who runs the processes, for messages (``"the Trainer"``, ``"Fabric"``).
        warn: rank-zero warning function.
        head_in_root: the untied embedding and lm_head in the FSDP2 root unit (``True``: Fabric, whose loss
            reads ``lm_head.weight`` outside the module); ``None`` decides by the module's
            ``LinearCrossEntropy`` (:func:`~lightning_memplan.parallel.decision.decide`).
        read_batch: returns one batch of the run (its structure, for the calibrated check's traced
            steps; read only when a plan is checked), or ``None`` (no calibrated check).

    Raises:
        BatchShapeUnknown: no batch shape and no forced plan.
        ValueError: a forced plan for another world size, or nothing fits (``PlanDoesNotFitError``).
    """
    model_spec = model_spec_for(module, layout)
    train, batch_known = _run_train(read_train, forced, precision, warn)
    calibrated = None
    if options.calibrate and read_batch is not None and batch_known and not self_parallel:
        from lightning_memplan.parallel.calibrated import CalibratedEstimator

        calibrated = CalibratedEstimator(module, model_spec, read_batch).estimate
    return decide(
        model_spec=model_spec,
        train=train,
        world_size=devices * num_nodes,
        layout=layout,
        module=module,
        self_parallel=self_parallel,
        forced=forced,
        forced_source=forced_source,
        batch_known=batch_known,
        planner=_planner(options, model_spec, train, module, layout, devices=devices, num_nodes=num_nodes,
                         excluded=_excluded(never, self_parallel, layout)),
        runner=runner,
        head_in_root=head_in_root,
        calibrated=calibrated,
    )


def _run_train(
    read_train: Callable[[], TrainSpec], forced: ParallelPlan | None, precision: str, warn: Callable[[str], None]
) -> tuple[TrainSpec, bool]:
    """The run's TrainSpec and whether its batch shape is known (a forced plan plans without it)."""
    try:
        return read_train(), True
    except BatchShapeUnknown:
        if forced is None:
            raise
        # A given plan needs no search; the shape only feeds its estimate, which is then rough.
        warn("memplan_auto: batch shape unknown before setup; the forced plan's estimate assumes b=1, s=1")
        return TrainSpec(micro_batch=1, seq_len=1, precision=precision), False


def _excluded(never: frozenset[str], self_parallel: bool, layout: TransformerLayout | None) -> set[str]:
    """Dimensions never planned: what a self-parallelising module decides itself, SP where the layout
    cannot take it, and what this front door does not run (the rest is found by ``decide`` and re-planned
    without)."""
    excluded = set(never) | ({"pp", "sp"} if self_parallel else set())
    if layout is None or layout.sp_blocker is not None:
        excluded.add("sp")
    return excluded


def _planner(
    options: PlanningOptions, model_spec: Any, train: TrainSpec, module: nn.Module, layout: TransformerLayout | None,
    *, devices: int, num_nodes: int, excluded: set[str],
) -> Callable[[dict[str, str]], Any]:
    """``blocked -> PlanDecision``: :func:`~lightning_memplan.parallel.planner_bridge.run_planner` over what
    this front door and module can apply."""
    from lightning_memplan.parallel.planner_bridge import run_planner
    from lightning_memplan.parallel.tensor_parallel import find_linear_cross_entropy

    has_lce = bool(find_linear_cross_entropy(module))

    def planner(blocked: dict[str, str]) -> Any:
        return run_planner(
            model_spec, train, hardware=options.hardware, devices=devices, num_nodes=num_nodes,
            memory_budget=options.memory_budget, headroom=options.headroom, allow=options.allow,
            exclude=excluded | set(blocked), has_lce=has_lce,
        )

    return planner


def rendezvous(what: str, global_rank: int, world_size: int) -> RankRendezvous | None:
    """Every rank checks in with a bounded wait (parallel/stall.py): a rank that hangs makes every
    rank fail within ``MEMPLAN_STALL_TIMEOUT_S``, naming it, instead of waiting out the collective
    timeout (30 minutes by default). ``None`` on one process."""
    if not (torch.distributed.is_initialized() and world_size > 1):
        return None
    meeting = RankRendezvous(what, global_rank, world_size)
    meeting.arrive()
    return meeting


def resolve_on_rank_zero(compute: Callable[[], Resolution], *, global_rank: int, world_size: int) -> Resolution:
    """``compute()`` on rank 0, broadcast to every rank; an error on rank 0 is raised on every rank.

    Every rank calls this at the same point (it enters a rendezvous and a broadcast).
    """
    payload: list[Any] = [None]
    distributed = torch.distributed.is_initialized() and world_size > 1
    meeting = rendezvous("plan agreement", global_rank, world_size)
    if global_rank == 0:
        try:
            payload[0] = ("ok", compute())
        except Exception as exc:  # noqa: BLE001 - sent to every rank, re-raised everywhere
            payload[0] = ("error", exc if _picklable(exc) else f"{type(exc).__name__}: {exc}")
            if world_size == 1:
                raise
        if meeting is not None:
            meeting.publish()
    elif meeting is not None:
        meeting.await_rank_zero()
    if distributed:
        torch.distributed.broadcast_object_list(payload, src=0)
    status, value = payload[0]
    if status == "error":
        if isinstance(value, BaseException):
            raise value
        raise ValueError(f"memplan_auto could not plan (on rank 0): {value}")
    return value


def check_agreement(resolution: Resolution, module: nn.Module, world_size: int, *, what: str) -> None:
    """All-gather a fingerprint of plan and parameter shapes; raise on every rank if they differ.

    Args:
        what: what every rank must build alike, for the message (``"the same LightningModule (...) before fit"``).

    Raises:
        RuntimeError: naming the groups of ranks that agree with each other.
    """
    signature = [(n, tuple(p.shape)) for n, p in module.named_parameters()]
    digest = hashlib.sha256((resolution.fingerprint() + repr(signature)).encode()).hexdigest()
    if not (torch.distributed.is_initialized() and world_size > 1):
        return
    digests: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(digests, digest)
    if len(set(digests)) > 1:
        groups: dict[str, list[int]] = {}
        for rank, d in enumerate(digests):
            groups.setdefault(d, []).append(rank)
        raise RuntimeError(
            "memplan_auto: ranks disagree on the plan or the model "
            f"(ranks grouped by fingerprint: {sorted(groups.values())}); every rank must build {what}"
        )


def plan_on_every_rank(
    compute: Callable[[], Resolution],
    *,
    module: nn.Module,
    global_rank: int,
    world_size: int,
    device_type: str,
    what: str,
    warn: Callable[[str], None],
    info: Callable[[str], None],
) -> tuple[Resolution, DeviceMesh]:
    """The planning step of both front doors, on every rank at the same point (it enters collectives).

    Rank 0 runs ``compute`` and broadcasts the result (:func:`resolve_on_rank_zero`); every rank warns its
    notes, builds the ``pp x dp_replicate x dp_shard x tp`` mesh, checks that every rank planned the same
    model (:func:`check_agreement`) and logs the explanation.

    Args:
        compute: rank 0's planning (a call of :func:`resolve` with the front door's inputs).
        module: the module planned for (its parameter shapes enter the agreement check).
        global_rank, world_size: this process's rank and the number of processes.
        device_type: the mesh's device type (``"cpu"``, ``"cuda"``).
        what: what every rank must build alike, for the disagreement message.
        warn, info: rank-zero warning and info functions.

    Returns:
        The resolution and the device mesh built from it.
    """
    resolution = resolve_on_rank_zero(compute, global_rank=global_rank, world_size=world_size)
    for note in resolution.notes:
        warn(f"memplan_auto: {note}")
    mesh = build_device_mesh(resolution.mesh, device_type)
    check_agreement(resolution, module, world_size, what=what)
    info(explain(resolution))
    return resolution, mesh


def _picklable(exc: BaseException) -> bool:
    """Whether an exception survives ``broadcast_object_list`` (pickle needs its ``args`` to rebuild it)."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))  # trusted: round-trips an exception object of this process, no file
    except Exception:  # noqa: BLE001
        return False
    return True
