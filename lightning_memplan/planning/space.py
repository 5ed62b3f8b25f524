"""The search space: which layouts and options the planner may use (:class:`Allow`), and the
enumeration of the layouts ``dp x tp x pp x cp = world`` with their micro-batch and schedule, each
rejected early, with a reason, when a divisibility rule forbids it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from lightning_memplan.model.frameworks import pipeline_units
from lightning_memplan.model.runnable import pipeline_schedule_blocker
from lightning_memplan.model.specs import (
    LOSS_MODES,
    MAX_PIPELINE_CHUNKS,
    RECOMPUTE_MODES,
    SCHEDULES,
    ModelSpec,
    TrainSpec,
)
from lightning_memplan.validation import MAX_DIVISOR_SEARCH, MAX_WORLD_SIZE, plain_scalar
from lightning_memplan.validation import divisors as _divisors

__all__ = [
    "ALLOW_NAMES",
    "MAX_MICRO_BATCH",
    "OFFLOAD_CHOICES",
    "MAX_VIRTUAL_STAGES",
    "Allow",
    "Layout",
    "LayoutChoice",
    "divisors",
    "enumerate_layouts",
]

#: Largest micro-batch the planner tries on its own (the user's own value is always tried too).
MAX_MICRO_BATCH = 64
#: Largest number of model chunks per pipeline rank tried for the interleaved schedule.
MAX_VIRTUAL_STAGES = 8

#: Offloads to host memory the planner may use when nothing fits on the devices (``Allow.offload``;
#: ``planning/offload.py``): FSDP2's CPUOffloadPolicy (``"params"``), activation offloading
#: (``"activations"``), both, or none.
OFFLOAD_CHOICES = ("none", "activations", "params", "params+activations")

#: Names accepted by the sequence form of ``allow`` and what each permits.
ALLOW_NAMES: dict[str, str] = {
    "dp": "data parallelism (replicas, zero=0)",
    "ddp": "same as 'dp'",
    "zero1": "ZeRO-1: optimizer states sharded over dp",
    "zero2": "ZeRO-2 / FSDP SHARD_GRAD_OP: + gradients",
    "zero3": "ZeRO-3 / FSDP FULL_SHARD: + parameters",
    "zero": "any ZeRO stage 1-3",
    "fsdp": "FSDP: zero 2 (SHARD_GRAD_OP) and 3 (FULL_SHARD)",
    "tp": "tensor parallelism (with or without sequence parallelism)",
    "sp": "same as 'tp' (sequence parallelism rides on tensor parallelism)",
    "pp": "pipeline parallelism with every schedule",
    "cp": "context parallelism",
}


def divisors(n: int) -> list[int]:
    """Divisors of n in increasing order (:func:`lightning_memplan.validation.divisors`: at most
    ``sqrt(n)`` trial divisions, so a world of :data:`~lightning_memplan.validation.MAX_WORLD_SIZE` costs
    ~4,000).

    Raises:
        ValueError: ``n`` above ``MAX_DIVISOR_SEARCH**2`` (10^10), too large to factor in bounded time.
    """
    found = _divisors(n)
    if found is None:
        raise ValueError(
            f"n={n!r} is too large to list its divisors in bounded time (above {MAX_DIVISOR_SEARCH}**2); "
            f"a world size is at most MAX_WORLD_SIZE={MAX_WORLD_SIZE}"
        )
    return found


def _tuple(name: str, value: Any, kind: type | tuple[type, ...], choices: Iterable[Any] | None = None) -> tuple[Any, ...]:
    scalar = plain_scalar(value)
    if isinstance(scalar, (str, int, bool, float)) or not isinstance(value, Iterable):
        values: tuple[Any, ...] = (scalar,)
    else:
        values = tuple(value)
    if not values:
        raise ValueError(f"allow[{name!r}]={value!r} is empty; give at least one allowed value")
    values = tuple(plain_scalar(v) for v in values)  # np.int64(2) -> 2, np.bool_ -> bool, 0-d tensors too
    for v in values:
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise TypeError(f"allow[{name!r}] contains {v!r}; expected {kind}")
        if choices is not None and v not in choices:
            raise ValueError(f"allow[{name!r}] contains {v!r}; use values from {sorted(choices, key=str)}")
        if kind is int and isinstance(v, int) and v < (0 if name == "zero" else 1):
            raise ValueError(f"allow[{name!r}] contains {v!r}; sizes must be >= 1")
    return values


@dataclass(frozen=True, kw_only=True)
class Allow:
    """What the planner may choose. ``None`` for a field means "anything valid".

    ``plan(allow=...)`` accepts three forms:

    - a sequence of names from :data:`ALLOW_NAMES`, e.g. ``("dp", "fsdp", "tp", "pp")``: only these
      parallelisms; an axis not named stays at 1 (no ``"dp"``/zero name: dp = 1), ZeRO stages are
      those named. Recompute, loss mode and micro-batch stay searchable.
    - a mapping from the field names below to allowed values, e.g.
      ``{"tp": [1, 2, 4, 8], "zero": [0, 3], "recompute": ["none", "full"], "micro_batch": [1]}``;
      fields not given stay unrestricted.
    - an :class:`Allow`.

    Args:
        dp, tp, pp, cp: allowed sizes per axis.
        zero: allowed ZeRO stages (0-3).
        sp: allowed sequence-parallel settings (``(False, True)``).
        schedule: allowed pipeline schedules.
        virtual_stages: allowed chunks per pipeline rank for ``"interleaved"``.
        recompute: allowed recompute modes.
        loss: allowed loss modes; ``None`` = the user's mode, ``"chunked"`` and ``"vocab_parallel"``.
        micro_batch: allowed micro-batch sizes; ``None`` = the user's value and powers of two up to
            :data:`MAX_MICRO_BATCH` that divide the per-replica batch.
        offload: offloads to host memory tried, in this order, only when no layout fits on the devices
            (:data:`OFFLOAD_CHOICES`; ``("none",)`` never offloads; the sequence form keeps them all).
    """

    dp: tuple[int, ...] | None = None
    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    zero: tuple[int, ...] = (0, 1, 2, 3)
    sp: tuple[bool, ...] = (False, True)
    schedule: tuple[str, ...] = SCHEDULES
    virtual_stages: tuple[int, ...] | None = None
    recompute: tuple[str, ...] = RECOMPUTE_MODES
    loss: tuple[str, ...] | None = None
    micro_batch: tuple[int, ...] | None = None
    offload: tuple[str, ...] = OFFLOAD_CHOICES

    @classmethod
    def parse(cls, allow: Any) -> Allow:
        """Normalise the ``allow=`` argument of :func:`~lightning_memplan.planning.plan`."""
        if allow is None:
            return cls()
        if isinstance(allow, Allow):
            return allow
        if isinstance(allow, Mapping):
            return cls._from_mapping(allow)
        if isinstance(allow, str):
            allow = [a for a in allow.replace(";", ",").split(",") if a.strip()]
        if isinstance(allow, Sequence):
            return cls._from_names([str(a).strip().lower() for a in allow])
        raise TypeError(
            f"allow={allow!r} must be None, a sequence of names such as ('dp', 'fsdp', 'tp', 'pp'), a dict "
            f"such as {{'tp': [1, 2, 4, 8]}}, or an Allow"
        )

    @classmethod
    def _from_names(cls, names: list[str]) -> Allow:
        unknown = [n for n in names if n not in ALLOW_NAMES]
        if unknown:
            raise ValueError(
                f"allow contains {unknown!r}; use names from {', '.join(ALLOW_NAMES)} or a dict of field values"
            )
        zero: set[int] = set()
        if {"dp", "ddp"} & set(names):
            zero.add(0)
        for n, stages in (("zero1", (1,)), ("zero2", (2,)), ("zero3", (3,)), ("zero", (1, 2, 3)), ("fsdp", (2, 3))):
            if n in names:
                zero.update(stages)
        one = (1,)
        return cls(
            dp=None if zero else one,
            zero=tuple(sorted(zero)) or (0,),
            tp=None if {"tp", "sp"} & set(names) else one,
            pp=None if "pp" in names else one,
            cp=None if "cp" in names else one,
        )

    @classmethod
    def _from_mapping(cls, data: Mapping[str, Any]) -> Allow:
        known = {f.name for f in fields(cls)}
        unknown = [k for k in data if k not in known]
        if unknown:
            raise ValueError(f"allow has unknown keys {unknown!r}; use keys from {', '.join(sorted(known))}")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if value is None:
                continue
            if key in ("dp", "tp", "pp", "cp", "virtual_stages", "micro_batch", "zero"):
                kwargs[key] = _tuple(key, value, int, (0, 1, 2, 3) if key == "zero" else None)
            elif key == "sp":
                kwargs[key] = _tuple(key, value, bool)
            elif key == "schedule":
                kwargs[key] = _tuple(key, value, str, SCHEDULES)
            elif key == "recompute":
                kwargs[key] = _tuple(key, value, str, RECOMPUTE_MODES)
            elif key == "loss":
                kwargs[key] = _tuple(key, value, str, LOSS_MODES)
            elif key == "offload":
                kwargs[key] = _tuple(key, value, str, OFFLOAD_CHOICES)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (list(v) if v is not None else None) for f in fields(self) for v in [getattr(self, f.name)]}


@dataclass(frozen=True)
class Layout:
    """The shape of a plan that the search and the time model share (``planning/timing.py``).

    Args:
        dp, tp, pp, cp: parallel degrees. b: micro-batch. m: micro-batches per optimizer step per replica
        (the pipeline's ``microbatches`` when pp > 1, else the gradient-accumulation count). schedule, v:
        pipeline schedule and chunks per pipeline rank.
    """

    dp: int
    tp: int
    pp: int
    cp: int
    b: int
    m: int
    schedule: str = "1f1b"
    v: int = 1

    @property
    def shape(self) -> Layout:
        """This layout as a plain :class:`Layout` (a :class:`LayoutChoice` without its options)."""
        if type(self) is Layout:
            return self
        return Layout(self.dp, self.tp, self.pp, self.cp, self.b, self.m, self.schedule, self.v)

    def describe(self) -> str:
        parts = [f"dp={self.dp}"]
        if self.tp > 1:
            parts.append(f"tp={self.tp}")
        if self.pp > 1:
            sched = self.schedule + (f"(v={self.v})" if self.v > 1 else "")
            parts.append(f"pp={self.pp} {sched}")
        if self.cp > 1:
            parts.append(f"cp={self.cp}")
        parts.append(f"b={self.b} x{self.m}")
        return " ".join(parts)


@dataclass(frozen=True)
class LayoutChoice(Layout):
    """One point of the outer search: a :class:`Layout` and the inner options valid for it (the tuples of
    ZeRO stages, sequence-parallel settings and loss modes; recompute modes are the search's)."""

    zeros: tuple[int, ...] = field(default=(0,))
    sps: tuple[bool, ...] = field(default=(False,))
    losses: tuple[str, ...] = field(default=("naive",))


def _in(value: int, allowed: tuple[int, ...] | None) -> bool:
    return allowed is None or value in allowed


def micro_batch_options(per_replica: int, user_b: int, allowed: tuple[int, ...] | None) -> list[int]:
    """Micro-batch sizes tried for a per-replica batch: the user's value and powers of two up to
    :data:`MAX_MICRO_BATCH`, each dividing the per-replica batch (or exactly ``allowed``)."""
    if allowed is not None:
        return [b for b in allowed if per_replica % b == 0]
    opts = {user_b} if per_replica % user_b == 0 else set()
    b = 1
    while b <= min(per_replica, MAX_MICRO_BATCH):
        if per_replica % b == 0:
            opts.add(b)
        b *= 2
    return sorted(opts)


def enumerate_layouts(
    model: ModelSpec,
    train: TrainSpec,
    world: int,
    allow: Allow,
    global_batch: int | None,
) -> tuple[list[LayoutChoice], list[tuple[str, str, str]]]:
    """Every valid layout for ``world`` ranks, and ``(layout, kind, reason)`` for each rejected one.

    Early, shape-only rejections (no memory estimate needed): tp must divide the query and key/value
    heads (Megatron splits whole heads); pp <= L; cp must divide s (2c | s for the load-balanced
    causal split); sp needs (s/c) % t == 0; the global batch must divide by dp x micro-batch;
    interleaving needs L >= p v and even chunks (L % (p v) == 0) when the stages are even (L % p == 0);
    the schedule must run its m micro-batches
    (:func:`~lightning_memplan.model.runnable.pipeline_schedule_blocker`: 1F1B m >= p, interleaved
    m % p == 0, the rule memplan_auto's setup applies to a forced plan). One reason is recorded per
    rejected axis value (per layout and schedule), not per combination, so the list stays readable.
    """
    layouts: list[LayoutChoice] = []
    rejected: list[tuple[str, str, str]] = []
    for tp, pp in _tp_pp(model, world, allow, rejected):
        for cp in divisors(world // (tp * pp)):
            if not _in(cp, allow.cp):
                continue
            dp = world // (tp * pp * cp)
            if not _in(dp, allow.dp):
                continue
            options = _options(model, train, allow, global_batch, (dp, tp, pp, cp), rejected)
            if options is None:
                continue
            per_replica, bs, zeros, sps, losses = options
            unrunnable: set[str] = set()
            for b in bs:
                m = per_replica // b
                for sched, v in _schedules(model, train, allow, (dp, tp, pp, cp), b, m, per_replica, unrunnable, rejected):
                    layouts.append(LayoutChoice(dp, tp, pp, cp, b, m, sched, v, zeros, sps, losses))
    return layouts, rejected


def _tp_pp(model: ModelSpec, world: int, allow: Allow, rejected: list[tuple[str, str, str]]) -> Iterator[tuple[int, int]]:
    """The ``(tp, pp)`` pairs whose heads and blocks split, lazily (a reason in ``rejected`` for each that
    does not, in the order the caller's later rejections interleave with)."""
    for tp in divisors(world):
        if not _in(tp, allow.tp):
            continue
        if model.n_heads % tp:
            rejected.append((f"tp={tp}", "divisibility", f"n_heads={model.n_heads} not divisible by tp={tp}"))
            continue
        if model.kv_heads % tp:
            rejected.append((f"tp={tp}", "divisibility", f"n_kv_heads={model.kv_heads} not divisible by tp={tp}"))
            continue
        for pp in divisors(world // tp):
            if not _in(pp, allow.pp):
                continue
            if pp > model.n_layers:
                rejected.append((f"tp={tp} pp={pp}", "divisibility", f"pp={pp} > n_layers={model.n_layers}: a stage needs a block"))
                continue
            if pp > MAX_PIPELINE_CHUNKS:
                rejected.append((f"tp={tp} pp={pp}", "bound", f"pp={pp} > MAX_PIPELINE_CHUNKS={MAX_PIPELINE_CHUNKS}"))
                continue
            yield tp, pp


def _options(model: ModelSpec, train: TrainSpec, allow: Allow, global_batch: int | None,
             degrees: tuple[int, int, int, int], rejected: list[tuple[str, str, str]]) -> tuple | None:
    """``(per-replica batch, micro-batches, zeros, sps, losses)`` of one ``(dp, tp, pp, cp)``, or ``None``
    with its reason in ``rejected``."""
    dp, tp, pp, cp = degrees
    s = train.seq_len
    where = f"dp={dp} tp={tp} pp={pp} cp={cp}"
    loss_opts = allow.loss if allow.loss is not None else tuple(dict.fromkeys((train.loss, "chunked", "vocab_parallel")))
    if cp > 1 and s % (2 * cp):
        rejected.append((where, "divisibility", f"seq_len={s} not divisible by 2*cp={2 * cp} (load-balanced causal split)"))
        return None
    if global_batch is not None:
        if global_batch % dp:
            rejected.append((where, "batch", f"global_batch={global_batch} not divisible by dp={dp}"))
            return None
        per_replica = global_batch // dp
    else:
        per_replica = train.micro_batch * train.grad_accumulation
    zeros = tuple(z for z in allow.zero if z == 0 or dp * cp > 1) or (0,)
    sps = tuple(sp for sp in allow.sp if not sp or (tp > 1 and (s // cp) % tp == 0)) or (False,)
    losses = tuple(lm for lm in loss_opts if lm != "vocab_parallel" or tp > 1)
    if not losses:
        rejected.append((where, "allow", f"loss modes {list(loss_opts)} need tp > 1"))
        return None
    bs = micro_batch_options(per_replica, train.micro_batch, allow.micro_batch)
    if not bs:
        rejected.append((where, "batch", f"per-replica batch {per_replica} not divisible by any allowed micro-batch {list(allow.micro_batch or ())}"))
        return None
    return per_replica, bs, zeros, sps, losses


def _schedules(model: ModelSpec, train: TrainSpec, allow: Allow, degrees: tuple[int, int, int, int], b: int, m: int,
               per_replica: int, unrunnable: set[str], rejected: list[tuple[str, str, str]]) -> list[tuple[str, int]]:
    """The ``(schedule, v)`` pairs that run ``m`` micro-batches of ``b`` on ``pp`` stages: the rule
    memplan_auto's setup applies too (1F1B: m >= pp; interleaved: m % pp == 0), so the search never yields
    a schedule that cannot run (one reason per layout and schedule, ``unrunnable``)."""
    dp, tp, pp, cp = degrees
    if pp == 1:
        return [("1f1b", 1)]
    schedules: list[tuple[str, int]] = []
    for sched in allow.schedule:
        blocker = pipeline_schedule_blocker(pp=pp, schedule=sched, microbatches=m, batch=per_replica)
        if blocker is not None:
            if sched not in unrunnable:  # one reason per layout and schedule
                unrunnable.add(sched)
                rejected.append((f"dp={dp} tp={tp} pp={pp} cp={cp} {sched} b={b} x{m}", "schedule", blocker))
            continue
        if sched != "interleaved":
            schedules.append((sched, 1))
            continue
        # uneven chunks (the first L mod (p v) take one more block) where the stages are uneven anyway
        # (L mod p != 0: Llama 3's 126 layers on 16 stages); even stages keep even chunks (L mod (p v) == 0)
        # units: the blocks, plus embedding and head where the stack weighs them (Llama 3)
        units = pipeline_units(model.n_layers, train.framework)
        for v in range(2, min(MAX_VIRTUAL_STAGES, units // pp, MAX_PIPELINE_CHUNKS // pp) + 1):
            if (units % pp == 0 and units % (pp * v)) or not _in(v, allow.virtual_stages):
                continue
            schedules.append(("interleaved", v))
    return schedules
