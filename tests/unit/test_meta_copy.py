"""``meta_copy``: the storage-free stand-in of a module that memplan_auto keeps from before it shards the
module, and that the callback traces to calibrate its estimate. Checked against the module itself: the
same structure, shapes, dtypes, ``requires_grad`` and ties, and the same calibration, coefficient by
coefficient."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_memplan.model.result import COMPONENTS
from lightning_memplan.testing.zoo import GPT, GPTConfig, causal_lm_loss
from lightning_memplan.tracking.meta_copy import meta_copy
from lightning_memplan.tracking.trace import calibrate


class TiedLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(64, 2, 32, 4, max_positions=16, tied_embeddings=True))
        self.model.pos_emb.weight.requires_grad_(False)  # a frozen part
        self.register_buffer("scale", torch.ones(3))

    def training_step(self, batch, batch_idx):
        return causal_lm_loss(self.model, *batch)


def test_the_copy_has_the_structure_and_no_storage() -> None:
    module = TiedLM()
    module._trainer = object()  # type: ignore[assignment] # what a running Trainer leaves on the module
    copy = meta_copy(module)
    ours, theirs = dict(module.named_parameters()), dict(copy.named_parameters())
    assert list(ours) == list(theirs)
    for name, p in theirs.items():
        assert p.device.type == "meta" and isinstance(p, torch.nn.Parameter)
        assert (p.shape, p.dtype, p.requires_grad) == (ours[name].shape, ours[name].dtype, ours[name].requires_grad)
    assert copy.model.lm_head.weight is copy.model.tok_emb.weight  # tied stays tied
    assert copy.scale.device.type == "meta" and module.scale.device.type == "cpu"
    assert copy._trainer is None and module._trainer is not None
    assert all(p.device.type == "cpu" for p in module.parameters())  # the original is untouched
    with pytest.raises(TypeError, match="must be an nn.Module"):
        meta_copy("model")  # type: ignore[arg-type]


def test_the_copy_calibrates_as_the_module_does() -> None:
    def batch(b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 64, (b, s + 1))
        return tokens[:, :-1], tokens[:, 1:]

    module = TiedLM()
    real = calibrate(module, [(2, 12), (4, 12)], input_fn=batch, optimizer="adamw")
    copied = calibrate(meta_copy(module), [(2, 12), (4, 12)], input_fn=batch, optimizer="adamw")
    for phase in real.coefficients:
        for component in COMPONENTS:
            assert copied.bytes_for(phase, component, 3, 16) == real.bytes_for(phase, component, 3, 16), (phase, component)
