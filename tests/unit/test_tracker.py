"""TensorTracker against bytes worked by hand on tiny graphs, and against PyTorch's MemTracker."""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from lightning_memplan.testing.zoo import GPT, causal_lm_loss, gpt2_style, llama_style, random_tokens
from lightning_memplan.tracking import PrecisionEmulation, TensorTracker, TrackerReport, run_training_step

FP32 = 4


def _linear_setup():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)  # weight 4x8, bias 4: 36 params
    opt = torch.optim.AdamW(lin.parameters(), foreach=False)
    x = torch.randn(16, 8)
    return lin, opt, x


def _sum_loss(module, batch):
    return module(batch).sum()


def _run_linear(steps: int, precision: str = "32-true") -> TrackerReport:
    lin, opt, x = _linear_setup()
    tracker = TensorTracker(lin, opt)
    with tracker:
        tracker.track(x, "other")
        for _ in range(steps):
            tracker.reset_peaks()
            run_training_step(lin, x, _sum_loss, opt, precision=PrecisionEmulation(precision=precision),
                              on_phase=tracker.set_phase)
    return tracker.report()


def test_linear_adamw_steady_state_worked_by_hand() -> None:
    report = _run_linear(steps=2)
    params = 36 * FP32  # 144
    grads = params  # previous step's grads are alive in forward (Lightning zeroes them after training_step)
    adam = 2 * params + 2 * FP32  # exp_avg + exp_avg_sq + one fp32 step tensor per parameter = 296
    batch = 16 * 8 * FP32  # 512, registered as "other"
    fwd = report.by_phase["forward"]
    # forward: addmm output [16, 4] + the summed loss scalar
    assert fwd == {**dict.fromkeys(fwd, 0), "params": params, "grads": grads, "optimizer": adam,
                   "other": batch, "activations": 16 * 4 * FP32 + FP32}
    bwd = report.by_phase["backward"]
    # backward: old grads freed by zero_grad; new grad W [4, 8] and grad b [4] (resolved to grads),
    # the loss scalar still alive, the ones_like seed gradient in flight
    assert bwd == {**dict.fromkeys(bwd, 0), "params": params, "grads": grads, "optimizer": adam,
                   "other": batch, "activations": FP32, "workspace": FP32}
    opt = report.by_phase["optimizer"]
    # for-loop AdamW: denom = exp_avg_sq.sqrt() / bias_correction2_sqrt: two temporaries of W's size
    assert opt == {**dict.fromkeys(opt, 0), "params": params, "grads": grads, "optimizer": adam,
                   "other": batch, "workspace": 2 * 32 * FP32}
    assert report.peak_phase == "forward" and report.total == sum(fwd.values()) == 1356
    assert report.phase_total("optimizer") == 1352


def test_a_peak_at_a_phase_start_is_named_and_pinnable() -> None:
    """Plain SGD updates in place, so its optimizer phase peaks at its start: the peak is named
    "start" (never an operator of the step before, whose counts reset_peaks restarts), and a pin on
    "start" is taken there (calibrate compares shapes at that moment)."""
    lin, _, x = _linear_setup()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, foreach=False)

    def run(pin):
        tracker = TensorTracker(lin, opt, pin=pin)
        with tracker:
            tracker.track(x, "other")
            for _ in range(2):
                tracker.reset_peaks()
                run_training_step(lin, x, _sum_loss, opt, on_phase=tracker.set_phase)
        return tracker.report()

    report = run(None)
    assert report.peak_ops["optimizer"] == "start"
    at_start = {"params": 36 * FP32, "grads": 36 * FP32, "other": 16 * 8 * FP32}
    assert {c: v for c, v in report.by_phase["optimizer"].items() if v} == at_start
    pinned = run(dict(report.peak_ops)).pinned
    assert set(pinned) == {"forward", "backward", "optimizer"} and pinned["optimizer"] == report.by_phase["optimizer"]


def test_first_step_optimizer_states_resolve_to_optimizer() -> None:
    report = _run_linear(steps=1)
    opt = report.by_phase["optimizer"]
    # AdamW creates every state lazily inside the first step (before the update loop), so at the peak,
    # W's two temporaries, all states exist; they are reported as optimizer (resolved after the step,
    # including the step counters made by torch.tensor outside the dispatcher), temporaries as workspace
    assert opt["optimizer"] == 2 * 36 * FP32 + 2 * FP32
    assert opt["workspace"] == 2 * 32 * FP32
    assert opt["other"] == 16 * 8 * FP32
    assert report.by_phase["forward"]["grads"] == 0  # no gradients exist before the first backward


def test_autocast_weight_copies_are_other() -> None:
    report = _run_linear(steps=2, precision="bf16-mixed")
    fwd = report.by_phase["forward"]
    # bf16 copies of W (32 elements) and b (4) made by autocast (Lightning: cache_enabled=False)
    assert fwd["other"] == 16 * 8 * FP32 + 36 * 2
    # the peak is the addmm: bf16 copy of the input (an activation) and the bf16 output; afterwards the
    # weight copies are freed (x needs no grad, so addmm does not save W's copy) before the bf16 sum
    assert fwd["activations"] == 16 * 8 * 2 + 16 * 4 * 2


