"""``estimate_checkpoint_memory``: the memory a checkpoint save takes on one rank, on the device and on the host.

A save builds a state dict (the model's and each optimizer's), then writes it. What is materialised where
depends on the layout and on how the strategy asks for the state dict; every fact below is read from
torch 2.13 / Lightning 2.6 (file, function):

**Plain (DDP, one device; no DTensor parameters).** ``Strategy.lightning_module_state_dict`` is
``module.state_dict()`` and ``Strategy.optimizer_state`` is ``optimizer.state_dict()``: both reference the
live tensors, nothing is copied on the device. Only global rank 0 writes (``Strategy.save_checkpoint``,
``if self.is_global_zero``), through ``TorchCheckpointIO`` -> ``lightning/fabric/utilities/cloud_io.py``
``_atomic_save``: ``torch.save(checkpoint, io.BytesIO())`` then ``f.write(bytesbuffer.getvalue())``, two
host buffers of the serialised size S. ``torch/serialization.py`` ``_save`` copies each device storage
to the host one at a time (``storage.cpu()``) before ``zip_file.write_record``: one largest tensor on
the host in flight (nothing when the tensors already live on the CPU).

**Full state dict** (``ModelParallelStrategy(save_distributed_checkpoint=False)``; Lightning asks for
``StateDictOptions(full_state_dict=True, cpu_offload=True)`` in ``lightning/pytorch/strategies/
model_parallel.py`` ``lightning_module_state_dict`` / ``optimizer_state``; Fabric's ``_get_full_state_dict``
the same). ``torch/distributed/checkpoint/state_dict.py`` ``_maybe_full_or_cpu_state_dict`` calls
``_state_dict_utils._gather_state_dict`` with ``ranks_only=(0,)`` when ``cpu_offload`` (``()`` without it):
for each DTensor, one at a time, ``redistribute`` to ``Replicate()`` (an all-gather into a full tensor on
the device, on *every* rank), then on a rank in ``ranks_only`` ``ret.to("cpu")`` keeps a host copy and
the device copy is dropped; other ranks drop it (``_iterate_state_dict``). So: device, one largest full
tensor in flight on every rank; host, rank 0 holds the whole stage's full parameters and optimizer
states F, then writes them with ``_atomic_save`` (2 F more). Without ``cpu_offload`` every rank keeps F on
the device.

**Sharded** (``save_distributed_checkpoint=True``, the default): ``_maybe_full_or_cpu_state_dict`` with
``cpu_offload`` calls ``_offload_state_dict_to_cpu`` (``ret.to("cpu")`` of every local shard: a host copy
of the rank's shards, S_loc); then ``torch.distributed.checkpoint.save`` (Lightning
``_distributed_checkpoint_save``). Its ``FileSystemWriter`` (``filesystem.py`` ``_write_files_from_queue``)
moves each tensor to the host (``_SerialCpuLoader``/``_OverlappingCpuLoader``: ``tensor.cpu()``, a
``clone`` when the storage is larger than the tensor) and keeps every written tensor in ``tensor_dict``
until the file is closed: S_loc on the host either way. The save plans travel as pickled objects
(``distributed_c10d.gather_object``/``scatter_object_list``/``broadcast_object_list``, byte tensors on the
device under NCCL): :data:`DCP_PLAN_BYTES_PER_ITEM` bytes per written tensor (measured, see there).

**Both DCP modes** call ``get_optimizer_state_dict``, whose ``_init_optim_state`` runs a zero-lr step
when the optimizer holds no state yet: the states are created (and stay).

On a CPU run the device is the host: ``Tensor.to("cpu")`` of a CPU tensor returns the tensor itself
(no copy), so the host copies above are the gathered tensors themselves (full) or nothing (sharded).
What it predicts is what a tensor tracker sees (live tensor storages); the serialisation buffers are
host bytes outside any tensor (``io.BytesIO``) and are reported apart.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lightning_memplan.model.estimate import estimate_memory, stage_layout
from lightning_memplan.model.sizes import optimizer_bytes, precision_bytes
from lightning_memplan.model.specs import ModelSpec, ParallelPlan, TrainSpec
from lightning_memplan.model.stage_layout import stage_params
from lightning_memplan.validation import check_bool, check_choice, check_optional_int

__all__ = [
    "CHECKPOINT_MODES",
    "DCP_PLAN_BYTES_PER_ITEM",
    "CheckpointEstimate",
    "checkpoint_mode",
    "estimate_checkpoint_memory",
]

#: ``"plain"`` (state dicts reference the live tensors: DDP, one device), ``"full"`` (gathered to rank 0),
#: ``"sharded"`` (each rank writes its shards with ``torch.distributed.checkpoint``).
CHECKPOINT_MODES: tuple[str, ...] = ("plain", "full", "sharded")
#: Pickled save-plan bytes per written tensor of a ``torch.distributed.checkpoint`` save (the plans and the
#: global metadata exchanged by ``gather_object``/``scatter_object_list``/``broadcast_object_list``):
#: measured with the tensor tracker on torch 2.13, 2 gloo ranks, FSDP2 (277 bytes per item of the
#: broadcast metadata, 340 of the coordinator's gathered plans, for fully qualified names of ~30 characters).
DCP_PLAN_BYTES_PER_ITEM = 320
#: Host buffers of one serialised checkpoint in Lightning's ``_atomic_save``: the ``io.BytesIO`` and its
#: ``getvalue()`` copy.
ATOMIC_SAVE_BUFFERS = 2
#: Parameter tensors of a transformer block when the module is not there to count them (q, k, v, o and
#: two MLP matrices with their biases, two norms with weight and bias); the embedding, final norm and head add 4.
_DEFAULT_TENSORS_PER_LAYER = 16
_DEFAULT_TENSORS_OUTSIDE = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointEstimate:
    """Predicted memory of one checkpoint save on one rank (integer bytes).

    Attributes:
        mode: ``"plain"``, ``"full"`` or ``"sharded"`` (:data:`CHECKPOINT_MODES`).
        rank: the global rank estimated.
        resident: device bytes alive when the save starts (parameters, gradients if alive, optimizer
            states, master weights), plus optimizer states a DCP save creates (``_init_optim_state``).
        device: device bytes the save adds at its peak (gathered full tensors, plan buffers).
        host: host tensor bytes the state dict holds at the save's end (CPU copies; 0 on a CPU run).
        serialization: host bytes outside tensors (``io.BytesIO`` buffers of ``torch.save``).
        full_state_bytes: F, the stage's full parameters and optimizer states (what rank 0 gathers).
        largest_tensor: the largest full tensor in flight during a gather.
        state_tensors: tensors the state dicts hold on this rank (parameters and their optimizer states).
    """

    mode: str
    rank: int
    resident: int
    device: int
    host: int
    serialization: int
    full_state_bytes: int = 0
    largest_tensor: int = 0
    state_tensors: int = 0

    @property
    def device_peak(self) -> int:
        """Peak tensor bytes on the device during the save: ``resident + device``."""
        return self.resident + self.device

    @property
    def host_peak(self) -> int:
        """Peak host bytes the save adds: ``host + serialization``."""
        return self.host + self.serialization

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "device_peak": self.device_peak, "host_peak": self.host_peak}


def checkpoint_mode(plan: ParallelPlan, *, full_state_dict: bool) -> str:
    """``"plain"`` when no parameter is a DTensor (no ZeRO-3 / FSDP2 sharding, no tensor parallelism),
    else ``"full"`` or ``"sharded"`` as ``full_state_dict`` says."""
    if plan.zero < 3 and plan.tp == 1:
        return "plain"
    return "full" if full_state_dict else "sharded"


def estimate_checkpoint_memory(
    model: ModelSpec,
    train: TrainSpec,
    plan: ParallelPlan | None = None,
    *,
    full_state_dict: bool,
    cpu_offload: bool,
    rank: int | None = None,
    device: str = "cuda",
    grads_alive: bool = True,
    optimizer_states: bool = True,
    param_tensors: int | None = None,
) -> CheckpointEstimate:
    """Predicted device and host bytes of one checkpoint save (module docstring for the sources).

    Args:
        model, train, plan: the run, as for :func:`~lightning_memplan.model.estimate.estimate_memory`.
        full_state_dict: the state dict is gathered to full tensors (``save_distributed_checkpoint=False``);
            ignored for a plan without DTensor parameters (``"plain"`` mode).
        cpu_offload: the state dict is moved to the host (Lightning's ``ModelParallelStrategy`` always
            asks for it; with ``full_state_dict`` it also limits the gathered copy to rank 0).
        rank: a global rank; ``None`` is the worst rank (rank 0 for a full or plain save).
        device: ``"cuda"`` (or any accelerator) or ``"cpu"``: on the CPU a host copy is no copy.
        grads_alive: the last step's gradients exist during the save.
        optimizer_states: the optimizer holds its states (after the first optimizer step).
        param_tensors: parameter tensors of the stage's module (``len(list(module.parameters()))``);
            ``None`` assumes a transformer block's 16 per layer plus 4.

    Returns:
        :class:`CheckpointEstimate`.

    Raises:
        ValueError: ``rank`` outside the plan, an unknown ``device``, ``param_tensors`` < 1.
        TypeError: an argument of the wrong type.
    """
    plan, flags, rank, param_tensors = _checked(model, train, plan, full_state_dict=full_state_dict,
                                                cpu_offload=cpu_offload, rank=rank, device=device,
                                                grads_alive=grads_alive, optimizer_states=optimizer_states,
                                                param_tensors=param_tensors)
    full_state_dict, cpu_offload, grads_alive, optimizer_states = flags
    mode = checkpoint_mode(plan, full_state_dict=full_state_dict)
    if rank is None:
        rank = 0  # rank 0 gathers (full) or writes (plain); sharded ranks differ only by the plan buffers
    training = estimate_memory(dataclasses.replace(model, calibration_source=None) if model.calibration_source else model,
                               train, plan, rank=rank)
    kept = training.by_phase["optimizer"]
    creates_states = mode != "plain" and not optimizer_states
    has_states = optimizer_states or creates_states
    resident = kept["params"] + kept["master"] + (kept["grads"] if grads_alive else 0)
    resident += kept["optimizer"] if has_states else 0
    local_state = kept["params"] + kept["master"] + (kept["optimizer"] if has_states else 0)

    pb = precision_bytes(train)
    state_per_param = optimizer_bytes(train).per_param
    layout = stage_layout(model, plan, training.stage, train.framework)
    full = stage_params(model, 1, plan.pp > 1, layout)
    full_params, largest = full.local, full.largest
    full_state = full_params * pb.param + (round(full_params * state_per_param) if has_states else 0)
    largest_bytes = largest * max(pb.param, pb.state if (has_states and state_per_param) else 0)
    n_param_tensors = param_tensors or (_DEFAULT_TENSORS_PER_LAYER * layout.n_layers + _DEFAULT_TENSORS_OUTSIDE)
    states_per_tensor = _optimizer_tensors_per_param(train) if has_states else 0
    n_tensors = n_param_tensors * (1 + states_per_tensor)
    device_extra, host, serialization = _save_bytes(
        mode, plan, rank=rank, cpu_offload=cpu_offload, on_cpu=device == "cpu", local_state=local_state,
        full_state=full_state, largest_bytes=largest_bytes, largest_param_bytes=largest * pb.param, n_tensors=n_tensors)
    return CheckpointEstimate(
        mode=mode, rank=rank, resident=resident, device=device_extra, host=host, serialization=serialization,
        full_state_bytes=full_state, largest_tensor=largest_bytes, state_tensors=n_tensors,
    )


def _checked(model: Any, train: Any, plan: Any, *, full_state_dict: Any, cpu_offload: Any, rank: Any, device: Any,
             grads_alive: Any, optimizer_states: Any, param_tensors: Any) -> tuple[ParallelPlan, tuple[bool, bool, bool, bool],
                                                                                    int | None, int | None]:
    """The arguments of :func:`estimate_checkpoint_memory`, checked: ``(plan, (full_state_dict, cpu_offload,
    grads_alive, optimizer_states), rank, param_tensors)``."""
    if not isinstance(model, ModelSpec):
        raise TypeError(f"model={model!r} must be a ModelSpec")
    if not isinstance(train, TrainSpec):
        raise TypeError(f"train={train!r} must be a TrainSpec")
    plan = plan if plan is not None else ParallelPlan()
    if not isinstance(plan, ParallelPlan):
        raise TypeError(f"plan={plan!r} must be a ParallelPlan (or None for one device)")
    flags = (
        check_bool("full_state_dict", full_state_dict, hint="True for save_distributed_checkpoint=False"),
        check_bool("cpu_offload", cpu_offload, hint="Lightning's ModelParallelStrategy uses cpu_offload=True"),
        check_bool("grads_alive", grads_alive),
        check_bool("optimizer_states", optimizer_states),
    )
    check_choice("device", device, ("cuda", "cpu", "mps", "xpu"), hint="the device type the model lives on")
    rank = check_optional_int("rank", rank, minimum=0, maximum=plan.world_size - 1,
                              hint=f"a global rank of this plan's {plan.world_size} ranks, or None for the worst one")
    param_tensors = check_optional_int("param_tensors", param_tensors,
                                       hint="len(list(module.parameters())), e.g. param_tensors=148")
    return plan, flags, rank, param_tensors


def _save_bytes(mode: str, plan: ParallelPlan, *, rank: int, cpu_offload: bool, on_cpu: bool, local_state: int,
                full_state: int, largest_bytes: int, largest_param_bytes: int, n_tensors: int) -> tuple[int, int, int]:
    """``(device bytes added, host tensor bytes, serialization bytes)`` of one rank's save in ``mode``."""
    device_extra = host = serialization = 0
    if mode == "plain":
        if rank == 0:
            serialization = ATOMIC_SAVE_BUFFERS * local_state
            host = 0 if on_cpu else largest_param_bytes  # torch.save's storage.cpu(), one at a time
    elif mode == "full":
        keeps = rank == 0 or not cpu_offload  # ranks_only=(0,) with cpu_offload, every rank without
        if not cpu_offload or on_cpu:
            device_extra = full_state if keeps else largest_bytes
        else:
            device_extra = largest_bytes
            host = full_state if keeps else 0
        if rank == 0:
            serialization = ATOMIC_SAVE_BUFFERS * full_state
    else:  # sharded
        device_extra = DCP_PLAN_BYTES_PER_ITEM * n_tensors * plan.world_size // max(1, plan.pp)
        host = 0 if on_cpu else local_state
    return device_extra, host, serialization


def _optimizer_tensors_per_param(train: TrainSpec) -> int:
    """Optimizer state tensors per parameter: Adam/AdamW ``exp_avg``, ``exp_avg_sq`` and ``step``
    (``torch/optim/adam.py`` ``_init_group``); SGD with momentum and Lion one buffer; plain SGD none."""
    return {"adamw": 3, "adam": 3, "adamw8bit": 3, "sgd": 0, "sgd_momentum": 1, "lion": 1, "adafactor": 3}.get(
        train.optimizer, 2
    )
