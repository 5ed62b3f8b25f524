"""The coefficient cache of the config-only traced path: in memory, and on disk as JSON.

A traced entry is a JSON object (the depth-1 and depth-2 calibrations and parameter counts,
``tracking/hf_calibrate.py``). It is looked up by a key, the SHA-256 of:

- the config JSON (:func:`~lightning_memplan.model.hf_build.canonical_config_json`);
- every field of the traced step ``T0`` except the batch shape (the trace runs at its own shapes);
- the torch and transformers versions;
- :data:`CACHE_VERSION` and a fingerprint of the source of the modules that produce an entry (the
  tracer, the tracker, the training step and the ``hf_*`` modules): an edited tracer never reads what
  an older one wrote.

On disk: one file ``hf_trace_<key>.json`` per entry in :func:`cache_dir` -- the directory named by
:data:`CACHE_ENV` (``"0"`` or empty: memory only), else ``$XDG_CACHE_HOME/lightning_memplan/hf_trace``,
else ``~/.cache/lightning_memplan/hf_trace`` (the XDG base-directory default). Files are written
atomically (:func:`~lightning_memplan.files.write_atomic`: a fresh temporary in the folder, never
through a link; a crash leaves the previous file or none) and only ever read by
:func:`~lightning_memplan.files.read_json`, never executed or unpickled. A file that is not a regular
file (a link, a FIFO), is too large, not UTF-8, nested too deep, holds a non-finite number, does not
parse, holds another key, or whose content the caller cannot use is ignored with a ``RuntimeWarning``
and traced again. A directory that cannot be written, or a :data:`CACHE_ENV` that cannot be resolved
(``~nosuchuser/x``), leaves the cache in memory only (with a warning).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["CACHE_ENV", "CACHE_VERSION", "cache_dir", "cached", "clear_cache", "entry_key"]

#: Environment variable naming the directory of the on-disk cache (``"0"`` or empty: memory only).
CACHE_ENV = "LIGHTNING_MEMPLAN_HF_TRACE_CACHE"
#: Bump when what an entry means changes in a way the source fingerprint does not see.
CACHE_VERSION = 3
# The source files (relative to the package root) whose code decides an entry's bytes: hashed into every key.
_PRODUCERS = (
    "model/hf_build.py",
    "tracking/hf_calibrate.py",
    "tracking/trace.py",
    "model/result.py",
    "tracking/tracker.py",
    "tracking/report.py",
    "tracking/step.py",
    "tracking/fake_fidelity.py",
)
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]

T = TypeVar("T")
_MEMORY: dict[str, Any] = {}
_LOCK = threading.Lock()
_WARNED_DIRS: set[str] = set()
#: Largest cache entry read (an entry is a few kB of coefficients).
_MAX_ENTRY_BYTES = 4 * 2**20


def clear_cache() -> None:
    """Forget the in-memory entries (the on-disk cache is left alone)."""
    with _LOCK:
        _MEMORY.clear()


def cache_dir() -> Path | None:
    """The on-disk cache directory now in effect (``None``: memory only), see the module docstring."""
    configured = os.environ.get(CACHE_ENV)
    if configured is not None:
        configured = configured.strip()
        if configured in ("", "0"):
            return None
        try:
            return Path(configured).expanduser()
        except (RuntimeError, KeyError, ValueError) as exc:  # "~nosuchuser/x": no such home directory
            if configured not in _WARNED_DIRS:
                _WARNED_DIRS.add(configured)
                warnings.warn(
                    f"{CACHE_ENV}={configured!r} cannot be resolved ({exc}); the HF trace cache stays in memory only. "
                    f"Set {CACHE_ENV} to a folder path, or to 0",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return None
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    if base and Path(base).is_absolute():  # the XDG spec ignores a relative XDG_CACHE_HOME
        return Path(base) / "lightning_memplan" / "hf_trace"
    try:
        return Path.home() / ".cache" / "lightning_memplan" / "hf_trace"
    except (KeyError, RuntimeError):  # no home directory to resolve: memory only
        return None


def _version(dist: str) -> str:
    module = sys.modules.get(dist)  # imported already: its own version string, no metadata scan
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


@functools.lru_cache(maxsize=1)
def _fingerprint() -> str:
    """Versions of torch and transformers and a hash of the producing modules' source files (read as
    bytes, not imported: finding a module's spec would import its package)."""
    digest = hashlib.sha256()
    for dist in ("torch", "transformers"):
        digest.update(f"{dist}={_version(dist)}\n".encode())
    for name in _PRODUCERS:
        digest.update(name.encode())
        with contextlib.suppress(OSError):  # an installation without sources: the versions still key it
            digest.update((_PACKAGE_ROOT / name).read_bytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1024)  # hashing the config JSON once per (config, traced step)
