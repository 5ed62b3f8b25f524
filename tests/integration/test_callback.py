"""MemoryPlanCallback in a real single-device CPU Trainer: metrics, report files, epochs, resume, OOM."""

from __future__ import annotations

import json
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from test_callback_helpers import LitGPT, make_trainer, read_metrics, token_loader

from lightning_memplan.callbacks import MemoryPlanCallback
from lightning_memplan.callbacks.memory_plan import MemoryPlanCallback as _Cls
from lightning_memplan.model.estimate import estimate_memory
from lightning_memplan.model.result import COMPONENTS
from lightning_memplan.model.specs import ParallelPlan, TrainSpec
from lightning_memplan.monitoring.advice import remedy
from lightning_memplan.report import load_report
from lightning_memplan.testing.zoo import gpt2_style

GIB = 2**30


def _documented_keys() -> set[str]:
    """Metric keys spelled out in the class docstring's "Logged metrics" section (expanded braces)."""
    doc = _Cls.__doc__ or ""
    section = doc[doc.index("**Logged metrics**") : doc.index("Args:")]
    keys: set[str] = set()
    listed = re.search(r"``(params, grads[^`]*)``", section).group(1)
    assert tuple(c.strip() for c in listed.split(",")) == COMPONENTS
    for raw in re.findall(r"``(memplan/[^`]+)``", section):
        parts = [raw.replace("<component>", "{" + listed + "}")]
        while any("{" in p for p in parts):
            expanded = []
            for p in parts:
                m = re.search(r"\{([^}]+)\}", p)
                if m is None:
                    expanded.append(p)
                    continue
                expanded += [p[: m.start()] + alt.strip() + p[m.end() :] for alt in m.group(1).split(",")]
            parts = expanded
        keys.update(p for p in parts if "..." not in p and "<" not in p)
    return keys


@pytest.fixture(scope="module")
def two_epoch_run(tmp_path_factory):
    """One 2-epoch run of the GPT-2-style zoo model, every step logged and tracked."""
    root = tmp_path_factory.mktemp("two_epochs")
    torch.manual_seed(0)
    config = gpt2_style()
    cb = MemoryPlanCallback(measure_every_n_steps=1, calibrate=False, print_report=False)
    trainer = make_trainer(root, [cb], max_epochs=2, limit_train_batches=3)
    trainer.fit(LitGPT(config), token_loader(config, 2, [32], 3))
    return trainer, cb, config


def test_logged_metrics_use_the_documented_names(two_epoch_run):
    trainer, _, _ = two_epoch_run
    rows = read_metrics(trainer.log_dir)
    columns = set(rows[0])
    step_keys = {
        "memplan/estimated_peak",
        "memplan/measured_peak",
        "memplan/reserved",
        "memplan/headroom",
        "memplan/measured_to_estimated",
        "memplan/micro_batch",
        "memplan/seq_len",
        "memplan/forward/measured_peak",
        "memplan/backward/measured_peak",
        "memplan/optimizer/measured_peak",
        "memplan/forward/estimated_peak",
        "memplan/params/estimated",
        "memplan/logits/measured",
        "memplan/epoch/measured_peak_max",
        "memplan/epoch/headroom_min",
        "memplan/epoch/ranks",
    }
    assert step_keys <= columns
    documented = _documented_keys()
    assert step_keys <= documented, step_keys - documented
    # Every documented key is really logged (tracked steps log components; CPU logs all of them here), but a
    # weight-averaging copy's, which this run does not keep (tests/unit/test_averaged.py logs it), and the bytes
    # gloo's thread released late, which a one-process run has none of (tests/unit/test_released_late_report.py).
    only_when_present = {"memplan/averaged/estimated", "memplan/averaged/measured", "memplan/released_late"}
    assert documented - only_when_present <= columns, documented - columns
    assert not only_when_present & columns
    # The GiB view is the byte value / 2**30 on the same row.
    measured = [r for r in rows if r["memplan/measured_peak"]]
    assert len(measured) == 6  # 2 epochs x 3 steps, all tracked
    for r in measured:
        assert float(r["memplan/measured_peak_gib"]) == pytest.approx(
            int(r["memplan/measured_peak"]) / GIB, rel=1e-6
        )
        assert int(r["memplan/seq_len"]) == 32 and int(r["memplan/micro_batch"]) == 2
        phases = [int(r[f"memplan/{p}/measured_peak"]) for p in ("forward", "backward", "optimizer")]
        assert max(phases) == int(r["memplan/measured_peak"])


