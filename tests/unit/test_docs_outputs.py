"""Printed outputs in the docs are the real outputs of the commands shown above them.

A page lists ```bash blocks holding one ``lightning-memplan ...`` command, each followed by a ```text
block with what it prints. Every such pair is run here (in-process, the CLI's own ``main``) and the text
must match, apart from the search's wall time. To regenerate after a deliberate change to the model:
``MEMPLAN_REGENERATE_DOCS=1 python -m pytest tests/unit/test_docs_outputs.py`` rewrites the pages.
"""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "examples" / "estimate" / "README.md"]
_PAIR = re.compile(r"```bash\n(lightning-memplan [^\n]*)\n```\n\n```text\n(.*?)```", re.S)
_TIMING = re.compile(r"(search: .*?), [0-9.]+ m?s$", re.M)  # wall time of the search: varies run to run


def _normalise(text: str) -> str:
    return _TIMING.sub(r"\1, <time>", text.rstrip() + "\n")


def _run(command: str) -> str:
    from lightning_memplan.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(shlex.split(command)[1:])
    assert code in (0, 1, None), f"{command!r} exited with {code}:\n{out.getvalue()}"  # 1: does not fit
    return out.getvalue()


def test_pages_hold_command_output_pairs():
    for page in PAGES:
        assert len(_PAIR.findall(page.read_text(encoding="utf-8"))) >= 3, page


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_printed_outputs_match_the_commands(page, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # rich wraps at the terminal width; the pages are 100 wide
    text = page.read_text(encoding="utf-8")
    if os.environ.get("MEMPLAN_REGENERATE_DOCS") == "1":
        text = _PAIR.sub(lambda m: f"```bash\n{m.group(1)}\n```\n\n```text\n{_run(m.group(1)).rstrip()}\n```", text)
        page.write_text(text, encoding="utf-8")
    for command, printed in _PAIR.findall(text):
        assert _normalise(_run(command)) == _normalise(printed), command


def test_troubleshooting_explains_the_unregistered_strategy_name():
    """Without ``import lightning_memplan`` Lightning rejects the name with its own message; the
    troubleshooting page quotes that message and the README says the import registers the strategy."""
    import subprocess
    import sys

    probe = (
        "import lightning as L\n"
        "try:\n    L.Trainer(strategy='memplan_auto', accelerator='cpu', logger=False)\n"
        "except ValueError as exc:\n    print('REJECTED', exc)\n"
        "import lightning_memplan\n"
        "print('ACCEPTED', type(L.Trainer(strategy='memplan_auto', accelerator='cpu', logger=False).strategy).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT).stdout
    assert "REJECTED You selected an invalid strategy name: `strategy='memplan_auto'`" in out, out
    assert "ACCEPTED MemplanAutoStrategy" in out, out
    troubleshooting = (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    assert "You selected an invalid strategy name: `strategy='memplan_auto'`" in troubleshooting
    assert "import lightning_memplan  # registers strategy=\"memplan_auto\"" in troubleshooting
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "invalid strategy name" in readme and "`import lightning_memplan` registers" in readme
