"""A monitoring feature never ends the user's run: on a full (64 KiB tmpfs) or read-only log folder a real
``Trainer.fit`` with :class:`MemoryPlanCallback`, and a Fabric loop with :class:`MemoryMonitor`, finish
every step; each report file that cannot be written is a ``UserWarning`` naming it, and no partial or
temporary file is left (each ``memory_report.*`` on disk is a whole version an epoch wrote). The HF trace
cache on a full disk is a ``RuntimeWarning`` and the estimate is still returned.

The folders are real file systems mounted for the test (``mount -t tmpfs``), so the writes fail in the
kernel as they would on a full or read-only disk (``ENOSPC`` part-way through a write, ``EROFS`` at
``mkstemp``); as root ``chmod`` alone would not stop a write. Mounting needs root (``CAP_SYS_ADMIN``) on
Linux: elsewhere, or where the mount is refused (a container without the capability), the tests skip and
say why.

The Trainer runs with ``logger=False`` and reports into ``default_root_dir``: Lightning's own CSVLogger
raises ``OSError: [Errno 28] No space left on device`` from ``CSVLogger.save`` at the end of a fit on a full
disk (its behaviour, not ours), so with it the test would not isolate memplan's writes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from test_callback_helpers import LitGPT, make_trainer, token_loader

from lightning_memplan.callbacks import MemoryPlanCallback
from lightning_memplan.report.html import render_html
from lightning_memplan.report.io import load_report
from lightning_memplan.report.records import MemoryReport
from lightning_memplan.report.render import render_markdown
from lightning_memplan.testing.zoo import GPT, gpt2_style

pytestmark = pytest.mark.hf

FILLER = "filler"
#: What a report folder may hold afterwards: the report files, the writers' lock file and the test's filler.
ALLOWED = {"memory_report.json", "memory_report.md", "memory_report.html", "memory_report.png", ".memory_report.lock", FILLER}
REPORT_WARNING = r"memory report: \d+ file\(s\) could not be written, the run goes on"
EPOCHS, STEPS = 2, 3
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_END = b"IEND\xaeB`\x82"


@contextlib.contextmanager
def _tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``path`` with ``options`` for the block (unmounted after); skips with the reason
    when it cannot be mounted."""
    if not sys.platform.startswith("linux") or shutil.which("mount") is None:
        pytest.skip(f"mounting a tmpfs needs Linux and the mount command (platform {sys.platform!r})")
    if os.geteuid() != 0:
        pytest.skip(f"mounting a tmpfs ({options}) needs root (CAP_SYS_ADMIN): running as uid {os.geteuid()}")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs ({options}) needs root (CAP_SYS_ADMIN): mount said {done.stderr.strip()!r}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)  # busy: detach it anyway


def _fill(folder: Path, leave: int) -> None:
    """Fill ``folder``'s file system with one file until ``leave`` bytes are free (tmpfs counts 4 KiB pages)."""
    info = os.statvfs(folder)
    free = info.f_bavail * info.f_frsize
    with open(folder / FILLER, "wb") as fh:
        try:
            fh.write(b"\0" * max(0, free - leave))
            fh.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    info = os.statvfs(folder)
    assert info.f_bavail * info.f_frsize <= leave


@pytest.fixture
def full_disk(tmp_path) -> Iterator[Path]:
    """A 64 KiB tmpfs with one page (4 KiB) left: the Markdown report fits, the JSON, HTML and PNG stop part-way."""
    with _tmpfs(tmp_path / "full", "size=64k") as folder:
        _fill(folder, 4096)
        yield folder


@pytest.fixture
def read_only(tmp_path) -> Iterator[Path]:
    """A read-only tmpfs (as root, ``chmod`` would not stop a write; a read-only mount does)."""
    with _tmpfs(tmp_path / "ro", "size=1m,ro") as folder:
        with pytest.raises(OSError) as refused:
            (folder / "probe").write_bytes(b"x")
        assert refused.value.errno == errno.EROFS
        yield folder


class _Snapshots(Callback):
    """The callback's report after each epoch's write (placed after it): what a whole file may hold."""

    def __init__(self, cb: MemoryPlanCallback) -> None:
        self.cb, self.reports = cb, []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.reports.append(self.cb.report)


def _assert_no_partial_file(folder: Path, reports: list[MemoryReport], units: str) -> None:
    """Nothing but the report files, the lock and the filler; each report file is one an epoch wrote, whole."""
    names = set(os.listdir(folder))
    assert names <= ALLOWED, f"left behind: {sorted(names - ALLOWED)}"
    assert not [n for n in names if re.search(r"tmp", n)], names
    if "memory_report.json" in names:
        loaded = load_report(folder / "memory_report.json").to_dict()  # parses completely, field by field
        assert loaded in [r.to_dict() for r in reports]
    if "memory_report.md" in names:
        assert (folder / "memory_report.md").read_text() in [render_markdown(r, units=units) for r in reports]
    if "memory_report.html" in names:
        assert (folder / "memory_report.html").read_text() in [render_html(r, units=units) for r in reports]
    if "memory_report.png" in names:
        data = (folder / "memory_report.png").read_bytes()
        assert data.startswith(PNG_SIGNATURE) and data.endswith(PNG_END)


def _fit(folder: Path) -> tuple[L.Trainer, MemoryPlanCallback, _Snapshots]:
    torch.manual_seed(0)
    config = gpt2_style()
    cb = MemoryPlanCallback(measure_every_n_steps=1, calibrate=False, print_report=False)
    snapshots = _Snapshots(cb)
    trainer = make_trainer(
        folder, [cb, snapshots], max_epochs=EPOCHS, limit_train_batches=STEPS, logger=False, default_root_dir=str(folder)
    )
    trainer.fit(LitGPT(config), token_loader(config, 2, [32], STEPS))  # returns: nothing escapes
    return trainer, cb, snapshots


