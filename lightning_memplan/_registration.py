"""Register ``strategy="memplan_auto"`` in Lightning's strategy registries without importing Lightning.

Importing Lightning costs seconds; the pure core and the ``lightning-memplan`` command need none of it.
So importing ``lightning_memplan`` registers at once in each registry whose package is already loaded
(the Trainer's ``StrategyRegistry`` in ``lightning.pytorch``, Fabric's ``STRATEGY_REGISTRY`` in
``lightning.fabric``), and otherwise installs a finder that registers right after that package finishes
importing - always before a ``Trainer`` or a ``Fabric`` can resolve the strategy name. Written by hand
because neither Python nor Lightning offers a post-import hook.

Fabric's entry is a factory (:func:`fabric_strategy`) that imports the strategy class when a ``Fabric``
is built: ``lightning.fabric`` finishes importing in the middle of ``import lightning`` (before
``lightning.pytorch``), and the Fabric strategy shares its core with the Trainer strategy, which
imports ``lightning.pytorch``; the registry only calls its entries, so a factory is all it needs.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["FABRIC_DESCRIPTION", "ensure_registered", "fabric_strategy", "register_fabric_strategy"]

FABRIC_DESCRIPTION = (
    "lightning_memplan: plans DP/FSDP/TP/recompute from the memory model at fabric.setup and applies it"
)


def _register() -> None:
    package = sys.modules.get("lightning_memplan.strategies")
    if package is not None and not hasattr(package, "register_strategies"):
        # ``lightning_memplan.strategies`` itself is importing Lightning right now (it was imported
        # first); it registers the strategy when its own import finishes.
        return
    from lightning_memplan.strategies import register_strategies

    register_strategies()


def fabric_strategy(**kwargs: Any) -> Any:
    """``MemplanAutoFabricStrategy(**kwargs)``: the entry of ``"memplan_auto"`` in Fabric's registry."""
    from lightning_memplan.fabric.strategy import MemplanAutoFabricStrategy

    return MemplanAutoFabricStrategy(**kwargs)


def register_fabric_strategy(registry: Any = None) -> None:
    """Register ``"memplan_auto"`` in Fabric's ``STRATEGY_REGISTRY`` (idempotent).

    Args:
        registry: the registry to add to; ``None`` means ``lightning.fabric.strategies.STRATEGY_REGISTRY``.
    """
    if registry is None:
        from lightning.fabric.strategies import STRATEGY_REGISTRY

        registry = STRATEGY_REGISTRY
    if "memplan_auto" not in registry:
        registry.register("memplan_auto", fabric_strategy, description=FABRIC_DESCRIPTION)


#: Package -> what to do right after it is imported.
_TRIGGERS: dict[str, Callable[[], None]] = {
    "lightning.pytorch": _register,
    "lightning.fabric": register_fabric_strategy,
}


class _RegisteringLoader(importlib.abc.Loader):
    """Delegates to the real loader, then registers once the module has executed."""

    def __init__(self, loader: Any, then: Callable[[], None]) -> None:
        self._loader = loader
        self._then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._then()


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self, pending: set[str]) -> None:
        self.pending = pending

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)  # one shot per package
        if not self.pending:
            sys.meta_path.remove(self)
        # PathFinder searches sys.path only (not sys.meta_path), so it cannot find this finder again.
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _RegisteringLoader(spec.loader, _TRIGGERS[fullname])
        return spec


def _loaded(name: str) -> bool:
    module = sys.modules.get(name)
    return module is not None and getattr(module, "__spec__", None) is not None


def ensure_registered() -> None:
    """Register now in each registry whose package is loaded, else as soon as it is imported."""
    pending = set()
    for name, register in _TRIGGERS.items():
        if _loaded(name):
            register()
        else:
            pending.add(name)
    if pending and not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder(pending))
