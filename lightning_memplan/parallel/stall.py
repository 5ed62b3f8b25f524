"""Bounded waiting for memplan_auto's rank agreement: a rank that hangs (rather than dies) makes every
rank fail within a stated time, and the error names the stalled rank.

Without this, the peers of a stuck rank wait inside a collective until the process-group timeout
(``default_pg_timeout``: 30 minutes), and the error says only that a collective timed out. Here every
rank first checks in on the process group's key-value store (``torch.distributed``'s default store,
the one ``init_process_group`` rendezvoused through) and waits for the others with a deadline:

- a rank whose peers do not all check in within ``timeout`` seconds raises :class:`StallError` naming
  the missing ranks, after marking the round as abandoned in the store;
- a late rank that checks in after the others gave up finds the mark (or, when rank 0 has already
  exited and taken the store with it, an unreachable store) and raises :class:`StallError` naming
  itself, at once;
- the ranks waiting for rank 0's plan wait at most ``timeout`` seconds for it, naming rank 0.

The bound: the peers of a stalled rank exit within ``timeout`` (plus the store's round trips); the
stalled rank exits as soon as it reaches the check. ``timeout`` is :data:`DEFAULT_STALL_TIMEOUT_S`
(5 minutes: planning a large model takes seconds) unless the environment variable
:data:`STALL_TIMEOUT_ENV` (``MEMPLAN_STALL_TIMEOUT_S``) gives another number of seconds.
"""

from __future__ import annotations

import itertools
import json
import os
from datetime import timedelta
from typing import Any

__all__ = ["DEFAULT_STALL_TIMEOUT_S", "STALL_TIMEOUT_ENV", "RankRendezvous", "StallError", "stall_timeout"]

#: Environment variable: seconds a rank waits for its peers at memplan_auto's agreement steps.
STALL_TIMEOUT_ENV = "MEMPLAN_STALL_TIMEOUT_S"
#: Default of :data:`STALL_TIMEOUT_ENV`, seconds.
DEFAULT_STALL_TIMEOUT_S = 300.0

_ABANDONED = "abandoned"
_PLANNED = "planned"
# Each rendezvous gets its own key prefix; every rank creates them in the same order (one per fit).
_rounds = itertools.count()


class StallError(RuntimeError):
    """A rank did not reach memplan_auto's agreement step in time (the message names it)."""


def stall_timeout() -> float:
    """Seconds to wait for peers: :data:`STALL_TIMEOUT_ENV` if set, else :data:`DEFAULT_STALL_TIMEOUT_S`.

    Raises:
        ValueError: the variable is not a finite number of seconds > 0.
    """
    from lightning_memplan.validation import check_number

    raw = os.environ.get(STALL_TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_STALL_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{STALL_TIMEOUT_ENV}={raw!r} must be a number of seconds, e.g. 300") from None
    return check_number(STALL_TIMEOUT_ENV, value, minimum=0.0, min_inclusive=False, hint="seconds, e.g. 300")


class RankRendezvous:
    """One agreement round on the default store: :meth:`arrive` (every rank), then rank 0
    :meth:`publish` es its result and the others :meth:`await_rank_zero`.

    Args:
        what: the step, for messages (``"plan agreement"``).
        rank, world_size: this process's global rank and the world size.
        timeout: seconds (default :func:`stall_timeout`).
        store: a ``torch.distributed.Store`` (default: the default process group's store).
    """

    def __init__(self, what: str, rank: int, world_size: int, *, timeout: float | None = None, store: Any = None) -> None:
        import torch.distributed as dist

        self.what, self.rank, self.world_size = what, rank, world_size
        self.timeout = stall_timeout() if timeout is None else float(timeout)
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        self.store = dist.PrefixStore(f"memplan_rendezvous/{next(_rounds)}/", base)

    def _hint(self) -> str:
        return (
            f"they wait at most {self.timeout:g} s ({STALL_TIMEOUT_ENV}); find what held that rank up (data "
            "loading, a filesystem, a debugger) or raise the timeout"
        )

    def _late(self, cause: str) -> StallError:
        return StallError(
            f"memplan_auto: rank {self.rank} reached the {self.what} after its peers gave up waiting for it "
            f"({cause}): rank {self.rank} stalled; {self._hint()}"
        )

    def arrive(self) -> None:
        """Check in and wait for every rank; raise :class:`StallError` naming the ranks that did not come."""
        try:
            if self.store.check([_ABANDONED]):
                raise self._late(f"the round was abandoned: {self.store.get(_ABANDONED).decode()}")
            self.store.set(f"arrived/{self.rank}", "1")
        except StallError:
            raise
        except Exception as exc:  # noqa: BLE001 - the store is gone: rank 0 exited after giving up
            raise self._late(f"the rendezvous store is unreachable: {type(exc).__name__}") from None
        keys = [f"arrived/{r}" for r in range(self.world_size)]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout))
        except Exception:  # noqa: BLE001 - DistStoreError on timeout; the missing ranks are named below
            missing = self._missing(keys)
            if missing:
                self._abandon(f"rank(s) {missing} did not arrive within {self.timeout:g} s")
                raise StallError(
                    f"memplan_auto: rank(s) {missing} did not reach the {self.what} within {self.timeout:g} s "
                    f"(rank {self.rank} waited): rank(s) {missing} stalled; {self._hint()}"
                ) from None
        if self.store.check([_ABANDONED]):
            raise self._late(f"the round was abandoned: {self.store.get(_ABANDONED).decode()}")

    def publish(self) -> None:
        """Rank 0: its plan (or its error) is ready to broadcast."""
        self.store.set(_PLANNED, "1")

    def await_rank_zero(self) -> None:
        """Every other rank: wait for rank 0's plan; raise :class:`StallError` naming rank 0 when it does not come."""
        try:
            self.store.wait([_PLANNED], timedelta(seconds=self.timeout))
        except Exception:  # noqa: BLE001
            raise StallError(
                f"memplan_auto: rank 0 did not finish planning within {self.timeout:g} s (rank {self.rank} "
                f"waited): rank 0 stalled; {self._hint()}"
            ) from None

    def _missing(self, keys: list[str]) -> list[int]:
        try:
            return [r for r, key in enumerate(keys) if not self.store.check([key])]
        except Exception:  # noqa: BLE001
            return [r for r in range(self.world_size) if r != self.rank]

    def _abandon(self, why: str) -> None:
        try:
            self.store.set(_ABANDONED, json.dumps(why)[1:-1])
        except Exception:  # noqa: BLE001 - best effort: the late rank also detects a vanished store
            pass
