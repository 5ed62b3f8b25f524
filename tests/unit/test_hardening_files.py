"""Issue 23, the files half: every write goes through a fresh temporary (never a planted link), every read
takes regular files only (bounded size, depth and numbers), names stay inside their root, every string is
escaped for its medium, a report write that fails is a warning, and the writers of one folder take turns.

Each test plants the hostile thing itself (a link at a temporary's guessable name or at the target, a FIFO,
a sparse file, a nested or non-finite JSON, an HTML/ANSI/rich-markup payload) and checks the victim, the
file on disk or the rendered text; where a FIFO could block forever the call runs in a thread with a
generous hang guard (the issue asks for a bounded answer).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from lightning_memplan.files import (
    LockState,
    atomic_file,
    clean_stale_temps,
    folder_lock,
    json_default,
    read_json,
    safe_component,
    write_atomic,
)
from lightning_memplan.report.escape import (
    html_text,
    markdown_code,
    markdown_code_block,
    markdown_text,
    rich_text,
    terminal_text,
)
from lightning_memplan.report.io import load_report, write_report
from lightning_memplan.report.paths import PLAN_FILENAME, plan_decision_beside
from lightning_memplan.report.records import EpochReport, Incident, MemoryReport, summarize_rank
from lightning_memplan.report.render import render_markdown, render_rich
from lightning_memplan.testing.reports import synthetic_report

pytestmark = pytest.mark.hf

HANG_GUARD_S = 20.0  # a generous guard against a blocking read, not a speed bound
VICTIM_TEXT = "the victim's own data\n"


def _answer(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a thread; the exception it raised (or its result); fails if it hangs."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), f"{fn.__name__} blocked (a FIFO was waited on)"
    return out.get("error", out.get("value"))


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "elsewhere" / "victim.txt"
    victim.parent.mkdir()
    victim.write_text(VICTIM_TEXT)
    return victim


def _epoch(epoch: int) -> EpochReport:
    from test_report import _rec  # noqa: I001 - the report tests' step-record fixture

    ranks = tuple(summarize_rank([_rec(epoch, est=10 * 2**20, meas=9 * 2**20, rank=r, epoch=epoch)], rank=r,
                                 epoch=epoch, backend="cpu") for r in range(2))
    return EpochReport(epoch=epoch, ranks=ranks)


# ------------------------------------------------------------------------------------ 1. safe writes
def _write_report_json(folder: Path) -> Path:
    write_report(synthetic_report(epochs=1), folder, png=False)
    return folder / "memory_report.json"


def _write_plan(folder: Path) -> Path:
    from lightning_memplan.files import write_atomic

    write_atomic(folder / PLAN_FILENAME, json.dumps({"plan": {"dp": 1}}))
    return folder / PLAN_FILENAME


def _write_trace_cache(folder: Path, monkeypatch) -> Path:
    from lightning_memplan.tracking import hf_cache

    monkeypatch.setenv(hf_cache.CACHE_ENV, str(folder))
    hf_cache._write("k" * 64, {"key": "k" * 64, "value": 1})
    return folder / f"hf_trace_{'k' * 64}.json"


def _write_png(folder: Path) -> Path:
    from lightning_memplan.report.plot import render_png

    render_png(synthetic_report(epochs=1), folder / "memory_report.png")
    return folder / "memory_report.png"


WRITERS = {"report": _write_report_json, "plan": _write_plan, "trace-cache": _write_trace_cache, "png": _write_png}
TARGETS = {"report": "memory_report.json", "plan": PLAN_FILENAME, "trace-cache": f"hf_trace_{'k' * 64}.json",
           "png": "memory_report.png"}


@pytest.mark.parametrize("where", ["old-temp-name", "target"])
@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_planted_link_is_never_written_through(tmp_path, monkeypatch, writer, where):
    folder = tmp_path / "logs"
    folder.mkdir()
    victim = _victim(tmp_path)
    name = TARGETS[writer]
    # the name the old writer used (".<name>.tmp<pid>": pid guessable), and the target itself
    planted = folder / (f".{name}.tmp{os.getpid()}" if where == "old-temp-name" else name)
    planted.symlink_to(victim)
    write = WRITERS[writer]
    target = write(folder, monkeypatch) if writer == "trace-cache" else write(folder)
    assert victim.read_text() == VICTIM_TEXT  # untouched
    assert target.is_file() and not target.is_symlink() and target.stat().st_size > 0
    assert not any(".tmp" in p.name and p != planted for p in folder.iterdir())  # no temporary left


def test_temporaries_are_fresh_private_files_and_the_target_keeps_the_usual_mode(tmp_path):
    with atomic_file(tmp_path / "r.json") as fh:
        (tmp,) = [p for p in tmp_path.iterdir() if ".tmp" in p.name]
        assert tmp.stat().st_ino == os.fstat(fh.fileno()).st_ino and not tmp.is_symlink()
        fh.write(b"{}")
    assert tmp.parent == tmp_path and tmp.name.startswith(f".r.json.tmp{os.getpid()}.") and not tmp.exists()
    umask = os.umask(0o022)
    os.umask(umask)
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o666 & ~umask
    write_atomic(tmp_path / "private.json", "{}", mode=0o600)
    assert (tmp_path / "private.json").stat().st_mode & 0o777 == 0o600


def test_clean_stale_temps_never_follows_a_link(tmp_path):
    victim = _victim(tmp_path)
    victim_dir = tmp_path / "victim_dir"
    victim_dir.mkdir()
    (victim_dir / "keep.txt").write_text("keep")
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # a dead writer's pid
    link = tmp_path / f".memory_report.json.tmp{pid}.abc123"
    link.symlink_to(victim)
    dir_link = tmp_path / f".memory_report.json.tmp{pid}"
    dir_link.symlink_to(victim_dir, target_is_directory=True)
    real_dir = tmp_path / f".memory_report.json.tmp{pid}.zz"  # a folder with a temporary's name is left alone
    real_dir.mkdir()
    removed = clean_stale_temps(tmp_path / "memory_report.json")
    assert sorted(removed) == sorted([link, dir_link])
    assert victim.read_text() == VICTIM_TEXT and (victim_dir / "keep.txt").read_text() == "keep" and real_dir.is_dir()


# ------------------------------------------------------------------------------------ 2. safe reads
def test_read_json_refuses_a_fifo_without_blocking(tmp_path):
    fifo = tmp_path / "memory_report.json"
    os.mkfifo(fifo)
    error = _answer(read_json, fifo)
    assert isinstance(error, ValueError) and "FIFO" in str(error) and str(fifo) in str(error)
    link = tmp_path / "config.json"
    link.symlink_to(fifo)  # a link to a FIFO, followed (a user-named config): still refused, still no wait
    error = _answer(read_json, link, follow_links=True)
    assert isinstance(error, ValueError) and "FIFO" in str(error)


@pytest.mark.parametrize(
    ("content", "rule"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested 100000 deep"),
        (b'{"a": ' * 5_000 + b"1" + b"}" * 5_000, "nested 5000 deep"),
        (b'{"c": NaN}', "not valid JSON"),
        (b'{"c": Infinity}', "not valid JSON"),
        (b'{"c": -Infinity}', "not valid JSON"),
        (b'{"c": 1e400}', "not valid JSON"),
        (b'{"c": ' + str(10**400).encode() + b"}", "not valid JSON"),
        (b'{"c": 9223372036854775808}', "not valid JSON"),
        (b'{"c": "\xff\xfe"}', "not UTF-8"),
        (b'{"c": ', "not valid JSON"),
    ],
    ids=["nested-100k", "objects-5k", "nan", "inf", "-inf", "1e400", "int-10**400", "int-2**63", "not-utf8", "torn"],
)
def test_read_json_refuses_bad_content_with_the_path(tmp_path, content, rule):
    path = tmp_path / "entry.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rule) as info:
        read_json(path, argument="cache_file")
    assert f"cache_file={str(path)!r}" in str(info.value)


def test_read_json_keeps_brackets_inside_strings_and_64_bit_integers(tmp_path):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps({"s": "[" * 1000, "n": 2**63 - 1, "m": -(2**63) + 1, "f": 1.5}))
    assert read_json(path)["n"] == 2**63 - 1


def test_read_json_caps_the_size_before_reading_and_takes_regular_files_only(tmp_path):
    sparse = tmp_path / "memory_report.json"
    with open(sparse, "wb") as fh:
        fh.truncate(512 * 2**20)  # 512 MiB of holes: refused on its size, never read
    with pytest.raises(ValueError, match=r"holds 536,870,912 bytes, more than"):
        read_json(sparse)
    with pytest.raises(ValueError, match="is a folder"):
        read_json(tmp_path)
    real = tmp_path / "real.json"
    real.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    with pytest.raises(ValueError, match="symbolic link"):
        read_json(link)  # files memplan wrote itself: a link there is not followed
    assert read_json(link, follow_links=True) == {}  # a user-named file (an HF snapshot's config.json link)
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_json(tmp_path / "missing.json")


def test_validation_read_json_file_is_the_same_reader(tmp_path):
    from lightning_memplan.validation import read_json_file

    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    error = _answer(read_json_file, fifo, argument="--model")
    assert isinstance(error, ValueError) and "--model=" in str(error)


def _trace_entry_cases(tmp_path: Path) -> dict[str, bytes | None]:
    return {
        "infinity": b'{"key": "KEY", "value": Infinity}',
        "nan": b'{"key": "KEY", "value": NaN}',
        "nested-100k": b'{"key": "KEY", "value": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "not-utf8": b'{"key": "KEY", "value": "\xff"}',
        "huge-int": b'{"key": "KEY", "value": ' + str(10**400).encode() + b"}",
        "link-to-fifo": None,
    }


@pytest.mark.parametrize("case", ["infinity", "nan", "nested-100k", "not-utf8", "huge-int", "link-to-fifo"])
def test_a_bad_trace_cache_entry_is_a_warning_and_a_fresh_trace(tmp_path, monkeypatch, case):
    from lightning_memplan.tracking import hf_cache

    monkeypatch.setenv(hf_cache.CACHE_ENV, str(tmp_path))
    hf_cache.clear_cache()
    key = hf_cache.entry_key("{}", f"hardening-{case}")
    path = tmp_path / f"hf_trace_{key}.json"
    content = _trace_entry_cases(tmp_path)[case]
    if content is None:
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        path.symlink_to(fifo)
    else:
        path.write_bytes(content.replace(b"KEY", key.encode()))
    calls = []

    def compute():
        calls.append(1)
        return {"value": 7}

    with pytest.warns(RuntimeWarning, match="ignoring the HF trace cache file"):
        value = _answer(hf_cache.cached, key, compute, lambda d: int(d["value"]))
    assert value == 7 and calls == [1]
    hf_cache.clear_cache()


def test_an_unresolvable_trace_cache_folder_is_a_warning_and_a_memory_cache(monkeypatch):
    from lightning_memplan.tracking import hf_cache

    monkeypatch.setenv(hf_cache.CACHE_ENV, "~nosuchuser_memplan_test/x")
    hf_cache._WARNED_DIRS.discard("~nosuchuser_memplan_test/x")
    hf_cache.clear_cache()
    with pytest.warns(RuntimeWarning, match="cannot be resolved.*memory only"):
        assert hf_cache.cache_dir() is None
    key = hf_cache.entry_key("{}", "hardening-nosuchuser")
    assert hf_cache.cached(key, lambda: {"value": 3}, lambda d: int(d["value"])) == 3
    hf_cache.clear_cache()


def _report_dict() -> dict:
    return json.loads(json.dumps(synthetic_report(epochs=1, oom=True).to_dict()))


def _set_peak(data: dict, value) -> None:
    data["epochs"][0]["ranks"][0]["measured_peak"] = value


BAD_REPORTS = {
    "note-not-a-string": (lambda d: d.update(notes=[{"x": 1}]), r"notes\[0\]="),
    "incident-kind-not-a-string": (lambda d: d["incidents"][0].update(kind=5), r"incidents\[0\]\.kind=5"),
    "incident-error-a-list": (lambda d: d["incidents"][0].update(error=["x"]), r"incidents\[0\]\.error="),
    "peak-a-string": (lambda d: _set_peak(d, "5"), r"epochs\[0\]\.ranks\[0\]\.measured_peak='5'"),
    "peak-negative": (lambda d: _set_peak(d, -5), r"epochs\[0\]\.ranks\[0\]\.measured_peak=-5 must be in \[0, 2\*\*63\)"),
    "peak-a-bool": (lambda d: _set_peak(d, True), r"measured_peak=True"),
    "peak-a-fraction": (lambda d: _set_peak(d, 1.5), r"measured_peak=1\.5"),
    "warning-not-a-string": (lambda d: d["epochs"][0].update(warnings=[None]), r"epochs\[0\]\.warnings\[0\]="),
    "component-negative": (lambda d: d["epochs"][0]["ranks"][0].update(estimated_components={"params": -1}),
                           r"estimated_components\['params'\]=-1"),
}


@pytest.mark.parametrize("case", list(BAD_REPORTS))
def test_a_bad_report_field_is_a_value_error_naming_the_field_and_the_path(tmp_path, case, capsys):
    from lightning_memplan.cli import main

    data = _report_dict()
    edit, field = BAD_REPORTS[case]
    edit(data)
    path = tmp_path / "memory_report.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=field) as info:
        load_report(path)
    assert f"path={str(path)!r}" in str(info.value)
    assert main(["report", str(path)]) == 2  # the CLI prints it as an error
    assert "memory_report.json" in capsys.readouterr().err


def test_a_peak_beyond_64_bits_is_refused_in_the_file_and_in_from_dict(tmp_path):
    path = tmp_path / "memory_report.json"
    text = json.dumps(_report_dict()).replace('"measured_peak": ', f'"measured_peak": {10**400}, "x": ', 1)
    path.write_text(text)
    with pytest.raises(ValueError, match=r"path=.*exceeds 64 bits"):
        load_report(path)
    data = _report_dict()
    _set_peak(data, 10**400)
    with pytest.raises(ValueError, match=r"measured_peak=an integer of 1329 bits must be in"):
        MemoryReport.from_dict(data)


@pytest.mark.parametrize("case", ["nested-100k", "candidates-x", "fifo", "link", "no-decision-dict"])
def test_a_stale_plan_record_is_a_warning_and_no_plan_map(tmp_path, case):
    plan = tmp_path / PLAN_FILENAME
    if case == "nested-100k":
        plan.write_text('{"decision": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif case == "candidates-x":
        plan.write_text(json.dumps({"decision": {"candidates": ["x"]}}))
    elif case == "fifo":
        os.mkfifo(plan)
    elif case == "link":
        plan.symlink_to(_victim(tmp_path))
    else:
        plan.write_text(json.dumps({"decision": [1, 2]}))
    with pytest.warns(UserWarning, match=f"plan record .*{PLAN_FILENAME}.*not used"):
        assert _answer(plan_decision_beside, tmp_path / "memory_report.json") is None
    with pytest.warns(UserWarning, match="plan record"):
        _, files = _answer(write_report, synthetic_report(epochs=1), tmp_path, png=False)
    assert files.html is not None and 'id="plan"' not in files.html.read_text()


# ------------------------------------------------------------------------------------ 3. names
def _csv_trainer(tmp_path: Path, **kwargs):
    from lightning.pytorch.loggers import CSVLogger

    logger = CSVLogger(str(tmp_path / "logs"), **kwargs)
    return SimpleNamespace(loggers=[logger], default_root_dir=str(tmp_path / "root")), logger


def _inside(path: str, root: Path) -> bool:
    return os.path.commonpath([os.path.abspath(path), str(root)]) == str(root)


@pytest.mark.parametrize("version", ["../../outside", "/abs/outside", "ver\x00sion", "../.."])
def test_a_logger_version_never_puts_the_report_outside_the_log_root(tmp_path, version):
    from lightning.pytorch.loggers import Logger

    from lightning_memplan.monitoring.artifacts import report_dirs

    trainer, _ = _csv_trainer(tmp_path, name="n", version=version)
    with pytest.warns(UserWarning, match="lies outside its root folder"):
        dirs = report_dirs(trainer, str(tmp_path / "root"))
    assert dirs and all(_inside(d, tmp_path / "root") for d in dirs), dirs
    assert all("\x00" not in d for d in dirs)

    class CustomLogger(Logger):  # no folder of its own: <default_root_dir>/memory_reports/<version>
        name = "custom"
        version = None

        def log_metrics(self, metrics, step=None):
            pass

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    custom = CustomLogger()
    custom.version = version
    trainer = SimpleNamespace(loggers=[custom], default_root_dir=str(tmp_path / "root"))
    (folder,) = report_dirs(trainer, str(tmp_path / "root"))
    assert _inside(folder, tmp_path / "root" / "memory_reports") and os.path.dirname(folder).endswith("memory_reports")


def test_a_plain_logger_version_is_kept(tmp_path):
    from lightning_memplan.monitoring.artifacts import report_dirs

    trainer, logger = _csv_trainer(tmp_path, name="n", version="version_3")
    assert report_dirs(trainer, "unused") == [logger.log_dir]
    assert safe_component("version_3") == "version_3"
    for hostile in ("../../x", "/etc", "a\x00b", "..", ".", "", "a/../../b"):
        part = safe_component(hostile)
        assert part not in ("", ".", "..") and "/" not in part and "\x00" not in part and not part.startswith(".")


# ------------------------------------------------------------------------------------ 4. escaping
XSS = "<img src=x onerror=alert(1)>"
ANSI = "\x1b]0;pwned\x07\x1b]52;c;cm0gLXJmIH4=\x07\x1b[2J\x9b31m"


def _html_of(markdown: str) -> str:
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").render(markdown)  # html=True: raw HTML would pass through


def _hostile_report(*, hostile_component: bool = True) -> MemoryReport:
    report = synthetic_report(epochs=1)
    run = {**report.run, "model": f"Net{XSS}", "estimate_source": "[/bogus] [bold]"}
    incident = Incident(kind=f"oom{XSS}", error="RuntimeError: a ` backtick `` run ``` and " + XSS + ANSI, rank=0,
                        epoch=0, step=3, allocator={"summary": "```\n" + XSS + "\n```", f"k{XSS}": f"v{ANSI}"})
    epoch = report.epochs[0]
    # a look-alike component key is refused on read (test_hardening_inputs.py); in memory it renders inert
    component = f"[/bogus]{XSS}" if hostile_component else "params"
    ranks = (type(epoch.ranks[0])(**{**epoch.ranks[0].__dict__, "measured_components": {component: 5}}),)
    epoch = EpochReport(epoch=0, ranks=ranks, warnings=(f"warn {XSS} {ANSI}",))
    return MemoryReport(run=run, notes=(f"note {XSS} {ANSI} [/bogus]",), epochs=(epoch,), incidents=(incident,))


def test_markdown_renders_every_hostile_string_inert():
    md = render_markdown(_hostile_report())
    html = _html_of(md)
    assert "<img" not in html and "onerror=alert(1)&gt;" in html  # shown as text
    assert "\x1b" not in md and "\x07" not in md and "\x9b" not in md
    # the incident's error is one code span, whole, whatever backticks it holds
    assert "<code>RuntimeError: a ` backtick `` run ``` and &lt;img src=x onerror=alert(1)&gt;" in html
    assert html.count("<pre><code>") == 1 and "&lt;img" in html.split("<pre><code>")[1]


def test_escape_helpers_per_medium():
    assert html_text('<a href="x">&') == "&lt;a href=&quot;x&quot;&gt;&amp;"
    assert "<" not in _html_of(markdown_text(XSS)).replace("<p>", "").replace("</p>", "")
    assert _html_of(markdown_text("*a* _b_ [c](d) # e | f")).strip() == "<p>*a* _b_ [c](d) # e | f</p>"
    for text in ("`", "a`b", "``x``", "` lead", "trail `"):
        assert _html_of(markdown_code(text)).strip() == f"<p><code>{html_text(text)}</code></p>"
    block = markdown_code_block("x\n```\n" + XSS)
    assert _html_of(block).count("<pre><code>") == 1 and "&lt;img" in _html_of(block)
    assert terminal_text(ANSI + "\nline") == "\ufffd]0;pwned\ufffd\ufffd]52;c;cm0gLXJmIH4=\ufffd\ufffd[2J\ufffd31m\nline"
    assert "\n" not in terminal_text("a\nb", newlines=False)
    assert terminal_text("abc\u202edef") == "abc\ufffddef"
    assert rich_text("[/bogus]") == "\\[/bogus]"


def test_rich_and_the_report_cli_print_hostile_strings_literally(tmp_path, capsys):
    from rich.console import Console

    from lightning_memplan.cli import main

    console = Console(file=open(os.devnull, "w"), width=200, record=True)  # noqa: SIM115
    console.print(render_rich(_hostile_report()))  # no MarkupError on "[/bogus]"
    text = console.export_text()
    assert "[/bogus]" in text and "\x1b]" not in text
    write_report(_hostile_report(hostile_component=False), tmp_path, png=False, html=False)
    for extra in ([], ["--markdown"], ["--json"]):
        assert main(["report", str(tmp_path), *extra]) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out, extra
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "note <img" in out and "[/bogus]" in out  # printed as text, not swallowed as markup


def test_plan_markdown_and_terminal_escape_a_config_model_type(tmp_path, capsys, monkeypatch):
    from lightning_memplan.cli import main

    monkeypatch.setenv("LIGHTNING_MEMPLAN_HF_TRACE", "0")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": f"{XSS}[/bogus]{ANSI}", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 64,
        "n_head": 2, "vocab_size": 100, "n_positions": 128,
    }))
    args = ["plan", "--model", str(config), "--hardware", "h100-80gb", "--gpus-per-node", "2", "--seq-len", "64",
            "--global-batch", "8"]
    main([*args, "--markdown"])
    md = capsys.readouterr().out
    assert "<img" not in _html_of(md) and "\x1b" not in md
    main(args)
    out = capsys.readouterr().out
    assert "[/bogus]" in out and "\x1b" not in out and "\x07" not in out


def test_the_png_title_is_text_not_mathtext(tmp_path):
    from lightning_memplan.report.plot import render_png

    report = synthetic_report(epochs=1)
    report = MemoryReport(run={**report.run, "model": r"Net$\undefinedmacro$ $x^$"}, epochs=report.epochs)
    render_png(report, tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------ 5. model classes
@pytest.mark.parametrize("arch", ["AutoTokenizer", "GPT2TokenizerFast", "AutoConfig", "GPT2Config", "pipeline", "os",
                                  "Trainer", 5])
def test_a_config_architecture_that_is_not_a_model_class_is_never_used(arch):
    transformers = pytest.importorskip("transformers")
    from lightning_memplan.model.hf_build import model_class

    config = transformers.GPT2Config(architectures=[arch])
    cls = model_class(config)
    assert issubclass(cls, transformers.PreTrainedModel) and cls is transformers.GPT2LMHeadModel


def test_a_config_architecture_that_is_a_model_class_is_used():
    transformers = pytest.importorskip("transformers")
    from lightning_memplan.model.hf_build import model_class

    config = transformers.GPT2Config(architectures=["GPT2ForSequenceClassification"])
    assert model_class(config) is transformers.GPT2ForSequenceClassification


# ------------------------------------------------------------------------------------ 6. the run goes on
@pytest.mark.parametrize("blocked", ["memory_report.json", "memory_report.html", "memory_report.md"])
def test_a_folder_in_place_of_a_report_file_is_one_warning_and_the_rest_is_written(tmp_path, blocked):
    (tmp_path / blocked).mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merged, files = write_report(synthetic_report(epochs=1), tmp_path, png=False, errors="warn")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and str(tmp_path / blocked) in messages[0] and "Error" in messages[0]
    assert (tmp_path / blocked).is_dir()
    written = {p.name for p in (files.json, files.markdown, files.html) if p is not None}
    assert written == {"memory_report.json", "memory_report.md", "memory_report.html"} - {blocked}
    with pytest.raises(ValueError, match="is a folder"):
        write_report(synthetic_report(epochs=1), tmp_path, png=False)  # errors="raise" (the default) raises


def test_a_renderer_error_is_one_warning_and_the_old_file_stays_whole(tmp_path, monkeypatch):
    from lightning_memplan.report import io

    write_report(synthetic_report(epochs=1), tmp_path, png=True)
    before = (tmp_path / "memory_report.png").read_bytes()

    def broken(report, path, *, units):
        with atomic_file(path) as fh:
            fh.write(b"half a picture")
            raise ValueError("unrenderable title")

    monkeypatch.setattr(io, "render_png", broken)
    with pytest.warns(UserWarning, match=r"memory_report\.png'.*ValueError: unrenderable title"):
        write_report(synthetic_report(epochs=2), tmp_path, errors="warn")
    assert (tmp_path / "memory_report.png").read_bytes() == before  # whole: the previous version
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]
    assert len(load_report(tmp_path).epochs) == 2


def test_numpy_values_in_the_report_are_written_as_numbers(tmp_path):
    report = MemoryReport(run={"model_spec": {"n_layers": np.int64(2), "hidden": np.int32(64)}, "ratio": np.float32(0.5),
                               "world_size": np.int64(1)}, epochs=(_epoch(0),))
    write_report(report, tmp_path, png=False, html=False)
    data = json.loads((tmp_path / "memory_report.json").read_text())
    assert data["run"]["model_spec"] == {"n_layers": 2, "hidden": 64} and data["run"]["ratio"] == 0.5
    assert json_default(np.int64(2)) == 2 and type(json_default(np.int64(2))) is int
    with pytest.raises(TypeError):
        json_default(object())


# ------------------------------------------------------------------------------------ 7. runs and the lock
def _write_epochs(folder: str, epochs: list[int]) -> None:
    report = MemoryReport()
    for e in epochs:  # each process keeps only its own epochs in memory: the file must keep everyone's
        report = MemoryReport(epochs=(_epoch(e),))
        write_report(report, folder, png=False, html=False)


def test_two_processes_writing_one_folder_keep_every_epoch(tmp_path):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_write_epochs, args=(str(tmp_path), list(range(k, 40, 2)))) for k in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert [e.epoch for e in load_report(tmp_path).epochs] == list(range(40))
    assert (tmp_path / ".memory_report.lock").is_file()


def test_the_lock_is_exclusive_and_never_opened_through_a_link(tmp_path):
    victim = _victim(tmp_path)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / ".memory_report.lock").symlink_to(victim)
    with folder_lock(tmp_path / "logs", ".memory_report.lock") as held:
        assert held is LockState.UNAVAILABLE and not held  # the link is refused; the block still runs
    assert victim.read_text() == VICTIM_TEXT
    with folder_lock(tmp_path, ".lock") as held:
        assert held
        with folder_lock(tmp_path, ".lock", timeout_s=0.2) as second:
            assert second is LockState.BUSY and not second  # another holder: waits, then says so (never hangs)


def test_a_second_fit_appends_a_run_instead_of_replacing_epoch_0(tmp_path):
    report = MemoryReport().with_epoch(_epoch(0)).with_epoch(_epoch(1))
    write_report(report, tmp_path, png=False)
    report = report.new_run()  # what begin_fit does at the second trainer.fit
    assert report.new_run() is report  # no epoch in the new run yet: still the same run
    report = report.with_epoch(_epoch(0))
    merged, _ = write_report(report, tmp_path, png=False)
    assert [e.key for e in merged.epochs] == [(0, 0), (0, 1), (1, 0)]
    again = load_report(tmp_path)
    assert [e.key for e in again.epochs] == [(0, 0), (0, 1), (1, 0)] and again.current_run == 1
    md = (tmp_path / "memory_report.md").read_text()
    assert "## Epoch 0" in md and "## Epoch 1" in md and "## Run 1, epoch 0" in md
