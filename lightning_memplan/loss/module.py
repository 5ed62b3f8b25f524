"""``LinearCrossEntropy``: the ``nn.Module`` form of :func:`linear_cross_entropy` (a function and a module,
as Liger-Kernel pairs ``transformers/functional.py`` with its modules).

The module holds no parameters: the lm_head weight is passed to ``forward`` so that tied embeddings,
FSDP2-unsharded and ``ColwiseParallel``-sharded weights all work unchanged. A memory planner or the
``memplan_auto`` strategy switches it between modes with :meth:`LinearCrossEntropy.configure`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
from torch import nn

from lightning_memplan.loss.functional import loss_with_options
from lightning_memplan.loss.metrics import LossMetrics
from lightning_memplan.loss.options import LossOptions
from lightning_memplan.validation import check_bool

__all__ = ["LinearCrossEntropy"]

_UNSET: Any = object()


class LinearCrossEntropy(nn.Module):
    r"""Cross-entropy of ``hidden @ weight.T (+ bias)`` without materialising [B, S, V] logits.

    Computes ``F.cross_entropy(F.linear(hidden, weight, bias).float(), target)`` (plus optional
    z-loss and logit softcap) over token chunks, and over vocabulary shards when the weight is a
    DTensor sharded ``Shard(0)`` (``ColwiseParallel`` lm_head) or a ``process_group`` is set. At most
    a [chunk, V/t] slice of logits exists in forward and backward; gradients are exact for any
    incoming ``grad_output`` (gradient accumulation, GradScaler, ``manual_backward``).

    Args:
        ignore_index: target id that is skipped. Default ``-100``.
        reduction: ``"mean"`` (over non-ignored tokens; 0 when there are none), ``"sum"`` or ``"none"``.
        label_smoothing: ε in [0, 1), ``F.cross_entropy`` convention, global vocabulary.
        z_loss: λ ≥ 0, adds λ·lse² per token (PaLM).
        softcap: c > 0 or None, logits ← c·tanh(logits / c) (Gemma 2).
        shift: predict ``target[:, 1:]`` from ``hidden[:, :-1]``.
        chunk_size: tokens per chunk or ``"auto"``.
        process_group: tensor-parallel group for a plain local vocab slice of the weight.
        return_metrics: ``forward`` returns ``(loss, LossMetrics)``.
        mode: ``"auto"``, ``"chunked"``, ``"vocab_parallel"``, ``"fp32_upcast"`` or ``"naive"``.
        backend: ``"auto"``, ``"memplan"`` or ``"torch"``.
        validate_targets: raise on out-of-range target ids (one host sync per call).
        sequence_parallel: plain ``hidden`` is this rank's sequence slice.
        chunk_budget_bytes: byte budget for ``chunk_size="auto"``.
        accum_dtype: weight-gradient accumulator dtype. Default fp32.
        allow_retain_graph: allow a second backward through one graph (costs a [V, h] buffer).

    Shape:
        - hidden: :math:`(B, S, h)` or :math:`(N, h)`
        - weight: :math:`(V, h)` (local :math:`(V_r, h)` slice with ``process_group``)
        - target: :math:`(B, S)` or :math:`(N)`, int64
        - output: scalar for ``"mean"``/``"sum"``; :math:`(B, S)` / :math:`(N)` for ``"none"``
          (:math:`(B, S-1)` with ``shift=True``)

    Example::

        loss_fn = LinearCrossEntropy(shift=True, z_loss=1e-4)
        loss = loss_fn(model(idx), model.lm_head.weight, idx)

    Strategy hook: ``loss_fn.configure(mode="vocab_parallel", chunk_size=2048, process_group=tp_group)``
    or plain attribute assignment (``loss_fn.chunk_size = 2048``); both validate immediately.
    """

    def __init__(
        self,
        *,
        process_group: Any = None,
        return_metrics: bool = False,
        **options: Any,
    ) -> None:
        super().__init__()
        bad = set(options) - {f.name for f in dataclasses.fields(LossOptions)}
        if bad:
            allowed = sorted(f.name for f in dataclasses.fields(LossOptions))
            raise TypeError(f"LinearCrossEntropy got unknown options {sorted(bad)}; allowed: {allowed}")
        return_metrics = check_bool("return_metrics", return_metrics, hint="True makes forward return (loss, LossMetrics)")
        object.__setattr__(self, "_options", LossOptions(**options))
        self.process_group = process_group
        self.return_metrics = return_metrics

    @property
    def options(self) -> LossOptions:
        """The current (frozen, validated) :class:`LossOptions`."""
        return self._options

    def __getattr__(self, name: str) -> Any:
        options = self.__dict__.get("_options")
        if options is not None and name in LossOptions.__dataclass_fields__:
            return getattr(options, name)
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        options = self.__dict__.get("_options")
        if options is not None and name in LossOptions.__dataclass_fields__:
            object.__setattr__(self, "_options", dataclasses.replace(options, **{name: value}))
            return
        super().__setattr__(name, value)

    def configure(
        self,
        *,
        mode: str | None = None,
        chunk_size: int | str | None = None,
        process_group: Any = _UNSET,
        **options: Any,
    ) -> LinearCrossEntropy:
        """Switch mode / chunk size / process group (and any other option); returns ``self``.

        Validated at once (``ValueError``/``TypeError`` naming the option). ``process_group=None``
        clears a previously set group.
        """
        changes = dict(options)
        if mode is not None:
            changes["mode"] = mode
        if chunk_size is not None:
            changes["chunk_size"] = chunk_size
        bad = set(changes) - set(LossOptions.__dataclass_fields__)
        if bad:
            raise TypeError(f"configure() got unknown options {sorted(bad)}")
        object.__setattr__(self, "_options", dataclasses.replace(self._options, **changes))
        if process_group is not _UNSET:
            self.process_group = process_group
        return self

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, LossMetrics]:
        """Loss of ``hidden @ weight.T (+ bias)`` against ``target`` (see the class docstring)."""
        loss, metrics = loss_with_options(
            hidden,
            weight,
            target,
            bias=bias,
            options=self._options,
            process_group=self.process_group,
            return_metrics=self.return_metrics,
        )
        return (loss, cast(LossMetrics, metrics)) if self.return_metrics else loss

    def extra_repr(self) -> str:
        defaults = LossOptions()
        parts = [
            f"{f.name}={getattr(self._options, f.name)!r}"
            for f in dataclasses.fields(LossOptions)
            if getattr(self._options, f.name) != getattr(defaults, f.name) or f.name in ("mode", "reduction")
        ]
        if self.process_group is not None:
            parts.append("process_group=set")
        if self.return_metrics:
            parts.append("return_metrics=True")
        return ", ".join(parts)
