"""The ``averaged`` component: a weight-averaging copy counted on its own, in the estimate, the tensor
tracker, the records, the renderers and the metrics, and absent (byte for byte) where there is none."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from lightning_memplan.model.result import COMPONENTS, OPTIONAL_COMPONENTS, MemoryEstimate, shown_components
from lightning_memplan.monitoring.averaged import averaged_copies, copy_bytes, is_averaging_callback
from lightning_memplan.tracking.tracker import TensorTracker


def _estimate(**extra: int) -> MemoryEstimate:
    by_phase = {p: {c: 0 for c in COMPONENTS} | {"params": 100, "activations": 10 * i}
                for i, p in enumerate(("forward", "backward", "optimizer"))}
    return MemoryEstimate(params=100, activations=10, peak_phase="backward", by_phase=by_phase, **extra)


def test_an_estimate_without_a_copy_keeps_the_keys_it_always_had():
    est = _estimate()
    data = est.to_dict()
    assert "averaged" not in data and all("averaged" not in c for c in data["by_phase"].values())
    assert "averaged" not in est.components() and "averaged" not in est.by_phase["forward"]
    assert OPTIONAL_COMPONENTS == {"averaged"} and COMPONENTS[-1] == "averaged"
    # JSON written before the component existed loads, and round-trips to the same text
    old = json.loads(json.dumps(data))
    assert MemoryEstimate.from_dict(old) == est and MemoryEstimate.from_dict(old).to_dict() == data


def test_with_averaged_adds_the_copy_to_every_phase_and_the_peak():
    est = _estimate()
    copied = est.with_averaged(64)
    assert copied.averaged == 64 and copied.total == est.total + 64
    assert all(copied.phase_total(p) == est.phase_total(p) + 64 for p in ("forward", "backward", "optimizer"))
    assert copied.peak_phase == est.peak_phase and copied.components()["averaged"] == 64
    assert copied.with_averaged(0).to_dict() == est.to_dict()  # taking it away gives the same estimate back
    assert MemoryEstimate.from_dict(copied.to_dict()) == copied
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="nbytes"):
            est.with_averaged(bad)  # type: ignore[arg-type]


def test_shown_components_include_averaged_only_when_something_holds_it():
    assert "averaged" not in shown_components({"params": 1, "averaged": 0}, None)
    assert shown_components({"averaged": 5})[-1] == "averaged"


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))


def _nbytes(module: nn.Module) -> int:
    return sum(t.untyped_storage().nbytes() for t in module.state_dict().values())


def test_tracker_counts_an_averaged_submodule_and_a_registered_copy_as_averaged():
    net = _Net()
    net.ema = AveragedModel(net.body)  # kept on the module: module.parameters() yields it too
    outside = AveragedModel(net.body)
    tracker = TensorTracker(net, [])
    tracker.track_copy(outside)
    with tracker:
        tracker.set_phase("forward")
        net.body(torch.randn(4, 8)).sum().backward()
    report = tracker.report()
    own = sum(p.numel() * 4 for p in net.body.parameters())
    assert report.current["params"] == own  # the copies are not parameters of the trained module
    assert report.current["averaged"] == _nbytes(net.ema) + _nbytes(outside)
    plain = TensorTracker(_Net(), []).report()
    assert "averaged" not in plain.peak and "averaged" not in plain.to_dict()["peak"]


class StochasticWeightAveraging:  # stands in for Lightning's callback, matched by name and module
    __module__ = "lightning.pytorch.callbacks.stochastic_weight_avg"

    def __init__(self, module: nn.Module) -> None:
        import copy

        self._average_model = copy.deepcopy(module)
        self.pl_module = module  # a reference to the trained module is not a copy


def test_copies_are_found_on_the_module_in_averaging_callbacks_and_their_attributes():
    net = _Net()
    net.ema = AveragedModel(net.body)
    swa = StochasticWeightAveraging(net)
    user = type("Holder", (), {})()
    user.models = [AveragedModel(net.body)]
    other = type("Other", (), {})()
    other.teacher = nn.Linear(8, 8)  # a module a non-averaging callback holds is not counted
    copies = averaged_copies(net, [swa, user, other])
    assert copies[0] is net.ema and swa._average_model in copies and user.models[0] in copies
    assert other.teacher not in copies and net not in copies
    assert is_averaging_callback(swa) and not is_averaging_callback(other)
    expected = _nbytes(net.ema) + _nbytes(swa._average_model) + _nbytes(user.models[0])
    assert copy_bytes(copies, net, "cpu") == expected
    assert copy_bytes(copies, net, "cuda") == 0  # a copy in host memory adds nothing to a GPU's


def test_a_copy_sharing_the_trained_storage_is_not_counted():
    net = _Net()
    alias = AveragedModel(net.body)
    for a, b in zip(alias.module.parameters(), net.body.parameters(), strict=True):
        a.data = b.data  # the same storage as the trained weights
    assert copy_bytes([alias], net, "cpu") == _nbytes(alias) - sum(p.untyped_storage().nbytes() for p in net.body.parameters())


def test_step_metrics_and_tables_show_averaged_only_with_a_copy():
    from lightning_memplan.monitoring.emit import step_metrics
    from lightning_memplan.report.records import StepRecord

    def record(extra: dict[str, int]) -> StepRecord:
        comps = {"params": 100, "activations": 50, **extra}
        return StepRecord(step=1, epoch=0, rank=0, micro_batch=2, seq_len=8, estimated_peak=sum(comps.values()),
                          measured_peak=sum(comps.values()), estimated_components=comps, measured_components=comps,
                          tracked=True, backend="cpu")

    with_copy = step_metrics(record({"averaged": 64}), "MiB")
    assert with_copy["memplan/averaged/estimated"] == with_copy["memplan/averaged/measured"] == 64
    assert not any("averaged" in k for k in step_metrics(record({}), "MiB"))


def test_report_files_name_averaged_only_when_a_rank_held_it(tmp_path):
    from lightning_memplan.report.io import report_text
    from lightning_memplan.report.records import EpochReport, MemoryReport, RankAccumulator, StepRecord
    from lightning_memplan.report.render import render_markdown

    def report(extra: dict[str, int]) -> MemoryReport:
        comps = {"params": 100, "activations": 50, **extra}
        acc = RankAccumulator(rank=0, epoch=0, backend="cpu")
        acc.add(StepRecord(step=1, epoch=0, rank=0, micro_batch=2, seq_len=8, estimated_peak=sum(comps.values()),
                           measured_peak=sum(comps.values()), estimated_components=comps, measured_components=comps,
                           tracked=True, backend="cpu"))
        return MemoryReport(epochs=(EpochReport(epoch=0, ranks=(acc.summary(),)),))

    plain, copied = report({}), report({"averaged": 64})
    assert json.loads(report_text(plain))["components"] == [c for c in COMPONENTS if c != "averaged"]
    assert json.loads(report_text(copied))["components"] == list(COMPONENTS)
    assert "averaged" not in render_markdown(plain, units="B") and "| averaged |" in render_markdown(copied, units="B")
    assert MemoryReport.from_dict(json.loads(report_text(copied))).epochs[0].ranks[0].measured_components["averaged"] == 64
    # the reader's strict names (report/records.py): an old report's ten components load, a look-alike is refused
    old = json.loads(report_text(plain))
    assert "averaged" not in old["components"] and MemoryReport.from_dict(old).to_dict() == plain.to_dict()
    bad = json.loads(report_text(copied))
    bad["epochs"][0]["ranks"][0]["measured_components"]["Averaged"] = 1
    with pytest.raises(ValueError, match="Averaged"):
        MemoryReport.from_dict(bad)


def test_a_fabric_loop_names_its_copy_with_averaged_models(tmp_path):
    from lightning.fabric import Fabric

    from lightning_memplan.fabric import MemoryMonitor
    from lightning_memplan.testing.zoo import GPT, gpt2_style

    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1)
    model = GPT(gpt2_style(vocab_size=128, n_layers=1, hidden=32, n_heads=2, max_positions=32))
    ema = AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def loss_fn(m, batch):
        return torch.nn.functional.cross_entropy(m.logits(m(batch)).flatten(0, 1), batch.flatten())

    monitor = MemoryMonitor(fabric, model, optimizer, loss_fn=loss_fn, averaged_models=[ema], print_report=False,
                            dirpath=tmp_path, measure_every_n_steps=1)
    for step in range(3):
        batch = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step))
        with monitor.step(batch):
            fabric.backward(loss_fn(model, batch))
            optimizer.step()
            optimizer.zero_grad()
            ema.update_parameters(model)
    steady = [t for t in monitor.end_epoch().ranks[0].tracked if not t.warmup][0]
    assert steady.measured_components["averaged"] == steady.estimated_components["averaged"] == _nbytes(ema)
    assert steady.measured_components["params"] == sum(p.numel() * 4 for p in model.parameters())  # not the copy
    with pytest.raises(TypeError, match="averaged_models"):
        MemoryMonitor(fabric, model, optimizer, averaged_models="ema")
