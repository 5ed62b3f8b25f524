"""docs/callback.md runs: every ```python block in order in one namespace, and every
``lightning-memplan`` command of its ```bash blocks, in a temporary directory."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from lightning_memplan.callbacks.memory_plan import MemoryPlanCallback
from lightning_memplan.model.result import COMPONENTS

DOC = Path(__file__).resolve().parents[2] / "docs" / "callback.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)


def test_callback_doc_snippets_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "callback_doc"}
    for i, block in enumerate(_blocks("python")):
        exec(compile(block, f"{DOC.name}[python block {i}]", "exec"), namespace)  # noqa: S102
    from lightning_memplan.cli import main

    commands = [
        line
        for block in _blocks("bash")
        for line in block.splitlines()
        if line.startswith("lightning-memplan")
    ]
    assert commands
    for line in commands:
        assert main(shlex.split(line)[1:]) == 0, line
    assert (tmp_path / "chart.png").read_bytes()[:4] == b"\x89PNG"


def test_doc_lists_every_logged_metric_and_argument():
    text = DOC.read_text(encoding="utf-8")
    doc = MemoryPlanCallback.__doc__ or ""
    for key in set(re.findall(r"``(memplan/[a-z_/]+)``", doc)):
        assert f"`{key}`" in text or f"`{key}," in text, key
    for component in COMPONENTS:
        assert f"`{component}`" in text
    import inspect

    for name in inspect.signature(MemoryPlanCallback).parameters:
        assert f"`{name}`" in text, name
