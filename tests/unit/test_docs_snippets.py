"""Every ```python block in README.md and docs/*.md runs (docs that cannot drift from the code).

Blocks in one page share a namespace and run in order, so a page reads like a session. A block whose
first line is ``# doc: skip`` is shown but not run (only for commands that need a GPU cluster).
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _blocks(page: pathlib.Path) -> list[str]:
    return [b for b in _BLOCK.findall(page.read_text(encoding="utf-8")) if not b.startswith("# doc: skip")]


def test_docs_have_snippets():
    pages_with_code = [p.name for p in PAGES if _blocks(p)]
    assert "concepts.md" in pages_with_code


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p)], ids=lambda p: p.name)
def test_snippets_execute(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # snippets that write files write them here
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for i, block in enumerate(_blocks(page)):
        code = compile(block, f"{page.name}[block {i}]", "exec")
        exec(code, namespace)  # noqa: S102 - executing our own documentation