def entry_key(config_json: str, knobs_json: str) -> str:
    """The cache key of a config (canonical JSON) traced with ``knobs_json`` (sorted JSON of ``T0``)."""
    payload = f"v{CACHE_VERSION}\n{_fingerprint()}\n{knobs_json}\n{config_json}"
    return hashlib.sha256(payload.encode()).hexdigest()


def _path(key: str) -> Path | None:
    directory = cache_dir()
    return directory / f"hf_trace_{key}.json" if directory is not None else None


def _warn(path: Path, why: str) -> None:
    warnings.warn(f"ignoring the HF trace cache file {path} ({why}); it is traced again", RuntimeWarning, stacklevel=3)


def _read(key: str) -> dict[str, Any] | None:
    path = _path(key)
    if path is None:
        return None
    from lightning_memplan.files import read_json

    try:  # a regular file only (a link or FIFO is refused, never waited on), size-capped, finite numbers
        data = read_json(path, what="an HF trace cache entry", argument="cache_file", max_bytes=_MAX_ENTRY_BYTES)
    except FileNotFoundError:
        return None
    except ValueError as exc:
        _warn(path, str(exc))
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        _warn(path, "not an entry for this key")
        return None
    return data


def _write(key: str, data: dict[str, Any]) -> None:
    path = _path(key)
    if path is None:
        return
    from lightning_memplan.files import write_atomic

    try:
        write_atomic(path, json.dumps(data, sort_keys=True, allow_nan=False))
    except (OSError, ValueError, TypeError) as exc:  # a read-only or full cache folder: the memory cache holds it
        warnings.warn(
            f"could not write the HF trace cache file {str(path)!r} ({type(exc).__name__}: {exc}); the estimate goes on "
            f"with the entry kept in memory for this process. Free space in the folder, or set {CACHE_ENV} to a "
            "writable folder (0: memory only)",
            RuntimeWarning,
            stacklevel=3,
        )


def cached(key: str, compute: Callable[[], dict[str, Any]], parse: Callable[[dict[str, Any]], T]) -> T:
    """``parse(entry)`` of the entry under ``key``: from memory, else from disk, else ``compute()``
    (then written to disk). ``parse`` turns the JSON entry into what callers use and is run once per
    process and key; a disk entry it rejects (``KeyError``/``TypeError``/``ValueError``) is ignored with
    a warning and computed again."""
    with _LOCK:
        hit = _MEMORY.get(key)
    if hit is not None:
        return hit  # type: ignore[no-any-return]
    value: T | None = None
    data = _read(key)
    if data is not None:
        try:
            value = parse(data)
        except (KeyError, TypeError, ValueError, ArithmeticError) as exc:
            path = _path(key)
            assert path is not None
            _warn(path, f"unusable entry: {type(exc).__name__}: {exc}")
    if value is None:
        data = {**compute(), "key": key}
        value = parse(data)
        _write(key, data)
    with _LOCK:
        _MEMORY[key] = value
    return value
