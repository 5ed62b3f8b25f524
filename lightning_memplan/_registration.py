"""Register ``strategy="memplan_auto"`` in Lightning's strategy registries without importing Lightning.

The composition root's wiring (top layer, beside ``cli`` and ``testing``): only the package's top
``__init__`` calls :func:`ensure_registered`, and nothing below imports this module, so the strategies
themselves (:mod:`lightning_memplan.strategies`, :mod:`lightning_memplan.fabric`) know nothing of the
registries.

Importing Lightning costs seconds; the pure core and the ``lightning-memplan`` command need none of it.
So importing ``lightning_memplan`` registers at once in each registry whose package is already loaded
(the Trainer's ``StrategyRegistry`` in ``lightning.pytorch``, Fabric's ``STRATEGY_REGISTRY`` in
``lightning.fabric``), and otherwise installs a finder that registers right after that package finishes
importing - always before a ``Trainer`` or a ``Fabric`` can resolve the strategy name. Written by hand
because neither Python nor Lightning offers a post-import hook.

Each registry entry is a factory (:func:`trainer_strategy`, :func:`fabric_strategy`) that imports its
strategy class when a ``Trainer`` or a ``Fabric`` is built: the registries only call their entries
(``_StrategyRegistry.get`` calls ``entry["strategy"](**init_params)``), and the hook fires in the middle
of imports - ``lightning.fabric`` finishes importing inside ``import lightning`` (before
``lightning.pytorch``), and ``lightning.pytorch`` inside the import of
:mod:`lightning_memplan.strategies.memplan_auto` when that module is imported first - where the class
may not exist yet.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = [
    "FABRIC_DESCRIPTION",
    "STRATEGY_NAME",
    "TRAINER_DESCRIPTION",
    "ensure_registered",
    "fabric_strategy",
    "register_strategy",
    "trainer_strategy",
]

#: The name both registries know the strategy by (``Trainer(strategy=...)``, ``Fabric(strategy=...)``).
STRATEGY_NAME = "memplan_auto"
TRAINER_DESCRIPTION = "lightning_memplan: plans DP/FSDP/TP/PP/recompute from the memory model and applies it"
FABRIC_DESCRIPTION = (
    "lightning_memplan: plans DP/FSDP/TP/recompute from the memory model at fabric.setup and applies it"
)


def trainer_strategy(**kwargs: Any) -> Any:
    """``MemplanAutoStrategy(**kwargs)``: the entry of ``"memplan_auto"`` in the Trainer's registry."""
    from lightning_memplan.strategies.memplan_auto import MemplanAutoStrategy

    return MemplanAutoStrategy(**kwargs)


def fabric_strategy(**kwargs: Any) -> Any:
    """``MemplanAutoFabricStrategy(**kwargs)``: the entry of ``"memplan_auto"`` in Fabric's registry."""
    from lightning_memplan.fabric.strategy import MemplanAutoFabricStrategy

    return MemplanAutoFabricStrategy(**kwargs)


@dataclass(frozen=True, kw_only=True)
class _FrontDoor:
    """One Lightning registry ``"memplan_auto"`` goes into.

    Args:
        package: the package whose import makes the registry exist (the post-import trigger).
        registry: ``"module:attribute"`` of the registry object.
        factory: the registry entry (builds the strategy when Lightning resolves the name).
        description: the entry's description.
    """

    package: str
    registry: str
    factory: Callable[..., Any]
    description: str


#: Front door -> its registry. The Trainer's ``StrategyRegistry`` lives in ``lightning.pytorch``,
#: Fabric's ``STRATEGY_REGISTRY`` in ``lightning.fabric``.
_FRONT_DOORS: dict[str, _FrontDoor] = {
    "trainer": _FrontDoor(
        package="lightning.pytorch", registry="lightning.pytorch.strategies:StrategyRegistry",
        factory=trainer_strategy, description=TRAINER_DESCRIPTION,
    ),
    "fabric": _FrontDoor(
        package="lightning.fabric", registry="lightning.fabric.strategies:STRATEGY_REGISTRY",
        factory=fabric_strategy, description=FABRIC_DESCRIPTION,
    ),
}


def register_strategy(front_door: str, registry: Any = None) -> None:
    """Register ``"memplan_auto"`` for one front door (idempotent).

    Args:
        front_door: ``"trainer"`` (``Trainer(strategy="memplan_auto")``) or ``"fabric"``
            (``Fabric(strategy="memplan_auto")``).
        registry: the registry to add to; ``None`` means that front door's own (the Trainer's
            ``lightning.pytorch.strategies.StrategyRegistry``, Fabric's
            ``lightning.fabric.strategies.STRATEGY_REGISTRY``), imported here.

    Raises:
        ValueError: an unknown ``front_door``.
    """
    door = _FRONT_DOORS.get(front_door) if isinstance(front_door, str) else None
    if door is None:
        raise ValueError(f"front_door={front_door!r} must be one of {sorted(_FRONT_DOORS)}, e.g. 'trainer'")
    if registry is None:
        module, _, name = door.registry.partition(":")
        registry = getattr(importlib.import_module(module), name)
    if STRATEGY_NAME not in registry:
        registry.register(STRATEGY_NAME, door.factory, description=door.description)


#: Package -> what to do right after it is imported.
_TRIGGERS: dict[str, Callable[[], None]] = {
    door.package: functools.partial(register_strategy, name) for name, door in _FRONT_DOORS.items()
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
