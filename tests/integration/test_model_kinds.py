"""Model kinds beyond decoder LMs under a real ``Trainer.fit`` with ``MemoryPlanCallback`` (issue 32): RNNs
(LSTM, GRU), BERT-, RoBERTa- and DistilBERT-style encoders with padding masks and -100 MLM labels, T5- and
BART-style encoder-decoders, a ViT and a BatchNorm CNN, audio encoders (wav2vec2 CTC, Whisper), a CLIP
dual encoder and a GroupNorm UNet, all from tiny configs (no download).

For each kind (``lightning_memplan.testing.model_kinds.fit_twice``): the fit with the callback and the
fit without it have bitwise-equal losses, weights (parameters and buffers) and global random states, and no
hook of the callback moves a random state, parameter, buffer, gradient, optimizer state or ``training``
flag; the report's estimate of its steady tracked step is within 5% of its measurement, and that
measurement equals PyTorch's ``MemTracker`` on the same step of the fit without the callback (the
independent reference). The fake-tensor trace of each kind's step equals a real CPU step to the byte (the
fidelity check), and the corrections that make it so (``tracking/fake_fidelity.py``) are shown to be
load-bearing. Calibration points are the callback's own traced shapes of each run; the measured step is
the fit's (held out: the estimate is never fitted to it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_memplan.callbacks import MemoryPlanCallback
from lightning_memplan.testing.model_kinds import StateGuard, fit_twice
from lightning_memplan.tracking.trace import trace_memory

pytestmark = [pytest.mark.hf]

#: Keywords of every fit's MemoryPlanCallback (its defaults, quiet; one kind runs with all defaults).
QUIET = {"print_report": False, "write_files": False}


class Lit(L.LightningModule):
    """A model trained with its own loss (``model(**batch).loss``) or ``loss(model, batch)``."""

    def __init__(self, build: Callable[[], nn.Module], loss: Callable[[nn.Module, Any], torch.Tensor] | None = None):
        super().__init__()
        self.model = build()
        self.loss = loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(self.model, batch) if self.loss is not None else self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _loader(make: Callable[[torch.Generator], Any], n: int = 3) -> Callable[[], DataLoader]:
    def build() -> DataLoader:
        gen = torch.Generator().manual_seed(3)
        return DataLoader([make(gen) for _ in range(n)], batch_size=None)

    return build


def _mlm(vocab: int, b: int = 4, s: int = 24) -> Callable[[torch.Generator], dict]:
    """Masked-LM batches: right-padded rows (attention_mask 0), labels -100 except ~15% of real tokens."""

    def make(gen: torch.Generator) -> dict:
        ids = torch.randint(5, vocab, (b, s), generator=gen)
        mask = torch.ones_like(ids)
        mask[1, s - 6:], mask[3, s // 2:] = 0, 0
        labels = torch.full_like(ids, -100)
        chosen = (torch.rand(ids.shape, generator=gen) < 0.15) & (mask == 1)
        labels[chosen] = ids[chosen]
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return make


def _seq2seq(vocab: int, b: int = 4, s: int = 20, t: int = 12) -> Callable[[torch.Generator], dict]:
    def make(gen: torch.Generator) -> dict:
        ids = torch.randint(5, vocab, (b, s), generator=gen)
        mask = torch.ones_like(ids)
        mask[2, s - 5:] = 0
        labels = torch.randint(5, vocab, (b, t), generator=gen)
        labels[1, t - 3:] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return make


class RNNLM(nn.Module):
    """Embedding, a 2-layer RNN with dropout between layers, a head (next-token loss)."""

    def __init__(self, cell: type[nn.Module], seq: int = 24):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.rnn = cell(16, 32, num_layers=2, batch_first=True, dropout=0.1)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.rnn(self.emb(x))[0]))


def _next_token(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _tokens(s: int) -> Callable[[torch.Generator], tuple]:
    def make(gen: torch.Generator) -> tuple:
        t = torch.randint(0, 64, (4, s + 1), generator=gen)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    return make


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(16, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _classify(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _images(gen: torch.Generator) -> tuple:
    return torch.randn(4, 3, 16, 16, generator=gen), torch.randint(0, 10, (4,), generator=gen)


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.SiLU(),
                                 nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(4, cout), nn.SiLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class UNet(nn.Module):
    """A one-level GroupNorm UNet with a skip connection, trained with MSE (a denoiser's step)."""

    def __init__(self) -> None:
        super().__init__()
        self.down, self.bottom = _Block(3, 8), nn.Sequential(_Block(8, 16), _Block(16, 16))
        self.up, self.merge, self.out = nn.ConvTranspose2d(16, 8, 2, stride=2), _Block(16, 8), nn.Conv2d(8, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.down(x)
        deep = self.bottom(nn.functional.max_pool2d(skip, 2))
        return self.out(self.merge(torch.cat([self.up(deep), skip], 1)))


def _denoise(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _hf(name: str, **config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        transformers = pytest.importorskip("transformers", reason="real Hugging Face models")
        model_cls, config_cls = name.split(":")
        return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))

    return build


_TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
_S2S = {"d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 2,
        "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64}


def _clip_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(**batch, return_loss=True).loss


def _clip_batch(gen: torch.Generator) -> dict:
    return {"input_ids": torch.randint(0, 128, (4, 12), generator=gen),
            "attention_mask": torch.ones(4, 12, dtype=torch.long),
            "pixel_values": torch.randn(4, 3, 16, 16, generator=gen)}


#: ``{kind: (module factory, loader factory)}``: the matrix.
KINDS: dict[str, tuple[Callable[[], L.LightningModule], Callable[[], DataLoader]]] = {
    "lstm": (lambda: Lit(lambda: RNNLM(nn.LSTM), _next_token), _loader(_tokens(24))),
    "gru": (lambda: Lit(lambda: RNNLM(nn.GRU), _next_token), _loader(_tokens(12))),
    "bert": (lambda: Lit(_hf("BertForMaskedLM:BertConfig", vocab_size=128, max_position_embeddings=64, **_TINY)),
             _loader(_mlm(128))),
    "roberta": (lambda: Lit(_hf("RobertaForMaskedLM:RobertaConfig", vocab_size=128, max_position_embeddings=64,
                                **_TINY)), _loader(_mlm(128))),
    "distilbert": (lambda: Lit(_hf("DistilBertForMaskedLM:DistilBertConfig", vocab_size=128, dim=32, n_layers=2,
                                   n_heads=2, hidden_dim=64, max_position_embeddings=64)), _loader(_mlm(128))),
    "t5": (lambda: Lit(_hf("T5ForConditionalGeneration:T5Config", vocab_size=128, d_model=32, d_kv=16, d_ff=64,
                           num_layers=2, num_heads=2, decoder_start_token_id=0)), _loader(_seq2seq(128))),
    "bart": (lambda: Lit(_hf("BartForConditionalGeneration:BartConfig", vocab_size=128, max_position_embeddings=64,
                             **_S2S)), _loader(_seq2seq(128))),
    "vit": (lambda: Lit(_hf("ViTForImageClassification:ViTConfig", image_size=16, patch_size=4, num_labels=10,
                            **_TINY)),
            _loader(lambda gen: {"pixel_values": torch.randn(4, 3, 16, 16, generator=gen),
                                 "labels": torch.randint(0, 10, (4,), generator=gen)})),
    "cnn": (lambda: Lit(CNN, _classify), _loader(_images)),
    "wav2vec2": (lambda: Lit(_hf("Wav2Vec2ForCTC:Wav2Vec2Config", vocab_size=32, conv_dim=(16, 16), conv_stride=(5, 4),
                                 conv_kernel=(10, 8), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
                                 layerdrop=0.0, **_TINY)),
                 _loader(lambda gen: {"input_values": torch.randn(2, 1600, generator=gen),
                                      "labels": torch.randint(1, 32, (2, 10), generator=gen)})),
    "whisper": (lambda: Lit(_hf("WhisperForConditionalGeneration:WhisperConfig", vocab_size=128, num_mel_bins=16,
                                max_source_positions=30, max_target_positions=32, decoder_start_token_id=1,
                                pad_token_id=0, **_S2S)),
                _loader(lambda gen: {"input_features": torch.randn(2, 16, 60, generator=gen),
                                     "labels": torch.randint(2, 128, (2, 10), generator=gen)})),
    "clip": (lambda: Lit(_hf("CLIPModel:CLIPConfig", projection_dim=16,
                             text_config=dict(vocab_size=128, max_position_embeddings=32, **_TINY),
                             vision_config=dict(image_size=16, patch_size=4, **_TINY)), _clip_loss),
             _loader(_clip_batch)),
    "unet": (lambda: Lit(UNet, _denoise), _loader(lambda gen: (torch.randn(2, 3, 16, 16, generator=gen),
                                                                 torch.randn(2, 3, 16, 16, generator=gen)))),
}

#: Kinds whose fake trace cannot run and a real CPU step is measured instead (``fallback_reason``).
REAL_STEP_KINDS = {"wav2vec2": "masked_select"}  # CTC picks its targets by value: a data-dependent size


def _diagnosis(result: Any) -> str:
    return (f"losses {result.losses_with} vs {result.losses_without}; weights_equal={result.weights_equal} "
            f"rng_equal={result.rng_equal}; hooks {result.hook_changes}; notes {result.notes}")


@pytest.mark.parametrize("kind", list(KINDS))
def test_kind_is_estimated_within_5_percent_and_its_run_unchanged(kind: str) -> None:
    make_module, make_loader = KINDS[kind]
    # one kind runs with every default of the callback (report files, the printed table)
    result = fit_twice(make_module, make_loader, steps=3, callback_kwargs=None if kind == "cnn" else QUIET,
                       memtracker=True)
    assert result.losses_equal and result.weights_equal and result.rng_equal, _diagnosis(result)
    assert not result.hook_changes, _diagnosis(result)
    assert result.estimate_source == "calibrated", result.notes
    assert result.measured_peak and result.memtracker_peak, result.notes
    # the callback's measurement against PyTorch's MemTracker on the same step of the run without it
    assert abs(result.measured_peak / result.memtracker_peak - 1) <= 0.005, (result.measured_peak,
                                                                            result.memtracker_peak)
    assert result.error is not None and abs(result.error) <= 0.05, (result.estimated_peak, result.measured_peak,
                                                                    result.notes)


@pytest.mark.parametrize("kind", list(KINDS))
def test_fake_trace_equals_a_real_step(kind: str) -> None:
    """The fidelity check: each phase's peak of the fake-tensor step against a real CPU step."""
    make_module, make_loader = KINDS[kind]
    L.seed_everything(0, verbose=False)
    module, batch = make_module(), next(iter(make_loader()))
    with pytest.warns(RuntimeWarning) if kind in REAL_STEP_KINDS else _nothing():
        fake = trace_memory(module, batch)
    real = trace_memory(module, batch, fake=False)
    if kind in REAL_STEP_KINDS:
        assert fake.mode == "real" and REAL_STEP_KINDS[kind] in (fake.fallback_reason or ""), fake.fallback_reason
    else:
        assert fake.mode == "fake", fake.fallback_reason
    for phase in ("forward", "backward", "optimizer"):
        assert fake.phase_total(phase) == real.phase_total(phase), (phase, fake.by_phase, real.by_phase)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: Any) -> None:
        return None


@pytest.mark.parametrize(("kind", "kernel", "low"), [("lstm", "aten.mkldnn_rnn_layer.default", 0.2),
                                                      ("unet", "aten.mse_loss.default", 0.005)])
def test_the_fake_kernel_corrections_are_what_makes_the_trace_right(kind, kernel, low, monkeypatch) -> None:
    """Without its correction the fake step of the LSTM (oneDNN's workspace) and of the UNet (MSE's
    unreduced storage) reads under the real one; with it, equal (the test above)."""
    from lightning_memplan.tracking import fake_fidelity

    monkeypatch.delitem(fake_fidelity.FAKE_KERNELS, kernel)
    make_module, make_loader = KINDS[kind]
    L.seed_everything(0, verbose=False)
    module, batch = make_module(), next(iter(make_loader()))
    fake, real = trace_memory(module, batch), trace_memory(module, batch, fake=False)
    assert fake.total < (1 - low) * real.total, (fake.total, real.total)


def test_the_harness_catches_a_callback_that_moves_the_run(monkeypatch) -> None:
    """The check can fail: a callback that draws from the global generator at the first batch, flips a
    training flag and nudges a BatchNorm statistic is caught by the losses, the weights and the guard."""

    def rogue(self: Any, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            torch.rand(3)
            pl_module.model.net[1].running_mean.add_(1e-3)
            pl_module.model.net[9].eval()

    monkeypatch.setattr(MemoryPlanCallback, "on_train_batch_start", rogue)
    result = fit_twice(*KINDS["cnn"], steps=2, callback_kwargs=QUIET)
    assert not result.unchanged and not result.losses_equal and not result.weights_equal
    (change,) = result.hook_changes
    assert change.startswith("on_train_batch_start@0") and "rng torch.cpu" in change, change
    assert "buffers net.1.running_mean" in change.replace("model.", "") and "training model.net.9" in change


def test_state_guard_names_what_a_hook_moved() -> None:
    class Rogue(L.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            import random

            import numpy as np

            random.random()
            np.random.rand()
            for group in trainer.optimizers[0].param_groups:
                group["params"][0].grad = None

    rogue = Rogue()
    guard = StateGuard(rogue)
    make_module, make_loader = KINDS["cnn"]
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[rogue])
    trainer.fit(make_module(), make_loader())
    (change,) = guard.changes
    assert "rng python" in change and "rng numpy" in change and "grads model.net.0.weight" in change, change


def test_vit_with_its_token_count_as_seq_len_says_no_tensor_was_resized() -> None:
    """``seq_len=17`` (a 4x4-patch ViT's tokens): no batch tensor has that length, so the calibration says
    so and varies the micro-batch alone -- exact; it used to fit three inconsistent points (6% off)."""
    result = fit_twice(*KINDS["vit"], steps=2, callback_kwargs={**QUIET, "seq_len": 17}, guard=False)
    assert any("no tensor of the batch has a dimension of seq_len=17" in n for n in result.notes), result.notes
    assert result.error is not None and abs(result.error) <= 0.01, (result.estimated_peak, result.measured_peak)


@pytest.mark.parametrize("kind", ["bert", "t5", "vit", "lstm"])
def test_without_calibration_every_kind_says_its_estimate_is_not_to_be_trusted(kind: str) -> None:
    """``calibrate=False``: the analytic terms describe decoder-only language models, and read 17-79 %
    under these kinds' measured peaks; the report says so at the start, before any measurement does (an
    encoder or encoder-decoder by its Hugging Face model, an RNN by its guessed spec)."""
    result = fit_twice(*KINDS[kind], steps=2, callback_kwargs={**QUIET, "calibrate": False}, guard=False)
    assert result.estimate_source == "analytic" and result.unchanged
    assert result.error is not None and result.error < -0.05, result.error  # the reason for the note
    said = [n for n in result.notes if "not a decoder-only" in n or "encoder-decoder model" in n or "guessed" in n]
    assert len(said) == 1 and "pass calibrate=True" in said[0], result.notes


class _Unsalvageable(Lit):
    """A module a calibration cannot copy (it holds a lock): the trace fails before any step."""

    def __init__(self) -> None:
        super().__init__(CNN, _classify)
        self.lock = threading.Lock()


def test_a_failed_calibration_says_the_estimate_is_not_to_be_trusted() -> None:
    result = fit_twice(_Unsalvageable, _loader(_images), steps=2, callback_kwargs=QUIET, guard=False)
    assert result.estimate_source == "analytic" and result.unchanged
    (note,) = [n for n in result.notes if "calibration with a traced step failed" in n]
    assert "do not trust it until a tracked step's measurement agrees" in note, note


class _BranchingLM(RNNLM):
    """Branches on an activation's value: a fake tensor has none, so its calibration measures real CPU
    steps -- the path that drew its batch and its dropout masks from the global generator."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.rnn(self.emb(x))[0]
        if bool(hidden.detach().abs().sum() > 0):
            hidden = self.drop(hidden)
        return self.head(hidden)


def _fabric_losses(monitored: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Three steps of a hand-written Fabric loop, with or without the monitor."""
    from lightning.fabric import Fabric

    from lightning_memplan.fabric import MemoryMonitor

    L.seed_everything(0, verbose=False)
    fabric = Fabric(accelerator="cpu", devices=1)
    module = _BranchingLM(nn.LSTM)
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-3))
    monitor = MemoryMonitor(fabric, model, optimizer, loss_fn=_next_token, print_report=False,
                            write_files=False) if monitored else None
    losses = []
    for batch in _loader(_tokens(24))():
        with monitor.step(batch) if monitor is not None else _nothing():
            loss = _next_token(model, batch)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss.detach()))
    if monitor is not None:
        assert monitor.report.run["estimate_source"] == "calibrated", monitor.report.notes
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_fabric_monitor_leaves_a_dropout_loop_bitwise_unchanged() -> None:
    (with_monitor, weights_with), (without, weights_without) = _fabric_losses(True), _fabric_losses(False)
    assert with_monitor == without
    assert all(torch.equal(weights_with[k], weights_without[k]) for k in weights_without)


