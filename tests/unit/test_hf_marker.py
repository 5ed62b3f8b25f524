"""Every test module that imports transformers (or peft) carries the ``hf`` marker.

``.ci/run`` runs ``pytest -m hf`` a second time in a venv with the newest transformers release, so a module
that touches transformers but lacks the marker would only ever be tested against the version the dev extra
resolves. The check parses each module with :mod:`ast`: an ``import``/``from`` import of ``transformers`` or
``peft`` (at any depth: inside functions and classes too), ``pytest.importorskip("transformers...")``, or
``__import__``/``importlib.import_module`` of one, must come with a module-level ``pytestmark`` that is
``pytest.mark.hf`` or a list/tuple holding it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
HF_PACKAGES = ("transformers", "peft")
IMPORT_CALLS = ("importorskip", "import_module", "__import__")


def _is_hf_module(name: str) -> bool:
    return name.split(".")[0] in HF_PACKAGES


def hf_uses(tree: ast.AST) -> list[int]:
    """Line numbers where the module imports (or import-skips) transformers or peft."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(_is_hf_module(a.name) for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _is_hf_module(node.module):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            first = node.args[0]
            if (name in IMPORT_CALLS and isinstance(first, ast.Constant) and isinstance(first.value, str)
                    and _is_hf_module(first.value)):
                lines.append(node.lineno)
    return sorted(lines)


def _is_mark_hf(node: ast.expr) -> bool:
    if isinstance(node, ast.Call):  # pytest.mark.hf(...)
        node = node.func
    return (isinstance(node, ast.Attribute) and node.attr == "hf" and isinstance(node.value, ast.Attribute)
            and node.value.attr == "mark" and isinstance(node.value.value, ast.Name) and node.value.value.id == "pytest")


def has_hf_marker(tree: ast.Module) -> bool:
    """A module-level ``pytestmark`` (plain or annotated assignment) that is or holds ``pytest.mark.hf``."""
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if not any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets):
            continue
        marks = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
        if any(_is_mark_hf(m) for m in marks):
            return True
    return False


def unmarked_hf_modules(sources: dict[str, str]) -> list[str]:
    """``path:line`` of each module in ``sources`` that uses transformers/peft but lacks the marker."""
    bad = []
    for path, text in sorted(sources.items()):
        tree = ast.parse(text, filename=path)
        uses = hf_uses(tree)
        if uses and not has_hf_marker(tree):
            bad.append(f"{path}:{uses[0]}")
    return bad


def _test_modules() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in sorted(TESTS.rglob("*.py"))}


def test_every_module_that_imports_transformers_is_marked_hf() -> None:
    bad = unmarked_hf_modules(_test_modules())
    assert not bad, ("these test modules import transformers/peft but lack `pytestmark = pytest.mark.hf` "
                     f"(so .ci/run would not test them against the newest transformers): {bad}")


def test_the_scan_finds_the_known_hf_modules() -> None:
    """The scan is not vacuous: it sees the modules it exists for, marked."""
    modules = _test_modules()
    hf = {path for path, text in modules.items() if hf_uses(ast.parse(text))}
    assert {"tests/unit/test_hf_trace.py", "tests/integration/test_callback_hf.py",
            "tests/distributed/test_strategy_hf.py"} <= hf
    assert "tests/unit/test_hf_marker.py" not in hf  # its snippets are strings, not imports
    assert "tests/unit/test_litgpt_spec.py" not in hf  # litgpt only


@pytest.mark.parametrize("snippet", [
    "import pytest\nimport transformers\n",
    "import pytest\nfrom transformers.models.llama import modeling_llama\n",
    "import pytest\ntransformers = pytest.importorskip('transformers')\n",
    "import pytest\npytest.importorskip('transformers.masking_utils', reason='x')\n",
    "import pytest\n\ndef test_x():\n    peft = pytest.importorskip('peft')\n",
    "import pytest\n\nclass M:\n    def setup(self):\n        import transformers\n",
    "import pytest\nx = __import__('transformers')\n",
    "import pytest\nimport transformers\npytestmark = pytest.mark.slow\n",
    "import pytest\nimport transformers\npytestmark = [pytest.mark.slow, pytest.mark.distributed]\n",
    "import pytest\nimport transformers\n\ndef f():\n    pytestmark = pytest.mark.hf\n",  # not module level
    "import pytest\nimport transformers\nmark = pytest.mark.hf\n",
])
def test_an_unmarked_snippet_is_reported(snippet: str) -> None:
    assert unmarked_hf_modules({"tests/unit/test_bad.py": snippet}) == [
        f"tests/unit/test_bad.py:{hf_uses(ast.parse(snippet))[0]}"]


@pytest.mark.parametrize("snippet", [
    "import pytest\nimport transformers\npytestmark = pytest.mark.hf\n",
    "import pytest\nimport transformers\npytestmark = [pytest.mark.distributed, pytest.mark.hf]\n",
    "import pytest\nimport transformers\npytestmark = (pytest.mark.hf,)\n",
    "import pytest\nimport transformers\npytestmark: list = [pytest.mark.hf]\n",
    # mentions that are not imports
    "import pytest\n# transformers' Mamba runs an associative scan\n",
    "import pytest\nBAD = ('transformers', 'torch')\n",
    "import pytest\nfrom lightning_memplan.testing.hf_architectures import measure_step\n",
    "import pytest\nfrom .transformers import x\n",  # a relative import is a local module
])
def test_a_marked_or_non_hf_snippet_passes(snippet: str) -> None:
    assert unmarked_hf_modules({"tests/unit/test_ok.py": snippet}) == []


def test_ci_runs_the_hf_tests_against_the_newest_transformers() -> None:
    """.ci/run: after the main test command and before .ci/checks, a venv with the newest transformers runs
    the hf tests; no hf test collected (pytest exit 5) fails CI, as for the main stage."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    main = ci.index('bash -c "$TEST_COMMAND"')
    venv = ci.index("-m venv --system-site-packages")
    upgrade = ci.index("pip\" install -q --upgrade transformers")
    hf_run = re.search(r"-m pytest -q -p no:cacheprovider -m \"hf( and not slow)?\"", ci)
    assert hf_run, "the hf stage must run pytest -m hf"
    checks = ci.index(".ci/checks\n")
    assert main < venv < upgrade < hf_run.start() < checks
    stage = ci[hf_run.end():checks]
    assert re.search(r'if \[ "\$rc" -eq 5 \]; then\n[^\n]*\n  exit 1', stage), "exit 5 must fail the hf stage"
