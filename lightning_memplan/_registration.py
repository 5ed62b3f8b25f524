"""Register ``strategy="memplan_auto"`` in Lightning's ``StrategyRegistry`` without importing Lightning.

Importing Lightning costs seconds; the pure core and the ``lightning-memplan`` command need none of it.
So importing ``lightning_memplan`` registers the strategy at once when ``lightning.pytorch`` is
already loaded, and otherwise installs a finder that registers it right after ``lightning.pytorch``
finishes importing - always before a ``Trainer`` can resolve the strategy name. Written by hand
because neither Python nor Lightning offers a post-import hook.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

__all__ = ["ensure_registered"]

_TRIGGER = "lightning.pytorch"


def _register() -> None:
    package = sys.modules.get("lightning_memplan.strategies")
    if package is not None and not hasattr(package, "register_strategies"):
        # ``lightning_memplan.strategies`` itself is importing Lightning right now (it was imported
        # first); it registers the strategy when its own import finishes.
        return
    from lightning_memplan.strategies import register_strategies

    register_strategies()


class _RegisteringLoader(importlib.abc.Loader):
    """Delegates to the real loader, then registers once the module has executed."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _register()


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TRIGGER:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding us again
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _RegisteringLoader(spec.loader)
        return spec


def ensure_registered() -> None:
    """Register now if Lightning is loaded, else as soon as ``lightning.pytorch`` is imported."""
    module = sys.modules.get(_TRIGGER)
    if module is not None and getattr(module, "__spec__", None) is not None:
        _register()
        return
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())
