"""Mesh axes and sizes: how a :class:`~lightning_memplan.model.specs.ParallelPlan` becomes a DeviceMesh.

The mesh is ``pp x dp_replicate x dp_shard x tp`` (torchtitan's ``ParallelDims`` order, tensor parallel
fastest so a TP group is made of neighbouring ranks, i.e. the GPUs of one node). Two flattened aliases
are added for code written for Lightning's ``ModelParallelStrategy``: ``"data_parallel"``
(``dp_replicate x dp_shard``) and ``"tensor_parallel"`` (``tp``), so a ``configure_model`` that indexes
``self.device_mesh["data_parallel"]`` keeps working under ``memplan_auto``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10

    class StrEnum(str, Enum):
        def __str__(self) -> str:
            return str(self.value)


if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_memplan.model.specs import ParallelPlan

__all__ = [
    "CP_NOT_APPLIED",
    "LIGHTNING_DP_ALIAS",
    "LIGHTNING_TP_ALIAS",
    "MeshAxis",
    "MeshLayout",
    "alias_mesh",
    "build_device_mesh",
]

#: Why a plan's context parallelism is not applied (checked by tests/distributed/test_context_parallel.py).
#: PyTorch's ring attention (``torch.distributed.tensor.experimental.context_parallel``) dispatches only
#: the CUDA SDPA kernels (flash, memory-efficient, cuDNN: ``_context_parallel/_attention.py``); on CPU
#: it raises ``NotImplementedError`` for ``aten._scaled_dot_product_flash_attention_for_cpu``.
CP_NOT_APPLIED = (
    "PyTorch's context_parallel ring attention has no rule for the CPU SDPA kernel "
    "(aten._scaled_dot_product_flash_attention_for_cpu), and memplan_auto does not shard the sequence "
    "buffers for it on CUDA either (not validated on a GPU)"
)

#: Flattened mesh names that Lightning's ``ModelParallelStrategy`` exposes to ``configure_model``.
LIGHTNING_DP_ALIAS = "data_parallel"
LIGHTNING_TP_ALIAS = "tensor_parallel"


class MeshAxis(StrEnum):
    """Names of the mesh dimensions, outermost first."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    TP = "tp"


@dataclass(frozen=True, kw_only=True)
class MeshLayout:
    """Sizes of the four mesh axes and how data parallelism shards state.

    Args:
        pp: pipeline stages.
        dp_replicate: replicas that hold full copies of their (TP/PP-local) state and all-reduce
            gradients (DDP semantics; the replicate dim of HSDP).
        dp_shard: ranks that shard parameters, gradients and optimizer states (FSDP2 ``fully_shard``).
        tp: tensor-parallel width.
        reshard_after_forward: FSDP2 frees the gathered parameters after forward (ZeRO-3) when
            ``True``; keeps them until backward (ZeRO-2, ``SHARD_GRAD_OP``) when ``False``; an int
            ``n`` (a non-trivial divisor of ``dp_shard``) keeps them sharded over ``n`` ranks until
            backward (``ParallelPlan.reshard_after_forward``).
        notes: why the layout differs from the plan it came from (shown to the user).
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    reshard_after_forward: bool | int = True
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("pp", "dp_replicate", "dp_shard", "tp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int (a mesh dimension size)")

    @property
    def dp(self) -> int:
        """Data-parallel ranks (replicate x shard): how many different micro-batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    @classmethod
    def from_plan(cls, plan: ParallelPlan) -> MeshLayout:
        """Map a plan's (dp, tp, pp, cp, zero) onto mesh sizes.

        ``zero=0`` -> all DP ranks replicate (DDP); ``zero=3`` -> all shard with resharding after
        forward (FSDP ``FULL_SHARD``); ``zero=2`` -> shard, keep parameters gathered until backward
        (``SHARD_GRAD_OP``); an explicit ``plan.reshard_after_forward`` (an int: a smaller world after
        forward) is passed through as it is; ``zero=1`` has no FSDP2 form, so it is applied as ``zero=2`` (it shards
        gradients too, so it never uses more memory than planned). Context parallelism is planner-only:
        its ranks become data-parallel ranks (same world size), with :data:`CP_NOT_APPLIED` as the note.
        """
        notes: list[str] = []
        dp = plan.dp
        if plan.cp > 1:
            dp *= plan.cp
            notes.append(f"cp={plan.cp} is planner-only: {CP_NOT_APPLIED}; its ranks are used as data-parallel ranks instead (dp={dp})")
        if plan.zero == 1 and dp > 1:
            notes.append(
                "zero=1 (optimizer states only) has no FSDP2 form; applied as zero=2 (gradients sharded too), "
                "which uses no more memory than planned"
            )
        if dp == 1 or plan.zero == 0:
            return cls(pp=plan.pp, dp_replicate=dp, dp_shard=1, tp=plan.tp, notes=tuple(notes))
        return cls(
            pp=plan.pp,
            dp_replicate=1,
            dp_shard=dp,
            tp=plan.tp,
            reshard_after_forward=plan.zero == 3 if plan.reshard_after_forward is None else plan.reshard_after_forward,
            notes=tuple(notes),
        )


def build_device_mesh(layout: MeshLayout, device_type: str) -> DeviceMesh:
    """``init_device_mesh`` over the four axes plus the Lightning-compatible flattened aliases.

    Every rank must call this with the same layout (it creates process groups collectively).
    """
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(str(axis) for axis in MeshAxis)
    mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=names)
    for alias in _ALIAS_DIMS:
        alias_mesh(mesh, alias)
    return mesh


#: The mesh dimensions each Lightning-compatible alias flattens.
_ALIAS_DIMS: dict[str, tuple[str, ...]] = {
    LIGHTNING_DP_ALIAS: (str(MeshAxis.DP_REPLICATE), str(MeshAxis.DP_SHARD)),
    LIGHTNING_TP_ALIAS: (str(MeshAxis.TP),),
}


def alias_mesh(mesh: DeviceMesh, alias: str) -> DeviceMesh:
    """The 1-D flattened mesh named ``alias`` (``"data_parallel"`` or ``"tensor_parallel"``).

    Slicing a flattened name from the root mesh (``mesh["data_parallel"]``) is deprecated since PyTorch
    2.11 ("Users need to bookkeep the flattened mesh directly", ``DeviceMesh.__getitem__``); flattening
    the underlying dimensions again returns the mesh made by the first ``_flatten`` (it is cached in the
    root's flatten mapping, no new process group), without the warning.
    """
    try:
        dims = _ALIAS_DIMS[alias]
    except KeyError:
        raise ValueError(f"alias={alias!r} is not a memplan_auto mesh alias; use one of {sorted(_ALIAS_DIMS)}") from None
    sub = mesh[dims] if len(dims) > 1 else mesh[dims[0]]
    return sub._flatten(alias)