def test_report_files_hold_every_epoch_and_match_the_metrics(two_epoch_run):
    trainer, cb, config = two_epoch_run
    log_dir = Path(trainer.log_dir)
    data = json.loads((log_dir / "memory_report.json").read_text())
    assert [e["epoch"] for e in data["epochs"]] == [0, 1]
    report = load_report(log_dir)
    assert report.to_dict() == cb.report.to_dict()
    rank0 = report.epochs[1].ranks[0]
    assert rank0.steps == 3 and rank0.shapes == ((2, 32),)
    # The estimate recorded is estimate_memory for the inferred specs (computed here independently).
    spec = LitGPT(config).model.spec()
    train = TrainSpec(
        micro_batch=2, seq_len=32, precision="32-true", optimizer="adamw", optimizer_impl="for_loop"
    )
    expected = estimate_memory(spec, train, ParallelPlan(), rank=0)
    assert rank0.estimated_peak == expected.total
    assert rank0.estimated_components == expected.components()
    # The measured epoch peak is the largest per-step measurement logged in that epoch.
    rows = [r for r in read_metrics(log_dir) if r["memplan/measured_peak"]]
    assert rank0.measured_peak == max(int(r["memplan/measured_peak"]) for r in rows[3:])
    assert sum(rank0.measured_components.values()) == rank0.measured_peak  # every step is tracked here
    md = (log_dir / "memory_report.md").read_text()
    assert "## Epoch 0" in md and "## Epoch 1" in md and f"{rank0.estimated_peak / GIB:.3f}" in md
    png = (log_dir / "memory_report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_estimate_tracks_measurement_within_5_percent_at_two_sequence_lengths(tmp_path):
    """Calibrated estimate vs the tensor tracker, zoo models, two sequence lengths in one run."""
    from lightning_memplan.testing.zoo import llama_style, tied_style

    # GPT-2 layout, Llama layout (GQA, SwiGLU, RMSNorm, RoPE), tied embeddings with eager attention
    # (the quadratic [b, a, s, s] term).
    for config in (gpt2_style(), llama_style(), tied_style(attention="eager")):
        torch.manual_seed(0)
        cb = MemoryPlanCallback(measure_every_n_steps=1, print_report=False, write_files=False)
        trainer = make_trainer(
            tmp_path / config.ffn_kind / config.attention, [cb], limit_train_batches=4, logger=False
        )
        trainer.fit(LitGPT(config), token_loader(config, 2, [32, 48], 4))
        assert cb.report.run["estimate_source"] == "calibrated", cb.report.notes
        tracked = [r for r in cb.report.epochs[0].ranks[0].tracked if not r.warmup]
        assert {r.seq_len for r in tracked} == {32, 48}
        for r in tracked:
            assert r.measured_peak == pytest.approx(r.estimated_peak, rel=0.05), (config, r.seq_len, r.ratio)


def test_second_fit_resumed_from_checkpoint_continues_the_report(tmp_path):
    config = gpt2_style()
    torch.manual_seed(0)
    cb1 = MemoryPlanCallback(calibrate=False, print_report=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    t1 = make_trainer(tmp_path, [cb1, ckpt], max_epochs=1, limit_train_batches=2, enable_checkpointing=True)
    t1.fit(LitGPT(config), token_loader(config, 2, [16], 2))
    first = load_report(t1.log_dir)
    assert [e.epoch for e in first.epochs] == [0]

    cb2 = MemoryPlanCallback(calibrate=False, print_report=False)
    t2 = make_trainer(tmp_path, [cb2], max_epochs=2, limit_train_batches=2, enable_checkpointing=True)
    t2.fit(LitGPT(config), token_loader(config, 2, [24], 2), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert t2.log_dir != t1.log_dir  # a new logger version, yet the report continues
    resumed = load_report(t2.log_dir)
    assert [e.epoch for e in resumed.epochs] == [0, 1]
    def without_saves(epoch):
        return {k: v for k, v in epoch.to_dict().items() if k != "checkpoints"}

    assert without_saves(resumed.epochs[0]) == without_saves(first.epochs[0])
    # ModelCheckpoint saved twice (the top-k file, then last.ckpt); a checkpoint holds the records of the
    # saves before it, not of its own save (measured while it is being written)
    assert len(first.epochs[0].checkpoints) == 2
    assert resumed.epochs[0].checkpoints == first.epochs[0].checkpoints[:1]
    assert resumed.epochs[1].ranks[0].shapes == ((2, 24),)
    # The step counter continued: the epoch-1 steps are numbered after the epoch-0 ones.
    assert resumed.epochs[1].ranks[0].worst_step >= 2


def test_simulated_oom_inside_a_step_leaves_a_complete_report(tmp_path):
    config = gpt2_style()
    cb = MemoryPlanCallback(calibrate=False, print_report=False, measure_every_n_steps=1)
    trainer = make_trainer(tmp_path, [cb], max_epochs=2, limit_train_batches=3)
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        trainer.fit(LitGPT(config, fail_at=(1, 1)), token_loader(config, 2, [16, 40], 3))
    report = load_report(Path(trainer.log_dir) / "memory_report.json")
    assert [e.epoch for e in report.epochs] == [0]  # the finished epoch is kept
    (incident,) = report.incidents
    assert incident.kind == "oom" and "simulated" in incident.error
    assert (incident.epoch, incident.step) == (1, 4)  # global step 4 = epoch 1, batch 1
    rec = incident.step_record
    assert (rec.micro_batch, rec.seq_len) == (2, 40)
    spec = LitGPT(config).model.spec()
    train = TrainSpec(
        micro_batch=2, seq_len=40, precision="32-true", optimizer="adamw", optimizer_impl="for_loop"
    )
    assert rec.estimated_peak == estimate_memory(spec, train, ParallelPlan(), rank=0).total
    assert rec.measured_peak is not None and rec.measured_peak > 0  # the tracker saw the forward so far
    assert incident.allocator["rss"] > 0 and "tracker_live_bytes" in incident.allocator
    assert incident.partial_epoch is not None and incident.partial_epoch.steps == 1
    assert "Incident on rank 0" in (Path(trainer.log_dir) / "memory_report.md").read_text()
    # The per-step metrics logged before the failure reached the logger: 3 steps of epoch 0 and 1 of epoch 1.
    logged = [r for r in read_metrics(trainer.log_dir) if r.get("memplan/measured_peak")]
    assert [int(r["memplan/seq_len"]) for r in logged] == [16, 40, 16, 16]
    # The failed step's tracker was removed: a new tensor op is not tracked any more.
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None


def test_warnings_name_the_component_and_the_remedy(tmp_path):
    config = gpt2_style()
    small = gpt2_style(n_layers=1, hidden=32, n_heads=2)  # a wrong, smaller model_spec
    from lightning_memplan.testing.zoo import GPT

    cb = MemoryPlanCallback(
        model_spec=GPT(small).spec(),
        calibrate=False,
        print_report=False,
        write_files=False,
        memory_budget=8 * 2**20,
        max_seq_len=4096,
        measure_every_n_steps=1,
    )
    trainer = make_trainer(tmp_path, [cb], limit_train_batches=3, logger=False)
    with pytest.warns(UserWarning) as caught:
        trainer.fit(LitGPT(config), token_loader(config, 2, [32], 3))
    texts = [str(w.message) for w in caught if "MemoryPlanCallback" in str(w.message)]
    mismatch = [t for t in texts if "above the estimate" in t]
    headroom = [t for t in texts if "headroom" in t and "min_headroom" in t]
    forecast = [t for t in texts if t.startswith("MemoryPlanCallback: forecast: at seq_len=4096")]
    assert len(mismatch) == 1 and "most likely component:" in mismatch[0]
    # The remedy is the decision table's for the largest measured component (here Adam's states, 2x the
    # params): on one device, an 8-bit optimizer first.
    rank0 = cb.report.epochs[0].ranks[0]
    largest = max(rank0.measured_components, key=rank0.measured_components.get)
    assert largest == "optimizer"
    assert len(headroom) == 1 and headroom[0].endswith(
        f"is {largest}: {remedy(largest, ParallelPlan(), None)}"
    )
    assert len(forecast) == 1 and "would run out of memory" in forecast[0]
    # The measured params (the real model) exceed the wrong spec's params the most: the culprit named.
    assert "most likely component: params" in mismatch[0] or "most likely component: optimizer" in mismatch[0]
    assert cb.report.epochs[0].warnings  # and they are kept in the report, at the step that raised them
    assert len(cb.report.epochs[0].warning_steps) == len(cb.report.epochs[0].warnings)
    assert all(0 <= s < 3 for s in cb.report.epochs[0].warning_steps)


def test_inputs_it_cannot_read_are_reported_with_the_argument_that_supplies_them(tmp_path):
    class NoParams(L.LightningModule):
        def training_step(self, batch, batch_idx):
            return None

        def configure_optimizers(self):
            return None

    images = torch.utils.data.TensorDataset(torch.randn(8, 3, 8, 8))
    cb = MemoryPlanCallback(calibrate=False, print_report=False)
    trainer = make_trainer(tmp_path, [cb], limit_train_batches=2)
    with pytest.warns(UserWarning, match="train_spec="):
        trainer.fit(NoParams(), torch.utils.data.DataLoader(images, batch_size=4))
    notes = " ".join(cb.report.notes)
    assert "optimizer_bytes_per_param=" in notes and "model_spec=" in notes and "measurement continues" in notes
    report = load_report(trainer.log_dir)
    rank0 = report.epochs[0].ranks[0]
    assert rank0.steps == 2 and rank0.estimated_peak is None and rank0.reserved > 0
    assert rank0.shapes == ((4, 1),)  # images are fixed-size samples: s = 1, read without seq_len=


def test_nested_batch_containers_are_read(tmp_path):
    """A dict of a tuple of a dict: the token ids are found, the estimate follows the batch shape."""

    class Nested(LitGPT):
        def training_step(self, batch, batch_idx):
            inner = batch["pair"][0]
            return super().training_step((inner["input_ids"], inner["labels"]), batch_idx)

    config = gpt2_style()

    def collate(items):
        idx, tgt = items[0]
        return {"meta": "x", "pair": ({"input_ids": idx, "labels": tgt}, None)}

    cb = MemoryPlanCallback(calibrate=False, print_report=False, write_files=False, measure_every_n_steps=1)
    trainer = make_trainer(tmp_path, [cb], limit_train_batches=2, logger=False)
    loader = torch.utils.data.DataLoader(
        list(token_loader(config, 3, [20], 2)), batch_size=1, collate_fn=collate
    )
    trainer.fit(Nested(config), loader)
    assert cb.report.epochs[0].ranks[0].shapes == ((3, 20),)
    assert not cb.report.notes


def test_logging_follows_log_every_n_steps_plus_tracked_steps(tmp_path):
    config = gpt2_style()
    cb = MemoryPlanCallback(calibrate=False, print_report=False, write_files=False, measure_every_n_steps=3)
    trainer = make_trainer(tmp_path, [cb], limit_train_batches=6, log_every_n_steps=2)
    trainer.fit(LitGPT(config), token_loader(config, 2, [16], 6))
    rows = [r for r in read_metrics(trainer.log_dir) if r.get("memplan/estimated_peak")]
    # batch n is logged when (n + 1) % 2 == 0 (n = 1, 3, 5) or tracked (n = 0, the first steady-state
    # step n = 1, and (n + 1) % 3 == 0: 2, 5); the logged step is the one self.log uses, n (optimizer
    # steps before the batch's own; trainer.global_step would be n + 1).
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3, 5]
    assert [int(r["step"]) for r in rows if r["memplan/measured_peak"]] == [0, 1, 2, 5]
