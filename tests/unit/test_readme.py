"""The README Quickstart holds exactly two commands, and CI runs the second one verbatim."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _quickstart_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_quickstart_has_two_commands():
    commands = _quickstart_commands()
    assert len(commands) == 2, commands
    assert all("\n" not in c for c in commands)
    assert "examples/gpt/train.py" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    match = re.search(r"^TEST_COMMAND='(.*)'$", ci, re.M)
    assert match, "the CI script must define TEST_COMMAND"
    assert match.group(1) == _quickstart_commands()[1]
    assert "torch==2.13.0" in match.group(1).split("&&")[0]


def test_main_job_script_exists():
    assert (ROOT / "examples" / "gpt" / "train.py").is_file()
