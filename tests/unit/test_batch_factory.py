"""``batch_factory``: the calibration's batches of other shapes keep the meaning of the real one (issue 32):
ignored labels, masks and their padding runs, segments, class ids, value ranges, dtypes; what is resized
is said; fake batches carry no floating values and keep the integer ones."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from lightning_memplan.live import batch_factory


def _mlm_batch() -> dict:
    gen = torch.Generator().manual_seed(0)
    b, s = 4, 40
    ids = torch.randint(5, 200, (b, s), generator=gen)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, 30:], mask[3, 12:] = 0, 0
    segments = torch.zeros(b, s, dtype=torch.long)
    segments[:, 20:] = 1
    labels = torch.full((b, s), -100)
    chosen = (torch.rand(b, s, generator=gen) < 0.15) & (mask == 1)
    labels[chosen] = ids[chosen]
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": segments, "labels": labels,
            "next_sentence_label": torch.tensor([0, 1, 1, 0])}


@pytest.mark.parametrize(("b", "s"), [(4, 30), (8, 40), (2, 16), (8, 64), (1, 3)])
def test_resized_batches_keep_the_meaning_of_the_real_one(b: int, s: int) -> None:
    real = _mlm_batch()
    out = batch_factory(real, 4, 40)(b, s)
    for key, tensor in out.items():
        assert tensor.dtype == real[key].dtype and tensor.device == real[key].device, key
    assert out["input_ids"].shape == out["labels"].shape == out["attention_mask"].shape == (b, s)
    assert out["next_sentence_label"].shape == (b,)
    # every value is one the real tensor holds: valid class ids stay valid, -100 stays -100
    assert set(out["labels"].unique().tolist()) <= set(real["labels"].unique().tolist())
    assert set(out["input_ids"].unique().tolist()) <= set(real["input_ids"].unique().tolist())
    # ignored labels keep their share (nearest positions: within one position per row of s)
    share = float((real["labels"] == -100).float().mean())
    assert abs(float((out["labels"] == -100).float().mean()) - share) <= 1.5 / s + 0.08
    # masks stay 0/1 with their padding at the end of the same rows; segments stay 0s then 1s
    for row in range(b):
        source = row % 4
        mask, seg = out["attention_mask"][row], out["token_type_ids"][row]
        assert bool((mask[:-1] >= mask[1:]).all()) and bool((seg[:-1] <= seg[1:]).all())
        assert bool(mask.all()) == bool(real["attention_mask"][source].all())
        assert int(seg[0]) == 0 and int(seg[-1]) == 1 if s > 1 else True
        assert out["next_sentence_label"][row] == real["next_sentence_label"][source]


def test_the_factory_says_what_it_resizes() -> None:
    factory = batch_factory(_mlm_batch(), 4, 40)
    assert factory.resized == ("input_ids[0,1]", "attention_mask[0,1]", "token_type_ids[0,1]", "labels[0,1]",
                               "next_sentence_label[0]")
    assert factory.resizes_batch and factory.resizes_seq and factory.batch_only_inputs == ()
    images = {"pixel_values": torch.randn(4, 3, 8, 8), "labels": torch.arange(4)}
    vit = batch_factory(images, 4, 17)  # seq_len= a ViT's token count: no tensor has that length
    assert vit.resized == ("pixel_values[0]", "labels[0]") and not vit.resizes_seq
    assert "dim 0 the micro-batch" in vit.describe()
    clip = batch_factory({"input_ids": torch.zeros(4, 12, dtype=torch.long), "pixel_values": torch.randn(4, 3, 8, 8)},
                         4, 12)
    assert clip.resizes_seq and clip.batch_only_inputs == ("pixel_values",)
    nothing = batch_factory(torch.randn(3, 5), 4, 5)  # no batch dimension of 4 anywhere
    assert not nothing.resizes_batch and "nothing can be resized" in nothing.describe()


def test_inside_a_fake_step_floats_have_no_values_and_integers_keep_theirs() -> None:
    real = _mlm_batch()
    real["pixel_values"] = torch.randn(4, 3, 8, 8)
    factory = batch_factory(real, 4, 40)
    with FakeTensorMode():
        out = factory(8, 30)
        assert all(isinstance(t, FakeTensor) for t in out.values())
        assert out["pixel_values"].constant is None and out["pixel_values"].shape == (8, 3, 8, 8)
        # a check the real step makes on the labels (wav2vec2: labels.max() >= vocab) has its real answer
        assert not bool(out["labels"].max() >= 200) and bool(out["labels"].max() >= 5)
        assert factory.padding_at(8, 30) == {(8, 30): True}
    assert factory.padding_at(2, 40) == {(2, 40): True} and factory.padding_at(1, 40) == {(1, 40): False}
