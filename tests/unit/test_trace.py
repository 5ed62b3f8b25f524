"""trace_memory (fake tensors) against a real CPU step measured by the tracker; calibration."""

from __future__ import annotations

import resource

import pytest
import torch

from lightning_memplan.model.result import COMPONENTS, MemoryEstimate
from lightning_memplan.testing.zoo import GPT, MLPNet, causal_lm_loss, gpt2_style, llama_style, tied_style
from lightning_memplan.tracking.trace import TraceResult, calibrate, default_loss, trace_memory


def _lm_loss(model, idx):
    return causal_lm_loss(model, idx, idx)


@pytest.mark.parametrize(
    ("make", "precision"),
    [
        (lambda: gpt2_style(attention="eager"), "32-true"),
        (llama_style, "bf16-mixed"),
        (tied_style, "bf16-true"),
        (llama_style, "16-mixed"),
    ],
    ids=["gpt2-eager-fp32", "llama-bf16mixed", "tied-bf16true", "llama-16mixed"],
)
def test_fake_trace_matches_real_cpu_step(make, precision: str) -> None:
    model = GPT(make())
    fake = trace_memory(model, batch_shape=(2, 40), loss_fn=_lm_loss, precision=precision)
    real = trace_memory(model, batch_shape=(2, 40), loss_fn=_lm_loss, precision=precision, fake=False)
    assert (fake.mode, real.mode) == ("fake", "real") and fake.fallback_reason is None
    assert abs(fake.total - real.total) <= 0.01 * real.total
    for phase in ("forward", "backward", "optimizer"):
        assert abs(fake.phase_total(phase) - real.phase_total(phase)) <= 0.01 * real.phase_total(phase)
    assert fake.peak_phase == real.peak_phase


def test_trace_model_states_worked_by_hand() -> None:
    model = GPT(llama_style())
    n = model.num_params()
    fp32 = trace_memory(model, batch_shape=(1, 16), loss_fn=_lm_loss)
    forward = fp32.by_phase["forward"]
    # 32-true AdamW: fp32 params, fp32 grads of the previous step alive in forward, two fp32 states per
    # parameter plus one fp32 step counter per parameter tensor
    n_tensors = len(list(model.parameters()))
    assert (forward["params"], forward["grads"]) == (4 * n, 4 * n)
    assert forward["optimizer"] == 8 * n + 4 * n_tensors
    half = trace_memory(model, batch_shape=(1, 16), loss_fn=_lm_loss, precision="bf16-true")
    forward = half.by_phase["forward"]
    # bf16-true: Lightning's HalfPrecision converts the module, so states follow the bf16 params
    # (step counters stay fp32)
    assert (forward["params"], forward["grads"], forward["optimizer"]) == (2 * n, 2 * n, 4 * n + 4 * n_tensors)
    sgd = trace_memory(model, batch_shape=(1, 16), loss_fn=_lm_loss, optimizer="sgd")
    assert sgd.by_phase["optimizer"]["optimizer"] == 0


def test_trace_does_not_touch_the_module_and_allocates_nothing() -> None:
    model = GPT(gpt2_style())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # b*s*V logits alone: 512 * 256 * 512 * 4 bytes = 256 MiB, and twice that for log_softmax
    result = trace_memory(model, batch_shape=(512, 256), loss_fn=_lm_loss)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert result.mode == "fake"
    assert result.by_phase["forward"]["logits"] == 2 * 512 * 256 * 512 * 4
    assert grown_kib < 200 * 1024  # well under the 512 MiB a real step would need
    assert all(p.grad is None for p in model.parameters())
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key])


def test_result_types_and_estimate_view() -> None:
    result = trace_memory(GPT(gpt2_style()), batch_shape=(2, 8), loss_fn=_lm_loss)
    assert isinstance(result, TraceResult) and isinstance(result.estimate, MemoryEstimate)
    assert result.estimate.source == "traced" and (result.micro_batch, result.seq_len) == (2, 8)
    assert result.total == sum(result.components().values()) == max(result.phase_total(p) for p in result.by_phase)
    assert set(result.components()) == set(COMPONENTS) - {"averaged"}  # no weight-averaging copy here


