"""Run a function on ``world_size`` real processes joined by a gloo process group.

Used by the multi-process tests and benchmarks. The rendezvous port is picked at run time (never a
fixed port), results come back through a pickle file per rank, and a failure on any rank re-raises in
the caller with that rank's traceback, so a test fails with the real error instead of hanging.

Every call starts fresh processes. Where the platform has it, they are forked from one
``multiprocessing`` fork server per calling process that imported torch and Lightning once
(``start_method="forkserver"``, the default on Linux and macOS): a spawned child would import them
again, which costs seconds per rank and dominated the distributed tests' wall time on 2-core machines.
Each child still starts as a spawned one would: the caller's environment variables, working directory
and ``sys.path`` at the time of the call are applied before ``fn`` is unpickled (the fork server's own
are those of its start). Sources: Python's ``multiprocessing`` "Contexts and start methods" and
``set_forkserver_preload``; ``torch.multiprocessing.start_processes``.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["find_free_port", "run_distributed"]

# What the fork server imports once for all the children it forks: the heavy imports every rank pays
# under "spawn". The package itself is left out, so that its import-time reads of the environment happen
# in each child, under the caller's environment, as with "spawn".
_FORKSERVER_PRELOAD = ("torch", "torch.distributed", "lightning.fabric", "lightning.pytorch")
_START_METHODS = ("forkserver", "spawn")


def find_free_port() -> int:
    """Ask the OS for a free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _default_start_method() -> str:
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _worker(
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    payload: bytes,
    context: tuple[dict[str, str], str, list[str]],
    backend: str,
    timeout_s: float,
    num_nodes: int = 1,
) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    # the caller's environment, working directory and import path at the time of the call (a child
    # forked from the fork server has the server's): applied before ``fn`` is unpickled, as under spawn
    environ, cwd, import_path = context
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = import_path + [p for p in sys.path if p not in import_path]
    fn, args = pickle.loads(payload)  # trusted: pickled by this harness's caller for its own children
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    per_node = world_size // num_nodes
    # Lightning's LightningEnvironment reads LOCAL_RANK and NODE_RANK (global rank = node x devices +
    # local), torchelastic-style code LOCAL_WORLD_SIZE / GROUP_RANK: each simulated node is a block of
    # ``per_node`` consecutive ranks on this host.
    os.environ["LOCAL_RANK"] = str(rank % per_node)
    os.environ["NODE_RANK"] = os.environ["GROUP_RANK"] = str(rank // per_node)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    stage = "init"
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
        stage = "error"
        result = fn(rank, world_size, *args)
        with open(path, "wb") as fh:
            pickle.dump(("ok", result), fh)
    except BaseException as exc:  # noqa: BLE001 - re-raised in the parent with the traceback
        with open(path, "wb") as fh:
            pickle.dump((stage, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"), fh)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    num_nodes: int = 1,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes and return each rank's result.

    Args:
        fn: a module-level (picklable) function. The process group is initialised before it runs.
        world_size: number of processes (keep it at 2-4 on small CPU machines).
        *args: extra picklable arguments passed to every rank.
        backend: ``torch.distributed`` backend; ``"gloo"`` runs on CPU.
        timeout_s: collective timeout, so a mismatch on one rank fails instead of hanging.
        num_nodes: simulated nodes on this host: ranks ``n * (world_size // num_nodes) + i`` form node
            ``n`` (``NODE_RANK=n``, ``LOCAL_RANK=i``), as Lightning's multi-node environment numbers
            them, so ``Trainer(devices=world_size // num_nodes, num_nodes=num_nodes)`` runs in each.
        start_method: ``"forkserver"`` (fork each rank from a server that imported torch and Lightning
            once; the default where the platform has it) or ``"spawn"`` (a fresh interpreter per rank;
            the default elsewhere). Either way each rank is a new process with the caller's environment.

    Returns:
        ``[result_rank0, result_rank1, ...]``.

    Raises:
        RuntimeError: naming the rank and carrying its traceback when any rank fails.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive int, e.g. 2")
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1 or world_size % num_nodes:
        raise ValueError(
            f"num_nodes={num_nodes!r} must be a positive int dividing world_size={world_size}, e.g. num_nodes=2"
        )
    if start_method is None:
        start_method = _default_start_method()
    if start_method not in _START_METHODS or start_method not in multiprocessing.get_all_start_methods():
        available = [m for m in _START_METHODS if m in multiprocessing.get_all_start_methods()]
        raise ValueError(f"start_method={start_method!r} is not one of {available} on this platform; "
                         f"use start_method=None for the default")
    payload = pickle.dumps((fn, args))  # an unpicklable fn or argument fails here, in the caller
    if start_method == "forkserver":
        # only taken into account before the fork server of this process starts (its first use)
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(_FORKSERVER_PRELOAD))
    # The port is free when picked but another process may take it before rank 0's store binds it:
    # such a run is retried on a new port (a few times), any other failure is raised at once.
    for attempt in range(_PORT_ATTEMPTS):
        try:
            return _spawn(fn, world_size, payload, backend, timeout_s, find_free_port(), num_nodes, start_method)
        except _PortTaken:
            if attempt == _PORT_ATTEMPTS - 1:
                raise RuntimeError(
                    f"distributed run of {getattr(fn, '__name__', fn)!r}: the rendezvous port was taken "
                    f"{_PORT_ATTEMPTS} times in a row"
                ) from None
    raise AssertionError("unreachable")


_PORT_ATTEMPTS = 3


class _PortTaken(RuntimeError):
    pass


def _spawn(fn: Callable[..., Any], world_size: int, payload: bytes, backend: str, timeout_s: float,
           port: int, num_nodes: int, start_method: str) -> list[Any]:
    context = (dict(os.environ), os.getcwd(), list(sys.path))
    with tempfile.TemporaryDirectory(prefix="memplan_dist_") as out_dir:
        ctx = mp.start_processes(
            _worker,
            args=(world_size, port, out_dir, payload, context, backend, timeout_s, num_nodes),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        failure: BaseException | None = None
        try:
            while not ctx.join():
                pass
        except BaseException as exc:  # noqa: BLE001 - replaced by a clearer error below
            failure = exc
        results: list[Any] = []
        errors: list[str] = []
        port_taken = False
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {rank}: exited without a result")
                results.append(None)
                continue
            with open(path, "rb") as fh:
                status, value = pickle.load(fh)  # trusted: the result file this harness's own child wrote in a private temp dir
            if status == "ok":
                results.append(value)
            else:
                errors.append(f"rank {rank}: {value}")
                results.append(None)
                port_taken |= status == "init" and ("address already in use" in value.lower() or "eaddrinuse" in value.lower())
        if port_taken:
            raise _PortTaken(port)
        if errors or failure is not None:
            detail = "\n".join(errors) or repr(failure)
            raise RuntimeError(f"distributed run of {getattr(fn, '__name__', fn)!r} failed:\n{detail}")
        return results
