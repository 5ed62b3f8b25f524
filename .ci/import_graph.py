#!/usr/bin/env python3
"""AST import graph of a package: file-level and package-level cycles, and arrows that point up the layers.

Counts every ``import``/``from ... import`` in a module, those inside functions included; skips
``if TYPE_CHECKING:`` blocks, and a package ``__init__`` importing its own submodules (a re-export).

Usage: python .ci/import_graph.py [PACKAGE_DIR]   (default: lightning_memplan). Exit 1 when any cycle exists.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def _module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    out: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]

    def resolve(name: str) -> str | None:
        # the longest known module that is a prefix of name
        while name:
            if name in known:
                return name
            name = name.rpartition(".")[0]
        return None

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for c in child.orelse:
                    visit_node(c)
                continue
            visit_node(child)

    def visit_node(child: ast.AST) -> None:
        if isinstance(child, ast.Import):
            for alias in child.names:
                target = resolve(alias.name)
                if target:
                    out.add(target)
        elif isinstance(child, ast.ImportFrom):
            if child.level:
                base = package.split(".")
                base = base[: len(base) - (child.level - 1)]
                prefix = ".".join(base)
                full = f"{prefix}.{child.module}" if child.module else prefix
            else:
                full = child.module or ""
            for alias in child.names:
                target = resolve(f"{full}.{alias.name}") or resolve(full)
                if target:
                    out.add(target)
        visit(child)

    visit(tree)
    out.discard(module)
    if is_package:  # a package re-exporting its own modules is not an arrow
        out = {t for t in out if not t.startswith(module + ".")}
    return out


def graph(root: Path) -> dict[str, set[str]]:
    files = {_module_name(root, p): p for p in root.rglob("*.py")}
    known = set(files)
    edges: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        edges[name] = _imports(tree, name, path.name == "__init__.py", known)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def package_of(module: str, top: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else top


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "lightning_memplan").resolve()
    top = root.name
    edges = graph(root)
    file_cycles = cycles(edges)
    pkg_edges: dict[str, set[str]] = {}
    for src, dsts in edges.items():
        ps = package_of(src, top)
        for d in dsts:
            pd = package_of(d, top)
            if pd != ps and pd != top:  # the top-level __init__ re-exports; imports of it are not counted
                pkg_edges.setdefault(ps, set()).add(pd)
    pkg_cycles = cycles(pkg_edges)
    n_arrows = sum(len(v) for v in pkg_edges.values())
    print(f"modules: {len(edges)}, file-level arrows: {sum(len(v) for v in edges.values())}, "
          f"package-level arrows: {n_arrows}")
    print(f"file-level cycles: {len(file_cycles)}")
    for c in file_cycles:
        print("  " + " <-> ".join(c))
    print(f"package-level cycles: {len(pkg_cycles)}")
    for c in pkg_cycles:
        print("  " + " <-> ".join(c))
    if "-v" in sys.argv:
        for s in sorted(pkg_edges):
            print(f"  {s} -> {', '.join(sorted(pkg_edges[s]))}")
    return 1 if file_cycles or pkg_cycles else 0


if __name__ == "__main__":
    sys.exit(main())
