"""The composition root's wiring (``lightning_memplan._registration``): ``"memplan_auto"`` goes into the
Trainer's and Fabric's registries as factories, idempotently; only the top ``__init__`` calls it.

(Registration on a fresh interpreter, whatever is imported first, is in
tests/integration/test_strategy_auto.py and tests/unit/test_fabric_strategy_errors.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lightning_memplan import _registration

pytest.importorskip("lightning")

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_memplan"


@pytest.mark.parametrize(
    ("front_door", "class_path"),
    [
        ("trainer", "lightning_memplan.strategies.memplan_auto.MemplanAutoStrategy"),
        ("fabric", "lightning_memplan.fabric.strategy.MemplanAutoFabricStrategy"),
    ],
)
def test_a_fresh_registry_gets_a_factory_that_builds_the_strategy(front_door, class_path):
    from lightning.fabric.strategies.registry import _StrategyRegistry

    registry = _StrategyRegistry()
    assert "memplan_auto" not in registry
    _registration.register_strategy(front_door, registry)
    _registration.register_strategy(front_door, registry)  # idempotent
    assert registry.available_strategies() == ["memplan_auto"]
    strategy = registry.get("memplan_auto")  # what Trainer/Fabric(strategy="memplan_auto") call
    assert f"{type(strategy).__module__}.{type(strategy).__name__}" == class_path
    configured = registry["memplan_auto"]["strategy"](memory_budget=2**30)  # keywords reach the constructor
    assert type(configured) is type(strategy) and configured._options.memory_budget == 2**30


def test_the_package_import_filled_both_real_registries():
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["memplan_auto"]["strategy"] is _registration.trainer_strategy
    assert STRATEGY_REGISTRY["memplan_auto"]["strategy"] is _registration.fabric_strategy


@pytest.mark.parametrize("front_door", ["Trainer", "deepspeed", None, 1])
def test_an_unknown_front_door_is_named(front_door):
    with pytest.raises(ValueError, match=rf"front_door={front_door!r} must be one of \['fabric', 'trainer'\]"):
        _registration.register_strategy(front_door)


def test_only_the_top_init_imports_the_registration():
    importers = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [node.module or ""] if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names] if isinstance(node, ast.Import) else []
            )
            if any(n == "lightning_memplan._registration" for n in names):
                importers.append(str(path.relative_to(PACKAGE)))
    assert importers == ["__init__.py"]