class _WaveClassifier(nn.Module):
    """A 1-d convolutional classifier of raw waveforms [b, samples]."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(1, 8, 9, stride=4), nn.GELU(), nn.Conv1d(8, 16, 5, stride=2), nn.GELU(),
                                 nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(16, 4))

    def forward(self, waves: torch.Tensor) -> torch.Tensor:
        return self.net(waves.unsqueeze(1))


@pytest.mark.parametrize("seq_len", [None, 1600])
def test_an_audio_model_per_clip_or_along_its_samples(seq_len: int | None) -> None:
    """s = 1 (a clip, the default) or s = the samples (``seq_len=1600``: the calibration resizes the
    waveform axis). Along the samples the estimate's analytic backward points, which read a guessed
    transformer at s = 1600, are bounded by the traced backward (they were 24x the step)."""
    clips = _loader(lambda gen: (torch.randn(4, 1600, generator=gen), torch.randint(0, 4, (4,), generator=gen)))
    result = fit_twice(lambda: Lit(_WaveClassifier, _classify), clips, steps=2,
                       callback_kwargs={**QUIET, "seq_len": seq_len}, guard=False)
    assert result.unchanged and result.estimate_source == "calibrated", result.notes
    assert result.error is not None and abs(result.error) <= 0.02, (result.estimated_peak, result.measured_peak)
    tracked = result.report.epochs[-1].ranks[0].tracked
    assert {t.seq_len for t in tracked} == {seq_len or 1}