def test_views_share_one_storage_and_frees_are_subtracted() -> None:
    tracker = TensorTracker()
    with tracker:
        a = torch.ones(256)
        views = [a.view(16, 16), a[:128], a.t() if a.dim() == 2 else a.unsqueeze(0)]
        assert tracker.report().current["activations"] == 256 * FP32
        b = torch.zeros(100, dtype=torch.float16)
        assert tracker.live_bytes == 256 * FP32 + 200
        del a, views
        assert tracker.live_bytes == 200
        del b
        assert tracker.live_bytes == 0
    assert tracker.report().total == 256 * FP32 + 200


def test_eager_attention_and_logits_classified_by_shape() -> None:
    b, s, a, n_layers, vocab = 2, 24, 4, 2, 512  # s != head_dim (16)
    model = GPT(gpt2_style(attention="eager"))
    idx, tgt = random_tokens(model.config, b, s)
    tracker = TensorTracker(model, seq_len=s)
    with tracker:
        tracker.set_phase("forward")
        loss = causal_lm_loss(model, idx, tgt)
        fwd = dict(tracker.report().by_phase["forward"])
        tracker.set_phase("backward")
        loss.backward()
    # per layer the softmax output [b, a, s, s] fp32 (saved by softmax and by probs @ v) and the
    # bool causal mask [s, s] (saved by masked_fill) survive; scores / scaled / masked copies are freed
    assert fwd["attention"] == n_layers * (b * a * s * s * FP32 + s * s)
    # logits [b, s, V] and log_softmax [b*s, V], both fp32, alive together at the forward peak
    assert fwd["logits"] == 2 * b * s * vocab * FP32
    assert tracker.vocab_size == vocab  # taken from the largest nn.Embedding


@pytest.mark.parametrize(
    ("make", "precision"),
    [(gpt2_style, "32-true"), (lambda: llama_style(attention="eager"), "bf16-mixed"), (llama_style, "bf16-true")],
    ids=["gpt2-fp32", "llama-eager-bf16mixed", "llama-bf16true"],
)
def test_peak_total_equals_pytorch_memtracker(make, precision: str) -> None:
    emulation = PrecisionEmulation(precision=precision)
    idx, tgt = random_tokens(make(), 2, 32)

    def loss_fn(m, batch):
        return causal_lm_loss(m, *batch)

    totals = []
    for use_memtracker in (True, False):
        torch.manual_seed(0)
        model = emulation.convert_module(GPT(make()))
        opt = torch.optim.AdamW(model.parameters())
        if use_memtracker:
            tracker = MemTracker()
            tracker.track_external(model, opt)
            with tracker:
                for _ in range(2):
                    run_training_step(model, (idx, tgt), loss_fn, opt, precision=emulation)
                    tracker.reset_mod_stats()
            totals.append(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
        else:
            ours = TensorTracker(model, opt, seq_len=32)
            with ours:
                for _ in range(2):
                    run_training_step(model, (idx, tgt), loss_fn, opt, precision=emulation, on_phase=ours.set_phase)
            totals.append(ours.report().total)
    assert totals[0] == totals[1] > 0


def test_report_roundtrip_and_estimate_view() -> None:
    report = _run_linear(steps=2)
    again = TrackerReport.from_dict(report.to_dict())
    assert again == report
    est = report.to_estimate()
    assert est.total == report.total and est.source == "measured" and est.phase_total("backward") == report.phase_total(
        "backward"
    )
    assert "optimizer" in report.format_table()


def test_bad_input_raises() -> None:
    with pytest.raises(ValueError, match="seq_len=0"):
        TensorTracker(seq_len=0)
    tracker = TensorTracker()
    with pytest.raises(ValueError, match="phase='fwd'"):
        tracker.set_phase("fwd")
    with pytest.raises(ValueError, match="component='misc'"):
        tracker.track(torch.ones(1), "misc")
    with tracker, pytest.raises(RuntimeError, match="already active"):
        tracker.__enter__()


def test_held_bytes_count_in_every_phase_as_their_component() -> None:
    """``hold`` (DDP's C++-owned gradient buckets, which no Python tensor reaches): the worked linear step
    above plus a held 1,000-byte comm buffer, in every phase and at the peak."""
    lin, opt, x = _linear_setup()
    tracker = TensorTracker(lin, opt)
    tracker.hold(1000, "comm")  # before entry, as the callback registers it
    with tracker:
        tracker.track(x, "other")
        for _ in range(2):
            tracker.reset_peaks()
            run_training_step(lin, x, _sum_loss, opt, on_phase=tracker.set_phase)
    report = tracker.report()
    assert {phase: comps["comm"] for phase, comps in report.by_phase.items()} == dict.fromkeys(report.by_phase, 1000)
    assert report.total == 1356 + 1000 and report.peak["comm"] == 1000
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="nbytes"):
            tracker.hold(bad)
    with pytest.raises(ValueError, match="component"):
        tracker.hold(8, "buckets")