def test_trainer_on_a_full_disk_finishes_with_a_warning_and_no_partial_file(full_disk):
    with pytest.warns(UserWarning, match=REPORT_WARNING) as record:
        trainer, cb, snapshots = _fit(full_disk)
    assert trainer.global_step == EPOCHS * STEPS and trainer.current_epoch == EPOCHS
    assert [e.epoch for e in cb.report.epochs] == list(range(EPOCHS))  # the report is kept in memory
    failed = [str(w.message) for w in record if re.search(REPORT_WARNING, str(w.message))]
    # one warning per epoch end's write (JSON, Markdown) and one for the end of the fit's (all four files)
    assert len(failed) == EPOCHS + 1
    assert all("No space left on device" in m and str(full_disk / "memory_report.json") in m for m in failed)
    _assert_no_partial_file(full_disk, snapshots.reports, cb.units)


def test_trainer_on_a_read_only_folder_finishes_with_a_warning_and_writes_nothing(read_only):
    with pytest.warns(UserWarning, match=REPORT_WARNING) as record:
        trainer, cb, snapshots = _fit(read_only)
    assert trainer.global_step == EPOCHS * STEPS and trainer.current_epoch == EPOCHS
    failed = [str(w.message) for w in record if re.search(REPORT_WARNING, str(w.message))]
    assert len(failed) == EPOCHS + 1 and all("Read-only file system" in m for m in failed)  # epoch ends, fit end
    assert all(str(read_only / f"memory_report.{ext}") in failed[0] for ext in ("json", "md"))
    assert all(str(read_only / f"memory_report.{ext}") in failed[-1] for ext in ("json", "md", "html"))
    assert os.listdir(read_only) == []


def test_fabric_monitor_on_a_full_disk_finishes_with_a_warning_and_no_partial_file(full_disk):
    from lightning.fabric import Fabric

    from lightning_memplan.fabric import MemoryMonitor

    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    model = GPT(gpt2_style())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    model, optimizer = fabric.setup(model, optimizer)

    def loss_fn(model, batch):
        return torch.nn.functional.cross_entropy(model.logits(model(batch[:, :-1])).flatten(0, 1), batch[:, 1:].flatten())

    monitor = MemoryMonitor(
        fabric, model, optimizer, loss_fn=loss_fn, dirpath=full_disk, calibrate=False, print_report=False, units="MiB"
    )
    reports, steps = [], 0
    with pytest.warns(UserWarning, match=REPORT_WARNING) as record:
        for epoch in range(EPOCHS):
            for step in range(STEPS):
                batch = torch.randint(0, gpt2_style().vocab_size, (2, 33), generator=torch.Generator().manual_seed(step))
                with monitor.step(batch):
                    loss = loss_fn(model, batch)
                    fabric.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                steps += 1
            assert monitor.end_epoch().epoch == epoch
            reports.append(monitor.report)
            assert monitor.files is not None and monitor.files.json is None  # the JSON did not fit
    assert steps == EPOCHS * STEPS and len(monitor.report.epochs) == EPOCHS
    failed = [str(w.message) for w in record if re.search(REPORT_WARNING, str(w.message))]
    assert len(failed) == EPOCHS and all("No space left on device" in m for m in failed)
    _assert_no_partial_file(full_disk, reports, "MiB")


def test_hf_trace_cache_on_a_full_disk_warns_and_still_estimates(tmp_path, monkeypatch):
    pytest.importorskip("transformers", reason="the traced config-only path builds the transformers class")
    from transformers import LlamaConfig

    from lightning_memplan.model.estimate import estimate_memory
    from lightning_memplan.model.specs import ModelSpec, TrainSpec
    from lightning_memplan.tracking import hf_cache

    with _tmpfs(tmp_path / "cache", "size=64k") as folder:
        _fill(folder, 0)
        monkeypatch.setenv(hf_cache.CACHE_ENV, str(folder))
        config = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=64, vocab_size=128, rms_norm_eps=1e-5 + 7e-9)  # a key of its own
        spec = ModelSpec.from_hf_config(config)
        with pytest.warns(RuntimeWarning, match="could not write the HF trace cache file") as record:
            estimate = estimate_memory(spec, TrainSpec(micro_batch=1, seq_len=16, precision="32-true", device="cpu"))
        assert estimate.source == "hf_trace" and estimate.total > 0
        # one warning per cache entry the estimate tried to store (one per traced step it needed)
        messages = [str(w.message) for w in record if "HF trace cache" in str(w.message)]
        assert messages
        for message in messages:
            assert str(folder) in message and "No space left on device" in message and "the estimate goes on" in message
        assert os.listdir(folder) == [FILLER]  # no temporary left


def test_enospc_at_fsync_removes_the_temporary_and_keeps_the_previous_files(tmp_path, monkeypatch):
    """A full disk can fail the ``fsync`` after every ``write`` succeeded (delayed allocation, NFS; tmpfs never
    does, so it is injected here, no root needed): the temporary goes, the previous file stays."""
    from lightning_memplan.report.io import write_report

    first = MemoryReport(notes=("first",))
    write_report(first, tmp_path, png=False)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.warns(UserWarning, match=REPORT_WARNING) as record:
        _, written = write_report(MemoryReport(notes=("second",)), tmp_path, png=False, errors="warn")
    assert written.json is None and written.markdown is None and written.html is None
    (message,) = [str(w.message) for w in record]
    assert all(str(tmp_path / f"memory_report.{ext}") in message for ext in ("json", "md", "html"))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temporary, every file as it was
    assert load_report(tmp_path).to_dict() == first.to_dict()