def test_default_loss_and_non_transformer_inputs() -> None:
    mlp = MLPNet(in_features=16, hidden=32, n_layers=2, n_classes=5)
    x, y = mlp.example_batch(4)
    expected = torch.nn.functional.cross_entropy(mlp(x), y)
    torch.testing.assert_close(default_loss(mlp, (x, y)), expected)
    result = trace_memory(mlp, (x, y))
    n = sum(p.numel() for p in mlp.parameters())
    assert result.mode == "fake" and result.micro_batch == 4 and result.seq_len is None
    assert result.by_phase["optimizer"]["params"] == 4 * n
    # the batch (x fp32 [4, 16], y int64 [4]) is counted as other
    assert result.by_phase["forward"]["other"] == 4 * 16 * 4 + 4 * 8


def test_lightning_module_uses_training_step() -> None:
    import lightning as L

    class LitGPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPT(tied_style())

        def training_step(self, batch, batch_idx):
            idx, tgt = batch
            return {"loss": causal_lm_loss(self.model, idx, tgt, loss="fp32_upcast")}

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    idx = torch.randint(0, 512, (2, 16))
    result = trace_memory(LitGPT(), (idx, idx), precision="bf16-mixed")
    assert result.mode == "fake" and result.seq_len == 16
    # autocast makes the logits [2, 16, 512] bf16; the explicit fp32 copy replaces them (the bf16 ones
    # are not saved by the matmul, so they are freed) and log_softmax adds fp32 log-probabilities
    assert result.by_phase["forward"]["logits"] == 2 * 16 * 512 * (4 + 4)
    assert result.by_phase["forward"]["other"] > 0  # autocast's bf16 weight copies


class _DataDependent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y[y > 0].sum()  # boolean indexing: output shape depends on the data


def test_fake_failure_falls_back_to_real_cpu_step() -> None:
    with pytest.warns(RuntimeWarning, match="fell back|instead"):
        result = trace_memory(_DataDependent(), torch.randn(8, 4))
    assert result.mode == "real" and result.fallback_reason
    assert result.by_phase["optimizer"]["params"] == (16 + 4) * 4


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_calibration_exact_at_traced_shapes_and_reproduces_a_new_one(attention: str) -> None:
    model = GPT(llama_style(attention=attention, n_layers=1))
    cal = calibrate(model, [(1, 32), (2, 64)], loss_fn=_lm_loss)
    assert len(cal.traced_shapes) == (3 if attention == "eager" else 2)  # a third shape for b*s^2
    assert cal.n_params == model.num_params() and cal.precision == "32-true"
    # exact at every traced shape, at the moment of each phase where the largest shape peaks (for
    # (1, 32) the backward peak itself is elsewhere: at the end of backward, when gradients dominate)
    moments = trace_memory(model, batch_shape=(2, 64), loss_fn=_lm_loss).report.peak_ops
    for b, s in cal.traced_shapes:
        pinned = trace_memory(model, batch_shape=(b, s), loss_fn=_lm_loss, pin_moments=moments).report.pinned
        for phase in ("forward", "backward", "optimizer"):
            for comp in COMPONENTS:
                assert cal.bytes_for(phase, comp, b, s) == pinned[phase].get(comp, 0), (b, s, phase, comp)
    new = trace_memory(model, batch_shape=(3, 48), loss_fn=_lm_loss)
    for phase in ("forward", "backward", "optimizer"):
        predicted = sum(cal.bytes_for(phase, c, 3, 48) for c in COMPONENTS)
        # exact for sdpa; eager has the [s, s] causal mask, an s^2 term without b (< 0.1% here)
        assert abs(predicted - new.phase_total(phase)) <= 0.001 * new.phase_total(phase), phase


