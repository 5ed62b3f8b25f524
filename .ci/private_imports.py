#!/usr/bin/env python3
"""No module of the package imports a private (``_``-prefixed) name from another package of it.

Reads every ``*.py`` under the package with :mod:`ast` (nothing is imported or run) and lists each
``from lightning_memplan.<pkg>... import _name`` (or a relative import that resolves there) whose
``<pkg>`` differs from the importing module's own package. A package is the first component below the
root (``model``, ``parallel``, ...); a top-level module (``files.py``) is its own package. Dunder names
(``__version__``) are public. The package root (``__init__.py``, the composition root) may import
private names of its layers, as it wires them.

Usage: ``python .ci/private_imports.py lightning_memplan`` (exit 1 when any crossing is found).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def _package_of(parts: tuple[str, ...]) -> str:
    """``("lightning_memplan", "model", "terms")`` -> ``"model"``; a top-level module is its own package."""
    return parts[1] if len(parts) > 1 else ""


def _module_parts(path: Path, root: Path) -> tuple[str, ...]:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = rel.parts
    return parts[:-1] if parts[-1] == "__init__" else parts


def _resolve(node: ast.ImportFrom, parts: tuple[str, ...], is_package: bool) -> tuple[str, ...]:
    """The absolute module path an ``ImportFrom`` names, relative imports resolved against ``parts``."""
    if node.level == 0:
        return tuple((node.module or "").split("."))
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return base + (tuple(node.module.split(".")) if node.module else ())


def crossings(root: Path) -> list[str]:
    """``path:line: module imports _name from other.package`` for every private name crossing a package line."""
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = _module_parts(path, root)
        if len(parts) == 1:  # the composition root
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        own = _package_of(parts)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            target = _resolve(node, parts, path.name == "__init__.py")
            if not target or target[0] != root.name:
                continue
            for alias in node.names:
                name = alias.name
                private = name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
                # ``from lightning_memplan.x import _mod`` names a private module of package x
                other = _package_of(target + ((name,) if len(target) == 1 else ()))
                if private and other != own:
                    found.append(f"{path}:{node.lineno}: {'.'.join(parts)} imports {name} from {'.'.join(target)}")
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    root = Path(argv[1]).resolve()
    found = crossings(root)
    for line in found:
        print(line)
    print(f"private names imported across packages: {len(found)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