def test_bad_input_raises() -> None:
    model = GPT(gpt2_style())
    with pytest.raises(ValueError, match="exactly one of example_input"):
        trace_memory(model)
    with pytest.raises(ValueError, match="steps=0"):
        trace_memory(model, batch_shape=(1, 8), steps=0)
    with pytest.raises(ValueError, match="precision='fp8'"):
        trace_memory(model, batch_shape=(1, 8), precision="fp8")
    with pytest.raises(ValueError, match="optimizer='rmsprop'"):
        trace_memory(model, batch_shape=(1, 8), optimizer="rmsprop")
    with pytest.raises(ValueError, match="no nn.Embedding"):
        trace_memory(MLPNet(), batch_shape=(1, 8))
    with pytest.raises(ValueError, match="one to 16"):
        calibrate(model, [])
    with pytest.raises(ValueError, match="do not separate"):
        calibrate(model, [(1, 24), (3, 8)], loss_fn=_lm_loss)  # same b*s twice


def test_grads_zeroed_before_forward_matches_memtracker() -> None:
    """A plain loop (zero_grad before forward): trace_memory(grads_alive_in_forward=False) within 0.5%
    of PyTorch's MemTracker on the same real steps, and below Lightning's order by the gradients."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = GPT(gpt2_style())
    idx = torch.randint(0, model.config.vocab_size, (2, 32))
    opt = torch.optim.AdamW(model.parameters(), foreach=False)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model.logits(model(idx)).flatten(0, -2), idx.flatten())
        loss.backward()
        del loss  # as Lightning drops it: the graph is freed before the step
        opt.step()

    step()  # the optimizer states exist from here on: the measured step is the steady state
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    measured = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    plain = trace_memory(model, idx, grads_alive_in_forward=False)
    lightning = trace_memory(model, idx)
    assert abs(plain.total / measured - 1) < 0.005, (plain.total, measured)
    assert lightning.total > plain.total
    with pytest.raises(TypeError, match="grads_alive_in_forward='no'"):
        trace_memory(model, idx, grads_alive_in_forward="no")  # type: ignore[arg-type]


class _TwoTowers(torch.nn.Module):
    """Token ids [b, s] and an image [b, 3, 10, 10]: memory grows with b*s and with b alone."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.conv = torch.nn.Conv2d(3, 32, 3, padding=1)

    def forward(self, ids: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        return self.emb(ids).mean() + self.conv(image).relu().mean()


def test_a_fit_that_misses_the_real_shape_is_refused_with_exact_at() -> None:
    """The least-squares fit through (b, s), (b, 3s/4), (2b, s) cannot describe a b-only term; with
    exact_at=(b, s) the miss is an error naming it (the callback then calibrates along b alone)."""
    from lightning_memplan.live import batch_factory

    batch = (torch.randint(0, 50, (2, 16)), torch.randn(2, 3, 10, 10))
    factory = batch_factory(batch, 2, 16)

    def loss(module: torch.nn.Module, b: tuple) -> torch.Tensor:
        return module(*b)

    shapes = [(2, 16), (2, 12), (4, 16)]
    calibrate(_TwoTowers(), shapes, input_fn=factory, loss_fn=loss)  # a fit, not exact at (2, 16)
    with pytest.raises(ValueError, match=r"misses the traced .* peak at \(2, 16\) by"):
        calibrate(_TwoTowers(), shapes, input_fn=factory, loss_fn=loss, exact_at=(2, 16))
    along_b = calibrate(_TwoTowers(), [(2, 16), (4, 16)], input_fn=factory, loss_fn=loss, exact_at=(2, 16))
    real = trace_memory(_TwoTowers(), batch, loss_fn=loss)
    assert abs(along_b.bytes_for("forward", "activations", 2, 16) - real.by_phase["forward"]["activations"]) <= 1
